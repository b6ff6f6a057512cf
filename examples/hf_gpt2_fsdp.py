"""A Hugging Face GPT-2 trained with shardkit's FSDP, one unit per ``GPT2Block``.

    torchrun --standalone --nproc_per_node 2 examples/hf_gpt2_fsdp.py --steps 50
    torchrun --standalone --nproc_per_node 2 examples/hf_gpt2_fsdp.py --from-pretrained DIR

The model is built from a small ``GPT2Config`` (byte-level, vocabulary 256, so no
tokenizer and no download) or loaded with ``--from-pretrained`` from a local directory
(or a hub name, if the machine can download). Each rank trains on its own random
windows of the Python language reference that ships with CPython. At the end every
rank generates greedily inside ``summon_full_params(recurse=False)`` (the root's full
parameters; the nested units gather themselves one at a time, so the whole model is
never unsharded at once), and rank 0 writes the full state
dict with ``save_pretrained``: ``GPT2LMHeadModel.from_pretrained(out_dir)`` loads it.
Needs ``pip install -e '.[hf]'``.
"""

from __future__ import annotations

import argparse
import os
from typing import cast

import torch
import torch.distributed as dist

from shardkit.extras import MissingDependency
from shardkit.nn import FSDP, auto_wrap, enable_wrap, transformer_auto_wrap_policy

try:  # the `hf` extra; without it, one line saying what to install
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
except ImportError as error:
    missing = MissingDependency(
        "hf_gpt2_fsdp.py", error.name or "transformers", "pip install -e '.[hf]'"
    )
    raise SystemExit(f"hf_gpt2_fsdp.py: error: {missing}") from error


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens (bytes) per sequence")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--from-pretrained", default=None, help="a directory or hub name")
    parser.add_argument("--out-dir", default="runs/hf-gpt2-fsdp")
    return parser.parse_args(argv)


def text_tokens() -> torch.Tensor:
    """The ``pydoc_data.topics`` texts as byte tokens, shape ``(n,)`` int64."""
    from pydoc_data.topics import topics

    data = "\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def build_model(args: argparse.Namespace) -> GPT2LMHeadModel:
    torch.manual_seed(0)  # the same initial model on every rank (FSDP also broadcasts)
    if args.from_pretrained:
        return GPT2LMHeadModel.from_pretrained(args.from_pretrained)
    config = GPT2Config(
        vocab_size=256,
        n_positions=args.seq_len,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_head=4,
        bos_token_id=10,  # newline
        eos_token_id=10,
        pad_token_id=10,
    )
    return GPT2LMHeadModel(config)


def wrap(model: GPT2LMHeadModel) -> FSDP:
    with enable_wrap(wrapper_cls=FSDP, reshard_after_forward=True):
        with_units = auto_wrap(model, transformer_auto_wrap_policy({GPT2Block}))
    return FSDP(with_units)  # the root: tied wte / lm_head, wpe, ln_f


def hf_model(model: FSDP) -> GPT2LMHeadModel:
    """The Hugging Face model inside the root unit (``generate``, ``save_pretrained``)."""
    return cast(GPT2LMHeadModel, model.module)


def train(model: FSDP, args: argparse.Namespace, tokens: torch.Tensor) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)  # after wrapping
    gen = torch.Generator().manual_seed(1000 + dist.get_rank())  # each rank its windows
    losses = []
    for step in range(args.steps):
        starts = torch.randint(0, len(tokens) - args.seq_len, (args.batch_size,), generator=gen)
        batch = torch.stack([tokens[s : s + args.seq_len] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss  # HF shifts the labels
        loss.backward()  # gradients reduce-scattered and averaged over the ranks
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if dist.get_rank() == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step:4d}  loss {loss.item():.3f}", flush=True)
    return losses


def generate(model: FSDP, prompt: bytes, new_tokens: int = 40) -> bytes:
    ids = torch.tensor([list(prompt)])
    new_tokens = min(new_tokens, model.config.n_positions - len(prompt))  # position table
    with model.summon_full_params(recurse=False), torch.no_grad():  # a collective
        # transformers annotates generate() with two self parameters (mypy: misc)
        out = hf_model(model).generate(  # type: ignore[misc]
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False
        )
    return bytes(out[0].tolist())


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    own_group = not dist.is_initialized()
    if own_group:  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    model = wrap(build_model(args))
    losses = train(model, args, text_tokens())
    sample = generate(model, b"The ")
    state = model.state_dict()  # full, original keys; every rank takes part
    if dist.get_rank() == 0:
        print(f"sample: {sample.decode('utf-8', 'replace')!r}")
        # save_pretrained pops the entries of the dict it is given: pass a copy
        hf_model(model).save_pretrained(args.out_dir, state_dict=dict(state))
        print(f"saved to {args.out_dir} (GPT2LMHeadModel.from_pretrained loads it)")
    dist.barrier()
    if own_group:
        dist.destroy_process_group()
    return {"losses": losses, "sample": sample, "state": state}


if __name__ == "__main__":
    main()
