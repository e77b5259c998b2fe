"""What only a GPU can show about the collectives and the rollout's memory.

- ``megatron_tlt/collectives.py`` at world size 1 over NCCL: every value helper and
  every tensor helper runs its collective (the helpers do not short-cut size 1), so
  each one's device and dtype meet NCCL here; a CPU tensor handed to a tensor helper
  fails with the module's own message, not NCCL's. Point-to-point send / recv need a
  second rank (NCCL cannot put two ranks on one GPU): only their refusal of CPU
  tensors is checked here, their transfers on gloo in the CPU suite.
- The rollout engine's memory lifecycle on CUDA: ``release_memory`` before the policy
  update gives back the KV cache (and, with CUDA graphs, what the graphs hold), and
  the next ``generate`` re-creates it and decodes the same tokens. Each test stands
  alone: the check may run any test in a fresh process (tests_gpu's runner restarts
  pytest after a hung or crashed test).
"""

from __future__ import annotations

import pytest
import torch

from megatron_tlt import collectives as C
from megatron_tlt.models import load_model
from megatron_tlt.rollout import SamplingParams

from test_speculative import _prompts, _random_drafter, _spec_engine

CUDA = torch.device("cuda", 0)


def _groups():
    """The default group and megatron-core's model-parallel groups (NCCL), by name."""
    from megatron.core import parallel_state as ps

    return {"default": None, "dp": ps.get_data_parallel_group(),
            "tp": ps.get_tensor_model_parallel_group(),
            "pp": ps.get_pipeline_model_parallel_group(),
            "mp": ps.get_model_parallel_group()}


def test_value_helpers_at_world_size_1_on_nccl(parallel):
    assert C.active()
    for name, g in _groups().items():
        assert C.size(g) == 1 and C.rank(g) == 0, name
        assert C.device_of(g) == CUDA, name
        assert C.global_rank(g, 0) == 0
        assert C.sum_values([1.5, 2, -3], g) == [1.5, 2.0, -3.0]
        assert C.max_values([3, -1], g) == [3.0, -1.0]
        assert C.reduce_values([4, 5], "min", g) == [4.0, 5.0]
        assert C.reduce_values([2 ** 40 + 1], "sum", g) == [float(2 ** 40 + 1)]  # float64
        assert C.broadcast_values([7, 2 ** 40], 0, g) == [7, 2 ** 40]             # int64
        assert C.all_gather_object({"a": [1, 2], "b": "x"}, g) == [{"a": [1, 2], "b": "x"}]
        assert C.broadcast_object(("t", 3.5), 0, g) == ("t", 3.5)
        C.barrier(g)
        if g is not None:
            assert C.group_ranks(g) == [0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_tensor_helpers_at_world_size_1_on_nccl(parallel, dtype):
    for name, g in _groups().items():
        want = torch.arange(1, 5, device=CUDA).to(dtype)
        for op in ("sum", "max", "min"):
            t = want.clone()
            assert C.all_reduce(t, op, g) is None
            assert t.equal(want), (name, op)
        t = want.clone()
        C.all_reduce(t, "sum", g, async_op=True).wait()
        assert t.equal(want)
        C.broadcast(t, 0, g)
        C.broadcast(t, 0, g, async_op=True).wait()
        assert t.equal(want)
        parts = C.all_gather(want[1:], g)  # a non-contiguous view is made contiguous
        assert len(parts) == 1 and parts[0].device == CUDA and parts[0].equal(want[1:])


def test_tensor_helpers_refuse_cpu_tensors_on_nccl(parallel):
    cpu = torch.ones(3)
    for name, g in _groups().items():
        for call in (lambda: C.all_reduce(cpu, "sum", g), lambda: C.broadcast(cpu, 0, g),
                     lambda: C.all_gather(cpu, g), lambda: C.send(cpu, 0, g),
                     lambda: C.recv(cpu, 0, g)):
            with pytest.raises(ValueError, match="device_of"):
                call()
        with pytest.raises(TypeError, match="holds a tensor"):
            C.all_gather_object({"x": [torch.ones(1, device=CUDA)]}, g)
        with pytest.raises(TypeError, match="holds a tensor"):
            C.broadcast_object(torch.ones(1), 0, g)


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("speculative", [False, True])
def test_rollout_memory_released_and_recreated_on_cuda(parallel, hf_dirs, graphs,
                                                       speculative):
    """After ``release_memory`` the allocated CUDA memory is back at its level after the
    previous release (the KV cache, sized here to dominate, is gone), and the next call
    re-creates it and gives the same greedy tokens.

    Self-contained: the first generate of a process also makes what stays for good
    (cuBLAS's workspace per stream, 32 MiB on Hopper, more than ten times this cache;
    the attention kernels' own buffers), which earlier test files would otherwise have
    made. So one generate and release come first, and the level is read after them."""
    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype="float32",
                             impl="local")
    drafter = _random_drafter(arch, device=CUDA) if speculative else None
    eng = _spec_engine(model, arch, drafter, "3_1_3", max_batch_size=6, attention="sdpa",
                       cuda_graphs=graphs)
    sp = SamplingParams(temperature=0.0, max_new_tokens=256)
    prompts = _prompts()
    warm = eng.generate(prompts, sp)  # the process's lasting buffers, then the cache
    eng.release_memory()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    first = eng.generate(prompts, sp)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    # 2 (K, V) x 4 layers x 6 rows x 2 groups x 273 positions x 24 x 4 bytes
    kv = 2 * arch.num_layers * 6 * arch.num_query_groups * 273 * arch.kv_channels * 4
    assert held - base >= kv // 2, (base, held, kv)
    eng.release_memory()
    torch.cuda.synchronize()
    released = torch.cuda.memory_allocated()
    assert released - base <= 0.25 * (held - base), (base, held, released)
    again = eng.generate(prompts, sp)
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert [o.token_ids for o in first] == [o.token_ids for o in warm]
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - base >= kv // 2  # re-created


def test_policy_moments_allocated_at_build_on_cuda(parallel, hf_dirs):
    """The policy's optimizer (megatron-core's distributed optimizer over bf16 weights)
    holds its fp32 Adam moments on the GPU once built, and an update step allocates
    no moments of its own afterwards (the resident memory is final before any
    rollout: optim_state.py)."""
    from megatron_tlt.config import load_config
    from megatron_tlt.optim_state import torch_optimizers
    from megatron_tlt.rl.policy import Policy
    from megatron_tlt.rl.samples import Sample, collate

    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype="bfloat16",
                             impl="local")
    policy = Policy(model, arch, load_config([], []).train, total_optimizer_steps=4)
    n = 0
    for _, opt in torch_optimizers(policy.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                st = opt.state[p]
                assert st["exp_avg"].device.type == "cuda"
                assert st["exp_avg"].dtype == torch.float32 and not st["exp_avg"].any()
                n += p.numel()
    assert n > 0 and policy.optimizer_state_bytes == 8 * n
    sample = Sample(prompt_index=0, prompt_ids=[1, 2, 3, 4], response_ids=[5, 6, 7, 8],
                    rollout_logprobs=[-1.0] * 4, finish_reason="stop", advantage=1.0,
                    uid="u")
    mb = collate([sample], [0], pad_id=0, device=CUDA)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    result, _ = policy.train_step([mb], lambda mb, logits: (logits.float().mean(), {}))
    torch.cuda.synchronize()
    assert result.updated
    # had the step made the moments, it would have grown by all of them
    assert torch.cuda.memory_allocated() - before < 0.5 * policy.optimizer_state_bytes
