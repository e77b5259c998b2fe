"""Model-free drafter kinds: drafts proposed from a row's own tokens (n-gram or suffix
lookups, the group's sibling responses), no model and no cache.

A kind subclasses ``ModelFreeDrafter`` and defines ``propose(tokens, depth)`` (or
``candidates``: several continuations); its decoder (``ModelFreeDecoder``) proposes a
chain (the most frequent continuation) or, under a tree strategy, the tree of the
distinct continuations, and the one verifier (``SpeculativeDecoder.step``) verifies
them as every kind's drafts: trees' candidates are tried in order against the
residual distribution (standard rows), coupled rows accept the child equal to the
target's coupled token. A proposal is deterministic, so
the drafter's distribution q is one-hot on it: exact rejection sampling accepts a
draft x with probability p~(x) and resamples from p~ without x, and coupled and greedy
rows accept while the draft equals the target's own token. Proposing runs on the host,
once per row and step (what an n-gram lookup is); the verification stays batched.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..forward import ModelRunner
from .decoder import SpeculativeDecoder
from .drafter_kind import Drafter
from . import suffix_index
from .draft_tree import ancestor_mask
from .drafting import DraftTree, is_standard
from .proposer import Proposal
from .stats import SpecStats

# a single lookup's arms: chains, shallow (a lookup's later tokens are less likely to
# hold); kinds with several candidates add trees (``arms``)
CHAIN_ARMS = "*:0_0_0,2_1_2,3_1_3,4_1_4"
TREE_ARMS = "*:0_0_0,2_1_2,4_1_4,6_1_6,4_2_6,6_3_12"


class ModelFreeDrafter(Drafter):
    """A kind whose drafts are a function of the rows' tokens."""

    fed = "tokens"
    free = True

    def propose(self, tokens: Sequence[int], depth: int) -> list[int]:
        """Up to ``depth`` draft tokens to follow ``tokens`` (prompt and response so
        far); fewer (or none) where the kind has nothing to propose."""
        raise NotImplementedError

    def candidates(self, tokens: Sequence[int], depth: int) -> list[list[int]]:
        """Continuations of ``tokens`` worth verifying (each up to ``depth`` tokens,
        best first): a chain proposes the most frequent, a tree their distinct
        branches. Default: the one ``propose`` gives."""
        d = list(self.propose(tokens, depth))[:depth]
        return [d] if d else []

    def lookup(self, row, depth: int) -> list[list[int]]:
        """Row ``row``'s candidates (``.prompt``, ``.tokens``): ``candidates`` of its
        prompt and response so far."""
        return self.candidates(row.prompt + row.tokens, depth)

    def make_decoder(self, target: ModelRunner) -> "ModelFreeDecoder":
        return ModelFreeDecoder(self, target)

    @classmethod
    def tuner_config(cls, sc):
        import dataclasses

        return dataclasses.replace(sc, arms=cls.arms)

    arms = CHAIN_ARMS  # its tuner's arms (``tuner_config``)


class ModelFreeDecoder(SpeculativeDecoder):
    """The proposer of a model-free kind: each row's candidates (``lookup``) on the
    host, proposed as a chain (the most frequent) or a tree of their distinct
    continuations; no drafter cache, feature store or catch-up (the proposer's
    stateless defaults)."""

    def observe(self, rows: Sequence) -> None:
        """Before the step's lookups: what the running rows decoded since the last
        step (a kind whose lookups read other rows indexes it here)."""

    def lookup(self, i: int, row, depth: int) -> list[list[int]]:
        """Cache row ``i``'s candidate continuations (``drafter.lookup``)."""
        return self.drafter.lookup(row, depth)

    def row_proposals(self, rows: Sequence, strategy: Strategy) -> list:
        """Per row, its chain (a list, maybe empty) for a chain strategy, or its tree
        ((tokens, parents), None when nothing matched) for a tree strategy."""
        self.observe(rows)
        conts = [self.lookup(i, r, strategy.depth) for i, r in enumerate(rows)]
        if strategy.is_chain:
            return [suffix_index.chain(c, strategy.depth) if c else [] for c in conts]
        return [suffix_index.tree_from(c, strategy.depth, strategy.top_k,
                                       strategy.verify_tokens + 1) for c in conts]

    def propose(self, rows: Sequence, strategy: Strategy, stats: SpecStats,
                target_cache=None) -> Proposal:
        """Each row's proposal: for chains with q one-hot on it [B, depth', V] when a
        row samples under standard sampling; trees as a ``DraftTree``."""
        props = self.row_proposals(rows, strategy)
        if strategy.is_chain:
            return Proposal(props, one_hot_q(self.target, rows, props))
        if not any(props):  # nothing to propose: the root alone, verified as a chain
            drafts: list[list[int]] = [[] for _ in rows]
            return Proposal(drafts, one_hot_q(self.target, rows, drafts))
        return Proposal(tree=host_trees(self.target.device, rows, props))


def host_trees(device, rows: Sequence, trees: Sequence) -> DraftTree:
    """Rows' candidate trees ((tokens, parents[, children]) per row, node 0 the root;
    None: the root alone) as one ``DraftTree`` of a common node count: a row's unused slots are
    padding nodes that attend to the root and themselves and are no node's children,
    so they are verified but never tried."""
    n = max(len(t[0]) if t else 1 for t in trees)
    toks, kids, depths, masks = [], [], [], []
    for r, t in zip(rows, trees):
        tok, par = t[:2] if t else ([-1], [-1])
        tok = [r.tokens[-1]] + list(tok[1:])
        par = list(par)
        pad = n - len(tok)
        tok += [r.tokens[-1]] * pad  # (any token: never tried)
        par += [0] * pad
        if t is not None and len(t) > 2:  # its own children's order
            children = [list(c) for c in t[2]] + [[] for _ in range(pad)]
        else:
            children = [[] for _ in range(n)]
            for j in range(1, n - pad):
                children[par[j]].append(j)
        depth = [0] * n
        for j in range(1, n):
            depth[j] = depth[par[j]] + 1
        toks.append(tok)
        kids.append(children)
        depths.append(depth)
        masks.append(ancestor_mask(par))
    return DraftTree(torch.tensor(toks, dtype=torch.long, device=device),
                     torch.tensor(masks, dtype=torch.bool, device=device),
                     torch.tensor(depths, dtype=torch.long, device=device),
                     toks, kids, depths)


def one_hot_q(target, rows: Sequence, drafts: list[list[int]]) -> Optional[torch.Tensor]:
    """Deterministic chains' q [B, depth', V] (one-hot on each draft, -inf elsewhere)
    when a row samples under standard sampling, else None."""
    if not any(is_standard(r) for r in rows):
        return None
    width = max((len(d) for d in drafts), default=0)
    vocab, dev = target.arch.vocab_size, target.device
    q_lp = torch.full((len(rows), width, vocab), float("-inf"), device=dev)
    at = [(i, j, t) for i, d in enumerate(drafts) for j, t in enumerate(d)]
    if at:
        i, j, t = torch.tensor(at, dtype=torch.long, device=dev).unbind(1)
        q_lp[i, j, t] = 0.0
    return q_lp
