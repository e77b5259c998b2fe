"""The FP8 self-drafter on CUDA (``rollout/speculative/quantize_fp8.py``, ``torch._scaled_mm`` with
row-wise scales; GPUs of compute capability >= 8.9): the scaled-matmul linear against
the dequantized reference and the float product, and SmolLM2 (``RolloutEngine.
from_pretrained``; the random-weight model of its shape that ``make gpu-check`` writes)
drafting with its FP8 copy under exact verification: greedy outputs equal plain
decoding's (float32 exactly; bfloat16 up to near-ties, each divergence checked to be
one), coupled T=1 outputs too (float32), and a refresh after a weight change equals quantizing the new weights, in the
same memory. The CPU suite covers the same logic emulated
(tests/rollout/test_self_drafter_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.config.kinds import KindSettings, SelfSettings
from megatron_tlt.gpu_check.probe import fp8_probe
from megatron_tlt.rollout import SamplingParams
from megatron_tlt.rollout.speculative.quantize_fp8 import (
    Fp8Weight, emulated_scaled_mm, fp8_linear, fp8_native, quantize_fp8, scaled_mm_operands)
# the CPU suite's modules, loaded by conftest.py
from test_self_drafter_fp8 import _weight, fp8_error_bound
from test_speculative import _prompts

CUDA = torch.device("cuda", 0)
LENGTHS = (3, 9, 1, 17, 5, 30)  # prompt lengths (6 prompts, 4 rows at a time)
# torch._scaled_mm's row-wise E4M3 on this device, with the reason where it fails
# (megatron_tlt/gpu_check/probe.py; the check records the same probe in its JSON)
FP8 = fp8_probe()
# skipped only where the device has no FP8 GEMMs; where it has them and torch's kernel
# fails, every FP8 test fails with that reason (the self-drafter would silently be int8)
needs_fp8 = pytest.mark.skipif(FP8["device_lacks_fp8"],
                               reason=f"FP8 GEMMs need compute capability >= 8.9: "
                                      f"{FP8['reason']}")


@pytest.fixture(autouse=True)
def fp8_runs_where_the_device_has_it():
    if not FP8["device_lacks_fp8"] and not FP8["native"]:
        pytest.fail(f"the device has FP8 GEMMs (compute capability {FP8['capability']}) "
                    f"but torch {FP8['torch']}: {FP8['reason']}; the self-drafter's auto "
                    "format falls back to int8 here", pytrace=False)


def _count_scaled_mm(monkeypatch) -> list:
    calls = []
    real = torch._scaled_mm

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch, "_scaled_mm", counted)
    return calls


# ----------------------------------------------------------------------------- the linear
@needs_fp8
@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (5, 960, 576), (64, 49152, 576), (3, 576, 1536)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaled_mm_linear_matches_the_dequantized_reference(parallel, monkeypatch, m, n, k,
                                                            dtype):
    """torch._scaled_mm (row-wise scales, padded where K or N is not a multiple of 16)
    gives the emulated product of the same FP8 operands up to the bfloat16 result's
    rounding and summation order, and stays within E4M3's error of the float product."""
    assert fp8_native(CUDA)
    g = torch.Generator().manual_seed(m + n + k)
    w = (_weight(n, k, seed=1) if n == 40 else torch.randn(n, k, generator=g) * 0.03).to(CUDA)
    qw = quantize_fp8(w.to(dtype))
    assert qw.native and qw.q.is_cuda and qw.q.shape == (-(-n // 16) * 16, -(-k // 16) * 16)
    x = torch.randn(m, k, generator=g).to(CUDA, dtype)
    b, res = torch.randn(n, generator=g).to(CUDA, dtype), torch.randn(m, n, generator=g).to(
        CUDA, dtype)
    calls = _count_scaled_mm(monkeypatch)
    got = fp8_linear(x, qw, b, res)
    assert calls and got.shape == (m, n) and got.dtype == dtype
    emu = emulated_scaled_mm(*scaled_mm_operands(x, qw)).to(dtype)[:, :n] + b + res
    tol = 2.0 ** -7 * (emu.abs() + res.abs() + b.abs()) + 1e-2
    assert ((got - emu).abs() <= tol).all(), ((got - emu).abs() / tol).max()
    ref = x.double() @ w.to(dtype).double().t() + b.double() + res.double()
    bound = fp8_error_bound(x, w.to(dtype), qw) + 2.0 ** -7 * (ref.abs() + res.double().abs()
                                                               + b.double().abs())
    assert ((got.double() - ref).abs() <= bound).all()


# ----------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def smollm2(parallel):
    """SmolLM2 by dtype, with the FP8 copy attached (speculation at a fixed chain)."""
    from megatron_tlt.rollout import RolloutEngine

    engines = {}

    def get(dtype: str, mode: str = "standard", strategy: str = "4_1_4"):
        key = (dtype, mode, strategy)
        if key not in engines:
            sc = SpeculativeConfig(drafter="self", policy="fixed", strategy=strategy,
                                   threshold=1 << 20, kinds=KindSettings(
                                       self=SelfSettings(format="auto")))
            cfg = RolloutConfig(speculative=sc, sampling_mode=mode, max_batch_size=4,
                                attention="sdpa")
            engines[key] = RolloutEngine.from_pretrained("smollm2", cfg, dtype=dtype,
                                                         device="cuda")
        return engines[key]

    return get


def _plain(eng, prompts, sp, **kw):
    """The same engine's outputs with speculation off (the copy stays attached)."""
    spec, tuner = eng.spec, eng.tuner
    eng.detach_drafter()
    try:
        return eng.generate(prompts, sp, **kw)
    finally:
        eng.spec, eng.tuner = spec, tuner


def _same_or_near_tie(got, ref, tie: float) -> None:
    """bfloat16 verification forwards run other kernels than plain decoding's, so a
    near-tie may resolve the other way; where the outputs part, both tokens must have
    been (nearly) the most likely: their log-probs under each run differ by < tie."""
    for g, r in zip(got, ref):
        for j, (a, b) in enumerate(zip(g.token_ids, r.token_ids)):
            if a != b:
                assert abs(g.logprobs[j] - r.logprobs[j]) < tie, (j, g.logprobs[j],
                                                                  r.logprobs[j])
                break
        else:
            assert len(g.token_ids) == len(r.token_ids)


@needs_fp8
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fp8_self_drafter_greedy_equals_plain_on_cuda(smollm2, monkeypatch, dtype):
    eng = smollm2(dtype)
    draft = eng.spec.draft
    assert draft.format == "fp8"  # auto on a GPU of sm >= 8.9
    assert all(isinstance(w, Fp8Weight) and w.native and w.q.device.type == CUDA.type
               for w in draft.quant_weights())
    prompts = _prompts(lengths=LENGTHS)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    calls = _count_scaled_mm(monkeypatch)
    outs = eng.generate(prompts, sp)
    assert calls  # the drafts came from torch._scaled_mm
    summ = eng.last_stats.spec.summary()
    print(dtype, "FP8 copy: accept rate by position", summ["accept_rate_at_position"],
          "accept_len", summ.get("accept_len"))
    assert summ["steps"] > 0 and summ["accept_rate_at_position"]["1"] > 0.3, summ
    plain = _plain(eng, prompts, sp)
    if dtype == "float32":
        for o, r in zip(outs, plain):
            assert o.token_ids == r.token_ids
            assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-3
    else:
        _same_or_near_tie(outs, plain, tie=0.05)
    again = eng.generate(prompts, sp)  # the copy and the decoding are deterministic
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


@needs_fp8
def test_fp8_self_drafter_coupled_equals_plain_on_cuda(smollm2):
    """Coupled T=1 sampling (tree drafts): the plain coupled responses, token for token
    (float32; in bfloat16 near-ties of the perturbed scores could part, as above)."""
    eng = smollm2("float32", "coupled", "3_2_5")
    prompts = _prompts(lengths=LENGTHS)
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=20, seed=9)
    seeds = list(range(100, 100 + len(prompts)))
    outs = eng.generate(prompts, sp, request_seeds=seeds)
    assert eng.last_stats.spec.steps > 0
    plain = _plain(eng, prompts, sp, request_seeds=seeds)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]


@needs_fp8
def test_fp8_copy_refresh_equals_quantizing_the_new_weights_on_cuda(smollm2):
    eng = smollm2("bfloat16")
    draft = eng.spec.draft
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    eng.generate(_prompts()[:2], sp)
    ptrs = [(w.q.data_ptr(), w.scale.data_ptr()) for w in draft.quant_weights()]
    n = draft.refreshes
    model = eng.runner.model
    saved = [p.detach().clone() for p in model.parameters()]
    try:
        with torch.no_grad():
            g = torch.Generator(device=CUDA).manual_seed(3)
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, device=CUDA, dtype=p.dtype))
        eng.generate(_prompts()[:2], sp)
        assert draft.refreshes == n + 1 and draft.refresh_seconds > 0
        print("FP8 refresh of SmolLM2's copy: %.1f ms" % (1e3 * draft.refresh_seconds))
        assert [(w.q.data_ptr(), w.scale.data_ptr()) for w in draft.quant_weights()] == ptrs
        for mine, lw in zip(draft.layers, eng.runner.layers):
            for name in ("qkv_w", "proj_w", "fc1_w", "fc2_w"):
                want, got = quantize_fp8(getattr(lw, name)), getattr(mine, name)
                assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8)), name
                assert torch.equal(got.scale, want.scale), name
            assert torch.equal(mine.ln1, lw.ln1) and torch.equal(mine.ln2, lw.ln2)
        want = quantize_fp8(eng.runner.output_w)
        assert torch.equal(draft.output_w.q.view(torch.uint8), want.q.view(torch.uint8))
        policy = sum(p.numel() * p.element_size() for p in model.parameters())
        assert draft.nbytes < 0.6 * policy  # bf16 policy: an FP8 copy is about half
    finally:
        with torch.no_grad():
            for p, s in zip(model.parameters(), saved):
                p.copy_(s)
