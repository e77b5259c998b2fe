"""Held-out evaluation numbers: mean reward and accuracy with 95 % intervals.

Accuracy is a binomial proportion over a small held-out set (the demo scores 64
prompts), where the normal approximation's interval misbehaves near 0 and 1 and can
leave [0, 1]; the Wilson score interval stays inside and keeps close to its nominal
coverage at such sizes.
"""

from __future__ import annotations

import math
from typing import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile


def wilson_interval(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion ``successes / n`` (``(0, 1)`` for
    n = 0)."""
    if n <= 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exact at the ends (0 and n successes), where rounding would leave them open
    lo = 0.0 if successes <= 0 else max(0.0, centre - half)
    hi = 1.0 if successes >= n else min(1.0, centre + half)
    return lo, hi


def eval_metrics(results: Sequence[tuple[float, float]]) -> dict:
    """``(reward, correct)`` per held-out prompt -> the ``eval/*`` metrics: mean reward
    with a normal 95 % half-width, accuracy with its Wilson 95 % interval."""
    n = len(results)
    if n == 0:
        return {}
    rewards = [r for r, _ in results]
    mean = sum(rewards) / n
    var = sum((x - mean) ** 2 for x in rewards) / max(n - 1, 1)
    correct = sum(c for _, c in results)
    lo, hi = wilson_interval(correct, n)
    return {"eval/reward": mean, "eval/reward_ci95": Z95 * math.sqrt(var / n),
            "eval/accuracy": correct / n, "eval/accuracy_lo": lo, "eval/accuracy_hi": hi,
            "eval/prompts": n}
