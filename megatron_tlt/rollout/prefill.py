"""Admission prefill: the prompts of newly admitted requests into the KV cache, their
first tokens sampled (``RolloutEngine``'s ``_run`` calls ``prefill`` for every
admission).

Shared prefill (``rollout.share_prefill``). A GRPO group's G requests carry the same
prompt, and its prefill (keys, values, the last position's hidden state) is the same
for all of them: only each distinct prompt is run through the model, and the other
requests' rows get copies:

- an admission's requests are split into *sources* (the first request of a prompt no
  running row holds) and *copies* (every other request); the sources are prefilled, in
  chunks, into the rows after the running ones, and the copies take the rows after
  the sources (the admission's order is kept within each part);
- a copy's source is a source of the same admission or a running row that holds the
  prompt (an earlier admission's: with ``max_batch_size`` below the call's requests a
  group enters the batch over several admissions). A running row's first prompt-length
  cache positions hold its prompt's keys and values for as long as it runs, since
  decoding writes only beyond them;
- each copy's row gets the source's prompt positions of the KV cache
  (``KVCache.copy_row``) and of the drafter's features (``copy_prompt``; the drafter's
  own cache of a new row starts empty and catches up on the prompt, as after any
  prefill), and its first token is sampled from the source's last hidden state with the
  copy's own random stream or noise key, so it is the token the copy's own prefill
  would give;
- ``SharedPrompts`` keeps the last hidden state of every prompt that a running row
  holds (one [hidden] vector each, dropped when the prompt's last row finishes): a
  prompt whose rows have all finished is prefilled again.

Every rank of a TP group and every stage of a pipelined replica makes the same choices
(they follow the prompts and the agreed tokens); each copies its own shard or layers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import torch

from .kv_cache import KVCache
from .outputs import GenerateStats

if TYPE_CHECKING:
    from .speculative.controller import SpeculationController


class SharedPrompts:
    """One call's prompts held by running rows: prompt -> the hidden state at the
    prompt's last position [hidden] (its first token's logits are computed from it).
    A prompt is known by a small id, given once per request (its tokens are hashed
    once, not at every admission)."""

    def __init__(self) -> None:
        self.last_hidden: dict[int, torch.Tensor] = {}
        self._ids: dict[tuple[int, ...], int] = {}  # prompt tokens -> id
        self._of: dict[int, int] = {}  # request -> its prompt's id

    def id_of(self, r) -> int:
        """The id of request ``r``'s prompt."""
        i = self._of.get(r.request)
        if i is None:
            i = self._of[r.request] = self._ids.setdefault(tuple(r.prompt), len(self._ids))
        return i

    def held_by(self, rows: Sequence) -> dict[int, int]:
        """Prompt id -> a running row holding it (and its last hidden state); forgets
        the prompts no running row holds."""
        live: dict[int, int] = {}
        for i, r in enumerate(rows):
            live.setdefault(self.id_of(r), i)
        self.last_hidden = {k: v for k, v in self.last_hidden.items() if k in live}
        return {k: i for k, i in live.items() if k in self.last_hidden}


def plan(admitted: Sequence, prompt_id, held: dict) -> tuple[list, list]:
    """Split ``admitted`` into the requests to prefill and the copies: (sources, [(row,
    source)]), a source being ("new", index into sources) or ("live", running row);
    ``prompt_id(r)`` names a request's prompt, ``held`` maps the ids running rows hold
    to such a row."""
    sources, copies, first = [], [], {}
    for r in admitted:
        key = prompt_id(r)
        if key not in first:
            if key in held:
                first[key] = ("live", held[key])
            else:
                first[key] = ("new", len(sources))
                sources.append(r)
                continue
        copies.append((r, first[key]))
    return sources, copies


def prefill(runner, cache: KVCache, rows: list, admitted: list,
            hidden_buf: Optional[torch.Tensor], stats: GenerateStats,
            ctl: Optional["SpeculationController"],
            shared: Optional[SharedPrompts], *, emit, prefill_tokens: int) -> list:
    """Prefill ``admitted`` into rows len(rows).. and sample their first tokens; with
    ``shared`` (rollout.share_prefill) each distinct prompt that no running row holds
    once, the other requests by copy. Returns the admitted requests in the order they
    now occupy the rows. ``emit(rows, first_row, hidden, hidden_buf)`` samples their
    first tokens (the engine's sampling); ``prefill_tokens``: padded tokens per chunk."""
    lo = len(rows)
    chunks = lambda reqs: _prefill_chunks(  # noqa: E731
        runner, cache, lo, reqs, hidden_buf, stats, ctl, emit, prefill_tokens)
    if shared is None:
        chunks(admitted)
        return list(admitted)
    sources, copies = plan(admitted, shared.id_of, shared.held_by(rows))
    last = chunks(sources)
    for r, h in zip(sources, last):
        shared.last_hidden[shared.id_of(r)] = h
    if not copies:
        return sources
    first_copy = lo + len(sources)
    targets: dict[tuple, list[int]] = {}  # source -> the rows copying it
    for j, (_, src) in enumerate(copies):
        targets.setdefault(src, []).append(first_copy + j)
    for (kind, i), dst in targets.items():
        src_row, n = (lo + i, len(sources[i].prompt)) if kind == "new" else \
            (i, len(rows[i].prompt))
        cache.copy_row(src_row, torch.tensor(dst, device=runner.device), n)
        if ctl is not None:
            ctl.copy_prompt(src_row, dst, n)
    copied = [r for r, _ in copies]
    hidden = torch.stack([shared.last_hidden[shared.id_of(r)] for r in copied])
    emit(copied, first_copy, hidden, hidden_buf)
    stats.prefill_shared_rows += len(copied)
    return sources + copied


def _pack(seqs: list, prefill_tokens: int) -> list[list[int]]:
    """Indices of ``seqs`` in chunks of at most ``prefill_tokens`` padded tokens (greedy,
    in order; a longer sequence is a chunk of its own)."""
    chunks: list[list[int]] = [[]]
    for i, s in enumerate(seqs):
        width = max([len(seqs[j]) for j in chunks[-1]] + [len(s)])
        if chunks[-1] and (len(chunks[-1]) + 1) * width > prefill_tokens:
            chunks.append([])
        chunks[-1].append(i)
    return [c for c in chunks if c]


def _forward(runner, cache, lo: int, seqs: list, ctl, stats: GenerateStats) -> torch.Tensor:
    """``seqs`` (token lists) into rows lo.. from position 0 (their blocks reserved
    first); the drafter's inputs stored. Returns the hidden states [n, T, hidden]."""
    dev = runner.device
    n, t = len(seqs), max(len(s) for s in seqs)
    cache.reserve_rows([(lo + j, len(s)) for j, s in enumerate(seqs)])
    ids = torch.zeros(n, t, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, : len(s)] = torch.tensor(s)
    ids = ids.to(dev)
    start = torch.zeros(n, dtype=torch.long, device=dev)
    hook, got = ctl.capture() if ctl is not None else (None, None)
    hidden = runner.extend(cache, slice(lo, lo + n), ids, start, capture=hook)
    if ctl is not None:  # the drafter's inputs at every position fed
        ctl.store_prompts(lo, [len(s) for s in seqs], hidden, got)
    stats.prefill_tokens += n * t
    return hidden


def _prefill_chunks(runner, cache: KVCache, lo: int, requests: list,
                    hidden_buf: Optional[torch.Tensor], stats: GenerateStats,
                    ctl: Optional["SpeculationController"], emit,
                    prefill_tokens: int) -> list[torch.Tensor]:
    """Prefill ``requests`` into rows lo.. in chunks of at most ``rollout.prefill_tokens``
    padded tokens; sample their first tokens. Returns each one's hidden state at its
    last prompt position [hidden]."""
    last_hidden: list[torch.Tensor] = []
    dev = runner.device
    for idx in _pack([r.prompt for r in requests], prefill_tokens):
        chunk = [requests[i] for i in idx]
        n = len(chunk)
        hidden = _forward(runner, cache, lo, [r.prompt for r in chunk], ctl, stats)
        last = torch.tensor([len(r.prompt) - 1 for r in chunk], device=dev)
        h = hidden[torch.arange(n, device=dev), last]  # [n, hidden], its own storage
        emit(chunk, lo, h, hidden_buf)
        last_hidden.extend(h.unbind(0))
        lo += n
    return last_hidden


def recompute(runner, cache: KVCache, lo: int, resumed: list, stats: GenerateStats,
              ctl: Optional["SpeculationController"], prefill_tokens: int) -> None:
    """Preempted requests back into rows lo..: each one's prompt and tokens but the last
    (its ``length`` positions) prefilled again, nothing sampled (the next decode step
    feeds its last token, as before it was preempted)."""
    seqs = [(r.prompt + r.tokens)[: r.length] for r in resumed]
    for idx in _pack(seqs, prefill_tokens):
        _forward(runner, cache, lo, [seqs[i] for i in idx], ctl, stats)
        lo += len(idx)
