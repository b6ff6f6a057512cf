"""A 2-stage pipeline, one stage per rank, 1F1B: torchrun --standalone --nproc_per_node 2 examples/docs/pipe.py"""

import torch
import torch.distributed as dist
from torch import nn

from shardkit.nn import PipelineStage, Schedule1F1B
from shardkit.nn.pipe import balance_by_size, consolidated_state_dict, stage_module


def main(steps: int = 20) -> tuple[list[float], dict[str, torch.Tensor] | None]:
    torch.manual_seed(0)  # every rank builds the whole model, keeps its stage
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.Linear(64, 1))
    balance = balance_by_size(dist.get_world_size(), model)  # layers per stage
    stage = PipelineStage(stage_module(model, balance, dist.get_rank()))
    runner = Schedule1F1B(stage, chunks=4, loss_fn=nn.functional.mse_loss)
    optimizer = torch.optim.AdamW(stage.module.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(0)  # the first stage reads x, the last y
    losses = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=data)
        loss = runner.step(x if stage.is_first else None, target=x.sum(1, keepdim=True))
        optimizer.step()
        optimizer.zero_grad()
        if loss is not None:  # the mini-batch loss, on the last stage only
            losses.append(loss.item())
    return losses, consolidated_state_dict(stage.module)  # the whole model, on rank 0


if __name__ == "__main__":
    dist.init_process_group("gloo")
    losses, _ = main()
    if losses:
        print(f"last stage: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    dist.destroy_process_group()
