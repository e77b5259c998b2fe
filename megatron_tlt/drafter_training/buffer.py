"""The drafter group's training data: finished responses with the features decoding saw.

For every finished response a replica keeps the tokens (prompt + response), the target
features the engine returned while decoding it (``RolloutOutput.hidden_states``: row i
is the hidden state at the position whose logits produced response token i), the
response mask and the RL step it came from. Training pairs are taken from the response
segment, exactly as decoding pairs them (``drafter_pairs``): at position p the drafter
reads (s_{p+1}, h_p) and learns h_{p+1}.

    buf = DataBuffer(budget_tokens=65536)
    buf.add(step, [BufferedResponse.from_output(out, step) for out in outputs])
    for batch in buf.batches(batch_tokens=1024, seed=window):   # lists of DraftSample
        ...

- One-step offset: records of the current and the previous step are kept, so a replica
  that finishes early this step still trains on last step's long responses (which this
  step's early finishers by definition lack).
- Token budget: the feature rows held (CPU memory ~ rows x hidden x dtype size) never
  exceed ``budget_tokens``; the oldest records go first.
- Batches: responses are bin-packed by length into batches of at most ``batch_tokens``
  padded tokens, one response per row, so no response attends to another.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch

from .trainer import DraftSample

__all__ = ["BufferedResponse", "DataBuffer"]


@dataclass
class BufferedResponse:
    tokens: list[int]          # prompt + response
    prompt_len: int
    features: torch.Tensor     # [R, F]: row i at position prompt_len - 1 + i
    step: int

    def __post_init__(self):
        r = len(self.tokens) - self.prompt_len
        if self.prompt_len < 1 or r < 0 or self.features.shape[0] != r:
            raise ValueError(f"a buffered response needs a prompt and one feature row per "
                             f"response token: prompt {self.prompt_len}, response {r}, "
                             f"feature rows {self.features.shape[0]}")

    @classmethod
    def from_output(cls, out, step: int) -> "BufferedResponse":
        """From a ``RolloutOutput`` generated with ``return_hidden_states=True``."""
        if out.hidden_states is None:
            raise ValueError("the rollout output has no hidden states; generate with "
                             "SamplingParams(return_hidden_states=True)")
        return cls(list(out.prompt_token_ids) + list(out.token_ids),
                   len(out.prompt_token_ids), out.hidden_states, step)

    @property
    def response_mask(self) -> torch.Tensor:
        """[len(tokens)] bool: True at response tokens."""
        m = torch.zeros(len(self.tokens), dtype=torch.bool)
        m[self.prompt_len:] = True
        return m

    @property
    def rows(self) -> int:
        return int(self.features.shape[0])

    def draft_sample(self) -> DraftSample:
        """The response segment as a ``DraftSample``: tokens s_{P-1}..s_{N-2} with their
        features h_{P-1}..h_{N-2}, so ``drafter_pairs`` yields (s_{p+1}, h_p) -> h_{p+1}
        for p = P-1..N-3, every prediction a response token (s_{p+2})."""
        p = self.prompt_len
        seg = self.tokens[p - 1: len(self.tokens) - 1]
        return DraftSample(tokens=seg, prompt_len=1, features=self.features,
                           final_hidden=self.features)


class DataBuffer:
    """Finished responses of the current and previous RL step within a token budget."""

    def __init__(self, budget_tokens: int, *, keep_steps: int = 2):
        if budget_tokens < 1 or keep_steps < 1:
            raise ValueError("DataBuffer needs budget_tokens >= 1 and keep_steps >= 1")
        self.budget = int(budget_tokens)
        self.keep_steps = int(keep_steps)
        self._items: deque[BufferedResponse] = deque()
        self.tokens = 0  # feature rows held
        self.dropped = 0  # records evicted or refused for the budget

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self):
        return iter(self._items)

    @property
    def steps(self) -> list[int]:
        return sorted({r.step for r in self._items})

    def add(self, step: int, responses: Sequence[BufferedResponse]) -> None:
        """Add this step's responses; drop steps older than ``keep_steps`` and then the
        oldest records until the budget holds. Responses with fewer than two feature
        rows give no training pair and are skipped."""
        while self._items and self._items[0].step <= step - self.keep_steps:
            self._pop()
        for r in responses:
            if r.rows < 2:
                continue
            if r.rows > self.budget:
                self.dropped += 1
                continue
            self._items.append(r)
            self.tokens += r.rows
        while self.tokens > self.budget:
            self._pop()
            self.dropped += 1

    def _pop(self) -> None:
        r = self._items.popleft()
        self.tokens -= r.rows

    def sample(self, n: int) -> list[BufferedResponse]:
        """The ``n`` newest records (the canary's sequences)."""
        return list(self._items)[-n:] if n > 0 else []

    def plan(self, batch_tokens: int) -> list[list[int]]:
        """Record indices bin-packed by length: each batch's rows x longest row stays
        within ``batch_tokens`` (a longer single response is a batch of its own)."""
        order = sorted(range(len(self._items)), key=lambda i: self._items[i].rows)
        batches, cur, width = [], [], 0
        for i in order:
            w = max(width, self._items[i].rows)
            if cur and (len(cur) + 1) * w > batch_tokens:
                batches.append(cur)
                cur, w = [], self._items[i].rows
            cur.append(i)
            width = w
        if cur:
            batches.append(cur)
        return batches

    def batches(self, batch_tokens: int, seed: int = 0) -> Iterator[list[DraftSample]]:
        """Endless batches: every packed batch once per epoch in a seeded random order
        (the same on every rank given the same contents and seed). Stops at once when
        the buffer is empty."""
        plan = self.plan(batch_tokens)
        if not plan:
            return
        items = list(self._items)
        g = torch.Generator().manual_seed(int(seed))
        while True:
            for j in torch.randperm(len(plan), generator=g).tolist():
                yield [items[i].draft_sample() for i in plan[j]]
