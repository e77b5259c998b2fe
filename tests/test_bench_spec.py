"""tools/bench_spec.py's per-step reading of the break-even gate's declined path."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import bench_spec  # noqa: E402
from megatron_tlt.rollout.engine import GenerateStats  # noqa: E402


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
    assert bench_spec.plain_step_medians(adaptive) == {4: 0.044, 2: 0.020, 3: 9.0}
    assert bench_spec.declined_step_ratio(adaptive, plain) == pytest.approx((1.1 + 1.0) / 2)
    # medians, not means: one slow step does not move it
    adaptive.batch_sizes.append(2), adaptive.step_seconds.append(5.0)
    adaptive.step_speculative.append(False)
    adaptive.batch_sizes.append(2), adaptive.step_seconds.append(0.020)
    adaptive.step_speculative.append(False)
    assert bench_spec.declined_step_ratio(adaptive, plain) == pytest.approx((1.1 + 1.0) / 2)


def test_declined_step_ratio_without_common_batch_sizes_is_none():
    assert bench_spec.declined_step_ratio(_stats([(1, 0.1, True)]),
                                          _stats([(1, 0.1, False)])) is None
    assert bench_spec._median_or_none([None, 2.0, None, 4.0]) == 3.0
    assert bench_spec._median_or_none([None]) is None
