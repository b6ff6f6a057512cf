"""shardkit.extras: an optional package a feature needs, or one line saying what to install."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from shardkit.extras import MissingDependency, require

ROOT = Path(__file__).resolve().parents[1]


def test_require_returns_the_module() -> None:
    assert require("json", "a feature") is json


def test_require_names_feature_package_and_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingDependency) as caught:
        require("matplotlib", "loss.png")
    missing = caught.value
    assert str(missing) == "loss.png needs matplotlib: pip install matplotlib"
    assert (missing.feature, missing.package, missing.install, missing.name) == (
        "loss.png",
        "matplotlib",
        "pip install matplotlib",
        "matplotlib",
    )
    assert isinstance(missing, ImportError) and isinstance(missing.__cause__, ImportError)
    with pytest.raises(MissingDependency, match=r"^x needs matplotlib: pip install -e '\.\[y\]'$"):
        require("matplotlib", "x", "pip install -e '.[y]'")


@pytest.mark.parametrize("package", ["transformers", "accelerate"])
def test_hf_integration_without_its_extra(package: str) -> None:
    """``import shardkit.integrations.hf`` without transformers or accelerate: one
    MissingDependency naming the package and the ``hf`` extra (accelerate was only
    noticed when the Trainer was built)."""
    code = (
        f"import sys; sys.modules[{package!r}] = None\n"
        "from shardkit.extras import MissingDependency\n"
        "try:\n"
        "    import shardkit.integrations.hf\n"
        "except MissingDependency as missing:\n"
        "    print(repr(str(missing)))\n"
        "import shardkit.integrations  # the package itself needs neither\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == repr(
        f"shardkit.integrations.hf needs {package}: pip install -e '.[hf]'"
    )


def test_the_extras_the_messages_name_are_declared() -> None:
    """The install commands the features print name extras of setup.py that hold the
    package: ``examples`` (matplotlib: the main job's loss.png), ``hf``, ``bench``."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    (extras,) = (
        ast.literal_eval(k.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == "extras_require"
    )
    names = {key: {re.split(r"[=<>!~\[ ]", r)[0] for r in reqs} for key, reqs in extras.items()}
    assert "matplotlib" in names["examples"] and "matplotlib" in names["bench"]
    assert {"transformers", "accelerate"} <= names["hf"]
