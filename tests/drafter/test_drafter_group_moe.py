"""The drafter group on a mixture-of-experts target: a tiny Qwen3-MoE (8 experts, top-2,
one dense layer) under torchrun (2 gloo ranks, DP = 2), the scenarios of
tests/support/mp_drafter_group_worker.py (the worker tests/drafter/test_drafter_group.py
runs on a tiny Llama). The one-layer drafter is a dense layer (``Family.drafter_layer``);
its features and the canary's target logits come from the MoE engine."""

from __future__ import annotations

import pytest

from cli import run_workers

pytestmark = pytest.mark.multiproc


def test_the_group_trains_an_eagle_drafter_for_an_moe_target_and_replicas_agree(
        qwen3_hf_dirs, tmp_path):
    results = run_workers("tests/support/mp_drafter_group_worker.py", tmp_path, "--model",
                          qwen3_hf_dirs["qwen3_moe"], "--schedules", 4, nproc=2, timeout=300)
    early, late = results[0]["uneven"], results[1]["uneven"]
    # replica 0 trained while replica 1 decoded; both leave with its state, bit for bit
    assert early["steps"] >= 3 and late["steps"] == 0 and late["last_finisher"]
    for res in (early, late):
        assert res["identical"] and res["changed"] and res["version"] == 1
        assert res["policy_untouched"] and res["policy_grads_none"]
        assert 0.0 <= res["alpha"] <= 1.0 and res["alpha"] == res["measured_alpha"]
    assert early["equals_trainer"]
    for res in results:
        # two trained replicas: the step-weighted average, the same bytes on both
        a = res["averaged"]
        assert a["identical"] and a["weighted"] and a["step_count"] == 2
        assert all(r["identical"] for r in res["schedules"])
        assert res["resume"] and all(res["resume"].values())
    assert len({res["diverged"]["checksum"] for res in results}) == 1
