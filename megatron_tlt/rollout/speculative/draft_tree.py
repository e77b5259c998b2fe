"""Draft trees (EAGLE-2 style): the pool of drafted nodes grown depth by depth, the
choice of the nodes verification sees, and each row's tree layout.

A node's path score is its parent's plus its own draft score (the draft log-probability,
or in coupled rows the Gumbel-perturbed one). Nodes are chosen by a selection key that
cannot exceed the parent's: key = min(parent's key, own path score), ties going to the
shallower node, then to the earlier one in pool order (parents come before their
children). In that order a parent always precedes its children, so the best n nodes
contain every chosen node's parent by construction, for any scores: positive
increments, equal scores, -inf (tokens removed by top-k / top-p) and NaN (counted as
-inf). Where path scores already fall with depth (log-probabilities are <= 0) the key is
the path score itself. No key is ever formed by subtracting scores, so -inf never meets
-inf in a difference.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

NEG_INF = float("-inf")


def _finite_or_neg_inf(x: torch.Tensor) -> torch.Tensor:
    """``x`` with NaN replaced by -inf (a NaN score ranks last, never first)."""
    return torch.where(torch.isnan(x), torch.full_like(x, NEG_INF), x)


def selection_order(key: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """Per row, the indices of ``key`` [B, N] sorted by key descending, then depth
    ascending, then index ascending (two stable sorts; exact for equal keys and -inf)."""
    by_depth = torch.sort(depth, dim=-1, stable=True).indices
    by_key = torch.sort(key.gather(1, by_depth), dim=-1, descending=True, stable=True).indices
    return by_depth.gather(1, by_key)


def coupled_child_scores(processed: torch.Tensor, lp: Optional[torch.Tensor], noise
                         ) -> torch.Tensor:
    """Tree drafting's draft scores: coupled rows' processed draft log-probabilities plus
    their noise, shifted so each row's (or node's) best is 0 (the drafter's coupled
    token, the one chain drafting would draft, comes first); other rows keep ``lp``
    (None when every row is coupled).
    ``processed`` / ``lp`` [B, V] or [B, K, V]; ``noise`` is (noise [B, V], coupled-row
    mask [B]). Tokens top-k / top-p removed score -inf (a row keeps at least one finite
    token, so the shift never forms -inf - -inf)."""
    g, mask = noise
    extra = (None,) * (processed.dim() - 2)
    x = processed.float() + g[(slice(None),) + extra]
    x = x - x.max(dim=-1, keepdim=True).values
    return x if lp is None else torch.where(mask[(slice(None),) + extra + (None,)], x, lp)


class TreePool:
    """Every node drafted for a batch of rows, in pool order: the ``k`` depth-1
    candidates, then ``k * k`` children per further depth (the top ``k`` children of each
    of the ``k`` frontier nodes). Each depth's frontier, the nodes expanded next, is its
    ``k`` best nodes by selection key."""

    def __init__(self, root_scores: torch.Tensor, k: int):
        """``root_scores`` [B, V]: draft scores of the first drafted token."""
        score, tok = _finite_or_neg_inf(root_scores.float()).topk(k, dim=-1)
        self.k = k
        self.tok, self.score, self.key = [tok], [score], [score]
        self.par = [torch.full_like(tok, -1)]
        self.depth = [torch.ones_like(tok)]
        self.size = k
        self.front = torch.arange(k, device=tok.device).expand_as(tok)  # pool indices
        self.front_tok, self.front_score, self.front_key = tok, score, score

    def grow(self, child_scores: torch.Tensor) -> torch.Tensor:
        """Add the top ``k`` children of each frontier node, scored ``child_scores``
        [B, K, V] (the frontier nodes' next-token draft scores), and make the ``k`` best
        of them the frontier. Returns the new frontier's indices among the ``K * K``
        children [B, K] (``// K`` is the parent's frontier slot)."""
        k = self.k
        b = child_scores.shape[0]
        c_score, c_tok = _finite_or_neg_inf(child_scores.float()).topk(k, dim=-1)
        score = (self.front_score[:, :, None] + c_score).reshape(b, k * k)
        key = torch.minimum(self.front_key[:, :, None].expand(b, k, k).reshape(b, k * k),
                            score)
        tok = c_tok.reshape(b, k * k)
        depth = self.depth[-1][:, :1].expand(b, k * k) + 1
        self.tok.append(tok)
        self.score.append(score)
        self.key.append(key)
        self.par.append(self.front[:, :, None].expand(b, k, k).reshape(b, k * k))
        self.depth.append(depth)
        best = selection_order(key, depth)[:, :k]
        self.front = self.size + best
        self.front_tok = tok.gather(1, best)
        self.front_score = score.gather(1, best)
        self.front_key = key.gather(1, best)
        self.size += k * k
        return best

    def select(self, n: int):
        """The ``n`` best nodes of each row (all of them when the pool is smaller), in
        pool order. Returns pool tokens, parents, depths and path scores [B, size], and
        the chosen pool indices [B, min(n, size)]."""
        tok, par, depth = (torch.cat(x, 1) for x in (self.tok, self.par, self.depth))
        score, key = torch.cat(self.score, 1), torch.cat(self.key, 1)
        order = selection_order(key, depth)[:, :min(n, self.size)]
        return tok, par, depth, score, torch.sort(order, dim=-1).values


class TreeNotClosed(ValueError):
    """A chosen node's parent was not chosen (a broken selection invariant)."""


def row_layout(par: Sequence[int], chosen: Sequence[int], score: Sequence[float]
               ) -> tuple[list[int], list[list[int]]]:
    """One row's tree over nodes 0 (the root: the last emitted token) and 1..n (node j
    is pool node ``chosen[j - 1]``): each node's parent node (-1 for the root) and each
    node's children, best own score first (ties in pool order). Raises
    ``TreeNotClosed`` naming the first chosen node whose parent was not chosen."""
    where = {p: j + 1 for j, p in enumerate(chosen)}
    node_par = [-1]
    for p in chosen:
        q = par[p]
        if q >= 0 and q not in where:
            raise TreeNotClosed(f"pool node {p} was chosen without its parent {q}")
        node_par.append(where[q] if q >= 0 else 0)
    kids: list[list[int]] = [[] for _ in node_par]
    for j in range(1, len(node_par)):
        kids[node_par[j]].append(j)
    rank = [NEG_INF] + [NEG_INF if math.isnan(score[p]) else score[p] for p in chosen]
    for kl in kids:
        kl.sort(key=lambda j: -rank[j])  # stable: equal scores keep pool order
    return node_par, kids


def ancestor_mask(node_par: Sequence[int]) -> list[list[bool]]:
    """mask[j][a]: node a is node j or one of its ancestors (the verify forward's
    attention mask among the tree's nodes)."""
    n = len(node_par)
    mask = [[False] * n for _ in range(n)]
    for j in range(n):
        a = j
        while a >= 0:
            mask[j][a] = True
            a = node_par[a]
    return mask
