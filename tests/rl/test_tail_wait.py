"""A rollout tail longer than the collective timeout: the step completes.

Two gloo ranks (DP = 2), every process group's timeout 5 s (set up with
``parallel.collective_timeout_s=60``, which megatron-core's groups must take too, then
lowered); replica 1's rollout starts 10 s late (tests/support/mp_tail_worker.py). The replica that finished first
waits on the rendezvous store (megatron_tlt/arrival.py), not in the barrier's
collective, so the steps complete: with the drafter group (its window ends before the
last replica finishes: one micro-step allowed) and without it. The same step with the
store wait removed fails with gloo's timeout, which is what the wait prevents.
"""

from __future__ import annotations

import pytest

from cli import run_workers
from rl_fixtures import save_tiny_policy, tiny_run_args

pytestmark = pytest.mark.multiproc

SETUP_TIMEOUT_S, TIMEOUT_S, TAIL_S = 60, 5, 10


def test_a_tail_longer_than_the_collective_timeout_completes(smollm2_dir, tmp_path):
    policy = save_tiny_policy(tmp_path / "policy", smollm2_dir, layers=1)
    ranks = run_workers(
        "tests/support/mp_tail_worker.py", tmp_path, "--tail", str(TAIL_S),
        "--timeout", str(TIMEOUT_S),
        *tiny_run_args(policy, tmp_path / "runs", "grpo.max_new_tokens=4",
                       "rollout.cpu_kernels=false", f"parallel.collective_timeout_s={SETUP_TIMEOUT_S}",
                       "parallel.heartbeat_timeout_s=0", "drafter_group.enable=true",
                       "drafter_group.max_steps_per_window=1", "drafter_group.batch_tokens=64",
                       "drafter_group.canary_sequences=0"),
        nproc=2, timeout=300)
    for res in ranks:
        assert res["setup_timeout_s"] == {"world": SETUP_TIMEOUT_S, "dp": SETUP_TIMEOUT_S}
        with_group, plain = res["steps"]
        for step in (with_group, plain):
            first, last = step["replica_finish"]
            assert last - first > TIMEOUT_S  # the tail outlasted the timeout
        # replica 0 took its one micro-step and then waited for replica 1 on the store
        assert with_group["drafter_steps"] == [1, 0] and with_group["drafter_identical"]
        assert plain["drafter_steps"] is None
    # the store wait is what made it work: without it replica 0's collective times out
    err = ranks[0]["unguarded"]
    assert err is not None and "timed out" in err["message"].lower(), err
