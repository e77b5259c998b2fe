"""The GRPO trainer end to end on a tiny policy with SmolLM2's real tokenizer.

An update moves log-probs the way the advantages say; the CLI runs steps with
speculative decoding on, writes metrics / plots / a checkpoint, and a resumed run
continues exactly where an uninterrupted one would be; recipes dry-run; Megatron-LM's
flags are aliases of config fields.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from cli import REPO, run_main, run_script
from rl_fixtures import save_tiny_policy, tiny_run_args

RECIPES = sorted((REPO / "examples" / "rl").glob("*.yaml"))


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory) -> Path:
    return save_tiny_policy(tmp_path_factory.mktemp("rl") / "policy", smollm2_dir)


def _tiny_args(policy: Path, out: Path, *extra: str) -> list[str]:
    return tiny_run_args(policy, out, "train.lr=1e-3", *extra)


def test_one_update_moves_logprobs_with_the_advantage(tiny_policy, single_process_parallel):
    """Positive-advantage responses gain log-probability, negative ones lose it."""
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.samples import Sample, collate
    from megatron_tlt.rl.trainer import Trainer

    cfg = load_config([], [f"model.hf_path={tiny_policy}", "grpo.prompts_per_step=1",
                           "grpo.group_size=4", "train.lr=3e-3", "data.train_size=4",
                           "rollout.cpu_kernels=false", "train.optimizer=torch"])
    trainer = Trainer(cfg, setup(cfg))
    prompt = trainer.train_prompts[0]
    gen = torch.Generator().manual_seed(0)
    samples = []
    for k, adv in enumerate([1.0, 1.0, -1.0, -1.0]):
        resp = torch.randint(100, 30000, (6,), generator=gen).tolist()
        samples.append(Sample(prompt_index=0, prompt_ids=list(prompt.token_ids),
                              response_ids=resp, rollout_logprobs=[-1.0] * 6,
                              finish_reason="stop", advantage=adv, uid=prompt.uid))

    def mean_logprob():
        mb = collate(samples, range(4), pad_id=0)
        lp = trainer.policy.logprobs([mb])[0]
        return (lp * mb.mask).sum(1) / mb.mask.sum(1)

    before = mean_logprob()
    trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
    trainer._update(samples, [True] * 4, fused_old=False)
    delta = mean_logprob() - before
    assert (delta[:2] > 0).all(), delta
    assert (delta[2:] < 0).all(), delta


def _drafter_for(policy: Path, out: Path) -> Path:
    """A (random) one-layer drafter checkpoint for the tiny policy, in a subprocess-free
    way: built and saved in this process."""
    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    arch = arch_from_source(policy)
    d = EagleDrafter(DrafterConfig.for_target(arch), arch)
    return save_drafter(d, out)


def test_cli_two_steps_with_speculation_checkpoint_and_exact_resume(
        tiny_policy, tmp_path, single_process_parallel):
    drafter = _drafter_for(tiny_policy, tmp_path / "drafter.safetensors")
    spec = [f"rollout.speculative.drafter={drafter}", "rollout.speculative.threshold=8",
            "rollout.speculative.policy=fixed", "rollout.speculative.strategy=2_1_2"]
    full = tmp_path / "full"
    r = run_script("pretrain_rl_tlt.py", *_tiny_args(tiny_policy, full, "train.steps=2",
                                                     "tracking.plots=true",
                                                     "tracking.wandb_mode=offline", *spec),
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    records = [json.loads(x) for x in (full / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == [1, 2]
    for rec in records:
        assert rec["spec"]["steps"] > 0 and rec["spec"]["on_fraction"] > 0
        assert 0.0 <= rec["accuracy"] <= 1.0
        assert rec["response_length/max"] <= 8
        assert math.isfinite(rec["loss/total"]) and rec["grad_norm"] > 0
        assert len(rec["timeline"]["replica_finish"]) == 1
    assert (full / "run" / "curves.png").stat().st_size > 0
    assert "W&B run" in r.stdout and list((full / "run" / "wandb").glob("offline-run-*"))
    assert (full / "run" / "timeline.png").stat().st_size > 0
    r = run_script("tools/plot_run.py", full / "run" / "metrics.jsonl", "--out", tmp_path / "p")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in (tmp_path / "p").glob("*.png")) == ["curves.png",
                                                                      "timeline.png"]

    # the same run stopped after step 1 and resumed gives the same step 2
    ckpt = tmp_path / "ckpt"
    part = tmp_path / "part"
    r = run_script("pretrain_rl_tlt.py", *_tiny_args(tiny_policy, part, "train.steps=1",
                                                     f"checkpoint.save={ckpt}", *spec),
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (ckpt / "latest").read_text().strip() == "step_0000001"
    r = run_script("pretrain_rl_tlt.py", *_tiny_args(tiny_policy, part, "train.steps=2",
                                                     f"checkpoint.load={ckpt}", *spec),
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stdout
    resumed = [json.loads(x) for x in (part / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in resumed] == [1, 2]
    a, b = records[1], resumed[1]
    for key in ("reward/mean", "response_length/mean", "loss/total", "grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), key


def test_resume_refuses_a_missing_checkpoint(tiny_policy, tmp_path):
    r = run_script("pretrain_rl_tlt.py", *_tiny_args(tiny_policy, tmp_path, "train.steps=1",
                                                     f"checkpoint.load={tmp_path / 'none'}"))
    assert r.returncode != 0
    assert "no checkpoint found" in r.stderr


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_every_recipe_dry_runs(recipe):
    world = {"smollm2_cpu": 2, "smollm2_learn": 2, "qwen2.5_7b_grpo": 8, "qwen2.5_32b_grpo": 64,
             "qwen3_30b_a3b_grpo": 16}.get(recipe.stem, 8)
    # the entry point's main in this process (test_dry_run_rejects_a_bad_layout and the
    # CLI runs above launch the script itself)
    r = run_main("pretrain_rl_tlt.py", "--config", recipe, "--dry-run", "--world-size", world)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "recipe OK" in r.stdout and "memory per rank" in r.stdout
    assert "predicted step time" in r.stdout and "expected speedup" in r.stdout
    if recipe.stem == "qwen2.5_32b_grpo":  # TP4 x PP2: the rollout memory of each stage
        stages = [line for line in r.stdout.splitlines() if line.strip().startswith("stage ")]
        assert [s.split(":")[0].strip() for s in stages] == ["stage 0", "stage 1"]
        assert all("KV cache" in s and "layers" in s for s in stages)


def test_dry_run_rejects_a_bad_layout():
    r = run_script("pretrain_rl_tlt.py", "--config", REPO / "examples/rl/smollm2_cpu.yaml",
                   "--dry-run", "--world-size", "3")
    assert r.returncode == 2
    assert "data-parallel" in r.stderr or "divisible" in r.stderr


def test_megatron_flags_are_aliases():
    import importlib.util

    spec = importlib.util.spec_from_file_location("entry", REPO / "pretrain_rl_tlt.py")
    entry = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(entry)
    _, cfg = entry.parse(["--tensor-model-parallel-size", "2", "--lr", "3e-6",
                          "--grpo-group-size", "16", "--grpo-clamp-eps-upper", "0.3",
                          "--global-batch-size", "64", "--save", "/tmp/x",
                          "--grpo-kl-beta", "0.01", "train.lr=5e-6"])
    assert cfg.parallel.tensor_model_parallel_size == 2
    assert cfg.grpo.group_size == 16 and cfg.grpo.clip_eps_high == 0.3
    assert cfg.train.global_batch_size == 64 and cfg.checkpoint.save == "/tmp/x"
    assert cfg.grpo.kl_beta == 0.01
    assert cfg.train.lr == 5e-6  # an explicit section.field=value wins over an alias
