"""``python -m benchmarks.two_nodes``: :func:`benchmarks.two_nodes.cli.main`."""

import sys

from benchmarks.two_nodes.cli import main

sys.exit(main())
