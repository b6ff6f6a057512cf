"""Megatron-LM's sequence parallelism inside tensor parallel (``sequence_parallel=True``
of the column / row-parallel layers, ``gpt_plan(sequence_parallel=True)``), tp = 2 and 4
on one pool of 4 ranks.

TP + SP against TP without SP and against the plain model: the GPT's loss, logits and
every gradient, then the parameters after SGD steps with accumulated micro-batches; one
GPT block on a sequence chunk; the layers alone. The replicated parameters that run on
sequence chunks (LayerNorms, row-parallel biases) get the whole gradient, bitwise the
same on every tensor-parallel rank. The collectives per block are 2 all-gathers and 2
reduce-scatters of b x s x h each way (the bytes of TP's 4 all-reduces); the block saves
(2 + 4 / h) (1 - 1 / tp) b x s x h elements fewer for backward (the LayerNorm inputs
and statistics on chunks).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardkit.nn import tensor_parallel as tp
from shardkit.nn.checkpoint import checkpoint_wrapper
from tests.nn.tensor_parallel import sp_workers as w

DEGREES = [2, 4]
TOL = 1e-5
WORKERS = ("sp_block_parity", "sp_layers", "sp_errors", "sp_communication_count")


def _jobs() -> dict[str, tuple[str, dict[str, Any]]]:
    jobs: dict[str, tuple[str, dict[str, Any]]] = {}
    for t in DEGREES:
        for lp in (False, True):
            jobs[f"gpt-{t}-{lp}"] = ("sp_gpt_parity", {"tp": t, "loss_parallel": lp})
        for name in (*WORKERS, "sp_activation_bytes"):
            jobs[f"{name}-{t}"] = (name, {"tp": t})
    jobs["dropout-2"] = ("sp_dropout", {"tp": 2})
    jobs["checkpointed-4"] = ("sp_checkpointed_dropout", {"tp": 4})
    return jobs


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> dict[str, list[Any]]:
    jobs = _jobs()
    per_rank = rank_pool(4).run(w.run_jobs, list(jobs.values()))
    out = {key: [r[i] for r in per_rank] for i, key in enumerate(jobs)}
    for key, ranks in out.items():
        for rank, r in enumerate(ranks):
            assert "error" not in r, f"{key}, rank {rank}:\n{r['error']}"
    return out


@pytest.mark.parametrize("loss_parallel", [False, True])
@pytest.mark.parametrize("t", DEGREES)
def test_sp_gpt_equals_tp_and_plain(results: Any, t: int, loss_parallel: bool) -> None:
    for rank, r in enumerate(results[f"gpt-{t}-{loss_parallel}"]):
        for key in ("loss_sp_tp", "loss_sp_ref", "logits_sp_tp", "logits_sp_ref"):
            assert r[key] <= TOL, f"rank {rank}: {key} {r[key]:.3e}"
        assert len(r["grads_sp_tp"]) == 2 + 2 + 2 * 12  # every parameter compared
        for ref in ("tp", "ref"):
            for name, d in r[f"grads_sp_{ref}"].items():
                assert d <= TOL, f"rank {rank}: grad of {name} vs {ref} differs by {d:.3e}"
        # after 2 SGD steps of 2 accumulated micro-batches each
        assert r["params_sp_tp"] <= TOL and r["params_sp_ref"] <= TOL, r
        assert r["replicas_agree"] == 1.0, "a LayerNorm / bias gradient differs across tp"
        assert r["ln_class"] == "SequenceParallelLayerNorm"
        assert r["tied"] == 1.0


@pytest.mark.parametrize("t", DEGREES)
def test_sp_block_and_layers(results: Any, t: int) -> None:
    for rank, r in enumerate(results[f"sp_block_parity-{t}"]):
        assert r["out_rows"] == 12 / t  # the block's output is this rank's chunk
        assert r["out"] <= TOL and r["input_grad"] <= TOL, (rank, r)
        assert sorted(r["grads"]) == sorted(
            f"{m}.{p}"
            for m in ("ln_1", "attn.qkv", "attn.proj", "ln_2", "mlp.0", "mlp.2")
            for p in ("weight", "bias")
        )
        for name, d in r["grads"].items():  # LayerNorms: the whole-sequence gradient
            assert d <= TOL, f"rank {rank}: grad of {name} differs by {d:.3e}"
        assert r["replicas_agree"] == 1.0
    for rank, r in enumerate(results[f"sp_layers-{t}"]):
        for key, d in r.items():
            assert d <= TOL, f"rank {rank}: {key} differs by {d:.3e}"


@pytest.mark.parametrize("t", DEGREES)
def test_sp_errors_name_the_sizes(results: Any, t: int) -> None:
    for r in results[f"sp_errors-{t}"]:
        n = 2 * t + 1
        assert r["seq"] == (
            f"ValueError: sequence length {n} (dim 1 of shape (2, {n}, 32)) is not divisible "
            f"by the tensor-parallel degree {t} (sequence parallel splits it into {t} equal "
            f"chunks); pad the sequence to a multiple of {t} or turn sequence_parallel off"
        )
        assert r["row"].startswith("ValueError: RowParallelLinear(sequence_parallel=True) ")
        assert "pass input_is_parallel=True" in r["row"]
        assert r["type"].startswith("TypeError: ") and "'blocks.0.mlp.0', a Linear" in r["type"]
        assert r["after"] == "ok"


@pytest.mark.parametrize("t", DEGREES)
def test_sp_moves_the_bytes_of_tp(results: Any, t: int) -> None:
    """Per block: TP's 2 all-reduces of b x s x h in forward and 2 in backward become 2
    all-gathers + 2 reduce-scatters each way (per rank a ring moves 2 (t-1)/t n for an
    all-reduce of n, (t-1)/t n for each of the others). Outside the blocks: the embedding's
    all-reduce stays, the LM head's input all-gather (forward) and reduce-scatter
    (backward) replace its backward all-reduce, the scatter after the embedding adds a
    backward all-gather; the LayerNorm and row-bias gradients are all-reduced (6 h per
    block, 2 h for ln_f)."""
    layers, h = w.TINY["n_layer"], w.TINY["n_embd"]
    bsh, logits = w.BATCH * w.SEQ * h, w.BATCH * w.SEQ * w.TINY["vocab_size"] // t
    counts = results[f"sp_communication_count-{t}"][0]
    assert counts["sp=False"] == {
        "forward all_reduce": [bsh] * (2 * layers + 1),
        "forward all_gather": [logits],
        "backward all_reduce": [bsh] * (2 * layers + 1),
    }
    assert counts["sp=True"] == {
        "forward all_reduce": [bsh],
        "forward all_gather_single": [bsh] * (2 * layers + 1),
        "forward reduce_scatter_single": [bsh] * (2 * layers),
        "forward all_gather": [logits],
        "backward reduce_scatter_single": [bsh] * (2 * layers + 1),
        "backward all_gather_single": [bsh] * (2 * layers + 1),
        "backward all_reduce": [h] * (6 * layers + 2),
    }


@pytest.mark.parametrize("t", DEGREES)
def test_sp_block_saves_less_for_backward(results: Any, t: int) -> None:
    """The LayerNorms' inputs (b x s x h each) and statistics (2 x b x s each) are kept
    for their chunk only: (2 + 4 / h) (1 - 1 / t) b x s x h fp32 elements fewer."""
    h, bs = w.TINY["n_embd"], w.BATCH * w.SEQ
    for r in results[f"sp_activation_bytes-{t}"]:
        assert r["tp"] - r["sp"] == 4 * (2 * bs * h + 4 * bs) * (t - 1) // t, r
        assert r["sp"] < r["tp"] < r["plain"]


def test_sp_dropout_streams(results: Any) -> None:
    """Dropout on sequence chunks: independent masks per tensor-parallel rank from the
    tracker's stream; the default stream stays in step; no seed: the tracker's error."""
    for r in results["dropout-2"]:
        assert "call model_parallel_manual_seed(seed) first" in r["missing"]
        assert r["masks_differ"] == 1.0
        assert 0.4 < r["drop_rate"] < 0.6
        assert r["tracker_advanced"] == 1.0 and r["default_same"] == 1.0


def test_sp_dropout_under_activation_checkpointing(results: Any) -> None:
    """Forked dropout in checkpointed blocks: the recompute draws the forward's masks,
    so checkpointing changes neither the losses nor the gradients nor the tracker."""
    for r in results["checkpointed-4"]:
        assert r["loss"] == 0.0 and r["grads"] <= 1e-7 and r["n_grads"] == 1.0, r
        assert r["tracker"] == 1.0, r


def _forked_dropout_grads(checkpoint: str) -> tuple[torch.Tensor, ...]:
    """One process, no group: a Linear and two forked dropouts, checkpointed as
    ``checkpoint`` says ("none", "outer", "nested"), two backward passes; the last
    output, the input's gradient and the tracker's state."""
    torch.manual_seed(0)
    inner = tp.parallelize(
        nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5)),
        {"1": tp.SequenceParallel(fork_rng=True)},
        None,
    )
    model: nn.Module = nn.Sequential(
        checkpoint_wrapper(inner) if checkpoint == "nested" else inner, nn.Dropout(0.5)
    )
    model = tp.parallelize(model, {"1": tp.SequenceParallel(fork_rng=True)}, None)
    if checkpoint != "none":
        model = checkpoint_wrapper(model)
    tp.model_parallel_manual_seed(3)
    x = torch.ones(4, 8, requires_grad=True)
    for _ in range(2):
        out = model(x)
        out.sum().backward()
    assert x.grad is not None
    return out, x.grad, tp.get_rng_tracker().get_states()["model-parallel-rng"]["cpu"]


def test_tracker_fork_replays_in_nested_recomputes() -> None:
    plain_out, plain_grad, plain_state = _forked_dropout_grads("none")
    assert 0.5 < float((plain_out == 0).float().mean()) < 0.9  # both dropouts drew
    for mode in ("outer", "nested"):
        out, grad, state = _forked_dropout_grads(mode)
        assert torch.equal(out, plain_out), mode
        assert torch.equal(grad, plain_grad), mode
        assert torch.equal(state, plain_state), mode
