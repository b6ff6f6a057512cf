"""Run FairScale 0.4.13's own CPU-runnable tests against shardkit; print pass/fail counts.

Usage::

    python -m benchmarks.fairscale_suite /path/to/fairscale-checkout [--files F ...] [-- PYTEST_ARGS]

The checkout is a FairScale source tree at v0.4.13 (its ``tests/`` and
``fairscale/fair_dev/``); nothing of it is copied here. ``import fairscale.X`` in its
tests resolves to ``shardkit.X`` (or the entry of :data:`ALIASES`) through a meta-path
finder; only FairScale's test helpers (``fairscale.fair_dev``, which the tests import
for ``dist_init``, ``DummyProcessGroup``, ...) are loaded from the checkout itself.
Names shardkit does not have resolve to a placeholder that raises when used, so each
test fails on its own instead of a whole file failing to import.

The selection (:data:`SUITE`, 146 tests): OSS, ShardedDDP features, wrap, activation
checkpointing and the single-process Pipe. The result (counts, and every test that did
not pass) is printed and, with ``--out``, written as JSON. The deliberate differences
are listed in docs/migration/fairscale.md.

[Note: why a stub package on disk]
FairScale's multi-process tests start ranks with ``torch.multiprocessing.spawn``: a new
interpreter that unpickles the test function and so imports ``fairscale`` before any code
of ours runs there. A three-line ``fairscale/__init__.py`` in a temporary directory (put
on ``sys.path``, which spawn passes to the children) installs the finder in every process.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

CHECKOUT_ENV = "SHARDKIT_FAIRSCALE_CHECKOUT"

SUITE: tuple[str, ...] = (
    "tests/optim/test_oss.py",
    "tests/nn/data_parallel/test_sharded_ddp_features.py",
    "tests/nn/wrap/test_wrap.py",
    "tests/nn/checkpoint/test_checkpoint_activations.py",
    "tests/nn/pipe/test_pipe.py",
)
"""FairScale's test files that run on CPU and whose subject shardkit implements."""

ALIASES: dict[str, str] = {
    "fairscale.nn.model_parallel": "shardkit.distributed.mpu",
    "fairscale.nn.model_parallel.initialize": "shardkit.distributed.mpu",
    "fairscale.nn.model_parallel.random": "shardkit.nn.tensor_parallel.random",
    "fairscale.nn.checkpoint.checkpoint_activations": "shardkit.nn.checkpoint",
    "fairscale.nn.misc": "shardkit.nn",
    "fairscale.nn.data_parallel.fully_sharded_data_parallel": "shardkit.nn.data_parallel",
    "fairscale.nn.data_parallel.sharded_ddp": "shardkit.nn.data_parallel.sharded_ddp",
}
"""FairScale module -> shardkit module, where the path differs (else ``fairscale.X`` ->
``shardkit.X``)."""


class _Missing:
    """Stands for a FairScale name shardkit lacks; any use raises :class:`NotImplementedError`."""

    def __init__(self, name: str) -> None:
        self._name = name

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{self._name} has no shardkit equivalent")

    __call__ = _fail

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return self._fail()


class _AliasModule(types.ModuleType):
    """``fairscale.X`` as seen by the tests: every attribute read from its shardkit module."""

    def __init__(self, name: str, target: types.ModuleType) -> None:
        super().__init__(name)
        self.__dict__["_target"] = target
        self.__path__: list[str] = []

    def __getattr__(self, attr: str) -> Any:
        target = self.__dict__["_target"]
        if hasattr(target, attr):
            return getattr(target, attr)
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self.__name__}.{attr}")


class _Loader(importlib.abc.Loader):
    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self._module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


def torch_version(version: str = torch.__version__) -> tuple[int, ...]:
    """FairScale's ``fairscale.internal.torch_version``: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``."""
    numbers = version.split("+")[0].split(".")[:3]
    return tuple(int("".join(c for c in n if c.isdigit()) or 0) for n in numbers)


def _internal_module() -> types.ModuleType:
    module = types.ModuleType("fairscale.internal")
    module.torch_version = torch_version  # type: ignore[attr-defined]
    return module


def _shardkit_module(fullname: str) -> types.ModuleType | None:
    if fullname == "fairscale.internal":
        return _internal_module()
    target = ALIASES.get(fullname, "shardkit" + fullname[len("fairscale") :])
    try:
        return importlib.import_module(target)
    except ImportError:
        return None


class FairScaleToShardkit(importlib.abc.MetaPathFinder):
    """Resolves ``fairscale.*`` to shardkit; ``fairscale.fair_dev.*`` from the checkout."""

    def __init__(self, checkout: Path) -> None:
        self.checkout = checkout

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("fairscale."):
            return None
        if fullname.startswith("fairscale.fair_dev"):
            base = self.checkout.joinpath(*fullname.split("."))
            init = base / "__init__.py"
            if init.exists():
                return importlib.util.spec_from_file_location(
                    fullname, init, submodule_search_locations=[str(base)]
                )
            return importlib.util.spec_from_file_location(fullname, base.with_suffix(".py"))
        module = _shardkit_module(fullname)
        alias = _AliasModule(fullname, module if module is not None else types.ModuleType(fullname))
        return importlib.machinery.ModuleSpec(fullname, _Loader(alias), is_package=True)


def install(checkout: str | Path | None = None) -> None:
    """Put :class:`FairScaleToShardkit` first on ``sys.meta_path`` (once per process)."""
    if any(isinstance(f, FairScaleToShardkit) for f in sys.meta_path):
        return
    root = Path(checkout if checkout is not None else os.environ[CHECKOUT_ENV])
    sys.meta_path.insert(0, FairScaleToShardkit(root))


_STUB = "from benchmarks.fairscale_suite import install\n\ninstall()\n"


def _stub_dir() -> Path:
    stub = Path(tempfile.mkdtemp(prefix="fairscale-stub-"))
    (stub / "fairscale").mkdir()
    (stub / "fairscale" / "__init__.py").write_text(_STUB)
    return stub


class _Counter:
    """pytest plugin: the outcome of each test (setup/call/teardown folded into one)."""

    def __init__(self) -> None:
        self.outcomes: dict[str, str] = {}

    def pytest_runtest_logreport(self, report: Any) -> None:
        previous = self.outcomes.get(report.nodeid, "passed")
        if report.when == "call" or report.outcome != "passed":
            outcome = report.outcome if previous == "passed" else previous
            self.outcomes[report.nodeid] = outcome


def run(checkout: Path, files: Sequence[str], pytest_args: Sequence[str]) -> dict[str, str]:
    """Run ``files`` of the checkout under pytest with the alias; return nodeid -> outcome."""
    import pytest

    os.environ[CHECKOUT_ENV] = str(checkout)
    repo_root = str(Path(__file__).resolve().parent.parent)
    stub = _stub_dir()
    for entry in (repo_root, str(stub), str(checkout)):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [repo_root, str(stub), str(checkout), os.environ.get("PYTHONPATH", "")]
    )
    install(checkout)
    counter = _Counter()
    args = [
        *[str(checkout / f) for f in files],
        "--rootdir",
        str(checkout),
        "-p",
        "no:cacheprovider",
        "-q",
        *pytest_args,
    ]
    pytest.main(args, plugins=[counter])
    return counter.outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run the suite, print the counts and the tests that did not pass."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("checkout", type=Path, help="a FairScale source tree at v0.4.13")
    parser.add_argument("--files", nargs="*", default=list(SUITE), help="test files (relative)")
    parser.add_argument("--out", type=Path, default=None, help="write the outcomes as JSON")
    argv = list(sys.argv[1:] if argv is None else argv)
    pytest_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    args = parser.parse_args(argv[: len(argv) - len(pytest_args) - (1 if pytest_args else 0)])
    torch.set_num_threads(1)
    outcomes = run(args.checkout.resolve(), args.files, pytest_args)
    counts: dict[str, int] = {}
    for outcome in outcomes.values():
        counts[outcome] = counts.get(outcome, 0) + 1
    for nodeid, outcome in sorted(outcomes.items()):
        if outcome != "passed":
            print(f"{outcome.upper():8s} {nodeid}")
    ran = len(outcomes) - counts.get("skipped", 0)
    print(
        f"fairscale suite on shardkit: {counts.get('passed', 0)} of {ran} run passed "
        f"({len(outcomes)} collected, {counts.get('skipped', 0)} skipped) {counts}"
    )
    if args.out is not None:
        args.out.write_text(json.dumps({"counts": counts, "outcomes": outcomes}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
