"""A Hugging Face Trainer script, sharded by shardkit with one argument.

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --shardkit fsdp
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py --shardkit sdp --bf16
    torchrun --standalone --nproc_per_node 2 examples/hf_trainer.py            # the Trainer's DDP

A small GPT-2 (byte-level, vocabulary 256: no tokenizer, no download) or
``--model-name-or-path DIR`` learns the Python language reference that ships with
CPython (``pydoc_data.topics``). The only change from a plain Trainer script is the
class, ``ShardkitTrainer(..., shardkit=args.shardkit)`` in place of ``Trainer(...)``.
The model is saved with ``save_model()`` into ``--output-dir``:
``GPT2LMHeadModel.from_pretrained(output_dir)`` loads it on one process. Needs
``pip install -e '.[hf]'``. Guide: ``docs/hf_trainer.md``.
"""

from __future__ import annotations

import argparse

import torch

from shardkit.extras import MissingDependency

try:  # the `hf` extra; without it, one line saying what to install
    from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

    from shardkit.integrations.hf import STRATEGIES, ShardkitTrainer
except ImportError as error:
    missing = MissingDependency(
        "hf_trainer.py", error.name or "transformers", "pip install -e '.[hf]'"
    )
    raise SystemExit(f"hf_trainer.py: error: {missing}") from error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shardkit", choices=STRATEGIES, default=None, help="default: none (DDP)")
    p.add_argument("--model-name-or-path", default=None, help="a directory (default: new GPT-2)")
    p.add_argument("--output-dir", default="runs/hf-trainer")
    p.add_argument("--max-steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    p.add_argument("--seq-len", type=int, default=128, help="bytes per sequence")
    p.add_argument("--gradient-accumulation-steps", type=int, default=1)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast")
    p.add_argument("--resume-from-checkpoint", default=None, help="a checkpoint-<step> directory")
    return p.parse_args(argv)


class ByteWindows(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Consecutive ``seq_len``-byte windows of ``data``; labels = inputs (the model shifts)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[i * self.seq_len : (i + 1) * self.seq_len]
        return {"input_ids": x, "labels": x}


def text_bytes() -> torch.Tensor:
    from pydoc_data.topics import topics

    data = "\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    if args.model_name_or_path:
        model = GPT2LMHeadModel.from_pretrained(args.model_name_or_path)
    else:
        config = GPT2Config(
            vocab_size=256, n_positions=args.seq_len, n_embd=128, n_layer=4, n_head=4
        )
        model = GPT2LMHeadModel(config)
    data = text_bytes()
    split = int(0.95 * len(data))
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=0.01,
        warmup_steps=args.max_steps // 10,
        bf16=args.bf16,
        eval_strategy="steps",
        eval_steps=max(1, args.max_steps // 4),
        logging_steps=max(1, args.max_steps // 10),
        save_steps=max(1, args.max_steps // 2),
        save_total_limit=2,
        report_to=[],
        use_cpu=not torch.cuda.is_available(),
        seed=0,
    )
    trainer = ShardkitTrainer(  # was: Trainer(
        model=model,
        args=training_args,
        train_dataset=ByteWindows(data[:split], args.seq_len),
        eval_dataset=ByteWindows(data[split:], args.seq_len),
        shardkit=args.shardkit,  # the one added argument: "oss", "sdp", "fsdp" or None
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    trainer.save_model()  # every rank: fsdp gathers the full state dict
    if trainer.is_world_process_zero():
        print(f"eval loss {metrics['eval_loss']:.4f}; model saved to {args.output_dir}")


if __name__ == "__main__":
    main()
