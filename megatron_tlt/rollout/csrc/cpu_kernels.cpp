// Fused CPU kernels for the rollout engine's decode step (float32); see
// megatron_tlt/rollout/cpu_kernels.py, which compiles this file on first use (one build
// per instruction set: AVX-512, AVX2 + FMA, portable) with torch.utils.cpp_extension.
#include <torch/extension.h>
#include <omp.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <cmath>
#include <cstring>
#include <vector>

// 16-float vectors through GCC/Clang vector extensions: one AVX-512 register where the
// CPU has it, two AVX2 or four SSE registers otherwise; -ffp-contract=fast fuses a*b+c.
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8 __attribute__((vector_size(32)));
typedef float v4 __attribute__((vector_size(16)));

// The native vector of the instruction set the build targets (vg: kVL floats, one
// register), for the code whose vector comparisons and selects GCC would otherwise
// expand element by element on 64-byte v16 values without AVX-512 (argmax, exp's
// clamps), and for the GEMM's register tile (below).
#if defined(__AVX512F__)
#define MTLT_ISA "avx512"
typedef float vg __attribute__((vector_size(64)));
typedef int32_t vgi __attribute__((vector_size(64)));
static constexpr int kVL = 16;
#ifndef MTLT_GEMM_VECS
#define MTLT_GEMM_VECS 3
#endif
#ifndef MTLT_GEMM_ROWS
#define MTLT_GEMM_ROWS 8
#endif
static inline vg bcast(const float* p) { return (vg)_mm512_set1_ps(*p); }
#elif defined(__AVX2__) && defined(__FMA__)
#define MTLT_ISA "avx2"
typedef float vg __attribute__((vector_size(32)));
typedef int32_t vgi __attribute__((vector_size(32)));
static constexpr int kVL = 8;
#ifndef MTLT_GEMM_VECS
#define MTLT_GEMM_VECS 2
#endif
#ifndef MTLT_GEMM_ROWS
#define MTLT_GEMM_ROWS 6
#endif
static inline vg bcast(const float* p) { return (vg)_mm256_broadcast_ss(p); }
#else
#define MTLT_ISA "portable"
typedef float vg __attribute__((vector_size(16)));
typedef int32_t vgi __attribute__((vector_size(16)));
static constexpr int kVL = 4;
#ifndef MTLT_GEMM_VECS
#define MTLT_GEMM_VECS 2
#endif
#ifndef MTLT_GEMM_ROWS
#define MTLT_GEMM_ROWS 6
#endif
static inline vg bcast(const float* p) { return vg{} + *p; }
#endif
static inline vg ldg(const float* p) { vg v; std::memcpy(&v, p, sizeof v); return v; }
static inline void stg(float* p, vg v) { std::memcpy(p, &v, sizeof v); }

static inline v16 ld(const float* p) { v16 v; std::memcpy(&v, p, sizeof v); return v; }
static inline void st(float* p, v16 v) { std::memcpy(p, &v, sizeof v); }
static inline v16 splat(float a) { return v16{} + a; }
static inline float hsum(v16 v) {
  v8 a, b; std::memcpy(&a, &v, 32); std::memcpy(&b, (const char*)&v + 32, 32); a += b;
  v4 c, d; std::memcpy(&c, &a, 16); std::memcpy(&d, (const char*)&a + 16, 16); c += d;
  return (c[0] + c[2]) + (c[1] + c[3]);
}
// exp on kVL lanes: 2^n * e^r with r = x - n ln2 in [-ln2/2, ln2/2] and a degree-7
// Taylor polynomial for e^r (truncation error < 5e-9 relative, below float rounding).
static inline vg vexp_native(vg x) {
  const vg lo = vg{} - 87.0f, hi = vg{} + 88.0f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const vg shifter = vg{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vg n = (x * 1.44269504088896341f + shifter) - shifter;
  vg r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  vg p = vg{} + 1.f / 5040.f;
  p = p * r + 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  vgi e = (__builtin_convertvector(n, vgi) + 127) << 23;
  vg scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}
// exp on 16 lanes, in native vectors
static inline v16 vexp(v16 x) {
  vg part[16 / kVL];
  std::memcpy(part, &x, sizeof x);
  for (int i = 0; i < 16 / kVL; ++i) part[i] = vexp_native(part[i]);
  v16 out;
  std::memcpy(&out, part, sizeof out);
  return out;
}

// ---------------------------------------------------------------- panel GEMM
// Weights are used in a panel layout made by pack_weight: w [N, K] becomes
// [ceil(N / kPanel)][K][kPanel] (zero rows pad the last panel), so one weight stream runs
// through memory in order and kPanel outputs of a row are kPanelVecs vector accumulators.
// For each k the kernel loads the panel's kPanel weights once and multiplies them by
// x[m, k] of up to kMT rows (a broadcast from memory): no horizontal sums, every weight
// read once per call (a panel stays in L1/L2 across blocks of rows). Each output is a sum
// over k in order, whatever the row count and the tile shape, so a row's result does not
// depend on its batch.
//
// The tile is chosen per instruction set at compile time so that the kMT x kPanelVecs
// accumulators, the kPanelVecs weight vectors and the broadcast stay in the vector
// register file (AVX-512: 32 zmm; AVX2 and SSE: 16 ymm / xmm):
//   AVX-512  vectors of 16 floats, panel 48 x 8 rows: 24 accumulators + 3 weights
//   AVX2     vectors of  8 floats, panel 16 x 6 rows: 12 accumulators + 2 weights + 1
//   portable vectors of  4 floats, panel  8 x 6 rows: 12 accumulators + 2 weights + 1
// (MTLT_GEMM_VECS / MTLT_GEMM_ROWS override the tile, for experiments).
static constexpr int kPanelVecs = MTLT_GEMM_VECS;
static constexpr int kMT = MTLT_GEMM_ROWS;
static constexpr int64_t kPanel = (int64_t)kVL * kPanelVecs;
static_assert(kMT >= 1 && kMT <= 16 && kPanelVecs >= 1, "GEMM tile");
// software prefetch ~4.6 KB ahead in the weight stream, one prefetch per 64-byte line
static constexpr int64_t kPrefetchBytes = 4608;
static constexpr int64_t kPrefetchK = (kPrefetchBytes + kPanel * 4 - 1) / (kPanel * 4);
static constexpr int kLinesPerK = (int)((kPanel * 4 + 63) / 64);
static constexpr int64_t kKBlock = 64;

// out[m, n0 + j] (+)= tot[m][j] (+ bias[n0 + j]) for m < MT, j < nvalid: a register
// tile's totals written out (every panel GEMM's last step)
template <int MT>
static inline void store_tile(const vg (&tot)[MT][kPanelVecs], float* __restrict out,
                              int64_t ldo, int64_t n0, int64_t nvalid,
                              const float* __restrict bias, bool accumulate) {
  for (int m = 0; m < MT; ++m) {
    float s[kPanel];
    for (int v = 0; v < kPanelVecs; ++v) stg(s + kVL * v, tot[m][v]);
    float* o = out + m * ldo + n0;
    for (int64_t j = 0; j < nvalid; ++j) {
      float r = s[j];
      if (bias) r += bias[n0 + j];
      o[j] = accumulate ? o[j] + r : r;
    }
  }
}

// out[m, n0 + j] (+)= sum_k xt[k * ldx + m] * panel[k][j] (+ bias) for m < MT, j < nvalid.
template <int MT>
static inline void panel_tile(const float* __restrict xt, int64_t ldx, int64_t K,
                              const float* __restrict wp, float* __restrict out, int64_t ldo,
                              int64_t n0, int64_t nvalid, const float* __restrict bias,
                              bool accumulate) {
  // Sums run over blocks of kKBlock k's in registers, added into totals in L1 after each
  // block: rounding error grows with the block length, not with K.
  vg tot[MT][kPanelVecs];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < kPanelVecs; ++v) tot[m][v] = vg{};
  for (int64_t k0 = 0; k0 < K; k0 += kKBlock) {
    const int64_t k1 = std::min(K, k0 + kKBlock);
    vg acc[MT][kPanelVecs];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = vg{};
    for (int64_t k = k0; k < k1; ++k) {
      const float* wk = wp + k * kPanel;
      for (int l = 0; l < kLinesPerK; ++l)
        __builtin_prefetch(wk + kPrefetchK * kPanel + 16 * l);
      vg wv[kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) wv[v] = ldg(wk + kVL * v);
      const float* xk = xt + k * ldx;
      for (int m = 0; m < MT; ++m) {
        const vg xb = bcast(xk + m);
        for (int v = 0; v < kPanelVecs; ++v) acc[m][v] += wv[v] * xb;
      }
    }
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < kPanelVecs; ++v) tot[m][v] += acc[m][v];
  }
  store_tile<MT>(tot, out, ldo, n0, nvalid, bias, accumulate);
}

// panel_tile<mt> for a runtime mt in 1..MT
template <int MT>
static inline void panel_rows(int mt, const float* xt, int64_t ldx, int64_t K, const float* wp,
                              float* out, int64_t ldo, int64_t n0, int64_t nvalid,
                              const float* bias, bool acc) {
  if constexpr (MT == 1) {
    panel_tile<1>(xt, ldx, K, wp, out, ldo, n0, nvalid, bias, acc);
  } else {
    if (mt == MT) panel_tile<MT>(xt, ldx, K, wp, out, ldo, n0, nvalid, bias, acc);
    else panel_rows<MT - 1>(mt, xt, ldx, K, wp, out, ldo, n0, nvalid, bias, acc);
  }
}

// x [M, K] row-major, wp the packed [N, K] weight; out [M, N] with row stride N.
static void gemm(const float* x, int64_t M, int64_t K, const float* wp, int64_t N,
                 float* out, const float* bias, bool accumulate) {
  const float* xt = x;  // x transposed to [K][M] (one row: x itself)
  thread_local std::vector<float> xbuf;
  if (M > 1) {
    xbuf.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xbuf[k * M + m] = x[m * K + k];
    xt = xbuf.data();
  }
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, nvalid = std::min(kPanel, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kMT)
      panel_rows<kMT>((int)std::min<int64_t>(kMT, M - m0), xt + m0, M, K,
                      wp + p * K * kPanel, out + m0 * N, N, n0, nvalid, bias, accumulate);
  }
}

// Panel p of w [N, K] into dst [K][kPanel] (rows past N as zeros); kPanel x 16 tiles
// go through L1.
static void pack_panel(const float* w, int64_t N, int64_t K, int64_t p, float* dst) {
  const int64_t rows = std::min(kPanel, N - p * kPanel);
  for (int64_t k0 = 0; k0 < K; k0 += 16) {
    const int64_t kn = std::min<int64_t>(16, K - k0);
    for (int64_t j = 0; j < kPanel; ++j) {
      if (j >= rows) {
        for (int64_t kk = 0; kk < kn; ++kk) dst[(k0 + kk) * kPanel + j] = 0.f;
        continue;
      }
      const float* src = w + (p * kPanel + j) * K + k0;
      for (int64_t kk = 0; kk < kn; ++kk) dst[(k0 + kk) * kPanel + j] = src[kk];
    }
  }
}

// ---------------------------------------------------------------- small pieces
static void rms_norm_rows(const float* x, int64_t M, int64_t H, const float* w, float eps,
                          float* out) {
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * H;
    float* o = out + m * H;
    v16 acc = v16{};
    int64_t h = 0;
    for (; h + 16 <= H; h += 16) { const v16 v = ld(xr + h); acc += v * v; }
    float ss = hsum(acc);
    for (; h < H; ++h) ss += xr[h] * xr[h];
    const float r = 1.f / std::sqrt(ss / (float)H + eps);
    for (h = 0; h < H; ++h) o[h] = (xr[h] * r) * w[h];
  }
}

// silu(h[:, :F]) * h[:, F:] -> out [M, F]
static void silu_mul_rows(const float* hp, int64_t M, int64_t F, float* out) {
  const int64_t chunks = (F + 255) / 256;
#pragma omp parallel for schedule(static) if (M * F >= 16384)
  for (int64_t c = 0; c < M * chunks; ++c) {
    const int64_t m = c / chunks, f0 = (c % chunks) * 256, f1 = std::min(F, f0 + 256);
    const float* a = hp + m * 2 * F;
    const float* u = a + F;
    float* o = out + m * F;
    int64_t f = f0;
    for (; f + 16 <= f1; f += 16) {
      const v16 av = ld(a + f);
      st(o + f, (av / (splat(1.f) + vexp(-av))) * ld(u + f));
    }
    for (; f < f1; ++f) o[f] = (a[f] / (1.f + std::exp(-a[f]))) * u[f];
  }
}

// sc[0..L) = exp(sc - max) in place (padding up to a multiple of 16 is scratch);
// returns their sum.
static inline float exp_shifted(float* sc, int64_t L, float mx) {
  const int64_t LP = (L + 15) / 16 * 16;
  for (int64_t j = L; j < LP; ++j) sc[j] = mx;  // padding, excluded from the sum
  for (int64_t j = 0; j < LP; j += 16) st(sc + j, vexp(ld(sc + j) - splat(mx)));
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) total += sc[j];
  return total;
}

// Where a cache row's positions live. The cache is a pool [blocks, G, S, D]: position p
// of cache row c is at offset p % S of block block(c, p / S). A contiguous cache
// [rows, G, S, D] is the pool whose block c is row c (tbl null, one block per row); a
// paged cache (rollout.kv_cache=paged) gives each row a block table tbl [rows, width]
// (entries a row does not hold point to the scratch block 0, never read below a row's
// length).
struct KVPages {
  const int64_t* tbl;  // [rows, width] block ids, or null (contiguous)
  int64_t width;       // blocks per row (1 when contiguous)
  int64_t S;           // positions per block
  inline int64_t block(int64_t c, int64_t i) const { return tbl ? tbl[c * width + i] : c; }
  inline int64_t capacity() const { return width * S; }
};

// Softmax attention of HPG query heads (q: rotated, pre-scaled, [HPG, D]) over L cached
// keys and values of one KV group, into o [HPG, D]. The keys and values are rows of D
// floats in blocks of S: block i starts at kp + off[i] (vp + off[i]). Every position is
// visited in order, so the result does not depend on how the positions are split in
// blocks (a paged row equals the same row contiguous, bitwise). D = 16 * ND is known at
// compile time, so a head's query and output stay in registers while the keys and values
// stream (they are re-read per head from L1/L2). sc: scratch of L rounded up to 16 floats.
template <int ND>
static void attend_fixed(const float* q, const float* kp, const float* vp, const int64_t* off,
                         int64_t S, int64_t L, int64_t HPG, float* sc, float* o) {
  constexpr int64_t D = 16 * ND;
  for (int64_t h = 0; h < HPG; ++h) {
    v16 qv[ND];
    for (int c = 0; c < ND; ++c) qv[c] = ld(q + h * D + 16 * c);
    float mx = -INFINITY;
    for (int64_t j0 = 0, bi = 0; j0 < L; j0 += S, ++bi) {
      const float* kb = kp + off[bi];
      const float* vb = vp + off[bi];
      const int64_t n = std::min(S, L - j0);
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = kb + j * D;
        if (h == 0)  // first pass over this group's cache rows: fetch keys and values ahead
          for (int c = 0; c < ND; ++c) {
            __builtin_prefetch(kj + 8 * D + 16 * c);
            __builtin_prefetch(vb + (j + 8) * D + 16 * c);
          }
        v16 acc = qv[0] * ld(kj);
        for (int c = 1; c < ND; ++c) acc += qv[c] * ld(kj + 16 * c);
        const float t = hsum(acc);
        sc[j0 + j] = t;
        mx = std::max(mx, t);
      }
    }
    const float total = exp_shifted(sc, L, mx);
    v16 ov[ND];
    for (int c = 0; c < ND; ++c) ov[c] = v16{};
    for (int64_t j0 = 0, bi = 0; j0 < L; j0 += S, ++bi) {
      const float* vb = vp + off[bi];
      const int64_t n = std::min(S, L - j0);
      for (int64_t j = 0; j < n; ++j) {
        const v16 w = splat(sc[j0 + j]);
        const float* vj = vb + j * D;
        for (int c = 0; c < ND; ++c) ov[c] += w * ld(vj + 16 * c);
      }
    }
    const v16 inv = splat(1.f / total);
    for (int c = 0; c < ND; ++c) st(o + h * D + 16 * c, ov[c] * inv);
  }
}

// Any head size: the same math with runtime loops.
static void attend_any(const float* q, const float* kp, const float* vp, const int64_t* off,
                       int64_t S, int64_t L, int64_t HPG, int64_t D, float* sc, float* o) {
  const int64_t DV = D / 16 * 16;
  for (int64_t h = 0; h < HPG; ++h) {
    const float* qh = q + h * D;
    float mx = -INFINITY;
    for (int64_t j0 = 0, bi = 0; j0 < L; j0 += S, ++bi) {
      const float* kb = kp + off[bi];
      const int64_t n = std::min(S, L - j0);
      for (int64_t j = 0; j < n; ++j) {
        const float* kj = kb + j * D;
        v16 acc = v16{};
        int64_t i = 0;
        for (; i < DV; i += 16) acc += ld(qh + i) * ld(kj + i);
        float t = hsum(acc);
        for (; i < D; ++i) t += qh[i] * kj[i];
        sc[j0 + j] = t;
        mx = std::max(mx, t);
      }
    }
    const float total = exp_shifted(sc, L, mx);
    float* oh = o + h * D;
    for (int64_t i = 0; i < D; ++i) oh[i] = 0.f;
    for (int64_t j0 = 0, bi = 0; j0 < L; j0 += S, ++bi) {
      const float* vb = vp + off[bi];
      const int64_t n = std::min(S, L - j0);
      for (int64_t j = 0; j < n; ++j) {
        const float w = sc[j0 + j];
        const float* vj = vb + j * D;
        int64_t i = 0;
        for (; i < DV; i += 16) st(oh + i, ld(oh + i) + splat(w) * ld(vj + i));
        for (; i < D; ++i) oh[i] += w * vj[i];
      }
    }
    const float inv = 1.f / total;
    for (int64_t i = 0; i < D; ++i) oh[i] *= inv;
  }
}

// RoPE + KV write + causal GQA attention for one new token per query row.
// qkv [B, G*(HPG+2)*D] (per group: HPG query heads, key, value); cos, sin [B, D] (sin
// carries rotate-half's signs); the caches kp, vp are pools [blocks, G, S, D] addressed
// through pg (KVPages: contiguous rows, or block tables); query b uses cache row rp[b]
// (rp null: row b) and position pp[b]. Every key and value is written before any
// attention, so several queries of one cache row at consecutive positions form a causal
// chain (verification, drafter catch-up). out [B, G*HPG*D].
static void rope_attend_rows(const float* qp, const float* cp, const float* sp, float* kp,
                             float* vp, const int64_t* pp, const int64_t* rp, int64_t B,
                             int64_t G, int64_t HPG, int64_t D, const KVPages& pg, float scale,
                             float* op) {
  const int64_t half = D / 2, S = pg.S;
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(pp[b] >= 0 && pp[b] < pg.capacity(), "position outside the KV cache");
  // rotated, pre-scaled queries, and the new keys and values written into the cache
  thread_local std::vector<float> qbuf;
  qbuf.resize(B * G * HPG * D);
  for (int64_t bg = 0; bg < B * G; ++bg) {
    const int64_t b = bg / G, g = bg % G, p = pp[b], cb = rp ? rp[b] : b;
    const float* base = qp + b * G * (HPG + 2) * D + g * (HPG + 2) * D;
    const float* c = cp + b * D;
    const float* s = sp + b * D;
    const int64_t at = ((pg.block(cb, p / S) * G + g) * S + p % S) * D;
    float* kdst = kp + at;
    float* vdst = vp + at;
    const float* kin = base + HPG * D;
    for (int64_t i = 0; i < D; ++i) kdst[i] = kin[i] * c[i] + kin[(i + half) % D] * s[i];
    std::memcpy(vdst, kin + D, D * sizeof(float));
    float* q = qbuf.data() + bg * HPG * D;
    for (int64_t h = 0; h < HPG; ++h)
      for (int64_t i = 0; i < D; ++i)
        q[h * D + i] = (base[h * D + i] * c[i] + base[h * D + (i + half) % D] * s[i]) * scale;
  }
  // One work item per KV group (its cache rows are read from memory once, by one
  // thread), or per query head when there are too few groups to keep the threads busy.
  const int64_t per = B * G >= 4 * (int64_t)omp_get_max_threads() ? HPG : 1;
  const int64_t items = B * G * (HPG / per);
  const float* qall = qbuf.data();
#pragma omp parallel for schedule(dynamic, 1) if (items > 1)
  for (int64_t it = 0; it < items; ++it) {
    const int64_t bg = it / (HPG / per), h0 = (it % (HPG / per)) * per;
    const int64_t b = bg / G, g = bg % G, L = pp[b] + 1, cb = rp ? rp[b] : b;
    const float* q = qall + (bg * HPG + h0) * D;
    float* o = op + (bg * HPG + h0) * D;
    thread_local std::vector<float> sc;  // scratch, reused across calls
    thread_local std::vector<int64_t> off;  // each block's offset in the pool
    sc.resize((L + 15) / 16 * 16);
    const int64_t nb = (L + S - 1) / S;
    off.resize(nb);
    for (int64_t i = 0; i < nb; ++i) off[i] = (pg.block(cb, i) * G + g) * S * D;
    switch (D) {
      case 64: attend_fixed<4>(q, kp, vp, off.data(), S, L, per, sc.data(), o); break;
      case 128: attend_fixed<8>(q, kp, vp, off.data(), S, L, per, sc.data(), o); break;
      default: attend_any(q, kp, vp, off.data(), S, L, per, D, sc.data(), o); break;
    }
  }
}

// ---------------------------------------------------------------- Python entry points
static void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(),
              name, " must be a contiguous float32 CPU tensor");
}
static const float* opt_ptr(const c10::optional<torch::Tensor>& t) {
  return t.has_value() && t->defined() && t->numel() > 0 ? t->data_ptr<float>() : nullptr;
}

// a packed weight of n output rows (pack_weight's layout): [ceil(n / kPanel), K, kPanel]
static void check_panels(const torch::Tensor& wp, int64_t n, int64_t K, const char* name) {
  check_f32(wp, name);
  TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kPanel && wp.size(1) == K &&
              wp.size(0) == (n + kPanel - 1) / kPanel,
              name, " must be a packed weight (pack_weight) of ", n, " x ", K);
}

// ws[i] [N, K] into outs[i] [ceil(N / kPanel), K, kPanel] (pack_weight's layout), all panels of
// all matrices in one parallel loop.
void pack_weights(std::vector<torch::Tensor> ws, std::vector<torch::Tensor> outs) {
  TORCH_CHECK(ws.size() == outs.size(), "one output per weight");
  std::vector<std::pair<size_t, int64_t>> items;  // (matrix, panel)
  for (size_t i = 0; i < ws.size(); ++i) {
    check_f32(ws[i], "w");
    TORCH_CHECK(ws[i].dim() == 2, "w must be 2-D");
    check_panels(outs[i], ws[i].size(0), ws[i].size(1), "out");
    for (int64_t p = 0; p < outs[i].size(0); ++p) items.emplace_back(i, p);
  }
#pragma omp parallel for schedule(dynamic, 8)
  for (int64_t it = 0; it < (int64_t)items.size(); ++it) {
    const auto& w = ws[items[it].first];
    const int64_t K = w.size(1), p = items[it].second;
    pack_panel(w.data_ptr<float>(), w.size(0), K, p,
               outs[items[it].first].data_ptr<float>() + p * K * kPanel);
  }
}

// 64-bit content fingerprints of ws (any dtype, contiguous): the packed copies are
// re-made only for matrices whose fingerprint changed. Chunks of 16 Ki 32-bit words
// are hashed in parallel (64 lanes of 32-bit polynomial hashes: a change to any one
// word always changes its lane), mixed with their index and summed per matrix.
static inline uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
typedef uint32_t v16u __attribute__((vector_size(64)));
static uint64_t hash_words(const uint32_t* w, int64_t n, uint64_t seed) {
  const uint32_t P = 0x01000193u;
  v16u a[4];
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 16; ++l) a[j][l] = (uint32_t)mix64(seed + 16 * j + l);
  int64_t i = 0;
  for (; i + 64 <= n; i += 64)
    for (int j = 0; j < 4; ++j) {
      v16u x;
      std::memcpy(&x, w + i + 16 * j, sizeof x);
      a[j] = a[j] * P + x;
    }
  uint64_t h = mix64(seed ^ (uint64_t)n);
  for (; i < n; ++i) h = mix64(h ^ w[i]);
  for (int j = 0; j < 4; ++j)
    for (int l = 0; l < 16; l += 2)
      h = mix64(h ^ ((uint64_t)a[j][l] << 32 | a[j][l + 1]));
  return h;
}

torch::Tensor fingerprint(std::vector<torch::Tensor> ws) {
  constexpr int64_t kChunk = 16384;
  std::vector<std::pair<size_t, int64_t>> items;  // (tensor, chunk)
  std::vector<int64_t> words(ws.size());
  for (size_t i = 0; i < ws.size(); ++i) {
    TORCH_CHECK(ws[i].device().is_cpu() && ws[i].is_contiguous(),
                "fingerprint needs contiguous CPU tensors");
    const int64_t bytes = ws[i].numel() * ws[i].element_size();
    TORCH_CHECK(bytes % 4 == 0, "fingerprint needs a whole number of 32-bit words");
    words[i] = bytes / 4;
    for (int64_t c = 0; c * kChunk < words[i]; ++c) items.emplace_back(i, c);
  }
  std::vector<uint64_t> part(items.size());
#pragma omp parallel for schedule(dynamic, 16)
  for (int64_t it = 0; it < (int64_t)items.size(); ++it) {
    const size_t i = items[it].first;
    const int64_t c = items[it].second, lo = c * kChunk;
    const auto* w = static_cast<const uint32_t*>(ws[i].data_ptr()) + lo;
    part[it] = mix64(hash_words(w, std::min(kChunk, words[i] - lo), (uint64_t)c));
  }
  auto out = torch::zeros({(int64_t)ws.size()}, torch::kLong);
  auto* o = out.data_ptr<int64_t>();
  for (size_t it = 0; it < items.size(); ++it)
    o[items[it].first] = (int64_t)((uint64_t)o[items[it].first] + part[it]);
  for (size_t i = 0; i < ws.size(); ++i)
    o[i] = (int64_t)mix64((uint64_t)o[i] ^ (uint64_t)words[i]);
  return out;
}

// w [N, K] into out [ceil(N / kPanel), K, kPanel] (allocated when not given); returns out.
torch::Tensor pack_weight(torch::Tensor w, c10::optional<torch::Tensor> out) {
  check_f32(w, "w");
  TORCH_CHECK(w.dim() == 2, "w must be 2-D");
  const int64_t N = w.size(0), K = w.size(1);
  torch::Tensor o = out.has_value() && out->defined()
      ? *out : torch::empty({(N + kPanel - 1) / kPanel, K, kPanel}, w.options());
  pack_weights({w}, {o});
  return o;
}

// x @ w^T (+ bias) (+ residual) with w packed: wp = pack_weight(w), n = w.size(0)
torch::Tensor linear(torch::Tensor x, torch::Tensor wp, int64_t n,
                     c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1);
  check_panels(wp, n, K, "w");
  torch::Tensor out;
  if (residual.has_value() && residual->defined()) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->size(0) == M && residual->size(1) == n, "residual shape");
    out = residual->clone();
  } else {
    out = torch::empty({M, n}, x.options());
  }
  if (bias.has_value() && bias->defined() && bias->numel()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "bias shape");
  }
  gemm(x.data_ptr<float>(), M, K, wp.data_ptr<float>(), n, out.data_ptr<float>(),
       opt_ptr(bias), residual.has_value() && residual->defined());
  return out;
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x"); check_f32(w, "w");
  TORCH_CHECK(x.dim() == 2);
  auto out = torch::empty_like(x);
  rms_norm_rows(x.data_ptr<float>(), x.size(0), x.size(1), w.data_ptr<float>(), (float)eps,
                out.data_ptr<float>());
  return out;
}

torch::Tensor silu_mul(torch::Tensor h) {
  check_f32(h, "h");
  TORCH_CHECK(h.dim() == 2);
  const int64_t M = h.size(0), F = h.size(1) / 2;
  auto out = torch::empty({M, F}, h.options());
  silu_mul_rows(h.data_ptr<float>(), M, F, out.data_ptr<float>());
  return out;
}

static const int64_t* row_map(const c10::optional<torch::Tensor>& rows, int64_t B,
                              int64_t cache_rows) {
  if (!rows.has_value() || !rows->defined() || rows->numel() == 0) {
    TORCH_CHECK(B <= cache_rows, "more query rows than cache rows needs a row map");
    return nullptr;
  }
  TORCH_CHECK(rows->is_contiguous() && rows->scalar_type() == torch::kLong &&
              rows->numel() == B, "row map must be a contiguous int64 tensor of B entries");
  const int64_t* r = rows->data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(r[b] >= 0 && r[b] < cache_rows, "row map entry outside the cache");
  return r;
}

// The addressing of a cache pool of ``blocks`` blocks of S positions: contiguous rows
// (no table: block c is row c) or a paged cache's block table [rows, width] (int64,
// every entry a block of the pool). *rows: the cache rows a row map may name.
static KVPages kv_pages(const c10::optional<torch::Tensor>& table, int64_t blocks, int64_t S,
                        int64_t* rows) {
  if (!table.has_value() || !table->defined() || table->numel() == 0) {
    *rows = blocks;
    return KVPages{nullptr, 1, S};
  }
  TORCH_CHECK(table->device().is_cpu() && table->is_contiguous() && table->dim() == 2 &&
              table->scalar_type() == torch::kLong,
              "block table must be a contiguous int64 CPU tensor [rows, blocks per row]");
  const int64_t* t = table->data_ptr<int64_t>();
  for (int64_t i = 0, n = table->numel(); i < n; ++i)
    TORCH_CHECK(t[i] >= 0 && t[i] < blocks, "block table entry outside the KV pool");
  *rows = table->size(0);
  return KVPages{t, table->size(1), S};
}

// kc, vc: [rows, G, S, D] (contiguous views of the running rows of one layer's cache),
// or with ``table`` [rows, width] a paged layer's pools [blocks, G, S, D] (S: the block
// size); row_of [B] (optional): the cache row of each query row (default: query b, row b).
torch::Tensor rope_attend(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin,
                          torch::Tensor kc, torch::Tensor vc, torch::Tensor pos,
                          int64_t G, int64_t HPG, int64_t D, double scale,
                          c10::optional<torch::Tensor> row_of,
                          c10::optional<torch::Tensor> table) {
  check_f32(qkv, "qkv"); check_f32(cos, "cos"); check_f32(sin, "sin");
  check_f32(kc, "k cache"); check_f32(vc, "v cache");
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == torch::kLong);
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.size(1) == G && kc.size(3) == D,
              "KV cache shape");
  const int64_t B = qkv.size(0);
  int64_t rows = 0;
  const KVPages pg = kv_pages(table, kc.size(0), kc.size(2), &rows);
  const int64_t* rp = row_map(row_of, B, rows);
  auto out = torch::empty({B, G * HPG * D}, qkv.options());
  rope_attend_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                   kc.data_ptr<float>(), vc.data_ptr<float>(), pos.data_ptr<int64_t>(), rp, B,
                   G, HPG, D, pg, (float)scale, out.data_ptr<float>());
  return out;
}

// The whole decoder stack for one new token per row (tensor parallel size 1):
// x [B, H] embeddings (updated in place to the last layer's output); per-layer weight
// lists (the four matrices packed by pack_weight); k_cache, v_cache
// [layers, rows, G, S, D] with the running rows at 0..B-1, or with ``table`` a paged
// cache's pools [layers, blocks, G, S, D] and block table [rows, width].
// Returns the final-norm hidden states [B, H].
torch::Tensor decode_layers(torch::Tensor x, std::vector<torch::Tensor> ln1,
                            std::vector<torch::Tensor> qkv_w, std::vector<torch::Tensor> qkv_b,
                            std::vector<torch::Tensor> proj_w, std::vector<torch::Tensor> ln2,
                            std::vector<torch::Tensor> fc1_w, std::vector<torch::Tensor> fc2_w,
                            torch::Tensor final_norm, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin,
                            torch::Tensor pos, int64_t G, int64_t HPG, int64_t D,
                            double scale, double eps, c10::optional<torch::Tensor> row_of,
                            c10::optional<torch::Tensor> table) {
  check_f32(x, "x"); check_f32(k_cache, "k cache"); check_f32(v_cache, "v cache");
  check_f32(cos, "cos"); check_f32(sin, "sin"); check_f32(final_norm, "final norm");
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == torch::kLong);
  const int64_t B = x.size(0), H = x.size(1), layers = (int64_t)qkv_w.size();
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(0) == layers && k_cache.size(2) == G && k_cache.size(4) == D,
              "KV cache shape");
  int64_t rows = 0;
  const KVPages pg = kv_pages(table, k_cache.size(1), k_cache.size(3), &rows);
  const int64_t* rp = row_map(row_of, B, rows);
  const int64_t layer_stride = k_cache.stride(0);
  const int64_t NQKV = G * (HPG + 2) * D, NATT = G * HPG * D;
  TORCH_CHECK(layers > 0 && fc2_w[0].dim() == 3, "packed weights expected");
  const int64_t F2 = 2 * fc2_w[0].size(1);  // fused fc1 rows (gate and up)
  auto opts = x.options();
  auto h = torch::empty({B, H}, opts), qkv = torch::empty({B, NQKV}, opts),
       att = torch::empty({B, NATT}, opts), fc = torch::empty({B, F2}, opts),
       act = torch::empty({B, F2 / 2}, opts);
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < layers; ++i) {
    for (auto* t : {&ln1[i], &ln2[i]}) check_f32(*t, "norm weight");
    check_panels(qkv_w[i], NQKV, H, "qkv weight");
    check_panels(proj_w[i], H, NATT, "proj weight");
    check_panels(fc1_w[i], F2, H, "fc1 weight");
    check_panels(fc2_w[i], H, F2 / 2, "fc2 weight");
    const float* bias = qkv_b[i].defined() && qkv_b[i].numel() ? qkv_b[i].data_ptr<float>() : nullptr;
    rms_norm_rows(xp, B, H, ln1[i].data_ptr<float>(), (float)eps, h.data_ptr<float>());
    gemm(h.data_ptr<float>(), B, H, qkv_w[i].data_ptr<float>(), NQKV, qkv.data_ptr<float>(),
         bias, false);
    rope_attend_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                     k_cache.data_ptr<float>() + i * layer_stride,
                     v_cache.data_ptr<float>() + i * layer_stride, pos.data_ptr<int64_t>(), rp,
                     B, G, HPG, D, pg, (float)scale, att.data_ptr<float>());
    gemm(att.data_ptr<float>(), B, NATT, proj_w[i].data_ptr<float>(), H, xp, nullptr, true);
    rms_norm_rows(xp, B, H, ln2[i].data_ptr<float>(), (float)eps, h.data_ptr<float>());
    gemm(h.data_ptr<float>(), B, H, fc1_w[i].data_ptr<float>(), F2, fc.data_ptr<float>(),
         nullptr, false);
    silu_mul_rows(fc.data_ptr<float>(), B, F2 / 2, act.data_ptr<float>());
    gemm(act.data_ptr<float>(), B, F2 / 2, fc2_w[i].data_ptr<float>(), H, xp, nullptr, true);
  }
  auto out = torch::empty({B, H}, opts);
  rms_norm_rows(xp, B, H, final_norm.data_ptr<float>(), (float)eps, out.data_ptr<float>());
  return out;
}

// ---------------------------------------------------------------- argmax, greedy drafting
static inline bool any_lane(vgi m) {
  int32_t a[kVL];
  std::memcpy(a, &m, sizeof a);
  int32_t r = 0;
  for (int k = 0; k < kVL; ++k) r |= a[k];
  return r != 0;
}

// Index of the largest of x[0..n) as torch.argmax gives it: the first of equal maxima,
// the first NaN when there is one. (Native vectors: comparisons and selects of 64-byte
// vectors are expanded element by element without AVX-512.)
static int64_t argmax_row(const float* x, int64_t n) {
  vg m = vg{} - INFINITY;
  vgi nan = vgi{};
  int64_t i = 0;
  for (; i + kVL <= n; i += kVL) {
    const vg v = ldg(x + i);
    nan |= (v != v);
    m = v > m ? v : m;
  }
  float mx = -INFINITY;
  {
    float a[kVL];
    std::memcpy(a, &m, sizeof a);
    for (int k = 0; k < kVL; ++k) mx = std::max(mx, a[k]);
  }
  bool has_nan = any_lane(nan);
  for (int64_t j = i; j < n; ++j) {
    if (std::isnan(x[j])) has_nan = true;
    else mx = std::max(mx, x[j]);
  }
  if (has_nan) {
    for (int64_t j = 0; j < n; ++j)
      if (std::isnan(x[j])) return j;
  }
  const vg target = vg{} + mx;
  int64_t j = 0;
  for (; j + kVL <= n; j += kVL)
    if (any_lane(ldg(x + j) == target)) break;
  for (; j < n; ++j)
    if (x[j] == mx) return j;
  return 0;  // n == 0
}

// argmax over the first n columns of every row of x [M, >= n] (unit column stride).
torch::Tensor argmax_rows(torch::Tensor x, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == torch::kFloat && x.dim() == 2 &&
              x.stride(1) == 1 && n > 0 && n <= x.size(1),
              "argmax_rows takes a float32 CPU matrix with unit column stride");
  const int64_t M = x.size(0), ld = x.stride(0);
  auto out = torch::empty({M}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
#pragma omp parallel for schedule(static) if (M * n >= (1 << 20))
  for (int64_t m = 0; m < M; ++m) o[m] = argmax_row(xp + m * ld, n);
  return out;
}

// ---------------------------------------------------------------- coupled sampling noise
// Natural log on kVL lanes of positive normal floats: x = 2^e * m with m in
// [sqrt(1/2), sqrt(2)), log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| < 0.172, as
// 2s (1 + z/3 + z^2/5 + ... + z^5/11), z = s^2 (truncation < 1e-9 relative); e ln2 in
// two parts. About 2 ulp (sampling.coupled_gumbel's torch form agrees to a few ulp).
static inline vg vlog_native(vg x) {
  vgi xi;
  std::memcpy(&xi, &x, sizeof xi);
  vgi e = ((xi >> 23) & 0xff) - 127;
  vgi mi = (xi & 0x7fffff) | 0x3f800000;
  vg m;
  std::memcpy(&m, &mi, sizeof m);
  const vgi big = m > (vg{} + 1.41421356f);  // -1 where true
  m = big ? m * 0.5f : m;
  e -= big;
  const vg f = m - 1.0f;  // exact (Sterbenz)
  const vg s = f / (f + 2.0f);
  const vg z = s * s;
  vg p = vg{} + 1.f / 11.f;
  p = p * z + 1.f / 9.f;
  p = p * z + 1.f / 7.f;
  p = p * z + 1.f / 5.f;
  p = p * z + 1.f / 3.f;
  const vg ef = __builtin_convertvector(e, vg);
  const vg logm = 2.0f * s + 2.0f * s * (p * z);
  return ef * 0.693145752f + (logm + ef * 1.42860677e-6f);
}

// Gumbel noise of the 32-bit hashes h (sampling.coupled_gumbel's definition): U = (h +
// 1/2) / 2^32, E = -log U (for U >= 1/2 as -log1p(-V), V = 1 - U computed in integers,
// so the small E that decide rare tokens keep their precision), g = -log E.
static inline vg gumbel_of_hash(vgi h) {
  // h holds 32 bits; as int32, h >= 2^31 reads negative
  const vgi lo = h >= vgi{};
  const vgi t = lo ? h : (vgi{} - 1) - h;  // the distance to the nearer end, < 2^31
  const vg w0 = (__builtin_convertvector(t, vg) + 0.5f) * 2.3283064365386963e-10f;
  const vg w = lo ? w0 : 1.0f - w0;        // U, or 1 - V rounded
  const vg l = vlog_native(w);
  // log1p(-V) = -V log(w) / (w - 1) for w = 1 - V rounded (Kahan); w == 1: -V
  const vg hi_e = w == (vg{} + 1.0f) ? w0 : w0 * l / (w - 1.0f);
  const vg e = lo ? (vg{} - l) : hi_e;
  return vg{} - vlog_native(e);
}

static inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16; h *= 0x85EBCA6Bu; h ^= h >> 13; h *= 0xC2B2AE35u; return h ^ (h >> 16);
}

// out[i, v] = gumbel(fmix32(table[v] ^ salt[i])) for salts [n] and token hashes table [V]
// (int64 holding 32-bit values): sampling.coupled_gumbel without its temporaries.
torch::Tensor coupled_gumbel(torch::Tensor salt, torch::Tensor table) {
  TORCH_CHECK(salt.device().is_cpu() && table.device().is_cpu() &&
              salt.scalar_type() == torch::kLong && table.scalar_type() == torch::kLong &&
              salt.dim() == 1 && table.dim() == 1,
              "coupled_gumbel takes int64 CPU salts [n] and token hashes [V]");
  salt = salt.contiguous();
  table = table.contiguous();
  const int64_t n = salt.size(0), V = table.size(0);
  auto out = torch::empty({n, V}, salt.options().dtype(torch::kFloat));
  const int64_t* sp = salt.data_ptr<int64_t>();
  const int64_t* tp = table.data_ptr<int64_t>();
  float* op = out.data_ptr<float>();
  constexpr int64_t kChunk = 2048;  // columns per task
  const int64_t chunks = (V + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static) if (n * V >= (1 << 15))
  for (int64_t task = 0; task < n * chunks; ++task) {
    const int64_t i = task / chunks, c0 = (task % chunks) * kChunk;
    const int64_t c1 = std::min(V, c0 + kChunk);
    const uint32_t s = (uint32_t)sp[i];
    float* row = op + i * V;
    for (int64_t v = c0; v < c1; v += kVL) {
      const int64_t m = std::min<int64_t>(kVL, c1 - v);  // fewer at the ragged end
      int32_t hb[kVL] = {0};
      for (int64_t k = 0; k < m; ++k) hb[k] = (int32_t)fmix32((uint32_t)tp[v + k] ^ s);
      vgi h;
      std::memcpy(&h, hb, sizeof h);
      if (m == kVL) {
        stg(row + v, gumbel_of_hash(h));
      } else {
        float tmp[kVL];
        stg(tmp, gumbel_of_hash(h));
        std::memcpy(row + v, tmp, m * sizeof(float));
      }
    }
  }
  return out;
}

// fc([embed(tok[n]); feat[n]]) for N rows -> out [N, H] (fc_w packed, H x 2H).
static torch::Tensor draft_inputs(const int64_t* tok, const float* feat, int64_t N, int64_t H,
                                  const torch::Tensor& embed_w, const torch::Tensor& fc_w) {
  const int64_t V = embed_w.size(0);
  auto x = torch::empty({N, 2 * H}, embed_w.options());
  float* xp = x.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(tok[n] >= 0 && tok[n] < V, "token outside the embedding");
    std::memcpy(xp + n * 2 * H, embed_w.data_ptr<float>() + tok[n] * H, H * sizeof(float));
    std::memcpy(xp + n * 2 * H + H, feat + n * H, H * sizeof(float));
  }
  auto out = torch::empty({N, H}, embed_w.options());
  gemm(xp, N, 2 * H, fc_w.data_ptr<float>(), H, out.data_ptr<float>(), nullptr, false);
  return out;
}

// RoPE rows for positions pos[0..N) from the model's tables (rotate-half signs applied).
static void rope_rows(const int64_t* pos, int64_t N, int64_t D, const torch::Tensor& cos_table,
                      const torch::Tensor& sin_table, torch::Tensor& cos, torch::Tensor& sin) {
  for (int64_t n = 0; n < N; ++n) {
    TORCH_CHECK(pos[n] >= 0 && pos[n] < cos_table.size(0), "RoPE table too short");
    const float* cs = cos_table.data_ptr<float>() + pos[n] * D;
    const float* sn = sin_table.data_ptr<float>() + pos[n] * D;
    float* co = cos.data_ptr<float>() + n * D;
    float* so = sin.data_ptr<float>() + n * D;
    for (int64_t d = 0; d < D; ++d) {
      co[d] = cs[d];
      so[d] = d < D / 2 ? -sn[d] : sn[d];
    }
  }
}

// Greedy chain drafting in one call, catch-up included. First the drafter runs on the
// pending pairs (tok[n], feat[n]) -- query n at position pos[n] of cache row row_of[n]
// (ragged chains per row, as decode_layers takes them) -- and each row's last pending
// query (index last[b]) is its root: output h and draft logits. Then ``depth`` tokens per
// row: token j = d2t[argmax of the first vocab logits] (the argmax without d2t); for
// j < depth - 1 the drafter runs on (token j, h) at position start[b] + j of cache row b.
// Each drafter run is fc([embed; h]) -> decode_layers (its layer(s) and final norm) ->
// head (a packed weight of head_n rows). The same kernels in the same order as the
// step-by-step path, so the same drafts. cos_table, sin_table [P, D]: the model's RoPE.
// ``table``: a paged drafter cache's block table (decode_layers).
// Returns the draft tokens [B, depth].
torch::Tensor draft_chain(torch::Tensor tok, torch::Tensor feat, torch::Tensor row_of,
                          torch::Tensor pos, torch::Tensor last, torch::Tensor start,
                          int64_t depth, int64_t vocab, torch::Tensor d2t,
                          torch::Tensor embed_w, torch::Tensor fc_w,
                          std::vector<torch::Tensor> ln1, std::vector<torch::Tensor> qkv_w,
                          std::vector<torch::Tensor> qkv_b, std::vector<torch::Tensor> proj_w,
                          std::vector<torch::Tensor> ln2, std::vector<torch::Tensor> fc1_w,
                          std::vector<torch::Tensor> fc2_w, torch::Tensor final_norm,
                          torch::Tensor k_cache, torch::Tensor v_cache,
                          torch::Tensor cos_table, torch::Tensor sin_table,
                          int64_t G, int64_t HPG, int64_t D, double scale, double eps,
                          torch::Tensor head_w, int64_t head_n,
                          c10::optional<torch::Tensor> table) {
  check_f32(feat, "features"); check_f32(embed_w, "embedding");
  check_f32(cos_table, "cos table"); check_f32(sin_table, "sin table");
  for (auto* t : {&tok, &row_of, &pos, &last, &start})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == torch::kLong,
                "token, row, position and index vectors must be contiguous int64");
  const int64_t N = tok.numel(), B = start.numel(), H = embed_w.size(1);
  TORCH_CHECK(feat.dim() == 2 && feat.size(0) == N && feat.size(1) == H && pos.numel() == N &&
              row_of.numel() == N && last.numel() == B && B > 0 && depth >= 1,
              "draft_chain shapes");
  TORCH_CHECK(cos_table.size(1) == D && sin_table.sizes() == cos_table.sizes(), "RoPE tables");
  check_panels(fc_w, H, 2 * H, "fc weight");
  check_panels(head_w, head_n, H, "head weight");
  const bool mapped = d2t.defined() && d2t.numel() > 0;
  if (mapped)
    TORCH_CHECK(d2t.is_contiguous() && d2t.scalar_type() == torch::kLong &&
                d2t.numel() == vocab, "d2t must hold vocab int64 ids");
  TORCH_CHECK(vocab > 0 && head_n >= vocab, "head_n < vocab");
  const int64_t* lp_idx = last.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) TORCH_CHECK(lp_idx[b] >= 0 && lp_idx[b] < N, "last");
  auto opts = embed_w.options();
  // catch-up: the pending pairs, then each row's root
  auto cos = torch::empty({N, D}, opts), sin = torch::empty({N, D}, opts);
  rope_rows(pos.data_ptr<int64_t>(), N, D, cos_table, sin_table, cos, sin);
  auto x = draft_inputs(tok.data_ptr<int64_t>(), feat.data_ptr<float>(), N, H, embed_w, fc_w);
  auto h_all = decode_layers(x, ln1, qkv_w, qkv_b, proj_w, ln2, fc1_w, fc2_w, final_norm,
                             k_cache, v_cache, cos, sin, pos, G, HPG, D, scale, eps, row_of,
                             table);
  auto h = torch::empty({B, H}, opts);
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(h.data_ptr<float>() + b * H, h_all.data_ptr<float>() + lp_idx[b] * H,
                H * sizeof(float));
  auto logits = torch::empty({B, head_n}, opts);
  gemm(h.data_ptr<float>(), B, H, head_w.data_ptr<float>(), head_n, logits.data_ptr<float>(),
       nullptr, false);
  // the chain
  auto out = torch::empty({B, depth}, start.options());
  int64_t* o = out.data_ptr<int64_t>();
  auto step_tok = torch::empty({B}, start.options()), step_pos = torch::empty({B}, start.options());
  auto bcos = torch::empty({B, D}, opts), bsin = torch::empty({B, D}, opts);
  const int64_t* st = start.data_ptr<int64_t>();
  for (int64_t j = 0; j < depth; ++j) {
    int64_t* tk = step_tok.data_ptr<int64_t>();
    int64_t* pp = step_pos.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t a = argmax_row(logits.data_ptr<float>() + b * head_n, vocab);
      tk[b] = mapped ? d2t.data_ptr<int64_t>()[a] : a;
      o[b * depth + j] = tk[b];
      pp[b] = st[b] + j;
    }
    if (j == depth - 1) break;
    rope_rows(pp, B, D, cos_table, sin_table, bcos, bsin);
    auto xin = draft_inputs(tk, h.data_ptr<float>(), B, H, embed_w, fc_w);
    h = decode_layers(xin, ln1, qkv_w, qkv_b, proj_w, ln2, fc1_w, fc2_w, final_norm,
                      k_cache, v_cache, bcos, bsin, step_pos, G, HPG, D, scale, eps,
                      c10::nullopt, table);
    gemm(h.data_ptr<float>(), B, H, head_w.data_ptr<float>(), head_n,
         logits.data_ptr<float>(), nullptr, false);
  }
  return out;
}

// ---------------------------------------------------------------- int8 weights
// Weight-only int8 GEMM (the self-drafter's quantized copy, rollout/speculative/quantize.py):
// w ~ q * s with q int8 [N, K] and float32 scales s [N, ceil(K / group)]. q is packed
// like the float weights ([ceil(N / kPanel), K, kPanel], a quarter of their bytes), s as
// [ceil(N / kPanel), groups, kPanel]. Activations stay float32: each k loads kPanel int8
// weights, widens them to float in registers (__builtin_convertvector: vpmovsxbd +
// vcvtdq2ps on x86) and multiplies them into up to kMT rows like panel_tile; the sums of
// one group (blocks of at most kKBlock k's inside it) are scaled once by the group's
// scales and added into the totals.
// kVL int8 weights widened to floats (x86: one sign extension and one conversion;
// GCC's generic conversion of an int8 vector would go lane by lane)
#if defined(__AVX512F__)
static inline vg ldq(const int8_t* p) {
  return (vg)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
#elif defined(__AVX2__) && defined(__FMA__)
static inline vg ldq(const int8_t* p) {
  return (vg)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#else
typedef int8_t vgc __attribute__((vector_size(kVL)));
static inline vg ldq(const int8_t* p) {
  vgc c;
  std::memcpy(&c, p, sizeof c);
  return __builtin_convertvector(__builtin_convertvector(c, vgi), vg);
}
#endif
static constexpr int64_t kPrefetchK8 = (kPrefetchBytes + kPanel - 1) / kPanel;

template <int MT>
static inline void panel_tile_i8(const float* __restrict xt, int64_t ldx, int64_t K,
                                 const int8_t* __restrict wp, const float* __restrict sp,
                                 int64_t group, float* __restrict out, int64_t ldo,
                                 int64_t n0, int64_t nvalid, const float* __restrict bias,
                                 bool accumulate) {
  vg tot[MT][kPanelVecs];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < kPanelVecs; ++v) tot[m][v] = vg{};
  for (int64_t k0 = 0; k0 < K;) {
    const int64_t gi = k0 / group;
    const int64_t k1 = std::min(std::min(K, k0 + kKBlock), (gi + 1) * group);
    vg acc[MT][kPanelVecs];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = vg{};
    for (int64_t k = k0; k < k1; ++k) {
      const int8_t* wk = wp + k * kPanel;
      if (((k * kPanel) & 63) < kPanel) __builtin_prefetch(wk + kPrefetchK8 * kPanel);
      vg wv[kPanelVecs];
      for (int v = 0; v < kPanelVecs; ++v) wv[v] = ldq(wk + kVL * v);
      const float* xk = xt + k * ldx;
      for (int m = 0; m < MT; ++m) {
        const vg xb = bcast(xk + m);
        for (int v = 0; v < kPanelVecs; ++v) acc[m][v] += wv[v] * xb;
      }
    }
    const float* sk = sp + gi * kPanel;
    for (int v = 0; v < kPanelVecs; ++v) {
      const vg sv = ldg(sk + kVL * v);
      for (int m = 0; m < MT; ++m) tot[m][v] += acc[m][v] * sv;
    }
    k0 = k1;
  }
  store_tile<MT>(tot, out, ldo, n0, nvalid, bias, accumulate);
}

template <int MT>
static inline void panel_rows_i8(int mt, const float* xt, int64_t ldx, int64_t K,
                                 const int8_t* wp, const float* sp, int64_t group, float* out,
                                 int64_t ldo, int64_t n0, int64_t nvalid, const float* bias,
                                 bool acc) {
  if constexpr (MT == 1) {
    panel_tile_i8<1>(xt, ldx, K, wp, sp, group, out, ldo, n0, nvalid, bias, acc);
  } else {
    if (mt == MT) panel_tile_i8<MT>(xt, ldx, K, wp, sp, group, out, ldo, n0, nvalid, bias, acc);
    else panel_rows_i8<MT - 1>(mt, xt, ldx, K, wp, sp, group, out, ldo, n0, nvalid, bias, acc);
  }
}

// gemm with int8 panels wp and scale panels sp ([panels, groups, kPanel])
static void gemm_i8(const float* x, int64_t M, int64_t K, const int8_t* wp, const float* sp,
                    int64_t group, int64_t N, float* out, const float* bias, bool accumulate) {
  const float* xt = x;
  thread_local std::vector<float> xbuf;
  if (M > 1) {
    xbuf.resize(M * K);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t k = 0; k < K; ++k) xbuf[k * M + m] = x[m * K + k];
    xt = xbuf.data();
  }
  const int64_t panels = (N + kPanel - 1) / kPanel, groups = (K + group - 1) / group;
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, nvalid = std::min(kPanel, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kMT)
      panel_rows_i8<kMT>((int)std::min<int64_t>(kMT, M - m0), xt + m0, M, K,
                         wp + p * K * kPanel, sp + p * groups * kPanel, group, out + m0 * N,
                         N, n0, nvalid, bias, accumulate);
  }
}

// ---------------------------------------------------------------- int8 weights x int8 activations
// The same product with the activations quantized too (``act_block`` > 0): each row's
// inputs are cut into blocks of act_block (a multiple of 4; inside one weight group) and
// quantized symmetrically per block, a = round(x / s_a) in [-127, 127] with
// s_a = max|x| / 127 (as ``quantize.quantize_activations``), so every block's dot
// product is an exact integer sum, scaled once by s_a and, per weight group, by the
// weights' scales. Weights are packed in groups of 4 inputs: [panels][ceil(K / 4)][kPanel][4]
// bytes, so one 32-bit lane holds 4 consecutive inputs of one output, and a broadcast of
// 4 activation bytes multiplies a whole vector of outputs:
//   AVX-512 VNNI: vpdpbusd (unsigned x signed bytes, 4 products summed into each 32-bit
//     lane); the weights are stored offset by +128 as unsigned bytes and the offset's
//     share (128 * the block's activation sum) is subtracted once per block;
//   AVX-512 BW / AVX2: |a| times the weights with a's sign (vpmaddubsw, at most
//     2 * 127 * 127 per pair: no saturation), then pairs summed by vpmaddwd;
//   portable: the same integer sums lane by lane.
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define MTLT_I8A "avx512-vnni"
static constexpr bool kI8Offset = true;
struct XB {
  __m512i x;
  explicit XB(int32_t b) : x(_mm512_set1_epi32(b)) {}
  inline vgi dot(vgi acc, vgi w) const {
    return (vgi)_mm512_dpbusd_epi32((__m512i)acc, (__m512i)w, x);
  }
};
#elif defined(__AVX512F__) && defined(__AVX512BW__)
#define MTLT_I8A "avx512-bw"
static constexpr bool kI8Offset = false;
struct XB {
  __m512i ax;
  __mmask64 neg;
  explicit XB(int32_t b) {
    const __m512i x = _mm512_set1_epi32(b);
    ax = _mm512_abs_epi8(x);
    neg = _mm512_movepi8_mask(x);
  }
  inline vgi dot(vgi acc, vgi w) const {
    const __m512i sw = _mm512_mask_sub_epi8((__m512i)w, neg, _mm512_setzero_si512(), (__m512i)w);
    return acc + (vgi)_mm512_madd_epi16(_mm512_maddubs_epi16(ax, sw), _mm512_set1_epi16(1));
  }
};
#elif defined(__AVX2__) && !defined(__AVX512F__)
#define MTLT_I8A "avx2"
static constexpr bool kI8Offset = false;
struct XB {
  __m256i x, ax;
  explicit XB(int32_t b) : x(_mm256_set1_epi32(b)), ax(_mm256_abs_epi8(_mm256_set1_epi32(b))) {}
  inline vgi dot(vgi acc, vgi w) const {
    const __m256i sw = _mm256_sign_epi8((__m256i)w, x);
    return acc + (vgi)_mm256_madd_epi16(_mm256_maddubs_epi16(ax, sw), _mm256_set1_epi16(1));
  }
};
#else
#define MTLT_I8A "portable"
static constexpr bool kI8Offset = false;
struct XB {
  int32_t a[4];
  explicit XB(int32_t b) {
    int8_t c[4];
    std::memcpy(c, &b, 4);
    for (int j = 0; j < 4; ++j) a[j] = c[j];
  }
  inline vgi dot(vgi acc, vgi w) const {
    int8_t wb[kVL * 4];
    std::memcpy(wb, &w, sizeof wb);
    for (int l = 0; l < kVL; ++l)
      acc[l] += wb[4 * l] * a[0] + wb[4 * l + 1] * a[1] + wb[4 * l + 2] * a[2] + wb[4 * l + 3] * a[3];
    return acc;
  }
};
#endif
static inline vgi ldi(const int8_t* p) { vgi v; std::memcpy(&v, p, sizeof v); return v; }

// Activations of M rows quantized per block: xq [ceil(K / 4)][M] four bytes each,
// scales xs [blocks][M] and (VNNI) the weight offset's share xc [blocks][M].
static void quantize_act_rows(const float* x, int64_t M, int64_t K, int64_t ab, int32_t* xq,
                              float* xs, int32_t* xc) {
  const int64_t nb = (K + ab - 1) / ab;
  for (int64_t m = 0; m < M; ++m) {
    const float* xr = x + m * K;
    for (int64_t b = 0; b < nb; ++b) {
      const int64_t k0 = b * ab, k1 = std::min(K, k0 + ab);
      float amax = 0.f;
      for (int64_t k = k0; k < k1; ++k) amax = std::max(amax, std::fabs(xr[k]));
      const float s = amax > 0.f ? amax / 127.f : 1.f;
      int32_t sum = 0;
      for (int64_t t = k0 / 4; t < (k1 + 3) / 4; ++t) {
        int8_t c[4] = {0, 0, 0, 0};
        for (int j = 0; j < 4; ++j) {
          const int64_t k = 4 * t + j;
          if (k < k1) {
            const float r = std::nearbyint(xr[k] / s);
            c[j] = (int8_t)std::max(-127.f, std::min(127.f, r));
            sum += c[j];
          }
        }
        std::memcpy(xq + t * M + m, c, 4);
      }
      xs[b * M + m] = s;
      xc[b * M + m] = kI8Offset ? 128 * sum : 0;
    }
  }
}

template <int MT>
static inline void panel_tile_i8a(const int32_t* __restrict xq, const float* __restrict xs,
                                  const int32_t* __restrict xc, int64_t ldx, int64_t K,
                                  int64_t ab, const int8_t* __restrict wp,
                                  const float* __restrict sp, int64_t group,
                                  float* __restrict out, int64_t ldo, int64_t n0,
                                  int64_t nvalid, const float* __restrict bias,
                                  bool accumulate) {
  vg tot[MT][kPanelVecs];
  for (int m = 0; m < MT; ++m)
    for (int v = 0; v < kPanelVecs; ++v) tot[m][v] = vg{};
  for (int64_t g0 = 0; g0 < K; g0 += group) {
    const int64_t g1 = std::min(K, g0 + group);
    vg gacc[MT][kPanelVecs];
    for (int m = 0; m < MT; ++m)
      for (int v = 0; v < kPanelVecs; ++v) gacc[m][v] = vg{};
    for (int64_t k0 = g0; k0 < g1; k0 += ab) {
      const int64_t b = k0 / ab, t1 = (std::min(g1, k0 + ab) + 3) / 4;
      vgi acc[MT][kPanelVecs];
      for (int m = 0; m < MT; ++m)
        for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = vgi{};
      for (int64_t t = k0 / 4; t < t1; ++t) {
        const int8_t* wt = wp + t * kPanel * 4;
        for (int64_t l = 0; l < kPanel * 4; l += 64) __builtin_prefetch(wt + kPrefetchBytes + l);
        vgi wv[kPanelVecs];
        for (int v = 0; v < kPanelVecs; ++v) wv[v] = ldi(wt + kVL * 4 * v);
        for (int m = 0; m < MT; ++m) {
          const XB xb(xq[t * ldx + m]);
          for (int v = 0; v < kPanelVecs; ++v) acc[m][v] = xb.dot(acc[m][v], wv[v]);
        }
      }
      for (int m = 0; m < MT; ++m) {
        const vg s = bcast(xs + b * ldx + m);
        const int32_t c = xc[b * ldx + m];
        for (int v = 0; v < kPanelVecs; ++v)
          gacc[m][v] += __builtin_convertvector(acc[m][v] - c, vg) * s;
      }
    }
    const float* sk = sp + (g0 / group) * kPanel;
    for (int v = 0; v < kPanelVecs; ++v) {
      const vg sv = ldg(sk + kVL * v);
      for (int m = 0; m < MT; ++m) tot[m][v] += gacc[m][v] * sv;
    }
  }
  store_tile<MT>(tot, out, ldo, n0, nvalid, bias, accumulate);
}

template <int MT>
static inline void panel_rows_i8a(int mt, const int32_t* xq, const float* xs, const int32_t* xc,
                                  int64_t ldx, int64_t K, int64_t ab, const int8_t* wp,
                                  const float* sp, int64_t group, float* out, int64_t ldo,
                                  int64_t n0, int64_t nvalid, const float* bias, bool acc) {
  if constexpr (MT == 1) {
    panel_tile_i8a<1>(xq, xs, xc, ldx, K, ab, wp, sp, group, out, ldo, n0, nvalid, bias, acc);
  } else {
    if (mt == MT)
      panel_tile_i8a<MT>(xq, xs, xc, ldx, K, ab, wp, sp, group, out, ldo, n0, nvalid, bias, acc);
    else
      panel_rows_i8a<MT - 1>(mt, xq, xs, xc, ldx, K, ab, wp, sp, group, out, ldo, n0, nvalid,
                             bias, acc);
  }
}

// out (+)= x @ (q * s)^T (+ bias) with x quantized per block of ab inputs; (wp, sp) of
// pack_int8(q, s, ab)
static void gemm_i8a(const float* x, int64_t M, int64_t K, int64_t ab, const int8_t* wp,
                     const float* sp, int64_t group, int64_t N, float* out, const float* bias,
                     bool accumulate) {
  const int64_t K4 = (K + 3) / 4, nb = (K + ab - 1) / ab;
  thread_local std::vector<int32_t> xq, xc;
  thread_local std::vector<float> xs;
  xq.resize(K4 * M);
  xc.resize(nb * M);
  xs.resize(nb * M);
  quantize_act_rows(x, M, K, ab, xq.data(), xs.data(), xc.data());
  const int64_t panels = (N + kPanel - 1) / kPanel, groups = (K + group - 1) / group;
  const int32_t* q = xq.data();
  const float* s = xs.data();
  const int32_t* c = xc.data();
#pragma omp parallel for schedule(static) if (N * K >= 65536)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t n0 = p * kPanel, nvalid = std::min(kPanel, N - n0);
    for (int64_t m0 = 0; m0 < M; m0 += kMT)
      panel_rows_i8a<kMT>((int)std::min<int64_t>(kMT, M - m0), q + m0, s + m0, c + m0, M, K,
                          ab, wp + p * K4 * kPanel * 4, sp + p * groups * kPanel, group,
                          out + m0 * N, N, n0, nvalid, bias, accumulate);
  }
}

static void check_i8_panels(const torch::Tensor& wp, const torch::Tensor& sp, int64_t n,
                            int64_t K, int64_t group, const char* name, int64_t ab = 0) {
  TORCH_CHECK(wp.device().is_cpu() && wp.scalar_type() == torch::kChar && wp.is_contiguous(),
              name, " must be a contiguous int8 CPU tensor (pack_int8)");
  const int64_t panels = (n + kPanel - 1) / kPanel;
  if (ab > 0) {
    TORCH_CHECK(ab % 4 == 0, name, ": the activation block must be a multiple of 4");
    TORCH_CHECK(wp.dim() == 4 && wp.size(3) == 4 && wp.size(2) == kPanel &&
                wp.size(1) == (K + 3) / 4 && wp.size(0) == panels,
                name, " must be a packed int8 weight (pack_int8 with an activation block) of ",
                n, " x ", K);
    TORCH_CHECK(group >= K || group % ab == 0, name, ": the weights' group (", group,
                ") must be a multiple of the activation block (", ab, ")");
  } else {
    TORCH_CHECK(wp.dim() == 3 && wp.size(2) == kPanel && wp.size(1) == K && wp.size(0) == panels,
                name, " must be a packed int8 weight (pack_int8) of ", n, " x ", K);
  }
  TORCH_CHECK(group >= 1, name, ": group must be >= 1");
  check_f32(sp, "scales");
  TORCH_CHECK(sp.dim() == 3 && sp.size(0) == panels && sp.size(2) == kPanel &&
              sp.size(1) == (K + group - 1) / group,
              name, "'s scales must be packed (pack_int8) for groups of ", group);
}

// the int8 GEMM of either packing: activations quantized per block of ab inputs (ab > 0)
// or float (ab = 0)
static void gemm_q(const float* x, int64_t M, int64_t K, int64_t ab, const torch::Tensor& wp,
                   const torch::Tensor& sp, int64_t group, int64_t N, float* out,
                   const float* bias, bool accumulate) {
  if (ab > 0)
    gemm_i8a(x, M, K, ab, wp.data_ptr<int8_t>(), sp.data_ptr<float>(), group, N, out, bias,
             accumulate);
  else
    gemm_i8(x, M, K, wp.data_ptr<int8_t>(), sp.data_ptr<float>(), group, N, out, bias,
            accumulate);
}

// q int8 [N, K] and its scales [N, G] into panels: ([ceil(N / kPanel), K, kPanel] int8,
// [ceil(N / kPanel), G, kPanel] float32), rows past N as zeros; with an activation block
// (ab > 0, int8 activations) the weights go in groups of 4 inputs,
// [ceil(N / kPanel), ceil(K / 4), kPanel, 4] (inputs past K as zeros; VNNI builds store
// them offset by +128 as unsigned bytes).
std::vector<torch::Tensor> pack_int8(torch::Tensor q, torch::Tensor scale, int64_t ab) {
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == torch::kChar && q.is_contiguous() &&
              q.dim() == 2, "q must be a contiguous 2-D int8 CPU tensor");
  check_f32(scale, "scale");
  TORCH_CHECK(ab >= 0 && ab % 4 == 0, "the activation block must be 0 or a multiple of 4");
  const int64_t N = q.size(0), K = q.size(1), G = scale.size(1), K4 = (K + 3) / 4;
  TORCH_CHECK(scale.dim() == 2 && scale.size(0) == N, "scale must be [N, groups]");
  const int64_t panels = (N + kPanel - 1) / kPanel;
  auto wp = ab > 0 ? torch::zeros({panels, K4, kPanel, 4}, q.options())
                   : torch::zeros({panels, K, kPanel}, q.options());
  auto sp = torch::zeros({panels, G, kPanel}, scale.options());
  const int8_t* src = q.data_ptr<int8_t>();
  const float* ss = scale.data_ptr<float>();
  int8_t* dst = wp.data_ptr<int8_t>();
  float* sd = sp.data_ptr<float>();
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t rows = std::min(kPanel, N - p * kPanel);
    for (int64_t j = 0; j < kPanel; ++j) {
      const int8_t* r = j < rows ? src + (p * kPanel + j) * K : nullptr;
      if (ab > 0) {
        for (int64_t k = 0; k < 4 * K4; ++k) {
          const int8_t v = r && k < K ? r[k] : 0;
          uint8_t u = kI8Offset ? (uint8_t)(v + 128) : (uint8_t)v;
          std::memcpy(dst + ((p * K4 + k / 4) * kPanel + j) * 4 + k % 4, &u, 1);
        }
      } else if (r) {
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kPanel + j] = r[k];
      }
      if (r)
        for (int64_t g = 0; g < G; ++g) sd[(p * G + g) * kPanel + j] = ss[(p * kPanel + j) * G + g];
    }
  }
  return {wp, sp};
}

// x @ (q * s)^T (+ bias) (+ residual) with (wp, sp) = pack_int8(q, s), n = q.size(0)
torch::Tensor linear_int8(torch::Tensor x, torch::Tensor wp, torch::Tensor sp, int64_t n,
                          int64_t group, int64_t ab, c10::optional<torch::Tensor> bias,
                          c10::optional<torch::Tensor> residual) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be 2-D");
  const int64_t M = x.size(0), K = x.size(1);
  check_i8_panels(wp, sp, n, K, group, "w", ab);
  torch::Tensor out;
  const bool acc = residual.has_value() && residual->defined();
  if (acc) {
    check_f32(*residual, "residual");
    TORCH_CHECK(residual->size(0) == M && residual->size(1) == n, "residual shape");
    out = residual->clone();
  } else {
    out = torch::empty({M, n}, x.options());
  }
  if (bias.has_value() && bias->defined() && bias->numel()) {
    check_f32(*bias, "bias");
    TORCH_CHECK(bias->numel() == n, "bias shape");
  }
  gemm_q(x.data_ptr<float>(), M, K, ab, wp, sp, group, n, out.data_ptr<float>(), opt_ptr(bias),
         acc);
  return out;
}

// decode_layers with int8 matrices: per layer (wp, sp) of pack_int8 for qkv, proj, fc1
// and fc2 (``*_s`` the scales), one quantization group size for all of them.
torch::Tensor decode_layers_int8(
    torch::Tensor x, std::vector<torch::Tensor> ln1, std::vector<torch::Tensor> qkv_w,
    std::vector<torch::Tensor> qkv_s, std::vector<torch::Tensor> qkv_b,
    std::vector<torch::Tensor> proj_w, std::vector<torch::Tensor> proj_s,
    std::vector<torch::Tensor> ln2, std::vector<torch::Tensor> fc1_w,
    std::vector<torch::Tensor> fc1_s, std::vector<torch::Tensor> fc2_w,
    std::vector<torch::Tensor> fc2_s, int64_t group, int64_t ab, torch::Tensor final_norm,
    torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor cos, torch::Tensor sin,
    torch::Tensor pos, int64_t G, int64_t HPG, int64_t D, double scale, double eps,
    c10::optional<torch::Tensor> row_of, c10::optional<torch::Tensor> table) {
  check_f32(x, "x"); check_f32(k_cache, "k cache"); check_f32(v_cache, "v cache");
  check_f32(cos, "cos"); check_f32(sin, "sin"); check_f32(final_norm, "final norm");
  TORCH_CHECK(pos.is_contiguous() && pos.scalar_type() == torch::kLong);
  const int64_t B = x.size(0), H = x.size(1), layers = (int64_t)qkv_w.size();
  TORCH_CHECK(k_cache.dim() == 5 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.size(0) == layers && k_cache.size(2) == G && k_cache.size(4) == D,
              "KV cache shape");
  int64_t rows = 0;
  const KVPages pg = kv_pages(table, k_cache.size(1), k_cache.size(3), &rows);
  const int64_t* rp = row_map(row_of, B, rows);
  const int64_t layer_stride = k_cache.stride(0);
  const int64_t NQKV = G * (HPG + 2) * D, NATT = G * HPG * D;
  TORCH_CHECK(layers > 0 && fc2_w[0].dim() == (ab > 0 ? 4 : 3), "packed weights expected");
  const int64_t F2 = 2 * fc2_w[0].size(1) * (ab > 0 ? 4 : 1);
  auto gs = [group](int64_t K) { return std::min(group, K); };
  auto opts = x.options();
  auto h = torch::empty({B, H}, opts), qkv = torch::empty({B, NQKV}, opts),
       att = torch::empty({B, NATT}, opts), fc = torch::empty({B, F2}, opts),
       act = torch::empty({B, F2 / 2}, opts);
  float* xp = x.data_ptr<float>();
  for (int64_t i = 0; i < layers; ++i) {
    for (auto* t : {&ln1[i], &ln2[i]}) check_f32(*t, "norm weight");
    check_i8_panels(qkv_w[i], qkv_s[i], NQKV, H, gs(H), "qkv weight", ab);
    check_i8_panels(proj_w[i], proj_s[i], H, NATT, gs(NATT), "proj weight", ab);
    check_i8_panels(fc1_w[i], fc1_s[i], F2, H, gs(H), "fc1 weight", ab);
    check_i8_panels(fc2_w[i], fc2_s[i], H, F2 / 2, gs(F2 / 2), "fc2 weight", ab);
    const float* bias = qkv_b[i].defined() && qkv_b[i].numel() ? qkv_b[i].data_ptr<float>() : nullptr;
    rms_norm_rows(xp, B, H, ln1[i].data_ptr<float>(), (float)eps, h.data_ptr<float>());
    gemm_q(h.data_ptr<float>(), B, H, ab, qkv_w[i], qkv_s[i], gs(H), NQKV, qkv.data_ptr<float>(),
           bias, false);
    rope_attend_rows(qkv.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                     k_cache.data_ptr<float>() + i * layer_stride,
                     v_cache.data_ptr<float>() + i * layer_stride, pos.data_ptr<int64_t>(), rp,
                     B, G, HPG, D, pg, (float)scale, att.data_ptr<float>());
    gemm_q(att.data_ptr<float>(), B, NATT, ab, proj_w[i], proj_s[i], gs(NATT), H, xp, nullptr,
           true);
    rms_norm_rows(xp, B, H, ln2[i].data_ptr<float>(), (float)eps, h.data_ptr<float>());
    gemm_q(h.data_ptr<float>(), B, H, ab, fc1_w[i], fc1_s[i], gs(H), F2, fc.data_ptr<float>(),
           nullptr, false);
    silu_mul_rows(fc.data_ptr<float>(), B, F2 / 2, act.data_ptr<float>());
    gemm_q(act.data_ptr<float>(), B, F2 / 2, ab, fc2_w[i], fc2_s[i], gs(F2 / 2), H, xp, nullptr,
           true);
  }
  auto out = torch::empty({B, H}, opts);
  rms_norm_rows(xp, B, H, final_norm.data_ptr<float>(), (float)eps, out.data_ptr<float>());
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("ISA") = MTLT_ISA;  // the instruction set the GEMM tile was chosen for
  m.attr("PANEL") = kPanel;  // output rows per panel of a packed weight
  m.attr("GEMM_ROWS") = kMT;  // rows per register tile
  m.def("pack_weight", &pack_weight, py::arg("w"), py::arg("out") = py::none());
  m.def("pack_weights", &pack_weights, py::arg("ws"), py::arg("outs"));
  m.def("fingerprint", &fingerprint, py::arg("ws"));
  m.def("linear", &linear, py::arg("x"), py::arg("w"), py::arg("n"),
        py::arg("bias") = py::none(), py::arg("residual") = py::none());
  m.def("rms_norm", &rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("rope_attend", &rope_attend, py::arg("qkv"), py::arg("cos"), py::arg("sin"),
        py::arg("kc"), py::arg("vc"), py::arg("pos"), py::arg("G"), py::arg("HPG"),
        py::arg("D"), py::arg("scale"), py::arg("row_of") = py::none(),
        py::arg("table") = py::none());
  m.def("argmax_rows", &argmax_rows, py::arg("x"), py::arg("n"));
  m.def("coupled_gumbel", &coupled_gumbel, py::arg("salt"), py::arg("table"));
  m.def("draft_chain", &draft_chain, py::arg("tok"), py::arg("feat"), py::arg("row_of"),
        py::arg("pos"), py::arg("last"), py::arg("start"), py::arg("depth"), py::arg("vocab"),
        py::arg("d2t"), py::arg("embed_w"), py::arg("fc_w"), py::arg("ln1"), py::arg("qkv_w"),
        py::arg("qkv_b"), py::arg("proj_w"), py::arg("ln2"), py::arg("fc1_w"),
        py::arg("fc2_w"), py::arg("final_norm"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("cos_table"), py::arg("sin_table"), py::arg("G"), py::arg("HPG"), py::arg("D"),
        py::arg("scale"), py::arg("eps"), py::arg("head_w"), py::arg("head_n"),
        py::arg("table") = py::none());
  m.def("decode_layers", &decode_layers, py::arg("x"), py::arg("ln1"), py::arg("qkv_w"),
        py::arg("qkv_b"), py::arg("proj_w"), py::arg("ln2"), py::arg("fc1_w"),
        py::arg("fc2_w"), py::arg("final_norm"), py::arg("k_cache"), py::arg("v_cache"),
        py::arg("cos"), py::arg("sin"), py::arg("pos"), py::arg("G"), py::arg("HPG"),
        py::arg("D"), py::arg("scale"), py::arg("eps"), py::arg("row_of") = py::none(),
        py::arg("table") = py::none());
  m.attr("INT8_ACT") = MTLT_I8A;  // the int8-activation dot product's instructions
  m.def("pack_int8", &pack_int8, py::arg("q"), py::arg("scale"), py::arg("act_block") = 0);
  m.def("linear_int8", &linear_int8, py::arg("x"), py::arg("wp"), py::arg("sp"), py::arg("n"),
        py::arg("group"), py::arg("act_block") = 0, py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("decode_layers_int8", &decode_layers_int8, py::arg("x"), py::arg("ln1"),
        py::arg("qkv_w"), py::arg("qkv_s"), py::arg("qkv_b"), py::arg("proj_w"),
        py::arg("proj_s"), py::arg("ln2"), py::arg("fc1_w"), py::arg("fc1_s"),
        py::arg("fc2_w"), py::arg("fc2_s"), py::arg("group"), py::arg("act_block"),
        py::arg("final_norm"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("cos"), py::arg("sin"),
        py::arg("pos"), py::arg("G"), py::arg("HPG"), py::arg("D"), py::arg("scale"),
        py::arg("eps"), py::arg("row_of") = py::none(), py::arg("table") = py::none());
}
