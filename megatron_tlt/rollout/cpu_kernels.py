"""Fused CPU kernels for the one-token decode step (float32).

A decode step at small batch streams every weight matrix once and does ~17 small
operations per layer (RMSNorm, RoPE, KV-cache writes, attention, SwiGLU, residuals).
On a CPU each small eager op costs 10-60 us once the weight stream has evicted its
operands, and MKL's GEMM at 1-64 rows stays well short of memory bandwidth. These
kernels run the step close to the bandwidth floor:

- ``pack_weight(w, out=None)``: a copy of w [N, K] in panel layout [ceil(N/P), K, P]
  (zero-padded; P = the module's ``PANEL``), which the GEMM reads as one in-order
  stream; ``pack_weights(ws, outs)`` packs many matrices in one parallel loop;
- ``linear(x, wp, n, bias=None, residual=None)``: ``residual + x @ w.T + bias`` with
  ``wp = pack_weight(w)``, ``n = w.shape[0]``. For each k the P weights of a panel are
  loaded once and multiplied into up to ``GEMM_ROWS`` rows at a time, with software
  prefetch; every weight is read once per call. Each output is a sum over k in order,
  so a row's result is bitwise the same at any batch size. The register tile is chosen
  per instruction set at compile time: AVX-512 48 x 8 rows, AVX2 16 x 6, portable
  8 x 6 (2-core Xeon, AVX-512, SmolLM2-135M's matrices from memory: 7 % faster than
  the earlier dot-product kernel at 1 row, 17-29 % at 5-8 rows, 23-33 % faster than
  MKL at 24-64 rows);
- ``rms_norm(x, w, eps)``: x * rsqrt(mean(x^2) + eps) * w, rows of x;
- ``rope_attend(qkv, cos, sin_signed, k_cache, v_cache, pos, ..., row_of, table)``:
  rotate-half RoPE on the query heads and the key of every KV group, write key and
  value at ``pos``, and attend causally over positions 0..pos with the group's query
  heads (GQA), the softmax's exp vectorised. With ``table`` (a paged cache's block table
  [rows, blocks per row], ``kv_paged.PagedKVCache.block_table``) the caches are the
  pools [blocks, G, block size, D] and position p of row r is read and written in place
  at (table[r, p // block size], p % block size); positions are visited in the same
  order as in a contiguous row, so the result is bitwise the same (gathering the blocks
  into a contiguous copy first measured 7-15x slower per layer);
- ``silu_mul(h)``: silu(h[:, :F]) * h[:, F:];
- ``decode_layers(...)``: the whole decoder stack of one decode step (tensor parallel
  size 1) in one call, from the embeddings to the final norm (packed matrices); a
  contiguous or (with ``table``) a paged cache, as ``rope_attend``;
- ``argmax_rows(x, n)``: torch.argmax over the first n columns of each row (first of
  equal maxima, NaN as the largest), a vectorised scan (torch's CPU argmax reads ~1 GB/s);
- ``coupled_gumbel(salt, table)``: coupled sampling's Gumbel noise rows
  (``sampling.coupled_gumbel``) in one vectorised pass: the hash, the two logs (its own
  polynomial log, a few ulp from torch's) and no temporaries; 49k columns in ~0.06 ms
  against ~0.4-0.9 ms for the tensor form;
- ``pack_int8(q, scale, act_block=0)``, ``linear_int8(x, wp, sp, n, group, act_block=0,
  bias=None, residual=None)``, ``decode_layers_int8(...)``: the same GEMM and decoder
  stack with int8 matrices (the self-drafter's copy, ``rollout/speculative/quantize.py``): int8
  panels (a quarter of the float weights' bytes) and float32 scales per output channel
  or per group of inputs in panel layout. With float activations (``act_block`` 0) each
  k's weights are widened to float in registers (one sign extension and one conversion
  per vector) and every group's sums scaled once. With ``act_block`` > 0 each row's
  activations are quantized per block of that many inputs and every block's product is
  an integer dot product of 4-input groups (``INT8_ACT``: AVX-512 VNNI's vpdpbusd,
  AVX-512 BW / AVX2 vpmaddubsw + vpmaddwd, or portable integer code), scaled once per
  block: a quarter of the instructions per weight byte, so the copy's step streams its
  int8 weights near the memory bandwidth instead of waiting on conversions;
- ``draft_chain(...)``: a speculative step's greedy drafting with the EAGLE drafter in
  one call: its catch-up over the pending (token, feature) pairs, then every draft token
  of every row (argmax, fc over [embedding; feature], ``decode_layers``, draft head),
  the same operations in the same order as the step-by-step path.

The C++ source is ``csrc/cpu_kernels.cpp`` (package data). Vectors are written with
GCC/Clang vector extensions, so one source builds AVX-512, AVX2 or portable (SSE, NEON)
code. ``get()`` compiles it on first use with ``torch.utils.cpp_extension`` (needs a C++
compiler and ninja; about a minute) into ``$MEGATRON_TLT_CACHE/kernels/<isa>-<hash>``,
one build per instruction-set variant, CPU type, torch version and source: the best
variant the CPU runs (``detect_isa``) with ``-march=native``, or a lower one forced with
``MEGATRON_TLT_CPU_ISA=avx2|portable`` (``-march=haswell``, ``-march=x86-64``) to run
what other CPUs run. The build links torch's own OpenMP runtime, so kernel and torch
threads are one pool. If building fails, or ``MEGATRON_TLT_NO_CPU_KERNELS=1`` is set,
the engine uses eager torch ops. Whether the engine uses a built kernel at a given batch
size is decided by ``kernel_policy`` (rollout.cpu_kernels=auto: a per-build
calibration against eager torch). Tests pin every kernel of every variant the CPU runs
to torch (tests/rollout/test_cpu_kernels.py) and both engine paths to full-sequence forwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from pathlib import Path
from typing import Optional

log = logging.getLogger(__name__)

# The C++ source, shipped as package data; its text is part of the build folder's key.
SOURCE_PATH = Path(__file__).resolve().parent / "csrc" / "cpu_kernels.cpp"
_source_text: Optional[str] = None


def _source() -> str:
    global _source_text
    if _source_text is None:
        _source_text = SOURCE_PATH.read_text()
    return _source_text

# Decode batches up to this many rows may use the kernels (rollout.cpu_kernels=auto
# narrows it to where the per-build calibration measured them faster: kernel_policy).
MAX_FUSED_ROWS = 64
ISAS = ("avx512", "avx2", "portable")  # instruction-set variants, best first
_BASE_FLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast"]
# a lower variant forced on a better CPU (MEGATRON_TLT_CPU_ISA): a representative
# -march for it; the CPU's own best variant builds with -march=native
_FORCED_MARCH = {"avx512": "-march=skylake-avx512", "avx2": "-march=haswell",
                 "portable": "-march=x86-64"}
_builds: dict = {}  # isa -> compiled module, or None when it could not be built


def cpu_info() -> tuple[str, set]:
    """(CPU model name, instruction-set flags) from /proc/cpuinfo; off Linux the flags
    are empty and the model is what the ``platform`` module reports."""
    import platform

    model, flags = "", set()
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8", errors="replace"):
            key, _, val = line.partition(":")
            key = key.strip()
            if key == "model name" and not model:
                model = val.strip()
            elif key in ("flags", "Features") and not flags:
                flags = set(val.split())
            if model and flags:
                break
    except OSError:
        pass
    return model or platform.processor() or platform.machine(), flags


def cpu_model() -> str:
    return cpu_info()[0]


def _is_x86() -> bool:
    import platform

    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def detect_isa() -> str:
    """The best kernel variant this CPU runs: avx512 (AVX-512F), avx2 (AVX2 + FMA) or
    portable (anything else, e.g. SSE-only x86 or ARM)."""
    flags = cpu_info()[1]
    if _is_x86():
        if "avx512f" in flags:
            return "avx512"
        if "avx2" in flags and "fma" in flags:
            return "avx2"
    return "portable"


def available_isas() -> list[str]:
    """The variants this machine can run, best first (tests build each of them)."""
    best = detect_isa()
    return list(ISAS[ISAS.index(best):]) if _is_x86() else [best]


def requested_isa(isa: Optional[str] = None) -> str:
    """``isa``, else ``$MEGATRON_TLT_CPU_ISA`` (avx512 | avx2 | portable; auto or unset:
    the best this CPU runs). A variant this CPU cannot run is refused."""
    name = (isa or os.environ.get("MEGATRON_TLT_CPU_ISA", "") or "auto").strip().lower()
    if name in ("auto", "native"):
        return detect_isa()
    if name not in ISAS:
        raise ValueError(f"unknown CPU kernel variant {name!r}; choose auto, "
                         + ", ".join(ISAS))
    if name not in available_isas():
        raise ValueError(f"this CPU ({cpu_model()}) cannot run the {name} kernel "
                         f"variant; it runs {', '.join(available_isas())}")
    return name


def compile_flags(isa: str) -> list[str]:
    if isa == detect_isa():
        return _BASE_FLAGS + ["-march=native"]
    return _BASE_FLAGS + [_FORCED_MARCH[isa]]


def _openmp_ldflags() -> list[str]:
    """Link torch's own OpenMP runtime, so kernels and torch ops share one thread pool.
    ``-fopenmp`` alone links the compiler's libgomp; where torch ships a renamed copy
    (``libgomp-<hash>.so.1``) or Intel's libiomp5 the process would hold two runtimes
    whose idle threads spin against each other's work."""
    from pathlib import Path

    import torch

    lib = Path(torch.__file__).resolve().parent / "lib"
    for pattern in ("libgomp*.so*", "libiomp5*.so", "libomp*.so*"):
        hits = sorted(lib.glob(pattern))
        if hits:
            return [str(hits[0]), f"-Wl,-rpath,{lib}"]
    return ["-fopenmp"]


def openmp_runtimes() -> list[str]:
    """OpenMP runtime libraries mapped into this process (Linux; [] elsewhere)."""
    import re

    found = set()
    try:
        for line in open("/proc/self/maps", encoding="utf-8", errors="replace"):
            path = line.split()[-1] if line.strip() else ""
            name = os.path.basename(path)
            if re.match(r"lib(gomp|iomp5|omp)\b[\w.-]*\.so", name):
                found.add(os.path.realpath(path))
    except OSError:
        pass
    return sorted(found)


def _libtorch() -> str:
    from pathlib import Path

    import torch

    return str(Path(torch.__file__).resolve().parent / "lib" / "libtorch_cpu.so")


def openmp_runtime_of(library: str) -> Optional[str]:
    """The file that defines the OpenMP entry point ``GOMP_parallel`` as ``library`` (a
    loaded shared object) sees it, or None where that cannot be told (not Linux, no
    OpenMP, not loaded)."""
    import ctypes

    class _DlInfo(ctypes.Structure):
        _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                    ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]

    try:
        lib = ctypes.CDLL(library, mode=getattr(os, "RTLD_NOLOAD", 0) | os.RTLD_LAZY)
        addr = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value
        info = _DlInfo()
        dladdr = ctypes.CDLL(None).dladdr
        dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
        if not dladdr(addr, ctypes.byref(info)) or not info.fname:
            return None
        return os.path.realpath(info.fname.decode())
    except (OSError, AttributeError, ValueError):
        return None


@contextlib.contextmanager
def _build_lock(build):
    """Hold the build folder's lock while torch builds or loads the kernels there. The
    lock is an flock, released by the kernel when its holder dies, so a build killed
    half-way blocks nobody. Holding it, no other process of ours is building here: a
    leftover torch build baton (``lock``, a plain file that a killed build never
    removes, on which torch would otherwise wait forever) is stale and removed."""
    import fcntl

    with open(build / "build.flock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            baton = build / "lock"
            if baton.exists():
                log.warning("removing a stale build lock left by a killed build: %s", baton)
                baton.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def build_dir(isa: Optional[str] = None):
    """Build folder of a variant: per CPU model and flags (-march=native code must not
    be shared by machines with different instruction sets, e.g. a home directory
    shared across a cluster), torch version and source. The calibration
    (kernel_policy) is stored in it too."""
    import hashlib
    from pathlib import Path

    import torch

    from ..assets import default_cache_dir

    isa = requested_isa(isa)
    model, flags = cpu_info()
    key = hashlib.sha256("\n".join([model, " ".join(sorted(flags)), torch.__version__, _source(),
                                    " ".join(compile_flags(isa)),
                                    " ".join(_openmp_ldflags())]).encode()).hexdigest()[:16]
    return Path(default_cache_dir()) / "kernels" / f"{isa}-{key}"


def get(isa: Optional[str] = None) -> Optional[object]:
    """The compiled kernels (the best variant for this CPU, or ``isa`` /
    ``$MEGATRON_TLT_CPU_ISA``), or None when unavailable (then callers use eager ops).
    The module's ``ISA`` says which variant it is and ``PANEL`` its packed-weight panel
    width."""
    if os.environ.get("MEGATRON_TLT_NO_CPU_KERNELS") == "1":
        return None
    try:
        isa = requested_isa(isa)
    except ValueError as e:
        if isa is not None:
            raise
        log.warning("%s; using the %s kernels", e, detect_isa())
        isa = detect_isa()
    if isa in _builds:
        return _builds[isa]
    kernels = None
    try:
        from torch.utils.cpp_extension import load_inline

        build = build_dir(isa)
        build.mkdir(parents=True, exist_ok=True)
        if not any(build.glob("*.so")):
            print(f"[kernels] compiling the fused CPU decode kernels ({isa}) into {build} "
                  "(once per machine type, about a minute)", file=sys.stderr, flush=True)
        with _build_lock(build):
            kernels = load_inline(name=f"megatron_tlt_cpu_decode_{isa}",
                                  cpp_sources=[_source()], extra_cflags=compile_flags(isa),
                                  extra_ldflags=_openmp_ldflags(),
                                  build_directory=str(build), verbose=False)
        if kernels.ISA != isa:
            raise RuntimeError(f"the {isa} build compiled the {kernels.ISA} code path "
                               f"(flags {' '.join(compile_flags(isa))})")
        mine, torchs = openmp_runtime_of(kernels.__file__), openmp_runtime_of(_libtorch())
        if mine != torchs:
            log.warning("the CPU kernels use the OpenMP runtime %s, torch uses %s: their "
                        "thread pools may contend", mine, torchs)
    except Exception as e:  # no compiler / ninja: eager fallback, said once
        log.warning("fused CPU decode kernels unavailable (%s); using eager torch ops", e)
        kernels = None
    _builds[isa] = kernels
    return kernels
