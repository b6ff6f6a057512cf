"""A typical FairScale training script, written the way FairScale's docs and tutorials do.

NOT imported directly (FairScale is not installed): ``test_fairscale_style.py`` reads
this text, changes only the ``fairscale`` import lines to ``shardkit`` and runs the
result on 2 ranks. Everything below the imports is FairScale code as a FairScale user
would have it (the FSDP part runs on CPU, which FairScale's own FSDP does not).
"""

import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from fairscale.nn import Pipe, checkpoint_wrapper
from fairscale.nn.data_parallel import FullyShardedDataParallel as FSDP
from fairscale.nn.data_parallel import ShardedDataParallel as ShardedDDP
from fairscale.nn.wrap import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap
from fairscale.optim.grad_scaler import ShardedGradScaler
from fairscale.optim.oss import OSS
from torch import nn


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
    )


def local_batch(x, y):
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = x.shape[0] // world_size
    return x[rank * rows : (rank + 1) * rows], y[rank * rows : (rank + 1) * rows]


def train_oss_sharded_ddp(batches):
    model = build_model()
    optimizer = OSS(params=model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    model = ShardedDDP(model, optimizer)
    scaler = ShardedGradScaler()
    model.train()
    for x, y in batches:
        x, y = local_batch(x, y)
        model.zero_grad()
        loss = F.mse_loss(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    optimizer.consolidate_state_dict()  # on every rank, before state_dict() on rank 0
    optim_state = optimizer.state_dict() if dist.get_rank() == 0 else None
    return model.module.state_dict(), optim_state


def train_fsdp(batches):
    policy = functools.partial(default_auto_wrap_policy, min_num_params=500)
    with enable_wrap(wrapper_cls=FSDP, flatten_parameters=True, reshard_after_forward=True):
        model = build_model()
        model[4] = wrap(checkpoint_wrapper(model[4]))  # by hand, with checkpointing
        model = auto_wrap(model, auto_wrap_policy=policy)  # the two larger Linears
    model = FSDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        x, y = local_batch(x, y)
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        model.clip_grad_norm_(0.5)
        optimizer.step()
    optim_state = model.gather_full_optim_state_dict(optimizer)  # on rank 0
    return model.state_dict(), optim_state


def train_pipe(batches):
    model = Pipe(build_model(), balance=[2, 3], devices=["cpu", "cpu"], chunks=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in batches:
        optimizer.zero_grad()
        output = model(x)
        loss = F.mse_loss(output, y.to(output.device))
        loss.backward()
        optimizer.step()
    return model.state_dict()
