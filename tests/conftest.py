"""Shared pytest fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from megatron_tlt.runtime_env import EXPECTED_WARNINGS

# --cpu-durations / --cpu-json: CPU seconds per test (tests/support/cpu_clock.py)
pytest_plugins = ["cpu_clock"]


def pytest_configure(config):
    """Hide megatron-core's apex / TE import notices (the same list entry points use),
    and share the cores among the test workers (``make test``'s pytest-xdist)."""
    for pattern in EXPECTED_WARNINGS:
        config.addinivalue_line("filterwarnings", f"ignore:{pattern}:UserWarning")
    share_cores(config)


def pytest_report_header(config):
    """The machine the timings are from: CPU model, the widest vector ISA it has, the
    one the CPU kernels use (``MEGATRON_TLT_CPU_ISA`` forces one), the cores, the
    threads each process runs and the load average at the start (and at the end:
    ``pytest_terminal_summary``)."""
    from megatron_tlt.rollout.cpu_kernels import cpu_info

    model, flags = cpu_info()
    widest = next((isa for isa, flag in (("avx512", "avx512f"), ("avx2", "avx2"))
                   if flag in flags), "portable")
    forced = os.environ.get("MEGATRON_TLT_CPU_ISA")
    return [f"cpu: {model}, {len(os.sched_getaffinity(0))} cores, widest ISA {widest}"
            + (f", forced to {forced} (MEGATRON_TLT_CPU_ISA)" if forced else ""),
            f"threads: {threads_per_process(config)} per test process, each of its "
            f"torchrun ranks a share of them (share_cores); "
            + load_average()]


def load_average() -> str:
    """The machine's load average: runnable processes over 1, 5 and 15 minutes. Above
    the cores, other jobs shared them with this run and its wall times say as much."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} (1, 5, 15 min)"


def pytest_terminal_summary(terminalreporter, config):
    if not hasattr(config, "workerinput"):
        terminalreporter.write_line(f"at the end: {load_average()} on "
                                    f"{len(os.sched_getaffinity(0))} cores")


def _workers(config) -> int:
    """The pytest-xdist workers of this run (1 without)."""
    n = os.environ.get("PYTEST_XDIST_WORKER_COUNT") or getattr(config.option, "numprocesses", 0)
    return int(n) if str(n).isdigit() and int(n) > 0 else 1


def threads_per_process(config) -> int:
    from megatron_tlt.runtime_env import threads_for

    return threads_for(_workers(config))


def share_cores(config) -> None:
    """This process's share of the cores, as its torch threads and, through the thread
    pools' variables (``runtime_env.THREAD_VARS``), for every process it starts: the
    budget (``OMP_NUM_THREADS`` if set, else the cores) divided among the pytest-xdist
    workers. The launchers divide a worker's share again among the ranks they start
    (``tests/support/cli.py`` ``run_script``, ``tools/fault_inject.py`` ``launch``:
    ``runtime_env.threads_for``), so threads per process times processes stays at the
    cores. Each worker would otherwise run a thread per core, two workers twice as many
    threads as cores: on 2 cores that tripled the CPU time of the speculation tests
    (idle threads spinning), for no result a test checks. The controller of the
    workers runs no test and leaves the budget to them."""
    from megatron_tlt.runtime_env import cap_threads

    if _workers(config) > 1 and not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    cap_threads(threads_per_process(config))
    import zygote  # noqa: F401  (its BASELINE: the environment before any test runs)


@pytest.fixture(scope="session", autouse=True)
def _cpu_kernels_everywhere():
    """Engines made by tests use the fused CPU kernels wherever they apply, as with
    rollout.cpu_kernels=true, so which paths a test exercises never depends on this
    machine's timings; tests/rollout/test_kernel_policy.py tests the calibration itself."""
    from megatron_tlt.rollout import kernel_policy

    kernel_policy.pinned = kernel_policy.ALWAYS
    yield
    kernel_policy.pinned = None


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Prepared SmolLM2-135M-Instruct folder (converted on first use, ~40 s, then cached).

    Uses the normal cache (``$MEGATRON_TLT_CACHE`` or ``~/.cache/megatron_tlt``) so the
    conversion is shared with `make assets` and across test runs.
    """
    from megatron_tlt.assets import prepare_smollm2

    return prepare_smollm2()


@pytest.fixture(scope="session")
def tiny_hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each tiny random model of tests/support/tiny_models.py saved as an HF folder."""
    from tiny_models import TINY_CONFIGS, save_tiny_hf

    root = tmp_path_factory.mktemp("tiny_hf")
    return {name: save_tiny_hf(name, root / name) for name in TINY_CONFIGS}


@pytest.fixture(scope="session")
def qwen3_hf_dirs(tmp_path_factory) -> dict[str, Path]:
    """Each tiny Qwen3 / Qwen3-MoE model of tests/support/tiny_models.py (QWEN3_CONFIGS)
    saved as an HF folder."""
    from tiny_models import QWEN3_CONFIGS, save_tiny_hf

    root = tmp_path_factory.mktemp("qwen3_hf")
    return {name: save_tiny_hf(name, root / name) for name in QWEN3_CONFIGS}


@pytest.fixture(scope="session")
def single_process_parallel():
    """torch.distributed (gloo, 1 process) and megatron-core groups at TP=PP=1."""
    from megatron_tlt.parallel import initialize_model_parallel
    from megatron_tlt.runtime_env import init_distributed

    platform = init_distributed()
    initialize_model_parallel(1, 1, seed=1234)
    return platform


@pytest.fixture(scope="module")
def tiny_llama(tiny_hf_dirs, single_process_parallel):
    """(model, arch): the tied tiny Llama as a megatron-core model (float32, CPU), one per
    test module (tests that train or modify it get a fresh one in the next module)."""
    import torch

    from megatron_tlt.models import load_model
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"), dtype="float32")
