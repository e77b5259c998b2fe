"""Modelled decode-step costs: what the strategy tuner and its break-even gate charge a
step with under ``rollout.speculative.costs=modelled`` instead of the clock.

A table measured once (``calibrate.py``: a few short calls on synthetic prompts, before
the first real one), frozen, agreed over the ranks and saved with the run (the tuner's
state, hence every checkpoint, and the table file ``rollout.speculative.step_costs``).
From then on a step's cost is a function of the step alone (its running batch size,
its strategy, the drafter positions it caught up), so which steps speculate, and with
which arm, follows the run's state, never the machine's timing: the same seed and
config give the same decisions, and a resumed run takes the ones the uninterrupted run
took.

Per drafter kind (``KindCosts``):

- ``plain[b]``: a plain decode step's seconds at running batch ``b`` (the calibrated
  sizes; piecewise linear in between, clamped below, the last slope above);
- ``relative[arm][b]``: a speculative step of ``arm`` (drafting and verification, the
  drafter's catch-up apart) over a plain step at the same ``b`` (clamped to the nearest
  calibrated size; an arm never calibrated: ``UNCALIBRATED`` per verified token);
- ``catchup``: seconds per position the drafter catches up after plain steps.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Union

from ...fileio import atomic_write
from ...spec_strategy import Strategy

VERSION = 1
UNCALIBRATED = 0.25  # relative cost per verified token of an arm the table lacks


def _interp(x: float, points: dict[int, float], extend: bool) -> float:
    """Piecewise linear through ``points`` (size -> value); below the first point its
    value; above the last, the last segment's slope (>= 0) with ``extend``, else the
    last value."""
    xs = sorted(points)
    if len(xs) == 1:  # one point: proportional above it with ``extend``
        return points[xs[0]] * (x / xs[0] if extend and x > xs[0] else 1.0)
    if x <= xs[0]:
        return points[xs[0]]
    for lo, hi in zip(xs, xs[1:]):
        if x <= hi:
            w = (x - lo) / (hi - lo)
            return points[lo] * (1.0 - w) + points[hi] * w
    if not extend:
        return points[xs[-1]]
    slope = max(0.0, (points[xs[-1]] - points[xs[-2]]) / (xs[-1] - xs[-2]))
    return points[xs[-1]] + slope * (x - xs[-1])


@dataclass
class KindCosts:
    """One drafter kind's modelled step costs (see the module docstring)."""

    plain: dict[int, float]
    relative: dict[str, dict[int, float]] = field(default_factory=dict)
    catchup: float = 0.0

    def __post_init__(self) -> None:
        if not self.plain or any(not v > 0 for v in self.plain.values()):
            raise ValueError(f"step costs need a positive plain step time at one batch "
                             f"size at least, got {self.plain!r}")

    def plain_seconds(self, batch_size: int) -> float:
        return _interp(batch_size, self.plain, extend=True)

    def spec_seconds(self, batch_size: int, arm: Strategy) -> float:
        if arm.is_off:
            return self.plain_seconds(batch_size)
        rel = self.relative.get(arm.name)
        r = (_interp(batch_size, rel, extend=False) if rel
             else 1.0 + UNCALIBRATED * arm.verify_tokens)
        return self.plain_seconds(batch_size) * r

    def catchup_seconds(self, positions: int) -> float:
        return self.catchup * max(0, int(positions))

    def to_dict(self) -> dict:
        return {"plain": {str(b): s for b, s in sorted(self.plain.items())},
                "relative": {a: {str(b): r for b, r in sorted(per.items())}
                             for a, per in sorted(self.relative.items())},
                "catchup": self.catchup}

    @classmethod
    def from_dict(cls, d: dict) -> KindCosts:
        try:
            return cls({int(b): float(s) for b, s in d["plain"].items()},
                       {a: {int(b): float(r) for b, r in per.items()}
                        for a, per in d.get("relative", {}).items()},
                       float(d.get("catchup", 0.0)))
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"invalid step costs {d!r}: {e!r}") from None

    def flat(self) -> list[float]:
        """The numbers in a fixed order (``from_flat`` with the same shape reads them
        back): how ranks that calibrated the same schedule agree on rank 0's."""
        return ([self.plain[b] for b in sorted(self.plain)]
                + [per[b] for a in sorted(self.relative) for per in [self.relative[a]]
                   for b in sorted(per)] + [self.catchup])

    def from_flat(self, values: list[float]) -> KindCosts:
        it = iter(values)
        return KindCosts({b: next(it) for b in sorted(self.plain)},
                         {a: {b: next(it) for b in sorted(self.relative[a])}
                          for a in sorted(self.relative)}, next(it))


@dataclass
class StepCosts:
    """Every drafter kind's costs, where they came from and the key they were measured
    for (``calibrate.costs_key``: the model, drafter kinds, arms and machine)."""

    kinds: dict[str, KindCosts]
    source: str = ""
    key: str = ""

    def to_dict(self) -> dict:
        return {"version": VERSION, "source": self.source, "key": self.key,
                "kinds": {k: c.to_dict() for k, c in sorted(self.kinds.items())}}

    @classmethod
    def from_dict(cls, d: dict) -> StepCosts:
        if not isinstance(d, dict) or d.get("version") != VERSION or "kinds" not in d:
            raise ValueError(f"not a step-cost table (version {VERSION}): {str(d)[:200]}")
        return cls({k: KindCosts.from_dict(c) for k, c in d["kinds"].items()},
                   str(d.get("source", "")), str(d.get("key", "")))

    def save(self, path: Union[str, os.PathLike]) -> None:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with atomic_write(path) as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> StepCosts:
        try:
            with open(path) as f:
                return cls.from_dict(json.load(f))
        except (OSError, json.JSONDecodeError, ValueError) as e:
            raise ValueError(f"rollout.speculative.step_costs={os.fspath(path)}: cannot "
                             f"read a step-cost table ({e}); delete the file to "
                             "calibrate again") from None
