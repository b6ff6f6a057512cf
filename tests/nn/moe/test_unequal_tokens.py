"""Expert parallelism when the ranks of the ep group pass different numbers of tokens
(a smaller last batch, variable sequence lengths, an empty batch), on 2 spawned gloo
ranks at ep = 2: FairScale's MOELayer used to abort inside gloo (its capacity buffers
differed in size between ranks); both layers must equal the one-process layer run on
each rank's tokens."""

from __future__ import annotations

from typing import Any

from tests.nn.moe import unequal_workers as w

ATOL = 1e-6

CASES: list[dict[str, Any]] = [
    {"layer": "MOELayer", "experts": 2, "counts": [6, 10]},
    {"layer": "MOELayer", "experts": 4, "counts": [12, 4]},  # 2 experts per rank
    {"layer": "MOELayer", "experts": 2, "counts": [0, 4]},  # an empty batch
    {"layer": "MOELayer", "experts": 2, "counts": [8, 8]},
    {"layer": "MoE", "experts": 4, "counts": [6, 10]},
    {"layer": "MoE", "experts": 4, "counts": [10, 0]},
]


def test_unequal_token_counts_per_rank_equal_the_one_process_layer(rank_pool: Any) -> None:
    """Outputs, l_aux (each rank's: the mean over its own tokens), the gate's gradient
    and the experts' gradients (MOELayer: summed over the ep group; MoE: averaged)
    within 1e-6 of the one-process layer on each rank's tokens; with equal counts the
    agreed capacity changes no bit."""
    per_rank = rank_pool(2).run(w.run_unequal_tokens, CASES, timeout_s=60)
    for i, case in enumerate(CASES):
        for rank in range(2):
            res = per_rank[rank][i]
            for key in ("out", "l_aux", "gate", "experts"):
                assert res[key] < ATOL, (case, rank, key, res[key])
            assert res["moved"] > 0, (case, rank)  # the experts got a gradient here
            if case["counts"][rank] == 0:
                assert res["l_aux_value"] == 0.0, (case, rank)
            else:
                assert res["l_aux_value"] > 0, (case, rank)
            if len(set(case["counts"])) == 1:
                assert res["bitwise"], (case, rank)
