"""Coupled (drafter-invariant) sampling: the counter-based Gumbel noise reproduces the
processed distribution (chi-square), and a request's coupled response is the same token
for token with speculation off, on with a good drafter, on with an adversarial random
drafter, chain and tree, alone or mixed in a batch of 16. TP=2 vs TP=1 is in
test_rollout_tp.py."""

from __future__ import annotations

import collections

import pytest
import torch
from scipy import stats as sps

from megatron_tlt.config import ConfigError, RolloutConfig
from megatron_tlt.rollout import SamplingParams
from megatron_tlt.rollout.sampling import (choose_tokens, coupled_argmax, coupled_gumbel,
                                           processed_logprobs, request_seed)
from test_speculative import _chi2_pvalue, _prompts, _random_drafter, _spec_engine, one_layer  # noqa: F401,E501

P_MIN = 1e-4
DRAWS = 24_000


# ------------------------------------------------------------------------- the noise
def test_noise_is_a_function_of_key_position_and_token_only():
    keys, pos = [11, 12, 11, 2**62 + 5], [0, 0, 7, 3]
    g = coupled_gumbel(keys, pos, 1000, "cpu")
    # any order, any batch: row by row the same values
    for i in range(len(keys)):
        alone = coupled_gumbel([keys[i]], [pos[i]], 1000, "cpu")[0]
        assert torch.equal(alone, g[i])
    assert torch.equal(coupled_gumbel(keys[::-1], pos[::-1], 1000, "cpu"), g.flip(0))
    # a longer vocabulary extends the row: token v's noise does not depend on the size
    assert torch.equal(coupled_gumbel(keys, pos, 1500, "cpu")[:, :1000], g)
    # different keys / positions: unrelated rows
    assert not torch.equal(g[0], g[1]) and not torch.equal(g[0], g[2])
    big = coupled_gumbel(list(range(64)), [5] * 64, 4096, "cpu").double()
    assert abs(big.mean().item() - 0.5772) < 0.01  # Euler-Mascheroni constant
    assert abs(big.std().item() - 1.2825) < 0.01  # pi / sqrt(6)
    c = torch.corrcoef(torch.stack([big[:, :-1].flatten(), big[:, 1:].flatten()]))[0, 1]
    assert abs(c.item()) < 0.01  # neighbouring tokens: independent


def _logits(vocab=12, seed=0, scale=1.5):
    return torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0),
                                                     (1.0, 5, 1.0), (0.7, 0, 0.8)])
def test_coupled_sampling_reproduces_the_processed_distribution(temperature, top_k, top_p):
    logits = _logits()
    lp = processed_logprobs(logits[None], temperature, top_k, top_p)[0]
    probs = {v: float(p) for v, p in enumerate(lp.exp()) if p > 0}
    keys = [request_seed(1234, i) for i in range(DRAWS)]
    tok = coupled_argmax(lp.expand(DRAWS, -1).contiguous(), keys, [3] * DRAWS)
    counts = collections.Counter(tok.tolist())
    assert _chi2_pvalue(counts, probs, DRAWS) > P_MIN
    # the test has power: the untempered distribution does not pass at T=0.7
    if temperature != 1.0:
        raw = {v: float(p) for v, p in enumerate(torch.softmax(logits, -1))}
        assert _chi2_pvalue(counts, raw, DRAWS) < P_MIN


def test_positions_of_one_request_are_independent():
    """The joint law of tokens t and t+1 of one key is the product of the marginals."""
    lp = torch.log_softmax(_logits(vocab=4, seed=2, scale=0.7), -1)
    keys = [request_seed(7, i) for i in range(DRAWS)]
    a = coupled_argmax(lp.expand(DRAWS, -1).contiguous(), keys, [10] * DRAWS)
    b = coupled_argmax(lp.expand(DRAWS, -1).contiguous(), keys, [11] * DRAWS)
    table = torch.zeros(4, 4)
    for x, y in zip(a.tolist(), b.tolist()):
        table[x, y] += 1
    assert sps.chi2_contingency(table.numpy()).pvalue > P_MIN
    assert (a != b).any()


def test_choose_tokens_coupled_rows_and_greedy_rows():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]
    tok, raw, proc = choose_tokens(logits, params, [None] * 3, coupled=[(5, 0), None, (6, 2)])
    assert int(tok[1]) == int(logits[1].argmax())
    for r, (k, t) in ((0, (5, 0)), (2, (6, 2))):
        lp = processed_logprobs(logits[r:r + 1], 1.0)
        assert int(tok[r]) == int(coupled_argmax(lp, [k], [t])[0])
    with pytest.raises(ValueError, match="one sampling mode"):
        choose_tokens(logits, [params[0]] * 3, [None] * 3, coupled=[(5, 0), None, (6, 1)])


def test_sampling_mode_is_validated():
    assert RolloutConfig(sampling_mode="coupled").sampling_mode == "coupled"
    with pytest.raises(ConfigError, match="sampling_mode"):
        RolloutConfig(sampling_mode="gumbel")


# ------------------------------------------------------------------------- the engine
def _coupled_engine(model, arch, drafter=None, strategy="4_1_4"):
    return _spec_engine(model, arch, drafter, strategy, sampling_mode="coupled")


def _mixed_batch():
    """16 requests: 12 sampled at two settings, 4 greedy, of varied prompt lengths."""
    prompts = _prompts(lengths=(3, 9, 1, 17, 5, 12, 2, 7, 4, 11, 6, 8, 14, 3, 10, 1), seed=4)
    params = []
    for i in range(16):
        if i % 4 == 3:
            params.append(SamplingParams(temperature=0.0, max_new_tokens=20))
        elif i % 2:
            params.append(SamplingParams(temperature=0.7, top_k=8, max_new_tokens=20))
        else:
            params.append(SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=20))
    seeds = [request_seed(99, 1000 + i) for i in range(16)]
    return prompts, params, seeds


@pytest.mark.parametrize("drafter_kind", ["good", "random"])
@pytest.mark.parametrize("strategy", ["5_1_5", "3_2_6"])  # chain, tree
def test_coupled_outputs_do_not_depend_on_speculation_or_batch(one_layer, drafter_kind,
                                                               strategy):
    model, arch, good, bad = one_layer
    drafter = good if drafter_kind == "good" else bad
    prompts, params, seeds = _mixed_batch()
    plain = _coupled_engine(model, arch)
    ref = plain.generate(prompts, params, request_seeds=seeds)
    eng = _coupled_engine(model, arch, drafter, strategy)
    got = eng.generate(prompts, params, request_seeds=seeds)
    assert eng.last_stats.spec.steps > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for o, r in zip(got, ref):
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
    # batch 1: each request alone, with and without speculation
    for i in (0, 5, 10):
        alone = eng.generate([prompts[i]], params[i], request_seeds=[seeds[i]])[0]
        assert alone.token_ids == ref[i].token_ids
        alone = plain.generate([prompts[i]], params[i], request_seeds=[seeds[i]])[0]
        assert alone.token_ids == ref[i].token_ids
    if drafter_kind == "good":  # coupled drafting is accepted like the greedy case
        assert eng.last_stats.spec.accept_len > 1.5


def test_coupled_seed_and_index_give_the_request_key(one_layer):
    """Without request_seeds, request i of a call with seed s has key request_seed(s, i),
    and the sample differs from standard mode's (another way to draw) but is sampled."""
    model, arch, _, _ = one_layer
    prompts = _prompts(seed=6)
    sp = SamplingParams(temperature=1.0, max_new_tokens=16, seed=42)
    eng = _coupled_engine(model, arch)
    a = eng.generate(prompts, sp)
    b = eng.generate(prompts, [sp] * len(prompts),
                     request_seeds=[request_seed(42, i) for i in range(len(prompts))])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = eng.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=43))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]


def test_coupled_acceptance_against_standard_acceptance(one_layer):
    """A good drafter's coupled acceptance is at least the (1-TV)/(1+TV) bound's share of
    standard rejection sampling's (loosely: > 0.6 of it on this drafter)."""
    model, arch, good, _ = one_layer
    prompts = _prompts(seed=8)
    sp = SamplingParams(temperature=1.0, max_new_tokens=24, seed=1)
    acc = {}
    for mode in ("standard", "coupled"):
        eng = _spec_engine(model, arch, good, "5_1_5", sampling_mode=mode)
        eng.generate(prompts, sp)
        acc[mode] = eng.last_stats.spec.accept_len
    assert acc["coupled"] > 1.0 + 0.6 * (acc["standard"] - 1.0), acc


def test_recompute_decoding_samples_the_engines_coupled_tokens(one_layer):
    """bench.reference.recompute_generate (megatron-core's own forward, recomputed per
    token) draws the same coupled tokens as the engine from the same request seeds."""
    from megatron_tlt.bench.reference import recompute_generate

    model, arch, _, _ = one_layer
    prompts = _prompts(lengths=(4, 7), seed=9)
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    seeds = [request_seed(3, 50), request_seed(3, 51)]
    ref = _coupled_engine(model, arch).generate(prompts, sp, request_seeds=seeds)
    got = recompute_generate(model, arch, [], arch.max_position_embeddings, prompts, sp,
                             request_seeds=seeds, sampling_mode="coupled")
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]


def test_coupled_noise_rows_are_computed_once_and_equal_the_direct_noise(monkeypatch):
    """``CoupledNoise`` (a speculative step's drafting and verification share rows): the
    rows equal ``coupled_gumbel`` of the same (key, position) in any order and batch,
    a repeated pair is computed once, and ``clear`` forgets them."""
    from megatron_tlt.rollout import sampling

    calls = []
    real = sampling.coupled_gumbel

    def counting(keys, positions, vocab, device, token_ids=None, kernels=None):
        calls.append(len(keys))
        return real(keys, positions, vocab, device, token_ids, kernels)

    monkeypatch.setattr(sampling, "coupled_gumbel", counting)
    noise = sampling.CoupledNoise(300, "cpu")
    a = noise.rows([7, 7, 9], [3, 4, 3])
    b = noise.rows([9, 7, 7, 7], [3, 4, 5, 4])
    assert calls == [3, 1]  # only (7, 5) was new
    assert torch.equal(a, real([7, 7, 9], [3, 4, 3], 300, "cpu"))
    assert torch.equal(b, real([9, 7, 7, 7], [3, 4, 5, 4], 300, "cpu"))
    noise.clear()
    noise.rows([7], [3])
    assert calls == [3, 1, 1]
    assert noise.rows([], []).shape == (0, 300)


def test_coupled_sampling_through_the_cpu_kernels_reproduces_the_distribution():
    """The CPU kernels' noise (what the engine uses on CPU) samples exactly too."""
    from megatron_tlt.rollout import cpu_kernels

    kern = cpu_kernels.get()
    assert kern is not None, "the CPU kernels did not build"
    lp = processed_logprobs(_logits()[None], 1.0, 0, 1.0)[0]
    probs = {v: float(p) for v, p in enumerate(lp.exp()) if p > 0}
    keys = [request_seed(99, i) for i in range(DRAWS)]
    tok = coupled_argmax(lp.expand(DRAWS, -1).contiguous(), keys, [5] * DRAWS, kern)
    assert _chi2_pvalue(collections.Counter(tok.tolist()), probs, DRAWS) > P_MIN
