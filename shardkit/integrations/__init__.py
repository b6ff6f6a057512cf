"""Glue to third-party training frameworks; the top layer of shardkit (nothing imports it).

- :mod:`shardkit.integrations.hf`: ``ShardkitTrainer``, a ``transformers.Trainer`` that
  trains with shardkit's OSS, ShardedDataParallel or FSDP by one argument
  (``pip install -e '.[hf]'``; guide: ``docs/hf_trainer.md``).

The sub-modules are imported on demand, so ``import shardkit.integrations`` does not
import transformers.
"""
