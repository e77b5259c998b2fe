"""runtime_env: device/backend choice, seeding, and the CPU redirection's boundaries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_tlt import runtime_env


def test_auto_picks_cpu_and_gloo_without_cuda():
    assert not torch.cuda.is_available()
    assert runtime_env.choose_device() == (torch.device("cpu"), "gloo")


def test_requesting_cuda_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="no CUDA device"):
        runtime_env.choose_device("cuda")
    with pytest.raises(ValueError, match="nccl' needs CUDA"):
        runtime_env.choose_device("cpu", "nccl")


def test_redirection_is_not_applied_when_cuda_is_reported_present():
    """On a CUDA machine nothing in torch or megatron-core may be patched."""
    code = textwrap.dedent("""
        import torch
        torch.cuda.is_available = lambda: True
        import megatron.core.tensor_parallel.random as mrandom
        import megatron.core.transformer.utils as mutils
        from megatron_tlt import runtime_env
        before = (torch.cuda.current_device, torch.cuda.synchronize,
                  mutils.get_default_causal_mask, mrandom._CUDA_RNG_STATE_TRACKER)
        assert runtime_env.apply_cpu_redirection() is False
        assert not runtime_env.cpu_redirection_applied()
        after = (torch.cuda.current_device, torch.cuda.synchronize,
                 mutils.get_default_causal_mask, mrandom._CUDA_RNG_STATE_TRACKER)
        assert all(a is b for a, b in zip(before, after)), "patched under CUDA"
        assert type(runtime_env.cuda_placements_on_cpu()).__name__ == "nullcontext"
        assert runtime_env.choose_device() == (torch.device("cuda"), "nccl")
        print("UNTOUCHED")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "UNTOUCHED" in r.stdout


def test_redirection_applies_without_cuda():
    code = textwrap.dedent("""
        import torch
        from megatron_tlt import runtime_env
        assert runtime_env.apply_cpu_redirection() is True
        assert torch.cuda.current_device() == torch.device("cpu")
        import megatron.core.transformer.utils as mutils
        assert mutils.get_default_causal_mask(3).device.type == "cpu"
        with runtime_env.cuda_placements_on_cpu():
            assert torch.zeros(2, device="cuda").device.type == "cpu"
            assert torch.ones(1).cuda().device.type == "cpu"
        print("REDIRECTED")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "REDIRECTED" in r.stdout


def test_cpu_rng_tracker_forks_reproducible_streams():
    tracker = runtime_env._CpuRNGStatesTracker()
    tracker.add("model-parallel-rng", 42)
    torch.manual_seed(0)
    outside_before = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.get_rng_state(), outside_before)  # default stream untouched
    with tracker.fork():
        b = torch.rand(4)
    assert not torch.equal(a, b)  # the forked stream advanced
    fresh = runtime_env._CpuRNGStatesTracker()
    fresh.add("model-parallel-rng", 42)
    with fresh.fork():
        assert torch.equal(torch.rand(4), a)
    with pytest.raises(Exception, match="already exists"):
        tracker.add("other", 42)


def test_seed_everything_is_reproducible():
    import random

    import numpy as np

    runtime_env.seed_everything(5)
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    runtime_env.seed_everything(5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first
