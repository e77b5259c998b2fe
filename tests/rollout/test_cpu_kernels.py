"""The fused CPU decode kernels (megatron_tlt/rollout/cpu_kernels.py) against torch.

Each kernel is compared with the eager torch expression it replaces, on shapes that
reach every code path: the panel GEMM's row tiles (1 to the tile's rows, and blocks of
them beyond), partial panels (N not a multiple of the panel width), any K; attention
with head sizes the kernel specialises (64, 128) and any other (24), at cache position 0
and at positions that are not a multiple of 16; the whole decoder stack against the
eager path.

Every instruction-set variant this CPU can run is built and tested (an AVX-512 machine
also runs the AVX2 and portable builds users of other CPUs get): the ``kern`` fixture
is parametrised over ``cpu_kernels.available_isas()``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from megatron_tlt.rollout import cpu_kernels


# panel width and rows per register tile of each variant
TILES = {"avx512": (48, 8), "avx2": (16, 6), "portable": (8, 6)}


@pytest.fixture(scope="module", params=cpu_kernels.available_isas())
def kern(request):
    k = cpu_kernels.get(request.param)
    assert k is not None, "the CPU kernels did not build (needs a C++ compiler and ninja)"
    return k


def test_each_variant_compiles_its_own_tile(kern):
    """The build for an instruction set takes that set's code path (a forced AVX2 build
    on an AVX-512 CPU really is AVX2 code) and links torch's OpenMP runtime, so the
    process holds one thread pool."""
    assert (kern.PANEL, kern.GEMM_ROWS) == TILES[kern.ISA]
    assert f"/{kern.ISA}-" in kern.__file__
    mine = cpu_kernels.openmp_runtime_of(kern.__file__)
    if mine is not None:  # Linux
        assert mine == cpu_kernels.openmp_runtime_of(cpu_kernels._libtorch())


def test_a_build_killed_half_way_blocks_no_later_build(kern, monkeypatch):
    """A build killed half-way leaves torch's build baton (a plain ``lock`` file) in the
    build folder, on which every later build would wait forever; the folder's flock
    (released when its holder dies) makes it known stale, and it is removed."""
    import threading

    build = cpu_kernels.build_dir(kern.ISA)
    (build / "lock").touch()
    monkeypatch.setattr(cpu_kernels, "_builds", {})
    got = []
    t = threading.Thread(target=lambda: got.append(cpu_kernels.get(kern.ISA)), daemon=True)
    t.start()
    t.join(timeout=300)
    assert not t.is_alive(), "the build waited on the stale lock"
    assert got[0] is not None and got[0].ISA == kern.ISA
    assert not (build / "lock").exists()


def test_variant_selection(monkeypatch):
    monkeypatch.delenv("MEGATRON_TLT_CPU_ISA", raising=False)  # the machine's own choice
    best = cpu_kernels.detect_isa()
    assert cpu_kernels.available_isas()[0] == best
    assert cpu_kernels.requested_isa() == best
    monkeypatch.setenv("MEGATRON_TLT_CPU_ISA", "portable")
    assert cpu_kernels.requested_isa() == "portable"
    with pytest.raises(ValueError, match="unknown"):
        cpu_kernels.requested_isa("sse9")
    for isa in cpu_kernels.ISAS:
        if isa not in cpu_kernels.available_isas():
            with pytest.raises(ValueError, match="cannot run"):
                cpu_kernels.requested_isa(isa)
    assert "-march=native" in cpu_kernels.compile_flags(best)
    monkeypatch.setenv("MEGATRON_TLT_NO_CPU_KERNELS", "1")
    assert cpu_kernels.get() is None


def test_pack_weight_layout(kern):
    """Panel p, row k, lane j holds w[P p + j, k] (P = kern.PANEL); rows past N are
    zeros."""
    P = kern.PANEL
    n = 2 * P + 4
    w = torch.randn(n, 7)
    wp = kern.pack_weight(w)
    assert wp.shape == (3, 7, P)
    ref = torch.zeros(3 * P, 7)
    ref[:n] = w
    assert torch.equal(wp, ref.view(3, P, 7).transpose(1, 2))
    again = kern.pack_weight(w * 2, wp)  # into an existing buffer
    assert again.data_ptr() == wp.data_ptr()
    assert torch.equal(wp, 2 * ref.view(3, P, 7).transpose(1, 2))


def test_fingerprint_sees_every_element(kern):
    """Equal content, equal fingerprint; one changed element anywhere (the vectorised
    part, the scalar tail, any of several chunks) or two swapped ones change it."""
    a = torch.randn(70_003)  # > 4 chunks of 16 Ki words, and a tail of 3
    base = kern.fingerprint([a, a.clone()])
    assert base[0] == base[1]
    for i in (0, 1, 63, 64, 16_383, 16_384, 40_000, 69_999, 70_002):
        b = a.clone()
        b[i] += 0.5
        assert kern.fingerprint([b])[0] != base[0], i
    b = a.clone()
    b[[5, 6]] = a[[6, 5]]
    assert kern.fingerprint([b])[0] != base[0]
    assert kern.fingerprint([a[:-1].clone()])[0] != base[0]  # length counts too
    ints = torch.arange(10, dtype=torch.int32)
    assert kern.fingerprint([ints])[0] == kern.fingerprint([ints.clone()])[0]
    with pytest.raises(RuntimeError, match="contiguous"):
        kern.fingerprint([torch.randn(4, 4).t()])


def test_pack_weights_packs_many_like_one(kern):
    P = kern.PANEL
    ws = [torch.randn(n, k) for n, k in ((100, 7), (48, 64), (5, 3), (200, 33))]
    outs = [torch.full((-(-w.shape[0] // P), w.shape[1], P), float("nan")) for w in ws]
    kern.pack_weights(ws, outs)
    for w, o in zip(ws, outs):
        assert torch.equal(o, kern.pack_weight(w))
    with pytest.raises(RuntimeError, match="packed weight"):
        kern.pack_weights([torch.randn(P + 1, 4)], [torch.empty(1, 4, P)])


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 8, 9, 12, 13, 16, 17, 33, 64])
@pytest.mark.parametrize("n,k", [(96, 64), (37, 50), (5, 7), (130, 1536)])
def test_linear_matches_torch(kern, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    wp = kern.pack_weight(w)
    b = torch.randn(n, generator=g)
    r = torch.randn(m, n, generator=g)
    tol = 2e-6 * math.sqrt(k) * 4
    torch.testing.assert_close(kern.linear(x, wp, n), x @ w.t(), rtol=0, atol=tol)
    torch.testing.assert_close(kern.linear(x, wp, n, b), F.linear(x, w, b), rtol=0, atol=tol)
    torch.testing.assert_close(kern.linear(x, wp, n, None, r), r + x @ w.t(), rtol=0,
                               atol=tol)
    r0 = r.clone()
    kern.linear(x, wp, n, b, r)
    assert torch.equal(r, r0), "the residual input must not be modified"


def test_linear_rows_are_independent_of_the_batch(kern):
    """A row's output is bitwise the same alone or among others (plain decoding at one
    row and verification at several then see identical logits)."""
    g = torch.Generator().manual_seed(5)
    w = torch.randn(200, 576, generator=g)
    wp = kern.pack_weight(w)
    x = torch.randn(19, 576, generator=g)
    full = kern.linear(x, wp, 200)
    for i in (0, 5, 6, 7, 8, 18):
        assert torch.equal(kern.linear(x[i: i + 1].contiguous(), wp, 200), full[i: i + 1])
    assert torch.equal(kern.linear(x[3:12].contiguous(), wp, 200), full[3:12])
    assert torch.equal(kern.linear(x[1:14].contiguous(), wp, 200), full[1:14])


def test_linear_rejects_bad_input(kern):
    with pytest.raises(RuntimeError, match="packed weight"):
        kern.linear(torch.randn(2, 8), kern.pack_weight(torch.randn(4, 9)), 4)
    with pytest.raises(RuntimeError, match="packed weight"):
        kern.linear(torch.randn(2, 8), torch.randn(4, 8), 4)  # not packed
    with pytest.raises(RuntimeError, match="packed weight"):
        kern.linear(torch.randn(2, 8), kern.pack_weight(torch.randn(4, 8)), kern.PANEL + 12)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kern.linear(torch.randn(2, 8, dtype=torch.float64), kern.pack_weight(torch.randn(4, 8)), 4)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        kern.linear(torch.randn(8, 2).t(), kern.pack_weight(torch.randn(4, 8)), 4)


def test_argmax_rows_matches_torch(kern):
    """First of equal maxima, first NaN, all -inf, a column limit and a row stride, odd
    widths (vector body and scalar tail)."""
    g = torch.Generator().manual_seed(0)
    for n in (1, 15, 16, 17, 1000, 49152):
        x = torch.randn(9, n, generator=g)
        assert torch.equal(kern.argmax_rows(x, n), torch.argmax(x, dim=-1)), n
    x = torch.randn(6, 100, generator=g)
    x[0, [3, 40, 99]] = 50.0  # ties: the first
    x[1, 70] = float("nan")
    x[1, 80] = float("nan")
    x[2] = float("-inf")
    x[3, 96:] = 60.0  # the maximum in the scalar tail
    x[4, 5] = -0.0
    x[4] = -1.0
    x[4, 7] = 0.0
    x[4, 5] = -0.0  # -0.0 == 0.0: the first of the two
    assert torch.equal(kern.argmax_rows(x, 100), torch.argmax(x, dim=-1))
    assert kern.argmax_rows(x, 100).tolist()[:5] == [3, 70, 0, 96, 5]
    wide = torch.randn(4, 130, generator=g)
    assert torch.equal(kern.argmax_rows(wide, 100), torch.argmax(wide[:, :100], dim=-1))
    view = wide[:, :100]  # row stride 130
    assert torch.equal(kern.argmax_rows(view, 100), torch.argmax(view, dim=-1))
    with pytest.raises(RuntimeError, match="unit column stride"):
        kern.argmax_rows(wide.t(), 4)
    with pytest.raises(RuntimeError):
        kern.argmax_rows(wide, 131)


def test_rms_norm_and_silu_mul_match_torch(kern):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 77, generator=g) * 3
    w = torch.randn(77, generator=g)
    torch.testing.assert_close(kern.rms_norm(x, w, 1e-5), F.rms_norm(x, (77,), w, 1e-5),
                               rtol=1e-6, atol=1e-6)
    # silu's exp over the whole float range, including where it under- and overflows
    a = torch.cat([torch.linspace(-120, 120, 4001), torch.randn(95, generator=g)])
    h = torch.stack([torch.cat([a, torch.ones_like(a)]),
                     torch.cat([a / 7, torch.randn(a.shape, generator=g)])])
    ref = F.silu(h[:, : a.numel()]) * h[:, a.numel():]
    got = kern.silu_mul(h)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=4e-7, atol=1e-30)


def _reference_attend(qkv, cos, sin, kc, vc, pos, g, hpg, d, scale):
    """RoPE + cache write + causal GQA attention, in eager torch (on copies)."""
    kc, vc = kc.clone(), vc.clone()
    b = qkv.shape[0]
    x = qkv.view(b, g, hpg + 2, d)
    rot = lambda t: t * cos[:, None, None] + torch.roll(t, d // 2, -1) * sin[:, None, None]  # noqa: E731
    q = rot(x[:, :, :hpg])
    k = rot(x[:, :, hpg:hpg + 1])[:, :, 0]
    out = torch.empty(b, g, hpg, d)
    for i in range(b):
        p = int(pos[i])
        kc[i, :, p], vc[i, :, p] = k[i], x[i, :, hpg + 1]
        s = torch.einsum("ghd,gjd->ghj", q[i], kc[i, :, : p + 1]) * scale
        out[i] = torch.einsum("ghj,gjd->ghd", s.softmax(-1), vc[i, :, : p + 1])
    return out.reshape(b, -1), kc, vc


@pytest.mark.parametrize("d,hpg", [(64, 3), (128, 2), (24, 1), (24, 4)])
def test_rope_attend_matches_torch(kern, d, hpg):
    gen = torch.Generator().manual_seed(d + hpg)
    b, g, s = 4, 2, 70
    qkv = torch.randn(b, g * (hpg + 2) * d, generator=gen)
    pos = torch.tensor([0, 17, 69, 32])
    ang = torch.randn(b, d // 2, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)  # rotate-half's signs folded in
    kc = torch.randn(b, g, s, d, generator=gen)
    vc = torch.randn(b, g, s, d, generator=gen)
    ref, kref, vref = _reference_attend(qkv, cos, sin, kc, vc, pos, g, hpg, d, d ** -0.5)
    out = kern.rope_attend(qkv, cos, sin, kc, vc, pos, g, hpg, d, d ** -0.5)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)
    torch.testing.assert_close(kc, kref, rtol=0, atol=1e-6)
    assert torch.equal(vc, vref)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kern.rope_attend(qkv, cos, sin, kc, vc, torch.tensor([0, 1, 70, 2]), g, hpg, d, 1.0)


def _paged_copy(kc, vc, bs, gen):
    """The contiguous caches kc, vc [rows, G, S, D] as pools [blocks, G, bs, D] behind a
    shuffled block table [rows, S / bs] (block 0, the scratch block, never used)."""
    rows, g, s, d = kc.shape
    width = s // bs
    perm = torch.randperm(rows * width, generator=gen) + 1
    table = perm.view(rows, width)
    pools = []
    for c in (kc, vc):
        pool = torch.full((rows * width + 1, g, bs, d), float("nan"))
        pool[table.reshape(-1)] = c.view(rows, g, width, bs, d).transpose(1, 2).reshape(
            rows * width, g, bs, d)
        pools.append(pool)
    return pools[0], pools[1], table


def _unpage(pool, table):
    rows, width = table.shape
    _, g, bs, d = pool.shape
    return pool[table.reshape(-1)].view(rows, width, g, bs, d).transpose(1, 2).reshape(
        rows, g, width * bs, d)


@pytest.mark.parametrize("d,hpg,bs", [(64, 3, 16), (24, 4, 8), (128, 1, 5)])
def test_paged_rope_attend_equals_the_contiguous_kernel(kern, d, hpg, bs):
    """A paged cache (pools of ``bs``-position blocks, a shuffled block table) read in
    place gives bitwise the contiguous kernel's output and writes, with ragged chains
    through a row map (verification's layout) and positions at block edges."""
    gen = torch.Generator().manual_seed(7 * d + bs)
    rows, g, s = 3, 2, 8 * bs if bs != 5 else 40
    kc = torch.randn(rows, g, s, d, generator=gen)
    vc = torch.randn(rows, g, s, d, generator=gen)
    kp, vp, table = _paged_copy(kc, vc, bs, gen)
    # row 2: a chain of 3 across a block edge; row 0: position 0; row 1: the last one
    row_of = torch.tensor([2, 2, 2, 0, 1])
    pos = torch.tensor([bs - 2, bs - 1, bs, 0, s - 1])
    b = len(pos)
    qkv = torch.randn(b, g * (hpg + 2) * d, generator=gen)
    ang = torch.randn(b, d // 2, generator=gen)
    cos = torch.cat([ang.cos(), ang.cos()], -1)
    sin = torch.cat([-ang.sin(), ang.sin()], -1)
    ref = kern.rope_attend(qkv, cos, sin, kc, vc, pos, g, hpg, d, d ** -0.5, row_of)
    got = kern.rope_attend(qkv, cos, sin, kp, vp, pos, g, hpg, d, d ** -0.5, row_of, table)
    assert torch.equal(got, ref)
    assert torch.equal(_unpage(kp, table), kc) and torch.equal(_unpage(vp, table), vc)
    assert torch.isnan(kp[0]).all(), "the scratch block was written"
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        kern.rope_attend(qkv, cos, sin, kp, vp, pos + s, g, hpg, d, 1.0, row_of, table)
    bad = table.clone()
    bad[0, 0] = kp.shape[0]
    with pytest.raises(RuntimeError, match="outside the KV pool"):
        kern.rope_attend(qkv, cos, sin, kp, vp, pos, g, hpg, d, 1.0, row_of, bad)


def test_decode_layers_match_the_eager_path(kern):
    """The whole decoder stack in one call (``decode_layers``, through
    ``ModelRunner.extend``) against the eager layers, on random weights with a QKV bias
    and head size 64: hidden states and the KV cache, at mixed positions, batches of 1,
    the tile's rows + 1 and 11 rows."""
    from megatron_tlt.rollout.forward import ModelRunner, _Layer
    from megatron_tlt.rollout.kernel_policy import ALWAYS, PolicyKernels
    from megatron_tlt.rollout.kv_cache import KVCache

    g = torch.Generator().manual_seed(3)
    h, groups, hpg, d, f, vocab = 96, 2, 2, 64, 160, 300

    def mat(n, k):
        return torch.randn(n, k, generator=g) * k ** -0.5

    layers = [_Layer(ln1=1 + 0.1 * torch.randn(h, generator=g),
                     qkv_w=mat(groups * (hpg + 2) * d, h),
                     qkv_b=0.1 * torch.randn(groups * (hpg + 2) * d, generator=g),
                     proj_w=mat(h, groups * hpg * d), ln2=1 + 0.1 * torch.randn(h, generator=g),
                     fc1_w=mat(2 * f, h), fc2_w=mat(h, f)) for _ in range(2)]
    runner = ModelRunner.from_tensors(embed_w=torch.randn(vocab, h, generator=g),
                                      layers=layers, final_norm=torch.ones(h),
                                      output_w=mat(vocab, h), groups=groups,
                                      heads_per_group=hpg, eps=1e-6)
    runner.kernels = PolicyKernels(kern, ALWAYS)
    runner.pack_weights()
    for b in (1, kern.GEMM_ROWS + 1, 11):
        caches = [KVCache(num_layers=2, max_batch=b, kv_heads=groups, capacity=40,
                          head_dim=d, dtype=torch.float32, device=torch.device("cpu"))
                  for _ in range(2)]
        for c in caches[1:]:
            c.k.copy_(caches[0].k.normal_(generator=g))
            c.v.copy_(caches[0].v.normal_(generator=g))
        tok = torch.randint(0, vocab, (b, 1), generator=g)
        start = torch.randint(0, 39, (b,), generator=g)
        with torch.no_grad():
            fused = runner.extend(caches[0], slice(0, b), tok, start)
            runner.kernels, saved = None, runner.kernels
            eager = runner.extend(caches[1], slice(0, b), tok, start)
            runner.kernels = saved
        torch.testing.assert_close(fused, eager, rtol=0, atol=3e-5)
        torch.testing.assert_close(caches[0].k, caches[1].k, rtol=0, atol=1e-5)
        torch.testing.assert_close(caches[0].v, caches[1].v, rtol=0, atol=1e-5)


# ------------------------------------------------------------------ coupled sampling noise
def _unfmix32(h: int) -> int:
    """The inverse of sampling._fmix32 (each step of the finaliser is a bijection)."""
    m = 0xFFFFFFFF

    def unshift(x, s):  # inverse of x ^= x >> s
        y = x
        for _ in range(32 // s + 1):
            y = x ^ (y >> s)
        return y & m

    h = unshift(h, 16)
    h = (h * pow(0xC2B2AE35, -1, 1 << 32)) & m
    h = unshift(h, 13)
    h = (h * pow(0x85EBCA6B, -1, 1 << 32)) & m
    return unshift(h, 16)


def test_coupled_noise_kernel_matches_the_torch_form(kern):
    """The kernel's Gumbel noise is sampling.coupled_gumbel's (the torch form) up to a few
    ulp of a float32 log, on every row and column, the ragged end of a row included."""
    from megatron_tlt.rollout.sampling import coupled_gumbel

    keys, pos = [3, 2**40 + 7, 11, 11], [0, 5, 5, 6]
    for vocab in (1, 15, 49152 + 7):
        a = coupled_gumbel(keys, pos, vocab, "cpu")
        b = coupled_gumbel(keys, pos, vocab, "cpu", kernels=kern)
        assert b.shape == a.shape and b.dtype == torch.float32
        assert torch.allclose(b, a, rtol=1e-6, atol=2e-6), (vocab, (a - b).abs().max())
    # a subset of tokens (token_ids) gives the same columns
    ids = torch.tensor([5, 0, 49000, 17])
    sub = coupled_gumbel(keys, pos, 49152, "cpu", token_ids=ids, kernels=kern)
    assert torch.equal(sub, coupled_gumbel(keys, pos, 49152, "cpu", kernels=kern)[:, ids])


def test_coupled_noise_kernel_is_accurate_at_both_ends_of_the_hash(kern):
    """Against float64's -log(-log U) where the float32 form is hardest: U near 0
    (E large), near 1/2 (the switch to log1p) and near 1 (E tiny: the large g that decide
    rare tokens). Token hashes are chosen through the finaliser's inverse so that the
    kernel's hash lands on each target value."""
    h = [*range(0, 300), *range(2**31 - 300, 2**31 + 300), *range(2**32 - 300, 2**32)]
    salt = 0x5EED
    table = torch.tensor([_unfmix32(x) ^ salt for x in h], dtype=torch.int64)
    g = kern.coupled_gumbel(torch.tensor([salt]), table)[0].double()
    hd = torch.tensor(h, dtype=torch.float64)
    exact = -torch.log(-torch.log((hd + 0.5) / 2**32))
    assert torch.all((g - exact).abs() <= 4e-7 * exact.abs().clamp_min(1.0)), \
        (g - exact).abs().max()
    assert g.max() > 22.0  # the Gumbel tail reaches -log(-log(1 - 2^-33))
