"""Peak memory while loading a checkpoint of the anchor GPT (23.2M parameters), by method.

Each method runs in a fresh process: build the model (and AdamW with state, for the
``+optim`` rows), reset the peak resident set (``/proc/self/clear_refs``), load, and
report the growth of the peak (``VmHWM``, anonymous and file-backed pages) and of the
peak anonymous memory (``RssAnon``, sampled every millisecond: memory that is not a
page of a mapped file the kernel can drop). Methods:

- ``torch.load``: ``torch.load(full state dict)`` then ``load_state_dict``;
- ``torch.load mmap``: the same with ``mmap=True``;
- ``universal``: ``load_universal`` of a 1-rank universal checkpoint (safetensors
  slices copied straight into the parameters).

Usage: ``python -m benchmarks.universal_load_memory [--dir DIR]`` (Linux only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from shardkit.checkpoint.universal import load_universal, save_universal
from shardkit.models import GPT, GPTConfig

ANCHOR = GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=8, n_embd=512)


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _model_and_optim(with_optim: bool) -> tuple[GPT, torch.optim.Optimizer | None]:
    torch.manual_seed(0)
    model = GPT(ANCHOR)
    if not with_optim:
        return model, None
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optim.step()
    return model, optim


def _save(directory: Path) -> None:
    model, optim = _model_and_optim(True)
    assert optim is not None
    torch.save(model.state_dict(), directory / "model.pt")
    torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, directory / "full.pt")
    save_universal(directory / "universal_model", 1, model)
    save_universal(directory / "universal_full", 1, model, optim)


def _measure(directory: Path, method: str, with_optim: bool) -> dict[str, float]:
    model, optim = _model_and_optim(with_optim)
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM
    base_hwm, base_anon = _status("VmHWM"), _status("RssAnon")
    peak_anon, done = [base_anon], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.perf_counter()
    if method.startswith("torch.load"):
        name = "full.pt" if with_optim else "model.pt"
        state = torch.load(directory / name, weights_only=True, mmap=method.endswith("mmap"))
        if with_optim:
            model.load_state_dict(state["model"])
            assert optim is not None
            optim.load_state_dict(state["optim"])
        else:
            model.load_state_dict(state)
        del state
    else:
        load_universal(
            directory / ("universal_full" if with_optim else "universal_model"), model, optim
        )
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    peak_anon[0] = max(peak_anon[0], _status("RssAnon"))
    return {
        "hwm_mib": (_status("VmHWM") - base_hwm) / 2**20,
        "anon_mib": (peak_anon[0] - base_anon) / 2**20,
        "seconds": seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # METHOD WITH_OPTIM
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.one:
        print(json.dumps(_measure(args.dir, args.one[0], args.one[1] == "1")))
        return
    directory = args.dir or Path(tempfile.mkdtemp(prefix="universal_mem_"))
    _save(directory)
    params = sum(p.numel() for p in GPT(ANCHOR).parameters())
    print(f"anchor GPT: {params / 1e6:.1f}M parameters, {params * 4 / 2**20:.1f} MiB fp32")
    for with_optim in (False, True):
        for method in ("torch.load", "torch.load mmap", "universal"):
            out = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.universal_load_memory",
                    "--dir",
                    str(directory),
                    "--one",
                    method,
                    str(int(with_optim)),
                ],
                capture_output=True,
                text=True,
                check=True,
            )
            r = json.loads(out.stdout.strip().splitlines()[-1])
            label = method + (" +optim" if with_optim else "")
            print(
                f"{label:<24} peak RSS +{r['hwm_mib']:7.1f} MiB   peak anonymous "
                f"+{r['anon_mib']:7.1f} MiB   {r['seconds']:.2f} s"
            )


if __name__ == "__main__":
    main()
