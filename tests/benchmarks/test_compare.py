"""benchmarks.compare on 2 ranks: every built-in strategy's step, bytes and counted traffic,
checked against the ZeRO formulas (the estimator at small scale) and the comm theory."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks.comm import theory_volume_bytes
from benchmarks.compare import (
    error_line,
    model_config,
    num_params,
    parse_args,
    rotated,
    run_config,
    write_outputs,
)
from benchmarks.report import render_markdown, summarize, write_plots
from benchmarks.runners import BY_NAME, STRATEGIES, available
from shardkit.memory import zero_memory_estimate
from shardkit.models import GPTConfig
from shardkit.testing import RankError, RankPool

CONFIG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=2, n_embd=64)
PSI = num_params(CONFIG)  # 0.12M: tied embedding 256 x 64 is the largest tensor
WORLD = 2
STEPS = 2
# the "+ compile" rows compile with inductor (minutes): not run here, see tests/compile
BUILT_IN = [s.name for s in STRATEGIES if s.requires is None and s.compiled_from is None]
# initialised slice by slice / unit by unit: other initial weights than GPT(config)
OWN_INIT = (
    "shardkit offload (disk)",
    "shardkit fsdp (meta init)",
    "shardkit hsdp (meta init)",
)
UNITS = CONFIG.n_layer + 1  # FSDP: one unit per Block + the root


def _run_all(specs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [run_config(spec) for spec in specs]


@pytest.fixture(scope="module")
def measured(
    rank_pool: Callable[[int], RankPool], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, list[dict[str, Any]]]:
    offload_dir = str(tmp_path_factory.mktemp("offload"))
    base = {"model": asdict(CONFIG), "batch": 2, "steps": STEPS, "warmup": 1, "chunks": 2}
    specs = [{**base, "strategy": n, "offload_dir": offload_dir} for n in BUILT_IN]
    per_rank = rank_pool(WORLD).run(_run_all, specs, timeout_s=240)
    return {name: [per_rank[r][i] for r in range(WORLD)] for i, name in enumerate(BUILT_IN)}


def _per_step(result: dict[str, Any], kind: str) -> float:
    return result["comm"]["payload_bytes"].get(kind, 0) / STEPS


def test_every_strategy_times_steps_and_measures_rss(
    measured: dict[str, list[dict[str, Any]]],
) -> None:
    for name, ranks in measured.items():
        for r in ranks:
            assert len(r["times"]) == STEPS and min(r["times"]) > 0, name
            assert r["rss_peak"] >= r["rss_start"] > 0, name
            # the peak of every step (VmHWM reset before each): warm-up + timed steps
            assert len(r["rss_steps"]) == 1 + STEPS and r["rss_steps_kind"] == "per step"
            assert min(r["rss_steps"]) > 0 and max(r["rss_steps"]) <= r["rss_peak"], name
        assert ranks[0]["times"] == ranks[1]["times"], name  # the slowest rank's time


def test_every_strategy_trains_like_ddp(measured: dict[str, list[dict[str, Any]]]) -> None:
    def global_loss(ranks: list[dict[str, Any]]) -> list[float]:
        return [sum(step) / WORLD for step in zip(*(r["losses"] for r in ranks))]

    ddp = global_loss(measured["torch DDP"])
    assert len(ddp) == 1 + STEPS and ddp[-1] < ddp[0]  # warm-up + timed steps; it learns
    for name, ranks in measured.items():
        if name in OWN_INIT:
            continue
        # fp32 rounding; shardkit fsdp's AdamW exempts biases and norms from weight decay
        assert global_loss(ranks) == pytest.approx(ddp, abs=2e-5), name


def test_ddp_state_and_traffic_match_the_formulas_exactly(
    measured: dict[str, list[dict[str, Any]]],
) -> None:
    tensors = 2 + 12 * CONFIG.n_layer + 2  # wte, wpe; 6 weights + 6 biases a block; ln_f
    for r in measured["torch DDP"]:
        s = r["state"]
        assert s["parameters"] == s["gradients"] == 4 * PSI
        assert s["optimizer_state"] == 8 * PSI + 4 * tensors  # AdamW: + one fp32 'step' each
        # every gradient all-reduced once per step: 4 psi bytes; ring volume = theory
        assert _per_step(r, "all_reduce") == 4 * PSI
        volume = r["comm"]["total_volume_bytes"] / STEPS
        assert volume == theory_volume_bytes(PSI, WORLD, 0)


@pytest.mark.parametrize("name", ["torch DDP + ZeroRedundancyOptimizer", "shardkit oss"])
def test_zero1_optimizer_state_is_sharded_within_the_largest_parameter(
    measured: dict[str, list[dict[str, Any]]], name: str
) -> None:
    largest = CONFIG.vocab_size * CONFIG.n_embd  # the tied embedding
    formula = zero_memory_estimate(PSI, WORLD, 1, mixed_precision=False)
    states = [r["state"] for r in measured[name]]
    assert sum(s["optimizer_state"] for s in states) < 8 * PSI + 4 * 64  # + 'step' scalars
    for s, r in zip(states, measured[name]):
        assert s["parameters"] == s["gradients"] == 4 * PSI
        # greedy partition by whole parameters: at most the largest one (8 bytes each) over
        assert abs(s["optimizer_state"] - formula.optimizer_state) <= 8 * largest
        # torch: DDP all-reduce (2 psi) + the owners' broadcast of the updated parameters
        # (psi); shardkit: reduce to the owner (psi, reduce_to_owner_hook) + broadcast (psi)
        reduced = "reduce" if name == "shardkit oss" else "all_reduce"
        assert _per_step(r, reduced) == 4 * PSI
        assert _per_step(r, "broadcast") == 4 * PSI
        theory = theory_volume_bytes(PSI, WORLD, 1)
        ratio = r["comm"]["total_volume_bytes"] / STEPS / theory
        assert ratio == (1.0 if name == "shardkit oss" else 1.5)


def test_sdp_gradients_sharded_and_traffic_is_two_psi(
    measured: dict[str, list[dict[str, Any]]],
) -> None:
    for r in measured["shardkit sdp"]:
        volume = r["comm"]["total_volume_bytes"] / STEPS
        assert volume == pytest.approx(theory_volume_bytes(PSI, WORLD, 2), rel=0.01)
        assert r["state"]["gradients"] < 4 * PSI  # the other rank's gradients are freed


@pytest.mark.parametrize("name", ["shardkit fsdp", "torch FSDP2 fully_shard"])
def test_zero3_state_within_padding_of_the_formula(
    measured: dict[str, list[dict[str, Any]]], name: str
) -> None:
    formula = zero_memory_estimate(PSI, WORLD, 3, mixed_precision=False)
    for r in measured[name]:
        s = r["state"]
        model = s["parameters"] + s["gradients"] + s["optimizer_state"]
        # padding: at most N - 1 elements per flat parameter, 16 bytes each (param, grad,
        # exp_avg, exp_avg_sq) + one 4-byte 'step' per optimizer tensor (<= 64 tensors)
        assert formula.total - 1 <= model <= formula.total + UNITS * 16 * (WORLD - 1) + 4 * 64
        # every gradient reduce-scattered once (on gloo: each rank sends every other rank
        # its chunk, (N - 1) / N of the payload, and sums what it receives; see
        # fully_sharded/collectives.py); parameters gathered at most twice (on gloo:
        # one broadcast per rank of its slice, the same payload)
        sent = _per_step(r, "send") * WORLD / (WORLD - 1)
        assert _per_step(r, "reduce_scatter") + sent >= 4 * PSI
        gathered = _per_step(r, "all_gather") + _per_step(r, "broadcast")
        assert 4 * PSI <= gathered <= 8 * PSI + 64 * UNITS
        ratio = r["comm"]["total_volume_bytes"] / STEPS / theory_volume_bytes(PSI, WORLD, 3)
        assert 2 / 3 < ratio <= 1.01


def test_offload_and_pipe_traffic(measured: dict[str, list[dict[str, Any]]]) -> None:
    for name in ("shardkit offload", "shardkit offload (disk)"):
        for r in measured[name]:
            assert _per_step(r, "all_reduce") == 4 * PSI, name  # gradients averaged
    disk = measured["shardkit offload (disk)"][0]["state"]
    assert disk["optimizer_state"] == 0  # on disk, not in this process
    first, last = measured["shardkit pipe"]
    activation = 2 * WORLD * CONFIG.block_size * CONFIG.n_embd * 4  # global batch, fp32
    assert _per_step(first, "send") >= activation  # forward activations to the last stage
    assert _per_step(last, "send") >= activation  # their gradients back


def test_report_of_measured_runs(measured: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    records = [
        {
            "spec": {"strategy": name},
            "world_size": WORLD,
            "model_size": "test",
            "round": 0,
            "psi": PSI,
            "stage": BY_NAME[name].stage,
            "ranks": ranks,
        }
        for name, ranks in measured.items()
    ]
    rows = summarize(records, batch=2, seq_len=CONFIG.block_size)
    ddp = rows[0]
    assert ddp["strategy"] == "torch DDP" and ddp["x_ddp"] == 1.0
    assert ddp["comm_over_theory"] == 1.0 and ddp["state_over_formula"] == pytest.approx(
        1.0, abs=1e-3
    )
    assert ddp["loss_vs_ddp"] == 0.0
    assert all(r["loss_vs_ddp"] < 2e-5 for r in rows if r["strategy"] not in OWN_INIT)
    doc = {
        "command": "python -m benchmarks.compare",
        "machine": {
            "cpu_count": 2,
            "cpu_model": "x",
            "torch": "t",
            "python": "p",
            "loadavg": [1.0],
        },
        "summary": rows,
    }
    page = render_markdown(doc, ["DeepSpeed ZeRO-1"])
    assert page.count("\n| ") == len(rows) + 2  # header, rows, one "not installed" row
    assert "| DeepSpeed ZeRO-1 | - | - | not installed |" in page
    paths = write_plots(rows, tmp_path / "run")
    assert [p.name for p in paths] == ["run-memory.png", "run-ratio.png", "run-rss.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)
    curve = ddp["rss_steps_bytes"][0]  # one round: each step's peak, the larger rank
    assert curve == [max(a, b) for a, b in zip(*(r["rss_steps"] for r in measured["torch DDP"]))]


def rows_of(doc: dict[str, Any]) -> dict[str, Any]:
    return {r["strategy"]: r for r in doc["summary"]}


def test_write_outputs_round_trips_json(
    measured: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    records = [
        {
            "spec": {"strategy": name},
            "world_size": WORLD,
            "model_size": "test",
            "round": r,
            "psi": PSI,
            "stage": BY_NAME[name].stage,
            "ranks": measured[name],
        }
        for r in range(2)
        for name in ("torch DDP", "shardkit fsdp")
    ]
    broken = {k: v for k, v in records[0].items() if k != "ranks"}
    records.append({**broken, "spec": {"strategy": "broken"}, "error": "rank 0: E: x"})
    machine = {"cpu_count": 2, "cpu_model": "x", "torch": "t", "python": "p", "loadavg": [1.0]}
    doc = {
        "command": "c",
        "machine": machine,
        "args": {"batch": 2, "seq_len": CONFIG.block_size},
        "not_installed": {"FairScale OSS + DDP": "fairscale"},
        "records": records,
    }
    page = write_outputs(doc, tmp_path / "run")
    saved = json.loads((tmp_path / "run.json").read_text())
    assert saved["plots"] == ["run-memory.png", "run-ratio.png", "run-rss.png"]
    assert len(rows_of(saved)["shardkit fsdp"]["rss_steps_bytes"]) == 2  # one curve a round
    rows = {r["strategy"]: r for r in saved["summary"]}
    assert rows["torch DDP"]["n_steps"] == 2 * STEPS and rows["torch DDP"]["x_ddp_paired"] == 1.0
    assert rows["broken"]["error"] == "rank 0: E: x"
    assert "| broken | 2 | test (0.1M) | failed: rank 0: E: x |" in page
    assert (tmp_path / "run.md").read_text() == page + "\n"


def test_helpers() -> None:
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert model_config("small", 64).n_embd == 384
    with pytest.raises(ValueError, match="anchor"):
        model_config("huge", 64)
    err = RankError(1, "Traceback ...\n  File x\nValueError: bad thing\n\n(ranks [0] also failed)")
    assert error_line(err) == "rank 1: ValueError: bad thing"
    assert all(available(BY_NAME[n]) for n in BUILT_IN)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--steps", "0"], "--steps must be >= 1"),
        (["--rounds", "0"], "--rounds must be >= 1"),
        (["--warmup", "0"], "--warmup must be >= 1"),
    ],
)
def test_bad_run_counts_are_refused_before_any_run(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: --steps 0 ran every strategy, then failed in statistics.median."""
    with pytest.raises(SystemExit) as exit_info:
        parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
