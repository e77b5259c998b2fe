"""The speculative step with the self-drafter (``self_drafter.py``): the policy's int8
copy drafts, the target verifies exactly as with the one-layer drafter.

It is ``SpeculativeDecoder`` with a token-fed drafter instead of a feature-fed one:

- the copy's KV cache (all layers) holds sequence positions 0..draft_len-1 of each row,
  the same positions as the target's cache; the root of a step is the last sampled
  token x_L fed at its own position L (the one-layer drafter feeds the pair
  (x_L, h_{L-1}) at L-1), so ``Drafting`` places drafts one position later
  (``pos_offset`` 1);
- the copy's cache takes the target's keys and values at every position the target has
  processed (``adopt``: the prompt after prefill, tokens decoded plainly, a step's
  accepted tokens), a copy of memory instead of a forward of the copy: the copy's
  forward runs only for the tokens it drafts from (the root x_L and its chain), and it
  attends over the policy's own keys and values (its drafts agree with the policy a
  little more; exactness does not depend on the drafter). Without the target's cache
  at hand the catch-up feeds the unseen tokens through the copy in one ragged forward;
- after verification the copy's cache is rolled back to the accepted run: a chain's
  drafts fed at L+1.. are kept as far as they were accepted (their keys and values are
  the accepted tokens'), a tree's nodes are not (they sit at tree slots), and the
  next step's catch-up feeds the rest, the bonus token last.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ...spec_strategy import Strategy
from ..forward import ModelRunner
from ..kv_cache import KVCache
from . import draft_cache
from .decoder import SpeculativeDecoder
from .eagle_decoder import EagleDecoder
from .proposer import Proposal
from .stats import SpecStats


class SelfDraftDecoder(EagleDecoder):
    """Self-speculation state for a running batch: the int8 copy's KV cache and, per
    cache row, how many positions of it are valid (``draft_len``)."""

    keeps_hidden = False  # no feature store: returned hidden states need their buffer

    def __init__(self, drafter, target: ModelRunner):  # drafter: a SelfDrafter
        if target.pp_size > 1:
            raise ValueError(
                "the self-drafter needs the whole model on every rank that drafts; at "
                "parallel.pipeline_model_parallel_size > 1 use rollout.pipeline_mode="
                "gathered (the default: each stage quantizes its gathered copy of the "
                "model), not the stage-to-stage pipelined mode")
        SpeculativeDecoder.__init__(self, drafter, target)
        self.draft = drafter.runner_for(target)
        self.draft.kernels = target.kernels  # (none for an FP8 copy)
        # quantize now (again only when the weights change); at PP > 1 (gathered) only
        # while the target holds its copies of the other stages' layers, else at the
        # next generate, after they are received again
        if getattr(target, "held_copy_bytes", 0) == getattr(target, "copy_bytes", 0):
            self.draft.pack_weights()
        self.drafting = self._drafting(self.draft)
        self.drafting.pos_offset = 1
        self.feature_layers = ()
        self.feature_width = 0
        self.cache = None
        self.features = None
        self.draft_len: list[int] = []
        self.target_len: list[int] = []  # per row, positions holding the target's K/V
        self.slack = 0

    # ---------------------------------------------------------------- state
    def begin(self, max_batch: int, capacity: int, slack: int, *,
              reach: Optional[int] = None, draft_rows: Optional[int] = None,
              paged=None) -> None:
        """The copy's cache for ``draft_rows`` rows (default ``max_batch``) of
        ``capacity`` positions (+ draft slack and the root; without the kernels the
        padded catch-up needs a capacity more), zeroed where a call of ``reach``
        positions can reach (None: all); paged with the target's cache ``paged``
        (``draft_cache``). The copy is fed only while the batch speculates, and
        speculating rows are the first ones (running rows are contiguous), so it needs
        no rows beyond the speculation threshold: a row past them has no copy state, and
        its catch-up takes the target's keys and values from its first position when it
        moves into them (``move_row``). Half the rows of a recipe with 16 responses per
        replica and a threshold of 8; every row of the target's cache would be a second
        target-sized cache."""
        rows = max(1, min(max_batch, draft_rows or max_batch))
        block_size = None if paged is None else paged.block_size
        self.slack = slack
        self.cache = draft_cache.make(
            self.cache, block_size=block_size, rows=rows,
            layout="bsgd" if self.draft.attention == "flash" else "bgsd",
            **self._cache_shape(max_batch, capacity, slack, reach, draft_rows, block_size))
        self.drafting.cache = self.cache
        self.draft_len = [0] * max_batch
        self.target_len = [0] * max_batch

    def release(self) -> None:
        """Free the copy's KV cache (``rollout.memory``; the next ``begin`` makes it
        again). The int8 copy itself stays: the next rollout drafts with it, re-quantized
        only if the policy changed."""
        if self.cache is not None:
            self.cache.release()

    @property
    def draft_layers(self) -> int:
        """The copy's layers: the target's (at PP > 1 in the gathered mode the copy is
        made at the first generate, after the engine sizes its caches)."""
        return len(self.draft.layers) or len(self.target.layers)

    def capture_hook(self):
        return None, None

    def paged_features(self):
        return None  # (fed tokens, it keeps no features)

    def features_of(self, hidden: torch.Tensor, got) -> torch.Tensor:
        return hidden  # not kept: the copy is fed tokens

    def store(self, row: int, first_pos: int, feats: torch.Tensor) -> None:
        pass

    def store_step(self, start: torch.Tensor, feats: torch.Tensor) -> None:
        pass

    @property
    def rows(self) -> int:
        """The copy's cache rows (``begin``; 0 before it)."""
        return 0 if self.cache is None else self.cache.max_batch

    def move_row(self, src: int, dst: int, length: int) -> None:
        if src >= self.rows or dst >= self.rows:  # no copy state there (``begin``)
            self.draft_len[dst] = self.target_len[dst] = 0
            return
        n = self.draft_len[src]
        self.cache.move_row(src, dst, n)
        self.draft_len[dst] = n
        self.target_len[dst] = min(self.target_len[src], n)

    def _check_rows(self, rows: Sequence) -> None:
        if len(rows) > self.rows:
            raise RuntimeError(f"the self-drafter's cache holds {self.rows} rows (the "
                               f"speculation threshold), but {len(rows)} rows speculate")

    def new_row(self, row: int) -> None:
        draft_cache.free_row(self.cache, row)
        self.draft_len[row] = self.target_len[row] = 0

    def adopt(self, target_cache: KVCache, rows: Sequence) -> int:
        """The target's keys and values at positions target_len .. L-1 of every row
        (everything the target has processed since) into the copy's cache: the copy is
        then fed only its root. Returns the positions copied."""
        self._check_rows(rows)
        n = 0
        for i, r in enumerate(rows):
            lo, hi = self.target_len[i], r.length
            if hi > lo:
                self.cache.copy_positions(target_cache, i, lo, hi)
                n += hi - lo
                self.target_len[i] = hi
                self.draft_len[i] = max(self.draft_len[i], hi)
        return n

    def feed(self, rows: Sequence, stats: SpecStats,
             target_cache: Optional[KVCache] = None) -> int:
        """``adopt`` when the target's cache is given, else the copy's forward over the
        missed tokens (``EagleDecoder.feed``)."""
        if target_cache is None:
            return super().feed(rows, stats)
        return self.adopt(target_cache, rows)

    # ---------------------------------------------------------------- proposing
    def propose(self, rows: Sequence, strategy: Strategy, stats: SpecStats,
                target_cache: Optional[KVCache] = None) -> Proposal:
        """The target's keys and values it has not adopted yet, then the copy's
        drafts from each row's root x_L (``EagleDecoder.propose``)."""
        if target_cache is not None:
            self.adopt(target_cache, rows)
        return super().propose(rows, strategy, stats)

    def committed(self, rows: Sequence, strategy: Strategy, emissions, feats: list,
                  mine=None) -> None:
        """Each row's copy is valid up to its root x_L and, for chains it drafted, the
        accepted drafts it was fed (d_1..d_{depth-1})."""
        fed = strategy.depth - 1 if strategy.is_chain else 0
        for i, (r, e) in enumerate(zip(rows, emissions)):
            own = fed if mine is None or mine[i] else 0
            self.draft_len[i] = r.length + 1 + min(len(e.tokens) - 1, own)
            self.target_len[i] = min(self.target_len[i], r.length)
        draft_cache.trim(self.cache, self.draft_len[: len(rows)])

    def _pending(self, rows: Sequence, stats: SpecStats, root: bool = True):
        """Every row's tokens the copy has not been fed: positions draft_len .. L (the
        last, x_L, is the root; ``root=False`` stops before it). Returns the tokens
        [N], None (no features), the row counts and their first positions."""
        counts, toks, starts = [], [], []
        for i, r in enumerate(rows):
            hi = r.length + (1 if root else 0)  # positions lo..hi-1
            lo = min(self.draft_len[i], r.length)  # the root is always fed
            hi = max(hi, lo)
            toks.extend((r.prompt + r.tokens)[lo:hi])
            counts.append(hi - lo)
            starts.append(lo)
        stats.catchup_tokens += sum(counts) - (len(rows) if root else 0)
        tok = torch.tensor(toks, dtype=torch.long, device=self.target.device)
        return tok, None, counts, starts

    def pending(self, rows: Sequence) -> int:
        """Positions the copy missed before each row's root."""
        return sum(max(0, r.length - self.draft_len[i]) for i, r in enumerate(rows))
