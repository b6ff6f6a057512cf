"""A missing optional package costs its feature, never the run: the entry points a user
runs, each in a fresh interpreter where the package cannot be imported (as after
``pip install -e .``, which installs none of the extras)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"


def run_without(blocked: list[str], argv: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run the script ``argv[0]`` (a path, or ``-m module``) with ``argv[1:]`` in a new
    interpreter in which every module of ``blocked`` fails to import."""
    script, *args = argv
    runner = (
        f"runpy.run_module({args[0]!r}, run_name='__main__', alter_sys=True)"
        if script == "-m"
        else f"sys.path.insert(0, {str(Path(script).parent)!r}); "
        f"runpy.run_path({script!r}, run_name='__main__')"
    )
    code = (
        "import runpy, sys\n"
        f"for name in {blocked!r}: sys.modules[name] = None\n"
        f"sys.argv = {[script if script != '-m' else args[0], *args[script == '-m' :]]!r}\n"
        f"{runner}\n"
    )
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    return subprocess.run(
        [sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=240, env=env
    )


def test_main_job_without_matplotlib_writes_everything_but_the_plot(tmp_path: Path) -> None:
    """train_gpt.py as a plain script (one rank): exit 0, one warning line, and the
    metrics, checkpoint, model and sample all written; only loss.png is missing."""
    out = tmp_path / "run"
    proc = run_without(
        ["matplotlib"],
        [
            str(ROOT / "examples" / "train_gpt.py"),
            *["--model-size", "tiny", "--batch-size", "4", "--seq-len", "32"],
            *["--eval-batches", "1", "--steps", "4", "--eval-every", "2", "--save-every", "4"],
            *["--out-dir", str(out)],
        ],
        tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    line = "train_gpt.py: warning: loss.png skipped: pip install matplotlib"
    assert proc.stderr.count(line) == 1, proc.stderr[-3000:]
    assert [s for s in proc.stderr.splitlines() if "matplotlib" in s] == [line]
    assert not (out / "loss.png").exists()
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["step"] == 4 and [s for s, _ in metrics["val_loss"]] == [0, 2, 4]
    assert (out / "model.pt").stat().st_size > 100_000
    assert (out / "sample.txt").read_text(encoding="utf-8").startswith("The ")
    assert (out / "latest").exists() and (out / "ckpt-000004").is_dir()
    assert f"wrote {out}/metrics.json\n" in proc.stdout


def test_compare_without_matplotlib_writes_the_results(tmp_path: Path) -> None:
    """benchmarks.compare writes its plots last: without matplotlib the JSON and the
    Markdown table are still written (``--render`` of a saved run: the same path)."""
    saved = tmp_path / "compare-20261202-070123.json"
    shutil.copy(RESULTS / saved.name, saved)
    proc = run_without(["matplotlib"], ["-m", "benchmarks.compare", "--render", str(saved)], ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "plots skipped: pip install matplotlib\n" in proc.stdout
    page = saved.with_suffix(".md").read_text()
    assert "| torch DDP |" in page and page in proc.stdout
    assert json.loads(saved.read_text())["plots"] == []
    assert not list(tmp_path.glob("*.png"))


def test_hf_examples_without_transformers_say_what_to_install(tmp_path: Path) -> None:
    """The Hugging Face examples are nothing without transformers: one line on stderr
    naming the package and the extra, exit 1, no traceback."""
    for name in ("hf_trainer.py", "hf_gpt2_fsdp.py"):
        proc = run_without(["transformers"], [str(ROOT / "examples" / name)], tmp_path)
        assert proc.returncode == 1, (name, proc.stderr[-3000:])
        assert proc.stderr == (
            f"{name}: error: {name} needs transformers: pip install -e '.[hf]'\n"
        ), proc.stderr[-3000:]
