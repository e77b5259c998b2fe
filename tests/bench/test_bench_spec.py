"""The speculative benchmark's per-step reading of the break-even gate's declined path
(megatron_tlt.bench.stats, used by tools/bench_spec.py and tools/bench_e2e.py)."""

from __future__ import annotations

import pytest

from megatron_tlt.bench import stats as bench_stats
from megatron_tlt.rollout.engine import GenerateStats


def _stats(steps):
    """GenerateStats from (batch size, seconds, speculative) per decode step."""
    st = GenerateStats()
    for b, sec, spec in steps:
        st.batch_sizes.append(b)
        st.step_seconds.append(sec)
        st.step_speculative.append(spec)
    return st


def test_declined_step_ratio_compares_plain_steps_at_equal_batch_sizes():
    plain = _stats([(4, 0.040, False)] * 3 + [(2, 0.020, False)] * 3 + [(1, 0.010, False)])
    # the adaptive run: declined steps 10 % slower at batch 4, equal at batch 2; its
    # speculative steps (any time) and batch sizes plain decoding never ran are left out
    adaptive = _stats([(4, 0.044, False)] * 3 + [(2, 0.020, False), (2, 0.5, True)]
                      + [(3, 9.0, False), (1, 0.3, True)])
    assert bench_stats.plain_step_medians(adaptive) == {4: 0.044, 2: 0.020, 3: 9.0}
    assert bench_stats.declined_step_ratio(adaptive, plain) == pytest.approx((1.1 + 1.0) / 2)
    # medians, not means: one slow step does not move it
    adaptive.batch_sizes.append(2), adaptive.step_seconds.append(5.0)
    adaptive.step_speculative.append(False)
    adaptive.batch_sizes.append(2), adaptive.step_seconds.append(0.020)
    adaptive.step_speculative.append(False)
    assert bench_stats.declined_step_ratio(adaptive, plain) == pytest.approx((1.1 + 1.0) / 2)


def test_declined_step_ratio_without_common_batch_sizes_is_none():
    assert bench_stats.declined_step_ratio(_stats([(1, 0.1, True)]),
                                           _stats([(1, 0.1, False)])) is None
    assert bench_stats.median_or_none([None, 2.0, None, 4.0]) == 3.0
    assert bench_stats.median_or_none([None]) is None


def test_rate_ratio_is_a_speed_ratio():
    # twice the tokens in the same time, or the same tokens in half the time: 2x
    assert bench_stats.rate_ratio(200, 1.0, 100, 1.0) == pytest.approx(2.0)
    assert bench_stats.rate_ratio(100, 0.5, 100, 1.0) == pytest.approx(2.0)
    assert bench_stats.rate_ratio(100, 2.0, 50, 1.0) == pytest.approx(1.0)


def test_paired_statistics_of_the_end_to_end_benchmark():
    """mean_ci95 (Student's t), amdahl and median_min_max (bench_e2e's summary)."""
    r = bench_stats.mean_ci95([1.0, 2.0, 3.0])  # sd 1, t(2) = 4.303
    assert r["mean"] == 2.0 and r["pairs"] == 3
    assert r["ci95"] == pytest.approx([2 - 4.303 / 3 ** 0.5, 2 + 4.303 / 3 ** 0.5])
    assert bench_stats.mean_ci95([]) == {"mean": None, "ci95": [None, None], "pairs": 0}
    assert bench_stats.mean_ci95([5.0]) == {"mean": 5.0, "ci95": [None, None], "pairs": 1}
    assert bench_stats.t975(30) == 2.042 and bench_stats.t975(60) == pytest.approx(2.0, abs=2e-3)
    # half the step 2x faster: 1 / (0.5 + 0.25); no rollout speedup: no step speedup
    assert bench_stats.amdahl(0.5, 2.0) == pytest.approx(4 / 3)
    assert bench_stats.amdahl(0.7, 1.0) == pytest.approx(1.0)
    assert bench_stats.median_min_max([3.0, None, float("inf"), 1.0, 2.0]) == (2.0, 1.0, 3.0)
    assert bench_stats.median_min_max([None, float("nan")]) == (None, None, None)
