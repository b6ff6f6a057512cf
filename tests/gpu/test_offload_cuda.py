"""Pinned-memory offload on CUDA: FSDP's ``move_params_to_cpu`` and OffloadModel's CPU tier.

Both keep the master parameters in page-locked CPU memory (so host-to-device copies
can be asynchronous) and compute on the GPU; both must train like the plain model on
the GPU.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardkit.nn import OffloadModel
from tests.gpu import workers
from tests.gpu.common import CUDA, FP32_ATOL, WORLD_SIZES

pytestmark = CUDA


@pytest.mark.parametrize("nesting", ["flat", "block"])
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_fsdp_move_params_to_cpu_pins_shards_and_matches(
    nccl_pool, world_size: int, nesting: str
) -> None:
    cfg = {"nesting": nesting, "fsdp": {"move_params_to_cpu": True}}
    results = nccl_pool(world_size).run(workers.fsdp_parity, cfg)
    for rank, result in enumerate(results):
        assert result["param_devices"] == ["cpu"], f"rank {rank}: shards not on the CPU"
        assert result["all_pinned"], f"rank {rank}: CPU shards feeding CUDA are not pinned"
        assert result["output_device"].startswith("cuda")  # computed on the GPU
        assert result["missing"] == []
        assert result["max_diff"] <= FP32_ATOL, f"rank {rank}: {result['max_diff']:.3g}"


def _tiny(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.LayerNorm(16), nn.Linear(16, 4)
    )


def _train(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), **workers.SGD)
    losses = []
    for _ in range(workers.STEPS):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize(
    ("num_slices", "checkpoint", "microbatches"), [(1, False, 1), (3, False, 1), (3, True, 3)]
)
def test_offload_model_on_cuda_pins_the_cpu_tier_and_matches(
    num_slices: int, checkpoint: bool, microbatches: int
) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    device = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 8, generator=g).to(device), torch.randn(6, 4, generator=g).to(device)
    plain = _tiny().to(device)
    expected = _train(plain, x, y)
    model = _tiny()  # on the CPU: the tier takes its parameters
    names = {id(p): n for n, p in model.named_parameters()}
    om = OffloadModel(
        model,
        device=device,
        num_slices=num_slices,
        checkpoint_activation=checkpoint,
        num_microbatches=microbatches,
    )
    rename = {n: names[id(p)] for n, p in om.named_parameters()}
    losses = _train(om, x, y)
    with torch.no_grad():
        assert om(x).device == device
    for p in om.parameters():  # offloaded between uses: views of the pinned CPU buffers
        assert p.device.type == "cpu" and p.is_pinned()
    state = {rename[k]: v for k, v in om.state_dict().items() if k in rename}
    for name, ref in plain.named_parameters():
        diff = float((state[name].float().cpu() - ref.detach().cpu()).abs().max())
        assert diff <= FP32_ATOL, f"{name}: {diff:.3g}"
    assert losses == pytest.approx(expected, abs=1e-5)
