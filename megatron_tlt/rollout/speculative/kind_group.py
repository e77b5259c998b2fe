"""The ``group_history`` drafter kind: a suffix index over the GRPO group's responses, the
siblings in flight and finished, and earlier steps' responses to the same prompt.

In a GRPO rollout the G responses to one prompt decode in the same engine (one
replica), and in the tail the last rows' siblings have finished: their text proposes
the continuation of a row's context (its last ``max_n`` tokens) where the siblings
said the same thing. Per distinct prompt one ``SuffixIndex`` holds each response
(with the prompt's last ``max_n`` tokens before it, so a response's first tokens have
a context); the running rows' new tokens are added before each speculative step's
lookups (``observe``, O(new tokens)), a finished row's rest when it leaves the batch
(``finished``; a row never speculated is added then, once). Indices stay across
``generate`` calls, so a prompt seen at an earlier step proposes from those
responses too. Memory is bounded in tokens: ``group_tokens`` per prompt (the oldest
finished responses dropped first) and ``history_tokens`` in all (the least recently
used prompts dropped). The history is the engine's own (each replica indexes the
groups it decodes, nothing crosses ranks) and each rank's checkpoint file holds it
(``drafting_state``: every prompt's index, entry for entry, in recency order), so a
resumed run drafts what the uninterrupted run drafted.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Sequence

import torch

from .model_free import TREE_ARMS, ModelFreeDecoder, ModelFreeDrafter
from .suffix_index import SuffixIndex


class GroupHistory(ModelFreeDrafter):
    name = "group_history"
    label = "the GRPO group's responses"
    color = "tab:pink"
    arms = TREE_ARMS

    def __init__(self, *, min_n: int = 2, max_n: int = 4, per_key: int = 8,
                 group_tokens: int = 1 << 15, history_tokens: int = 1 << 18):
        self.min_n, self.max_n, self.per_key = min_n, max_n, per_key
        self.group_tokens, self.history_tokens = group_tokens, history_tokens
        self.groups: OrderedDict[tuple, SuffixIndex] = OrderedDict()
        self.next_seq = 0

    def settings(self) -> dict:
        return {"kind": self.name, "min_n": self.min_n, "max_n": self.max_n,
                "per_key": self.per_key, "group_tokens": self.group_tokens,
                "history_tokens": self.history_tokens}

    @property
    def tokens(self) -> int:
        """Tokens the history holds (all prompts)."""
        return sum(len(g) for g in self.groups.values())

    def index(self, prompt: Sequence[int]) -> SuffixIndex:
        """The prompt's index (made when new; the least recently used prompts dropped
        past ``history_tokens``)."""
        key = tuple(prompt)
        idx = self.groups.get(key)
        if idx is None:
            idx = self.groups[key] = self._new_index()
        self.groups.move_to_end(key)
        self.bound()
        return idx

    def bound(self) -> None:
        """Drop the least recently used prompts' indices (not those still decoding)
        while the history holds more than ``history_tokens`` tokens."""
        total = self.tokens
        for key in list(self.groups)[:-1]:
            if total <= self.history_tokens:
                return
            old = self.groups[key]
            if not old.live:
                total -= len(old)
                del self.groups[key]

    def drafting_state(self) -> dict:
        """The history: per prompt (least recently used first) its tokens and its
        index's ``state_dict``, with the n-gram settings it was indexed with."""
        return {"indexed": self._indexed(),
                "next_seq": self.next_seq,
                "prompts": [torch.tensor(k, dtype=torch.int64) for k in self.groups],
                "groups": [g.state_dict() for g in self.groups.values()]}

    def load_drafting_state(self, state: dict) -> None:
        """Restore ``drafting_state()``'s history: entry for entry when it was indexed
        with these n-gram lengths, else its responses indexed anew; then this
        drafter's bounds."""
        same = list(state["indexed"]) == self._indexed()
        self.groups.clear()
        self.next_seq = int(state["next_seq"])
        for prompt, g in zip(state["prompts"], state["groups"]):
            idx = self.groups[tuple(prompt.tolist())] = self._new_index()
            if same:
                idx.load_state_dict(g)
            else:
                for seq, tokens in SuffixIndex.sequences(g):
                    idx.extend(seq, tokens, live=False)
        self.bound()

    def _new_index(self) -> SuffixIndex:
        return SuffixIndex(min_n=self.min_n, max_n=self.max_n, per_key=self.per_key,
                           max_tokens=self.group_tokens)

    def _indexed(self) -> list[int]:
        """The settings an index's entries depend on."""
        return [self.min_n, self.max_n, self.per_key]

    def new_sequence(self, prompt: Sequence[int]) -> tuple[SuffixIndex, int]:
        idx = self.index(prompt)
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        idx.extend(seq, list(prompt[-self.max_n:]))
        return idx, seq

    def propose(self, tokens, depth: int) -> list[int]:
        raise NotImplementedError("the group_history kind looks rows up (its decoder's lookup)")

    def make_decoder(self, target) -> "GroupDecoder":
        return GroupDecoder(self, target)

    @classmethod
    def from_value(cls, value, **kw):
        return cls() if value == cls.name else None


class GroupDecoder(ModelFreeDecoder):
    """Per cache row, the response's entry in its group's index and how many of its
    tokens are indexed."""

    def begin(self, max_batch: int, capacity: int, slack: int, *,
              reach: Optional[int] = None, draft_rows: Optional[int] = None,
              paged=None) -> None:
        self.rows: list[Optional[list]] = [None] * max_batch  # [index, seq, indexed]

    def new_row(self, row: int) -> None:
        self.rows[row] = None

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.rows[dst] = self.rows[src]

    def _sync(self, i: int, prompt: Sequence[int], tokens: Sequence[int]) -> list:
        st = self.rows[i]
        if st is None:
            st = self.rows[i] = [*self.drafter.new_sequence(prompt), 0]
        idx, seq, n = st
        if len(tokens) > n:
            idx.extend(seq, tokens[n:])
            st[2] = len(tokens)
        return st

    def finished(self, row: int, prompt: Sequence[int], tokens: Sequence[int]) -> None:
        idx, seq, _ = self._sync(row, prompt, tokens)
        idx.finish(seq)
        self.rows[row] = None
        self.drafter.bound()

    def observe(self, rows: Sequence) -> None:
        for i, r in enumerate(rows):
            self._sync(i, r.prompt, r.tokens)

    def lookup(self, i: int, row, depth: int) -> list[list[int]]:
        m = self.drafter.max_n
        context = (list(row.prompt[-m:]) + list(row.tokens))[-m:]
        return self.rows[i][0].candidates(context, depth)
