"""Deprecated alias of :mod:`shardkit.models.gpt`: import the GPT from ``shardkit.models``.

The main job's GPT moved out of the test harness (it is what the examples train, not a
testing tool). Every name stays importable from here, the same objects, so existing
imports keep working; the first one read raises one ``DeprecationWarning`` per process
(:func:`shardkit.deprecation.moved_names`). New code writes
``from shardkit.models import GPT``.
"""

from shardkit.deprecation import moved_names

# each name this old path still serves -> the canonical module (a literal dict:
# tools/api_table.py reads it without importing)
_TARGETS = {
    "AttentionCore": "shardkit.models",
    "GPT": "shardkit.models",
    "MODEL_SIZES": "shardkit.models",
    "Block": "shardkit.models",
    "GPTConfig": "shardkit.models",
    "GPTEmbedding": "shardkit.models",
    "GPTHead": "shardkit.models",
    "gpt_config": "shardkit.models",
    "gpt_init_fn": "shardkit.models",
    "gpt_stages": "shardkit.models",
    "gpt_unit_init_fn": "shardkit.models",
}

__all__ = sorted(_TARGETS)

__getattr__ = moved_names(__name__, _TARGETS)
