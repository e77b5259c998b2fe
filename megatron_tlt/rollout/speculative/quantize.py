"""Weight-only int8 quantization of linear layers (the self-drafter's weights).

A weight w [N, K] becomes int8 values q and float32 scales s, symmetric, one scale per
output channel (``group=0``) or per group of ``group`` consecutive inputs of a channel
(the last group of a row may be shorter):

    s[n, g] = max(|w[n, g*G : (g+1)*G]|) / 127      (1 where that block is all zeros)
    q[n, k] = clamp(round(w[n, k] / s[n, k // G]), -127, 127)

so w ≈ q * s. Quantization is elementwise and reduction-order free (a max), hence
bit-identical wherever the same weights are quantized (every replica, every refresh).

A weight may also carry an activation block (``act_block`` > 0): its inputs are then
quantized too, dynamically, per row and per block of ``act_block`` consecutive inputs
(``quantize_activations``: symmetric, s_a = max|x| / 127 over the block), so every
block's dot product is an integer sum (the CPU kernels' int8 dot-product instructions).
The blocks sit inside the weights' groups (a group is a multiple of the block).

``int8_linear`` is the reference matmul: ``x' @ dequantize(w).T (+ bias) (+ residual)``
in the activations' dtype, x' = x, or x quantized and dequantized per block. The CPU
kernels (``cpu_kernels.linear_int8``) compute the same sums with the int8 weights in
their panel layout: widened to float in registers (float activations), or as integer
dot products scaled once per block (int8 activations).

Where the kernels run, a weight keeps its int8 values only in their panel layout
(``QuantWeight.packed``: ``q`` is dropped, one int8 copy of the matrix is held);
``int8_values`` reads them back from the panels (``unpack_panel``, the inverse of
``cpu_kernels.pack_int8``'s layout) for the reference path and for checks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

QMAX = 127


@dataclass
class QuantWeight:
    """An int8 weight [N, K] and its float32 scales [N, ceil(K / group)] (per channel:
    [N, 1]): the matrix ``q`` (row-major), or once ``packed`` only the CPU kernels' int8
    panel copy (``panel``, ``panel_scale``) and ``scale``."""

    q: Optional[torch.Tensor]  # None once packed (the panels hold the values)
    scale: torch.Tensor
    group: int  # inputs per scale (K when per output channel)
    act_block: int = 0  # inputs per activation scale (0: float activations)
    panel: Optional[torch.Tensor] = None  # the CPU kernels' int8 panel copy
    panel_scale: Optional[torch.Tensor] = None  # its scales, panel layout
    size: tuple = ()  # (N, K): q's shape, kept when q is dropped
    panel_offset: int = 0  # added to each stored panel byte (VNNI builds: 128, as uint8)

    def __post_init__(self):
        if not self.size:
            self.size = tuple(self.q.shape)

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self.size)

    @property
    def packed(self) -> bool:
        """Whether only the panel copy holds the int8 values (no ``q``)."""
        return self.q is None

    def pack(self, panel: torch.Tensor, panel_scale: torch.Tensor, offset: int = 0) -> None:
        """Keep the kernels' panel copy (``cpu_kernels.pack_int8(q, scale, act_block)``,
        whose stored bytes are the values + ``offset``) instead of ``q``."""
        self.panel, self.panel_scale, self.panel_offset = panel, panel_scale, offset
        self.q = None

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor this weight holds."""
        return [t for t in (self.q, self.scale, self.panel, self.panel_scale) if t is not None]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor it holds: the int8 matrix (``q``, or the panel copy
        with its padding), the scales, and the panel copy's scales."""
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def int8_values(self) -> torch.Tensor:
        """The int8 matrix [N, K]: ``q``, or read back from the panel copy."""
        if self.q is not None:
            return self.q
        return unpack_panel(self.panel, *self.size, self.act_block, self.panel_offset)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * s as a [N, K] matrix of ``dtype``."""
        k = self.size[1]
        s = self.scale.repeat_interleave(self.group, dim=1)[:, :k]
        return (self.int8_values().float() * s).to(dtype)


def unpack_panel(panel: torch.Tensor, n: int, k: int, act_block: int = 0,
                 offset: int = 0) -> torch.Tensor:
    """The int8 matrix [n, k] of a ``cpu_kernels.pack_int8`` panel copy: panels of P
    output rows, [ceil(n / P), k, P] (float activations) or, with an activation block,
    groups of 4 inputs [ceil(n / P), ceil(k / 4), P, 4]; each stored byte is the value
    + ``offset`` (mod 256: VNNI builds store them offset by 128 as unsigned bytes)."""
    order = (0, 2, 1, 3) if act_block else (0, 2, 1)  # -> [panels, P, inputs(, 4)]
    rows = panel.permute(*order).reshape(panel.shape[0] * panel.shape[2], -1)[:n, :k]
    if offset:
        rows = (rows.view(torch.uint8).to(torch.int16) - offset).to(torch.int8)
    return rows.contiguous()


def panel_byte_offset(kern, act_block: int) -> int:
    """What ``kern.pack_int8`` (a CPU kernels module) adds to each stored byte: 128 in
    builds whose int8 dot product takes unsigned weights (AVX-512 VNNI) when the
    activations are int8, else 0. Read from a packed zero."""
    if not act_block:
        return 0
    probe, _ = kern.pack_int8(torch.zeros(1, 4, dtype=torch.int8), torch.ones(1, 1), 4)
    return int(probe.reshape(-1)[:1].view(torch.uint8)[0])


def check_blocks(group: int, act_block: int) -> None:
    """``act_block`` 0 or a positive multiple of 4 that divides ``group`` (when grouped)."""
    if act_block < 0 or act_block % 4:
        raise ValueError(f"the activation block must be 0 (float activations) or a positive "
                         f"multiple of 4, got {act_block}")
    if act_block and group and group % act_block:
        raise ValueError(f"the weights' quantization group ({group}) must be a multiple of "
                         f"the activation block ({act_block})")


def quantize_int8(w: torch.Tensor, group: int = 0, act_block: int = 0) -> QuantWeight:
    """``w`` [N, K] (any float dtype, any device) as int8 with float32 scales per output
    channel (``group`` 0) or per ``group`` consecutive inputs; ``act_block``: its
    activations' block (0: float activations)."""
    check_blocks(group, act_block)
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 needs a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    if group < 0:
        raise ValueError(f"quantization group must be >= 0 (0 = per channel), got {group}")
    g = k if group == 0 else min(group, k)
    blocks = -(-k // g)
    with torch.no_grad():
        wf = w.detach().float()
        if blocks * g != k:  # zero-pad the last group (zeros change no maximum)
            wf = F.pad(wf, (0, blocks * g - k))
        wf = wf.reshape(n, blocks, g)
        amax = wf.abs().amax(dim=-1)
        scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
        q = torch.round(wf / scale[:, :, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return QuantWeight(q.reshape(n, blocks * g)[:, :k].contiguous(), scale.contiguous(), g,
                       act_block=act_block)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] as int8 a [..., K] and float32 scales s [..., ceil(K / block)], per block
    of ``block`` inputs: s = max|x| / 127 (1 for an all-zero block), a = round(x / s)."""
    k = x.shape[-1]
    nb = -(-k // block)
    xf = F.pad(x.float(), (0, nb * block - k)).reshape(*x.shape[:-1], nb, block)
    amax = xf.abs().amax(dim=-1)
    s = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    a = torch.round(xf / s[..., None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return a.reshape(*x.shape[:-1], nb * block)[..., :k], s


def dequantize_activations(a: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """The float32 values a * s of ``quantize_activations``' output."""
    k = a.shape[-1]
    return (a.float() * s.repeat_interleave(block, dim=-1)[..., :k])


def int8_linear(x: torch.Tensor, w: QuantWeight, bias: Optional[torch.Tensor] = None,
                residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``residual + x' @ dequantize(w).T + bias`` for x [..., K] (the reference path; x'
    is x quantized per block when ``w.act_block`` is set)."""
    if w.act_block:
        x = dequantize_activations(*quantize_activations(x, w.act_block),
                                   w.act_block).to(x.dtype)
    out = F.linear(x, w.dequantize(x.dtype), bias)
    return out if residual is None else residual.reshape(out.shape) + out
