"""Faults mid-run: a frozen or killed rank makes its peer exit non-zero (heartbeats
through the store, gloo's closed connection), never a hang; a NaN reward or loss skips
the update, is reported, and stops the run past train.max_nonfinite_steps."""

from __future__ import annotations

import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli import REPO
from rl_fixtures import save_tiny_policy


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pair(timeout_s: float) -> list[subprocess.Popen]:
    port = _free_port()
    return [subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "support" / "mp_heartbeat_worker.py"), str(timeout_s)],
        env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
             "MASTER_PORT": str(port)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]


def test_a_frozen_or_killed_rank_makes_the_other_exit_nonzero():
    from megatron_tlt.heartbeat import PEER_LOST_EXIT_CODE

    pairs = {"frozen": _pair(3.0), "killed": _pair(3.0)}  # started together: one import wait
    try:
        for procs in pairs.values():
            for p in procs:
                assert p.stdout.readline().strip() == "ready", p.communicate()[1][-2000:]
        pairs["frozen"][1].send_signal(signal.SIGSTOP)  # alive, silent: only heartbeats see it
        pairs["killed"][1].send_signal(signal.SIGKILL)
        results = {k: (procs[0].wait(timeout=120), procs[0].communicate()[1])  # hang detector
                   for k, procs in pairs.items()}
    finally:
        for procs in pairs.values():
            for p in procs:
                p.kill()
                p.wait()
    rc, err = results["frozen"]
    assert rc == PEER_LOST_EXIT_CODE, err[-2000:]
    assert "rank 0: rank 1 (host " in err and "sent no heartbeat" in err, err[-2000:]
    assert "parallel.heartbeat_timeout_s=3" in err
    rc, err = results["killed"]
    assert rc != 0, err[-2000:]


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory) -> Path:
    return save_tiny_policy(tmp_path_factory.mktemp("faults") / "policy", smollm2_dir,
                            layers=1)


def _weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.policy.module.parameters()]


@pytest.mark.parametrize("where", ["reward", "loss"])
def test_a_nan_skips_the_update_is_reported_and_stops_past_the_limit(
        where, tiny_policy, single_process_parallel, monkeypatch):
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl import grpo
    from megatron_tlt.rl.nonfinite import NonFiniteError
    from megatron_tlt.rl.trainer import Trainer

    cfg = load_config([], [f"model.hf_path={tiny_policy}", "grpo.prompts_per_step=1",
                           "grpo.group_size=2", "grpo.max_new_tokens=4", "train.lr=1e-2",
                           "data.train_size=4", "rollout.cpu_kernels=false",
                           "reward.format_reward=1.0", "reward.format_pattern=k",
                           "train.steps=3", "train.max_nonfinite_steps=1"])
    trainer = Trainer(cfg, setup(cfg))
    if where == "reward":
        score = trainer._score

        def nan_score(samples, prompts):
            score(samples, prompts)
            samples[0].reward = math.nan  # one sample of one replica is enough
        monkeypatch.setattr(trainer, "_score", nan_score)
    else:
        loss = grpo.policy_loss

        def nan_loss(*a, **kw):
            value, met = loss(*a, **kw)
            return value * math.nan, met
        monkeypatch.setattr(grpo, "policy_loss", nan_loss)
    before = _weights(trainer)
    with pytest.warns(RuntimeWarning, match="NaN or inf: the update was skipped"), \
            pytest.raises(NonFiniteError, match="more than train.max_nonfinite_steps=1"):
        trainer.train()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(trainer)))
    assert trainer.state.extra["nonfinite_steps"] == 2
    assert trainer.state.step == 2  # the step counter moves on; the weights do not
