"""The bucketed multi-armed bandit over drafting strategies (BEG-MAB's bandit half).

One bandit per batch-size bucket; an arm is a ``Strategy``, its reward the accepted
tokens per second of a step that ran it:

- ``egreedy``: untried arms first, then with probability ``epsilon`` a uniformly
  random arm, else the arm with the highest median reward over its sliding window (the
  median shrugs off rare stalls and spikes; the window tracks drift as sequences grow);
- ``ucb1``: untried arms first, then ``median/scale + c*sqrt(2 ln N / n)``.

Randomness comes from the bandit's own ``random.Random(seed)``, whose state is part of
the tuner's saved state, so a reloaded tuner makes the same further choices.
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque
from typing import Iterable, Optional

from ...spec_strategy import Strategy


def median(window: Iterable[float]) -> Optional[float]:
    """Median of ``window``, None when it is empty."""
    values = list(window)
    return statistics.median(values) if values else None


class Bandit:
    """Reward windows and pull counts per bucket and arm, and the arm choice."""

    def __init__(self, buckets: int, *, policy: str, epsilon: float, window: int,
                 ucb_c: float, seed: int) -> None:
        self.policy = policy
        self.epsilon = float(epsilon)
        self.window = window
        self.ucb_c = float(ucb_c)
        self.rng = random.Random(seed)
        # Per bucket, keyed by strategy name: recent rewards and total update counts.
        self.windows: list[dict[str, deque[float]]] = [{} for _ in range(buckets)]
        self.pulls: list[dict[str, int]] = [{} for _ in range(buckets)]

    def pulls_of(self, b: int, arm: Strategy) -> int:
        return self.pulls[b].get(arm.name, 0)

    def median_of(self, b: int, arm: Strategy) -> Optional[float]:
        return median(self.windows[b].get(arm.name, ()))

    def greedy(self, b: int, arms: list[Strategy]) -> Strategy:
        """The arm with the highest median reward (the first listed without data)."""
        best, best_median = arms[0], None
        for arm in arms:
            m = self.median_of(b, arm)
            if m is not None and (best_median is None or m > best_median):
                best, best_median = arm, m
        return best

    def untried(self, b: int, arms: list[Strategy]) -> Optional[Strategy]:
        for arm in arms:
            if self.pulls_of(b, arm) == 0:
                return arm
        return None

    def _ucb(self, b: int, arms: list[Strategy]) -> Strategy:
        medians = [self.median_of(b, a) or 0.0 for a in arms]
        scale = max(medians)
        total = sum(self.pulls_of(b, a) for a in arms)
        log_total = math.log(total) if total > 1 else 0.0
        best, best_value = arms[0], -math.inf
        for arm, m in zip(arms, medians):
            exploit = m / scale if scale > 0 else 0.0
            value = exploit + self.ucb_c * math.sqrt(2.0 * log_total / self.pulls_of(b, arm))
            if value > best_value:
                best, best_value = arm, value
        return best

    def choose(self, b: int, arms: list[Strategy]) -> Strategy:
        """The policy's arm among ``arms`` of bucket ``b``."""
        untried = self.untried(b, arms)
        if untried is not None:
            return untried
        if self.policy == "ucb1":
            return self._ucb(b, arms)
        if self.rng.random() < self.epsilon:
            return self.rng.choice(arms)
        return self.greedy(b, arms)

    def record(self, b: int, arm: Strategy, reward: float) -> None:
        """Add ``reward`` (accepted tokens per second) to ``arm``'s window in bucket ``b``."""
        name = arm.name
        window = self.windows[b].get(name)
        if window is None:
            window = self.windows[b][name] = deque(maxlen=self.window)
        window.append(float(reward))
        self.pulls[b][name] = self.pulls[b].get(name, 0) + 1

    def bucket_stats(self, b: int, names: list[str]) -> dict:
        """``{arm: {"pulls", "median_reward"}}`` for ``names`` plus any other recorded arm."""
        names = names + sorted(n for n in self.pulls[b] if n not in names)
        return {n: {"pulls": self.pulls[b].get(n, 0),
                    "median_reward": median(self.windows[b].get(n, ()))} for n in names}

    # ------------------------------------------------------------------ state
    def state(self) -> dict:
        """JSON-able windows, pulls and RNG state (the tuner's state keys)."""
        version, internal, gauss_next = self.rng.getstate()
        return {"windows": [{n: list(w) for n, w in per.items()} for per in self.windows],
                "pulls": [dict(per) for per in self.pulls],
                "rng": [version, list(internal), gauss_next]}

    def load(self, windows: list, pulls: list, rng: list) -> None:
        """Restore from ``state()``'s parts (their count already checked by the tuner)."""
        try:
            rng_state = (int(rng[0]), tuple(int(x) for x in rng[1]),
                         None if rng[2] is None else float(rng[2]))
            new_rng = random.Random()
            new_rng.setstate(rng_state)
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"tuner state has an invalid RNG state: {e}") from None
        self.windows = [{name: deque((float(r) for r in rewards), maxlen=self.window)
                         for name, rewards in per.items()} for per in windows]
        self.pulls = [{name: int(c) for name, c in per.items()} for per in pulls]
        self.rng = new_rng
