"""Optional dependencies: a missing one costs the feature that needs it, never the run.

shardkit installs torch, typing-extensions, tqdm and safetensors (``pip install -e .``).
Everything else is an extra of ``setup.py``: ``hf`` (transformers, accelerate: the
Trainer integration), ``examples`` (matplotlib: the main job's ``loss.png``), ``bench``
(the anchors of ``benchmarks.compare`` and its plots), ``test``, ``dev``, ``docs``. A
feature that needs an extra imports it through :func:`require` (or, where the import must
stay a plain ``from x import Y`` for type checking, raises :class:`MissingDependency` from
the ``ImportError`` of that import); without it, the caller gets a
:class:`MissingDependency` whose message is one line naming the feature and the install
command, and either skips the feature (a plot) or stops with that line (a module that is
nothing without the package).
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingDependency", "require"]


class MissingDependency(ImportError):
    """An optional package a feature needs is not importable.

    ``str()`` is one line: ``"<feature> needs <package>: <install>"``.

    Attributes:
        feature: what cannot run without the package (``"loss.png"``,
            ``"shardkit.integrations.hf"``).
        package: the top-level module that failed to import (``"matplotlib"``).
        install: the command that installs it (``"pip install matplotlib"``).
    """

    def __init__(self, feature: str, package: str, install: str) -> None:
        self.feature = feature
        self.package = package
        self.install = install
        super().__init__(f"{feature} needs {package}: {install}", name=package)


def require(package: str, feature: str, install: str | None = None) -> ModuleType:
    """Import ``package`` for ``feature``, or say in one line what to install.

    Example::

        try:
            require("matplotlib", "loss.png", "pip install -e '.[examples]'")
        except MissingDependency as missing:
            print(f"{missing.feature} skipped: {missing.install}")

    Args:
        package: a module name (``"matplotlib"``, ``"transformers"``).
        feature: what needs it, as the user knows it (a file, a module, a flag).
        install: the command that installs it; default ``pip install <package>``.

    Returns:
        The imported module.

    Raises:
        MissingDependency: ``package`` (or something it imports) cannot be imported;
            the original ``ImportError`` is chained as its cause.
    """
    try:
        return importlib.import_module(package)
    except ImportError as error:
        raise MissingDependency(feature, package, install or f"pip install {package}") from error
