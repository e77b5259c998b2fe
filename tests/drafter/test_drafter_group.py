"""The drafter group under torchrun (2 gloo ranks, DP = 2, a tiny model): who trains,
preemption within one micro-step, bit-identical drafters after every window, failure
handling, resume (scenarios in tests/support/mp_drafter_group_worker.py)."""

from __future__ import annotations

import json

import pytest

from cli import run_script, run_workers

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def results(tiny_hf_dirs, tmp_path_factory):
    return run_workers("tests/support/mp_drafter_group_worker.py",
                       tmp_path_factory.mktemp("dgroup"), "--model", tiny_hf_dirs["llama_tied"],
                       "--schedules", 50, nproc=2)


def test_all_finishing_together_trains_nothing_and_averages_nothing(results):
    for res in results:
        t = res["together"]
        assert t["steps"] == 0 and t["version"] == 0 and t["unchanged"]
        assert t["checksum"] is None and not t["pending"]  # no averaging collective ran


def test_the_group_trains_with_the_configured_loss_at_the_recipes_sampling(results):
    from megatron_tlt.config import DrafterGroupConfig
    from megatron_tlt.drafter_training.losses import LOSS_PRESETS
    from megatron_tlt.drafter_training.warmup import DEFAULT_LOSS

    assert DrafterGroupConfig().loss == DEFAULT_LOSS
    for res in results:
        lc = res["loss"]
        assert (lc["temperature"], lc["top_k"], lc["top_p"]) == (0.7, 20, 0.9)
        preset = LOSS_PRESETS[lc["preset"]]
        assert (lc["kl"], lc["tv"]) == (preset.kl, preset.tv)


def test_canary_alpha_is_measure_alpha_at_the_recipes_sampling(results):
    for res in results:
        u = res["uneven"]
        assert u["alpha"] == u["measured_alpha"]
        assert u["alpha"] != u["alpha_t1"]  # the settings reach the measurement


def test_a_frozen_group_trains_nothing_but_still_measures(results):
    """drafter_group.train=false (bench_drift's frozen arm): an early replica does not
    train while the other decodes, the drafter stays as it was on every replica, and
    the canary measures it."""
    for res in results:
        f = res["frozen"]
        assert f["steps"] == 0 and f["unchanged"] and f["identical"]
        assert 0.0 <= f["alpha"] <= 1.0


def test_uneven_finish_early_replica_trains_late_one_does_not(results):
    early, late = results[0]["uneven"], results[1]["uneven"]
    assert early["steps"] >= 3 and late["steps"] == 0
    assert late["last_finisher"] and not early["last_finisher"]
    for res in (early, late):
        assert res["identical"] and res["changed"] and res["version"] == 1
        assert res["policy_untouched"] and res["policy_grads_none"]
        assert 0.0 <= res["alpha"] <= 1.0
    # weights 1 and 0: both leave with exactly the early replica's trained state
    assert early["equals_trainer"]
    assert early["train"] is not None and late["train"] is None


def test_random_schedules_stay_identical_and_preempt_within_one_micro_step(results):
    trained = 0
    for k in range(50):
        rows = [res["schedules"][k] for res in results]
        assert all(r["identical"] for r in rows), k
        assert all(r["overrun"] <= 1 for r in rows), (k, rows)
        assert sum(r["last"] for r in rows) == 1, (k, rows)  # exactly one last finisher
        last = next(r for r in rows if r["last"])
        assert last["steps"] == 0
        trained += sum(r["steps"] for r in rows)
        # an overlapped averaging is pending after the window exactly when one ran
        assert all(r["pending"] == (r["overlap"] and any(x["steps"] for x in rows))
                   for r in rows), (k, rows)
        assert all(r["checksum"] is None or r["checksum"] == r["own_checksum"]
                   for r in rows), (k, rows)
    assert trained > 0  # the schedules did exercise training
    assert any(r["overlap"] and r["pending"] for r in results[0]["schedules"])


def test_two_trained_replicas_average_weighted_by_their_steps(results):
    for res in results:
        a = res["averaged"]
        assert a["pending"] and a["identical"] and a["weighted"] and a["adam_step"]
        assert a["version"] == 1 and a["step_count"] == 2


def test_a_drafter_failure_restores_it_and_turns_speculation_off_once(results):
    for rank, res in enumerate(results):
        f = res["failure"]
        assert f["speculation_off"] and f["restored"] and f["version_unchanged"]
        assert f["guarded_spec_steps"] == 0 and f["after_spec_steps"] > 0
        assert not f["off_after_guard"]
    assert "FloatingPointError" in results[0]["failure"]["failure"]
    assert results[0]["failure"]["warned"]
    assert results[1]["failure"]["failure"] is None


def test_resume_restores_drafter_and_optimizer_state(results):
    for res in results:
        assert all(res["resume"].values()), res["resume"]


def test_replicas_that_diverge_are_given_replica_0s_state(results):
    for rank, res in enumerate(results):
        d = res["diverged"]
        assert d["differed"] and d["healed"] and d["identical"]
        assert d["own_kept"] == (rank == 0)  # replica 0's bytes won
        assert d["checksum"] == d["checksum_of_state"] == d["checksum_again"]
        assert not d["healed_again"]
    assert len({res["diverged"]["checksum"] for res in results}) == 1


def test_cli_run_trains_the_drafter_in_the_tail_and_checkpoints_it(smollm2_dir, tmp_path):
    """Two GRPO steps at DP = 2 from a random (cold-start) drafter beside both model-free
    kinds (``drafter=group_history``, ``free_too=prompt_lookup``): the group's metrics
    are logged, every replica holds the same drafter version and checksum after every
    step, the timeline has the training spans, the checkpoint carries the drafter's
    optimizer state, and speculation is reported by kind."""
    from megatron_tlt.checkpoint.safe_files import read_tree

    from rl_fixtures import save_tiny_policy

    policy = save_tiny_policy(tmp_path / "policy", smollm2_dir)
    r = run_script("pretrain_rl_tlt.py", f"model.hf_path={policy}", "grpo.prompts_per_step=2",
                   "grpo.group_size=2", "grpo.max_new_tokens=8", "train.steps=2",
                   "data.train_size=8", "tracking.progress=false", "tracking.run_name=run",
                   f"tracking.output_dir={tmp_path / 'out'}", "drafter_group.enable=true",
                   "drafter_group.batch_tokens=64", f"checkpoint.save={tmp_path / 'ckpt'}",
                   "rollout.speculative.policy=fixed", "rollout.speculative.strategy=2_1_2",
                   "rollout.speculative.drafter=group_history",
                   "rollout.speculative.free_too=prompt_lookup", nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "drafter steps" in r.stdout  # the summary table's drafter columns
    recs = [json.loads(x) for x in (tmp_path / "out" / "run" / "metrics.jsonl")
            .read_text().splitlines() if '"reward/mean"' in x]
    assert len(recs) == 2
    for rec in recs:
        assert rec["drafter/identical"]
        assert len(set(rec["drafter/version"])) == 1
        assert len(rec["drafter/steps_per_replica"]) == 2
        assert len(rec["timeline"]["drafter_train"]) == 2
        assert 0.0 <= rec["drafter/alpha"] <= 1.0
        assert rec["spec/alpha"] == rec["drafter/alpha"]
        assert rec["spec"]["steps"] > 0
        assert 0.0 <= rec["drafter/idle_used_fraction"] <= 1.0
        # speculation by kind: the trained drafter's steps, and every configured kind's
        # tokens by the rows it proposed (they sum to the speculative steps' tokens)
        spec = rec["spec"]
        assert set(spec["kinds"]) == {"eagle", "group_history", "prompt_lookup"}, spec
        assert spec["eagle"]["steps"] > 0
        assert (sum(spec[k]["proposed_emitted"] for k in spec["kinds"])
                == sum(spec[k]["emitted"] for k in spec["kinds"]))
    version = recs[-1]["drafter/version"][0]
    for k in range(2):
        state = read_tree(tmp_path / "ckpt" / "step_0000002" / f"rank_tp0_pp0_dp{k}")
        assert state["drafter_group"]["version"] == version
        if version:  # AdamW moments on every replica, trained or not
            assert state["drafter_group"]["optimizer"]["state"]
