"""The speculative step for a running batch (``SpeculativeDecoder.step``), every row at
its own position L, its last sampled token x_L not yet in the target's cache:

1. Drafter catch-up + root: the drafter's KV cache is valid up to ``draft_len`` per
   row; the pairs (tok_{p+1}, h_p) for p = draft_len .. L-1 are fed in one ragged
   forward (h_p = the target's hidden state at p, kept in a per-position feature
   store), so switching speculation on mid-generation costs one drafter pass over
   the positions it missed, never a target re-prefill. The last pair (x_L, h_{L-1})
   is the root: its output ĥ and draft distribution q_1.
2. Drafting (``drafting.py``): a chain, the fused chain, or an EAGLE-2 tree.
3. Verification: one target forward over [x_L, drafts...] (chains causally, trees
   with an ancestor mask and depth-based RoPE positions) gives p at every node from
   the same ``processed_logprobs`` as plain decoding.
4. Acceptance (exact; standard rows: ``acceptance_batched.py``, all rows at once on
   their random streams; greedy rows: ``acceptance.py``; coupled rows: greedy
   verification of log p~ + g_t, so the output is the plain coupled sample whatever
   the drafter).
5. Commit: features of accepted nodes are stored; the engine emits the tokens, log-probs
   and hidden states exactly as plain decoding emits them (stop tokens and length
   limits cut the accepted run) and accepted tree nodes' keys/values (and recorded
   experts) move to consecutive cache slots (``compact``; rejected slots are simply
   beyond the new length).
"""

from __future__ import annotations

import time
from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..forward import ModelRunner
from ..kv_cache import KVCache, reuse_or_make
from .acceptance import processed_rows
from .draft_runner import DraftRunner
from .drafting import DraftTree, Drafting, is_coupled, ragged
from .emissions import Emission, Verified, accept_rows
from .stats import SpecStats


class SpeculativeDecoder:
    """Drafter state for a running batch (drafter KV cache, per-position target
    features) and the speculative step. The engine owns the rows and the target cache;
    this keeps, per cache row, how far the drafter's cache is valid."""

    # the feature store holds the target's final hidden states when the drafter reads
    # no EAGLE-3 feature layers (``rollout.memory`` returns them from there)
    keeps_hidden = True
    # the engine's fixed-shape target forwards (``cuda_graphs.GraphedDecoder``), set by
    # the engine at every call when it decodes through them: verification replays a
    # graph per (batch bucket, tokens per row, chain or tree); None: eager
    graphs = None

    def __init__(self, drafter, target: ModelRunner):
        self.drafter = drafter  # the ``Drafter`` (its model: an ``EagleDrafter``)
        self.kind = drafter.name  # in metrics (``SpecStats.kinds``)
        self.target = target
        self.draft = DraftRunner(drafter.model, target)
        self.draft.kernels = target.kernels
        self.drafting = Drafting(self.draft, target)
        self.feature_layers = tuple(drafter.feature_layers)
        self.feature_width = drafter.model.config.feature_width
        self.cache: Optional[KVCache] = None
        self.features: Optional[torch.Tensor] = None
        self.draft_len: list[int] = []

    @property
    def min_draft_prob(self) -> float:
        """Chains stop below this cumulative draft probability (``Drafting``)."""
        return self.drafting.min_draft_prob

    @min_draft_prob.setter
    def min_draft_prob(self, value: float) -> None:
        self.drafting.min_draft_prob = value

    # ---------------------------------------------------------------- the engine's view
    def each(self) -> list["SpeculativeDecoder"]:
        """The decoders speculating (one; several kinds: ``multi.KindDecoder``)."""
        return [self]

    def active_kind(self) -> Optional[str]:
        return self.kind

    def pack_weights(self) -> tuple[int, float]:
        """Bring the drafter's weights up to date with the target's (the kernels' panel
        copies; a quantized copy re-quantized when the policy changed) at the start of a
        call. Returns (refreshes, their seconds)."""
        before = self.draft.refreshes
        self.draft.pack_weights()
        n = self.draft.refreshes - before
        return n, self.draft.refresh_seconds if n else 0.0

    def wire_graphs(self, graphs) -> None:
        """Verify through the engine's graphs ``graphs`` (None: eagerly); draft through
        graphs of the drafter's own forwards over its cache where its kind's drafting is
        graphed and its runner can be captured (not through Transformer Engine's FP8
        GEMMs, nor the CPU kernels; without those its cache has a capacity of room
        beyond the rows' drafts, where a capture's warm-up writes)."""
        from ..cuda_graphs import GraphedDecoder

        self.graphs = graphs
        d = self.drafting
        if (graphs is None or not self.drafter.graphed_drafting or self.draft.fp8
                or self.draft.kernels is not None):
            d.graphs = None
        elif d.graphs is None or d.graphs.capture != graphs.capture:
            d.graphs = GraphedDecoder(self.draft, capture=graphs.capture,
                                      measure=graphs.measure, timer=graphs.timer)

    def graph_decisions(self) -> dict[str, dict]:
        """``rollout.cuda_graphs=auto``'s measured choice per key of the drafting graphs
        ("<kind>/<key>")."""
        g = self.drafting.graphs
        return {} if g is None else {f"{self.kind}/{k}": v for k, v in g.decisions().items()}

    # ---------------------------------------------------------------- state
    def begin(self, max_batch: int, capacity: int, slack: int, *,
              reach: Optional[int] = None, draft_rows: Optional[int] = None) -> None:
        """Make room for ``max_batch`` rows of ``capacity`` positions (+ draft slack),
        zeroing what a call of ``reach`` positions can reach (None: all). Every row
        keeps its features from its prefill on, so ``draft_rows`` is not used here."""
        def span(positions: int) -> int:  # + slack (+ a capacity for the padded catch-up)
            return positions + slack + (0 if self.draft.kernels is not None else positions)

        need, upto = span(capacity), None if reach is None else span(reach)
        self.cache = reuse_or_make(self.cache, num_layers=1, max_batch=max_batch, upto=upto,
                                   kv_heads=self.draft.groups, capacity=need,
                                   head_dim=self.draft.head_dim, dtype=self.draft.dtype,
                                   device=self.draft.device)
        self.drafting.cache = self.cache
        self.drafting.static_tokens = slack  # (graphed drafting: the widest key)
        f = self.features
        if f is None or f.shape[0] < max_batch or f.shape[1] < capacity + slack:
            self.features = None
            self.features = torch.zeros(max_batch, capacity + slack, self.feature_width,
                                        dtype=self.target.dtype, device=self.target.device)
        self.draft_len = [0] * max_batch

    def release(self) -> None:
        """Free the drafter's cache and the feature store (``rollout.memory``); the
        next ``begin`` makes them again."""
        if self.cache is not None:
            self.cache.release()
        if self.drafting.graphs is not None:  # they hold the drafter cache's addresses
            self.drafting.graphs.release()
        self.features = None

    def capture_hook(self):
        """A ``capture`` callback collecting the EAGLE-3 feature layers (None without)."""
        if not self.feature_layers:
            return None, None
        got: dict[int, torch.Tensor] = {}
        wanted = set(self.feature_layers)

        def hook(i, x):
            if i in wanted:
                got[i] = x
        return hook, got

    def features_of(self, hidden: torch.Tensor, got: Optional[dict]) -> torch.Tensor:
        if not self.feature_layers:
            return hidden
        return torch.cat([got[i] for i in self.feature_layers], dim=-1)

    def store(self, row: int, first_pos: int, feats: torch.Tensor) -> None:
        """Target features [T, F] of positions first_pos.. of cache row ``row``."""
        self.features[row, first_pos: first_pos + feats.shape[0]] = feats.to(self.features.dtype)

    def store_step(self, start: torch.Tensor, feats: torch.Tensor) -> None:
        """Target features [B, 1, F] of one plain decode step at positions ``start`` [B]
        of rows 0..B-1."""
        b = feats.shape[0]
        self.features[torch.arange(b, device=self.features.device), start] = \
            feats[:, 0].to(self.features.dtype)

    def new_row(self, row: int) -> None:
        self.draft_len[row] = 0

    def copy_prompt(self, src: int, dst: list[int], length: int) -> None:
        """Rows ``dst`` start with the ``length``-token prompt that row ``src`` holds
        (shared prefill): its features at those positions are copied; the drafter's
        cache of each new row starts empty (its catch-up feeds the prompt)."""
        if self.features is not None:
            idx = torch.tensor(dst, device=self.features.device)
            self.features[idx, :length] = self.features[src: src + 1, :length]
        for row in dst:
            self.new_row(row)

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.features[dst, :length] = self.features[src, :length]
        n = self.draft_len[src]
        self.cache.move_row(src, dst, n)
        self.draft_len[dst] = n

    # ---------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, target_cache: KVCache, rows: Sequence, strategy: Strategy,
             stats: SpecStats) -> tuple[list[Emission], Verified]:
        """Draft and verify for running rows 0..len(rows)-1 (``rows[i]`` has
        ``.length``, ``.prompt``, ``.tokens``, ``.params``, ``.stream``, ``.key``).

        Returns per-row emissions and the verify forward's outputs over every row's
        nodes (``Verified``: hidden states, float32 logits, the processed log-probs the
        acceptance used); the caller emits from them and commits.
        """
        t0 = time.perf_counter()
        b = len(rows)
        dev = self.target.device
        self.drafting.new_step()
        drafts, q_lp, tree = self._draft(rows, strategy, stats)
        t1 = time.perf_counter()
        stats.draft_seconds += t1 - t0

        hook, got = self.capture_hook()
        if tree is None:
            hidden, counts = self._verify_chains(target_cache, rows, drafts, hook)
        else:
            L = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
            if self.graphs is not None and hook is None:  # a fixed-shape tree step
                h3 = self.graphs.verify(target_cache, tree.verify_tokens, L,
                                        rope_positions=L[:, None] + tree.depth,
                                        new_token_mask=tree.mask)
            else:
                h3 = self.target.extend(target_cache, slice(0, b), tree.verify_tokens, L,
                                        rope_positions=L[:, None] + tree.depth,
                                        new_token_mask=tree.mask, capture=hook,
                                        span=max(r.length for r in rows)
                                        + tree.verify_tokens.shape[1])
            counts = [tree.verify_tokens.shape[1]] * b
            hidden = h3.reshape(b * counts[0], -1)
            if got:
                got = {k: v.reshape(b * counts[0], -1) for k, v in got.items()}
        stats.drafted += sum(counts) - b
        logits = self.target.logits(hidden)
        feats = self.features_of(hidden, got)
        per_query = [r for r, c in zip(rows, counts) for _ in range(c)]
        plp = processed_rows(logits, per_query)
        split = lambda t: list(torch.split(t, counts))  # noqa: E731
        logits_r, plp_r, feats_r = split(logits), split(plp), split(feats)

        noisy = self._verify_noise(rows, counts, tree)
        scores = [plp_r[i] + noisy[i] if noisy[i] is not None else plp_r[i]
                  for i in range(b)]  # coupled: greedy verification of log p~ + noise
        emissions = accept_rows(self.target, rows, scores, logits_r, plp_r, drafts, q_lp,
                                tree, (logits, plp, counts), strategy)
        emissions = self._agree(emissions, max(counts))
        # features of accepted nodes go to positions L.. (compaction happens in commit)
        for i, (r, e) in enumerate(zip(rows, emissions)):
            idx = torch.tensor(e.nodes, device=dev)
            self.store(i, r.length, feats_r[i].index_select(0, idx))
            self.draft_len[i] = r.length  # drafted positions >= L are stale now
        stats.verify_seconds += time.perf_counter() - t1
        return emissions, Verified(hidden, logits, plp, list(counts))

    def _draft(self, rows: Sequence, strategy: Strategy, stats: SpecStats):
        """The step's drafts: (per-row chain drafts and, with standard rows, the
        drafter's distributions at each depth [B, depth', V], or None) for a chain, or
        (None, None, the ``DraftTree``) for a tree."""
        if strategy.is_chain and self.drafting.fused(rows):  # catch-up + chain, one call
            return self.drafting.fused_chain(rows, strategy.depth,
                                             self._pending(rows, stats)), None, None
        root_h, root_logits = self._catch_up(rows, stats)
        if strategy.is_chain:
            drafts, q_lp = self.drafting.chain(rows, strategy.depth, root_h, root_logits)
            return drafts, q_lp, None
        return None, None, self.drafting.tree(rows, strategy, root_h, root_logits)

    def _verify_noise(self, rows, counts: Sequence[int], tree: Optional[DraftTree]) -> list:
        """Per row, the coupled noise of each verified node [nodes, V] (a node at
        depth d predicts response position len(tokens) + d), or None (not coupled)."""
        keys, pos, owner = [], [], []
        for i, r in enumerate(rows):
            if not is_coupled(r):
                continue
            t0 = len(r.tokens)
            depths = range(counts[i]) if tree is None else tree.depths[i]
            for d in depths:
                keys.append(r.key)
                pos.append(t0 + int(d))
            owner.append(i)
        out: list = [None] * len(rows)
        if not keys:
            return out
        g = self.drafting.noise.rows(keys, pos)  # the drafts' rows computed once
        for i, part in zip(owner, torch.split(g, [counts[i] for i in owner])):
            out[i] = part
        return out

    def _verify_chains(self, cache: KVCache, rows, drafts: list[list[int]], hook):
        """Target forward over each row's [x_L, drafts...] (chains of any lengths).
        Returns hidden states [sum of lengths, H] (row by row) and the lengths."""
        dev = self.target.device
        counts = [len(d) + 1 for d in drafts]
        toks = [t for r, d in zip(rows, drafts) for t in [r.tokens[-1]] + list(d)]
        t = self.target
        static = self.graphs is not None and hook is None  # a fixed-shape chain step
        if (not static and t.kernels is not None and cache.layout == "bgsd"
                and not cache.paged):  # ragged, fused
            row_of, pos = ragged(counts, [r.length for r in rows], dev)
            x = t.embed(torch.tensor(toks, dtype=torch.long, device=dev))
            return t.extend_chains(cache, row_of, pos, x, hook), counts
        # padded [B, T]: pad tokens sit past each row's chain (their cache slots are
        # beyond the new length, i.e. already rewound)
        b, width = len(rows), max(counts)
        ids = torch.zeros(b, width, dtype=torch.long, device=dev)
        off = 0
        for i, c in enumerate(counts):
            ids[i, :c] = torch.tensor(toks[off: off + c])
            off += c
        L = torch.tensor([r.length for r in rows], dtype=torch.long, device=dev)
        captured: dict[int, torch.Tensor] = {}
        sub = None if hook is None else (lambda i, x: captured.__setitem__(i, x))
        if static:  # the graph of (bucket, width): pads as above
            h = self.graphs.verify(cache, ids, L)
        else:
            h = t.extend(cache, slice(0, b), ids, L, capture=sub,
                         span=max(r.length for r in rows) + width)
        keep = torch.cat([torch.arange(c, device=dev) + i * width for i, c in enumerate(counts)])
        if hook is not None:
            for i, x in captured.items():
                hook(i, x.reshape(b * width, -1).index_select(0, keep))
        return h.reshape(b * width, -1).index_select(0, keep), counts

    def compact(self, target_cache: KVCache, row: int, length: int, slots: Sequence[int]) -> None:
        """Move accepted tree nodes (slot offsets from ``length``) to consecutive slots
        length+1.. in the target cache (chains are already in place), their keys,
        values and, for a mixture-of-experts target, the experts recorded for them
        (``KVCache.routes``: the routes of the verified nodes, which a plain decode
        of the accepted tokens would have taken)."""
        want = list(range(1, len(slots) + 1))
        if list(slots) == want:
            return
        target_cache.move_positions(row, [length + s for s in slots],
                                    [length + s for s in want])

    # ---------------------------------------------------------------- pieces
    def _agree(self, emissions: list[Emission], n: int) -> list[Emission]:
        """Every rank of the group that decodes together (TP and, at PP > 1, the
        pipeline stages) takes the deciding rank's emissions (``ModelRunner.agree``;
        they agree already: same logits, same streams; this makes it certain)."""
        if self.target.decides_alone:
            return emissions
        width = n + 1
        buf = torch.full((len(emissions), 2, width), -1, dtype=torch.long,
                         device=self.target.device)
        for i, e in enumerate(emissions):
            buf[i, 0, : len(e.tokens)] = torch.tensor(e.tokens)
            buf[i, 1, : len(e.nodes)] = torch.tensor(e.nodes)
        self.target.agree(buf)
        out = []
        for e, (tok_row, node_row) in zip(emissions, buf.tolist()):  # one host read
            toks = [t for t in tok_row if t >= 0]
            nodes = [t for t in node_row if t >= 0]
            same = toks == e.tokens and nodes == e.nodes  # (always, unless ranks differ)
            out.append(Emission(toks, nodes, e.logprobs if same else None))
        return out

    def _pending(self, rows: Sequence, stats: SpecStats, root: bool = True):
        """Every row's pending drafter inputs: the pairs (tok_{p+1}, h_p) for positions
        p = draft_len .. L-1 (the last one is the root; ``root=False`` stops before it).
        Returns the tokens [N], the target features [N, F], the row counts and their
        first positions."""
        counts, toks, feats, starts = [], [], [], []
        for i, r in enumerate(rows):
            lo, hi = self.draft_len[i], r.length - (0 if root else 1)  # positions lo..hi-1
            hi = max(hi, lo)
            seq_next = (r.prompt + r.tokens)[lo + 1: hi + 1]
            counts.append(hi - lo)
            toks.extend(seq_next)
            feats.append(self.features[i, lo:hi])
            starts.append(lo)
        stats.catchup_tokens += sum(counts) - (len(rows) if root else 0)
        tok = torch.tensor(toks, dtype=torch.long, device=self.target.device)
        return tok, torch.cat(feats, dim=0), counts, starts

    def pending(self, rows: Sequence) -> int:
        """Drafter positions the rows missed (decoded plainly, or since their prefill),
        not counting each row's root."""
        return sum(max(0, r.length - 1 - self.draft_len[i]) for i, r in enumerate(rows))

    @torch.no_grad()
    def catch_up(self, rows: Sequence, stats: SpecStats,
                 target_cache: Optional[KVCache] = None) -> int:
        """Feed every row's missed drafter inputs but the root (positions draft_len ..
        L-2) in one forward, so the next ``step`` feeds only the roots and costs what a
        steady speculative step costs; the engine times this switching cost apart (the
        tuner's break-even gate compares steady steps). Returns the positions fed.
        (``target_cache``: the target's cache, which the self-drafter's decoder reads.)"""
        if self.pending(rows) == 0:
            return 0
        dev = self.target.device
        t0 = time.perf_counter()
        tok, feats, counts, starts = self._pending(rows, stats, root=False)
        x = self.draft.inputs(tok, feats, target_features=True)
        if self.draft.kernels is not None:  # ragged: rows with nothing pending add none
            row_of, pos = ragged(counts, starts, self.target.device)
            self.draft.extend_chains(self.cache, row_of, pos, x)
        else:  # padded [B, T]: pad slots lie at or past each row's draft_len (invalid)
            xp = self._padded(x, counts)
            b, t_max = xp.shape[:2]
            start = torch.tensor(starts, dtype=torch.long, device=dev)
            self.drafting.extend(b, torch.zeros(b, t_max, dtype=torch.long, device=dev),
                                 start, embeds=xp, span=max(starts) + t_max)
        for i, (s, c) in enumerate(zip(starts, counts)):
            self.draft_len[i] = s + c
        stats.catchup_seconds += time.perf_counter() - t0
        return sum(counts)

    def _catch_up(self, rows: Sequence, stats: SpecStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's pending (tok_{p+1}, h_p) pairs; returns the root outputs
        ĥ [B, H] and draft logits [B, V_draft]."""
        dev = self.target.device
        b = len(rows)
        tok, feats, counts, starts = self._pending(rows, stats)
        x = self.draft.inputs(tok, feats, target_features=True)
        t_max = max(counts)
        if self.draft.kernels is not None or t_max == 1:
            # ragged: one query row per pending position, chains per cache row
            row_of, pos = ragged(counts, starts, self.target.device)
            if self.draft.kernels is not None:
                out = self.draft.extend_chains(self.cache, row_of, pos, x)
            else:  # one pending position per row: a plain one-token step
                out = self.drafting.extend(b, torch.zeros(b, 1, dtype=torch.long, device=dev),
                                           pos, embeds=x[:, None],
                                           span=max(starts) + 1).reshape(b, -1)
            last = torch.tensor(counts, device=dev).cumsum(0) - 1
        else:  # padded [B, T]: pad slots lie beyond each row's valid range (the cache
            # has a full capacity of slack for them, see ``begin``)
            xp = self._padded(x, counts)
            start = torch.tensor(starts, dtype=torch.long, device=dev)
            out = self.drafting.extend(b, torch.zeros(b, t_max, dtype=torch.long, device=dev),
                                       start, embeds=xp,
                                       span=max(starts) + t_max).reshape(b * t_max, -1)
            last = torch.arange(b, device=dev) * t_max + torch.tensor(counts, device=dev) - 1
        root_h = out.index_select(0, last)
        return root_h, self.draft.draft_logits(root_h)

    @staticmethod
    def _padded(x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        """Rows' consecutive runs of ``x`` [sum(counts), H] as [B, max(counts), H],
        zero-padded at the end of each row."""
        xp = torch.zeros(len(counts), max(counts), x.shape[-1], dtype=x.dtype,
                         device=x.device)
        off = 0
        for i, c in enumerate(counts):
            xp[i, :c] = x[off: off + c]
            off += c
        return xp
