"""megatron-core's memory controls in the trained policy: activation recomputation
(selective, full) leaves one GRPO step's loss and gradient norm unchanged and keeps
fewer activations (bytes of the tensors autograd saves, counted by a saved-tensors hook:
deterministic, unlike a timing or RSS); the config fields and their checks; micro-batches
at PP > 1 carry no padding beyond their own longest sample.
"""

from __future__ import annotations

import pytest
import torch

from rl_fixtures import save_tiny_policy


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("memctl") / "policy", smollm2_dir,
                            layers=4)


def _trainer(policy, *extra):
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.trainer import Trainer

    cfg = load_config([], [f"model.hf_path={policy}", "grpo.prompts_per_step=1",
                           "grpo.group_size=4", "grpo.max_new_tokens=40",
                           "data.train_size=4", "rollout.cpu_kernels=false",
                           "train.clip_grad=0", *extra])
    return Trainer(cfg, setup(cfg))


def _samples(trainer, lengths, advantages, seed=0):
    from megatron_tlt.rl.samples import Sample

    prompt = trainer.train_prompts[0]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for n, adv in zip(lengths, advantages):
        resp = torch.randint(100, 30000, (n,), generator=gen).tolist()
        out.append(Sample(prompt_index=0, prompt_ids=list(prompt.token_ids),
                          response_ids=resp, rollout_logprobs=[-1.0] * n,
                          finish_reason="stop", advantage=adv, uid=prompt.uid))
    return out


class SavedBytes:
    """Peak bytes of the tensors autograd holds for backward, through a saved-tensors
    hook: each saved tensor counts from its save until its graph frees it (a recomputed
    chunk's tensors count only while that chunk's backward runs)."""

    def __init__(self):
        self.live = self.peak = 0

    def __enter__(self):
        meter = self

        class Held:
            def __init__(self, t):
                self.t, self.n = t, t.numel() * t.element_size()
                meter.live += self.n
                meter.peak = max(meter.peak, meter.live)

            def __del__(self):
                meter.live -= self.n

        self._ctx = torch.autograd.graph.saved_tensors_hooks(Held, lambda held: held.t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        self._ctx.__exit__(*exc)


def _one_step(policy, *extra):
    """(loss, grad norm, peak saved bytes) of one GRPO update on fixed samples."""
    trainer = _trainer(policy, *extra)
    samples = _samples(trainer, [40, 31, 17, 8], [1.0, -0.5, 0.7, -1.2])
    trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
    with SavedBytes() as saved:
        upd = trainer._update(samples, [True] * 4, fused_old=False)
    return upd["sums"]["loss"], upd["grad_norm"][0], saved.peak


@pytest.fixture(scope="module")
def recompute_runs(tiny_policy, single_process_parallel):
    return {g: _one_step(tiny_policy, f"train.recompute_granularity={g}",
                         "train.recompute_num_layers=2")
            for g in ("none", "selective", "full")}


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recomputation_keeps_the_step_and_saves_activations(recompute_runs, granularity):
    loss, norm, saved = recompute_runs[granularity]
    loss0, norm0, saved0 = recompute_runs["none"]
    assert loss == pytest.approx(loss0, rel=1e-5, abs=1e-7)
    assert norm == pytest.approx(norm0, rel=1e-5)
    assert norm0 > 0
    assert saved < saved0
    if granularity == "full":  # only each 2-layer chunk's input is kept
        assert saved < recompute_runs["selective"][2]


def test_recomputation_is_configured_in_megatron_core(tiny_policy, single_process_parallel):
    trainer = _trainer(tiny_policy, "train.recompute_granularity=full",
                       "train.recompute_method=block", "train.recompute_num_layers=3")
    config = trainer.policy.module.config
    assert (config.recompute_granularity, config.recompute_method,
            config.recompute_num_layers) == ("full", "block", 3)
    assert config.sequence_parallel is False  # TP = 1: nothing to split over
    trainer = _trainer(tiny_policy, "train.recompute_granularity=selective")
    config = trainer.policy.module.config
    assert config.recompute_granularity == "selective" and config.recompute_method is None


# ------------------------------------------------------------------ config

def test_memory_control_fields(tmp_path):
    from megatron_tlt.config import ConfigError, load_config
    from megatron_tlt.models.gpt import memory_controls

    yaml = tmp_path / "c.yaml"
    yaml.write_text("parallel:\n  tensor_model_parallel_size: 2\n  sequence_parallel: off\n")
    cfg = load_config([yaml])  # a bare YAML off is a boolean: read as "off"
    assert cfg.parallel.sequence_parallel == "off"
    assert not memory_controls(cfg.train, cfg.parallel).sequence_parallel
    cfg = load_config([], ["parallel.tensor_model_parallel_size=2"])
    assert cfg.parallel.sequence_parallel == "auto"
    assert memory_controls(cfg.train, cfg.parallel).sequence_parallel  # auto: on at TP 2
    cfg = load_config([], ["parallel.sequence_parallel=on"])
    assert not memory_controls(cfg.train, cfg.parallel).sequence_parallel  # TP 1
    assert cfg.train.recompute_granularity == "none" and cfg.train.loss_chunk_tokens > 0
    for bad in ("train.recompute_granularity=some", "train.recompute_method=all",
                "train.recompute_num_layers=0", "train.loss_chunk_tokens=-1",
                "parallel.sequence_parallel=maybe"):
        with pytest.raises(ConfigError):
            load_config([], [bad])


def test_recompute_layers_beyond_a_stage_are_refused():
    from megatron_tlt.config import ConfigError, load_config, validate_for_run
    from megatron_tlt.models.gpt import ModelArch
    from tiny_models import TINY_CONFIGS

    spec = dict(TINY_CONFIGS["llama_tied"], model_type="llama")
    arch = ModelArch.from_hf_config(spec)  # 4 layers
    cfg = load_config([], ["parallel.pipeline_model_parallel_size=2",
                           "train.recompute_granularity=full",
                           "train.recompute_num_layers=3"])
    with pytest.raises(ConfigError, match="recompute_num_layers=3 exceeds the 2 layers"):
        validate_for_run(cfg, arch, 2)


def test_gpu_recipes_turn_the_controls_on():
    from pathlib import Path

    from megatron_tlt.config import load_config

    root = Path(__file__).resolve().parents[2] / "examples" / "rl"
    for name in ("qwen2.5_7b_grpo.yaml", "qwen2.5_32b_grpo.yaml"):
        cfg = load_config([root / name])
        assert cfg.train.recompute_granularity in ("selective", "full"), name
        assert cfg.parallel.tensor_model_parallel_size > 1, name
        assert cfg.parallel.sequence_parallel in ("auto", "on"), name
