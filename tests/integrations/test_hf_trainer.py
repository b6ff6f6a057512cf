"""``ShardkitTrainer`` (shardkit.integrations.hf): the HF Trainer on 2 ranks under torchrun.

GPT-2, BERT, T5 (seq2seq, tied embeddings) and DistilBERT sequence classification (no
``_no_split_modules``) from small configs (no download), dropout off. Each strategy
(oss, sdp, fsdp) trains with gradient accumulation and clipping and is compared with
the Trainer's own DDP run on the same seed: the logged losses, gradient norms and the
eval loss and metrics. Also: bf16 (autocast, as accelerate applies it) against DDP in
bf16; label smoothing (the Trainer shifts a causal LM's labels, deciding by the
unwrapped model's class); a run resumed from a checkpoint (the optimizer state as a
universal checkpoint) against an uninterrupted one, by the same strategy and by
another; a checkpoint of the previous release refused; ``save_model()`` loaded by ``from_pretrained`` on one
process reproduces the eval loss, and writes the tensors the DDP run's save writes;
every rank's model-state bytes in the logs.

Importing transformers costs 10-20 s per process on the 2-core box, so every
configuration runs in ONE torchrun (this file is its script: ``--worker OUT``), which
writes what it measured to a JSON file; the test reads it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
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
MODELS = ("gpt2", "bert", "t5", "distilbert")
LABELS = 3  # distilbert: sequence classification classes
EVAL_METRICS = ("eval_loss", "eval_accuracy", "eval_logit_mean")


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
    if name == "t5":  # shared / encoder / decoder embeddings and lm_head: one tensor
        cfg = hf.T5Config(
            num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=2, d_kv=16,
            vocab_size=VOCAB, dropout_rate=0.0, decoder_start_token_id=0, bos_token_id=0,
            eos_token_id=0, pad_token_id=0, tie_word_embeddings=True,
        )  # fmt: skip
        return hf.T5ForConditionalGeneration(cfg)
    if name == "distilbert":  # _no_split_modules names no block class
        cfg = hf.DistilBertConfig(
            n_layers=2, dim=32, n_heads=2, hidden_dim=64, vocab_size=VOCAB,
            max_position_embeddings=SEQ, dropout=0.0, attention_dropout=0.0,
            seq_classif_dropout=0.0, pad_token_id=0, num_labels=LABELS,
        )  # fmt: skip
        return hf.DistilBertForSequenceClassification(cfg)
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
    if name == "t5":  # a target of half the length, other tokens
        targets = torch.randint(2, VOCAB, (n, SEQ // 2), generator=gen)
        return [{"input_ids": x, "labels": y} for x, y in zip(ids, targets)]
    if name == "distilbert":
        classes = torch.randint(0, LABELS, (n,), generator=gen)
        return [{"input_ids": x, "labels": c} for x, c in zip(ids, classes)]
    masked = torch.rand(n, SEQ, generator=gen) < 0.25  # masked LM: predict the masked ids
    masked[:, 0] = True  # at least one label per row
    return [
        {"input_ids": x.masked_fill(m, 1), "labels": x.masked_fill(~m, -100)}
        for x, m in zip(ids, masked)
    ]


def _metrics(prediction: Any) -> dict[str, float]:
    """Eval metrics from the predictions gathered over the ranks: the accuracy of the
    arg-max class or token, and the mean logit (a value, to compare to fp32 rounding)."""
    import numpy as np

    logits = prediction.predictions
    logits = logits[0] if isinstance(logits, tuple) else logits
    labels = prediction.label_ids
    hits = (logits.argmax(-1) == labels)[labels != -100]
    return {"accuracy": float(np.mean(hits)), "logit_mean": float(np.mean(logits))}


def _trainer(name: str, strategy: Any, out: str, model: Any = None, **kwargs: Any) -> Any:
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
        compute_metrics=_metrics if name in ("t5", "distilbert") else None,
    )


def _history(trainer: Any, key: str) -> list[float]:
    return [float(h[key]) for h in trainer.state.log_history if key in h and "eval_loss" not in h]


def _train(name: str, strategy: Any, out: str, **kwargs: Any) -> dict[str, Any]:
    import transformers as hf

    class CountSteps(hf.TrainerCallback):
        steps = 0

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            CountSteps.steps += 1

    resume = kwargs.pop("resume_from_checkpoint", None)
    trainer = _trainer(name, strategy, out, **kwargs)
    trainer.add_callback(CountSteps())
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):  # the wrap policy's line (fsdp, rank 0)
        trainer.train(resume_from_checkpoint=resume)
    evaluated = trainer.evaluate()
    result = {
        "steps_run": CountSteps.steps,
        "loss": _history(trainer, "loss"),
        "grad_norm": _history(trainer, "grad_norm"),
        "eval_loss": float(evaluated["eval_loss"]),
        "eval_metrics": {k: float(v) for k, v in evaluated.items() if k in EVAL_METRICS},
        "printed": [x for x in printed.getvalue().splitlines() if x.startswith("shardkit")],
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


def _saved_tensors(directory: Path) -> dict[str, Any]:
    """The tensors a save wrote (every ``*.safetensors`` / ``*.bin`` file in it)."""
    import torch
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for path in sorted(directory.iterdir()):
        if path.suffix == ".safetensors":
            tensors.update(load_file(str(path)))
        elif path.suffix == ".bin" and path.name != "training_args.bin":
            tensors.update(torch.load(path, weights_only=True))
    return tensors


def _compare_saves(mine: Path, ddp: Path) -> dict[str, Any]:
    """Key sets, shapes and the largest difference of two saves' tensors."""
    got, want = _saved_tensors(mine), _saved_tensors(ddp)
    common = sorted(set(got) & set(want))
    return {
        "keys": sorted(got),
        "ddp_keys": sorted(want),
        "shapes_differ": [k for k in common if got[k].shape != want[k].shape],
        "max_diff": max(
            [float((got[k].float() - want[k].float()).abs().max()) for k in common] or [0.0]
        ),
    }


def _unit_count(trainer: Any) -> int:
    from shardkit.nn import FullyShardedDataParallel

    return sum(isinstance(m, FullyShardedDataParallel) for m in trainer.sharded_module.modules())


DEFAULT_GROUPS = ("base", "resume", "families", "smoothing")


def _worker(out_path: str, groups: tuple[str, ...] = DEFAULT_GROUPS) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    root = Path(out_path).parent
    results: dict[str, Any] = {}

    def keep(key: str, run: dict[str, Any]) -> dict[str, Any]:
        results[key] = {k: v for k, v in run.items() if k != "trainer"}
        return run

    if "base" in groups:
        _base(root, results, keep)
    if "resume" in groups:
        _resume(root, results, keep)
    if "one_rank" in groups:
        _one_rank(root, keep)
    if "families" in groups:
        _families(root, results, keep)
    if "smoothing" in groups:
        _label_smoothing(root, keep)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()


def _families(root: Path, results: dict[str, Any], keep: Any) -> None:
    """T5 and DistilBERT (no ``_no_split_modules``), each strategy against DDP; each
    run's ``save_model()`` against the DDP run's; DistilBERT with the block class named."""
    import torch.distributed as dist

    from shardkit.integrations.hf import ShardkitConfig, fsdp_wrap_policy

    for name in ("t5", "distilbert"):
        runs = {"ddp": _train(name, None, str(root / f"{name}-ddp"))}
        for strategy in STRATEGIES:
            runs[strategy] = _train(name, strategy, str(root / f"{name}-{strategy}"))
        split = ShardkitConfig("fsdp", wrap_classes=("TransformerBlock",))
        if name == "distilbert":
            runs["fsdp-blocks"] = _train(name, split, str(root / f"{name}-fsdp-blocks"))
        for label, run in runs.items():
            keep(f"{name}/{label}", run)
            run["trainer"].save_model(str(root / f"{name}-{label}-saved"))  # on every rank
            if label.startswith("fsdp"):
                results[f"{name}/{label}"]["units"] = _unit_count(run["trainer"])
        dist.barrier()
        for label in runs:
            if label != "ddp" and dist.get_rank() == 0:
                mine, ddp = root / f"{name}-{label}-saved", root / f"{name}-ddp-saved"
                results[f"{name}/{label}/saved"] = _compare_saves(mine, ddp)
    errors = results.setdefault("errors", {})
    for key, call in {
        "no_such_class": lambda: fsdp_wrap_policy(_model("distilbert"), ("TransformerLayer",)),
        "one_string": lambda: ShardkitConfig("fsdp", wrap_classes="TransformerBlock"),  # type: ignore[arg-type]
    }.items():
        try:
            call()
            errors[key] = "no error"
        except ValueError as err:
            errors[key] = f"ValueError: {err}"


def _label_smoothing(root: Path, keep: Any) -> None:
    """GPT-2 with ``label_smoothing_factor``: the Trainer shifts the labels of a causal
    LM (by the class ``accelerator.unwrap_model`` returns), under every strategy."""
    for strategy in (None, *STRATEGIES):
        label = strategy or "ddp"
        run = _train("gpt2", strategy, str(root / f"smooth-{label}"), label_smoothing_factor=0.1)
        trainer = keep(f"smoothing/{label}", run)["trainer"]
        unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        accepts = trainer.model_accepts_loss_kwargs
        keep(
            f"smoothing/{label}", {**run, "unwrapped": type(unwrapped).__name__, "accepts": accepts}
        )


def _resume(root: Path, results: dict[str, Any], keep: Any) -> None:
    """GPT-2, 6 steps straight vs 3 steps (checkpoint-3) then resumed to 6: by the same
    strategy; the sdp checkpoint resumed by fsdp; a checkpoint holding the previous
    release's per-rank optimizer files."""
    import torch.distributed as dist

    long = {"max_steps": 6, "save_strategy": "steps", "save_steps": 3}
    for strategy in ("sdp", "fsdp"):
        keep(
            f"resume/{strategy}/straight",
            _train("gpt2", strategy, str(root / f"straight-{strategy}"), **long),
        )
        split = str(root / f"split-{strategy}")
        _train("gpt2", strategy, split, **long)  # writes checkpoint-3 (and -6)
        ckpt = os.path.join(split, "checkpoint-3")
        if dist.get_rank() == 0:
            results[f"resume/{strategy}/files"] = sorted(os.listdir(ckpt))
            results[f"resume/{strategy}/checkpoint"] = ckpt
            optim = Path(ckpt, "shardkit-optimizer")
            results[f"resume/{strategy}/optimizer_files"] = sorted(os.listdir(optim))
        resumed = _train("gpt2", strategy, split + "-resumed", **long, resume_from_checkpoint=ckpt)
        keep(f"resume/{strategy}/resumed", resumed)
    # another strategy: sdp's checkpoint (OSS shards by parameter) resumed by fsdp (flat
    # shards by element)
    sdp_ckpt = str(root / "split-sdp" / "checkpoint-3")
    across = _train(
        "gpt2", "fsdp", str(root / "sdp-to-fsdp"), **long, resume_from_checkpoint=sdp_ckpt
    )
    keep("resume/sdp-to-fsdp/resumed", across)
    # the previous release's checkpoint: per-rank optimizer files, refused
    old = root / "old-release"
    if dist.get_rank() == 0:
        shutil.copytree(sdp_ckpt, old, ignore=shutil.ignore_patterns("shardkit-optimizer"))
    dist.barrier()
    # the control: without optimizer state (as save_only_model leaves it) Adam starts fresh
    fresh = _train("gpt2", "sdp", str(root / "fresh"), **long, resume_from_checkpoint=str(old))
    keep("resume/sdp/fresh-optimizer", fresh)
    if dist.get_rank() == 0:
        for rank in range(2):
            (old / f"optimizer.rank{rank}-of-2.pt").write_bytes(b"old")
    dist.barrier()
    try:
        _train("gpt2", "sdp", str(root / "old-resumed"), **long, resume_from_checkpoint=str(old))
        results.setdefault("errors", {})["old"] = "no error"
    except ValueError as err:
        results.setdefault("errors", {})["old"] = f"ValueError: {err}"


def _one_rank(root: Path, keep: Any) -> None:
    """On 1 rank (the same global batch: 4 per device): the 2-rank fsdp checkpoint-3
    resumed by fsdp, the 2-rank sdp one by oss."""
    long = {"max_steps": 6, "save_strategy": "no", "per_device_train_batch_size": 2 * BATCH}
    for saved, strategy in (("fsdp", "fsdp"), ("sdp", "oss")):
        ckpt = str(root / f"split-{saved}" / "checkpoint-3")
        out = str(root / f"one-rank-{saved}-to-{strategy}")
        keep(
            f"{saved}-to-{strategy}",
            _train("gpt2", strategy, out, **long, resume_from_checkpoint=ckpt),
        )


def _base(root: Path, results: dict[str, Any], keep: Any) -> None:
    """GPT-2 and BERT: each strategy, bf16, ``save_model()`` and a bad strategy."""
    import torch.distributed as dist

    for name in ("gpt2", "bert"):
        ddp = keep(f"{name}/ddp", _train(name, None, str(root / f"{name}-ddp")))
        ddp["trainer"].save_model(str(root / f"{name}-ddp-saved"))
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
                if dist.get_rank() == 0:
                    ddp_saved = root / f"{name}-ddp-saved"
                    results[f"{name}/fsdp/saved"] = _compare_saves(saved, ddp_saved)
    # mixed precision: bf16 autocast on CPU, against the Trainer's DDP in bf16
    keep("gpt2/ddp/bf16", _train("gpt2", None, str(root / "bf16-ddp"), bf16=True))
    for strategy in ("sdp", "fsdp"):
        keep(
            f"gpt2/{strategy}/bf16",
            _train("gpt2", strategy, str(root / f"bf16-{strategy}"), bf16=True),
        )
    try:
        _trainer("gpt2", "zero", str(root / "zero"))
        results.setdefault("errors", {})["zero"] = "no error"
    except ValueError as err:
        results.setdefault("errors", {})["zero"] = f"ValueError: {err}"


# -- the test ----------------------------------------------------------------------------
def _run_workers(out: Path, nproc: int, *groups: str) -> dict[str, Any]:
    """Run this file's worker on ``nproc`` ranks under torchrun (``groups``: default
    every group of the 2-rank run); what it measured."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).resolve().parents[2]), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        [*cmd, str(nproc), __file__, "--worker", str(out), *groups],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run_workers(tmp_path_factory.mktemp("hf_trainer") / "results.json", 2)


@pytest.fixture(scope="module")
def one_rank(results: dict[str, Any]) -> dict[str, Any]:
    """The 2-rank run's checkpoints resumed on 1 rank (its own torchrun)."""
    root = Path(results["resume/fsdp/checkpoint"]).parents[1]
    return _run_workers(root / "one-rank.json", 1, "one_rank")


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


@pytest.mark.parametrize("name", ["t5", "distilbert"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_other_families_equal_the_trainers_ddp(
    results: dict[str, Any], name: str, strategy: str
) -> None:
    """A seq2seq model with tied embeddings (T5) and an encoder classifier whose class
    has no ``_no_split_modules`` (DistilBERT: fsdp made it one unit; it was refused):
    losses, gradient norms, eval loss and metrics (from the predictions gathered over
    the ranks) equal the Trainer's DDP run's."""
    ddp, mine = results[f"{name}/ddp"], results[f"{name}/{strategy}"]
    assert len(ddp["loss"]) == STEPS and ddp["loss"][0] > 1.0
    assert _close(mine["loss"], ddp["loss"], 1e-5), (mine["loss"], ddp["loss"])
    assert _close(mine["grad_norm"], ddp["grad_norm"], 1e-4), (mine["grad_norm"], ddp["grad_norm"])
    assert set(ddp["eval_metrics"]) == set(EVAL_METRICS)
    for key, want in ddp["eval_metrics"].items():
        assert abs(mine["eval_metrics"][key] - want) < 1e-5, (key, mine["eval_metrics"], want)


def test_fsdp_without_no_split_modules_is_one_unit_or_split_by_config(
    results: dict[str, Any],
) -> None:
    """DistilBERT names no block class: the whole model is one FSDP unit, said in one
    line on rank 0; ``ShardkitConfig(wrap_classes=("TransformerBlock",))`` splits it
    (2 blocks + the root) and trains as DDP does."""
    whole, split, ddp = (results[f"distilbert/{k}"] for k in ("fsdp", "fsdp-blocks", "ddp"))
    assert whole["units"] == 1 and split["units"] == 3
    assert len(whole["printed"]) == 1 and "the whole" in whole["printed"][0]
    assert "DistilBertForSequenceClassification" in whole["printed"][0]
    assert "wrap_classes" in whole["printed"][0]
    assert split["printed"] == [
        "shardkit fsdp: one FSDP unit per TransformerBlock (ShardkitConfig.wrap_classes) + the root"
    ]
    assert results["t5/fsdp"]["printed"] == [
        "shardkit fsdp: one FSDP unit per T5Block (T5ForConditionalGeneration._no_split_modules)"
        " + the root"
    ]
    assert results["t5/fsdp"]["units"] == 5  # 2 encoder + 2 decoder blocks + the root
    assert _close(split["loss"], ddp["loss"], 1e-5), (split["loss"], ddp["loss"])
    assert abs(split["eval_loss"] - ddp["eval_loss"]) < 1e-5
    # a class the model does not have, or one string: refused, naming what to pass
    missing = results["errors"]["no_such_class"]
    assert missing.startswith("ValueError: fsdp: no module of DistilBertForSequenceClassification")
    assert "'TransformerLayer'" in missing and "'TransformerBlock'" in missing  # the classes
    assert results["errors"]["one_string"] == (
        "ValueError: wrap_classes='TransformerBlock' is one string; pass a tuple of class "
        "names: wrap_classes=('TransformerBlock',)"
    )


@pytest.mark.parametrize(
    "run", ["gpt2/fsdp", "t5/oss", "t5/sdp", "t5/fsdp", "distilbert/fsdp", "distilbert/fsdp-blocks"]
)
def test_saved_tensors_equal_the_ddp_save(results: dict[str, Any], run: str) -> None:
    """``save_model()`` writes the tensors the Trainer's DDP run's save writes: the same
    names (a tied weight once: T5's ``shared``, GPT-2's ``wte``; under fsdp each of its
    names was written), the same shapes, the same values to fp32 rounding."""
    saved = results[f"{run}/saved"]
    assert saved["keys"] == saved["ddp_keys"]
    assert saved["shapes_differ"] == []
    assert saved["max_diff"] < 1e-5
    if run.startswith("t5"):
        assert "shared.weight" in saved["keys"] and "lm_head.weight" not in saved["keys"]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_label_smoothing_shifts_a_causal_lms_labels(results: dict[str, Any], strategy: str) -> None:
    """``label_smoothing_factor=0.1`` on GPT-2: the Trainer's ``unwrap_model`` sees the
    GPT-2 class through shardkit's wrappers, so it shifts the labels as under DDP (it saw
    ``ShardedDataParallel`` / ``FullyShardedDataParallel`` and did not shift)."""
    ddp, mine = results["smoothing/ddp"], results[f"smoothing/{strategy}"]
    assert mine["unwrapped"] == ddp["unwrapped"] == "GPT2LMHeadModel"
    assert mine["accepts"] is ddp["accepts"] is True  # num_items_in_batch is passed on
    assert ddp["loss"] != results["gpt2/ddp"]["loss"]  # smoothing changed the loss
    assert _close(mine["loss"], ddp["loss"], 1e-5), (mine["loss"], ddp["loss"])
    assert abs(mine["eval_loss"] - ddp["eval_loss"]) < 1e-5


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
    """Resuming from checkpoint-3 (HF model + the optimizer state as a universal
    checkpoint in ``shardkit-optimizer/``, the current step only) gives steps 4-6 with
    the losses of the uninterrupted run."""
    files = results[f"resume/{strategy}/files"]
    assert {"shardkit-optimizer", "scheduler.pt"} <= set(files)
    assert not [f for f in files if f.startswith("optimizer.")]
    assert "model.safetensors" in files and "trainer_state.json" in files
    # keep=1: the current step only
    assert results[f"resume/{strategy}/optimizer_files"] == ["ckpt-000003", "latest"]
    straight = results[f"resume/{strategy}/straight"]["loss"]
    resumed = results[f"resume/{strategy}/resumed"]["loss"]
    # the resumed run took steps 4-6 only (its log history holds 1-3 from the checkpoint)
    assert results[f"resume/{strategy}/resumed"]["steps_run"] == 3
    assert results[f"resume/{strategy}/straight"]["steps_run"] == 6
    assert len(straight) == len(resumed) == 6
    assert _close(resumed[3:], straight[3:], 1e-6), (resumed, straight)
    eval_straight = results[f"resume/{strategy}/straight"]["eval_loss"]
    assert abs(results[f"resume/{strategy}/resumed"]["eval_loss"] - eval_straight) < 1e-6


def test_resume_by_another_strategy_equals_uninterrupted(results: dict[str, Any]) -> None:
    """sdp's checkpoint-3 resumed by fsdp (same 2 ranks): steps 4-6 have the losses of
    the uninterrupted sdp run (fp32, 1e-5), so the optimizer state really moved (a fresh
    Adam would differ at step 4 by far more)."""
    straight = results["resume/sdp/straight"]
    resumed = results["resume/sdp-to-fsdp/resumed"]
    assert resumed["steps_run"] == 3
    assert len(resumed["loss"]) == 6
    assert _close(resumed["loss"][3:], straight["loss"][3:], 1e-5), (resumed, straight)
    assert abs(resumed["eval_loss"] - straight["eval_loss"]) < 1e-5
    # the control: the same resume without the optimizer state departs from it
    fresh = results["resume/sdp/fresh-optimizer"]
    assert not _close(fresh["loss"][4:], straight["loss"][4:], 1e-3), (fresh, straight)


@pytest.mark.parametrize(("saved", "strategy"), [("fsdp", "fsdp"), ("sdp", "oss")])
def test_resume_at_another_world_size_equals_uninterrupted(
    results: dict[str, Any], one_rank: dict[str, Any], saved: str, strategy: str
) -> None:
    """A checkpoint-3 of 2 ranks resumed on 1 rank (same global batch): steps 4-6 and
    the eval loss equal the uninterrupted 2-rank run's (fp32, 1e-5)."""
    straight = results[f"resume/{saved}/straight"]
    resumed = one_rank[f"{saved}-to-{strategy}"]
    assert resumed["steps_run"] == 3
    assert len(resumed["loss"]) == 6
    assert _close(resumed["loss"][3:], straight["loss"][3:], 1e-5), (resumed, straight)
    assert abs(resumed["eval_loss"] - straight["eval_loss"]) < 1e-5


def test_previous_release_checkpoint_is_refused(results: dict[str, Any]) -> None:
    """A checkpoint holding ``optimizer.rank<r>-of-<n>.pt`` (the previous release's
    format) fails with one line saying what to do."""
    message = results["errors"]["old"]
    assert message.startswith("ValueError: "), message
    assert "optimizer.rank0-of-2.pt, optimizer.rank1-of-2.pt" in message
    assert "resume it with that release" in message and "starts fresh" in message
    assert "\n" not in message


def test_unknown_strategy_is_refused(results: dict[str, Any]) -> None:
    """An unknown strategy fails at construction with one clear line."""
    assert results["errors"]["zero"].startswith("ValueError: unknown shardkit strategy 'zero'")


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2], tuple(sys.argv[3:]) or DEFAULT_GROUPS)
