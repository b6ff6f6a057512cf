"""``ShardkitTrainer`` (shardkit.integrations.hf): the HF Trainer on 2 ranks under torchrun.

GPT-2 and BERT from small configs (no download), dropout off. Each strategy (oss, sdp,
fsdp) trains with gradient accumulation and clipping and is compared with the
Trainer's own DDP run on the same seed: the logged losses, gradient norms and the eval
loss. Also: bf16 (autocast, as accelerate applies it) against DDP in bf16; a run
resumed from a checkpoint (sharded optimizer state) against an uninterrupted one;
``save_model()`` loaded by ``from_pretrained`` on one process reproduces the eval
loss; every rank's model-state bytes in the logs.

Importing transformers costs 10-20 s per process on the 2-core box, so every
configuration runs in ONE torchrun (this file is its script: ``--worker OUT``), which
writes what it measured to a JSON file; the test reads it.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None
    or importlib.util.find_spec("accelerate") is None,
    reason="transformers / accelerate not installed (pip install -e '.[hf]')",
)

VOCAB, SEQ = 64, 16
STEPS, GA, BATCH, EVAL_BATCH = 3, 2, 2, 2
STRATEGIES = ("oss", "sdp", "fsdp")


# -- the torchrun worker (each rank) ---------------------------------------------------
def _model(name: str) -> Any:
    import torch
    import transformers as hf

    torch.manual_seed(0)
    if name == "gpt2":
        cfg = hf.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        )  # fmt: skip
        return hf.GPT2LMHeadModel(cfg)
    cfg = hf.BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=VOCAB, max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, pad_token_id=0,
    )  # fmt: skip
    return hf.BertForMaskedLM(cfg)


def _data(name: str, n: int, seed: int) -> list[dict[str, Any]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (n, SEQ), generator=gen)
    if name == "gpt2":
        return [{"input_ids": x, "labels": x.clone()} for x in ids]
    masked = torch.rand(n, SEQ, generator=gen) < 0.25  # masked LM: predict the masked ids
    masked[:, 0] = True  # at least one label per row
    return [
        {"input_ids": x.masked_fill(m, 1), "labels": x.masked_fill(~m, -100)}
        for x, m in zip(ids, masked)
    ]


def _trainer(name: str, strategy: str | None, out: str, model: Any = None, **kwargs: Any) -> Any:
    import transformers as hf

    from shardkit.integrations.hf import ShardkitTrainer

    settings: dict[str, Any] = {
        "per_device_train_batch_size": BATCH,
        "per_device_eval_batch_size": EVAL_BATCH,
        "gradient_accumulation_steps": GA,
        "max_steps": STEPS,
        "learning_rate": 1e-2,
        "weight_decay": 0.01,
        "max_grad_norm": 0.5,  # clipping is active (norms are ~1)
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "seed": 0,
        **kwargs,
    }
    args = hf.TrainingArguments(output_dir=out, **settings)
    return ShardkitTrainer(
        model=_model(name) if model is None else model,
        args=args,
        train_dataset=_data(name, 48, 1),
        eval_dataset=_data(name, 8, 2),
        shardkit=strategy,
    )


def _history(trainer: Any, key: str) -> list[float]:
    return [float(h[key]) for h in trainer.state.log_history if key in h and "eval_loss" not in h]


def _train(name: str, strategy: str | None, out: str, **kwargs: Any) -> dict[str, Any]:
    import transformers as hf

    class CountSteps(hf.TrainerCallback):
        steps = 0

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            CountSteps.steps += 1

    resume = kwargs.pop("resume_from_checkpoint", None)
    trainer = _trainer(name, strategy, out, **kwargs)
    trainer.add_callback(CountSteps())
    trainer.train(resume_from_checkpoint=resume)
    result = {
        "steps_run": CountSteps.steps,
        "loss": _history(trainer, "loss"),
        "grad_norm": _history(trainer, "grad_norm"),
        "eval_loss": float(trainer.evaluate()["eval_loss"]),
        "state_bytes": getattr(trainer, "model_state_bytes", []),
        "logged_keys": sorted(k for h in trainer.state.log_history for k in h),
    }
    result["trainer"] = trainer
    return result


def _manual_eval_loss(model: Any, name: str) -> float:
    """The mean of the per-batch losses over the eval set, batches of ``EVAL_BATCH``
    (the whole set on this process; the model's own loss, no Trainer scaling)."""
    import torch

    data, losses = _data(name, 8, 2), []
    with torch.no_grad():
        for i in range(0, len(data), EVAL_BATCH):
            rows = data[i : i + EVAL_BATCH]
            batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
            losses.append(model(**batch).loss.item())
    return sum(losses) / len(losses)


def _from_pretrained(name: str, directory: str) -> Any:
    import transformers as hf

    cls = hf.GPT2LMHeadModel if name == "gpt2" else hf.BertForMaskedLM
    return cls.from_pretrained(directory).eval()


def _worker(out_path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    root = Path(out_path).parent
    results: dict[str, Any] = {}

    def keep(key: str, run: dict[str, Any]) -> dict[str, Any]:
        results[key] = {k: v for k, v in run.items() if k != "trainer"}
        return run

    for name in ("gpt2", "bert"):
        keep(f"{name}/ddp", _train(name, None, str(root / f"{name}-ddp")))
        for strategy in STRATEGIES:
            run = keep(
                f"{name}/{strategy}", _train(name, strategy, str(root / f"{name}-{strategy}"))
            )
            if strategy == "fsdp":  # save_model(): a plain HF checkpoint
                trainer, saved = run["trainer"], root / f"{name}-fsdp-saved"
                trainer.save_model(str(saved))
                sharded = _manual_eval_loss(trainer.sharded_module.eval(), name)
                dist.barrier()
                loaded = _from_pretrained(name, str(saved))  # each process on its own
                plain = _trainer(name, None, str(root / f"{name}-plain"), model=loaded)
                results[f"{name}/fsdp/reloaded"] = {
                    "files": sorted(os.listdir(saved)),
                    "manual_sharded": sharded,
                    "manual_loaded": _manual_eval_loss(loaded, name),
                    "trainer_eval_loss": float(plain.evaluate()["eval_loss"]),
                }
    # mixed precision: bf16 autocast on CPU, against the Trainer's DDP in bf16
    keep("gpt2/ddp/bf16", _train("gpt2", None, str(root / "bf16-ddp"), bf16=True))
    for strategy in ("sdp", "fsdp"):
        keep(
            f"gpt2/{strategy}/bf16",
            _train("gpt2", strategy, str(root / f"bf16-{strategy}"), bf16=True),
        )
    # resume: 6 steps straight vs 3 steps (checkpoint) then resumed to 6
    for strategy in ("sdp", "fsdp"):
        long = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3}
        keep(
            f"resume/{strategy}/straight",
            _train("gpt2", strategy, str(root / f"straight-{strategy}"), **long),
        )
        split = str(root / f"split-{strategy}")
        _train("gpt2", strategy, split, **long)  # writes checkpoint-3 (and -6)
        ckpt = os.path.join(split, "checkpoint-3")
        if dist.get_rank() == 0:
            results[f"resume/{strategy}/files"] = sorted(os.listdir(ckpt))
        resumed = _train("gpt2", strategy, split + "-resumed", **long, resume_from_checkpoint=ckpt)
        keep(f"resume/{strategy}/resumed", resumed)
    try:
        _trainer("gpt2", "zero", str(root / "zero"))
        results["errors"] = {"zero": "no error"}
    except ValueError as err:
        results["errors"] = {"zero": f"ValueError: {err}"}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()


# -- the test ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("hf_trainer") / "results.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [*cmd, __file__, "--worker", str(out)],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return dict(json.loads(out.read_text()))


def _close(a: list[float], b: list[float], tol: float) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= tol * max(1.0, abs(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("name", ["gpt2", "bert"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_losses_equal_the_trainers_ddp(results: dict[str, Any], name: str, strategy: str) -> None:
    """Same seed, data order, gradient accumulation (2) and clipping as the Trainer's own
    DDP run: the same losses, gradient norms and eval loss, to fp32 rounding."""
    ddp, mine = results[f"{name}/ddp"], results[f"{name}/{strategy}"]
    assert len(ddp["loss"]) == STEPS
    assert ddp["loss"][0] > 3.5  # about ln(64) = 4.16 at initialisation
    assert _close(mine["loss"], ddp["loss"], 1e-5), (mine["loss"], ddp["loss"])
    assert _close(mine["grad_norm"], ddp["grad_norm"], 1e-4), (mine["grad_norm"], ddp["grad_norm"])
    assert min(ddp["grad_norm"]) > 0.5  # so max_grad_norm=0.5 clipped every step
    assert abs(mine["eval_loss"] - ddp["eval_loss"]) < 1e-5


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_state_bytes_are_logged_per_rank(results: dict[str, Any], name: str) -> None:
    """Each log carries every rank's model-state bytes; the ZeRO stage shows in them."""
    keys = results[f"{name}/fsdp"]["logged_keys"]
    assert {f"model_state_bytes/rank{r}/optimizer_state" for r in (0, 1)} <= set(keys)
    oss, sdp, fsdp = (results[f"{name}/{s}"]["state_bytes"] for s in STRATEGIES)
    assert len(oss) == len(fsdp) == 2
    full = oss[0]["parameters"]  # oss and sdp keep the full parameters on each rank
    assert full > 50_000 and sdp[1]["parameters"] == full
    for rank in (0, 1):  # AdamW's two fp32 moments: 2 x params, half of them per rank
        assert 0.4 * full < oss[rank]["optimizer_state"] < 0.6 * 2 * full
        assert fsdp[rank]["parameters"] < 0.55 * full  # ZeRO-3: a shard of the parameters
    assert sum(r["optimizer_state"] for r in fsdp) == pytest.approx(2 * full, rel=0.01)


@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_saved_model_loads_with_from_pretrained(results: dict[str, Any], name: str) -> None:
    """``save_model()`` under fsdp writes a plain HF checkpoint; one process loads it
    with ``from_pretrained`` and gets the eval loss the sharded run reported."""
    reloaded = results[f"{name}/fsdp/reloaded"]
    assert "config.json" in reloaded["files"] and "model.safetensors" in reloaded["files"]
    # a plain Trainer evaluating the reloaded model reports the sharded run's eval loss
    assert abs(reloaded["trainer_eval_loss"] - results[f"{name}/fsdp"]["eval_loss"]) < 1e-5
    # and the model's own loss, one process vs through FSDP, is the same
    assert abs(reloaded["manual_loaded"] - reloaded["manual_sharded"]) < 1e-5
    assert reloaded["manual_loaded"] < 5.0


@pytest.mark.parametrize("strategy", ["sdp", "fsdp"])
def test_bf16_matches_ddp_bf16(results: dict[str, Any], strategy: str) -> None:
    """``bf16=True``: autocast as the Trainer's DDP run gets it from accelerate."""
    ddp, mine = results["gpt2/ddp/bf16"], results[f"gpt2/{strategy}/bf16"]
    fp32 = results["gpt2/ddp"]
    assert ddp["loss"] != fp32["loss"]  # bf16 really ran
    assert _close(mine["loss"], ddp["loss"], 1e-3), (mine["loss"], ddp["loss"])
    assert abs(mine["eval_loss"] - ddp["eval_loss"]) < 1e-2


@pytest.mark.parametrize("strategy", ["sdp", "fsdp"])
def test_resume_equals_uninterrupted(results: dict[str, Any], strategy: str) -> None:
    """Resuming from checkpoint-3 (HF model + this rank's optimizer shard per rank)
    gives steps 4-6 with the losses of the uninterrupted run."""
    files = results[f"resume/{strategy}/files"]
    assert {"optimizer.rank0-of-2.pt", "optimizer.rank1-of-2.pt", "scheduler.pt"} <= set(files)
    assert "model.safetensors" in files and "trainer_state.json" in files
    straight = results[f"resume/{strategy}/straight"]["loss"]
    resumed = results[f"resume/{strategy}/resumed"]["loss"]
    # the resumed run took steps 4-6 only (its log history holds 1-3 from the checkpoint)
    assert results[f"resume/{strategy}/resumed"]["steps_run"] == 3
    assert results[f"resume/{strategy}/straight"]["steps_run"] == 6
    assert len(straight) == len(resumed) == 6
    assert _close(resumed[3:], straight[3:], 1e-6), (resumed, straight)
    eval_straight = results[f"resume/{strategy}/straight"]["eval_loss"]
    assert abs(results[f"resume/{strategy}/resumed"]["eval_loss"] - eval_straight) < 1e-6


def test_unknown_strategy_is_refused(results: dict[str, Any]) -> None:
    """An unknown strategy fails at construction with one clear line."""
    assert results["errors"]["zero"].startswith("ValueError: unknown shardkit strategy 'zero'")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2])
