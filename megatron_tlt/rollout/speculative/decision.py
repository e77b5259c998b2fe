"""What the strategy tuner decides for a decode step and what the step measured: the
two values of its protocol (``StrategyTuner.decide`` -> ``Decision``, then
``StrategyTuner.record(decision, Outcome)``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ...spec_strategy import Strategy


@dataclass(frozen=True)
class Decision:
    """The strategy of one decode step in bucket ``bucket``: ``0_0_0`` is a plain step.
    ``declined``: it runs plain below the speculation threshold (the break-even gate, or
    a ``0_0_0`` arm); ``probe``: a step taken against the gate's current verdict to
    re-measure the other side."""

    bucket: int
    strategy: Strategy
    declined: bool
    probe: bool = False


@dataclass(frozen=True)
class Outcome:
    """What a decided step measured.

    ``tokens``: tokens the batch of ``batch_size`` rows emitted; ``seconds``: the step's
    time (the drafter's catch-up apart). ``accepted_drafts``: per row, its accepted draft
    count (a chain step's; the gate's acceptance profile). ``switch_seconds`` /
    ``switch_positions``: the drafter's catch-up before the step (the positions it
    missed while rows decoded plainly) and how many positions it fed."""

    batch_size: int
    tokens: float
    seconds: float
    accepted_drafts: Optional[Sequence[int]] = None
    switch_seconds: float = 0.0
    switch_positions: int = 0
