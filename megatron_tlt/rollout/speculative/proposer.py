"""The proposer interface: what a drafter kind's decoder implements. A proposer only
proposes; ``decoder.SpeculativeDecoder`` verifies and commits for every kind.

Given the running rows' state (row i is cache row i: ``.length``, ``.prompt``,
``.tokens``, ``.params``, ``.stream``, ``.key``) and the step's strategy, ``propose``
returns a ``Proposal``: per row a chain of draft tokens with, for standard rows, the
distribution q each was drawn from (a deterministic proposal's q is one-hot: the
chain rule then accepts draft x with probability p~(x) and resamples p~ without x), or
a tree of candidates (``DraftTree``: deterministic drafts, children tried in order).
After verification the proposer is told what was accepted (``committed``): the
emissions (accepted drafts and the next token, with the verified node each came from)
and the target's features at every verified node. Everything else a proposer answers
is its per-row state kept in step with the engine's rows (prefill, plain steps, row
moves) and its catch-up (``feed``: the positions it missed while rows decoded
plainly). The defaults below are a stateless proposer's (a lookup needs none of it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .drafting import DraftTree


@dataclass
class Proposal:
    """A step's drafts for every row: ``drafts`` (per row a chain, maybe empty) with
    ``q_lp`` (standard rows present: the drafts' distributions [B, depth', V] over the
    full vocabulary, one-hot for a deterministic proposal; else None), or ``tree``
    (every row's candidates; a row's unused node slots are no node's children)."""

    drafts: Optional[list[list[int]]] = None
    q_lp: Optional[torch.Tensor] = None
    tree: Optional[DraftTree] = None
    # several proposers in one step (``multi.KindDecoder``): per row, whether the
    # proposer told by ``committed`` drafted it (None: it drafted every row)
    mine: Optional[list[bool]] = None


class Proposer:
    """The proposing half of a kind's decoder, with a stateless proposer's defaults."""

    # the feature store holds the target's final hidden states (``rollout.memory``
    # returns the response's hidden states from there): feature-fed kinds only
    keeps_hidden = False
    feature_layers: tuple = ()
    features = None  # per cache row and position, the target's features (or None)
    cache = None  # the proposer's own KV cache (or None)
    min_draft_prob = 0.0  # chains stop below this cumulative draft probability

    # ---------------------------------------------------------------- proposing
    def propose(self, rows: Sequence, strategy, stats, target_cache=None) -> Proposal:
        """The step's drafts for rows 0..len(rows)-1 (``strategy``: depth, top-k and
        verified tokens at most; ``target_cache``: the target's KV cache, which a
        token-fed proposer may copy from)."""
        raise NotImplementedError

    def committed(self, rows: Sequence, strategy, emissions, feats: list,
                  mine: Optional[Sequence[bool]] = None) -> None:
        """After verification (before the engine's commit: ``rows[i].length`` is still
        L): ``emissions[i]`` the row's accepted drafts and next token with their
        verified nodes, ``feats[i]`` the target's features at each verified node;
        ``mine[i]``: whether row i's drafts were this proposer's (None: all were)."""

    # ---------------------------------------------------------------- per-row state
    def pack_weights(self) -> tuple[int, float]:
        """Weights brought up to date at the start of a call: (refreshes, seconds)."""
        return 0, 0.0

    def wire_graphs(self, graphs) -> None:
        self.graphs = graphs  # verification through the engine's graphs (None: eager)

    def graph_decisions(self) -> dict[str, dict]:
        return {}

    def begin(self, max_batch: int, capacity: int, slack: int, *,
              reach: Optional[int] = None, draft_rows: Optional[int] = None,
              paged=None) -> None:
        """Before a call: state for ``max_batch`` rows of ``capacity`` positions
        (``paged``: the target's cache when it is paged; a proposer's own cache pages
        too, in its blocks' size)."""

    def paged_features(self):
        """(width, dtype) of the per-position features it keeps, which a paged target
        cache holds in its blocks (None: none)."""
        return None

    def paged_kv_bytes(self, max_batch: int, capacity: int, slack: int, draft_rows: int,
                       block_size: int) -> int:
        """Bytes of the proposer's own paged KV cache for such a call (0: none), which
        the engine counts in ``rollout.kv_cache_gib``."""
        return 0

    def kv_bytes_in_use(self) -> int:
        """Bytes of its own KV cache that rows hold now (paged: their blocks)."""
        return 0

    def reserve(self, rows: Sequence) -> None:
        """Before a speculative step: room in its own cache for what ``rows`` may write."""

    def drop_row(self, row: int) -> None:
        """Cache row ``row`` left the batch (finished or preempted; the last running row
        then moves into it, ``move_row``)."""

    def release(self) -> None:
        """Free the rollout's caches (``rollout.memory``)."""

    def capture_hook(self):
        """A target forward's ``capture`` hook and what it collects ((None, None))."""
        return None, None

    def features_of(self, hidden: torch.Tensor, got) -> torch.Tensor:
        return hidden

    def store(self, row: int, first_pos: int, feats: torch.Tensor) -> None:
        """Target features [T, F] of positions first_pos.. of cache row ``row``."""

    def store_step(self, start: torch.Tensor, feats: torch.Tensor) -> None:
        """Target features [B, 1, F] of a plain decode step at positions ``start``."""

    def new_row(self, row: int) -> None:
        """Cache row ``row`` holds a new sequence (just prefilled)."""

    def copy_prompt(self, src: int, dst: list[int], length: int) -> None:
        for row in dst:
            self.new_row(row)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Cache row ``src`` (``length`` positions) moved to ``dst``."""

    def finished(self, row, prompt: Sequence[int], tokens: Sequence[int]) -> None:
        """A sequence left the running batch (cache row ``row``) with its response
        ``tokens``."""

    def pending(self, rows: Sequence) -> int:
        """Positions the proposer missed (decoded plainly), not counting the roots."""
        return 0

    def feed(self, rows: Sequence, stats, target_cache=None) -> int:
        """Feed what ``pending`` counts (the catch-up); returns the positions fed."""
        return 0
