"""The self-drafter's copy of a mixture-of-experts layer's experts: int8, one scale per
output channel of each expert (or per group of inputs), and the copy's MoE forward.

A rank's experts are stacked [E, N, K] (the rollout forward's ``experts.StackedExperts``
copies: fc1 [E, 2F, H], fc2 [E, H, F]); each expert's matrix is quantized as
``quantize.quantize_int8`` quantizes a linear (symmetric, s = max|w| / 127 per row or
per group, q = round(w / s)), so q [E, N, K] int8 and scales [E, N, G] float32: a
quarter of the float32 experts' bytes, and bit-identical wherever the same weights are
quantized (elementwise and a max).

The copy's MoE step (``moe_int8``) routes on the copy's float router as the target
does, with each GEMM's inputs quantized per row and per block of ``act_block`` inputs as
the copy's linears quantize theirs (``quantize.quantize_activations``). Its experts are
dequantized for the call (torch has no int8 grouped GEMM; the CPU kernels' int8 GEMM
takes one matrix): at small batches, fewer (token, expert) pairs than experts, only the
chosen experts, one matrix-vector product per pair, so the cost follows the experts a
step touches; at larger batches every expert of the rank, for ``experts.moe``'s grouped
GEMMs (docs/speculation.md gives the measured cost). The FP8 copy format keeps its
experts in this int8 form too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from .. import experts
from .quantize import dequantize_activations, quantize_activations, quantize_int8


@dataclass
class QuantExperts:
    """Stacked int8 experts [E, N, K] and their float32 scales [E, N, G]."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int  # inputs per scale (K when per output channel)
    act_block: int = 0  # inputs per activation scale of the GEMMs' inputs (0: float)

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def tensors(self) -> list[torch.Tensor]:
        return [self.q, self.scale]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def dequantize(self, dtype: torch.dtype = torch.float32,
                   ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """q * s as [E, N, K] of ``dtype``; ``ids`` [P]: those experts only, [P, N, K]."""
        q, scale = (self.q, self.scale) if ids is None else \
            (self.q.index_select(0, ids), self.scale.index_select(0, ids))
        s = scale.repeat_interleave(self.group, dim=-1)[..., :q.shape[-1]]
        return (q.float() * s).to(dtype)


def quantize_experts(w: torch.Tensor, group: int = 0, act_block: int = 0,
                     out: Optional[QuantExperts] = None) -> QuantExperts:
    """Stacked experts ``w`` [E, N, K] as int8, expert by expert (one matrix's
    temporaries at a time), written into ``out``'s tensors when their shapes match."""
    first = quantize_int8(w[0], group, act_block)
    if out is None or out.q.shape != w.shape or out.scale.shape[1:] != first.scale.shape:
        out = QuantExperts(torch.empty(w.shape, dtype=torch.int8, device=w.device),
                           torch.empty(w.shape[0], *first.scale.shape,
                                       dtype=first.scale.dtype, device=w.device),
                           first.group, act_block)
    with torch.no_grad():
        for e in range(w.shape[0]):
            p = first if e == 0 else quantize_int8(w[e], group, act_block)
            out.q[e].copy_(p.q)
            out.scale[e].copy_(p.scale)
    out.group, out.act_block = first.group, act_block
    return out


def activation_rounding(block: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The copy's GEMM inputs as its int8 linears see them: quantized per row and per
    block of ``block`` inputs and back (unchanged when ``block`` is 0)."""
    if not block:
        return lambda rows: rows
    return lambda rows: dequantize_activations(*quantize_activations(rows, block),
                                               block).to(rows.dtype)


def moe_int8(x: torch.Tensor, router_w: torch.Tensor, w13: QuantExperts, w2: QuantExperts,
             shape: "experts.MoeShape") -> tuple[torch.Tensor, torch.Tensor]:
    """``experts.moe`` over the int8 experts (the GEMMs' inputs quantized per
    ``act_block`` like the copy's linears). With fewer (token, expert) pairs than the
    rank's experts (the tail's small batches) only the chosen experts are dequantized,
    one matrix per pair (``_moe_pairs``); otherwise all of them, for the grouped GEMMs.
    Which path runs follows from the shapes alone (no host read)."""
    act = activation_rounding(w13.act_block)
    if x.shape[0] * shape.topk < shape.local:
        return _moe_pairs(x, router_w, w13, w2, shape, act)
    return experts.moe(x, router_w, w13.dequantize(x.dtype), w2.dequantize(x.dtype), shape,
                       act=act)


def _moe_pairs(x, router_w, w13: QuantExperts, w2: QuantExperts, shape, act):
    """The MoE MLP pair by pair: each (token, slot) multiplies its token by its own
    expert's dequantized matrices (a batched matrix-vector product); pairs whose expert
    another rank holds weigh 0."""
    n, k = x.shape[0], shape.topk
    weights, idx = experts.route(x, router_w, shape)
    ids, w = experts.local_pairs(weights, idx, shape)
    rows = act(x.repeat_interleave(k, dim=0))  # [P, H], pair p = token p // k
    h = torch.bmm(w13.dequantize(x.dtype, ids), rows[:, :, None])[..., 0]
    a, u = torch.chunk(h, 2, dim=-1)
    y = torch.bmm(w2.dequantize(x.dtype, ids), act(F.silu(a) * u)[:, :, None])[..., 0]
    return (y * w[:, None]).view(n, k, -1).sum(1), idx.to(experts.ROUTE_DTYPE)
