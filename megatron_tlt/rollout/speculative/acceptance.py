"""Exact acceptance of drafted tokens (TLT.md; pure functions, tested on their own).

Chains accept draft x with probability min(1, p(x)/q(x)) and at the first rejection
sample from norm(max(0, p - q)); trees (deterministic drafts) try a node's children in
draft order, accept child x with probability p'(x) where p' is p with rejected siblings
removed and renormalised, and sample from p' when none is accepted; greedy requests
follow argmax p. One more token (the bonus) is always emitted.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..sampling import argmax_rows, processed_logprobs


def _uniform(gen: Optional[torch.Generator], device) -> float:
    return float(torch.rand((), generator=gen, device=device))


def sample(probs: torch.Tensor, gen: Optional[torch.Generator]) -> int:
    total = probs.sum()
    if not bool(total > 0):
        raise RuntimeError("speculative sampling hit an empty distribution")
    return int(torch.multinomial(probs / total, 1, generator=gen))


def draw(probs: torch.Tensor, gen: Optional[torch.Generator]) -> torch.Tensor:
    """``sample`` kept on the device ([1] long, the same draw from ``gen``) for a
    distribution known to have mass (a processed one keeps its most likely token)."""
    return torch.multinomial(probs / probs.sum(), 1, generator=gen)


def accept_chain(p_logprobs: torch.Tensor, q_logprobs: Optional[torch.Tensor],
                 drafts: Sequence[int], gen: Optional[torch.Generator], *, greedy: bool,
                 kernels=None, best: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """Verify a chain of drafts. p_logprobs [k+1, V] (target, processed), q_logprobs
    [k, V] (drafter's sampling distribution, full vocabulary; unused when greedy).
    Returns (accepted draft count a, next token): the tokens emitted are drafts[:a]
    then the next token. ``kernels``: the fused CPU kernels (greedy argmax); ``best``:
    the argmax of each row of p_logprobs when the caller read them already (greedy)."""
    k = len(drafts)
    if greedy:
        if best is None:
            best = argmax_rows(p_logprobs, kernels).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return a, best[a]
    for i, x in enumerate(drafts):
        px = float(p_logprobs[i, x].exp())
        qx = float(q_logprobs[i, x].exp())
        if _uniform(gen, p_logprobs.device) * qx < px:
            continue
        residual = (p_logprobs[i].exp() - q_logprobs[i].exp()).clamp_min(0.0)
        if not bool(residual.sum() > 0):  # p == q up to rounding: p itself is the residual
            residual = p_logprobs[i].exp()
        return i, sample(residual, gen)
    return k, sample(p_logprobs[k].exp(), gen)


def accept_chain_sampled(p_logprobs: torch.Tensor, q_logprobs: torch.Tensor,
                         drafts: torch.Tensor, gen: Optional[torch.Generator]
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_chain``'s sampled rule on the device, without a host read: p_logprobs
    [k+1, V], q_logprobs [k, V], drafts [k] (long). The k uniforms are drawn at once
    from ``gen`` (then the emitted token, from the same generator), so the row's stream
    is consumed the same way whatever is accepted. Returns (accepted count a, next
    token) as 0-dim long tensors: the tokens emitted are drafts[:a] then the next."""
    k = drafts.shape[0]
    dev = p_logprobs.device
    a = torch.zeros((), dtype=torch.long, device=dev)
    if k:
        ar = torch.arange(k, device=dev)
        px = p_logprobs[ar, drafts].exp()
        qx = q_logprobs[ar, drafts].exp()
        u = torch.rand(k, generator=gen, device=dev)
        a = (u * qx < px).long().cumprod(0).sum()  # drafts accepted before the first no
    pa = p_logprobs.index_select(0, a.view(1))[0].exp()  # p at the first rejection (or k)
    if k:  # a rejection samples from norm(max(0, p - q)), p itself if that has no mass
        qa = q_logprobs.index_select(0, a.clamp(max=k - 1).view(1))[0].exp()
        res = (pa - qa).clamp_min(0.0)
        res = torch.where(res.sum() > 0, res, pa)
        pa = torch.where(a < k, res, pa)
    return a, torch.multinomial(pa / pa.sum(), 1, generator=gen)[0]


def accept_tree(p_logprobs: torch.Tensor, tokens: Sequence[int], children: Sequence[list[int]],
                gen: Optional[torch.Generator], *, greedy: bool,
                best: Optional[Sequence[int]] = None) -> tuple[list[int], int]:
    """Verify a tree of deterministic drafts. Node 0 is the root (the last emitted
    token); p_logprobs [n+1, V] is the target's processed distribution at each node;
    ``tokens[i]`` is node i's token; ``children[i]`` lists node i's children in the
    order they are tried (best draft score first). Returns (accepted node path without
    the root, next token). ``best``: each node's argmax when the caller read them
    already (greedy)."""
    node, path = 0, []
    while True:
        kids = children[node]
        if greedy:
            top = best[node] if best is not None else int(torch.argmax(p_logprobs[node]))
            nxt = next((c for c in kids if tokens[c] == top), None)
            if nxt is None:
                return path, top
            node = nxt
            path.append(node)
            continue
        probs = p_logprobs[node].exp()
        accepted = None
        for c in kids:
            x = tokens[c]
            mass = probs.sum()
            if _uniform(gen, probs.device) * float(mass) < float(probs[x]):
                accepted = c
                break
            probs = probs.clone()
            probs[x] = 0.0
        if accepted is None:
            return path, sample(probs, gen)
        node = accepted
        path.append(node)


def accept_tree_sampled(p_logprobs: torch.Tensor, tokens: torch.Tensor, kids: torch.Tensor,
                        depth: int, gen: Optional[torch.Generator]
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """``accept_tree``'s sampled rule on the device, without a host read: p_logprobs
    [n+1, V] at each node, ``tokens`` [n+1] the nodes' tokens, ``kids`` [n+1, K] each
    node's children in trial order (-1 padding), ``depth`` the tree's depth. One uniform
    per node is drawn at once from ``gen`` (each is used at most once, by the trial of
    its node), then the emitted token, so the row's stream is consumed the same way
    whatever is accepted. Returns the accepted path [depth] (node ids, -1 padding) and
    the next token (0-dim long)."""
    dev = p_logprobs.device
    n1, width = kids.shape
    u = torch.rand(n1, generator=gen, device=dev)
    cur = torch.zeros((), dtype=torch.long, device=dev)
    going = torch.ones((), dtype=torch.bool, device=dev)
    final = p_logprobs[0].exp()
    path = []
    earlier = torch.ones(width, width, dtype=torch.bool, device=dev).tril(-1)
    for _ in range(depth + 1):
        k = kids.index_select(0, cur.view(1))[0]  # [K] the current node's children
        valid = k >= 0
        kc = k.clamp_min(0)
        x = tokens.index_select(0, kc)
        probs = p_logprobs.index_select(0, cur.view(1))[0].exp()
        px = torch.where(valid, probs.index_select(0, x), 0.0)
        # a token tried before among the siblings has probability 0 now
        seen = ((x[:, None] == x[None, :]) & earlier & valid[None, :]).any(dim=1)
        px = torch.where(seen, 0.0, px)
        mass = probs.sum() - (px.cumsum(0) - px)  # rejected siblings removed
        ok = valid & (u.index_select(0, kc) * mass < px)
        hit = ok.any()
        first = kc.gather(0, ok.long().argmax().view(1))[0]  # the first accepted child
        # where the walk ends here: p with every tried child removed (a padding entry
        # keeps its token: the smallest factor wins where a child shares it)
        keep = torch.ones_like(probs).scatter_reduce(
            0, x, torch.where(valid, 0.0, 1.0).to(probs.dtype), reduce="amin")
        final = torch.where(going & ~hit, probs * keep, final)
        step = going & hit
        path.append(torch.where(step, first, -1))
        cur = torch.where(step, first, cur)
        going = step
    nxt = torch.multinomial(final / final.sum(), 1, generator=gen)[0]
    return torch.stack(path[:depth]), nxt


def processed_rows(logits: torch.Tensor, rows: Sequence) -> torch.Tensor:
    """``processed_logprobs`` of logits [B, ..., V] with row i's sampling settings, one
    call per distinct setting; greedy rows get their raw float32 logits (argmax only)."""
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault(None if r.params.greedy else r.params.processing_key(), []).append(i)
    if len(groups) == 1:  # one setting for the whole batch (the usual case): no gathers
        key = next(iter(groups))
        return logits.float() if key is None else processed_logprobs(logits, *key)
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    for key, idx in groups.items():
        index = torch.tensor(idx, device=logits.device)
        part = logits.index_select(0, index)
        out[index] = part.float() if key is None else processed_logprobs(part, *key)
    return out

