"""Tests of the main job (examples/train_gpt.py and its helper modules).

The examples are scripts, not a package: their directory goes on ``sys.path`` here, at
import time, so that spawned test ranks (which import this package to find the test
functions) can import them too.
"""

import sys
from pathlib import Path

EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"
if str(EXAMPLES_DIR) not in sys.path:
    sys.path.insert(0, str(EXAMPLES_DIR))
