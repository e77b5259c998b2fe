"""Per-token log-probabilities and entropies from vocabulary-parallel logits, computed in
token chunks.

The loss needs, at each response position, log p(target) and (as a metric or an
entropy bonus) the entropy of softmax(logits / T). Done on a whole micro-batch at once
these cost several fp32 [tokens, V/TP] temporaries (a copy of the selected rows, the
fp32 cast, the softmax, the products): at 9K tokens and a 152K vocabulary over TP 2,
about 2.8 GB each. Here one autograd function walks the response positions in chunks of
``chunk_tokens``; only one chunk's fp32 rows exist at a time, in the forward and again
in the backward, which recomputes the chunk's softmax from the saved log-partition
function (n floats) instead of keeping it. The logits themselves are saved by
reference (no copy); the gradient of the logits is written chunk by chunk into one
buffer of their own dtype, the one the output layer's backward needs anyway.

Vocabulary parallelism as megatron-core's ``vocab_parallel_cross_entropy``: each rank
holds columns ``rank * V/TP`` onward; per chunk the row maximum is all-reduced (MAX) and
the partition sums, the target logit and the entropy's sum (SUM) over the TP group.
The backward needs no communication (softmax and its gradient are column-local once the
log-partition function is known). Padding columns (ids >= ``vocab_size``) are excluded.

With z = logits / T, lse = log sum_v exp z_v, p = softmax(z):

    logp = z_target - lse                 d logp / d z_v = [v = target] - p_v
    H    = lse - sum_v p_v z_v            d H / d z_v    = -p_v (z_v - lse + H)
"""

from __future__ import annotations

import torch

from .. import collectives


def _tp():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_rank(),
            ps.get_tensor_model_parallel_world_size())


def _chunk_logits(flat: torch.Tensor, rows: torch.Tensor, temperature: float,
                  first_pad: int) -> torch.Tensor:
    """fp32 z = logits / T of ``rows``, padding columns -inf: one chunk's only copy."""
    z = flat.index_select(0, rows).float()  # a copy: the chunk's own fp32 buffer
    if temperature != 1.0:
        z.div_(temperature)
    if first_pad < z.shape[1]:
        z[:, first_pad:] = float("-inf")
    return z


class _ChunkedTokenStats(torch.autograd.Function):
    """(logp [n], entropy [n]) of ``flat[rows]`` ([N, V/TP] logits), in chunks."""

    @staticmethod
    def forward(ctx, flat, rows, targets, temperature, vocab_size, chunk, entropy_grad):
        group, tp_rank, _ = _tp()
        width = flat.shape[1]
        start = tp_rank * width
        first_pad = min(max(vocab_size - start, 0), width)
        n = rows.numel()
        logp = torch.empty(n, dtype=torch.float32, device=flat.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for c0 in range(0, n, chunk):
            r, t = rows[c0:c0 + chunk], targets[c0:c0 + chunk]
            z = _chunk_logits(flat, r, temperature, first_pad)
            m = z.max(dim=1).values
            collectives.all_reduce(m, op="max", group=group)
            z.sub_(m.unsqueeze(1))                            # z - M, in place
            local = t - start
            mine = (local >= 0) & (local < width)
            zt = z.gather(1, local.clamp(0, width - 1).unsqueeze(1)).squeeze(1)
            zt = torch.where(mine, zt, torch.zeros_like(zt))
            e = torch.exp(z)
            if first_pad < width:                             # 0 * -inf: keep them out
                z[:, first_pad:] = 0.0
            sums = torch.stack([e.sum(dim=1), zt, torch.linalg.vecdot(e, z)])
            del e, z
            collectives.all_reduce(sums, group=group)
            log_s = torch.log(sums[0])
            logp[c0:c0 + chunk] = sums[1] - log_s
            ent[c0:c0 + chunk] = log_s - sums[2] / sums[0]
            lse[c0:c0 + chunk] = m + log_s
        ctx.save_for_backward(flat, rows, targets, lse, ent)
        ctx.temperature, ctx.first_pad, ctx.start = temperature, first_pad, start
        ctx.chunk, ctx.entropy_grad = chunk, entropy_grad
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        flat, rows, targets, lse, ent = ctx.saved_tensors
        T, first_pad, start, chunk = ctx.temperature, ctx.first_pad, ctx.start, ctx.chunk
        width = flat.shape[1]
        grad = torch.zeros_like(flat)
        use_ent = ctx.entropy_grad and g_ent is not None
        for c0 in range(0, rows.numel(), chunk):
            sl = slice(c0, c0 + chunk)
            r, t = rows[sl], targets[sl]
            z = _chunk_logits(flat, r, T, first_pad)
            z.sub_(lse[sl].unsqueeze(1))                      # log p (padding: -inf)
            p = torch.exp(z)
            gl = g_logp[sl] if g_logp is not None else torch.zeros_like(lse[sl])
            if use_ent:                                       # -p (log p + H) g_H
                if first_pad < width:
                    z[:, first_pad:] = 0.0
                z.add_(ent[sl].unsqueeze(1)).mul_(p).mul_(-g_ent[sl].unsqueeze(1))
                z.addcmul_(p, gl.unsqueeze(1), value=-1.0)    # - p g_logp, in place
                del p
                gz = z
            else:
                del z
                gz = p.mul_(-gl.unsqueeze(1))
                del p
            local = t - start
            mine = (local >= 0) & (local < width)
            gz.scatter_add_(1, local.clamp(0, width - 1).unsqueeze(1),
                            torch.where(mine, gl, torch.zeros_like(gl)).unsqueeze(1))
            if T != 1.0:
                gz.div_(T)
            grad.index_copy_(0, r, gz.to(grad.dtype))
            del gz  # before the next chunk's rows exist: one chunk's temporaries at a time
        return grad, None, None, None, None, None, None


def token_stats(local_logits: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, *,
                vocab_size: int, temperature: float = 1.0, chunk_tokens: int = 0,
                entropy_grad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(targets) and the entropy of softmax(logits / ``temperature``), [b, S] fp32,
    at the positions where ``mask`` is set (0 elsewhere).

    ``local_logits`` [b, S, V/TP] is this TP rank's vocabulary slice (differentiable);
    ``chunk_tokens`` bounds the positions per chunk (0: all at once). The log-probs
    carry gradients; the entropy only with ``entropy_grad`` (an entropy bonus), else it
    is a detached metric computed in the same pass.
    """
    b, s, width = local_logits.shape
    flat = local_logits.reshape(b * s, width)  # a view of contiguous logits
    rows = mask.reshape(-1).nonzero().squeeze(1)  # response positions (one host sync)
    tgt = targets.reshape(-1).index_select(0, rows)
    chunk = chunk_tokens if chunk_tokens > 0 else max(rows.numel(), 1)
    logp, ent = _ChunkedTokenStats.apply(flat, rows, tgt, float(temperature),
                                         int(vocab_size), int(chunk), bool(entropy_grad))
    zeros = torch.zeros(b * s, dtype=torch.float32, device=local_logits.device)
    logp = zeros.index_copy(0, rows, logp).view(b, s)
    ent = zeros.index_copy(0, rows, ent).view(b, s)
    return logp, ent

