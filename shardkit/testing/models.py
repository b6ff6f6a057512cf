"""Deprecated alias of :mod:`shardkit.models.gpt`: import the GPT from ``shardkit.models``.

The main job's GPT moved out of the test harness (it is what the examples train, not a
testing tool). Every name stays importable from here, the same objects, so existing
imports keep working; the first one read raises one ``DeprecationWarning`` per process
(:func:`shardkit.deprecation.moved_names`). New code writes
``from shardkit.models import GPT``.
"""

from shardkit.deprecation import moved_names
from shardkit.models import gpt as _gpt

__all__ = list(_gpt.__all__)

__getattr__ = moved_names(__name__, dict.fromkeys(_gpt.__all__, "shardkit.models"))
