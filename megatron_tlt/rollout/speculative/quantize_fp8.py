"""FP8 (E4M3) copies of linear layers through ``torch._scaled_mm`` (the self-drafter on
GPUs with FP8 tensor cores: compute capability 8.9 and later).

A weight w [N, K] becomes float8_e4m3fn values q and float32 scales s, one per output
channel, symmetric:

    s[n] = max_k |w[n, k]| / 448            (1 where the channel is all zeros)
    q[n, k] = e4m3(clamp(w[n, k] / s[n], -448, 448))

(448 is E4M3's largest finite value; the clamp keeps a quotient that rounds past it
finite: E4M3 has no infinity and an overflowing cast may give NaN.) Quantization is
elementwise plus a maximum, hence bit-identical wherever the same weights are quantized
(every replica, every stage, every refresh).

The matmul quantizes the activations the same way per row at every call (dynamic
row-wise scales t[m]) and multiplies in FP8 with float32 accumulation:

    out[m, n] = t[m] * s[n] * sum_k e4m3(x[m, k] / t[m]) * q[n, k]      (bfloat16 out)

which is ``torch._scaled_mm(xq, q.T, t[:, None], s[None, :], out_dtype=bfloat16)``
(row-wise scaling). Its layout rules (torch's own checks, ``scaled_mm_problems``): both
operands FP8, the first row-major, the second column-major, the inner dimension K and
the second operand's N multiples of 16, scales float32 and contiguous, [M, 1] and
[1, N]. So the weight is stored padded to [ceil16(N), ceil16(K)] row-major (its
transpose is the column-major operand; zero padding changes no product, padded scales
are 1) once per refresh, into the same memory (``quantize_fp8(w, out=old)``); only the
activations are padded per call, and only when K is not a multiple of 16.

Elsewhere (a CPU, an older GPU) ``fp8_linear`` runs the same math emulated: the FP8
operands dequantized to float32 and multiplied, the result rounded to bfloat16 like the
device's (``emulated_scaled_mm``); correct, not fast. ``resolve_format`` picks FP8
only where the device runs it natively.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
ALIGN = 16  # _scaled_mm: K and N multiples of 16
OUT_DTYPE = torch.bfloat16  # row-wise scaling writes bfloat16 only
FORMATS = ("auto", "int8", "fp8")

_NATIVE: dict = {}  # device -> whether torch._scaled_mm runs row-wise FP8 there


def _round_up(n: int, m: int = ALIGN) -> int:
    return -(-n // m) * m


@dataclass
class Fp8Weight:
    """An E4M3 weight of logical shape [n, k], stored padded to [N, K] (multiples of
    16) row-major, and its float32 scales [1, N] (padding: zeros, scales 1).
    ``native``: multiplied by ``torch._scaled_mm`` (else emulated)."""

    q: torch.Tensor
    scale: torch.Tensor
    n: int
    k: int
    native: bool = False
    panel = None  # (no CPU-kernel panel copy: the self-drafter's CPU paths skip it)
    panel_scale = None

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.n, self.k))

    @property
    def group(self) -> int:
        return self.k  # one scale per output channel

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this weight holds."""
        return [self.q, self.scale]

    @property
    def nbytes(self) -> int:
        """Bytes of the (padded) FP8 matrix and its scales."""
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * s as the logical [n, k] matrix of ``dtype``."""
        return (self.q[: self.n, : self.k].float() * self.scale[0, : self.n, None]).to(dtype)


def fp8_native(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs row-wise-scaled E4M3 on ``device``: CUDA with
    compute capability >= 8.9 and a 16 x 16 probe that runs (once per device; the
    build may lack the row-wise kernels)."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_mm"):
        return False
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _NATIVE:
        ok = torch.cuda.get_device_capability(device) >= (8, 9)
        if ok:
            try:
                a = torch.zeros(1, ALIGN, dtype=E4M3, device=device)
                b = torch.zeros(ALIGN, ALIGN, dtype=E4M3, device=device).t()
                torch._scaled_mm(a, b, torch.ones(1, 1, device=device),
                                 torch.ones(1, ALIGN, device=device), out_dtype=OUT_DTYPE)
            except (RuntimeError, NotImplementedError):
                ok = False
        _NATIVE[device] = ok
    return _NATIVE[device]


def resolve_format(fmt: str, device: torch.device, group: int = 0,
                   native: Optional[bool] = None) -> str:
    """The self-drafter's weight format: ``fmt`` as configured, or for "auto" FP8 where
    the device multiplies it natively (``fp8_native``, or ``native`` when given) and the
    scales are per output channel (``group`` 0), int8 otherwise."""
    if fmt not in FORMATS:
        raise ValueError(f"self-drafter format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "fp8" and group:
        raise ValueError("the FP8 self-drafter has one scale per output channel; "
                         f"got a group of {group} (rollout.speculative.kinds.self.group=0)")
    if fmt != "auto":
        return fmt
    if group:
        return "int8"
    return "fp8" if (fp8_native(device) if native is None else native) else "int8"


def _scales(amax: torch.Tensor) -> torch.Tensor:
    """float32 scales mapping ``amax`` to E4M3's largest value (1 for zero rows)."""
    amax = amax.float()
    return torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))


def _to_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.float() / scale).clamp_(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_fp8(w: torch.Tensor, out: Optional[Fp8Weight] = None,
                 native: Optional[bool] = None) -> Fp8Weight:
    """``w`` [n, k] (any float dtype, any device) as a padded E4M3 matrix with float32
    per-channel scales; written into ``out``'s tensors when its shapes match (the copy's
    memory is allocated once). ``native`` defaults to ``fp8_native(w.device)``."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 needs a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    np_, kp = _round_up(n), _round_up(k)
    native = fp8_native(w.device) if native is None else native
    fits = (out is not None and out.n == n and out.k == k and out.q.device == w.device)
    if not fits:
        out = Fp8Weight(torch.zeros(np_, kp, dtype=E4M3, device=w.device),
                        torch.ones(1, np_, dtype=torch.float32, device=w.device), n, k, native)
    out.native = native
    with torch.no_grad():
        wd = w.detach()
        s = _scales(wd.abs().amax(dim=1))  # [n]
        out.q[:n, :k].copy_(_to_e4m3(wd, s[:, None]))
        out.scale[0, :n].copy_(s)
    return out


def quantize_rows(x: torch.Tensor, k_padded: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations x [m, k] as E4M3 [m, k_padded] (row-major, zero-padded) and their
    per-row float32 scales [m, 1] (dynamic: from this call's values; no host sync)."""
    t = _scales(x.abs().amax(dim=-1, keepdim=True))
    xq = _to_e4m3(x, t)
    if k_padded != x.shape[-1]:
        xq = F.pad(xq.view(torch.uint8), (0, k_padded - x.shape[-1])).view(E4M3)
    return xq, t


def emulated_scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor,
                       scale_b: torch.Tensor, out_dtype: torch.dtype = OUT_DTYPE
                       ) -> torch.Tensor:
    """``torch._scaled_mm``'s row-wise result computed by dequantizing: (a * scale_a) @
    (b * scale_b) in float32, rounded to ``out_dtype``."""
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype)


def scaled_mm_operands(x: torch.Tensor, w: Fp8Weight) -> tuple:
    """The four operands of ``torch._scaled_mm`` for x [m, k] @ w.T: E4M3 activations
    [m, K] row-major, the weight [K, N] column-major (a transposed view), their scales
    [m, 1] and [1, N]."""
    xq, t = quantize_rows(x, w.q.shape[1])
    return xq, w.q.t(), t, w.scale


def scaled_mm_problems(a, b, scale_a, scale_b) -> list[str]:
    """What torch's CUDA ``_scaled_mm`` would refuse in these operands, by its own
    checks: they are run on meta copies with the same strides (a meta tensor is checked
    as a CUDA one). Empty when the call is valid; the CPU tests use it."""
    meta = [t.detach().to("meta") for t in (a, b, scale_a, scale_b)]
    problems = []
    try:
        torch._scaled_mm(*meta, out_dtype=OUT_DTYPE)
    except RuntimeError as e:
        problems.append(str(e))
    if scale_a.shape != (a.shape[0], 1) or scale_b.shape != (1, b.shape[1]):
        problems.append(f"not row-wise scales: {tuple(scale_a.shape)}, {tuple(scale_b.shape)}")
    return problems


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: Optional[torch.Tensor] = None,
               residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``residual + x @ w.T + bias`` for x [..., k] in x's dtype: ``torch._scaled_mm``
    with dynamic row-wise activation scales where ``w.native``, else emulated."""
    lead = x.shape[:-1]
    a, b, sa, sb = scaled_mm_operands(x.reshape(-1, x.shape[-1]), w)
    if w.native:
        out = torch._scaled_mm(a, b, sa, sb, out_dtype=OUT_DTYPE)
    else:
        out = emulated_scaled_mm(a, b, sa, sb)
    if out.shape[1] != w.n:  # padded channels: sliced off (contiguous for the callers' views)
        out = out[:, : w.n].contiguous()
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    if residual is not None:
        out = residual.reshape(out.shape) + out
    return out.view(*lead, w.n)
