"""The main job's ``--compile``: off by default, each block compiled in place (names
kept), refused with a one-line error where it does not apply."""

from __future__ import annotations

import pytest

from shardkit.models import GPT, GPTConfig
from tests.examples import EXAMPLES_DIR

assert EXAMPLES_DIR.is_dir()  # importing tests.examples puts the examples on sys.path

import gpt_compile  # noqa: E402
import train_gpt  # noqa: E402
from gpt_data import InputError  # noqa: E402


def test_compile_is_off_by_default_and_parsed() -> None:
    assert train_gpt.parse_args([]).compile is False
    config = train_gpt.parse_args(["--compile", "--strategy", "fsdp"])
    assert config.compile is True and config.flags()["compile"] is True


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategy", "offload"], "--compile does not apply to --strategy offload"),
        (["--moe-experts", "4"], "--compile does not apply to --moe-experts 4"),
        (["--strategy", "ddp", "--cp", "2"], "--compile has not been tried with --cp 2"),
        (
            ["--strategy", "ddp", "--tp", "2", "--sequence-parallel"],
            "--compile has not been tried with --sequence-parallel",
        ),
    ],
)
def test_compile_refused_where_it_does_not_apply(argv: list[str], message: str) -> None:
    with pytest.raises(InputError, match=message):
        train_gpt.parse_args(["--compile", *argv])
    train_gpt.parse_args(argv)  # the same flags without --compile are fine


def test_compile_blocks_in_place_keeps_names() -> None:
    model = GPT(GPTConfig(n_layer=3))
    names = list(model.state_dict())
    assert gpt_compile.compile_blocks(model) == 3
    assert all(b._compiled_call_impl is not None for b in model.blocks)
    assert list(model.state_dict()) == names  # no _orig_mod. prefix: checkpoints unchanged
    assert model.wte._compiled_call_impl is None  # blocks only
