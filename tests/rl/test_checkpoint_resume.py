"""SIGTERM or SIGKILL anywhere, resume exactly (2 ranks, gloo, tiny policy): a run
stopped (SIGTERM to one rank) mid-rollout, resumed and killed mid-update, resumed and
killed mid-save, then resumed to the end, logs the uninterrupted run's metrics for
every step (not zero steps, counters not restarted);
the uninterrupted run's step-1 checkpoint resumed at DP=1 continues with its steps."""

from __future__ import annotations

import json

import pytest

from cli import forked_fault_inject
from rl_fixtures import save_tiny_policy

fault_inject = forked_fault_inject()  # its launches' ranks forked from a warm interpreter

STEPS = 3


@pytest.fixture(scope="module")
def reference(smollm2_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    policy = save_tiny_policy(root / "policy", smollm2_dir, layers=1)
    r = fault_inject.launch(fault_inject.run_args(policy, root / "runs", root / "ckpt", STEPS))
    assert r.returncode == 0, r.stderr[-3000:]
    ref = fault_inject.metrics(root / "runs" / "run")
    assert sorted(ref) == [1, 2, 3]
    return policy, root, ref


@pytest.mark.multiproc
def test_stopped_mid_rollout_killed_mid_update_and_mid_save_resumes_to_the_same_metrics(
        reference, tmp_path):
    policy, _, ref = reference
    out, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    args = fault_inject.run_args(policy, out, ckpt, STEPS)
    # SIGTERM to rank 1 as step 2's rollout starts: its engine stops at the first
    # decode step, the other rank hears of it at the latest at the step barrier, where
    # every rank abandons step 2, restores what the step changed and checkpoints step 1
    # (no regular save of step 1 here: save_interval=2), exit 75
    r = fault_inject.launch(args + ["checkpoint.save_interval=2"], term="rollout:2")
    assert "exitcode  : 75" in r.stderr or "exitcode: 75" in r.stderr, r.stderr[-3000:]
    assert "stopped after step 1 (step 2 abandoned" in r.stdout, r.stdout[-3000:]
    assert json.loads((ckpt / "requeue").read_text())["step"] == 1
    assert (ckpt / "latest").read_text().strip() == "step_0000001"
    assert sorted(fault_inject.metrics(out / "run")) == [1]
    r = fault_inject.launch(args + [f"checkpoint.load={ckpt}"], kill="update:2")
    assert r.returncode != 0 and (ckpt / "latest").read_text().strip() == "step_0000001"
    r = fault_inject.launch(args + [f"checkpoint.load={ckpt}"], kill="publish:3")
    assert r.returncode != 0 and (ckpt / "latest").read_text().strip() == "step_0000002"
    assert (ckpt / ".step_0000003.partial").is_dir()
    r = fault_inject.launch(args + [f"checkpoint.load={ckpt}"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "at step 2" in r.stdout  # resumed, not restarted
    got = fault_inject.metrics(out / "run")
    assert fault_inject.compare(ref, got) == []
    assert (ckpt / "latest").read_text().strip() == "step_0000003"


@pytest.mark.multiproc
def test_a_dp2_checkpoint_resumes_at_dp1(reference, tmp_path):
    policy, root, ref = reference
    out = tmp_path / "runs"
    args = fault_inject.run_args(policy, out, tmp_path / "ckpt", STEPS)
    r = fault_inject.launch(args + [f"checkpoint.load={root / 'ckpt' / 'step_0000001'}"],
                            nproc=1)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "saved at TP=1 PP=1 DP=2, resumed at TP=1 PP=1 DP=1" in r.stdout
    got = fault_inject.metrics(out / "run")
    for step in (2, 3):
        for key in ("reward/mean", "loss/total", "grad_norm", "response_length/mean"):
            assert got[step][key] == pytest.approx(ref[step][key], rel=1e-4, abs=1e-6), \
                (step, key)

