"""The gate's noise and bias options against their papers' definitions: Switch's
jitter of the router input, GShard's Gumbel noise on the choice, and DeepSeek-V3's
auxiliary-loss-free expert bias (selection only, moved by the sign of the load
imbalance between steps)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shardkit.nn.moe import MoE, TopKGate


def test_jitter_multiplies_the_router_input_in_training() -> None:
    """Switch (2021): the router sees ``x * U(1 - 1e-2, 1 + 1e-2)`` in training."""
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=2, noisy_gate_policy="Jitter", drop_tokens=False)
    x = torch.randn(10, 6)
    torch.manual_seed(3)
    got = gate(x)
    torch.manual_seed(3)
    noise = torch.empty_like(x).uniform_(1.0 - 1e-2, 1.0 + 1e-2)
    want = gate.route(gate.wg(x * noise))
    assert torch.equal(got.experts, want.experts)
    torch.testing.assert_close(got.weights, want.weights, atol=0, rtol=0)
    assert 0 < float((noise - 1).abs().max()) <= 1e-2


def test_rsample_chooses_by_gumbel_perturbed_logits_weights_from_probs() -> None:
    """GShard (2020): the choice is the top-k of ``logits + Gumbel(0, 1)``; the
    weights stay the softmax probabilities of the chosen experts."""
    torch.manual_seed(0)
    gate = TopKGate(6, 8, k=2, noisy_gate_policy="RSample", drop_tokens=False)
    logits = torch.randn(40, 8)
    torch.manual_seed(5)
    got = gate.route(logits)
    torch.manual_seed(5)
    gumbel = -torch.log(-torch.log(torch.rand(40, 8).clamp_min(1e-20)))
    choice = (logits + gumbel).topk(2, dim=-1).indices
    assert torch.equal(got.experts, choice)
    probs = F.softmax(logits, dim=-1).gather(1, choice)
    torch.testing.assert_close(got.weights, probs / probs.sum(dim=-1, keepdim=True))
    assert not torch.equal(choice, logits.topk(2, dim=-1).indices)  # the noise mattered


def test_expert_bias_moves_the_choice_not_the_weights() -> None:
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=1, drop_tokens=False, bias_update_speed=0.1)
    logits = torch.randn(12, 4)
    probs = F.softmax(logits, dim=-1)
    assert gate.expert_bias is not None
    assert torch.equal(gate.route(logits).experts[:, 0], probs.argmax(dim=-1))  # bias 0
    gate.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 1.0]))
    routing = gate.route(logits)
    assert routing.experts[:, 0].tolist() == [3] * 12  # every choice moved to expert 3
    torch.testing.assert_close(routing.weights[:, 0], probs[:, 3])  # unbiased weights
    share = torch.tensor([0.0, 0.0, 0.0, 1.0])  # the loss sees the biased choice
    torch.testing.assert_close(routing.aux_loss, 4 * (share * probs.mean(dim=0)).sum())


def test_expert_bias_update_is_gamma_times_the_sign_of_the_imbalance() -> None:
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=2, drop_tokens=True, capacity_factor=0.5, bias_update_speed=0.25)
    assert gate.expert_bias is not None and gate.expert_load is not None
    x = torch.randn(16, 6)
    first, second = gate(x), gate(x)
    load = torch.zeros(4, dtype=torch.float64)
    for r in (first, second):  # choices before dropping, both forwards
        load += torch.bincount(r.experts.reshape(-1), minlength=4).double()
    assert int((~first.kept).sum()) > 0  # the capacity dropped some: still counted
    gate.eval()
    gate(x)  # eval forwards do not count
    got = gate.update_expert_bias()
    assert torch.equal(got, load) and float(load.sum()) == 2 * 16 * 2
    want = 0.25 * torch.sign(load.mean() - load).float()
    assert torch.equal(gate.expert_bias, want) and float(want.abs().sum()) > 0
    assert float(gate.expert_load.abs().sum()) == 0.0  # restarted
    assert "gate.expert_bias" in MoE(6, 8, 4, bias_update_speed=1e-3).state_dict()
    plain = MoE(6, 8, 4).state_dict()  # no bias: the state dict keys are as before
    assert not any("expert_bias" in k or "expert_load" in k for k in plain)
    with pytest.raises(RuntimeError, match="build it with bias_update_speed > 0"):
        TopKGate(6, 4).update_expert_bias()
    with pytest.raises(ValueError, match="bias_update_speed must be >= 0.*got -0.1"):
        TopKGate(6, 4, bias_update_speed=-0.1)


def test_expert_bias_balances_a_skewed_router_without_a_loss() -> None:
    """A router that sends every token to expert 0: 100 steps of bias updates (no
    gradient) cut the largest deviation from the mean load (32) by 5x, for the loads
    averaged over the last 40 steps (on a fixed batch the sign update oscillates
    around the balance)."""
    torch.manual_seed(0)
    gate = TopKGate(6, 4, k=1, drop_tokens=False, bias_update_speed=2e-2)
    with torch.no_grad():
        gate.wg.weight.normal_(0, 0.3)
        gate.wg.weight[0] += 1.0
    x = torch.randn(128, 6).abs()
    loads = []
    for _ in range(100):
        gate(x)
        loads.append(gate.update_expert_bias())
    start = float((loads[0] - 32).abs().max())
    assert start > 0.6 * 128, loads[0]  # skewed at the start
    late = torch.stack(loads[-40:]).mean(dim=0)
    assert float((late - 32).abs().max()) < 0.2 * start, late  # near the balance
    assert gate.expert_bias is not None and float(gate.expert_bias[0]) < float(
        gate.expert_bias[1:].min()
    )  # the overloaded expert's bias went down relative to the others
