"""The GRPO loss family against hand-computed values and naive reference loops."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tlt.config import GRPOConfig
from megatron_tlt.rl.grpo import (LossDenominators, group_advantages, kl_penalty,
                                  loss_denominators, overlong_penalty, policy_loss,
                                  vocab_parallel_entropy, zero_std_groups)

EPS_LOW, EPS_HIGH = 0.2, 0.28
ONE = LossDenominators(tokens=1.0, sequences=1.0, max_len=1.0)


def _cfg(**kw) -> GRPOConfig:
    kw.setdefault("clip_eps_low", EPS_LOW)
    kw.setdefault("clip_eps_high", EPS_HIGH)
    return GRPOConfig(**kw)


def _tokens(ratios, advantages, **kw):
    """One single-token sequence per (ratio, advantage); loss = sum of token losses."""
    old = torch.tensor([[-1.0]] * len(ratios), dtype=torch.float64)
    logp = (old + torch.tensor([[math.log(r)] for r in ratios], dtype=torch.float64))
    logp.requires_grad_(True)
    adv = torch.tensor(advantages, dtype=torch.float64)
    loss, metrics = policy_loss(logp, old, adv, torch.ones_like(old), kw.pop("cfg", _cfg()),
                                ONE, **kw)
    loss.backward()
    return loss.item(), logp.grad[:, 0].tolist(), metrics


# ------------------------------------------------------------------ advantages, rewards

REWARDS = torch.tensor([1.0, 0, 0, 1,   2, 2, 2, 2,   0, 0, 0, 3])


def test_advantages_divided_by_the_unbiased_group_std():
    s1 = math.sqrt(4 * 0.5 ** 2 / 3)  # group 1: mean 0.5, unbiased std
    s3 = 1.5                          # group 3: mean 0.75, var (3*0.5625 + 5.0625) / 3
    expected = ([d / (s1 + 1e-6) for d in (0.5, -0.5, -0.5, 0.5)] + [0.0] * 4
                + [d / (s3 + 1e-6) for d in (-0.75, -0.75, -0.75, 2.25)])
    got = group_advantages(REWARDS, 4, norm_by_std=True)
    assert got.tolist() == pytest.approx(expected, rel=1e-6)


def test_advantages_without_std_are_centred_rewards():
    got = group_advantages(REWARDS, 4, norm_by_std=False)
    assert got.tolist() == pytest.approx(
        [0.5, -0.5, -0.5, 0.5] + [0.0] * 4 + [-0.75, -0.75, -0.75, 2.25])


@pytest.mark.parametrize("norm", [True, False])
def test_equal_rewards_give_exactly_zero(norm):
    rewards = torch.tensor([0.1] * 7 + [0.7] * 7)  # float32 mean(0.1 x 7) != 0.1
    assert group_advantages(rewards, 7, norm).tolist() == [0.0] * 14
    assert zero_std_groups(REWARDS, 4).tolist() == [False, True, False]
    assert zero_std_groups(rewards, 7).tolist() == [True, True]
    assert group_advantages(torch.tensor([1.0, 2.0]), 1, norm).tolist() == [0.0, 0.0]


def test_overlong_penalty_is_linear_over_the_buffer():
    # cap 10, buffer 4: free up to 6 tokens, then -2 * (len - 6) / 4.
    got = overlong_penalty(torch.tensor([3, 6, 7, 8, 10]), 10, 4, 2.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.5, -1.0, -2.0])


# ------------------------------------------------------------------ clipped surrogate

def test_each_clip_region_value_gradient_and_count():
    cases = [  # (ratio, advantage, token loss, d loss / d logp)
        (1.5, 1.0, -1.28, 0.0),   # A > 0, above 1 + eps_high: clipped
        (1.1, 1.0, -1.1, -1.1),   # A > 0, inside
        (0.5, 1.0, -0.5, -0.5),   # A > 0, below 1 - eps_low: not clipped
        (0.5, -1.0, 0.8, 0.0),    # A < 0, below 1 - eps_low: clipped
        (0.9, -1.0, 0.9, 0.9),    # A < 0, inside
        (1.5, -1.0, 1.5, 1.5),    # A < 0, above 1 + eps_high: not clipped
    ]
    for r, a, value, grad in cases:
        loss, grads, _ = _tokens([r], [a])
        assert loss == pytest.approx(value), (r, a)
        assert grads[0] == pytest.approx(grad, abs=1e-12), (r, a)
        # positive advantage: more probability, lower loss; negative: the opposite
        assert grads[0] == 0 or (grads[0] < 0) == (a > 0)

    _, _, metrics = _tokens([r for r, *_ in cases], [a for _, a, *_ in cases])
    assert metrics["clip_high_count"].item() == 1
    assert metrics["clip_low_count"].item() == 1
    assert metrics["dual_clip_count"].item() == 0
    assert metrics["tokens"].item() == 6 and metrics["sequences"].item() == 6
    assert metrics["ratio_sum"].item() == pytest.approx(1.5 + 1.1 + 0.5 + 0.5 + 0.9 + 1.5)
    assert metrics["ratio_max"].item() == pytest.approx(1.5)
    assert metrics["pg_loss_sum"].item() == pytest.approx(sum(c[2] for c in cases))


def test_dual_clip_bounds_negative_advantage_losses():
    cfg = _cfg(dual_clip_c=3.0)
    # A = -2, r = 4: max(8, 2.56) = 8 > 3 * 2 = 6: dual clip active, no gradient.
    loss, grads, metrics = _tokens([4.0], [-2.0], cfg=cfg)
    assert (loss, grads[0]) == (pytest.approx(6.0), 0.0)
    assert metrics["dual_clip_count"].item() == 1
    # A = -2, r = 2: 4 < 6, untouched; A > 0 is never dual-clipped.
    loss, grads, metrics = _tokens([2.0, 4.0], [-2.0, 2.0], cfg=cfg)
    assert loss == pytest.approx(4.0 - 2 * 1.28)
    assert grads == pytest.approx([4.0, 0.0])
    assert metrics["dual_clip_count"].item() == 0
    # off: the loss is unbounded
    loss, grads, _ = _tokens([4.0], [-2.0])
    assert (loss, grads[0]) == (pytest.approx(8.0), pytest.approx(8.0))


def test_truncated_importance_weights_are_capped_and_detached():
    old = torch.tensor([[-1.0, -1.0]], dtype=torch.float64)
    rollout = old - torch.tensor([[math.log(3.0), math.log(0.5)]], dtype=torch.float64)
    rollout.requires_grad_(True)
    logp = old.clone().requires_grad_(True)
    adv = torch.tensor([1.0], dtype=torch.float64)
    mask = torch.ones_like(old)
    loss, metrics = policy_loss(logp, old, adv, mask, _cfg(tis_cap=2.0), ONE,
                                rollout_logp=rollout)
    loss.backward()
    assert loss.item() == pytest.approx(-2.0 - 0.5)  # weights min(3, 2) and 0.5
    assert logp.grad[0].tolist() == pytest.approx([-2.0, -0.5])
    assert rollout.grad is None
    assert metrics["tis_weight_sum"].item() == pytest.approx(2.5)
    assert metrics["rollout_logp_abs_diff_sum"].item() == pytest.approx(math.log(6.0))
    # tis_cap = 0: off even with rollout log-probs
    loss, metrics = policy_loss(logp, old, adv, mask, _cfg(), ONE, rollout_logp=rollout)
    assert loss.item() == pytest.approx(-2.0)
    assert metrics["tis_weight_sum"].item() == 0


# ------------------------------------------------------------------ KL, entropy

def test_k1_and_k3_estimators():
    logp = torch.tensor([-1.0, -1.0])
    ref = torch.tensor([-1.5, -0.5])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.5])
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx(
        [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1])
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k2")


@pytest.mark.parametrize("kind", ["k1", "k3"])
def test_kl_term_in_the_loss(kind):
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -0.5]])
    k = ([0.5, -0.5] if kind == "k1"
         else [math.exp(-0.5) + 0.5 - 1, math.exp(0.5) - 0.5 - 1])
    cfg = _cfg(kl_beta=0.1, kl_type=kind)
    denoms = LossDenominators(tokens=2, sequences=1, max_len=2)
    loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2), cfg,
                                denoms, ref_logp=ref)
    assert loss.item() == pytest.approx(0.1 * sum(k) / 2)
    assert metrics["kl_sum"].item() == pytest.approx(sum(k))
    loss.backward()
    # d k1 / d logp = 1;  d k3 / d logp = 1 - exp(ref - logp)
    dk = [1.0, 1.0] if kind == "k1" else [1 - math.exp(-0.5), 1 - math.exp(0.5)]
    assert logp.grad[0].tolist() == pytest.approx([0.1 * d / 2 for d in dk])
    # reported but not in the loss when kl_beta = 0
    loss, metrics = policy_loss(logp, logp.detach(), torch.zeros(1), torch.ones(1, 2),
                                _cfg(kl_type=kind), denoms, ref_logp=ref)
    assert loss.item() == 0 and metrics["kl_sum"].item() == pytest.approx(sum(k))


def test_kl_without_reference_is_a_clear_error():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, torch.zeros(1), torch.ones(1, 2), _cfg(kl_beta=0.1), ONE)


def test_entropy_bonus():
    logp = torch.tensor([[-1.0, -2.0]])
    entropy = torch.tensor([[2.0, 3.0]], requires_grad=True)
    denoms = LossDenominators(tokens=2, sequences=1, max_len=2)
    loss, metrics = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2),
                                _cfg(entropy_coef=0.01), denoms, entropy=entropy)
    assert loss.item() == pytest.approx(-0.01 * 5 / 2)
    assert metrics["entropy_sum"].item() == pytest.approx(5.0)
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([-0.005, -0.005])
    loss, metrics = policy_loss(logp, logp, torch.zeros(1), torch.ones(1, 2), _cfg(),
                                denoms, entropy=entropy)
    assert loss.item() == 0 and metrics["entropy_sum"].item() == pytest.approx(5.0)


# ------------------------------------------------------------------ aggregation

def test_the_three_aggregations_and_padding_is_ignored():
    # r = 1 everywhere so token loss = -A: row 0 (A = 2) has 3 tokens of -2, row 1
    # (A = -1) one token of +1; padding holds garbage.
    old = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, float("inf"), 0.0]])
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, float("nan"), 5.0]],
                        requires_grad=True)
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([2.0, -1.0])
    denoms = LossDenominators(tokens=4, sequences=2, max_len=4)
    expected = {"token-mean": (-6 + 1) / 4,
                "seq-mean-token-mean": (-6 / 3 + 1 / 1) / 2,
                "seq-mean-token-sum-norm": (-6 + 1) / 4 / 2}
    for agg, value in expected.items():
        logp.grad = None
        loss, metrics = policy_loss(logp, old, adv, mask.float(), _cfg(loss_agg=agg), denoms)
        assert loss.item() == pytest.approx(value), agg
        loss.backward()
        assert torch.isfinite(logp.grad).all() and logp.grad[1, 1:].tolist() == [0, 0]
        assert metrics["tokens"].item() == 4 and metrics["ratio_max"].item() == 1.0


def _naive_minibatch_loss(logp, old, ref, rollout, ent, adv, mask, cfg):
    """The mini-batch loss by plain python loops over sequences and tokens."""
    c = cfg
    seq_terms, total, tokens, sequences = [], 0.0, 0, 0
    for i in range(logp.shape[0]):
        a, row = float(adv[i]), 0.0
        n = int(mask[i].sum())
        for t in range(logp.shape[1]):
            if not mask[i, t]:
                continue
            r = math.exp(logp[i, t] - old[i, t])
            pg = max(-a * r, -a * min(max(r, 1 - c.clip_eps_low), 1 + c.clip_eps_high))
            if c.dual_clip_c and a < 0:
                pg = min(pg, -c.dual_clip_c * a)
            pg *= min(math.exp(old[i, t] - rollout[i, t]), c.tis_cap)
            d = float(ref[i, t] - logp[i, t])
            kl = -d if c.kl_type == "k1" else math.exp(d) - d - 1
            row += pg + c.kl_beta * kl - c.entropy_coef * float(ent[i, t])
        total += row
        tokens += n
        if n:
            sequences += 1
            seq_terms.append(row / n)
    if c.loss_agg == "token-mean":
        return total / tokens
    if c.loss_agg == "seq-mean-token-mean":
        return sum(seq_terms) / sequences
    return total / c.max_new_tokens / sequences


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean",
                                 "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_micro_batches_and_ranks_sum_to_the_minibatch_loss(agg, kl_type):
    g = torch.Generator().manual_seed(0)
    b, t = 8, 6
    old = -torch.rand(b, t, generator=g, dtype=torch.float64) * 3
    logp = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.4
    ref = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    rollout = old + torch.randn(b, t, generator=g, dtype=torch.float64) * 0.3
    ent = torch.rand(b, t, generator=g, dtype=torch.float64) * 4
    adv = torch.randn(b, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])  # uneven, one fully masked
    mask = torch.arange(t)[None, :] < lengths[:, None]
    cfg = _cfg(loss_agg=agg, kl_type=kl_type, kl_beta=0.05, entropy_coef=0.01,
               dual_clip_c=3.0, tis_cap=1.2, max_new_tokens=t)
    expected = _naive_minibatch_loss(logp, old, ref, rollout, ent, adv, mask, cfg)

    denoms = loss_denominators([mask], cfg.max_new_tokens)
    assert (denoms.tokens, denoms.sequences, denoms.max_len) == (27, 7, 6)
    whole_logp = logp.clone().requires_grad_(True)
    whole, _ = policy_loss(whole_logp, old, adv, mask, cfg, denoms, ref_logp=ref,
                           rollout_logp=rollout, entropy=ent)
    whole.backward()
    assert whole.item() == pytest.approx(expected, rel=1e-10)

    # 2 DP ranks x 2 micro-batches of 2 sequences each; denominators from all of them
    chunks = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    assert loss_denominators([mask[c] for c in chunks], t) == denoms
    split_logp = logp.clone().requires_grad_(True)
    total, tokens, sequences = 0.0, 0.0, 0.0
    for c in chunks:
        loss, metrics = policy_loss(split_logp[c], old[c], adv[c], mask[c], cfg, denoms,
                                    ref_logp=ref[c], rollout_logp=rollout[c], entropy=ent[c])
        loss.backward()
        total += loss.item()
        tokens += metrics["tokens"].item()
        sequences += metrics["sequences"].item()
    assert total == pytest.approx(expected, rel=1e-10)
    assert (tokens, sequences) == (27, 7)
    torch.testing.assert_close(split_logp.grad, whole_logp.grad)


# ------------------------------------------------------------------ entropy over the vocabulary

def test_vocab_parallel_entropy_at_tp1(single_process_parallel):
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 3, 7, generator=g) * 3).requires_grad_(True)
    got = vocab_parallel_entropy(logits)
    want = torch.distributions.Categorical(logits=logits.detach()).entropy()
    torch.testing.assert_close(got, want)
    assert got.dtype == torch.float32

    # gradient matches the plain formula -sum p log p
    got.sum().backward()
    ref_logits = logits.detach().clone().requires_grad_(True)
    p = torch.softmax(ref_logits, -1)
    (-(p * torch.log_softmax(ref_logits, -1)).sum(-1)).sum().backward()
    torch.testing.assert_close(logits.grad, ref_logits.grad)

    # padding columns (ids >= vocab_size) are masked out, whatever they hold
    padded = logits.detach().clone()
    padded[..., 5:] = torch.tensor([50.0, -float("inf")])
    padded.requires_grad_(True)
    got = vocab_parallel_entropy(padded, vocab_size=5)
    want = torch.distributions.Categorical(logits=logits.detach()[..., :5]).entropy()
    torch.testing.assert_close(got, want)
    got.sum().backward()
    assert torch.isfinite(padded.grad).all() and (padded.grad[..., 5:] == 0).all()

    # bf16 in, fp32 out; large logits stay finite; a one-hot softmax has entropy 0
    big = torch.tensor([[[1000.0, 0.0, -1000.0]]], dtype=torch.bfloat16)
    out = vocab_parallel_entropy(big)
    assert out.dtype == torch.float32 and out.item() == pytest.approx(0.0, abs=1e-6)
    uniform = vocab_parallel_entropy(torch.zeros(1, 1, 8), vocab_size=4)
    assert uniform.item() == pytest.approx(math.log(4))
