"""Only this rank's stage of a meta-built GPT is allocated, initialised exactly as the plain
GPT (same values, same generator state after), tied embedding / LM head included."""

from __future__ import annotations

import pytest
import torch

from shardkit.models import GPT, GPTConfig, gpt_stages
from shardkit.nn.pipe import balance_by_size, stage_module
from shardkit.testing import assert_state_dicts_close
from tests.examples import EXAMPLES_DIR

assert EXAMPLES_DIR.is_dir()  # puts the examples on sys.path
from gpt_stage_init import materialize_stage  # noqa: E402

CONFIG = GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16)


@pytest.mark.parametrize("stages", [1, 2, 3])
def test_each_stage_equals_the_plain_models_part(stages: int) -> None:
    torch.manual_seed(7)
    plain = gpt_stages(GPT(CONFIG))
    after = torch.get_rng_state()
    balance = balance_by_size(stages, plain)
    for index in range(stages):
        torch.manual_seed(7)
        with torch.device("meta"):
            model = GPT(CONFIG)
        assert balance_by_size(stages, gpt_stages(model)) == balance  # sizes from meta shapes
        part = stage_module(gpt_stages(model), balance, index)
        materialize_stage(model, part, torch.device("cpu"))
        assert torch.equal(torch.get_rng_state(), after), f"generator state, stage {index}"
        want = stage_module(plain, balance, index).state_dict()
        assert_state_dicts_close(part.state_dict(), want, atol=0.0)
        if stages == 1:  # the tied embedding / LM head stays one tensor
            assert part[0].wte.weight is part[-1].lm_head.weight
        held = sum(p.numel() for p in model.parameters() if not p.is_meta)
        assert held == sum(p.numel() for p in part.parameters())
