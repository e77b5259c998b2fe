"""The one-layer (EAGLE) drafter's proposer: its KV cache, the per-position store of
the target's features and its drafting; ``decoder.SpeculativeDecoder`` verifies and
commits.

1. Catch-up + root: the drafter's KV cache is valid up to ``draft_len`` per row; the
   pairs (tok_{p+1}, h_p) for p = draft_len .. L-1 are fed in one ragged forward
   (h_p = the target's hidden state at p, kept in a per-position feature store), so
   switching speculation on mid-generation costs one drafter pass over the positions
   it missed, never a target re-prefill. The last pair (x_L, h_{L-1}) is the root: its
   output ĥ and draft distribution q_1.
2. Drafting (``drafting.py``): a chain, the fused chain, or an EAGLE-2 tree.
3. Told what was committed: the features of the accepted nodes are stored at
   positions L.. and the drafter's cache is valid up to L (drafted positions are stale).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..forward import ModelRunner
from ..kv_cache import KVCache
from . import draft_cache
from .decoder import SpeculativeDecoder
from .draft_runner import DraftRunner
from .drafting import Drafting, ragged
from .proposer import Proposal
from .stats import SpecStats


class EagleDecoder(SpeculativeDecoder):
    """Drafter state for a running batch (drafter KV cache, per-position target
    features) and its proposals. The engine owns the rows and the target cache; this
    keeps, per cache row, how far the drafter's cache is valid."""

    # the feature store holds the target's final hidden states when the drafter reads
    # no EAGLE-3 feature layers (``rollout.memory`` returns them from there)
    keeps_hidden = True

    def __init__(self, drafter, target: ModelRunner):
        super().__init__(drafter, target)
        self.draft = DraftRunner(drafter.model, target)
        self.draft.kernels = target.kernels
        self.drafting = self._drafting(self.draft)
        self.feature_layers = tuple(drafter.feature_layers)
        self.feature_width = drafter.model.config.feature_width
        self.cache: Optional[KVCache] = None
        self.features: Optional[torch.Tensor] = None
        self.draft_len: list[int] = []
        self.slack = 0  # positions past a row's length a step may write (``begin``)

    def _drafting(self, draft) -> Drafting:
        """Drafting with ``draft``, sharing the step's coupled noise rows with the
        verification."""
        d = Drafting(draft, self.target)
        d.noise = self.noise
        return d

    def use_noise(self, noise) -> None:
        self.noise = self.drafting.noise = noise

    @property
    def min_draft_prob(self) -> float:
        """Chains stop below this cumulative draft probability (``Drafting``)."""
        return self.drafting.min_draft_prob

    @min_draft_prob.setter
    def min_draft_prob(self, value: float) -> None:
        self.drafting.min_draft_prob = value

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
              reach: Optional[int] = None, draft_rows: Optional[int] = None,
              paged=None) -> None:
        """Make room for ``max_batch`` rows of ``capacity`` positions (+ draft slack),
        zeroing what a call of ``reach`` positions can reach (None: all). Every row
        keeps its features from its prefill on; with ``paged`` (the target's cache,
        ``rollout.kv_cache=paged``) the drafter's cache is paged, its pool
        ``draft_rows`` rows of positions, and the features live in the target's blocks
        (``draft_cache``)."""
        self.slack = slack
        block_size = None if paged is None else paged.block_size
        self.cache = draft_cache.make(
            self.cache, block_size=block_size, rows=max_batch,
            **self._cache_shape(max_batch, capacity, slack, reach, draft_rows, block_size))
        self.drafting.cache = self.cache
        self.drafting.static_tokens = slack  # (graphed drafting: the widest key)
        f = self.features
        if paged is not None:
            self.features = draft_cache.PagedFeatures(paged, self.feature_width)
        elif (f is None or isinstance(f, draft_cache.PagedFeatures)
              or f.shape[0] < max_batch or f.shape[1] < capacity + slack):
            self.features = None
            self.features = torch.zeros(max_batch, capacity + slack, self.feature_width,
                                        dtype=self.target.dtype, device=self.target.device)
        self.draft_len = [0] * max_batch

    def _cache_shape(self, max_batch: int, capacity: int, slack: int,
                     reach: Optional[int], draft_rows: Optional[int],
                     block_size: Optional[int]) -> dict:
        """The drafter cache's width (the positions it reaches: the rows' + the slack +
        a capacity for the padded catch-up's pad slots, which the fused kernels' ragged
        catch-up has none of; they read contiguous rows, so not with a paged cache),
        zeroed reach, pool rows and positions, and tensor shape."""
        fused = self.draft.kernels is not None and block_size is None
        extra = 1 if self.drafting.pos_offset else 0  # (the self-drafter's root at L)

        def span(positions: int) -> int:
            return positions + slack + extra + (0 if fused else positions)

        return dict(width=span(capacity), upto=None if reach is None else span(reach),
                    pool_rows=max(1, min(max_batch, draft_rows or max_batch)),
                    positions=capacity + slack + 1, num_layers=self.draft_layers,
                    kv_heads=self.draft.groups, head_dim=self.draft.head_dim,
                    dtype=self.draft.dtype, device=self.draft.device)

    def paged_kv_bytes(self, max_batch: int, capacity: int, slack: int, draft_rows: int,
                       block_size: int) -> int:
        """Bytes the paged drafter cache of a call of these sizes holds (its pool:
        ``rollout.memory`` counts it in the KV budget)."""
        shape = self._cache_shape(max_batch, capacity, slack, None, draft_rows, block_size)
        return draft_cache.pool_bytes(
            **{k: shape[k] for k in ("num_layers", "kv_heads", "head_dim", "dtype",
                                     "pool_rows", "positions")}, block_size=block_size)

    @property
    def draft_layers(self) -> int:
        """The drafter cache's layers."""
        return 1

    @property
    def _ragged_kernels(self) -> bool:
        """Whether the catch-up runs ragged in the fused kernels (they read the cache's
        contiguous rows: not a paged one)."""
        return self.draft.kernels is not None and not self.cache.paged

    def reserve(self, rows: Sequence) -> None:
        """Blocks for what a speculative step of ``rows`` may write (paged cache)."""
        draft_cache.reserve(self.cache, rows, self.slack)

    def drop_row(self, row: int) -> None:
        """Row ``row`` left the batch (finished or preempted): a paged cache's blocks
        returned (fixed slots keep the row as it is until a row moves in)."""
        if self.cache is not None and self.cache.paged:
            self.new_row(row)

    def kv_bytes_in_use(self) -> int:
        return draft_cache.bytes_in_use(self.cache)

    def paged_features(self):
        return self.feature_width, self.target.dtype

    @property
    def _paged_features(self) -> bool:
        return isinstance(self.features, draft_cache.PagedFeatures)

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
        if self._paged_features:
            n = feats.shape[0]
            self.features.cache.write_features(
                torch.full((n,), row, device=feats.device),
                torch.arange(first_pos, first_pos + n, device=feats.device), feats)
            return
        self.features[row, first_pos: first_pos + feats.shape[0]] = feats.to(self.features.dtype)

    def store_step(self, start: torch.Tensor, feats: torch.Tensor) -> None:
        """Target features [B, 1, F] of one plain decode step at positions ``start`` [B]
        of rows 0..B-1."""
        b = feats.shape[0]
        if self._paged_features:
            self.features.cache.write_features(torch.arange(b, device=feats.device), start,
                                               feats[:, 0])
            return
        self.features[torch.arange(b, device=self.features.device), start] = \
            feats[:, 0].to(self.features.dtype)

    def new_row(self, row: int) -> None:
        draft_cache.free_row(self.cache, row)
        self.draft_len[row] = 0

    def copy_prompt(self, src: int, dst: list[int], length: int) -> None:
        """Rows ``dst`` start with the ``length``-token prompt that row ``src`` holds
        (shared prefill): its features at those positions are copied; the drafter's
        cache of each new row starts empty (its catch-up feeds the prompt)."""
        if self.features is not None and not self._paged_features:  # (paged: the
            # target's shared blocks hold them, its partly filled last one copied)
            idx = torch.tensor(dst, device=self.features.device)
            self.features[idx, :length] = self.features[src: src + 1, :length]
        for row in dst:
            self.new_row(row)

    def move_row(self, src: int, dst: int, length: int) -> None:
        if not self._paged_features:  # (paged: the target's table moved them)
            self.features[dst, :length] = self.features[src, :length]
        n = self.draft_len[src]
        self.cache.move_row(src, dst, n)
        self.draft_len[dst] = n

    # ---------------------------------------------------------------- the step

    # ---------------------------------------------------------------- proposing
    def propose(self, rows: Sequence, strategy: Strategy, stats: SpecStats,
                target_cache=None) -> Proposal:
        """The step's drafts: chains (with, for standard rows, the drafter's
        distributions at each depth [B, depth', V]) or a ``DraftTree``."""
        if strategy.is_chain and self.drafting.fused(rows):  # catch-up + chain, one call
            return Proposal(self.drafting.fused_chain(rows, strategy.depth,
                                                      self._pending(rows, stats)))
        root_h, root_logits = self._catch_up(rows, stats)
        if strategy.is_chain:
            drafts, q_lp = self.drafting.chain(rows, strategy.depth, root_h, root_logits)
            return Proposal(drafts, q_lp)
        return Proposal(tree=self.drafting.tree(rows, strategy, root_h, root_logits))

    def committed(self, rows: Sequence, strategy: Strategy, emissions, feats: list,
                  mine=None) -> None:
        """The accepted nodes' features go to positions L.. (compaction happens in the
        engine's commit); drafted positions >= L of the drafter's cache are stale."""
        dev = self.target.device
        for i, (r, e) in enumerate(zip(rows, emissions)):
            idx = torch.tensor(e.nodes, device=dev)
            self.store(i, r.length, feats[i].index_select(0, idx))
            self.draft_len[i] = r.length
        draft_cache.trim(self.cache, self.draft_len[: len(rows)])

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
    def feed(self, rows: Sequence, stats: SpecStats,
             target_cache: Optional[KVCache] = None) -> int:
        """Feed every row's missed drafter inputs but the root (positions draft_len ..
        L-2) in one forward, so the next ``step`` feeds only the roots and costs what a
        steady speculative step costs. Returns the positions fed."""
        dev = self.target.device
        tok, feats, counts, starts = self._pending(rows, stats, root=False)
        x = self.draft.inputs(tok, feats, target_features=True)
        if self._ragged_kernels:  # ragged: rows with nothing pending add none
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
        return sum(counts)

    def _catch_up(self, rows: Sequence, stats: SpecStats) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every row's pending (tok_{p+1}, h_p) pairs; returns the root outputs
        ĥ [B, H] and draft logits [B, V_draft]."""
        dev = self.target.device
        b = len(rows)
        tok, feats, counts, starts = self._pending(rows, stats)
        x = self.draft.inputs(tok, feats, target_features=True)
        t_max = max(counts)
        if self._ragged_kernels or t_max == 1:
            # ragged: one query row per pending position, chains per cache row
            row_of, pos = ragged(counts, starts, self.target.device)
            if self._ragged_kernels:
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
