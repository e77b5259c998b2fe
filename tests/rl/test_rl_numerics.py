"""GRPO off the default path, on a tiny policy with SmolLM2's real tokenizer.

Every training dtype learns (float16 through megatron-core's loss scaling); at a
sampling temperature T != 1 the rollout, old and training log-probs are all
log softmax(logits / T) (top-p does not truncate them), so the on-policy ratio is 1 and
the loss gradient is the tempered one; loss metrics do not depend on whether
zero-advantage samples skip their backward; edge cases of the reward and the
denominators.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_fixtures import save_tiny_policy

T = 0.7


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("rl_num") / "policy", smollm2_dir)


def _trainer(policy, *extra):
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.trainer import Trainer

    cfg = load_config([], [f"model.hf_path={policy}", "grpo.prompts_per_step=1",
                           "grpo.group_size=4", "grpo.max_new_tokens=6", "data.train_size=4",
                           "rollout.cpu_kernels=false", "train.clip_grad=0", *extra])
    return Trainer(cfg, setup(cfg))


def _samples(trainer, advantages, lengths=None, seed=0):
    from megatron_tlt.rl.samples import Sample

    prompt = trainer.train_prompts[0]
    gen = torch.Generator().manual_seed(seed)
    out = []
    for k, adv in enumerate(advantages):
        n = 6 if lengths is None else lengths[k]
        resp = torch.randint(100, 30000, (n,), generator=gen).tolist()
        out.append(Sample(prompt_index=0, prompt_ids=list(prompt.token_ids),
                          response_ids=resp, rollout_logprobs=[-1.0] * n,
                          finish_reason="stop", advantage=adv, uid=prompt.uid))
    return out


def _mean_logprobs(trainer, samples):
    from megatron_tlt.rl.samples import collate

    mb = collate(samples, range(len(samples)), pad_id=0)
    lp = trainer.policy.logprobs([mb])[0].float()
    return (lp * mb.mask).sum(1) / mb.mask.sum(1)


# ------------------------------------------------------------------ training dtypes

@pytest.fixture(scope="module")
def float32_run(tiny_policy, single_process_parallel):
    return _train_a_few_steps(tiny_policy, "float32")


def _train_a_few_steps(policy, dtype):
    trainer = _trainer(policy, f"model.dtype={dtype}", "train.lr=1e-3")
    samples = _samples(trainer, [1.0, 1.0, -1.0, -1.0])
    before = _mean_logprobs(trainer, samples)
    norms, skipped = [], 0
    for _ in range(3):
        trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
        upd = trainer._update(samples, [True] * 4, fused_old=False)
        norms += upd["grad_norm"]
        skipped += upd["skipped"]
    delta = _mean_logprobs(trainer, samples) - before
    return dict(norms=norms, skipped=skipped, delta=delta, loss_scale=upd["loss_scale"],
                trainer=trainer)


@pytest.mark.parametrize("dtype,rel", [("bfloat16", 0.03), ("float16", 2e-3)])
def test_every_training_dtype_learns(tiny_policy, single_process_parallel, float32_run,
                                     dtype, rel):
    """The first step's gradient norm (same weights, same samples) agrees with float32
    within the dtype's precision, and three steps raise positive-advantage log-probs
    and lower negative ones; float16 steps are loss-scaled and none overflows."""
    run = _train_a_few_steps(tiny_policy, dtype)
    ref = float32_run
    assert ref["skipped"] == 0 and ref["norms"][0] > 0
    assert run["skipped"] == 0 and len(run["norms"]) == 3
    assert run["norms"][0] == pytest.approx(ref["norms"][0], rel=rel)
    for r in (ref, run):
        assert (r["delta"][:2] > 0).all() and (r["delta"][2:] < 0).all(), r["delta"]
    assert run["loss_scale"] == (2.0 ** 16 if dtype == "float16" else 1.0)


def test_float16_overflow_skips_the_step_and_backs_off(tiny_policy, single_process_parallel):
    """A loss scale so large the float16 gradients overflow: the step is skipped (weights
    unchanged, counted), and after megatron-core's hysteresis of 2 the scale halves."""
    trainer = _trainer(tiny_policy, "model.dtype=float16", "train.lr=1e-3")
    samples = _samples(trainer, [1.0, 1.0, -1.0, -1.0])
    for opt in trainer.policy.optimizer.chained_optimizers:
        opt.grad_scaler._scale.fill_(2.0 ** 120)
    before = [p.detach().clone() for p in trainer.policy.module.parameters()]
    skipped = 0
    for _ in range(2):
        trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
        upd = trainer._update(samples, [True] * 4, fused_old=False)
        skipped += upd["skipped"]
        assert upd["grad_norm"] == []
    assert skipped == 2
    assert upd["loss_scale"] == 2.0 ** 119
    for a, b in zip(before, trainer.policy.module.parameters()):
        assert torch.equal(a, b)


def test_float16_with_the_torch_optimizer_is_refused(tiny_policy, single_process_parallel):
    from megatron_tlt.config import ConfigError

    with pytest.raises(ConfigError, match="model.dtype=bfloat16"):
        _trainer(tiny_policy, "model.dtype=float16", "train.optimizer=torch")


# ------------------------------------------------------------------ temperature

@pytest.fixture(scope="module")
def tempered(tiny_policy, single_process_parallel):
    """A policy sampling at T = 0.7 with top-p 0.9, learning rate 0: updates compute
    their losses, gradients and metrics without moving the weights."""
    return _trainer(tiny_policy, f"grpo.temperature={T}", "grpo.top_p=0.9", "train.lr=0")


def test_rollout_logprobs_are_tempered_and_match_training(tempered):
    """The engine's log-probs are log softmax(z / T) of the sampled tokens, untruncated
    by top-p (a full forward computed here by hand), and equal the trainer's old
    log-probs up to float noise: the mismatch metrics sit at noise, and the ratio of a
    not-yet-updated policy is exactly 1."""
    from megatron_tlt.models.inference import forward_local_logits, gather_logits

    trainer = tempered
    roll = trainer._rollout(trainer.train_prompts[:1], [0], seed=5, t_step=0.0)
    samples = roll.samples
    assert len(samples) == 4 and all(s.response_ids for s in samples)
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        with torch.no_grad():
            z = gather_logits(forward_local_logits(trainer.policy.module, ids),
                              trainer.arch)[0].float()
        p = len(s.prompt_ids)
        want = torch.log_softmax(z / T, dim=-1)[p - 1:-1].gather(
            -1, torch.tensor(s.response_ids)[:, None])[:, 0]
        assert torch.allclose(torch.tensor(s.rollout_logprobs), want, atol=2e-4), (
            s.rollout_logprobs, want)
    for s in samples:
        s.advantage = 1.0
    trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
    upd = trainer._update(samples, [True] * 4, fused_old=False)
    sums, tokens = upd["sums"], upd["sums"]["tokens"]
    assert tokens == sum(len(s.response_ids) for s in samples)
    assert upd["maxes"]["ratio_max"] == 1.0 and sums["ratio_sum"] == tokens
    assert sums["rollout_logp_abs_diff_sum"] / tokens < 2e-5
    assert sums["mismatch_ratio_err_sum"] / tokens < 2e-5


def test_loss_gradient_is_the_tempered_one(tempered):
    """token-mean, on-policy: dL/dz_t = -A / n (onehot(x_t) - softmax(z_t / T)) / T at
    each response position; pushed through the model by autograd it gives the
    gradient the trainer accumulated."""
    from megatron_tlt.models.inference import forward_local_logits

    trainer = tempered
    samples = _samples(trainer, [1.0, -0.5], seed=3)
    trainer._update(samples, [True] * 2, fused_old=True)
    params = [p for p in trainer.policy.module.parameters() if p.requires_grad]
    got = [p.main_grad.detach().clone() for p in params]

    n = sum(len(s.response_ids) for s in samples)
    trainer.policy.ddp.zero_grad_buffer()  # as train_step starts: DDP's hooks
    trainer.policy.optimizer.zero_grad()   # accumulate into the same buffers
    for s in samples:
        ids = torch.tensor([s.prompt_ids + s.response_ids])
        z = forward_local_logits(trainer.policy.module, ids)[0].float()
        k = len(s.prompt_ids)
        pos = torch.arange(k - 1, ids.shape[1] - 1)
        onehot = torch.nn.functional.one_hot(torch.tensor(s.response_ids), z.shape[-1])
        dz = torch.zeros_like(z)
        dz[pos] = -s.advantage / n * (onehot - torch.softmax(z[pos].detach() / T, -1)) / T
        z.backward(dz)
    for p, g in zip(params, got):
        want = p.main_grad
        assert want.abs().max() > 0
        assert torch.allclose(g, want, rtol=1e-3, atol=1e-7), (p.shape, (g - want).abs().max())


# ------------------------------------------------------------------ metrics

def test_loss_metrics_do_not_depend_on_skipping(tempered, monkeypatch):
    """Zero-advantage samples skip their backward (no KL, no entropy term) or not: the
    same metric sums over the same tokens. The issue's example: A = 0 and A = +1, equal
    lengths, on-policy: the policy loss per token is -0.5 either way."""
    trainer = tempered
    samples = _samples(trainer, [0.0, 1.0, 0.0, -1.0], lengths=[6, 6, 4, 5], seed=1)
    trainer._fill_logprobs(samples, trainer.policy, "old_logprobs")
    assert trainer._skips_zero_advantage()
    on = trainer._update(samples, [True] * 4, fused_old=False)
    monkeypatch.setattr(trainer, "_skips_zero_advantage", lambda: False)
    off = trainer._update(samples, [True] * 4, fused_old=False)
    assert on["sums"].keys() == off["sums"].keys()
    assert on["sums"]["tokens"] == off["sums"]["tokens"] == 21
    for k in on["sums"]:
        assert on["sums"][k] == pytest.approx(off["sums"][k], rel=1e-5, abs=1e-6), k
    assert on["maxes"]["ratio_max"] == pytest.approx(off["maxes"]["ratio_max"], rel=1e-6)

    pair = _samples(trainer, [0.0, 1.0], lengths=[10, 10], seed=2)
    monkeypatch.undo()
    upd = trainer._update(pair, [True] * 2, fused_old=True)
    assert upd["sums"]["pg_loss_sum"] / upd["sums"]["tokens"] == pytest.approx(-0.5)
    assert upd["sums"]["loss"] == pytest.approx(-0.5)


def test_dual_clip_fraction_and_tis_weight_are_reported():
    """The trainer's metric names for the dual-clip and TIS sums (from the step's
    metrics builder, on a hand-made update)."""

    from megatron_tlt.config import Config, GRPOConfig
    from megatron_tlt.rl.rollout import ReplicaRollout
    from megatron_tlt.rl.step_metrics import step_metrics

    # one process, no process group: the collectives are the identity
    tis = Config(grpo=GRPOConfig(tis_cap=2.0, dual_clip_c=3.0)).grpo.tis_cap > 0
    upd = {"sums": {"tokens": 8.0, "dual_clip_count": 2.0, "tis_weight_sum": 6.0},
           "maxes": {}, "grad_norm": [1.0], "lr": [1e-3], "skipped": 0, "updates": 1,
           "loss_scale": 1.0}
    out = step_metrics([], ReplicaRollout([], 0.0, 1.0, 0), [1.0], {"step": 1.0}, upd, 0,
                       0, 0, dp_group=None, lr=1e-3, tis=tis)
    assert out["clip_fraction/dual"] == 0.25
    assert out["tis/weight_mean"] == 0.75
    assert out["rollout/prefill_tokens"] == out["rollout/prefill_shared_rows"] == 0


def test_rollout_prefill_metrics_come_from_the_engine_stats():
    """rollout/prefill_{tokens,seconds,shared_rows}: the replica's generate stats (one
    prefill per prompt, rollout.share_prefill) in the step's record."""

    from megatron_tlt.config import Config
    from megatron_tlt.rl.rollout import ReplicaRollout
    from megatron_tlt.rl.step_metrics import step_metrics

    upd = {"sums": {"tokens": 1.0}, "maxes": {}, "grad_norm": [1.0], "lr": [1e-3],
           "skipped": 0, "updates": 1, "loss_scale": 1.0}
    roll = ReplicaRollout([], 0.0, 1.0, 0, stats={"prefill_tokens": 120,
                                                  "prefill_seconds": 0.25,
                                                  "prefill_shared_rows": 14})
    out = step_metrics([], roll, [1.0], {"step": 1.0}, upd, 0, 0, 0, dp_group=None,
                       lr=1e-3, tis=Config().grpo.tis_cap > 0)
    assert out["rollout/prefill_tokens"] == 120
    assert out["rollout/prefill_seconds"] == 0.25
    assert out["rollout/prefill_shared_rows"] == 14
    assert "rollout/preemptions" not in out  # fixed slots: no paged figures


def test_paged_kv_metrics_are_summed_and_maxed_over_replicas_and_rounds(monkeypatch):
    """rollout.kv_cache=paged: rollout/preemptions summed over the replicas and the
    step's rounds (dynamic sampling), rollout/rows_peak and rollout/kv_bytes_peak the
    largest; the run's reading reports them. Two replicas, the other one's figures
    made up in the gathered objects."""
    from megatron_tlt import collectives
    from megatron_tlt.rl import step_metrics as sm
    from megatron_tlt.rl.report import reading
    from megatron_tlt.rl.rollout import ReplicaRollout
    from megatron_tlt.rollout.outputs import GenerateStats

    def summary(pre, rows, nbytes):
        st = GenerateStats(kv_blocks=64, preemptions=pre)
        st.note_blocks(nbytes // 1024, rows, 1024)
        return st.summary()

    stats = summary(2, 12, 40 * 1024)
    sm.add_round(stats, summary(1, 14, 8 * 1024))  # a dynamic-sampling round
    assert (stats["preemptions"], stats["rows_peak"], stats["kv_bytes_peak"]) == \
        (3, 14, 40 * 1024)

    def two_replicas(obj, group=None):  # the other replica: 5 preemptions, 20 rows
        if isinstance(obj, tuple) and len(obj) == 3 and isinstance(obj[2], tuple):
            return [obj, (obj[0], obj[1], (5, 20, 16 * 1024))]
        return [obj, obj]

    monkeypatch.setattr(collectives, "all_gather_object", two_replicas)
    upd = {"sums": {"tokens": 1.0}, "maxes": {}, "grad_norm": [1.0], "lr": [1e-3],
           "skipped": 0, "updates": 1, "loss_scale": 1.0}
    out = sm.step_metrics([], ReplicaRollout([], 0.0, 1.0, 0, stats=stats), [1.0, 1.0],
                          {"step": 1.0}, upd, 0, 0, 0, dp_group=None, lr=1e-3, tis=False)
    assert out["rollout/preemptions"] == 3 + 5
    assert out["rollout/rows_peak"] == 20
    assert out["rollout/kv_bytes_peak"] == 40 * 1024
    line = next(ln for ln in reading([{"step": 1, "reward/mean": 0.0, **out}])
                if ln.startswith("KV cache"))
    assert "up to 20 rows in flight" in line and "8 rows preempted" in line
    assert "rollout.kv_cache_gib" in line


# ------------------------------------------------------------------ edge cases

def test_group_size_one_is_refused():
    from megatron_tlt.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="grpo.group_size must be >= 2"):
        load_config([], ["grpo.group_size=1"])


def test_overlong_penalty_is_floored_past_the_cap():
    from megatron_tlt.rl.grpo import overlong_penalty

    pen = overlong_penalty(torch.tensor([90, 100, 101, 150]), 100, 20, 0.5)
    assert pen.tolist() == [-0.25, -0.5, -0.5, -0.5]


def test_empty_responses_are_not_counted_as_sequences(tempered, monkeypatch):
    """seq-mean-token-mean over one 5-token response (A = +1, on-policy) and one empty
    response: the mean over sequences with a loss token is -1, not -1/2."""
    trainer = tempered
    monkeypatch.setattr(trainer.cfg.grpo, "loss_agg", "seq-mean-token-mean")
    samples = _samples(trainer, [1.0, -1.0], lengths=[5, 0], seed=4)
    upd = trainer._update(samples, [True] * 2, fused_old=True)
    assert upd["sums"]["sequences"] == 1.0
    assert upd["sums"]["loss"] == pytest.approx(-1.0)
    assert math.isfinite(upd["sums"]["pg_loss_sum"])
