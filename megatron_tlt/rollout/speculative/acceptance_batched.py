"""Standard sampling's exact acceptance, batched over rows: device tensors in, device
tensors out, no host read and a fixed number of operations whatever the batch size
(chains: none per depth; trees: one round per tree level), so the step can be
captured in a CUDA graph per (strategy, batch bucket).

The rules are ``acceptance.py``'s (TLT.md):

- chains: draft x_j is accepted with probability min(1, p_j(x_j) / q_j(x_j)) (the test
  U < p/q taken as E > log q - log p with E = -log U, an Exp(1) draw: no overflow or
  underflow of the ratio); the run stops at the first rejection (a cumulative product),
  and the next token is drawn from norm(max(0, p_a - q_a)) there (p_a itself when that
  has no mass: p = q up to rounding), or from p_k (the bonus) when every draft was
  accepted;
- trees (deterministic drafts): at each node its children are tried in draft order,
  child x accepted with probability p'(x) = p(x) / (mass left), p' being p with the
  rejected siblings removed; the walk descends into the first accepted child, and
  where none is, the next token is drawn from p'.

Draws are Gumbel-max (argmax(log w + g) is a draw from norm(w)) and exponential tests
on the rows' streams (``sampling.stream_salts``): ``STREAM_ACCEPT`` at slot j (chain
depth j, or tree node id: a node is tried at most once) and ``STREAM_FINAL`` for the
last token, both at the step's t0 (``step_noise``).
"""

from __future__ import annotations

import torch

from ..sampling import (STREAM_ACCEPT, STREAM_FINAL, argmax_rows, stream_exponential,
                        stream_gumbel, stream_salts)

_NEG_INF = float("-inf")


def step_noise(keys: torch.Tensor, t0: torch.Tensor, slots: int, vocab: int,
               kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """A speculative step's acceptance randomness for rows with stream keys ``keys``
    [B] at response positions ``t0`` [B]: Exp(1) draws [B, slots] (``STREAM_ACCEPT``)
    and a Gumbel row [B, vocab] for the last token (``STREAM_FINAL``)."""
    tags = torch.tensor([STREAM_ACCEPT, STREAM_FINAL], dtype=torch.int64, device=keys.device)
    salt = stream_salts(keys, t0, tags)  # [B, 2]
    return (stream_exponential(salt[:, 0], slots),
            stream_gumbel(salt[:, 1].contiguous(), vocab, kernels))


def _at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[b, idx[b]] of x [B, N, V] and idx [B]: [B, V]."""
    return x.gather(1, idx[:, None, None].expand(x.shape[0], 1, x.shape[2]))[:, 0]


def accept_chains(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor,
                  counts: torch.Tensor, e: torch.Tensor, g: torch.Tensor,
                  kernels=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Chains of every row at once. p [B, K+1, V]: the target's processed log-probs at
    each node (row b's valid nodes 0..counts[b]); q [B, K, V]: the drafter's sampling
    distributions (full vocabulary); drafts [B, K] long; counts [B]: drafts per row
    (<= K; the rest is padding, never accepted); e [B, >=K] Exp(1) draws; g [B, V]
    Gumbel noise. Returns (accepted count a [B], next token [B]): row b emits
    drafts[b, :a] then the next token."""
    b, k = drafts.shape
    dev = p.device
    if k:
        lp = p[:, :k].gather(2, drafts[..., None])[..., 0]
        lq = q[:, :k].gather(2, drafts[..., None])[..., 0]
        ok = (e[:, :k] > lq - lp) & (torch.arange(k, device=dev)[None, :] < counts[:, None])
        a = ok.long().cumprod(1).sum(1)  # drafts accepted before the first rejection
    else:
        a = torch.zeros(b, dtype=torch.long, device=dev)
    pa = _at(p, a)  # log p at the first rejection, or the bonus node
    final = pa
    if k:
        qa = _at(q[:, :k], a.clamp(max=k - 1))
        res = (pa.exp() - qa.exp()).clamp_min(0.0)
        log_res = torch.where((res > 0).any(1, keepdim=True), res.log(), pa)
        final = torch.where((a < counts)[:, None], log_res, pa)
    return a, argmax_rows((final + g).contiguous(), kernels)


def chain_emits(drafts: torch.Tensor, a: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """The token each chain node emits, [B, K+1]: drafts[j] below a, the next token at
    a (later nodes: unused)."""
    tok = torch.cat([drafts, drafts.new_zeros(drafts.shape[0], 1)], 1)
    return tok.scatter(1, a[:, None], nxt[:, None])


def accept_trees(p: torch.Tensor, tokens: torch.Tensor, kids: torch.Tensor, depth: int,
                 e: torch.Tensor, g: torch.Tensor, kernels=None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Trees of every row at once, one round per level. p [B, N, V]: the target's
    processed log-probs at each node (node 0 the root); tokens [B, N] the nodes'
    tokens; kids [B, N, W] each node's children in trial order (-1 padding); ``depth``
    the deepest path (a host integer); e [B, N] Exp(1) draws (one per node, used by its
    own trial); g [B, V] Gumbel noise. Returns the accepted path [B, depth] (node ids,
    -1 padding) and the next token [B]."""
    b, n, w = kids.shape
    dev = p.device
    cur = torch.zeros(b, dtype=torch.long, device=dev)
    going = torch.ones(b, dtype=torch.bool, device=dev)
    final = end_p = p[:, 0]
    earlier = torch.ones(w, w, dtype=torch.bool, device=dev).tril(-1)
    path = []
    for _ in range(depth + 1):
        k = kids.gather(1, cur[:, None, None].expand(b, 1, w))[:, 0]  # [B, W] children
        valid = k >= 0
        kc = k.clamp_min(0)
        x = tokens.gather(1, kc)
        lp = _at(p, cur)
        probs = lp.exp()
        px = torch.where(valid, probs.gather(1, x), 0.0)
        # a token tried before among the siblings has probability 0 now
        seen = ((x[:, :, None] == x[:, None, :]) & earlier & valid[:, None, :]).any(2)
        px = torch.where(seen, 0.0, px)
        # the mass left when child j is tried (rejected siblings removed); never below
        # p(x) (rounding): the test U < p(x) / mass as E > log mass - log p(x)
        mass = torch.maximum(probs.sum(1, keepdim=True) - (px.cumsum(1) - px), px)
        ok = valid & (e.gather(1, kc) > mass.log() - px.log())
        hit = ok.any(1)
        first = kc.gather(1, ok.long().argmax(1, keepdim=True))[:, 0]  # first accepted
        # where the walk ends here: p with every tried child's token removed (a
        # padding entry keeps its token: the smallest value wins where one shares it)
        removed = torch.zeros_like(lp).scatter_reduce(
            1, x, torch.where(valid, _NEG_INF, 0.0).to(lp.dtype), reduce="amin")
        end = (going & ~hit)[:, None]
        final = torch.where(end, lp + removed, final)
        end_p = torch.where(end, lp, end_p)
        step = going & hit
        path.append(torch.where(step, first, -1))
        cur = torch.where(step, first, cur)
        going = step
    # every token of the node tried and rejected (possible only through rounding): p
    final = torch.where((final > _NEG_INF).any(1, keepdim=True), final, end_p)
    nxt = argmax_rows((final + g).contiguous(), kernels)
    return torch.stack(path[:depth], 1), nxt


def tree_emits(tokens: torch.Tensor, path: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """The token each tree node emits, [B, N]: along the accepted path its accepted
    child's token, at the path's last node the next token (elsewhere: unused)."""
    b, n = tokens.shape
    seq = torch.cat([path.new_zeros(b, 1), path], 1)  # the root, then accepted nodes
    child = seq[:, 1:]
    emit = tokens.new_zeros(b, n + 1)  # column n takes the writes of unused depths
    emit = emit.scatter(1, torch.where(child >= 0, seq[:, :-1], n),
                        tokens.gather(1, child.clamp_min(0)))
    last = seq.gather(1, (child >= 0).sum(1, keepdim=True))  # the path's last node
    return emit.scatter(1, last, nxt[:, None])[:, :n]
