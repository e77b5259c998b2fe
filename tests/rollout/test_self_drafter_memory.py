"""The self-drafter's memory: the bytes its copy reports (``SelfDraftRunner.nbytes``)
are the bytes of every tensor it holds, found by walking the copy's attributes and
containers (the target's weights aside), with the CPU kernels (one int8 copy of each
matrix: their panels, no row-major ``q`` beside them), without them (``q``), as FP8,
and with a draft vocabulary's head and grouped scales; more rows than the kernels take
at once run their int8 GEMM in chunks (the reference path reads a packed matrix back
from its panels); on SmolLM2-135M the copy holds at most 0.3x the float32 policy's
parameter bytes. Tiny random models, single process."""

from __future__ import annotations

import types
from collections import deque

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.cpu_kernels import MAX_FUSED_ROWS
from megatron_tlt.rollout.speculative.quantize import QuantWeight, int8_linear
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from tiny_models import VOCAB


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return load_model(tiny_hf_dirs["qwen2"], device=torch.device("cpu"), dtype="float32")


def held_storages(obj, skip: tuple) -> dict[int, int]:
    """Every tensor storage reachable from ``obj`` through attributes and containers,
    not through the objects in ``skip`` (the target runner, its model) nor modules:
    data_ptr -> bytes."""
    seen, out = set(), {}

    def visit(o, depth: int) -> None:
        if id(o) in seen or depth > 10 or any(o is s for s in skip):
            return
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            if st.nbytes():
                out[st.data_ptr()] = st.nbytes()
            return
        if isinstance(o, (torch.nn.Module, type, types.FunctionType, types.MethodType,
                          types.BuiltinFunctionType, types.ModuleType)):
            return
        if isinstance(o, dict):
            for v in o.values():
                visit(v, depth + 1)
        elif isinstance(o, (list, tuple, set, deque)):
            for v in o:
                visit(v, depth + 1)
        elif hasattr(o, "__dict__"):
            for v in vars(o).values():
                visit(v, depth + 1)

    visit(obj, 0)
    return out


def _engine(model, arch, drafter, kernels: str) -> RolloutEngine:
    sc = SpeculativeConfig(policy="fixed", strategy="3_1_3", threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, cpu_kernels=kernels),
                        arch=arch, eos_token_ids=[])
    eng.attach_drafter(drafter)
    return eng


CASES = {
    "kernels": (dict(), "true"),
    "no-kernels": (dict(), "false"),
    "fp8": (dict(format="fp8"), "true"),
    "vocab-grouped": (dict(group=32, draft_vocab=torch.arange(0, VOCAB, 3)), "true"),
    "float-activations": (dict(act_block=0), "true"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_reported_bytes_are_every_tensor_the_copy_holds(tiny, case):
    model, arch = tiny
    kw, kernels = CASES[case]
    eng = _engine(model, arch, SelfDrafter(**kw), kernels)
    prompts = [[3, 5, 7, 11], [2, 4]]
    eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    draft, target = eng.spec.draft, eng.runner
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    held = held_storages(draft, skip=(target, draft.source, model, draft.kernels))
    own = {p: n for p, n in held.items() if p not in weights}  # not the embedding
    assert sum(own.values()) == draft.nbytes, (sorted(own.values()), draft.nbytes)
    mats = draft.quant_weights()
    if case == "fp8":
        assert draft.format == "fp8" and not draft._int8_kernels()
    elif kernels == "true":  # one int8 copy: the kernels' panels, no q beside them
        assert draft._int8_kernels()
        assert all(w.packed and w.q is None and w.panel is not None for w in mats)
    else:
        assert all(isinstance(w, QuantWeight) and not w.packed and w.panel is None
                   for w in mats)
    # refreshing after an update writes into the same tensors: nothing more is held
    ptrs = sorted(own)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.01)
    eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=6))
    again = {p: n for p, n in held_storages(
        draft, skip=(target, draft.source, model, draft.kernels)).items() if p not in weights}
    assert sorted(again) == ptrs and sum(again.values()) == draft.nbytes
    with torch.no_grad():
        for p in model.parameters():
            p.div_(1.01)


def test_more_rows_than_the_kernels_take_run_in_chunks(tiny):
    """150 rows: the panel GEMM in chunks of MAX_FUSED_ROWS, bitwise the kernel's one
    call over all rows, and within float rounding of the reference (which reads the
    packed matrix back from its panels)."""
    model, arch = tiny
    eng = _engine(model, arch, SelfDrafter(), "true")
    draft = eng.spec.draft
    w, b = draft.layers[0].qkv_w, draft.layers[0].qkv_b
    assert w.packed and b is not None
    g = torch.Generator().manual_seed(0)
    rows = 2 * MAX_FUSED_ROWS + 22
    x = torch.randn(2, rows // 2, w.shape[1], generator=g)
    got = draft._lin(x, w, b)
    one = draft.kernels.linear_int8(x.reshape(rows, -1), w.panel, w.panel_scale, w.shape[0],
                                    w.group, w.act_block, b, None)
    assert got.shape == (2, rows // 2, w.shape[0])
    assert torch.equal(got.reshape(rows, -1), one)
    ref = int8_linear(x, w, b)
    assert (got - ref).abs().max() < 1e-4 * (1 + ref.abs().max())
    res = torch.randn(2, rows // 2, w.shape[0], generator=g)
    assert torch.allclose(draft._lin(x, w, b, residual=res), got + res, atol=1e-5)


def test_smollm2_copy_is_at_most_0_3x_the_policy(smollm2_dir, single_process_parallel):
    """The copy of SmolLM2-135M (int8, one scale per output channel, the CPU kernels'
    panels) holds at most 0.3x the float32 policy's parameter bytes."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    model, arch = load_model(smollm2_dir, device=torch.device("cpu"), dtype="float32")
    eng = _engine(model, arch, SelfDrafter(), "true")
    draft = eng.spec.draft
    assert draft._int8_kernels()
    policy = sum(p.numel() * p.element_size() for p in model.parameters())
    assert draft.nbytes <= 0.3 * policy, draft.nbytes / policy
