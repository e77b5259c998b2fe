"""Drafting: the draft tokens a speculative step sends to verification, from the root
outputs of the drafter's catch-up (its hidden state ĥ and draft logits per row).

- a chain of ``depth`` tokens (sampled from the processed q when the request samples,
  argmax when greedy), optionally stopped early below ``min_draft_prob``;
- the fused chain: catch-up and a greedy chain in one call of the fused CPU kernels;
- an EAGLE-2 tree: top-k children per node, the top-k nodes of each depth by
  cumulative draft log-probability expanded, and the ``verify_tokens`` best nodes of
  the whole tree kept, a selection closed under parents by construction
  (``rollout/speculative/draft_tree.py``), handed to verification as a ``DraftTree``.

Coupled rows (a noise ``key``) draft argmax(log q~ + g_t) with the target's noise at
their response position; trees rank children by their perturbed processed score, so
the drafter's own coupled token is always the first child. Standard rows (a stream
key) draw chain drafts from q~ by Gumbel-max on their streams, all rows at once
(``STREAM_DRAFT + j`` at the step's t0 for depth j, over the draft vocabulary); trees
draw nothing (deterministic drafts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from .draft_tree import (TreeNotClosed, TreePool, ancestor_mask, coupled_child_scores,
                          row_layout)
from ..forward import ModelRunner
from ..kv_cache import KVCache
from ..sampling import (STREAM_DRAFT, CoupledNoise, argmax_rows, coupled_gumbel,
                        stream_gumbel, stream_salts_of)
from .acceptance import processed_rows
from .draft_runner import DraftRunner


def is_coupled(r) -> bool:
    """Whether row ``r`` samples under coupled sampling (it has a noise key)."""
    return getattr(r, "key", None) is not None and not r.params.greedy


def is_standard(r) -> bool:
    """Whether row ``r`` samples under standard sampling (neither greedy nor coupled)."""
    return not r.params.greedy and not is_coupled(r)


def ragged(counts: Sequence[int], starts: Sequence[int], device):
    """Cache row and position of every query of runs of ``counts`` positions starting at
    ``starts`` (the layout of ``extend_chains``)."""
    row_of = torch.tensor([i for i, c in enumerate(counts) for _ in range(c)],
                          dtype=torch.long, device=device)
    pos = torch.tensor([s + j for s, c in zip(starts, counts) for j in range(c)],
                       dtype=torch.long, device=device)
    return row_of, pos


@dataclass
class DraftTree:
    """A batch's draft trees as verification takes them: per row node 0 (the root,
    the last emitted token) and n drafted nodes."""

    verify_tokens: torch.Tensor  # [B, 1+n] node tokens (target vocabulary)
    mask: torch.Tensor  # [B, 1+n, 1+n] node j attends node a (a is j or its ancestor)
    depth: torch.Tensor  # [B, 1+n] node depths (the root 0)
    tokens: list[list[int]]  # per row, node tokens
    children: list[list[list[int]]]  # per row and node, its children, best draft first
    depths: list[list[int]]  # per row, node depths (``depth`` on the host)


class Drafting:
    """Chain, fused-chain and tree drafting with ``draft`` (the drafter's runner) for
    ``target``'s rows, in the drafter's KV cache ``cache``."""

    def __init__(self, draft: DraftRunner, target: ModelRunner):
        self.draft = draft
        self.target = target
        self.cache: Optional[KVCache] = None  # the drafter's cache (SpeculativeDecoder.begin)
        self.min_draft_prob = 0.0  # chains stop below this cumulative draft probability
        # the drafter's cache position of draft j is L + j + pos_offset (0: the
        # one-layer drafter, whose root pair sits at L-1; 1: the self-drafter, fed x_L at L)
        self.pos_offset = 0
        # coupled noise rows of the current step, shared with verification (the decoder
        # calls new_step at the start of every step)
        self.noise = CoupledNoise(target.arch.vocab_size, target.device)
        # the drafter's fixed-shape forwards over its cache (``cuda_graphs.
        # GraphedDecoder`` on ``draft``), set by the engine where drafting is graphed
        # (the one-layer drafter with CUDA graphs); None: eager. Only forwards of at
        # most ``static_tokens`` tokens per row use them (the decoder sets it to the
        # draft slack): drafting steps and a steady step's catch-up, not the catch-up
        # of positions decoded plainly (any width: a key per width would be captured)
        self.graphs = None
        self.static_tokens = 0

    def extend(self, b: int, tokens: torch.Tensor, start: torch.Tensor, *, embeds,
               span: int, rope_positions: Optional[torch.Tensor] = None,
               new_token_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The drafter's forward over rows 0..b-1 of its cache (``ModelRunner.extend``
        with ``embeds`` as its inputs): through ``graphs`` when set and the rows take at
        most ``static_tokens`` tokens (a key per (bucket, tokens per row, tree mask
        width, embeds)), else eagerly over ``span`` positions."""
        if self.graphs is not None and tokens.shape[1] <= self.static_tokens:
            return self.graphs.forward(self.cache, tokens, start, embeds=embeds,
                                       rope_positions=rope_positions,
                                       new_token_mask=new_token_mask)
        return self.draft.extend(self.cache, slice(0, b), tokens, start, embeds=embeds,
                                 rope_positions=rope_positions,
                                 new_token_mask=new_token_mask, span=span)

    def new_step(self) -> None:
        """Forget the last step's noise rows; the next are computed as the target's own
        sampling computes them (its CPU kernels, when it has them)."""
        self.noise.clear()
        self.noise.kernels = self.target.kernels

    def _draft_noise(self, rows, offset: int):
        """Coupled rows' noise at response position len(tokens) + offset over the draft
        vocabulary, [B, V_draft] (zeros for other rows), and their mask [B]; None when
        no row is coupled."""
        idx = [i for i, r in enumerate(rows) if is_coupled(r)]
        if not idx:
            return None
        dev = self.target.device
        keys, pos = [rows[i].key for i in idx], [len(rows[i].tokens) + offset for i in idx]
        g = self.noise.rows(keys, pos) if self.draft.d2t is None else coupled_gumbel(
            keys, pos, self.target.arch.vocab_size, dev, token_ids=self.draft.d2t,
            kernels=self.target.kernels)
        full = torch.zeros(len(rows), g.shape[-1], dtype=torch.float32, device=dev)
        index = torch.tensor(idx, device=dev)
        full[index] = g
        mask = torch.zeros(len(rows), dtype=torch.bool, device=dev)
        mask[index] = True
        return full, mask

    def _tree_scores(self, rows, logits: torch.Tensor, offset: int) -> torch.Tensor:
        """Draft scores of the token after each tree node, from the drafter's logits
        [B, V_draft] or [B, K, V_draft]: its log-probabilities, and in coupled rows its
        processed log-probabilities (the request's temperature, top-k, top-p) plus the
        noise of response position len(tokens) + offset, shifted so each node's best is
        0 (``draft_tree.coupled_child_scores``)."""
        noise = self._draft_noise(rows, offset)
        if noise is None:
            return torch.log_softmax(logits, dim=-1)
        every = all(is_coupled(r) for r in rows)  # (the host knows; no read of the mask)
        lp = None if every else torch.log_softmax(logits, dim=-1)
        return coupled_child_scores(processed_rows(logits, rows), lp, noise)

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft.d2t is None else self.draft.d2t[draft_ids]

    def _q(self, logits: torch.Tensor, rows) -> torch.Tensor:
        """Drafter's sampling distributions over the FULL vocabulary, [B, V] log-probs
        (each row processed with its request's settings, like the target's p)."""
        return self._full(processed_rows(logits, rows))

    def _full(self, lp: torch.Tensor) -> torch.Tensor:
        """Processed draft log-probs [..., V_draft] over the full vocabulary."""
        if self.draft.d2t is None:
            return lp
        full = torch.full((*lp.shape[:-1], self.target.arch.vocab_size), float("-inf"),
                          device=lp.device)
        full[..., self.draft.d2t] = lp
        return full

    def chain(self, rows, depth: int, h: torch.Tensor, logits: torch.Tensor):
        """Up to ``depth`` draft tokens per row. Before drafting position j a row stops if
        (probability of its draft so far) x (largest probability at j) is below
        ``min_draft_prob`` (zero drafts is allowed), so verification spends rows only
        where acceptance is likely. The rule never looks at the token about to be drawn,
        so every kept draft still follows q and acceptance stays exact (a rule that
        dropped unlikely draws would bias them; the distribution test catches that).
        Returns per-row draft token lists and, with standard rows, the drafter's
        sampling distributions at each drafted depth [B, depth', V] (every row; None
        without standard rows)."""
        if self.min_draft_prob <= 0:  # no stop rule: the whole chain on the device
            return self._full_chain(rows, depth, h, logits)
        dev = self.target.device
        b = len(rows)
        coupled = [is_coupled(r) for r in rows]
        sampled = [not r.params.greedy for r in rows]
        any_sampled = any(sampled)
        min_prob = self.min_draft_prob
        standard = [i for i, r in enumerate(rows) if is_standard(r)]
        std_pos = {i: n for n, i in enumerate(standard)}
        salts, std_index = self._standard_salts(rows, standard, depth)
        q_steps: list[torch.Tensor] = []
        drafts: list[list[int]] = [[] for _ in range(b)]
        alive, cum = [True] * b, [1.0] * b
        start = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
        top = max(r.length for r in rows)  # the host's max of start
        last = torch.tensor([r.tokens[-1] for r in rows], dtype=torch.long, device=dev)
        for j in range(depth):
            top_p, top_id = torch.softmax(logits.float(), dim=-1).max(dim=-1)
            full_tok = self._to_target(top_id)
            lp_d = processed_rows(logits, rows) if any_sampled else None
            q_all = self._full(lp_d) if any_sampled else None
            reads = [full_tok.double(), top_p.double()]
            if standard:  # every standard row's draw, its probability and q's largest
                pick = self._draw(lp_d, salts[:, j], std_index)
                qs = q_all if std_index is None else q_all.index_select(0, std_index)
                reads += [pick.double(), qs.max(-1).values.exp().double(),
                          qs.gather(1, pick[:, None])[:, 0].exp().double()]
                q_steps.append(q_all)
            host = torch.cat(reads).tolist()
            tok_l, conf_l = [int(t) for t in host[:b]], host[b: 2 * b]
            n = len(standard)
            std_tok = [int(t) for t in host[2 * b: 2 * b + n]]
            std_best, std_q = host[2 * b + n: 2 * b + 2 * n], host[2 * b + 2 * n:]
            coupled_tok = {}
            idx = [i for i in range(b) if coupled[i] and alive[i]]
            if idx:  # the drafter's coupled tokens: the target's noise at position t0 + j
                g = self.noise.rows([rows[i].key for i in idx],
                                    [len(rows[i].tokens) + j for i in idx])
                index = torch.tensor(idx, device=dev)
                best_tok = argmax_rows(q_all.index_select(0, index) + g, self.draft.kernels)
                coupled_tok = dict(zip(idx, best_tok.tolist()))
            for i, r in enumerate(rows):
                if not alive[i]:
                    continue
                # decide to stop BEFORE drawing: a draw kept only when its own probability
                # is high would no longer follow q, and the acceptance ratio would be wrong
                if i in std_pos:
                    best = std_best[std_pos[i]]
                else:
                    best = float(q_all[i].max().exp()) if sampled[i] else conf_l[i]
                if min_prob > 0 and cum[i] * best < min_prob:
                    alive[i] = False
                    continue
                if coupled[i]:
                    tok = coupled_tok[i]
                    cum[i] *= float(q_all[i, tok].exp())
                elif i in std_pos:
                    tok = std_tok[std_pos[i]]
                    cum[i] *= std_q[std_pos[i]]
                else:
                    tok = tok_l[i]
                    cum[i] *= best
                drafts[i].append(tok)
            if j == depth - 1 or not any(alive):
                break
            # next drafter step for every row (stopped rows feed a placeholder; ignored)
            feed = torch.tensor([d[-1] if d else 0 for d in drafts], dtype=torch.long,
                                device=dev)
            feed = torch.where(torch.tensor([bool(d) for d in drafts], device=dev), feed, last)
            x = self.draft.inputs(feed, h, target_features=False)
            h = self.extend(b, feed[:, None], start + j + self.pos_offset,
                            embeds=x[:, None], span=top + j + self.pos_offset + 1)[:, 0]
            logits = self.draft.draft_logits(h)
        return drafts, torch.stack(q_steps, 1) if standard else None

    def _standard_salts(self, rows, standard: list[int], depth: int):
        """The standard rows' draft salts [S, depth] (``STREAM_DRAFT + j`` at their t0)
        and their row index (None when every row is standard); (None, None) without
        standard rows."""
        if not standard:
            return None, None
        dev = self.target.device
        tags = torch.arange(depth, dtype=torch.int64, device=dev) + STREAM_DRAFT
        salts = stream_salts_of([rows[i].stream for i in standard],
                                [len(rows[i].tokens) for i in standard], tags, dev)
        index = None if len(standard) == len(rows) else torch.tensor(standard, device=dev)
        return salts, index

    def _draw(self, lp: torch.Tensor, salt: torch.Tensor,
              index: Optional[torch.Tensor]) -> torch.Tensor:
        """Standard rows' drafts (target ids), one Gumbel-max draw per row from the
        processed draft log-probs ``lp`` [B, V_draft] (rows ``index``; all when None)
        with the noise of ``salt`` [S] over the draft vocabulary."""
        x = lp if index is None else lp.index_select(0, index)
        g = stream_gumbel(salt.contiguous(), x.shape[-1], self.target.kernels)
        return self._to_target(argmax_rows(x.float() + g, self.draft.kernels))

    def _full_chain(self, rows, depth: int, h: torch.Tensor, logits: torch.Tensor):
        """``chain`` without a stop rule: every row drafts ``depth`` tokens, each depth's
        tokens stay on the device (greedy: the drafter's argmax; coupled: argmax of
        log q~ + g_t; standard: a Gumbel-max draw from q~ on the row's stream, every
        row at once), and the drafts reach the host in one read."""
        dev = self.target.device
        b = len(rows)
        coupled = [i for i, r in enumerate(rows) if is_coupled(r)]
        standard = [i for i, r in enumerate(rows) if is_standard(r)]
        salts, std_index = self._standard_salts(rows, standard, depth)
        q_steps: list[torch.Tensor] = []
        start = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
        top = max(r.length for r in rows)  # the host's max of start
        drafted = []
        for j in range(depth):
            tok = None
            if len(standard) < b:  # greedy rows' drafts (coupled rows' replaced below)
                tok = self._to_target(argmax_rows(logits.float(), self.draft.kernels))
            lp_d = processed_rows(logits, rows) if coupled or standard else None
            q_all = self._full(lp_d) if coupled or standard else None
            if coupled:  # the drafter's coupled tokens: the target's noise at t0 + j
                g = self.noise.rows([rows[i].key for i in coupled],
                                    [len(rows[i].tokens) + j for i in coupled])
                index = torch.tensor(coupled, device=dev)
                tok = tok.index_copy(0, index, argmax_rows(q_all.index_select(0, index) + g,
                                                           self.draft.kernels))
            if standard:
                pick = self._draw(lp_d, salts[:, j], std_index)
                tok = pick if std_index is None else tok.index_copy(0, std_index, pick)
                q_steps.append(q_all)
            drafted.append(tok)
            if j == depth - 1:
                break
            x = self.draft.inputs(tok, h, target_features=False)
            h = self.extend(b, tok[:, None], start + j + self.pos_offset,
                            embeds=x[:, None], span=top + j + self.pos_offset + 1)[:, 0]
            logits = self.draft.draft_logits(h)
        drafts = torch.stack(drafted, dim=1).tolist()  # the chain's one host read
        return drafts, torch.stack(q_steps, 1) if standard else None

    def fused(self, rows) -> bool:
        """Whether ``fused_chain`` drafts this batch: greedy rows, no confidence stop,
        the fused kernels' own cases (TP 1, float32 CPU, no FP8)."""
        d = self.draft
        return (d.fused_drafting and d.kernels is not None and d.tp_group is None
                and not d.fp8
                and self.min_draft_prob <= 0 and self.cache.layout == "bgsd"
                and not self.cache.paged  # (the kernels read contiguous rows)
                and len(rows) <= d.fused_max_rows and all(r.params.greedy for r in rows))

    def fused_chain(self, rows, depth: int, pending) -> list[list[int]]:
        """The catch-up over ``pending`` (``SpeculativeDecoder``'s pending drafter
        inputs: tokens, target features, row counts, first positions) then a chain of
        ``depth`` greedy drafts, in one kernel call (``DraftRunner.draft_chain_fused``):
        the same kernels in the same order as the unfused path, so the same drafts,
        without the ~0.2 ms of host work per drafter run."""
        tok, feats, counts, starts = pending
        row_of, pos = ragged(counts, starts, self.target.device)
        last = torch.tensor(counts).cumsum(0) - 1
        start = torch.tensor([r.length for r in rows], dtype=torch.long)
        return self.draft.draft_chain_fused(self.cache, tok, feats, row_of, pos, last, start,
                                            depth, self.target.arch.vocab_size,
                                            max(r.length for r in rows))

    def tree(self, rows, s: Strategy, h: torch.Tensor, logits: torch.Tensor):
        """EAGLE-2 style dynamic tree, batched over rows (``draft_tree.TreePool``: each
        depth's top-k nodes expanded, the ``verify_tokens`` best nodes of the whole tree
        kept, closed under parents). Returns the ``DraftTree``."""
        dev = self.target.device
        b, k = len(rows), s.top_k
        L = torch.tensor([r.length for r in rows], dtype=torch.long,
                         device=dev) + self.pos_offset
        top = max(r.length for r in rows) + self.pos_offset  # the host's max of L
        pool = TreePool(self._tree_scores(rows, logits, 0), k)
        parent_h = h[:, None].expand(b, k, h.shape[-1])
        # drafter tree masks: frontier j (slots L + (j-1)K ..) sees its ancestors
        anc = torch.zeros(b, 0, 0, dtype=torch.bool, device=dev)  # ancestors among fed nodes
        fed_pool: list[torch.Tensor] = []  # pool index of each fed slot
        for depth in range(1, s.depth):
            w = anc.shape[1]
            new_anc = torch.zeros(b, w + k, w + k, dtype=torch.bool, device=dev)
            new_anc[:, :w, :w] = anc
            if w:  # a frontier node sees its parent's ancestors (parent was fed last round)
                par_slot = self._slot_of_parent(pool, fed_pool)
                new_anc[:, w:, :w] = torch.gather(anc, 1, par_slot[:, :, None].expand(b, k, w))
                new_anc[:, w:, :w].scatter_(2, par_slot[:, :, None], True)
            new_anc[:, w:, w:] = torch.eye(k, dtype=torch.bool, device=dev)
            anc = new_anc
            fed_pool.append(pool.front)
            full_tok = self._to_target(pool.front_tok)
            x = self.draft.inputs(full_tok.reshape(-1), parent_h.reshape(b * k, -1),
                                  target_features=False).view(b, k, -1)
            out = self.extend(
                b, full_tok, L + w,
                rope_positions=(L + depth - 1)[:, None].expand(b, k), new_token_mask=anc[:, w:],
                embeds=x, span=top + w + k)  # [B, K, H]
            # children predict response position t0 + depth
            best = pool.grow(self._tree_scores(rows, self.draft.draft_logits(out), depth))
            parent_h = torch.gather(out, 1, (best // k)[:, :, None].expand(b, k, out.shape[-1]))
        tok, par, dep, score, chosen = pool.select(s.verify_tokens)
        return self._tree_inputs(rows, s, tok, par, dep, chosen, score)

    @staticmethod
    def _slot_of_parent(pool: TreePool, fed_pool: list[torch.Tensor]) -> torch.Tensor:
        """Fed-slot index (within the drafter's tree region) of each frontier node's
        parent [B, K]."""
        par = torch.cat(pool.par, 1).gather(1, pool.front)  # pool index of parents [B, K]
        fed = torch.cat(fed_pool, 1)  # [B, W] pool index per fed slot
        match = fed[:, None, :] == par[:, :, None]  # [B, K, W]
        return match.float().argmax(dim=-1)

    def _tree_inputs(self, rows, s: Strategy, tok, par, dep, chosen, score):
        dev = self.target.device
        b, n = chosen.shape
        # the tree's layout to the host in one read (ids and depths exact in float64)
        size = par.shape[1]
        host = torch.cat([par.double(), dep.double(), self._to_target(tok).double(),
                          score.double(), chosen.double()], dim=1).tolist()
        par_l, dep_l, full_l = ([[int(v) for v in row[j * size: (j + 1) * size]]
                                 for row in host] for j in range(3))
        score_l = [row[3 * size: 4 * size] for row in host]
        ch_l = [[int(v) for v in row[4 * size:]] for row in host]
        vtok = torch.empty(b, n + 1, dtype=torch.long, device=dev)
        mask = torch.zeros(b, n + 1, n + 1, dtype=torch.bool, device=dev)
        depth = torch.zeros(b, n + 1, dtype=torch.long, device=dev)
        tokens, children, depths = [], [], []
        for i, r in enumerate(rows):
            try:
                node_par, kids = row_layout(par_l[i], ch_l[i], score_l[i])
            except TreeNotClosed as e:
                sp = r.params
                mode = ("greedy" if sp.greedy else "coupled" if is_coupled(r)
                        else "standard")
                raise RuntimeError(
                    f"draft tree of batch row {i} is not closed under parents ({e}): "
                    f"strategy {s.name}, temperature={sp.temperature} top_k={sp.top_k} "
                    f"top_p={sp.top_p}, {mode} sampling. This is an engine bug; chain "
                    "strategies only (top_k 1 in rollout.speculative.strategy / arms) "
                    "avoid trees until it is fixed"
                ) from None
            node_tok = [r.tokens[-1]] + [full_l[i][p] for p in ch_l[i]]
            mask[i] = torch.tensor(ancestor_mask(node_par), dtype=torch.bool)
            depths.append([0] + [dep_l[i][p] for p in ch_l[i]])
            depth[i] = torch.tensor(depths[-1])
            vtok[i] = torch.tensor(node_tok)
            tokens.append(node_tok)
            children.append(kids)
        return DraftTree(vtok, mask, depth, tokens, children, depths)
