"""tools/bench_e2e.py's worker under torchrun (DP=2, gloo) on a tiny policy.

The two arms are separate model instances, optimizers and engines in one process; the
tlt arm speculates with an untrained drafter (speculation forced by a fixed strategy).
With coupled sampling a response does not depend on the drafter, so the arms must see
the same responses and end the step with exactly the same weights: anything the arms
share by mistake (a model, an engine, a sampler, RNG state), any asymmetry in how the
bench drives them, or coupled speculation that changes a token shows up here. Standard
sampling then runs too (the same distribution, not the same samples: keys only).
"""

from __future__ import annotations

import json

import pytest

from cli import run_script
from rl_fixtures import save_tiny_policy

pytestmark = pytest.mark.multiproc

SUMMARY_KEYS = {"rollout_speedup", "step_speedup", "amdahl_bound", "rollout_fraction",
                "coupled_identical", "reward_delta", "max_param_delta", "weights_identical",
                "steps_with_update", "acceptance", "tail", "idle_replica_seconds", "steps"}
ARM_KEYS = {"rollout", "step", "tail", "idle_replica_seconds", "replica_finish", "reward",
            "accept_len", "spec_steps", "generated_tokens", "param_moved", "grad_norm"}


def test_bench_e2e_keys_and_coupled_arms_agree_exactly(smollm2_dir, tmp_path):
    policy = save_tiny_policy(tmp_path / "policy", smollm2_dir)
    out = tmp_path / "e2e.json"
    r = run_script(
        "tools/bench_e2e.py", "--worker", "--json", out, "--drafter", "random",
        "--steps", "1", "--prompts-per-step", "4", "--group-size", "4",
        "--max-new-tokens", "16", "--warmup-tokens", "2", f"model.hf_path={policy}",
        # random tokens from the tiny policy; a format reward ("k" somewhere in the
        # response) gives groups reward variance (4 groups: some group almost surely
        # has it), so the update moves the weights
        "reward.format_reward=1.0", "reward.format_pattern=k", "data.train_size=8",
        "rollout.cpu_kernels=false", "rollout.speculative.policy=fixed",
        "rollout.speculative.strategy=2_1_2", nproc=2, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["benchmark"] == "bench_e2e" and res["config"]["drafter"] == "random"
    assert res["config"]["dp"] == 2 and "cpu_isa_flags" in res["config"]
    assert list(res["modes"]) == ["coupled", "standard"] and len(res["results"]) == 2
    for mode, m in res["modes"].items():
        assert SUMMARY_KEYS <= set(m), (mode, SUMMARY_KEYS - set(m))
        (row,) = m["steps"]
        assert row["responses"] == 16 and m["reward_delta"]["pairs"] == 4
        for arm in ("tlt", "off"):
            a = row["arms"][arm]
            assert ARM_KEYS <= set(a), (mode, arm, ARM_KEYS - set(a))
            assert len(a["replica_finish"]) == 2
            assert a["rollout"] == max(a["replica_finish"]) <= a["step"]
            # the update did something, so equal weights are not vacuous
            assert a["updates_skipped"] == 0 and a["param_moved"] > 0
        assert row["arms"]["tlt"]["spec_steps"] > 0 and row["accept_len"] is not None
        assert row["arms"]["off"]["spec_steps"] is None  # no drafter in the off arm
        f, s = m["rollout_fraction"], m["rollout_speedup"]
        assert 0 < f < 1
        assert m["amdahl_bound"] == pytest.approx(1 / ((1 - f) + f / s))
    c = res["modes"]["coupled"]
    assert c["coupled_identical"] == 1.0, c["steps"][0]["first_split"]
    assert c["rewards_identical"] == 1.0 and c["reward_delta"]["mean"] == 0.0
    assert c["max_param_delta"] == 0.0 and c["weights_identical"]
    assert c["steps_with_update"] == 1
