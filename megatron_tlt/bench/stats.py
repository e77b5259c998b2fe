"""Reading a benchmark's timings: speed ratios and per-step medians of ``GenerateStats``."""

from __future__ import annotations

import statistics
from typing import Optional

__all__ = ["rate_ratio", "plain_step_medians", "declined_step_ratio", "median_or_none",
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


def median_or_none(values) -> Optional[float]:
    """Median of the values that are not None; None when there are none."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


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
