"""The CPU kernels' int8-weight GEMM (``pack_int8``, ``linear_int8``,
``decode_layers_int8``: the self-drafter's quantized copy) against float64 references of
the dequantized weights, in every instruction-set variant this CPU runs (AVX-512, AVX2,
portable), on shapes that reach the row tiles, partial panels, per-channel and grouped
scales with a shorter last group; with int8 activations (``act_block``) against the
exact integer sums of ``quantize.quantize_activations``' blocks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_tlt.rollout import cpu_kernels
from megatron_tlt.rollout.forward import ModelRunner, _Layer
from megatron_tlt.rollout.kv_cache import KVCache
from megatron_tlt.rollout.speculative.quantize import (dequantize_activations, int8_linear,
                                            panel_byte_offset, quantize_activations,
                                            quantize_int8, unpack_panel)


@pytest.fixture(scope="module", params=cpu_kernels.available_isas())
def kern(request):
    k = cpu_kernels.get(request.param)
    assert k is not None, "the CPU kernels did not build (needs a C++ compiler and ninja)"
    return k


@pytest.mark.parametrize("group", [0, 64, 40])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_linear_int8_matches_the_dequantized_product(kern, group, rows):
    """x @ (q * s)^T + bias + residual within float32 rounding of the float64 product,
    for N not a multiple of the panel width and K not a multiple of the group."""
    g = torch.Generator().manual_seed(rows + group)
    n, k = 3 * kern.PANEL + 5, 200
    qw = quantize_int8(torch.randn(n, k, generator=g), group)
    wp, sp = kern.pack_int8(qw.q, qw.scale)
    assert wp.dtype == torch.int8 and wp.shape == (4, k, kern.PANEL)
    x = torch.randn(rows, k, generator=g)
    b, res = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    w = qw.dequantize().double()
    ref = x.double() @ w.t()
    tol = 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-5
    got = kern.linear_int8(x, wp, sp, n, qw.group)
    assert ((got.double() - ref).abs() <= tol).all()
    got = kern.linear_int8(x, wp, sp, n, qw.group, bias=b, residual=res)
    assert ((got.double() - (ref + b.double() + res.double())).abs() <= tol + 1e-5).all()
    # a row's result does not depend on the other rows (the same at any batch size)
    one = kern.linear_int8(x[-1:].contiguous(), wp, sp, n, qw.group)
    assert torch.equal(one[0], kern.linear_int8(x, wp, sp, n, qw.group)[-1])


@pytest.mark.parametrize("group,act_block", [(0, 32), (64, 32), (64, 64), (40, 8), (0, 4)])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_linear_int8_with_int8_activations_is_the_integer_block_sum(kern, group, act_block,
                                                                     rows):
    """With an activation block each block's dot product is the exact integer sum of the
    quantized activations and weights, scaled by both scales: float32 rounding of the
    float64 result only; K = 202 is not a multiple of 4 (padded inputs) nor of the block
    or group (shorter last ones)."""
    g = torch.Generator().manual_seed(7 * rows + group + act_block)
    n, k = 3 * kern.PANEL + 5, 202
    qw = quantize_int8(torch.randn(n, k, generator=g), group, act_block)
    wp, sp = kern.pack_int8(qw.q, qw.scale, act_block)
    assert wp.dtype == torch.int8 and wp.shape == (4, (k + 3) // 4, kern.PANEL, 4)
    x = torch.randn(rows, k, generator=g) * torch.linspace(0.1, 3, k)  # uneven blocks
    a, s = quantize_activations(x, act_block)
    ref = torch.zeros(rows, n, dtype=torch.float64)
    for k0 in range(0, k, act_block):
        k1 = min(k, k0 + act_block)
        dot = a[:, k0:k1].double() @ qw.q[:, k0:k1].double().t()  # exact in float64
        ref += dot * s[:, k0 // act_block, None].double() * qw.scale[:, k0 // qw.group].double()
    got = kern.linear_int8(x, wp, sp, n, qw.group, act_block)
    tol = 1e-5 * (dequantize_activations(a, s, act_block).double().abs()
                  @ qw.dequantize().double().abs().t()) + 1e-6
    assert ((got.double() - ref).abs() <= tol).all()
    b, res = torch.randn(n, generator=g), torch.randn(rows, n, generator=g)
    got = kern.linear_int8(x, wp, sp, n, qw.group, act_block, b, res)
    assert ((got.double() - (ref + b.double() + res.double())).abs() <= tol + 1e-5).all()
    # the reference path (int8_linear: fake-quantized activations, float matmul) agrees
    assert torch.allclose(int8_linear(x, qw, b, res), got, rtol=1e-4, atol=1e-4)
    one = kern.linear_int8(x[-1:].contiguous(), wp, sp, n, qw.group, act_block)
    assert torch.equal(one[0], kern.linear_int8(x, wp, sp, n, qw.group, act_block)[-1])


def test_activation_quantization_bounds_its_error():
    """Each block's values come back within half a step of its scale, an all-zero block
    stays zero, and the extremes map to +-127."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 70, generator=g)
    x[1, 32:64] = 0
    a, s = quantize_activations(x, 32)
    assert a.dtype == torch.int8 and s.shape == (5, 3)
    assert a.abs().max() == 127 and (a[1, 32:64] == 0).all() and s[1, 1] == 1
    err = (dequantize_activations(a, s, 32) - x).abs()
    assert (err <= 0.5 * s.repeat_interleave(32, dim=1)[:, :70] * (1 + 1e-6)).all()


@pytest.mark.parametrize("group,act_block", [(0, 0), (40, 0), (0, 32), (64, 8)])
def test_a_packed_weight_keeps_one_int8_copy_and_reads_it_back(kern, group, act_block):
    """``unpack_panel`` inverts ``pack_int8``'s layout (partial panels, K not a multiple
    of 4, VNNI's byte offset where the build has one), so a weight that keeps only its
    panels (``QuantWeight.pack``) still dequantizes to the same matrix; its bytes are
    the panels and both scales, not q besides."""
    g = torch.Generator().manual_seed(group + act_block)
    n, k = 2 * kern.PANEL + 3, 202
    qw = quantize_int8(torch.randn(n, k, generator=g), group, act_block)
    ref, want = qw.q.clone(), qw.dequantize()
    wp, sp = kern.pack_int8(qw.q, qw.scale, act_block)
    off = panel_byte_offset(kern, act_block)
    assert off in (0, 128) and (off == 128) == (act_block > 0 and kern.INT8_ACT == "avx512-vnni")
    assert torch.equal(unpack_panel(wp, n, k, act_block, off), ref)
    qw.pack(wp, sp, off)
    assert qw.packed and qw.q is None and qw.shape == (n, k)
    assert torch.equal(qw.int8_values(), ref) and torch.equal(qw.dequantize(), want)
    assert qw.nbytes == wp.numel() + 4 * (sp.numel() + qw.scale.numel())


@pytest.mark.parametrize("act_block", [0, 32])
def test_linear_int8_in_chunks_of_rows_equals_one_call(kern, act_block):
    """Rows are independent in the int8 GEMM: 150 rows in chunks of MAX_FUSED_ROWS give
    bitwise the one call's result (the self-drafter's path beyond that many rows)."""
    g = torch.Generator().manual_seed(act_block)
    n, k, m = kern.PANEL + 7, 96, 150
    qw = quantize_int8(torch.randn(n, k, generator=g), 0, act_block)
    wp, sp = kern.pack_int8(qw.q, qw.scale, act_block)
    x, b, res = torch.randn(m, k, generator=g), torch.randn(n, generator=g), \
        torch.randn(m, n, generator=g)
    whole = kern.linear_int8(x, wp, sp, n, qw.group, act_block, b, res)
    step = cpu_kernels.MAX_FUSED_ROWS
    parts = torch.cat([kern.linear_int8(x[i:i + step], wp, sp, n, qw.group, act_block, b,
                                        res[i:i + step]) for i in range(0, m, step)])
    assert torch.equal(parts, whole)


def test_int8_kernels_check_their_inputs(kern):
    qw = quantize_int8(torch.randn(20, 64), 16)
    wp, sp = kern.pack_int8(qw.q, qw.scale)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="scales must be packed"):
        kern.linear_int8(x, wp, sp, 20, 32)  # the wrong group size
    with pytest.raises(RuntimeError, match="packed int8 weight"):
        kern.linear_int8(torch.randn(2, 63), wp, sp, 20, 16)
    with pytest.raises(RuntimeError, match="activation block"):
        kern.linear_int8(x, wp, sp, 20, 16, 16)  # packed for float activations
    wp, sp = kern.pack_int8(qw.q, qw.scale, 8)
    with pytest.raises(RuntimeError, match="multiple of the activation block"):
        kern.linear_int8(x, wp, sp, 20, 16, 32)
    with pytest.raises(ValueError, match="multiple of the activation block"):
        quantize_int8(torch.randn(4, 64), 16, 32)
    with pytest.raises(ValueError, match="multiple of 4"):
        quantize_int8(torch.randn(4, 64), 0, 6)


@pytest.mark.parametrize("group,act_block", [(0, 0), (32, 0), (0, 32), (32, 16)])
def test_decode_layers_int8_matches_the_reference_layers(kern, group, act_block):
    """The fused int8 decoder stack equals the layer-by-layer reference (the runner's
    eager path over the dequantized weights, its linears' inputs quantized per block with
    an activation block) at a decode step of 3 rows with a prefix."""
    g = torch.Generator().manual_seed(group)
    h, f, groups, hpg, d, layers = 64, 96, 2, 2, 16, 2
    nqkv, natt = groups * (hpg + 2) * d, groups * hpg * d

    def mat(n, k):
        return torch.randn(n, k, generator=g) * k ** -0.5

    fl = [_Layer(ln1=1 + 0.1 * torch.randn(h, generator=g), qkv_w=mat(nqkv, h), qkv_b=None,
                 proj_w=mat(h, natt), ln2=1 + 0.1 * torch.randn(h, generator=g),
                 fc1_w=mat(2 * f, h), fc2_w=mat(h, f)) for _ in range(layers)]
    q = [{n: quantize_int8(getattr(lw, n), group, act_block)
          for n in ("qkv_w", "proj_w", "fc1_w", "fc2_w")} for lw in fl]
    deq = [_Layer(ln1=lw.ln1, qkv_w=qq["qkv_w"].dequantize(), qkv_b=None,
                  proj_w=qq["proj_w"].dequantize(), ln2=lw.ln2,
                  fc1_w=qq["fc1_w"].dequantize(), fc2_w=qq["fc2_w"].dequantize())
           for lw, qq in zip(fl, q)]
    norm = torch.ones(h)
    ref = ModelRunner.from_tensors(embed_w=mat(50, h), layers=deq, final_norm=norm,
                                   output_w=mat(50, h), groups=groups, heads_per_group=hpg)
    if act_block:  # the reference's linears see the activations the kernel quantizes
        lin = ref._lin
        ref._lin = lambda x, w, b=None, residual=None: lin(
            dequantize_activations(*quantize_activations(x, act_block), act_block), w, b,
            residual)
    b, prefix = 3, 5
    caches = [KVCache(num_layers=layers, max_batch=b, kv_heads=groups, capacity=16,
                      head_dim=d, dtype=torch.float32, device=torch.device("cpu"))
              for _ in range(2)]
    tokens = torch.randint(0, 50, (b, prefix + 1), generator=g)
    start = torch.zeros(b, dtype=torch.long)
    for c in caches:  # the same prefix in both caches
        ref.extend(c, slice(0, b), tokens[:, :prefix], start)
    want = ref.extend(caches[0], slice(0, b), tokens[:, prefix:], start + prefix)[:, 0]
    pos = torch.full((b,), prefix, dtype=torch.long)
    cos, sin = ref.rope(pos)
    packed = [{n: kern.pack_int8(qw.q, qw.scale, act_block) for n, qw in qq.items()} for qq in q]
    x = ref.embed(tokens[:, prefix]).contiguous()
    got = kern.decode_layers_int8(
        x, [lw.ln1 for lw in fl], [p["qkv_w"][0] for p in packed],
        [p["qkv_w"][1] for p in packed], [torch.empty(0)] * layers,
        [p["proj_w"][0] for p in packed], [p["proj_w"][1] for p in packed],
        [lw.ln2 for lw in fl], [p["fc1_w"][0] for p in packed], [p["fc1_w"][1] for p in packed],
        [p["fc2_w"][0] for p in packed], [p["fc2_w"][1] for p in packed], group or 1 << 40,
        act_block, norm, caches[1].k, caches[1].v, cos.contiguous(),
        (sin * ref._sin_sign).contiguous(), pos, groups, hpg, d, ref.scale, ref.eps)
    assert (got - want).abs().max() < 1e-4
    assert torch.allclose(caches[1].k[:, :, :, : prefix + 1], caches[0].k[:, :, :, : prefix + 1],
                          atol=1e-5)
    assert F.cosine_similarity(got, want, dim=-1).min() > 0.9999
