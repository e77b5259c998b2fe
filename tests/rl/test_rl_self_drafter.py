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


def test_rl_steps_with_both_drafter_kinds(tiny_policy, tmp_path, single_process_parallel):
    """rollout.speculative.kinds.self.also: a one-layer drafter checkpoint and the int8 copy
    side by side (the default adaptive tuner per kind); the run speculates, re-quantizes
    the copy after the update and checkpoints the one-layer drafter."""
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    arch = arch_from_source(tiny_policy)
    path = save_drafter(EagleDrafter(DrafterConfig.for_target(arch), arch),
                        tmp_path / "drafter.safetensors")
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    r = run_script("pretrain_rl_tlt.py", *tiny_run_args(
        tiny_policy, out, "train.lr=1e-3", "train.steps=3", f"checkpoint.save={ckpt}",
        f"rollout.speculative.drafter={path}", "rollout.speculative.kinds.self.also=true",
        "rollout.speculative.threshold=8"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2, 3]
    # the copy is re-quantized at a step's rollout exactly when the update before it
    # moved the weights (a step whose groups all have one reward has no gradient)
    moved = [x["grad_norm"] > 0 and not x["updates_skipped"] for x in records]
    assert [x["spec"]["drafter_refreshes"] for x in records[1:]] == [int(m) for m in moved[:-1]]
    assert any(moved[:-1])
    assert any((ckpt / "latest").parent.rglob("*drafter*"))
    # the metrics per drafter kind: they add up to the step's totals
    for rec in records:
        spec = rec["spec"]
        assert set(spec["kinds"]) <= {"eagle", "self"} and spec["kinds"]
        kinds = [spec[k] for k in spec["kinds"]]
        assert sum(k["steps"] for k in kinds) == spec["steps"]
        assert sum(k["declined"] for k in kinds) == spec["declined"]
        assert sum(k["chosen"] for k in kinds) == sum(
            n for per in spec["chosen"].values() for n in per.values())
        assert set(spec["bucket_choice"]) == set(spec["chosen"])
        for a, b, what in [s for r in rec["timeline"]["replica_kinds"] for s in r]:
            assert 0 <= a <= b <= rec["timeline"]["replica_finish"][0] + 1e-6
            assert what in ("eagle", "self", "plain")
    assert "drafter by bucket" in r.stdout or len(set().union(
        *(x["spec"]["kinds"] for x in records))) == 1  # the table's column


def test_self_also_needs_a_drafter_checkpoint():
    """Checked when a run starts (and by the dry run), before anything is built."""
    from megatron_tlt.config import ConfigError, load_config
    from megatron_tlt.rollout.speculative.drafters import check_config

    for drafter in ("self", ""):
        cfg = load_config(overrides=[f"rollout.speculative.drafter={drafter}",
                                     "rollout.speculative.kinds.self.also=true"])
        with pytest.raises(ConfigError, match="rollout.speculative.kinds.self.also"):
            check_config(cfg)
    check_config(load_config(overrides=["rollout.speculative.drafter=d.safetensors",
                                        "rollout.speculative.kinds.self.also=true"]))


def test_both_kinds_with_the_drafter_group_at_dp2(tiny_policy, tmp_path, single_process_parallel):
    """The demo's set-up with ``rollout.speculative.kinds.self.also=true``: two replicas, the
    drafter group training the one-layer drafter in the tail while the int8 copy drafts
    beside it. Every replica's kind timeline is logged, the per-kind metrics add up
    over the replicas, and the summary table names each bucket's drafter."""
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    arch = arch_from_source(tiny_policy)
    path = save_drafter(EagleDrafter(DrafterConfig.for_target(arch), arch),
                        tmp_path / "drafter.safetensors")
    out = tmp_path / "run"
    r = run_script("pretrain_rl_tlt.py", *tiny_run_args(
        tiny_policy, out, "train.steps=2", "grpo.group_size=2",
        f"rollout.speculative.drafter={path}", "rollout.speculative.kinds.self.also=true",
        "rollout.speculative.threshold=8", "drafter_group.enable=true",
        "drafter_group.batch_tokens=64"), nproc=2, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (out / "run" / "metrics.jsonl").read_text().splitlines()
               if '"reward/mean"' in x]
    assert len(records) == 2
    kinds = set()
    for rec in records:
        spec = rec["spec"]
        kinds |= set(spec["kinds"])
        assert sum(spec[k]["steps"] for k in spec["kinds"]) == spec["steps"]
        assert sum(spec[k]["declined"] for k in spec["kinds"]) == spec["declined"]
        assert len(rec["timeline"]["replica_kinds"]) == 2
        assert len(rec["timeline"]["drafter_train"]) == 2
    assert kinds == {"eagle", "self"}
    assert "drafter by bucket" in r.stdout and "SD on / accept by kind" in r.stdout
