"""shardkit: composable ZeRO-style sharding wrappers for PyTorch."""

import re
from pathlib import Path

from setuptools import find_packages, setup

_VERSION = re.search(
    r'__version__ = "([^"]+)"', (Path(__file__).parent / "shardkit" / "version.py").read_text()
)
assert _VERSION is not None

setup(
    name="shardkit",
    version=_VERSION.group(1),
    description="Composable PyTorch wrappers that shard training state across ranks (ZeRO 1-3), "
    "pipeline and offload.",
    long_description=(Path(__file__).parent / "README.md").read_text(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["shardkit", "shardkit.*"]),
    package_data={"shardkit": ["py.typed"]},
    install_requires=["torch>=2.4", "typing-extensions", "tqdm", "safetensors>=0.8"],
    extras_require={
        "test": ["pytest", "hypothesis", "pytest-timeout", "numpy"],
        "dev": ["ruff", "mypy", "import-linter==2.16"],
        "docs": ["mkdocs", "mkdocstrings", "mkdocstrings-python"],
        # The anchors of benchmarks.compare, pinned to the versions measured (CPU, gloo,
        # torch 2.13); DeepSpeed's own dependencies pinned with it. Not installed by
        # `make test` / CI. See docs/benchmarks.md.
        "bench": [
            "matplotlib",
            "deepspeed==0.19.8",
            "fairscale==0.4.13",
            "hjson==3.1.0",
            "ninja==1.13.2",
            "py-cpuinfo==9.0.0",
            "msgpack==1.2.4",
            "einops==0.8.2",
            "psutil==7.2.2",
            "pydantic==2.14.4",
        ],
        # what examples/train_gpt.py uses when present: matplotlib draws loss.png (without
        # it the job skips the plot with one line). docs/train_gpt.md
        "examples": ["matplotlib"],
        # the Trainer integration (shardkit.integrations.hf): the versions it is tested with
        "hf": ["transformers==5.23.0", "accelerate==1.15.0"],
    },
    license="BSD-3-Clause",
)
