# Two commands do all the set-up on a fresh machine (Python >= 3.10 and pip):
#   make train   the main job: GPT on real text, 2 ranks under torchrun
#   make test    lint, type check and the test suite
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
NPROC ?= 2
STRATEGY ?= fsdp
TRAIN_ARGS ?=
SITE_DIR ?= /tmp/shardkit-site

.PHONY: train test lint docs venv clean bench test-gpu

venv: $(STAMP)

$(STAMP): requirements.txt setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps -e ".[test,dev]"
	touch $(STAMP)

train: $(STAMP)
	$(VENV)/bin/torchrun --standalone --nproc_per_node $(NPROC) examples/train_gpt.py \
		--strategy $(STRATEGY) --out-dir runs/gpt-$(STRATEGY) $(TRAIN_ARGS)

# The docs site (mkdocs.yml), strict: a warning (broken link, bad docstring) fails.
docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir $(SITE_DIR)

# every strategy side by side (benchmarks/compare.py); results in benchmarks/results/
bench: $(STAMP)
	$(PY) -m benchmarks.compare $(BENCH_ARGS)

# lint-imports: the import contracts of docs/architecture.md ([tool.importlinter] in
# pyproject.toml); a lower layer importing an upper one fails here. test_wording: no
# "session" / "the issue's" words in docs/ and README.md. test_doc_names: every
# `shardkit.` name docs/ and README.md show in code imports (file, line and name if not);
# test_doc_options: each wrapper guide's options table lists the constructor's arguments.
# tools/check_imports.py: what import-linter cannot say (no import cycles, function-local
# imports included), benchmarks/ + examples/ import only the public API, nothing imports
# a deprecated shim, a module over 500 lines says why (see its docstring); tests/lint tests that check itself and that
# docs/api/index.md's table of names and aliases is current (tools/api_table.py).
lint: $(STAMP) docs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy shardkit
	$(VENV)/bin/mypy examples
	$(VENV)/bin/mypy tools
	MYPYPATH=examples $(VENV)/bin/mypy benchmarks  # runners.py imports the main job's modules from examples/
	$(VENV)/bin/lint-imports --no-cache --no-logo
	$(PY) tools/check_imports.py
	$(VENV)/bin/pytest -q -p no:cacheprovider --noconftest tests/lint
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/docs/test_wording.py  # docs speak to users
	$(VENV)/bin/pytest -q -p no:cacheprovider tests/docs/test_doc_names.py tests/docs/test_doc_options.py  # docs name real code

test: lint
	$(VENV)/bin/pytest -q

# On a GPU machine: the CUDA tests (NCCL groups, FSDP prefetch / reduce-scatter on CUDA,
# pinned-memory offload, the fp16 scaler; tests/gpu, marker `cuda`), then a short
# benchmarks.compare run. benchmarks.compare runs its strategies on CPU ranks over gloo
# (it has no CUDA mode), so that part checks the benchmark still runs on the GPU
# machine's CPUs, not GPU speed. Without CUDA the tests are reported as skipped.
GPU_BENCH_OUT ?= /tmp/shardkit-gpu-bench
test-gpu: $(STAMP)
	$(PY) -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
	$(VENV)/bin/pytest -m cuda tests/gpu -rs
	$(PY) -m benchmarks.compare --steps 2 --rounds 1 --strategies "torch DDP" "shardkit fsdp" \
		--out $(GPU_BENCH_OUT)

clean:
	rm -rf $(VENV) runs .pytest_cache .mypy_cache .ruff_cache .hypothesis
