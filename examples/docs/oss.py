"""OSS (ZeRO-1) with torch DDP: torchrun --standalone --nproc_per_node 2 examples/docs/oss.py"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit.optim import OSS


def main(steps: int = 20) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)  # the same initial model on every rank
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 1)))
    optimizer = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    data = torch.Generator().manual_seed(dist.get_rank())  # each rank its own batches
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data)
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()  # DDP averages the gradients
        optimizer.step()  # this rank steps its shard, then broadcasts the new values
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, model.module.state_dict()


if __name__ == "__main__":
    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR/PORT
    losses, _ = main()
    print(f"rank {dist.get_rank()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
