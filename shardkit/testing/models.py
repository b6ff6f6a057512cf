"""Deprecated alias of :mod:`shardkit.models.gpt`: import the GPT from ``shardkit.models``.

The main job's GPT moved out of the test harness (it is what the examples train, not a
testing tool). Every name stays importable from here, the same objects, so existing
imports keep working; new code writes ``from shardkit.models import GPT``.
"""

from shardkit.models import gpt as _gpt
from shardkit.models.gpt import *  # noqa: F403  (the deprecated alias: every public name)

__all__ = list(_gpt.__all__)
