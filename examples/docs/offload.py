"""OffloadModel, disk tier, data parallel: torchrun --standalone --nproc_per_node 2 examples/docs/offload.py"""

import tempfile

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn import OffloadModel


def main(steps: int = 20) -> tuple[list[float], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(4)]
    directory = tempfile.TemporaryDirectory()  # one per rank; a fast local disk in practice
    model = OffloadModel(
        nn.Sequential(*layers, nn.Linear(32, 1)),
        "cpu",
        offload_dir=directory.name,  # parameters, gradients, optimizer state in files
        num_slices=3,  # one slice in memory at a time
        checkpoint_activation=True,
        process_group=dist.group.WORLD,  # average gradients over the ranks
    )
    optimizer = model.sliced_optimizer(torch.optim.AdamW, lr=1e-2)  # steps slice by slice
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        optimizer.step()  # commits the next generation of files atomically
        losses.append(loss.item())
    state = model.state_dict()  # read back one slice at a time
    directory.cleanup()
    return losses, state


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses, _ = main()
    print(f"rank {dist.get_rank()}: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
