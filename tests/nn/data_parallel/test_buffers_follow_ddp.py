"""Buffers (BatchNorm statistics) of every wrapper against torch DDP, rank by rank.

torch DDP's rule (torch 2.13, read in ``torch/nn/parallel/distributed.py`` and
measured): rank 0's buffers are broadcast at construction, and before a forward when
the previous forward of the DDP module ran with grad enabled outside ``no_sync`` (and
before the first forward), in train and eval mode alike; backward and the optimizer
step do not touch buffers. With ``no_sync`` accumulation that is one broadcast per step,
before the micro-batch inside ``no_sync``.

Each rank runs torch DDP and the wrapper side by side on the same local micro-batches
(different on every rank; the initial buffers differ per rank too) and compares its
buffers with DDP's on the same rank after every operation: the forward inside and
outside ``no_sync``, each backward, the optimizer step, an eval forward under
``no_grad``, ``state_dict()``, then an eval forward with grad, a train forward without
grad, forwards inside ``summon_full_params``, and frozen (eval-mode) BatchNorms in a
training model: two forwards, the second broadcasting, then one backward through both
(DDP keeps the buffers' version counters, so the backward runs) and a step. Wrappers: FSDP with one unit, FSDP
with units nested twice (``auto_wrap``), ShardedDataParallel, and OSS under torch DDP
(which must leave DDP's buffers alone); FSDP (nested) and ShardedDataParallel also with
``broadcast_buffers=False`` against DDP's ``forward_sync_buffers=False`` (broadcast at
construction only). World sizes 2 and 3, one pool run each.

``bn0`` sees only the input and the broadcast buffers, so its statistics and every
``num_batches_tracked`` must match bit for bit; the BatchNorms behind trained layers
follow the parameters, which differ from DDP's by fp32 rounding of the gradient
average (0 at 2 ranks, up to about 1e-8 at 3).
"""

from __future__ import annotations

from typing import Any

import pytest

from shardkit.testing import assert_tensors_close
from tests.nn.data_parallel import buffer_sync_workers as w

WORLDS = [2, 3]
_CACHE: dict[int, dict[str, list[Any]]] = {}


@pytest.fixture(scope="module")
def results(rank_pool: Any) -> Any:
    def get(world: int) -> dict[str, list[Any]]:
        if world not in _CACHE:
            per_rank = rank_pool(world).run(w.buffers_vs_ddp, list(w.WRAPPERS))
            _CACHE[world] = {k: [r[i] for r in per_rank] for i, k in enumerate(w.WRAPPERS)}
        return _CACHE[world]

    return get


def _mismatches(result: dict[str, Any]) -> list[str]:
    """Every (operation, buffer) whose value differs from DDP's on this rank."""
    found = []
    for what, mine, ref in result["records"]:
        if sorted(mine) != sorted(ref):
            found.append(f"after {what}: buffer names {sorted(mine)} != {sorted(ref)}")
            continue
        for name, want in ref.items():
            exact = name.startswith("bn0.") or name.endswith("num_batches_tracked")
            try:
                assert_tensors_close(
                    mine[name],
                    want,
                    atol=0.0 if exact else 1e-6,
                    rtol=0.0 if exact else 1e-5,
                    name=f"after {what}: {name}",
                )
            except AssertionError as err:
                found.append(str(err))
    return found


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("wrapper", w.WRAPPERS)
def test_buffers_equal_ddp_after_every_operation(results: Any, world: int, wrapper: str) -> None:
    per_rank = results(world)[wrapper]
    errors = [
        f"rank {r}: ...{res['error'][-600:]}" for r, res in enumerate(per_rank) if res["error"]
    ]
    assert not errors, f"{wrapper} at {world} ranks:\n" + "\n".join(errors)
    for rank, result in enumerate(per_rank):
        assert len(result["records"]) == 1 + w.STEPS * 7 + 6 + 2
        found = _mismatches(result)
        assert not found, (
            f"{wrapper} at {world} ranks, rank {rank}: {len(found)} buffers differ from "
            "torch DDP's, e.g.\n" + "\n".join(found[:2] + found[2:][-3:])
        )
        params, ref_params = result["params"]
        for name, want in ref_params.items():
            assert_tensors_close(
                params[name], want, atol=1e-6, rtol=1e-5, name=f"{wrapper} rank {rank} {name}"
            )
