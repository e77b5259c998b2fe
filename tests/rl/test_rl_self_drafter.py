"""GRPO with the self-drafter (rollout.speculative.drafter=self): every step's rollout
speculates with the policy's int8 copy, re-quantized after each update; the drafter
group refuses it (nothing to train)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cli import run_script
from rl_fixtures import save_tiny_policy, tiny_run_args


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory) -> Path:
    return save_tiny_policy(tmp_path_factory.mktemp("rl") / "policy", smollm2_dir)


SPEC = ["rollout.speculative.drafter=self", "rollout.speculative.threshold=8",
        "rollout.speculative.policy=fixed", "rollout.speculative.strategy=2_1_2"]


def test_rl_steps_refresh_the_copy_after_every_update(tiny_policy, tmp_path):
    out = tmp_path / "run"
    r = run_script("pretrain_rl_tlt.py", *tiny_run_args(tiny_policy, out, "train.lr=1e-3",
                                                        "train.steps=3", *SPEC), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2, 3]
    for rec in records:
        assert rec["spec"]["steps"] > 0
    # quantized when attached; then once per rollout after each policy update
    assert records[0]["spec"]["drafter_refreshes"] == 0
    assert [x["spec"]["drafter_refreshes"] for x in records[1:]] == [1, 1]
    assert all(x["spec"]["drafter_refresh_seconds"] > 0 for x in records[1:])


def test_drafter_group_refuses_the_self_drafter(tiny_policy, tmp_path):
    r = run_script("pretrain_rl_tlt.py", *tiny_run_args(tiny_policy, tmp_path / "run",
                                                        "train.steps=1",
                                                        "drafter_group.enable=true", *SPEC),
                   timeout=600)
    assert r.returncode != 0
    assert "drafter_group.enable=false" in r.stderr
