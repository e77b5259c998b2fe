"""Reading a benchmark's timings: speed ratios and per-step medians of ``GenerateStats``."""

from __future__ import annotations

import statistics
from typing import Optional

__all__ = ["rate_ratio", "plain_step_medians", "declined_step_ratio", "median_or_none"]


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
