"""tools/check_imports.py on small trees: the import-cycle check finds the cycles it must
(function-local, TYPE_CHECKING, relative, through a package ``__init__``) and lets a
package ``__init__`` import its own submodules; the public-API, shim, library-imports-
no-script and long-module checks report what they must; the allowlists stay exact.
(``make lint`` runs the script itself on the repository.)"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import check_imports  # noqa: E402
from import_graph import build_graph, collect_modules  # noqa: E402


def make_tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return collect_modules(tmp_path, ["pkg"])


def cycles(tmp_path: Path, files: dict[str, str], allowed=()) -> list[str]:
    modules = make_tree(tmp_path, files)
    return check_imports.cycle_problems(modules, build_graph(modules), allowed, tmp_path)


def test_function_local_import_closing_a_cycle_is_reported(tmp_path: Path) -> None:
    problems = cycles(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import helper\n",
            "pkg/b.py": "def helper():\n    from pkg import a\n    return a\n",
        },
    )
    assert len(problems) == 1
    assert "import cycle between 2 modules: pkg.a, pkg.b" in problems[0]
    assert "pkg/a.py:1: from pkg.b import helper" in problems[0]
    assert "pkg/b.py:2: from pkg import a" in problems[0]


def test_type_checking_and_relative_imports_count(tmp_path: Path) -> None:
    problems = cycles(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/sub/__init__.py": "",
            "pkg/sub/a.py": "from ..c import C\n",
            "pkg/c.py": (
                "from typing import TYPE_CHECKING\n"
                "if TYPE_CHECKING:\n"
                "    from .sub.a import A\n"
                "C = 1\n"
            ),
        },
    )
    assert len(problems) == 1
    assert "pkg.c, pkg.sub.a" in problems[0]
    assert "pkg/c.py:3: from .sub.a import A" in problems[0]


def test_init_importing_its_submodules_is_no_cycle(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "from pkg.a import A\nfrom pkg.b import B\n",
        "pkg/a.py": "from pkg.b import B\nA = B\n",
        "pkg/b.py": "B = 1\n",
    }
    assert cycles(tmp_path, files) == []


def test_submodule_importing_its_package_init_that_reexports_a_sibling(tmp_path: Path) -> None:
    # b takes A from the package, whose __init__ imports a, which imports b back
    problems = cycles(
        tmp_path,
        {
            "pkg/__init__.py": "from pkg.a import A\n",
            "pkg/a.py": "from pkg.b import B\nA = B\n",
            "pkg/b.py": "def f():\n    from pkg import A\n    return A\nB = 1\n",
        },
    )
    assert len(problems) == 1
    assert "3 modules: pkg, pkg.a, pkg.b" in problems[0]


CYCLE = {
    "pkg/__init__.py": "",
    "pkg/a.py": "import pkg.b\n",
    "pkg/b.py": "def f():\n    import pkg.a\n",
}


def test_allowed_cycle_passes_and_a_grown_or_stale_one_fails(tmp_path: Path) -> None:
    entry = check_imports.AllowedCycle(frozenset({"pkg.a", "pkg.b"}), "someone", "why")
    assert cycles(tmp_path, CYCLE, (entry,)) == []
    grown = {**CYCLE, "pkg/b.py": "import pkg.c\n", "pkg/c.py": "import pkg.a\n"}
    problems = cycles(tmp_path, grown, (entry,))
    assert len(problems) == 2
    assert "3 modules: pkg.a, pkg.b, pkg.c" in problems[0]
    assert "ALLOWED_CYCLES entry (someone) matches no cycle today" in problems[1]


SCRIPT = """\
from shardkit.nn import FSDP, tensor_parallel
from shardkit.optim import OSS
from shardkit.nn.data_parallel.fully_sharded.sharded_checkpoint import save_fsdp_sharded
from shardkit.nn.data_parallel.fully_sharded.api import FullyShardedDataParallel
import shardkit.checkpoint.manifest


def run():
    from shardkit.memory import _count_new, model_state_bytes
    return _count_new, model_state_bytes
"""


def script_problems(tmp_path: Path, allowed: dict[tuple[str, str], str]) -> list[str]:
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "bench.py").write_text(SCRIPT)
    api = check_imports.public_api(collect_modules(ROOT, ["shardkit"]), ROOT / "docs" / "api")
    scripts = collect_modules(tmp_path, ["scripts"])
    return check_imports.public_api_problems(scripts, api, allowed, tmp_path)


def test_scripts_importing_internals_are_reported(tmp_path: Path) -> None:
    problems = script_problems(tmp_path, {})
    assert len(problems) == 3, problems
    assert problems[0].startswith(
        "scripts/bench.py:4: from shardkit.nn.data_parallel.fully_sharded.api import"
    )
    assert (
        "shardkit.nn.data_parallel.fully_sharded.api.FullyShardedDataParallel: not" in problems[0]
    )
    assert problems[1].startswith("scripts/bench.py:5: import shardkit.checkpoint.manifest")
    # function-local, and only the private name of the statement
    assert problems[2].startswith("scripts/bench.py:9: from shardkit.memory import _count_new")
    assert "shardkit.memory._count_new: not" in problems[2]
    assert "model_state_bytes:" not in problems[2]


def test_allowed_internal_passes_and_a_stale_entry_fails(tmp_path: Path) -> None:
    allowed = {
        ("scripts/bench.py", "shardkit.nn.data_parallel.fully_sharded.api"): "why",
        ("scripts/bench.py", "shardkit.checkpoint.manifest"): "why",
        ("scripts/bench.py", "shardkit.memory"): "why",
        ("scripts/other.py", "shardkit.memory"): "why",
    }
    assert script_problems(tmp_path, allowed) == [
        "ALLOWED_INTERNAL entry ('scripts/other.py', 'shardkit.memory') matches no import "
        "today: delete it from tools/check_imports.py"
    ]


def test_imports_of_a_shim_and_an_unwarned_deprecated_module_are_reported(
    tmp_path: Path,
) -> None:
    modules = make_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/new.py": "X = 1\n",
            "pkg/old.py": (
                '"""Deprecated location of X."""\n'
                "from shardkit.deprecation import moved_names\n"
                "__getattr__ = moved_names(__name__, {'X': 'pkg.new'})\n"
            ),
            "pkg/user.py": "def f():\n    from pkg.old import X\n    return X\n",
            "pkg/quiet.py": '"""Deprecated alias of pkg.new: import X from there."""\n'
            "from pkg.new import X\n",
        },
    )
    problems = check_imports.shim_problems(modules, build_graph(modules), tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].startswith("pkg/user.py:2: from pkg.old import X\n  pkg.old is a")
    assert problems[1].startswith("pkg/quiet.py: its docstring calls it a deprecated path")


def test_long_module_without_a_reason_is_reported(tmp_path: Path) -> None:
    body = "x = 1\n" * 500
    modules = make_tree(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/short.py": '"""Short."""\n' + "x = 1\n" * 499,  # 500 lines: at the limit
            "pkg/long.py": '"""Long, no reason."""\n' + body,
            "pkg/said.py": '"""Long.\n\nWhy this module is long: one protocol.\n"""\n' + body,
            "pkg/empty.py": '"""Long.\n\nWhy this module is long:\n"""\n' + body,
        },
    )
    problems = check_imports.long_module_problems(modules, tmp_path)
    assert [p.split(":")[0] for p in problems] == ["pkg/empty.py", "pkg/long.py"]
    assert "pkg/long.py: 501 lines (over 500)" in problems[1]


def test_the_library_importing_a_script_is_reported(tmp_path: Path) -> None:
    files = {
        "pkg/__init__.py": "",
        "pkg/core.py": "def f():\n    from train_gpt import main\n    return main\n",
        "scripts/train_gpt.py": "import pkg.core\nmain = 1\n",
    }
    make_tree(tmp_path, files)
    modules = collect_modules(tmp_path, ["pkg", "scripts"])
    problems = check_imports.library_import_problems(
        {"pkg", "pkg.core"}, {"train_gpt"}, build_graph(modules), tmp_path
    )
    assert len(problems) == 1
    assert problems[0].startswith("pkg/core.py:2: from train_gpt import main\n  the library")
