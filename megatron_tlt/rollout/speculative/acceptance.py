"""Exact acceptance of drafted tokens (TLT.md; pure functions, tested on their own).

Chains accept draft x with probability min(1, p(x)/q(x)) and at the first rejection
sample from norm(max(0, p - q)); trees (deterministic drafts) try a node's children in
draft order, accept child x with probability p'(x) where p' is p with rejected siblings
removed and renormalised, and sample from p' when none is accepted; greedy requests
follow argmax p. One more token (the bonus) is always emitted.

Here the rules for one row on the host: greedy rows' acceptance in the step, and the
sampled rules with a ``torch.Generator``, the readable reference that the batched
device rules the step uses for standard rows (``acceptance_batched.py``, on the rows'
counter-based streams) are tested against.
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

