"""tests_gpu/ set-up: the CUDA guard, the shared fixtures, and the CPU suite's helper
module that the GPU tests reuse.

Every test here needs CUDA: a machine without it fails at collection rather than
skipping, so a GPU run cannot pass vacuously. ``GPU_CHECK_COLLECT_ONLY=1`` lets
``pytest tests_gpu --collect-only`` list the tests on a machine without CUDA
(``tools/gpu_check.py --dry`` checks that every required test is collected). On the
GPU the check runs these files through ``megatron_tlt/gpu_check/tests_run.py``, which may
start any test in a fresh process (after a hung or crashed one): each test stands alone.

``tests/support/`` is on pytest's import path (pyproject's ``pythonpath``); the
speculative-decoding helpers live in the CPU test module
``tests/rollout/test_speculative.py`` itself (and the FP8 error bound in
``tests/rollout/test_self_drafter_fp8.py``), which are loaded here by file path under
their module names (``pytest tests_gpu`` does not collect ``tests/``), so
``from test_speculative import ...`` finds them.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available() and os.environ.get("GPU_CHECK_COLLECT_ONLY") != "1":
    raise RuntimeError("tests_gpu/ needs a CUDA device (torch reports none)")

REPO = Path(__file__).resolve().parents[1]
CPU_HELPERS = {"test_speculative": REPO / "tests" / "rollout" / "test_speculative.py",
               "test_self_drafter_fp8": REPO / "tests" / "rollout" / "test_self_drafter_fp8.py"}


def _load(name: str, path: Path) -> None:
    if name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


for _name, _path in CPU_HELPERS.items():
    _load(_name, _path)


@pytest.fixture(scope="session")
def parallel():
    """torch.distributed at world size 1 over NCCL and megatron-core's groups at
    TP = PP = 1 (every collective still runs at size 1: megatron_tlt/collectives.py)."""
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.runtime_env import init_distributed

    plat = init_distributed()
    assert plat.device.type == "cuda" and plat.backend == "nccl"
    initialize_model_parallel(1, 1, seed=1234)
    return plat


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    from tiny_models import TINY_CONFIGS, save_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: save_tiny_hf(name, root / name) for name in TINY_CONFIGS}
