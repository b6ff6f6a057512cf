"""The main job with ``--moe-experts``: each Block's MLP an ``MoE``; the expert-parallel
run (``--ep 2``) follows the ``--ep 1`` run under ddp (experts out of DDP, averaged over
``edp``) and fsdp (experts in a unit over ``edp``), and so does ``--ep 2 --tp 2
--sequence-parallel`` on 4 ranks (each expert split over tp too, each MoE routing the
gathered sequence), resumed at ``--ep 1`` on 2; bad MoE flags are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import train_gpt
from gpt_checkpoint import check_model_flags
from gpt_data import InputError
from gpt_moe import MoEGPT, MoESettings, active_and_total, moe_model_flags, top_k_change

from shardkit.models import gpt_config

STEPS = 2
COMMON = [
    *("--model-size", "tiny", "--batch-size", "2", "--seq-len", "32", "--eval-batches", "1"),
    *("--steps", str(STEPS), "--eval-every", "0", "--save-every", "0"),
    *("--moe-experts", "4", "--moe-top-k", "2"),
]


def _metrics(out_dir: Path) -> dict[str, Any]:
    return json.loads((out_dir / "metrics.json").read_text())


def _run_main(argvs: list[list[str]]) -> list[int]:
    return [train_gpt.main(argv) for argv in argvs]


def test_ep2_follows_ep1_under_ddp_and_fsdp(
    rank_pool: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One spawned group for every main-job MoE run: ep 1 / 2 under ddp and fsdp, ep 1
    under oss, sdp (both with --moe-every 2) and hsdp, and a ddp --ep 2 checkpoint
    resumed at --ep 1; on 4 ranks, fsdp --ep 2 --tp 2 --sequence-parallel (the same
    global batch: 2 data-parallel ranks) saved at step 1 and resumed at --ep 1 on 2
    ranks."""
    runs = [(s, ep) for s in ("ddp", "fsdp") for ep in (1, 2)]
    argvs = [
        [*COMMON, "--strategy", s, "--ep", str(ep), "--out-dir", str(tmp_path / f"{s}{ep}")]
        for s, ep in runs
    ]
    others = {
        "oss": ["--strategy", "oss", "--moe-every", "2"],
        "sdp": ["--strategy", "sdp", "--moe-every", "2"],
        "hsdp": ["--strategy", "hsdp"],
        "saved": ["--strategy", "ddp", "--ep", "2", "--save-every", "1", "--stop-after", "1"],
    }
    argvs += [[*COMMON, *a, "--out-dir", str(tmp_path / name)] for name, a in others.items()]
    pool = rank_pool(2)
    assert pool.run(_run_main, argvs, timeout_s=300) == [[0] * len(argvs)] * 2
    ep_tp = ["--strategy", "fsdp", "--ep", "2", "--tp", "2", "--sequence-parallel"]
    ep_tp += ["--save-every", "1"]
    ep_tp_argv = [*COMMON, *ep_tp, "--stop-after", "1", "--out-dir", str(tmp_path / "ep_tp")]
    assert rank_pool(4).run(_run_main, [ep_tp_argv], timeout_s=300) == [[0]] * 4
    resume = [*COMMON, "--strategy", "ddp", "--ep", "1", "--resume"]
    for name in ("saved", "ep_tp"):
        assert pool.run(_run_main, [[*resume, "--out-dir", str(tmp_path / name)]]) == [[0]] * 2
    model = MoEGPT(gpt_config("tiny", vocab_size=256, block_size=32), MoESettings(4, 2))
    active, total = active_and_total(model)
    # 4 blocks x 4 experts x (2 x 128 x 512) expert weights; a token uses 2 of 4
    assert total - active == 4 * 2 * (2 * 128 * 512), (active, total)
    m = {run: _metrics(tmp_path / f"{run[0]}{run[1]}") for run in runs}
    for s in ("ddp", "fsdp"):
        one, two = m[(s, 1)], m[(s, 2)]
        assert len(one["train_loss"]) == len(two["train_loss"]) == STEPS
        assert abs(one["train_loss"][0][1] - two["train_loss"][0][1]) < 1e-5, (one, two)
        assert abs(one["train_loss"][1][1] - two["train_loss"][1][1]) < 1e-4, (one, two)
        assert abs(one["moe_aux_loss"][0][1] - two["moe_aux_loss"][0][1]) < 1e-5
        assert one["moe_dropped"][0][1] == two["moe_dropped"][0][1]
        assert 0.0 <= two["moe_dropped"][0][1] < 1.0
        # 4 layers' load-balancing losses, each about k = 2 when balanced
        assert 4.0 < two["moe_aux_loss"][0][1] < 16.0, two["moe_aux_loss"]
        assert (two["param_count"], two["active_param_count"]) == (total, active)
        assert two["args"]["ep"] == 2 and two["args"]["moe_experts"] == 4
        assert not (tmp_path / f"{s}2" / "model.pt").exists()
    # the same model and rows: ddp and fsdp agree too, and hsdp
    ddp1 = m[("ddp", 1)]["train_loss"]
    assert abs(m[("ddp", 2)]["train_loss"][0][1] - m[("fsdp", 2)]["train_loss"][0][1]) < 1e-5
    hsdp = _metrics(tmp_path / "hsdp")["train_loss"]
    assert abs(hsdp[0][1] - ddp1[0][1]) < 1e-5 and abs(hsdp[1][1] - ddp1[1][1]) < 1e-4
    # --moe-every 2: two MoE blocks of four; oss and sdp train the same model alike
    oss, sdp = _metrics(tmp_path / "oss"), _metrics(tmp_path / "sdp")
    config = gpt_config("tiny", vocab_size=256, block_size=32)
    every2 = active_and_total(MoEGPT(config, MoESettings(4, 2, every=2)))
    assert (oss["active_param_count"], oss["param_count"]) == every2
    assert every2[1] - every2[0] == 2 * 2 * (2 * 128 * 512)  # blocks 1 and 3 only
    assert 2.0 < oss["moe_aux_loss"][0][1] < 8.0, oss["moe_aux_loss"]  # 2 layers now
    for i, tol in ((0, 1e-5), (1, 1e-4)):
        assert abs(oss["train_loss"][i][1] - sdp["train_loss"][i][1]) < tol, (oss, sdp)
    assert oss["train_loss"][0][1] != ddp1[0][1]  # another model
    # ddp --ep 2 saved step 1 (experts as ep parts); resumed at --ep 1, step 2 is the
    # uninterrupted --ep 1 run's
    saved = json.loads((tmp_path / "saved" / "ckpt-000001" / "manifest.json").read_text())
    assert saved["layout"]["strategy"] == "ddp+ep2", saved["layout"]["strategy"]
    resumed = _metrics(tmp_path / "saved")["train_loss"]
    assert [int(step) for step, _ in resumed] == [1, 2], resumed
    assert abs(resumed[0][1] - ddp1[0][1]) < 1e-5 and abs(resumed[1][1] - ddp1[1][1]) < 1e-4
    # a dense run resuming the MoE checkpoint is refused, naming the flag (not the keys)
    dense = COMMON[:-4]
    assert dense + ["--moe-experts", "4", "--moe-top-k", "2"] == COMMON
    code = train_gpt.main([*dense, "--resume", "--out-dir", str(tmp_path / "saved")])
    err = capsys.readouterr().err
    assert code == 2 and "--moe-experts 4 (this run: 0)" in err, err
    # fsdp --ep 2 --tp 2 --sequence-parallel: experts split over both, each MoE routing the
    # gathered sequence; saved at step 1, resumed on 2 ranks
    saved = json.loads((tmp_path / "ep_tp" / "ckpt-000001" / "manifest.json").read_text())
    assert saved["layout"]["strategy"] == "fsdp+ep2+tp2", saved["layout"]["strategy"]
    resumed = _metrics(tmp_path / "ep_tp")["train_loss"]
    assert [int(step) for step, _ in resumed] == [1, 2], resumed
    assert abs(resumed[0][1] - ddp1[0][1]) < 1e-5 and abs(resumed[1][1] - ddp1[1][1]) < 1e-4


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--moe-experts", "3", "--ep", "3"], "ep (3) must divide dp_shard (1)"),  # 1 rank
        (
            ["--moe-experts", "3", "--ep", "2"],
            "--moe-experts 3 does not split over --ep 2 ranks; choose an --ep that divides 3",
        ),
        (
            ["--moe-experts", "2", "--moe-top-k", "3"],
            "--moe-top-k 3 is more than the 2 experts; use --moe-top-k <= 2",
        ),
        (["--moe-top-k", "2"], "--moe-top-k, --moe-every and --ep need --moe-experts"),
        (
            ["--moe-experts", "4", "--strategy", "pipe"],
            "--moe-experts applies to --strategy ddp / oss / sdp / fsdp / hsdp, not 'pipe'",
        ),
        (
            ["--moe-experts", "4", "--ep", "2", "--strategy", "sdp"],
            "--ep 2 with --strategy sdp",
        ),
    ],
)
def test_moe_refusals_one_line_exit_2(
    argv: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = train_gpt.main([*argv, "--out-dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2, argv
    assert err.startswith("train_gpt.py: error: ") and err.count("\n") == 1, err
    assert message in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("saved", "now", "named"),
    [
        ((8, 1), (4, 1), "--moe-experts 8 (this run: 4)"),  # another expert count
        ((4, 2), (4, 1), "--moe-every 2 (this run: 1)"),  # MoE in other blocks
        ((4, 1), (0, 1), "--moe-experts 4 (this run: 0)"),  # an MoE checkpoint, dense run
    ],
)
def test_resume_with_other_moe_flags_names_them(
    saved: tuple[int, int], now: tuple[int, int], named: str
) -> None:
    """The checkpoint's model flags hold ``--moe-experts`` / ``--moe-every``: a resume
    with others is refused naming them, before any key is looked up."""
    flags = {"model_size": "tiny", **moe_model_flags(*now)}
    with pytest.raises(InputError) as err:
        check_model_flags({"model_size": "tiny", **moe_model_flags(*saved)}, flags, Path("c"))
    assert named in str(err.value) and "resume with the same model flags" in str(err.value)


def test_resume_with_another_top_k_warns_naming_both(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression: ``--resume --moe-top-k 1`` from a checkpoint trained at top-k 2 ran
    without a word. ``--moe-top-k`` is not a model flag (the same tensors), so the
    resume goes on, with one warning line naming both values; the same k says nothing."""
    common = [*COMMON, "--stop-after", "1", "--sample-bytes", "0", "--out-dir", str(tmp_path)]
    assert train_gpt.main(common) == 0
    capsys.readouterr()
    assert train_gpt.main([*common, "--resume", "--moe-top-k", "1"]) == 0  # no step left
    err = capsys.readouterr().err
    warning = (
        "train_gpt.py: warning: --moe-top-k 1 differs from the checkpoint's 2: each token "
        "now goes to 1 of the 4 experts instead of 2. To route as before, resume with "
        "--moe-top-k 2\n"
    )
    assert err.count(warning) == 1, err
    assert _metrics(tmp_path)["step"] == 1
    assert top_k_change(2, 4, 2) is None  # the same k
    assert top_k_change(None, 4, 1) is None  # a checkpoint from before it was kept
    assert top_k_change(2, 0, 1) is None  # a dense run: no routing
