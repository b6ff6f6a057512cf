"""ShardedDataParallel + OSS (ZeRO-2): torchrun --standalone --nproc_per_node 2 examples/docs/sharded_ddp.py"""

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn import ShardedDataParallel
from shardkit.optim import OSS


def main(steps: int = 20) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1))
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    model = ShardedDataParallel(model, optimizer)  # in place of DDP(model)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()  # each gradient reduced to the rank that owns it, freed elsewhere
        optimizer.clip_grad_norm(1.0)  # the global norm, not this rank's shard's
        optimizer.step()
        optimizer.zero_grad()  # set_to_none=True (torch's default) is fine
        losses.append(loss.item())
    return losses, model.module.state_dict()


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses, _ = main()
    print(f"rank {dist.get_rank()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
