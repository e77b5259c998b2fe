"""The one logits-processing function and the samplers built on it."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tlt.rollout.sampling import (STREAM_SAMPLE, SamplingParams, choose_tokens,
                                           processed_logprobs, sample_rows, stream_salts)


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


@pytest.mark.parametrize("streams", ["keys", "positions"])
def test_samples_follow_the_processed_distribution(streams):
    """40,000 draws, all rows at once: 40,000 requests' streams at one position, or one
    request's stream at 40,000 positions; chi-square goodness of fit at the 0.1 %
    level."""
    from scipy.stats import chisquare

    logits = torch.tensor([[1.5, 1.0, 0.2, 0.0, -0.5, -3.0]])
    lp = processed_logprobs(logits, 0.8, top_k=5, top_p=0.95)
    p = lp.exp()[0]
    n = torch.arange(40_000)
    keys, pos = (n * 7919 + 3, torch.zeros_like(n)) if streams == "keys" else \
        (torch.full_like(n, 12345), n)
    toks = sample_rows(lp.expand(40_000, -1), stream_salts(keys, pos, STREAM_SAMPLE))
    counts = torch.bincount(toks, minlength=6).float()
    support = p > 0
    assert counts[~support].sum() == 0  # truncated tokens are never drawn
    expected = p[support] * counts.sum()
    assert chisquare(counts[support].numpy(), expected.numpy()).pvalue > 1e-3


def test_choose_tokens_mixes_greedy_and_sampled_rows():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 30, generator=g)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=0.0)]
    tokens, raw, processed = choose_tokens(logits, params, [None, (3, 0), None])
    assert torch.equal(tokens, logits.argmax(-1))  # top_k=1 sampling is greedy too
    ref = torch.log_softmax(logits, -1).gather(-1, tokens[:, None])[:, 0]
    assert torch.allclose(raw, ref)
    assert processed[1].item() == pytest.approx(0.0, abs=1e-6)  # top-1: probability 1


def test_streams_depend_on_key_position_and_tag_only():
    """A stream's salt is a function of (key, position, tag): the same in any batch and
    from host integers; any change of one of them gives another salt."""
    from megatron_tlt.rollout.sampling import STREAM_DRAFT, stream_salts_of

    keys = torch.tensor([5, 2**62 + 17, 5, 6])
    pos = torch.tensor([0, 3, 1, 0])
    a = stream_salts(keys, pos, STREAM_SAMPLE)
    assert torch.equal(a[1:2], stream_salts(keys[1:2], pos[1:2], STREAM_SAMPLE))
    assert torch.equal(a, stream_salts_of(keys.tolist(), pos.tolist(), STREAM_SAMPLE, "cpu"))
    assert len(set(a.tolist())) == 4
    tags = torch.tensor([STREAM_SAMPLE, STREAM_DRAFT])
    both = stream_salts(keys, pos, tags)
    assert torch.equal(both[:, 0], a) and not (both[:, 1] == a).any()
    assert ((0 <= a) & (a < 2**32)).all()


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
