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
    [N, 1])."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int  # inputs per scale (K when per output channel)
    act_block: int = 0  # inputs per activation scale (0: float activations)
    panel: Optional[torch.Tensor] = None  # the CPU kernels' int8 panel copy
    panel_scale: Optional[torch.Tensor] = None  # its scales, panel layout

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized matrix and its scales (not the kernels' panel copy)."""
        return self.q.numel() + self.scale.numel() * self.scale.element_size()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """q * s as a [N, K] matrix of ``dtype``."""
        k = self.q.shape[1]
        s = self.scale.repeat_interleave(self.group, dim=1)[:, :k]
        return (self.q.float() * s).to(dtype)


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
