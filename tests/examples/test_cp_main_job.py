"""The main job with ``--cp``: each sequence split over the context-parallel ranks
(Ulysses or ring attention), the data-parallel reduction over ``dp_shard x cp``.

One 4-rank spawn runs every config: the first-step loss at ``--cp 2`` (ddp, Ulysses)
and ``--cp 4`` (fsdp, ring, activation checkpointing) equals the ``--cp 1`` run's (same global batch) within
1e-5; a checkpoint written at ``--cp 2`` resumes at ``--cp 1`` and ends as the
uninterrupted ``--cp 1`` run does. The context-parallel GPT against the plain GPT at
cp = 2 and 4, both methods: logits, loss and every gradient. Bad ``--cp`` flags exit 2 with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import train_gpt
from gpt_context_parallel import apply_context_parallel

from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.models import GPT, gpt_config
from shardkit.nn.context_parallel import combine_sequence

STEPS = 2
COMMON = [
    *("--model-size", "tiny", "--global-batch", "4", "--batch-size", "1", "--seq-len", "32"),
    *("--eval-batches", "1", "--steps", str(STEPS), "--eval-every", "0", "--save-every", "0"),
    *("--log-every", "0"),
]
RUNS: dict[str, list[str]] = {
    "ddp-cp1": ["--strategy", "ddp"],
    "fsdp-cp4-ring": [
        *("--strategy", "fsdp", "--cp", "4", "--cp-method", "ring"),
        "--activation-checkpointing",  # the ring runs again in the recompute
    ],
    # one step at cp 2, its checkpoint resumed at cp 1
    "save-cp2": ["--strategy", "ddp", "--cp", "2", "--cp-method", "ulysses", "--save-every", "1"],
}


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _run_main(argvs: list[list[str]]) -> list[int]:
    return [train_gpt.main(argv) for argv in argvs]


def test_cp_first_step_loss_equals_cp1_and_resumes_at_cp1(rank_pool: Any, tmp_path: Path) -> None:
    argvs = [[*COMMON, *flags, "--out-dir", str(tmp_path / name)] for name, flags in RUNS.items()]
    save = tmp_path / "save-cp2"
    argvs[-1] += ["--stop-after", "1"]
    argvs.append([*COMMON, "--strategy", "ddp", "--out-dir", str(save), "--resume"])
    assert rank_pool(4).run(_run_main, argvs, timeout_s=300) == [[0] * len(argvs)] * 4
    ref = _metrics(tmp_path / "ddp-cp1")
    assert len(ref["train_loss"]) == STEPS and ref["train_loss"][0][1] > 4.0  # ~ln 256
    ring = _metrics(tmp_path / "fsdp-cp4-ring")
    assert ring["args"]["cp"] == 4 and ring["args"]["cp_method"] == "ring"
    assert ring["args"]["activation_checkpointing"]
    assert abs(ring["train_loss"][0][1] - ref["train_loss"][0][1]) < 1e-5, (ring, ref)
    assert abs(ring["train_loss"][1][1] - ref["train_loss"][1][1]) < 1e-4, (ring, ref)
    resumed = _metrics(save)  # the resumed run's metrics carry the cp-2 step before it
    assert resumed["args"]["cp"] == 1 and resumed["start_step"] == 1, resumed
    assert len(resumed["train_loss"]) == STEPS, resumed["train_loss"]
    assert abs(resumed["train_loss"][0][1] - ref["train_loss"][0][1]) < 1e-5, (resumed, ref)
    assert abs(resumed["train_loss"][-1][1] - ref["train_loss"][-1][1]) < 1e-4, (resumed, ref)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cp", "2", "--strategy", "oss"], "--cp 2 applies to --strategy ddp / fsdp, not 'oss'"),
        (["--cp", "2", "--tp", "2"], "--cp 2 with --tp 2 is not supported"),
        (
            ["--cp", "4", "--cp-method", "ring", "--seq-len", "36"],
            "--seq-len 36 does not split over --cp 4 with --cp-method ring (8 equal chunks)",
        ),
        (["--cp", "8", "--seq-len", "64"], "splits the GPT's 4 attention heads over 8 ranks"),
    ],
)
def test_bad_cp_flags(argv: list[str], message: str) -> None:
    with pytest.raises(train_gpt.InputError, match=message.replace("(", r"\(").replace(")", r"\)")):
        train_gpt.parse_args(argv)


def _gpt_parity(cp: int, method: str) -> dict[str, float]:
    """The tiny GPT made context parallel over cp groups of ``cp`` ranks (the mesh's
    ``"cp"``) against the plain GPT on the whole sequence: logits gathered over the
    group, the loss, and every parameter's gradient (averaged over the cp group, as the
    data-parallel reduction over ``dp_shard x cp`` does)."""
    torch.manual_seed(0)
    plain = GPT(gpt_config("tiny", block_size=32))
    model = GPT(gpt_config("tiny", block_size=32))
    model.load_state_dict(plain.state_dict())
    mesh = ProcessMesh(ParallelDims(world_size=dist.get_world_size(), cp=cp))
    group = mesh.group("cp")
    apply_context_parallel(model, group, method)
    idx = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    want_logits, want_loss = plain(idx, targets=idx)
    logits, loss = model(idx, targets=idx)
    assert logits.shape == (2, 32 // cp, 256)
    assert want_loss is not None and loss is not None
    want_loss.backward()
    loss.backward()
    parts = [torch.empty_like(logits) for _ in range(cp)]
    dist.all_gather(parts, logits.detach().contiguous(), group=group)
    full = combine_sequence(parts, zigzag=method == "ring")
    grad_err = 0.0
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert q.grad is not None and p.grad is not None
        dist.all_reduce(q.grad, group=group)
        grad_err = max(grad_err, (q.grad / cp - p.grad).abs().max().item())
    loss_mean = loss.detach().clone()
    dist.all_reduce(loss_mean, group=group)
    mesh.destroy()
    return {
        "logits": (full - want_logits).abs().max().item(),
        "loss": abs(loss_mean.item() / cp - want_loss.item()),
        "grad": grad_err,
    }


def _gpt_parity_all(configs: list[tuple[int, str]]) -> list[dict[str, float]]:
    return [_gpt_parity(cp, method) for cp, method in configs]


def test_context_parallel_gpt_matches_the_plain_gpt(rank_pool: Any) -> None:
    configs = [(2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring")]
    for rank_results in rank_pool(4).run(_gpt_parity_all, configs):
        for cfg, errs in zip(configs, rank_results, strict=True):
            assert errs["logits"] < 1e-5 and errs["loss"] < 1e-6, (cfg, errs)
            assert errs["grad"] < 1e-6, (cfg, errs)
