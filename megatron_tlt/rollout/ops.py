"""Small tensor operations of the incremental forward (``forward.ModelRunner``): the
linear layer at decode-sized row counts and the additive attention mask."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def attention_bias(start: torch.Tensor, t: int, span: int,
                   new_token_mask: Optional[torch.Tensor], dtype: torch.dtype,
                   heads_per_group: int) -> torch.Tensor:
    """Additive mask [B, 1, T (x query heads per group if T > 1), span]: each row's
    cached prefix, then the new tokens causally or as ``new_token_mask`` says. Made
    once per forward (SDPA would convert a bool mask in every layer)."""
    b = start.shape[0]
    ar = torch.arange(t, device=start.device)
    keys = torch.arange(span, device=start.device)
    rel = keys[None, None, :] - start[:, None, None]  # [B, 1, span] key index - start
    if new_token_mask is None:
        allowed = rel <= ar[None, :, None]
    else:
        w = new_token_mask.shape[-1]
        rel = rel + (w - t)  # key index relative to the mask's first slot
        inside = (rel >= 0) & (rel < w)
        m = new_token_mask.expand(b, t, w)
        gathered = torch.gather(m, 2, rel.clamp(0, w - 1).expand(b, t, span))
        allowed = torch.where(inside, gathered, rel < 0)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=start.device)
    bias.masked_fill_(~allowed, float("-inf"))
    return bias[:, None] if t == 1 else bias[:, None].repeat(1, 1, heads_per_group, 1)


# Below this many rows MKL's fp32 GEMM is faster (measured 10-20 % at 8 and 32 rows on
# a 2-core Xeon) with the weight as the left operand: (W @ x^T)^T instead of x @ W^T.
_SMALL_M = 64


def _linear(x: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor] = None,
            residual: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w.T (+ b) (+ residual)`` for x [..., in]; the same math as F.linear."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if 2 <= m <= _SMALL_M and x.device.type == "cpu":
        out = torch.mm(w, x2.t()).t()  # a transposed view: make it row-major once,
        if residual is not None:          # or every later elementwise op runs strided
            out = residual.reshape(m, -1) + out
        else:
            out = out.contiguous()
        if b is not None:
            out = out + b
    elif residual is not None and b is None:
        out = torch.addmm(residual.reshape(m, -1), x2, w.t())
    else:
        out = F.linear(x2, w, b)
        if residual is not None:
            out = residual.reshape(m, -1) + out
    return out.reshape(*lead, out.shape[-1])
