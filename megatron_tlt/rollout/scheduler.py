"""The rollout's scheduler: one ``generate`` call's queue and running rows.

The engine (``engine.py``) is three parts: this scheduler (which requests run,
admission, preemption, retirement), the KV manager (the cache: ``kv_cache.KVCache``'s
fixed slots or ``kv_paged.PagedKVCache``'s blocks, with ``kv_blocks.BlockPool``'s
tables and sharing; made by ``memory.RolloutMemory``) and the model runner (the
engine's step functions over ``forward.ModelRunner``: forward, sampling, speculation).

Rows 0..n-1 of the cache are the n running requests (a finished row's place is taken
by the last running row, so the running batch is a contiguous slice). With fixed slots
a request is admitted while rows are free. With the paged cache it is admitted while
rows are free (``rollout.max_batch_size``, the most rows in flight) and the pool has the
blocks its prompt and first step need (a prompt another row of the call holds costs
only its partly filled last block: ``BlockPool.share``). Before every decode step every
row reserves the positions the step may write (one, or k + 1 and the draft slack with
speculation); when the pool lacks them the newest row is preempted: its blocks return
to the pool and it goes back to the head of the queue with its tokens so far, to be
recomputed (its prompt and tokens prefilled again, nothing sampled) when blocks are
free. Sampling draws from per-(request, position) randomness, so its output does not
change.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from .kv_blocks import blocks_for
from .outputs import GenerateStats, RolloutOutput
from .sampling import SamplingParams


@dataclass
class Row:
    """A request in the running batch (or preempted, waiting to be recomputed)."""

    request: int
    params: SamplingParams
    stream: Optional[int]  # standard sampling: the request's stream key (else None)
    length: int  # positions held in the cache
    prompt: list[int]
    key: Optional[int] = None  # coupled sampling: the request's noise key (else None)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    seq: int = 0  # admission order (the newest row is preempted first)
    saved_hidden: Optional[torch.Tensor] = None  # a preempted row's response hidden states


class Scheduler:
    """The queue and running rows of one call over ``cache`` (at most ``max_rows``
    running). ``finish_reason(row)``: why a row is done (None: running);
    ``slack``: positions a step may write past a row's length (speculation);
    ``shared`` (``prefill.SharedPrompts``, rollout.share_prefill): the prompts running
    rows hold, whose full blocks a new row shares."""

    def __init__(self, cache, rows: list, max_rows: int, stats: GenerateStats, *,
                 slack: int = 0, shared=None, remove: Optional[Callable[[int], Row]] = None):
        self.cache, self.rows, self.max_rows, self.stats = cache, rows, max_rows, stats
        self.slack, self.shared, self.remove = slack, shared, remove
        self.queue: deque = deque()
        self.waiting: dict[int, Row] = {}  # preempted requests, by request index
        self._seq = 0
        # after a preemption nothing is admitted until a row has finished (a preempted
        # row re-admitted at once would be preempted again at the next step: thrashing)
        self._hold_at: Optional[int] = None

    # ---------------------------------------------------------------- admission
    def admit(self, make_row: Callable[[int], Row]) -> tuple[list[Row], list[Row]]:
        """Take queued requests into free rows: (new rows, preempted rows to recompute),
        in queue order while rows (and, paged, blocks) are free. The first request is
        always taken when nothing runs (the budget holds one full row)."""
        fresh: list[Row] = []
        resumed: list[Row] = []
        if self._hold_at is not None:
            if self.rows and len(self.rows) >= self._hold_at:
                return fresh, resumed
            self._hold_at = None
        paged = self.cache.paged
        free = self.cache.pool.free_count if paged else 0
        held = set(self.shared.held_by(self.rows)) if (paged and self.shared) else set()
        while self.queue and len(self.rows) + len(fresh) + len(resumed) < self.max_rows:
            i = self.queue[0]
            r = self.waiting.get(i) or make_row(i)
            if paged:
                need = self._blocks_needed(r, held, i in self.waiting)
                if need > free and (self.rows or fresh or resumed):
                    break
                free -= need
            self.queue.popleft()
            r.seq = self._seq
            self._seq += 1
            if i in self.waiting:
                resumed.append(self.waiting.pop(i))
            else:
                fresh.append(r)
        return fresh, resumed

    def _blocks_needed(self, r: Row, held: set, resumed: bool) -> int:
        """Blocks row ``r`` takes by its first step (a prompt a running or just admitted
        row holds: only what is not a full prompt block)."""
        bs = self.cache.block_size
        need = blocks_for(r.length + 1 + self.slack, bs)
        if not resumed and self.shared is not None:
            pid = self.shared.id_of(r)
            if pid in held:
                need -= len(r.prompt) // bs
            held.add(pid)
        return min(need, self.cache.max_blocks_per_row)

    # ---------------------------------------------------------------- a step
    def prepare_step(self) -> None:
        """Blocks for the positions the next step writes, for every running row;
        preempts the newest rows (``remove(i)`` takes row i out of the batch) until
        the rest fit. Then the table is on the device (one host-to-device copy)."""
        c = self.cache
        if not c.paged:
            return
        while True:
            needs = [(i, r.length + 1 + self.slack) for i, r in enumerate(self.rows)]
            if c.can_reserve(needs):
                break
            if len(self.rows) == 1:  # the budget holds one full row: not reached
                raise RuntimeError("one row does not fit in the KV block budget "
                                   "(rollout.kv_cache_gib)")
            newest = max(range(len(self.rows)), key=lambda i: self.rows[i].seq)
            r = self.remove(newest)
            self.waiting[r.request] = r
            self.queue.appendleft(r.request)
            self.stats.preemptions += 1
            self._hold_at = len(self.rows)
        c.reserve_rows(needs)
        c.pool.flush()
        self.stats.note_blocks(c.pool.used, len(self.rows), c.block_nbytes)

    def after_step(self) -> None:
        """Return the blocks past each row's positions (a speculative step's rollback)."""
        if self.cache.paged and self.slack:
            for i, r in enumerate(self.rows):
                self.cache.trim(i, r.length)


def remove_row(cache, rows: list, i: int, hidden_buf: Optional[torch.Tensor],
               drafter: Optional[Callable[[int, int, int], None]]) -> Row:
    """Take running row ``i`` out of the batch: its blocks returned (paged), the last
    running row moved into its place (cache, hidden buffer; ``drafter(i, last,
    length)``: the drafters' rows, ``SpeculationController.remove_row``). Returns it."""
    r = rows[i]
    cache.free_row(i)
    last = len(rows) - 1
    if drafter is not None:
        drafter(i, last, rows[last].length)
    if i != last:
        moved = rows[last]
        cache.move_row(last, i, moved.length)
        if hidden_buf is not None:
            hidden_buf[i, : len(moved.tokens)] = hidden_buf[last, : len(moved.tokens)]
        rows[i] = moved
    rows.pop()
    return r


def retire(cache, rows: list, outputs: list, finish_reason: Callable[[Row], Optional[str]],
           response_hidden: Callable, hidden_buf: Optional[torch.Tensor],
           drafter: Optional[Callable[[int, int, int], None]],
           finished: Optional[Callable[[int, list, list], None]] = None) -> None:
    """Move finished rows to ``outputs`` (``response_hidden(i, row)``: their hidden
    states copied out; ``finished(i, prompt, tokens)``: speculation told, e.g. the group
    history's index); the running rows stay contiguous."""
    i = 0
    while i < len(rows):
        r = rows[i]
        reason = finish_reason(r)
        if reason is None:
            i += 1
            continue
        outputs[r.request] = RolloutOutput(r.request, r.prompt, r.tokens, r.logprobs,
                                           reason, response_hidden(i, r),
                                           cache.row_routes(i, r.length))
        if finished is not None:
            finished(i, r.prompt, r.tokens)
        remove_row(cache, rows, i, hidden_buf, drafter)


def save_hidden(r: Row, hidden_buf: Optional[torch.Tensor], i: int) -> None:
    """A preempted row keeps its response hidden states (row ``i`` of the buffer)."""
    if hidden_buf is not None and r.tokens:
        r.saved_hidden = hidden_buf[i, : len(r.tokens)].clone()


def restore_hidden(rows: Sequence[Row], first: int, hidden_buf: Optional[torch.Tensor]) -> None:
    """Recomputed rows (from row ``first``) get their saved hidden states back."""
    for j, r in enumerate(rows):
        if hidden_buf is not None and r.saved_hidden is not None:
            hidden_buf[first + j, : r.saved_hidden.shape[0]] = r.saved_hidden
        r.saved_hidden = None
