"""Reading a benchmark's timings: speed ratios and per-step medians of ``GenerateStats``,
medians and intervals of paired ratios, the Amdahl bound."""

from __future__ import annotations

import math
import statistics
from typing import Optional

__all__ = ["rate_ratio", "plain_step_medians", "declined_step_ratio", "tuned_summary",
           "median_or_none", "median_min_max", "mean_ci95", "t975", "amdahl",
           "tail_speedup_bound"]


def rate_ratio(tok_a, sec_a, tok_p, sec_p) -> float:
    """(tokens/s of a) / (tokens/s of plain): the time ratio when the outputs agree."""
    return (tok_a / sec_a) / (tok_p / sec_p)


def plain_step_medians(st) -> dict:
    """Median time of the plain (not speculative) decode steps at each batch size."""
    per: dict = {}
    for b, sec, spec in zip(st.batch_sizes, st.step_seconds, st.step_speculative):
        if not spec:
            per.setdefault(b, []).append(sec)
    return {b: statistics.median(v) for b, v in per.items()}


def declined_step_ratio(adaptive_st, plain_st) -> Optional[float]:
    """Median over batch sizes of (the adaptive run's plain-step time / plain decoding's
    step time at that batch size): what the gate's declined path costs per step (1 = the
    same as plain decoding), free of the run's probes and speculative steps."""
    a, p = plain_step_medians(adaptive_st), plain_step_medians(plain_st)
    common = sorted(set(a) & set(p))
    return statistics.median(a[b] / p[b] for b in common) if common else None


def tuned_summary(st) -> dict:
    """Decision counts of one adaptive run, from its ``GenerateStats``: the fraction of
    steps speculating, declined and tuned steps, probes, arms, acceptance length."""
    s = st.spec.summary()
    return dict(spec_fraction=st.spec_fraction, declined=s["declined"],
                tuned_steps=s["declined"] + s["steps"],
                declined_fraction=s["declined_fraction"], probes=s["probes"],
                arms=s["arms"], accept_len=s["accept_len"])


def median_or_none(values) -> Optional[float]:
    """Median of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def median_min_max(values) -> tuple:
    """(median, min, max) of the finite values that are not None; (None, None, None)
    when there are none."""
    xs = [x for x in values if x is not None and math.isfinite(x)]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201,
         2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074,
         2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(df: int) -> float:
    """Student's t 97.5 % quantile (two-sided 95 %); 1.96 + 2.37/df above 30 (within
    0.002 of the exact value)."""
    if df < 1:
        return float("nan")
    return _T975[df - 1] if df <= len(_T975) else 1.96 + 2.37 / df


def mean_ci95(values) -> dict:
    """Mean and 95 % interval (Student's t) of paired differences."""
    v = [float(x) for x in values]
    n = len(v)
    if n == 0:
        return {"mean": None, "ci95": [None, None], "pairs": 0}
    m = sum(v) / n
    if n == 1:
        return {"mean": m, "ci95": [None, None], "pairs": 1}
    sd = math.sqrt(sum((x - m) ** 2 for x in v) / (n - 1))
    h = t975(n - 1) * sd / math.sqrt(n)
    return {"mean": m, "ci95": [m - h, m + h], "pairs": n}


def amdahl(f: float, s: float) -> float:
    """Step speedup when a fraction f of the step runs s times faster."""
    return 1.0 / ((1.0 - f) + f / s)


def tail_speedup_bound(plain_st, speedup_at: dict, threshold: int) -> Optional[dict]:
    """An upper bound on what speculation can give a long-tail run, from plain decoding's
    own steps (``plain_st``: each step's running batch and time, and the prefill) and
    the best speedup measured at a few batch sizes (``speedup_at``: {batch: speedup}).

    Each plain step at batch b <= ``threshold`` is taken as sped up by the speedup
    measured at the largest measured batch <= b (never below 1: the gate can always
    decline); steps above the threshold and the prefill stay as they are. Speedups
    fall with the batch, so taking the smaller batch's is optimistic: no per-bucket
    choice of strategy beats this bound with these measurements. Returns the bound
    and each batch bucket's share of plain decoding's time, or None without steps."""
    if not plain_st.step_seconds or not speedup_at:
        return None
    measured = sorted(speedup_at)
    total = plain_st.prefill_seconds + sum(plain_st.step_seconds)
    best, share = plain_st.prefill_seconds, {}
    for b, sec in zip(plain_st.batch_sizes, plain_st.step_seconds):
        under = [m for m in measured if m <= b]
        s = max(1.0, speedup_at[under[-1]]) if under and b <= threshold else 1.0
        best += sec / s
        share[b] = share.get(b, 0.0) + sec / total
    return {"bound": total / best,
            "time_share_by_batch": {str(b): round(v, 4) for b, v in sorted(share.items())},
            "prefill_share": plain_st.prefill_seconds / total,
            "speedup_at": {str(b): speedup_at[b] for b in measured}}
