"""FSDP (ZeRO-3), one unit per transformer block: torchrun --standalone --nproc_per_node 2 examples/docs/fsdp.py"""

import torch
import torch.distributed as dist

from shardkit.models import GPT, Block, gpt_config
from shardkit.nn import FSDP, auto_wrap, enable_wrap, transformer_auto_wrap_policy


def main(steps: int = 10) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model: torch.nn.Module = GPT(gpt_config("tiny", block_size=32))  # 0.86M params, tied head
    with enable_wrap(wrapper_cls=FSDP, reshard_after_forward=True):
        model = auto_wrap(model, transformer_auto_wrap_policy({Block}))
    model = FSDP(model)  # the root unit: embeddings, tied head, final norm
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)  # build AFTER wrapping
    data = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 256, (4, 33), generator=data)  # one batch, learnt by heart
    losses = []
    for _ in range(steps):
        _, loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()  # gradients reduce-scattered: each rank keeps its shard
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.state_dict()  # full state, original keys, on every rank


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses, _ = main()
    print(f"rank {dist.get_rank()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
