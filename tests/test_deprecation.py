"""The deprecated import paths (shardkit.deprecation.moved_names): the same objects as
the canonical path, one DeprecationWarning per process naming the canonical path, and no
upper layer imported when the old module loads."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest

import shardkit.deprecation
import shardkit.models
from shardkit.nn.data_parallel.fully_sharded import sharded_checkpoint

SHIMS = {
    "shardkit.checkpoint.fsdp": {
        "save_fsdp_sharded": sharded_checkpoint.save_fsdp_sharded,
        "load_fsdp_sharded": sharded_checkpoint.load_fsdp_sharded,
        "fsdp_shard_path": sharded_checkpoint.fsdp_shard_path,
    },
    "shardkit.testing.models": {n: getattr(shardkit.models, n) for n in shardkit.models.__all__},
}


@pytest.mark.parametrize("old", sorted(SHIMS))
def test_shim_serves_the_same_objects_and_warns_once(old: str) -> None:
    module = importlib.import_module(old)
    shardkit.deprecation._warned.discard(old)
    expected = SHIMS[old]
    assert sorted(module.__all__) == sorted(expected)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, obj in expected.items():
            assert getattr(module, name) is obj, name
        getattr(module, next(iter(expected)))
    assert [type(w.message) for w in caught] == [DeprecationWarning]
    message = str(caught[0].message)
    first = next(iter(expected))
    assert message.startswith(f"{old} is a deprecated import path: write `from ")
    assert f"import {first}`" in message
    assert caught[0].filename == __file__  # points at the user's line
    with pytest.raises(AttributeError, match=f"module '{old}' has no attribute 'nope'"):
        module.nope  # noqa: B018


def test_old_checkpoint_path_imports_no_wrapper_until_a_name_is_read() -> None:
    code = (
        "import sys, warnings\n"
        "import shardkit.checkpoint.fsdp as old\n"
        "assert 'shardkit.nn' not in sys.modules, sorted(sys.modules)\n"
        "with warnings.catch_warnings(record=True) as w:\n"
        "    warnings.simplefilter('always')\n"
        "    old.save_fsdp_sharded\n"
        "assert 'shardkit.nn' in sys.modules and len(w) == 1, w\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
