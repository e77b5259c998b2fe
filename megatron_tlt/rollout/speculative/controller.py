"""The rollout engine's one interface to speculation during a ``generate`` call.

``SpeculationController`` owns the tuner's protocol and the drafter's inputs: per
decode step the engine makes one call, ``decode_step``, which asks the tuner for the
step's strategy (``StrategyTuner.decide``), runs either a speculative step (the
drafter's catch-up, then ``SpeculativeDecoder.step``) or the engine's plain step
(whose target features it keeps for the drafter), times it and reports it back
(``StrategyTuner.record``) and into ``SpecStats``. Prefill, shared prefills and row moves
go through it too (``capture`` / ``store_prompts``, ``copy_prompt``, ``move_row``), so
the drafter's feature store is written only here and in the decoder.

Engine -> controller -> decoder: a decode step reads through these three files.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import torch

from ...spec_strategy import Strategy
from . import position_accept
from ..kv_cache import KVCache
from .decision import Outcome
from .drafter_kind import draft_slack
from .decoder import SpeculativeDecoder
from .emissions import Emission, Verified
from .stats import KindSteps, SpecStats
from .tuner import StrategyTuner

# The engine's plain decode step: given a capture hook (None, or one collecting the
# drafter's EAGLE-3 feature layers) it runs the target over every row's last token,
# emits one token per row, and returns the target's hidden states [B, 1, H] and the
# positions they were computed at [B].
PlainStep = Callable[[Optional[Callable]], tuple[torch.Tensor, torch.Tensor]]
# The engine's commit of a speculative step: given the decoder's emissions and the
# verify forward's outputs over every row's nodes (hidden states, logits, processed
# log-probs), it emits each row's tokens (stop tokens and length limits cut the run)
# and returns how many each row kept.
Commit = Callable[[list[Emission], Verified], list[int]]


class SpeculationController:
    """Speculation for one ``generate`` call: ``decoder`` (the drafter and its state)
    decoding at most ``threshold`` rows speculatively, ``tuner`` choosing the strategy
    per step; ``tp_times(*seconds)`` gives TP rank 0's measured times on every rank
    (the tuner's decisions follow measured times, and TP ranks must take the same
    ones); ``tuner_state``: a file the tuner is saved to after the call ('' = none)."""

    def __init__(self, decoder: SpeculativeDecoder, tuner: StrategyTuner, *,
                 threshold: int, tuner_state: str = "",
                 tp_times: Callable[..., list[float]] = lambda *v: list(v)) -> None:
        self.decoder = decoder
        self.tuner = tuner
        self.threshold = threshold
        self.tuner_state = tuner_state
        self.tp_times = tp_times
        self.stats = SpecStats()
        self.t_begin = time.perf_counter()  # the kind timeline's origin (``begin``)

    # ------------------------------------------------------------ the call
    @property
    def slack(self) -> int:
        """Cache slots beyond a sequence's length that drafting/verification may use."""
        return draft_slack(self.tuner.all_arms())

    def begin(self, max_batch: int, capacity: int, reach: Optional[int] = None,
              paged=None) -> SpecStats:
        """Before the call's first step: the drafter's weights and caches for
        ``max_batch`` rows of ``capacity`` positions, of which the call reaches
        ``reach`` (zeroed; None: all); ``paged``: the target's cache when it is paged
        (the drafters' caches then page too, their features in its blocks). A drafter that only drafts keeps cache rows for the batches
        that speculate: ``threshold`` rows at most. Returns the call's ``SpecStats``."""
        self.t_begin = time.perf_counter()
        refreshed, seconds = self.decoder.pack_weights()  # a quantized copy re-made here
        if refreshed:
            self.stats.drafter_refreshes += 1
            self.stats.drafter_refresh_seconds += seconds
        self.decoder.begin(max_batch, capacity, self.slack, reach=reach,
                           draft_rows=self.draft_rows(max_batch), paged=paged)
        for d in self.decoder.each():  # free kinds are reported where they proposed
            if d.drafter.free:  # nothing too (their tokens by kind: 0)
                self.stats.kinds.setdefault(d.kind, KindSteps())
        return self.stats

    def draft_rows(self, max_batch: int) -> int:
        """The rows a drafter's own cache holds: those of batches that speculate."""
        return min(max_batch, self.threshold)

    def paged_kv_bytes(self, max_batch: int, capacity: int, block_size: int) -> int:
        """Bytes of the drafters' paged caches for a call of ``max_batch`` rows of
        ``capacity`` positions (``begin`` with ``block_size``)."""
        return self.decoder.paged_kv_bytes(max_batch, capacity, self.slack,
                                           self.draft_rows(max_batch), block_size)

    def paged_features(self):
        """(width, dtype) of the features a drafter keeps per position, which the
        target's paged cache holds in its blocks (None: none)."""
        return self.decoder.paged_features()

    def finish(self) -> None:
        """After the call's last step: the gate's state into the stats, and the tuner's
        state saved where configured."""
        if self.tuner.break_even:
            self.stats.gate = self.tuner.gate_stats()
        if self.tuner_state:
            self.tuner.save(self.tuner_state)

    # ------------------------------------------------------------ rows
    def capture(self):
        """A target forward's ``capture`` hook and what it collects (the drafter's
        EAGLE-3 feature layers; (None, None) without)."""
        return self.decoder.capture_hook()

    def store_prompts(self, first_row: int, prompt_lengths: Sequence[int],
                      hidden: torch.Tensor, got) -> None:
        """The drafter's inputs at every prompt position of rows first_row.. (just
        prefilled; ``hidden`` [n, T, H] and what ``capture`` collected)."""
        feats = self.decoder.features_of(hidden, got)
        for j, n in enumerate(prompt_lengths):
            self.decoder.new_row(first_row + j)
            self.decoder.store(first_row + j, 0, feats[j, :n])

    def copy_prompt(self, src: int, dst: list[int], length: int) -> None:
        """Rows ``dst`` got a copy of the ``length``-token prompt of row ``src`` (shared
        prefill): the drafter's inputs at those positions too."""
        self.decoder.copy_prompt(src, dst, length)

    def move_row(self, src: int, dst: int, length: int) -> None:
        """Cache row ``src`` (``length`` positions) moved to ``dst``."""
        self.decoder.move_row(src, dst, length)

    def remove_row(self, row: int, last: int, length: int) -> None:
        """Cache row ``row`` left the batch (finished or preempted; its drafter state
        dropped, a paged cache's blocks returned) and the last running row ``last``
        (``length`` positions) moved into its place (``scheduler.remove_row``)."""
        self.decoder.drop_row(row)
        if last != row:
            self.decoder.move_row(last, row, length)

    def finished(self, row: int, prompt, tokens) -> None:
        """The sequence in cache row ``row`` finished with response ``tokens`` (a
        proposer that drafts from other rows' responses keeps them)."""
        self.decoder.finished(row, prompt, tokens)

    # ------------------------------------------------------------ a decode step
    def kind(self) -> str:
        """The drafter kind of the step just decided (``KindTuner``'s choice with
        several kinds)."""
        return self.decoder.active_kind()

    def decode_step(self, cache: KVCache, rows: Sequence, t0: float, plain: PlainStep,
                    commit: Commit, record_step: Callable[[float, bool], None]) -> None:
        """One decode step for the running ``rows`` (started at ``t0``): speculative or
        plain as the tuner decides (plain above the threshold), timed and recorded
        (``record_step(seconds, speculative)``: the engine's per-step stats)."""
        b = len(rows)
        decision = (self.tuner.decide(b, self.decoder.pending(rows)) if b <= self.threshold
                    else None)
        if decision is not None and decision.strategy.is_off:
            # declined: free kinds' matches may still speculate alone on their rows
            decision = self.decoder.alone(rows, decision, self.tuner) or decision
        label = self.tuner.bucket_label(decision.bucket) if decision is not None else ""
        if decision is not None and not decision.strategy.is_off:
            # what the drafter missed (plain steps, new rows) is fed first and timed
            # apart: a switching cost, not a property of the strategy
            costs = self.stats.costs()
            t1 = time.perf_counter()
            fed = self.decoder.catch_up(rows, self.stats, cache)
            switch = time.perf_counter() - t1 if fed else 0.0
            emitted, accepted = self._speculate(cache, rows, decision.strategy, label,
                                                commit)
            seconds, switch = self.tp_times(time.perf_counter() - t0, switch)
            # the step's time measured like a plain step's, the switching cost apart
            self.tuner.record(decision, Outcome(b, emitted, seconds - switch, accepted,
                                                switch, fed))
            self.stats.record_tuned(label, declined=False, probe=decision.probe, rows=b,
                                    tokens=emitted, seconds=seconds)
            kind = self.kind()
            self.stats.record_kind(kind, label, decision.strategy, probe=decision.probe,
                                   rows=b, emitted=emitted, seconds=seconds,
                                   costs_before=costs)
            self.stats.mark(t0 - self.t_begin, time.perf_counter() - self.t_begin, kind)
            record_step(seconds, True)
            return
        hook, got = self.capture()
        hidden, start = plain(hook)
        # the drafter's input at this position, for later
        self.decoder.store_step(start, self.decoder.features_of(hidden, got))
        seconds = time.perf_counter() - t0
        record_step(seconds, False)
        seconds = self.tp_times(seconds)[0]  # TP ranks feed their tuners the same times
        if decision is not None:  # the tuner chose not to speculate: reward it too
            self.tuner.record(decision, Outcome(b, b, seconds))
            name = decision.strategy.name
            self.stats.arms[name] = self.stats.arms.get(name, 0) + 1
            self.stats.record_tuned(label, declined=True, probe=decision.probe, rows=b,
                                    tokens=b, seconds=seconds)
            self.stats.record_kind(self.kind(), label, decision.strategy,
                                   probe=decision.probe, rows=b, emitted=b, seconds=seconds)
            self.stats.mark(t0 - self.t_begin, time.perf_counter() - self.t_begin, "plain")
        else:  # above the threshold: plain decoding's reference time
            self.tuner.observe_plain(b, seconds)
            self.stats.mark(0.0, 0.0, None)

    def _speculate(self, cache: KVCache, rows: Sequence, strategy: Strategy, label: str,
                   commit: Commit) -> tuple[int, list[int]]:
        """Draft, verify, emit (``commit``) and rewind for every running row. Returns
        the number of tokens emitted and each row's accepted draft count."""
        lengths = [r.length for r in rows]
        positions = [len(r.tokens) for r in rows]  # response tokens so far
        emissions, verified = self.decoder.step(cache, rows, strategy, self.stats)
        emitted = commit(emissions, verified)
        for i, (length, e, m) in enumerate(zip(lengths, emissions, emitted)):
            self.decoder.compact(cache, i, length, e.nodes[1:m])
        accepted = [len(e.tokens) - 1 for e in emissions]
        self.stats.record(strategy, label, accepted, emitted)
        self.stats.record_rows(self.decoder.kinds_of_rows(len(rows)), emitted)
        position_accept.record(self.stats.by_position, positions, emitted)
        return sum(emitted), accepted
