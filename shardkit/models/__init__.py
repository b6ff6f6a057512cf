"""Models that shardkit's examples, benchmarks and tests train (torch only, no wrapper).

:mod:`shardkit.models.gpt`: the GPT-2-style decoder of the main job
(``examples/train_gpt.py``), with named sizes and the helpers the wrappers need (the
model as a sequence of stages; ``param_init_fn`` for a GPT built on the meta device).
"""

from shardkit.models.gpt import (
    GPT,
    MODEL_SIZES,
    AttentionCore,
    Block,
    GPTConfig,
    GPTEmbedding,
    GPTHead,
    gpt_config,
    gpt_init_fn,
    gpt_stages,
    gpt_unit_init_fn,
)

__all__ = [
    "GPT",
    "MODEL_SIZES",
    "AttentionCore",
    "Block",
    "GPTConfig",
    "GPTEmbedding",
    "GPTHead",
    "gpt_config",
    "gpt_init_fn",
    "gpt_stages",
    "gpt_unit_init_fn",
]
