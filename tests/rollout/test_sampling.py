"""The one logits-processing function and the samplers built on it."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tlt.rollout.sampling import (SamplingParams, choose_tokens, make_generators,
                                           processed_logprobs, sample_rows)


def test_temperature_topk_topp():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    lp = processed_logprobs(logits, 0.5)
    assert torch.allclose(lp, torch.log_softmax(logits / 0.5, -1))
    lp = processed_logprobs(logits, 1.0, top_k=2)
    assert torch.isinf(lp[0, 2:]).all() and torch.isfinite(lp[0, :2]).all()
    assert math.isclose(lp.exp().sum().item(), 1.0, rel_tol=1e-6)
    probs = torch.softmax(logits, -1)[0]  # 0.563, 0.207, 0.126, 0.076, 0.028
    # top_p=0.75: 0.563 < 0.75, 0.563+0.207 >= 0.75 -> keep two
    lp = processed_logprobs(logits, 1.0, top_p=0.75)
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert torch.allclose(lp[0, :2].exp(), probs[:2] / probs[:2].sum())
    # a tiny top_p still keeps the most likely token
    lp = processed_logprobs(logits, 1.0, top_p=1e-6)
    assert torch.isfinite(lp[0, 0]) and torch.isinf(lp[0, 1:]).all()
    # top-k then top-p, the order the function documents
    lp = processed_logprobs(logits, 1.0, top_k=3, top_p=0.7)
    kept = probs[:3] / probs[:3].sum()  # 0.628, 0.231, 0.141 -> top_p 0.7 keeps 2
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    assert torch.allclose(lp[0, :2].exp(), kept[:2] / kept[:2].sum())
    # greedy: the raw distribution (argmax is taken by the caller)
    assert torch.allclose(processed_logprobs(logits, 0.0), torch.log_softmax(logits, -1))


def test_rows_in_any_order_are_processed_alike():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    lp = processed_logprobs(logits, 0.7, top_k=10, top_p=0.9)
    flipped = processed_logprobs(logits.flip(0), 0.7, top_k=10, top_p=0.9).flip(0)
    assert torch.equal(lp, flipped)


def test_samples_follow_the_processed_distribution():
    """40,000 draws: chi-square goodness of fit at the 0.1 % level."""
    from scipy.stats import chisquare

    logits = torch.tensor([[1.5, 1.0, 0.2, 0.0, -0.5, -3.0]])
    lp = processed_logprobs(logits, 0.8, top_k=5, top_p=0.95)
    p = lp.exp()[0]
    gen = make_generators(0, 1, torch.device("cpu"))[0]
    counts = torch.zeros(6)
    for _ in range(40):
        toks = sample_rows(lp.expand(1000, -1), [gen] * 1000)
        counts += torch.bincount(toks, minlength=6).float()
    support = p > 0
    assert counts[~support].sum() == 0  # truncated tokens are never drawn
    expected = p[support] * counts.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_choose_tokens_mixes_greedy_and_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 30, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0)]
    gens = [None, make_generators(3, 1, torch.device("cpu"))[0], None]
    tokens, raw, processed = choose_tokens(logits, params, gens)
    assert torch.equal(tokens, logits.argmax(-1))  # top_k=1 sampling is greedy too
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(raw, ref)
    assert processed[1].item() == pytest.approx(0.0, abs=1e-6)  # top-1: probability 1


def test_generators_depend_on_seed_and_index_only():
    a = make_generators(5, 3, torch.device("cpu"))
    b = make_generators(5, 2, torch.device("cpu"), offset=1)
    draw = [torch.rand(4, generator=g) for g in a]
    assert torch.equal(draw[1], torch.rand(4, generator=b[0]))
    assert not torch.equal(draw[0], draw[1])


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_p=0.0), "top_p must be in"),
    (dict(top_k=-2), "top_k must be >= 0"),
    (dict(max_new_tokens=0), "max_new_tokens must be >= 1"),
    (dict(logprobs="scaled"), "logprobs must be one of"),
])
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)
