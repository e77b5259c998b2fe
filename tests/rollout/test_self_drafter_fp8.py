"""The FP8 (E4M3) self-drafter on CPU (``rollout/speculative/quantize_fp8.py``): the quantization
math (per-channel scales, clamping at 448, round-trip bounds), the padded layout that
``torch._scaled_mm`` needs (checked by torch's own CUDA shape checks on meta tensors),
the emulated scaled matmul against the float product and against torch's CPU
``_scaled_mm``, and the engine with an FP8 copy (emulated here; on a GPU of compute
capability >= 8.9 the same code calls ``torch._scaled_mm``, tests_gpu/
test_self_drafter_cuda.py): greedy and coupled outputs identical to plain decoding, the
copy refreshed in place after an update. Also the config (``kinds.self.format``) and the PP
layout check."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import ConfigError, RolloutConfig, SpeculativeConfig
from megatron_tlt.config.kinds import KindSettings, SelfSettings
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative.quantize_fp8 import (E4M3, E4M3_MAX, Fp8Weight, _to_e4m3,
                                               emulated_scaled_mm, fp8_linear, fp8_native,
                                               quantize_fp8, resolve_format,
                                               scaled_mm_operands, scaled_mm_problems)
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from test_speculative import _prompts
from tiny_models import save_tiny_hf

EPS = 2.0 ** -4  # E4M3's relative half step (3 mantissa bits)
SUB = 2.0 ** -10  # its absolute half step below the smallest normal (2^-6), in scaled units


def fp8_error_bound(x: torch.Tensor, w: torch.Tensor, qw: Fp8Weight) -> torch.Tensor:
    """|fp8_linear(x, qw) - x @ w.T| <= this, per element, for x [m, k]: each product
    term off by E4M3's relative half steps of both operands (or their absolute half steps
    below the normals), then the bfloat16 result's rounding (tests_gpu reuses it)."""
    xd, wd = x.double(), w.double()
    t = xd.abs().amax(dim=1, keepdim=True) / E4M3_MAX
    s = qw.scale[0, : qw.n].double().to(xd.device)[None, :]
    mm = xd @ wd.t()
    per = (xd.abs() @ wd.abs().t()) * (2 * EPS + EPS ** 2) \
        + (xd.abs().sum(1, keepdim=True) * s + t * wd.abs().sum(1)[None, :]) * SUB * (1 + EPS) \
        + xd.shape[1] * t * s * SUB ** 2
    return per + 2.0 ** -8 * (mm.abs() + per) + 1e-6


def _weight(n=40, k=72, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[3] = 0.0  # an all-zero channel: zeros, scale 1
    w[5, 7] = 2.5  # an outlier sets its channel's scale
    w[6, :] *= 1e-4  # a channel of tiny values (scaled: still spans E4M3's range)
    return w


# ------------------------------------------------------------------------- quantization
def test_fp8_quantization_scales_clamp_and_round_trip():
    w = _weight()
    q = quantize_fp8(w, native=False)
    assert q.q.dtype == E4M3 and q.q.shape == (48, 80) and q.scale.shape == (1, 48)
    assert q.shape == (40, 72) and q.group == 72 and not q.native
    assert q.nbytes == 48 * 80 + 48 * 4
    amax = w.abs().amax(dim=1)
    want = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    assert torch.equal(q.scale[0, :40], want) and (q.scale[0, 40:] == 1).all()
    qf = q.q.float()
    assert torch.isfinite(qf).all() and qf.abs().max() <= E4M3_MAX
    # each non-zero channel's largest element lands on 448, the padding stays zero
    rows = [r for r in range(40) if r != 3]
    assert (qf[rows, :72].abs().amax(dim=1) == E4M3_MAX).all()
    assert (qf[3] == 0).all() and (qf[40:] == 0).all() and (qf[:, 72:] == 0).all()
    assert q.dequantize()[5, 7] == 2.5  # the channel maximum is exact
    # round trip: half an E4M3 step, relative for normals, absolute below them
    s = q.scale[0, :40, None]
    bound = torch.maximum(w.abs() * EPS, s * SUB) + 1e-7 * w.abs()
    err = (q.dequantize() - w).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert err.max() > 0  # (a different matrix)
    # bit-identical when quantized again (every replica, every refresh)
    again = quantize_fp8(w.clone(), native=False)
    assert torch.equal(again.q.view(torch.uint8), q.q.view(torch.uint8))
    assert torch.equal(again.scale, q.scale)
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8(torch.zeros(3))


def test_e4m3_conversion_is_clamped_not_overflowed():
    """Quotients past 448 (a scale computed in float32 can leave the channel maximum at
    448.00003) saturate at +-448; none become NaN."""
    x = torch.tensor([448.00003, 1000.0, -1e6, 447.0, 0.0, -3e-5])
    got = _to_e4m3(x, torch.tensor(1.0)).float()
    assert torch.isfinite(got).all()
    assert got[:3].tolist() == [448.0, 448.0, -448.0] and got[4] == 0


def test_refresh_writes_into_the_same_memory():
    w = _weight()
    q = quantize_fp8(w, native=False)
    ptrs = (q.q.data_ptr(), q.scale.data_ptr())
    w2 = w.flip(0) * 3
    q2 = quantize_fp8(w2, out=q, native=False)
    assert q2 is q and (q.q.data_ptr(), q.scale.data_ptr()) == ptrs
    fresh = quantize_fp8(w2, native=False)
    assert torch.equal(q.q.view(torch.uint8), fresh.q.view(torch.uint8))
    assert torch.equal(q.scale, fresh.scale)
    other = quantize_fp8(torch.randn(24, 72), out=q, native=False)  # another shape: new
    assert other is not q and other.q.shape == (32, 80)


# ------------------------------------------------------------------------- layout
@pytest.mark.parametrize("m,n,k", [(1, 40, 72), (3, 48, 64), (17, 251, 96), (5, 16, 8)])
def test_scaled_mm_operands_pass_torchs_cuda_checks(m, n, k):
    """The operands as fp8_linear hands them to torch._scaled_mm: torch's CUDA checks
    (run on meta tensors of the same strides) accept them: FP8, the first row-major and
    the second column-major, K and N multiples of 16, row-wise float32 scales."""
    w = quantize_fp8(torch.randn(n, k), native=False)
    a, b, sa, sb = scaled_mm_operands(torch.randn(m, k), w)
    assert scaled_mm_problems(a, b, sa, sb) == []
    assert a.shape == (m, w.q.shape[1]) and b.shape == (w.q.shape[1], w.q.shape[0])
    assert (a.float()[:, k:] == 0).all() and sa.shape == (m, 1) and sa.dtype == torch.float32
    # the checker does refuse a row-major second operand and an unpadded K
    assert scaled_mm_problems(a, b.contiguous(), sa, sb)
    if k % 16:
        unpadded = torch.zeros(m, k, dtype=E4M3)
        assert scaled_mm_problems(unpadded, torch.zeros(n, k, dtype=E4M3).t(), sa,
                                  torch.ones(1, n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_the_float_product(dtype):
    """fp8_linear (emulated on CPU) is within the error E4M3 allows of the float64
    product, bias and residual included, and follows the operands' scaled product as
    torch's CPU _scaled_mm computes it."""
    g = torch.Generator().manual_seed(1)
    w = _weight(seed=2)
    qw = quantize_fp8(w, native=False)
    x = torch.randn(2, 3, 72, generator=g)
    x[0, 1] = 0.0  # an all-zero activation row
    x[1, 2, 5] = 40.0  # an outlier in a row
    b, res = torch.randn(40, generator=g), torch.randn(2, 3, 40, generator=g)
    got = fp8_linear(x.to(dtype), qw, b.to(dtype), res.to(dtype))
    assert got.shape == (2, 3, 40) and got.dtype == dtype and got.is_contiguous()
    xd = x.to(dtype).double().reshape(6, 72)
    ref = xd @ w.double().t() + b.to(dtype).double() + res.to(dtype).double().reshape(6, 40)
    bound = fp8_error_bound(xd, w, qw)
    if dtype == torch.bfloat16:  # the caller's additions in bfloat16
        bound = bound + 2.0 ** -8 * ref.abs()
    err = (got.double().reshape(6, 40) - ref).abs()
    assert (err <= bound).all(), (err / bound).max()
    assert (got[0, 1].double() - ref.reshape(2, 3, 40)[0, 1]).abs().max() < 1e-2  # zero row
    # torch's own (CPU) scaled matmul of the same operands agrees with the emulation
    ops = scaled_mm_operands(x.reshape(6, 72), qw)
    emu = emulated_scaled_mm(*ops).float()
    cpu = torch._scaled_mm(*ops, out_dtype=torch.bfloat16).float()
    assert ((cpu - emu).abs() <= 2.0 ** -7 * emu.abs() + 1e-3).all()


def test_formats_resolve_by_device_and_group():
    cpu = torch.device("cpu")
    assert not fp8_native(cpu)
    assert resolve_format("auto", cpu) == "int8"  # no FP8 GEMM here
    assert resolve_format("auto", cpu, native=True) == "fp8"  # a GPU of sm >= 8.9
    assert resolve_format("auto", cpu, group=32, native=True) == "int8"  # grouped scales
    assert resolve_format("fp8", cpu) == "fp8" and resolve_format("int8", cpu, 32) == "int8"
    with pytest.raises(ValueError, match="one scale per output channel"):
        resolve_format("fp8", cpu, group=32)
    with pytest.raises(ValueError, match="format"):
        SelfDrafter(format="int4")


# ------------------------------------------------------------------------- the engine
@pytest.fixture(scope="module")
def models(tiny_hf_dirs, tmp_path_factory, single_process_parallel):
    """The tiny Qwen2 (QKV biases; vocabulary 251: the head's channels padded) and a
    tied Llama whose MLP width (88) pads fc2's inputs to 96."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    odd = save_tiny_hf("llama_tied", tmp_path_factory.mktemp("odd"), seed=3,
                       intermediate_size=88)
    cpu = torch.device("cpu")
    return {"qwen2": load_model(tiny_hf_dirs["qwen2"], device=cpu, dtype="float32"),
            "odd": load_model(odd, device=cpu, dtype="float32")}


def _engine(model, arch, strategy, **cfg):
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=1 << 20,
                           drafter="self",
                           kinds=KindSettings(self=SelfSettings(format="fp8")))
    return RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                         eos_token_ids=[])


@pytest.mark.parametrize("name", ["qwen2", "odd"])
@pytest.mark.parametrize("strategy", ["4_1_4", "3_3_8"])
def test_greedy_fp8_self_speculation_equals_plain_decoding(models, name, strategy):
    model, arch = models[name]
    sp = SamplingParams(temperature=0.0, max_new_tokens=14, return_hidden_states=True)
    prompts = _prompts()
    plain = RolloutEngine(model, None, RolloutConfig(max_batch_size=4), arch=arch,
                          eos_token_ids=[]).generate(prompts, sp)
    eng = _engine(model, arch, strategy, max_batch_size=4)
    draft = eng.spec.draft
    assert draft.format == "fp8" and draft.kernels is None
    assert all(isinstance(w, Fp8Weight) and not w.native for w in draft.quant_weights())
    outs = eng.generate(prompts, sp)
    for o, r in zip(outs, plain):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
        assert (o.hidden_states - r.hidden_states).abs().max() < 1e-4
    assert eng.last_stats.spec_fraction == 1.0
    # the FP8 copy (weights and activations) still agrees with the policy mostly
    assert eng.last_stats.spec.summary()["accept_rate_at_position"]["1"] > 0.5


def test_coupled_fp8_self_speculation_equals_plain_coupled(models):
    model, arch = models["odd"]
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=9)
    prompts = _prompts()
    seeds = list(range(100, 100 + len(prompts)))
    plain = RolloutEngine(model, None, RolloutConfig(sampling_mode="coupled", max_batch_size=4),
                          arch=arch, eos_token_ids=[]).generate(prompts, sp,
                                                                request_seeds=seeds)
    eng = _engine(model, arch, "3_2_5", sampling_mode="coupled", max_batch_size=4)
    outs = eng.generate(prompts, sp, request_seeds=seeds)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]
    assert eng.last_stats.spec.steps > 0


def test_fp8_copy_refreshes_in_place_after_an_update(tiny_hf_dirs, single_process_parallel):
    """After an in-place update the next generate re-quantizes into the same memory, and
    the copy equals quantizing the updated weights; it is at most 0.3x the policy."""
    model, arch = load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"),
                             dtype="float32")
    eng = _engine(model, arch, "3_1_3")
    draft = eng.spec.draft
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    eng.generate(_prompts()[:2], sp)
    ptrs = [w.q.data_ptr() for w in draft.quant_weights()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    n = draft.refreshes
    eng.generate(_prompts()[:2], sp)
    assert draft.refreshes == n + 1
    assert [w.q.data_ptr() for w in draft.quant_weights()] == ptrs
    for mine, lw in zip(draft.layers, eng.runner.layers):
        for name in ("qkv_w", "proj_w", "fc1_w", "fc2_w"):
            want, got = quantize_fp8(getattr(lw, name), native=False), getattr(mine, name)
            assert torch.equal(got.q.view(torch.uint8), want.q.view(torch.uint8))
            assert torch.equal(got.scale, want.scale)
    want = quantize_fp8(eng.runner.output_w, native=False)
    assert torch.equal(draft.output_w.q.view(torch.uint8), want.q.view(torch.uint8))
    assert draft.nbytes < 0.3 * sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------- config
def test_self_format_config():
    assert SpeculativeConfig().kinds.self.format == "auto"
    with pytest.raises(ConfigError, match="rollout.speculative.kinds.self.format"):
        SelfSettings(format="fp4")
    with pytest.raises(ConfigError, match="rollout.speculative.kinds.self.group=0"):
        SelfSettings(format="fp8", group=64)
    SelfSettings(format="int8", group=64)


def test_self_drafter_at_pp2_needs_the_gathered_rollout():
    from dataclasses import replace

    from megatron_tlt.config import Config
    from megatron_tlt.rollout.speculative.drafters import check_config

    cfg = Config()
    cfg = replace(cfg, parallel=replace(cfg.parallel, pipeline_model_parallel_size=2),
                  rollout=replace(cfg.rollout, pipeline_mode="pipelined",
                                  speculative=SpeculativeConfig(drafter="self")))
    with pytest.raises(ConfigError, match="pipeline_mode=gathered"):
        check_config(cfg)
    check_config(replace(cfg, rollout=replace(cfg.rollout, pipeline_mode="gathered")))
    check_config(replace(cfg, rollout=replace(
        cfg.rollout, speculative=SpeculativeConfig())))  # no self-drafter
