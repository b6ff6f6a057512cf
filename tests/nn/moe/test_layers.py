"""MoE layers in one process: FairScale's Top2Gate / MOELayer against GShard's algorithm
(and against FairScale where it is installed), the top-k gate's routing invariants
(hypothesis), MoE against the token-by-token reference, losses, bad input."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from shardkit.nn.moe import MoE, MOELayer, Top2Gate, TopKGate, expert_parameters
from tests.nn.moe.reference import gshard_top2, moe_reference, topk_route


def _gumbel(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.distributions.Gumbel(torch.tensor(0.0), torch.tensor(1.0)).rsample(shape)


@pytest.mark.parametrize(("tokens", "experts"), [(8, 4), (16, 2), (12, 6), (32, 8)])
def test_top2gate_is_gshards_algorithm(tokens: int, experts: int) -> None:
    torch.manual_seed(tokens + experts)
    gate = Top2Gate(model_dim=6, num_experts=experts)
    x = torch.randn(tokens, 6)
    torch.manual_seed(7)
    l_aux, combine, dispatch = gate(x)
    torch.manual_seed(7)
    want_aux, want = gshard_top2(gate.wg(x).detach(), _gumbel((tokens, experts)))
    assert combine.shape == (tokens, experts, 2 * tokens // experts)
    assert l_aux.item() == pytest.approx(want_aux, rel=1e-6)
    got = {(t, e): (c, combine[t, e, c].item()) for t, e, c in combine.nonzero().tolist()}
    assert got.keys() == want.keys()
    for key, (slot, weight) in want.items():
        assert got[key][0] == slot and got[key][1] == pytest.approx(weight, rel=1e-5)
    assert torch.equal(dispatch, combine != 0)


def test_top2gate_drops_beyond_capacity() -> None:
    gate = Top2Gate(model_dim=1, num_experts=4)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.tensor([[10.0], [5.0], [-20.0], [-20.0]]))
    torch.manual_seed(0)
    _, combine, _ = gate(torch.ones(8, 1))  # every token: expert 0, then expert 1; C = 4
    p0, p1 = torch.tensor([10.0, 5.0, -20.0, -20.0]).softmax(0)[:2].tolist()
    per_token = combine.sum(dim=2)
    want = torch.zeros(8, 4)
    want[:4, 0], want[:4, 1] = p0 / (p0 + p1), p1 / (p0 + p1)  # tokens 4..7: both dropped
    torch.testing.assert_close(per_token, want)
    assert combine[:4, 0].argmax(dim=1).tolist() == [0, 1, 2, 3]  # slots in token order


def test_top2gate_needs_tokens_a_multiple_of_experts() -> None:
    with pytest.raises(ValueError, match="7 tokens, 4 experts"):
        Top2Gate(3, 4)(torch.randn(7, 3))


def _moe_layer(experts: int, dim: int) -> tuple[MOELayer, nn.ModuleList]:
    gate = Top2Gate(dim, experts)
    modules = nn.ModuleList([nn.Linear(dim, dim) for _ in range(experts)])
    return MOELayer(gate, modules), modules


def test_moelayer_output_l_aux_and_gradients_follow_gshard() -> None:
    torch.manual_seed(0)
    layer, modules = _moe_layer(4, 5)
    x = torch.randn(4, 4, 5, requires_grad=True)
    torch.manual_seed(3)
    out = layer(x)
    torch.manual_seed(3)
    logits = layer.gate.wg(x.reshape(-1, 5))
    want_aux, routes = gshard_top2(logits.detach(), _gumbel((16, 4)))
    tokens = x.reshape(-1, 5)
    rows = [torch.zeros(5) for _ in range(16)]
    for (t, e), (_, w) in routes.items():
        rows[t] = rows[t] + w * modules[e](tokens[t])
    assert layer.l_aux is not None and layer.l_aux.item() == pytest.approx(want_aux, rel=1e-6)
    torch.testing.assert_close(out, torch.stack(rows).reshape(4, 4, 5), atol=1e-6, rtol=1e-5)
    assert all(getattr(p, "expert", False) for p in modules.parameters())
    assert set(expert_parameters(layer)) == {
        f"experts.{i}.{n}" for i in range(4) for n in ("weight", "bias")
    }
    # gradients reach the gate (through the combine weights) and every routed expert
    (out.square().sum() + layer.l_aux).backward()
    assert layer.gate.wg.weight.grad is not None and layer.gate.wg.weight.grad.abs().sum() > 0
    used = {e for (_, e) in routes}
    for e in used:
        assert modules[e].weight.grad is not None and modules[e].weight.grad.abs().sum() > 0


def test_moelayer_rejects_bad_shapes() -> None:
    layer, _ = _moe_layer(2, 3)
    with pytest.raises(
        ValueError, match=r"one \(sequence, token, model\) tensor; got shapes \[\(4, 3\)\]"
    ):
        layer(torch.randn(4, 3))
    # a gate of 4 experts over 2 local ones (one process) ran each expert on two
    # experts' tokens
    two = MOELayer(Top2Gate(3, 4), nn.ModuleList([nn.Linear(3, 3) for _ in range(2)]))
    with pytest.raises(ValueError, match=r"routes to 4 experts, but the group holds 1 rank"):
        two(torch.randn(4, 2, 3))


def test_moelayer_equals_fairscale(tmp_path: Any) -> None:
    fairscale_moe = pytest.importorskip("fairscale.nn.moe")
    # FairScale's MOELayer needs torch.distributed: a world of one gloo rank
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/init", rank=0, world_size=1)
    try:
        _compare_with_fairscale(fairscale_moe)
    finally:
        dist.destroy_process_group()


def _compare_with_fairscale(fairscale_moe: Any) -> None:
    torch.manual_seed(0)
    ours, _ = _moe_layer(4, 6)
    theirs = fairscale_moe.MOELayer(
        fairscale_moe.Top2Gate(6, 4), nn.ModuleList([nn.Linear(6, 6) for _ in range(4)]), group=None
    )
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 6, 6)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    torch.manual_seed(11)
    out_a = ours(xa)
    torch.manual_seed(11)
    out_b = theirs(xb)
    torch.testing.assert_close(out_a, out_b, atol=0, rtol=0)
    assert ours.l_aux is not None
    torch.testing.assert_close(ours.l_aux, theirs.l_aux, atol=0, rtol=0)
    (out_a.square().sum() + ours.l_aux).backward()
    (out_b.square().sum() + theirs.l_aux).backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-7, rtol=1e-6)
    for (name, pa), pb in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(pa.grad, pb.grad, atol=1e-7, rtol=1e-6, msg=name)


# the general gate ------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(1, 40),
    experts=st.integers(1, 8),
    data=st.data(),
    factor=st.sampled_from([0.1, 0.5, 1.0, 1.25, 2.0, 4.0]),
    min_capacity=st.integers(0, 3),
    drop=st.booleans(),
)
def test_every_kept_token_goes_to_its_top_k_with_the_right_weights(
    tokens: int, experts: int, data: Any, factor: float, min_capacity: int, drop: bool
) -> None:
    k = data.draw(st.integers(1, experts))
    seed = data.draw(st.integers(0, 2**16))
    torch.manual_seed(seed)
    gate = TopKGate(5, experts, k, factor, factor, min_capacity, drop)
    x = torch.randn(tokens, 5)
    routing = gate(x)
    probs = F.softmax(gate.wg(x).detach(), dim=-1)
    cap = max(min_capacity, math.ceil(k * tokens * factor / experts)) if drop else None
    assert routing.capacity == cap
    want = topk_route(probs, k, cap, gate.normalize_weights)
    top = probs.topk(k, dim=-1).indices
    for t in range(tokens):
        assert set(routing.experts[t].tolist()) == set(top[t].tolist())  # exactly its top-k
        assert [e for e, _, _ in want[t]] == routing.experts[t].tolist()
        assert routing.kept[t].tolist() == [kept for _, _, kept in want[t]]
        weights = routing.weights[t]
        assert weights.tolist() == pytest.approx([w for _, w, _ in want[t]], rel=1e-5, abs=1e-7)
        if gate.normalize_weights:
            share = probs[t, routing.experts[t]] / probs[t, routing.experts[t]].sum()
            assert weights.sum().item() == pytest.approx(
                (share * routing.kept[t]).sum().item(), rel=1e-5
            )
            if routing.kept[t].all():
                assert weights.sum().item() == pytest.approx(1.0, rel=1e-5)
    assert routing.counts.tolist() == [
        int((routing.experts[routing.kept] == e).sum()) for e in range(experts)
    ]
    if cap is not None:
        assert max(routing.counts.tolist()) <= cap
    else:
        assert bool(routing.kept.all())


def test_losses_follow_switch_and_st_moe() -> None:
    torch.manual_seed(0)
    gate = TopKGate(4, 3, k=2, drop_tokens=False)
    x = torch.randn(10, 4)
    routing = gate(x)
    logits = gate.wg(x).detach().double()
    probs = logits.softmax(-1)
    share = torch.stack([(routing.experts == e).sum() for e in range(3)]).double() / 20
    assert routing.aux_loss.item() == pytest.approx(
        3 * float((share * probs.mean(0)).sum()), rel=1e-6
    )
    z = float((torch.logsumexp(logits, -1) ** 2).mean())
    assert routing.z_loss.item() == pytest.approx(z, rel=1e-6)
    # a balanced router: aux = 1
    with torch.no_grad():
        gate.wg.weight.zero_()
    assert TopKGate.route(gate, torch.zeros(6, 3)).aux_loss.item() == pytest.approx(1.0)


def test_no_tokens_give_zero_losses_not_nan() -> None:
    """Regression: a rank routing no token (an empty batch) got ``l_aux`` NaN (the mean
    over zero tokens) from both gates; its losses are now 0 and its gradients 0."""
    torch.manual_seed(0)
    moe = MoE(hidden_size=8, ffn_hidden_size=16, num_experts=4, k=2, z_loss_coef=0.1)
    out, l_aux, counts = moe(torch.randn(0, 3, 8, requires_grad=True))
    assert out.shape == (0, 3, 8) and counts.tolist() == [0, 0, 0, 0]
    assert l_aux.item() == 0.0
    (out.sum() + l_aux).backward()
    assert moe.gate.wg.weight.grad is not None
    assert moe.gate.wg.weight.grad.abs().sum().item() == 0.0
    routing = moe.gate(torch.randn(0, 8))
    assert (routing.aux_loss.item(), routing.z_loss.item()) == (0.0, 0.0)
    layer, _ = _moe_layer(4, 5)
    layer(torch.randn(0, 4, 5))
    assert layer.l_aux is not None and layer.l_aux.item() == 0.0


@pytest.mark.parametrize(
    ("k", "drop", "factor", "shared"),
    [
        (1, True, 0.5, 0),
        (2, True, 0.75, 0),
        (2, False, 1.0, 1),
        (3, True, 1.0, 0),
        (1, False, 1.0, 2),
    ],
)
def test_moe_equals_the_token_by_token_reference(
    k: int, drop: bool, factor: float, shared: int
) -> None:
    torch.manual_seed(0)
    moe = MoE(
        6,
        10,
        4,
        k=k,
        capacity_factor=factor,
        min_capacity=0,
        drop_tokens=drop,
        num_shared_experts=shared,
        z_loss_coef=1e-3,
    )
    x = torch.randn(3, 7, 6, requires_grad=True)
    out, l_aux, counts = moe(x)
    routing = moe.last_routing
    assert routing is not None
    if drop and factor < 1:
        assert int(routing.kept.sum()) < 21 * k  # the capacity binds: tokens dropped
    assert int(counts.sum()) == int(routing.kept.sum())
    assert l_aux.item() == pytest.approx((routing.aux_loss + 1e-3 * routing.z_loss).item())
    w1 = moe.experts.w1.detach().clone().requires_grad_()
    w2 = moe.experts.w2.detach().clone().requires_grad_()
    x2 = x.detach().clone().requires_grad_()
    want = moe_reference(moe, x2, w1, w2)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    target = torch.randn_like(out)
    gate_grad = torch.autograd.grad((want * target).sum(), [moe.gate.wg.weight, w1, w2, x2])
    (out * target).sum().backward()
    for got, ref in zip(
        [moe.gate.wg.weight.grad, moe.experts.w1.grad, moe.experts.w2.grad, x.grad],
        gate_grad,
        strict=True,
    ):
        assert got is not None
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


def test_capacity_differs_in_eval_mode() -> None:
    moe = MoE(4, 8, 4, k=1, capacity_factor=0.5, eval_capacity_factor=2.0, min_capacity=0)
    x = torch.randn(16, 4)
    moe(x)
    assert moe.last_routing is not None and moe.last_routing.capacity == 2
    moe.eval()
    moe(x)
    assert moe.last_routing.capacity == 8


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"k": 5}, r"k must be in \[1, num_experts=4\]; got k=5"),
        ({"k": 0}, "got k=0"),
        ({"capacity_factor": 0.0}, "capacity_factor must be > 0; got 0.0"),
        ({"eval_capacity_factor": -1.0}, "eval_capacity_factor must be > 0; got -1.0"),
        ({"noisy_gate_policy": "gumbel"}, "noisy_gate_policy must be one of"),
    ],
)
def test_bad_input_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MoE(4, 8, 4, **kwargs)


def test_noise_policies_only_in_training() -> None:
    torch.manual_seed(0)
    x = torch.randn(12, 4)
    for policy in ("Jitter", "RSample"):
        moe = MoE(4, 8, 4, k=2, noisy_gate_policy=policy, drop_tokens=False)
        moe.eval()
        plain = MoE(4, 8, 4, k=2, drop_tokens=False)
        plain.load_state_dict(moe.state_dict())
        plain.eval()
        torch.testing.assert_close(moe(x)[0], plain(x)[0], atol=0, rtol=0)


def test_ddp_check_is_not_skipped_for_a_new_ddp_at_a_freed_ones_id(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Regression: the expert-parallel MoE remembered the last DDP module it checked by
    ``id``, so a new DDP module built where a freed one was (the same id, as CPython
    reuses addresses) went unchecked. Stand-ins for DDP and its check, in one process."""
    import copy

    from shardkit.nn.moe import layer as moe_layer

    class FakeDDP:
        pass

    checked: list[int] = []
    active: list[FakeDDP] = []
    monkeypatch.setattr(
        moe_layer.DistributedDataParallel, "_get_active_ddp_module", lambda: active[-1]
    )
    monkeypatch.setattr(moe_layer, "check_ddp_leaves_experts", lambda d, e: checked.append(id(d)))
    moe = MoE(hidden_size=8, ffn_hidden_size=16, num_experts=4)
    moe.ep_size = 2  # as if expert parallel: the check runs
    active.append(FakeDDP())
    moe._check_data_parallel()
    moe._check_data_parallel()  # the same DDP: checked once
    freed = id(active.pop())  # the only reference: freed here
    active.append(FakeDDP())  # CPython hands the freed address out again, usually
    moe._check_data_parallel()
    same = id(active[-1]) == freed
    assert len(checked) == 2, f"the new DDP module (at the freed one's id: {same}) unchecked"
    copied = copy.deepcopy(moe)  # a copy is checked again under each DDP
    copied._check_data_parallel()
    assert len(checked) == 3
