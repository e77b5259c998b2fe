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
    from megatron_tlt.config import ConfigError, load_config
    from megatron_tlt.validation import validate
    from megatron_tlt.models.gpt import ModelArch
    from tiny_models import TINY_CONFIGS

    spec = dict(TINY_CONFIGS["llama_tied"], model_type="llama")
    arch = ModelArch.from_hf_config(spec)  # 4 layers
    cfg = load_config([], ["parallel.pipeline_model_parallel_size=2",
                           "train.recompute_granularity=full",
                           "train.recompute_num_layers=3"])
    with pytest.raises(ConfigError, match="recompute_num_layers=3 exceeds the 2 layers"):
        validate(cfg, arch, 2)


def test_gpu_recipes_turn_the_controls_on():
    from pathlib import Path

    from megatron_tlt.config import load_config

    root = Path(__file__).resolve().parents[2] / "examples" / "rl"
    for name in ("qwen2.5_7b_grpo.yaml", "qwen2.5_32b_grpo.yaml"):
        cfg = load_config([root / name])
        assert cfg.train.recompute_granularity in ("selective", "full"), name
        assert cfg.parallel.tensor_model_parallel_size > 1, name
        assert cfg.parallel.sequence_parallel in ("auto", "on"), name


# ------------------------------------------------------------------ PP > 1 padding

def test_pipeline_micro_batches_carry_no_padding_beyond_their_longest_sample(
        tiny_policy, single_process_parallel, monkeypatch):
    """At PP = 2 the trainer's micro-batches go through megatron-core's pipeline schedule
    with variable_seq_lengths: each is sent at its own rows and its own longest sample.
    The schedule is replaced by one that records what it is handed and runs the same
    forward steps on this one-stage model, so the log-probs are also checked against
    the PP = 1 path."""
    import dataclasses

    import megatron.core.pipeline_parallel as mpp

    trainer = _trainer(tiny_policy, "train.micro_batch_size=3")
    lengths = [3, 5, 4, 40, 6, 7, 2, 33]  # a long tail: two long responses of eight
    samples = _samples(trainer, lengths, [0.5] * 8)
    pp1 = [lp.clone() for lp in trainer.policy.logprobs(
        trainer._micro_batches(samples, range(8), None, for_loss=False))]

    sent, calls = [], []

    def schedule(*, forward_step_func, data_iterator, model, num_microbatches, seq_length,
                 micro_batch_size, forward_only, collect_non_loss_data):
        calls.append(dict(seq_length=seq_length, micro_batch_size=micro_batch_size,
                          variable=model[0].config.variable_seq_lengths))
        out = []
        for _ in range(num_microbatches):
            mb = next(data_iterator)
            sent.append(mb)
            logits, finish = forward_step_func(iter([mb]), model[0])
            out.append(finish(logits))
        return out

    monkeypatch.setattr(mpp, "get_forward_backward_func", lambda: schedule)
    monkeypatch.setattr(trainer, "layout", dataclasses.replace(trainer.layout, pp_size=2))
    monkeypatch.setattr(trainer.policy, "pp_size", 2)
    trainer.policy.module.config.variable_seq_lengths = True  # as Policy sets it at PP 2
    handed = trainer._micro_batches(samples, range(8), None, for_loss=False)
    outs = trainer.policy.logprobs(handed)

    assert calls and all(c["variable"] for c in calls)
    assert len(sent) == len(handed) == 3
    computed = padding = 0
    for mb in sent:
        rows, width = mb.input_ids.shape
        own = [samples[i].length for i in mb.samples]
        assert rows == len(mb.samples)  # no filler rows
        assert width == max(own)        # no columns beyond its own longest sample
        computed += rows * width
        padding += rows * width - rows * max(own)
    assert padding == 0
    # against one fixed [micro_batch_size, longest of all] shape for every micro-batch
    # (what the stages exchanged without variable_seq_lengths)
    fixed = len(sent) * 3 * max(s.length for s in samples)
    assert computed < 0.7 * fixed, (computed, fixed)
    # the same log-probs as the PP = 1 path, at every response position
    by_sample = {}
    for mb, lp in zip(sent, outs):
        for r, i in enumerate(mb.samples):
            s = samples[i]
            p = len(s.prompt_ids)
            by_sample[i] = lp[r, p - 1:p - 1 + len(s.response_ids)]
    plans = trainer._micro_batches(samples, range(8), None, for_loss=False)
    for mb, lp in zip(plans, pp1):
        for r, i in enumerate(mb.samples):
            s = samples[i]
            p = len(s.prompt_ids)
            torch.testing.assert_close(by_sample[i], lp[r, p - 1:p - 1 + len(s.response_ids)],
                                       rtol=1e-5, atol=1e-5)


def test_sequence_parallel_widths_are_a_multiple_of_tp():
    from megatron_tlt.rl.samples import Sample, collate

    samples = [Sample(prompt_index=0, prompt_ids=[1, 2, 3], response_ids=[4] * n,
                      rollout_logprobs=[0.0] * n, finish_reason="stop") for n in (2, 4)]
    mb = collate(samples, [0, 1, 0], pad_id=9, width=12)
    mb.samples = [0, 1]  # the third row a filler, as the PP > 1 trainer pads rows
    fit = mb.fitted(4)
    assert fit.input_ids.shape == (2, 8) and fit.mask.shape == (2, 8)
    assert torch.equal(fit.mask[:, :7], mb.mask[:2, :7]) and fit.mask[:, 7:].sum() == 0
    assert fit.lengths == [5, 7]
    assert mb.fitted(1).input_ids.shape == (2, 7)


# ------------------------------------------------------------------ sequence parallelism

@pytest.mark.multiproc
def test_sequence_parallel_at_tp2_on_gloo_equals_plain_tp2(tiny_hf_dirs, tmp_path):
    """gloo runs sequence parallelism's reduce-scatter / all-gather: at TP=2 the loss and
    the gradient norm with SP (and with recomputation on top) equal those without, for
    an odd sequence length (padded to a multiple of TP by the forward)."""
    from cli import run_workers

    results = run_workers("tests/support/mp_sequence_parallel_worker.py", tmp_path,
                          "--model", tiny_hf_dirs["llama_tied"], nproc=2)
    for res in results:
        plain = res["plain"]
        assert not plain["sequence_parallel"] and plain["grad_norm"] > 0
        for name in ("sp", "sp_full", "sp_selective"):
            assert res[name]["sequence_parallel"], name
            assert res[name]["loss"] == pytest.approx(plain["loss"], rel=1e-5), name
            assert res[name]["grad_norm"] == pytest.approx(plain["grad_norm"], rel=1e-5), name
        assert res["sp_full"]["recompute"] == "full"
