"""The main job's ``--compile``: each transformer block compiled before it is wrapped.

``torch.compile`` is applied to every :class:`shardkit.models.Block` in place
(``block.compile()``: parameter names and the module class are kept, so wrapping
policies, checkpoints and state-dict keys are those of an eager run), before the
strategy wraps the model. The compile itself is lazy: dynamo traces a block at its first
call, in the first training step (one graph for every block of the same shapes; a second
one at the first evaluation, which runs without gradients). The wrappers' own code
(FSDP's hooks, DDP's reduction, the pipeline's schedule) runs eagerly around the
compiled blocks; docs/compile.md lists what works with which wrapper.

Refused (exit 2): ``--strategy offload`` (its slices move parameters between tiers
during the step; not tried with compiled blocks) and ``--moe-experts`` (the experts'
routing changes token counts every step, so each MoE block would recompile).
"""

from __future__ import annotations

from shardkit.models import GPT

REFUSED_STRATEGIES = ("offload",)


def compile_error(
    strategy: str, moe_experts: int, cp: int = 1, sequence_parallel: bool = False
) -> str | None:
    """Why ``--compile`` does not fit ``--strategy`` / ``--moe-experts`` / ``--cp`` /
    ``--sequence-parallel``, or None."""
    if strategy in REFUSED_STRATEGIES:
        return (
            f"--compile does not apply to --strategy {strategy} (its slices move parameters "
            "between tiers during the step); drop --compile or use another strategy"
        )
    if moe_experts:
        return (
            f"--compile does not apply to --moe-experts {moe_experts} (expert routing "
            "changes token counts every step: each MoE block would recompile); drop --compile"
        )
    if cp > 1 or sequence_parallel:
        flag = f"--cp {cp}" if cp > 1 else "--sequence-parallel"
        return (
            f"--compile has not been tried with {flag} (their collectives run inside each "
            f"block, where no test compiles them yet); drop --compile or {flag}"
        )
    return None


def compile_blocks(model: GPT) -> int:
    """Compile each block of ``model`` in place (inductor, torch's default backend);
    returns how many. Call before the strategy wraps the model."""
    for block in model.blocks:
        block.compile()
    return len(model.blocks)
