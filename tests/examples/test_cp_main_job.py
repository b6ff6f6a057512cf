"""The main job with ``--cp``: each sequence split over the context-parallel ranks
(Ulysses or ring attention), the data-parallel reduction over ``dp x cp``.

One 4-rank spawn runs every config against the ``--cp 1`` run (same global batch):
fsdp at ``--cp 4`` (ring, activation checkpointing) and ``--cp 2 --tp 2`` (ring); sdp at
``--cp 2``, oss at ``--cp 2 --tp 2 --sequence-parallel`` and hsdp at ``--cp 2
--dp-replicate 2``: the first-step loss within 1e-5 and the second (after a step on the
gradients averaged over ``dp x cp``) within 1e-4. A checkpoint written by ddp at
``--cp 2 --tp 2`` (Ulysses on each rank's tensor-parallel heads) after its first step
(within 1e-5) resumes at ``--cp 1`` and ends as the uninterrupted ``--cp 1`` run does.
The context-parallel GPT against the plain GPT at cp = 2 and 4, both methods, and at
cp 2 x tp 2 (Ulysses; ring with sequence parallelism): logits, loss and every
gradient. Bad ``--cp`` flags exit 2 with one line.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import train_gpt
from gpt_context_parallel import apply_context_parallel
from strategies import StrategyConfig, parallel_dims

from shardkit.distributed.mesh import ParallelDims, ProcessMesh
from shardkit.models import GPT, gpt_config
from shardkit.nn import tensor_parallel as tp
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
    # cp x tp: Ulysses on each rank's n_head / tp heads, ring on any; dp x cp reduction
    "fsdp-cp2-tp2-ring": ["--strategy", "fsdp", "--cp", "2", "--tp", "2", "--cp-method", "ring"],
    # the other data-parallel strategies reduce (and shard) over dp x cp too
    "sdp-cp2": ["--strategy", "sdp", "--cp", "2"],  # over the world (dp_cp)
    "oss-cp2-tp2-sp": ["--strategy", "oss", "--cp", "2", "--tp", "2", "--sequence-parallel"],
    "hsdp-cp2": ["--strategy", "hsdp", "--cp", "2", "--dp-replicate", "2", "--cp-method", "ring"],
    # one step at cp 2 x tp 2 (ddp, Ulysses on each rank's 2 heads), resumed at cp 1 tp 1
    "save-cp2": [
        *("--strategy", "ddp", "--cp", "2", "--tp", "2", "--cp-method", "ulysses"),
        *("--save-every", "1"),
    ],
}
#: Runs whose two steps follow the cp 1 run: the first loss is the forward's (1e-5), the
#: second is after one AdamW step on gradients averaged over dp x cp (1e-4).
FOLLOW = ["fsdp-cp4-ring", "fsdp-cp2-tp2-ring", "sdp-cp2", "oss-cp2-tp2-sp", "hsdp-cp2"]


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _run_main(argvs: list[list[str]]) -> list[int]:
    """On each pool rank: the job once per command line; the exit codes. The sample text
    and the loss plot that rank 0 makes after the last step are left out (most of a
    run's time here; this test reads metrics.json, tests/examples/test_train_gpt_outputs.py
    covers them); the patches are undone before the pool's next test."""
    with (
        mock.patch.object(train_gpt, "sample_text", lambda *_: ""),
        mock.patch.object(train_gpt, "plot_metrics", lambda *_: None),
    ):
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
    hsdp = _metrics(tmp_path / "hsdp-cp2")  # shards over cp, replicates over dp_replicate
    assert hsdp["args"]["dp_replicate"] == 2 and hsdp["grad_accum"] == 2, hsdp
    for name in FOLLOW:
        run = _metrics(tmp_path / name)
        assert run["args"]["cp"] > 1 and len(run["train_loss"]) == STEPS, (name, run)
        got, want = run["train_loss"], ref["train_loss"]
        assert abs(got[0][1] - want[0][1]) < 1e-5, (name, got, want)
        assert abs(got[1][1] - want[1][1]) < 1e-4, (name, got, want)
    resumed = _metrics(save)  # the resumed run's metrics carry the cp-2 step before it
    assert resumed["args"]["cp"] == 1 and resumed["start_step"] == 1, resumed
    assert len(resumed["train_loss"]) == STEPS, resumed["train_loss"]
    assert abs(resumed["train_loss"][0][1] - ref["train_loss"][0][1]) < 1e-5, (resumed, ref)
    assert abs(resumed["train_loss"][-1][1] - ref["train_loss"][-1][1]) < 1e-4, (resumed, ref)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cp", "2", "--strategy", "pipe"], "--cp 2 with --strategy pipe is not supported"),
        (["--cp", "2", "--strategy", "offload"], "--cp 2 with --strategy offload is not"),
        (["--cp", "2", "--moe-experts", "2"], "--cp 2 with --moe-experts is not supported"),
        (["--cp", "4", "--tp", "2"], "splits the GPT's 2 heads per --tp rank over 4 ranks"),
        (
            ["--cp", "2", "--tp", "2", "--sequence-parallel", "--seq-len", "34"],
            "splits each rank's 17 tokens over --tp 2",
        ),
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


def test_hsdp_with_cp_shards_over_one_nodes_dp_shard_x_cp(monkeypatch: Any) -> None:
    """hsdp's default shard group is one node's data-parallel ranks: with ``--cp`` it is
    ``dp_shard x cp`` = ``LOCAL_WORLD_SIZE / tp`` ranks, replicated over the nodes."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    dims = parallel_dims(StrategyConfig(name="hsdp", cp=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 2, 2, 1)
    dims = parallel_dims(StrategyConfig(name="hsdp", cp=2, tp=2), 8)
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.tp) == (2, 1, 2, 2)
    with pytest.raises(ValueError, match=r"dp_shard \(3\) x cp \(2\) x tp \(1\) = 6"):
        parallel_dims(StrategyConfig(name="hsdp", cp=2, shard_size=3), 8)


def _gpt_parity(cp: int, method: str, tp_degree: int = 1, sp: bool = False) -> dict[str, float]:
    """The tiny GPT made context parallel over cp groups of ``cp`` ranks (the mesh's
    ``"cp"``), and tensor parallel over ``tp_degree`` ranks (``tp.gpt_plan``, with
    Megatron's sequence parallelism when ``sp``), against the plain GPT on the whole
    sequence: logits gathered over the group, the loss, and every parameter's gradient
    (gathered over ``tp``, averaged over the cp group as the data-parallel reduction
    over ``dp_shard x cp`` does)."""
    torch.manual_seed(0)
    plain = GPT(gpt_config("tiny", block_size=32))
    model = GPT(gpt_config("tiny", block_size=32))
    model.load_state_dict(plain.state_dict())
    mesh = ProcessMesh(ParallelDims(world_size=dist.get_world_size(), cp=cp, tp=tp_degree))
    group = mesh.group("cp")
    apply_context_parallel(model, group, method)
    if tp_degree > 1:  # the tensor-parallel heads: Ulysses splits each rank's n_head / tp
        tp.parallelize(model, tp.gpt_plan(sequence_parallel=sp), process_group=mesh.group("tp"))
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
        grad = q.grad
        if tp.is_tensor_parallel(q):
            grad = tp.full_tensor(grad, q.partition_dim, mesh.group("tp"), q.partition_stride)
        dist.all_reduce(grad, group=group)
        grad_err = max(grad_err, (grad / cp - p.grad).abs().max().item())
    loss_mean = loss.detach().clone()
    dist.all_reduce(loss_mean, group=group)
    mesh.destroy()
    return {
        "logits": (full - want_logits).abs().max().item(),
        "loss": abs(loss_mean.item() / cp - want_loss.item()),
        "grad": grad_err,
    }


def _gpt_parity_all(configs: list[tuple[int, str, int, bool]]) -> list[dict[str, float]]:
    return [_gpt_parity(*config) for config in configs]


def test_context_parallel_gpt_matches_the_plain_gpt(rank_pool: Any) -> None:
    configs = [(2, "ulysses", 1, False), (2, "ring", 1, False), (4, "ulysses", 1, False)]
    configs += [(4, "ring", 1, False), (2, "ulysses", 2, False), (2, "ring", 2, True)]  # x tp
    for rank_results in rank_pool(4).run(_gpt_parity_all, configs):
        for cfg, errs in zip(configs, rank_results, strict=True):
            assert errs["logits"] < 1e-5 and errs["loss"] < 1e-6, (cfg, errs)
            assert errs["grad"] < 1e-6, (cfg, errs)
