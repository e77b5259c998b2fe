"""From a speculative step's verification to each row's emission: greedily verified
rows (greedy and coupled: every node's argmax, an accepted draft being equal to it)
and standard rows (exact rejection sampling, all rows at once on their random streams,
``acceptance_batched``), each with the emitted tokens' log-probs as its request asks,
with one host read for the whole step (``SpeculativeDecoder.step`` calls
``accept_rows``)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..sampling import argmax_rows, requested_logprobs
from .acceptance import accept_chain, accept_tree
from .acceptance_batched import accept_chains, accept_trees, chain_emits, step_noise, tree_emits
from .drafting import DraftTree, is_standard


@dataclass
class Emission:
    """What one speculative step produced for one row (before stop/length cuts)."""

    tokens: list[int]  # accepted drafts, then the next token
    nodes: list[int]  # verify-forward index (= cache slot offset from L) of the node
    # that produced each token; nodes[1:] are the accepted draft nodes
    # each token's log-probability as the request asks for it, when the step read them
    # with its acceptance (greedily verified rows); None: the commit computes them
    logprobs: Optional[list[float]] = None


@dataclass
class Verified:
    """A speculative step's verification forward over every row's nodes, the rows one
    after another (row i's nodes at ``offsets[i]`` .. ``offsets[i] + counts[i] - 1``):
    the target's final hidden states [N, H], its float32 logits [N, V] and the
    processed log-probs the acceptance used [N, V] (greedy rows: the logits). The
    hidden states may be a graph's static output: valid until its next replay."""

    hidden: torch.Tensor
    logits: torch.Tensor
    plp: torch.Tensor
    counts: list[int]  # nodes per row (host ints)

    @property
    def offsets(self) -> list[int]:
        out, off = [], 0
        for c in self.counts:
            out.append(off)
            off += c
        return out


def accept_rows(target, rows, scores: list, logits: list, plp: list, drafts, q_lp,
            tree: Optional[DraftTree], flat, strategy: Optional[Strategy] = None
            ) -> list[Emission]:
    """Every row's emission, with one host read: greedily verified rows (greedy and
    coupled: every node's argmax, the token such a row emits at that node, an
    accepted draft being equal to it) and standard rows (``_accept_standard``, all
    at once), each with the emitted tokens' log-probs as its request asks
    (``requested_logprobs``), so the commit reads nothing more. ``flat``: the
    verification's logits and processed log-probs [nodes of every row, V] and the
    node counts per row; ``strategy``: the step's (a tree's depth and width)."""
    k = target.kernels
    standard = [i for i, r in enumerate(rows) if is_standard(r)]
    parts = []
    for i, r in enumerate(rows):
        if is_standard(r):
            continue
        sp = r.params
        tok = argmax_rows(scores[i], k)
        x = logits[i].float()
        # the same formulas as plain decoding's (``sampling.choose_tokens``)
        if sp.greedy:
            raw = processed = x.gather(-1, tok[:, None])[:, 0] - torch.logsumexp(x, -1)
        else:
            raw = torch.log_softmax(x, dim=-1).gather(-1, tok[:, None])[:, 0]
            processed = plp[i].gather(-1, tok[:, None])[:, 0]
        lp = requested_logprobs(x, tok, [sp] * x.shape[0], raw, processed)
        parts.append(torch.cat([tok.double(), lp.double()]))
    width = extra = 0
    if standard:
        block, width, extra = _accept_standard(target, rows, standard, *flat, drafts, q_lp,
                                               tree, strategy)
        parts.append(block)
    flat_l = torch.cat(parts).tolist() if parts else []  # the step's acceptance read
    out: list = [None] * len(rows)
    off = 0
    for i, r in enumerate(rows):
        if is_standard(r):
            continue
        n = scores[i].shape[0]
        best = [int(t) for t in flat_l[off: off + n]]
        lps = flat_l[off + n: off + 2 * n]
        off += 2 * n
        if tree is None:
            a, nxt = accept_chain(scores[i], None, drafts[i], None, greedy=True,
                                  best=best)
            toks, nodes = list(drafts[i][:a]) + [nxt], list(range(a + 1))
        else:
            path, nxt = accept_tree(scores[i], tree.tokens[i], tree.children[i], None,
                                    greedy=True, best=best)
            toks, nodes = [tree.tokens[i][c] for c in path] + [nxt], [0] + path
        out[i] = Emission(toks, nodes, [lps[j] for j in nodes])
    for i in standard:  # per row: node tokens, their log-probs, then a or the path
        row = flat_l[off: off + 2 * width + extra]
        off += 2 * width + extra
        emit = [int(t) for t in row[:width]]
        lps = row[width: 2 * width]
        if tree is None:
            a = int(row[2 * width])
            toks, nodes = list(drafts[i][:a]) + [emit[a]], list(range(a + 1))
        else:  # emit: the token each node emits
            nodes = [0] + [int(c) for c in row[2 * width:] if c >= 0]
            toks = [emit[m] for m in nodes]
        out[i] = Emission(toks, nodes, [lps[j] for j in nodes])
    return out

def _accept_standard(target, rows, idx: list[int], logits: torch.Tensor, plp: torch.Tensor,
                 counts: Sequence[int], drafts, q_lp, tree: Optional[DraftTree],
                 strategy: Optional[Strategy]) -> tuple[torch.Tensor, int, int]:
    """Standard rows ``idx`` accepted at once (``acceptance_batched``) on their
    streams at the step's t0. Returns the flat block [per row: the token each of
    its N nodes emits, their log-probs, then the accepted count (chains) or the
    path (trees, D entries, D the strategy's depth: fixed shapes and a fixed number
    of rounds whatever the trees drawn)], N and the entries after the log-probs
    (1 or D)."""
    dev = target.device
    s, vocab = len(idx), plp.shape[-1]
    n = max(counts[i] for i in idx)
    if s == len(rows) and all(c == n for c in counts):  # the usual case: no gather
        pl, lg = plp.view(s, n, vocab), logits.view(s, n, vocab)
    else:  # rows' nodes padded to n (a padding node repeats the row's last)
        first = [0, *itertools.accumulate(counts)]
        at = torch.tensor([first[i] + min(j, counts[i] - 1) for i in idx for j in range(n)],
                          dtype=torch.long, device=dev)
        pl = plp.index_select(0, at).view(s, n, vocab)
        lg = logits.index_select(0, at).view(s, n, vocab)
    kt = torch.tensor([[rows[i].stream, len(rows[i].tokens)] for i in idx],
                      dtype=torch.int64, device=dev)
    e, g = step_noise(kt[:, 0], kt[:, 1], n, vocab, target.kernels)
    if tree is None:
        d = torch.tensor([list(drafts[i]) + [0] * (n - 1 - len(drafts[i])) for i in idx],
                         dtype=torch.long, device=dev).view(s, n - 1)
        q = q_lp if s == len(rows) else q_lp.index_select(
            0, torch.tensor(idx, device=dev))
        got = torch.tensor([counts[i] - 1 for i in idx], dtype=torch.long, device=dev)
        a, nxt = accept_chains(pl, q, d, got, e, g, target.kernels)
        tok, extra = chain_emits(d, a, nxt), a[:, None]
    else:
        width = max([1, strategy.top_k if strategy is not None else 1]
                    + [len(c) for i in idx for c in tree.children[i]])
        kids = torch.tensor([[c + [-1] * (width - len(c)) for c in tree.children[i]]
                             for i in idx], dtype=torch.long, device=dev)
        node_tok = tree.verify_tokens if s == len(rows) else \
            tree.verify_tokens.index_select(0, torch.tensor(idx, device=dev))
        depth = max([strategy.depth if strategy is not None else 0]
                    + [max(tree.depths[i]) for i in idx])
        extra, nxt = accept_trees(pl, node_tok, kids, depth, e, g, target.kernels)
        tok = tree_emits(node_tok, extra, nxt)
    x = lg.reshape(s * n, vocab).float()
    t = tok.reshape(-1)
    raw = torch.log_softmax(x, dim=-1).gather(-1, t[:, None])[:, 0]
    processed = pl.reshape(s * n, vocab).gather(-1, t[:, None])[:, 0]
    lp = requested_logprobs(x, t, [rows[i].params for i in idx for _ in range(n)],
                            raw, processed).view(s, n)
    block = torch.cat([tok.double(), lp.double(), extra.double()], 1)
    return block.reshape(-1), n, extra.shape[1]
