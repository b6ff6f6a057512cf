"""What the main job shows at its end and on request: the loss plot, a generated text
sample, and ``torch.profiler`` traces of chosen steps.

- :func:`plot_metrics`: ``loss.png`` next to ``metrics.json`` (train and validation
  loss against step, tokens/s below), matplotlib's Agg backend (no display needed);
  matplotlib is optional (``pip install -e '.[examples]'``): without it the job skips
  the plot with one line and writes everything else.
- :func:`sample_text`: the trained byte-level GPT continues a prompt (rank 0, from the
  consolidated state dict loaded into a plain :class:`GPT`, so it is the same for
  every strategy).
- :class:`StepProfiler`: ``--profile-steps a:b`` records steps ``a`` to ``b``
  (inclusive) with ``torch.profiler`` and writes one Chrome trace per rank,
  ``trace-rank<r>.json`` in the out dir (open it in ``chrome://tracing`` or Perfetto).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from shardkit.extras import require
from shardkit.models import GPT, gpt_config

__all__ = ["SAMPLE_PROMPT", "StepProfiler", "parse_steps", "plot_metrics", "sample_text"]

SAMPLE_PROMPT = "The "


def plot_metrics(metrics: dict[str, Any], path: Path) -> None:
    """Write the loss curves and tokens/s of ``metrics`` (``metrics.json``'s content)
    as a PNG at ``path``.

    Raises:
        MissingDependency: matplotlib is not installed (it is optional: the
            ``examples`` extra); nothing is written, the caller skips the plot.
    """
    require("matplotlib", path.name)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for key, label, style in (("train_loss", "train", "-"), ("val_loss", "validation", "o-")):
        points = metrics.get(key) or []
        if points:
            steps, values = zip(*points)
            loss_ax.plot(steps, values, style, label=label, markersize=4)
    loss_ax.set_ylabel("loss (nats/byte)")
    loss_ax.set_title(
        f"{metrics.get('model_size', '')} GPT, {metrics.get('strategy', '')}, "
        f"{metrics.get('world_size', '')} rank(s)"
    )
    loss_ax.legend()
    loss_ax.grid(alpha=0.3)
    speed = metrics.get("tokens_per_s") or []
    if speed:
        steps, values = zip(*speed)
        speed_ax.plot(steps, values, "o-", color="tab:green", markersize=4)
    speed_ax.set_xlabel("step")
    speed_ax.set_ylabel("tokens/s")
    speed_ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@torch.no_grad()
def sample_text(
    state: dict[str, Any],
    model_size: str,
    vocab_size: int,
    seq_len: int,
    prompt: str = SAMPLE_PROMPT,
    new_tokens: int = 120,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
) -> str:
    """The prompt and ``new_tokens`` bytes sampled from a plain GPT holding ``state``
    (top-k sampling at ``temperature``, seeded: the same state gives the same text).

    Args:
        state: the plain GPT's ``state_dict`` (``Strategy.consolidated_model_state``).
        model_size, vocab_size, seq_len: the GPT's shape (``seq_len``: its context).
        prompt: the text to continue. Default :data:`SAMPLE_PROMPT`.
        new_tokens: bytes to generate. Default 120.
        temperature: softmax temperature. Default 0.8.
        top_k: sample among the k likeliest bytes. Default 40.
        seed: the sampling generator's seed. Default 0.
    """
    model = GPT(gpt_config(model_size, vocab_size=vocab_size, block_size=seq_len))
    model.load_state_dict({k: v.cpu() for k, v in state.items()})  # copied into fp32
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    idx = torch.tensor([list(prompt.encode("utf-8"))], dtype=torch.long)
    for _ in range(new_tokens):
        logits, _ = model(idx[:, -seq_len:])
        logits = logits[:, -1, :] / temperature
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
        probs = F.softmax(logits.masked_fill(logits < kth, float("-inf")), dim=-1)
        idx = torch.cat([idx, torch.multinomial(probs, 1, generator=gen)], dim=1)
    return bytes(idx[0].tolist()).decode("utf-8", errors="replace")


def parse_steps(text: str) -> tuple[int, int]:
    """``"a:b"`` -> ``(a, b)`` with ``1 <= a <= b``.

    Raises:
        ValueError: another form.
    """
    first, sep, last = text.partition(":")
    try:
        a, b = int(first), int(last)
    except ValueError:
        a = b = 0
    if not sep or not 1 <= a <= b:
        raise ValueError(f"--profile-steps wants FIRST:LAST with 1 <= FIRST <= LAST, got {text!r}")
    return a, b


class StepProfiler:
    """``torch.profiler`` around steps ``first..last`` of the training loop.

    Call :meth:`before_step` with the step about to run and :meth:`after_step` with
    the step just finished; after ``last`` (or at :meth:`close`, if the run stops
    earlier) the trace goes to ``out_dir/trace-rank<r>.json``. Each recorded step is
    one ``train_step <n>`` range; the wrappers' own labels (``FSDP::pre_forward``, ...)
    nest in it.

    Args:
        steps: ``(first, last)`` (:func:`parse_steps`), or None: a no-op.
        out_dir: where the trace goes.
        rank: this process's rank (names the file).
    """

    def __init__(self, steps: tuple[int, int] | None, out_dir: Path, rank: int) -> None:
        self.steps = steps
        self.path = out_dir / f"trace-rank{rank}.json"
        self._prof: profile | None = None
        self._range: record_function | None = None

    def before_step(self, step: int) -> None:
        if self.steps is not None and step == self.steps[0] and self._prof is None:
            activities = [ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(ProfilerActivity.CUDA)
            self._prof = profile(activities=activities)
            self._prof.__enter__()
        if self._prof is not None:
            self._range = record_function(f"train_step {step}")
            self._range.__enter__()

    def after_step(self, step: int) -> None:
        self._end_range()
        if self.steps is not None and step == self.steps[1]:
            self.close()

    def _end_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None

    def close(self) -> None:
        """Stop and write the trace, if one is recording."""
        self._end_range()
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(str(self.path))
