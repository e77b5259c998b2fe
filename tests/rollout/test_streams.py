"""Standard sampling's counter-based streams (``rollout.sampling``) and the batched
acceptance built on them (``speculative/acceptance_batched.py``): draws at both ends
of the hash range, chi-square of every batched rule against the target distribution
(top-k / top-p at T = 1, many rows in one call, each on its own stream), reproducible
and distinct streams through the engine, and torch operations per step that do not
grow with the number of rows."""

from __future__ import annotations

import collections

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.sampling import (STREAM_DRAFT, STREAM_SAMPLE, exponential_of_hash,
                                           gumbel_of_hash, processed_logprobs, sample_rows,
                                           stream_gumbel, stream_salts)
from megatron_tlt.rollout.speculative.acceptance_batched import (accept_chains, accept_trees,
                                                                 chain_emits, step_noise,
                                                                 tree_emits)
from megatron_tlt.rollout.speculative import decoder as decoder_mod
from test_speculative import P_MIN, _chi2_pvalue
from op_counter import OpCounter
from tiny_models import VOCAB, tiny_model_and_own_layer_drafter


def test_exponentials_at_both_ends_of_the_hash_range():
    h = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    e = exponential_of_hash(h)
    u = (h.double() + 0.5) / 2**32
    assert torch.isfinite(e).all() and (e > 0).all()
    assert torch.allclose(e.double(), -u.log(), rtol=1e-6, atol=0)  # relative, both ends
    assert torch.equal(gumbel_of_hash(h), -torch.log(e))


def _keys(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 2**62, (n,), generator=torch.Generator().manual_seed(seed))


def _processed(gen, rows: int, vocab: int, top_k: int, top_p: float) -> torch.Tensor:
    return processed_logprobs(torch.randn(rows, vocab, generator=gen) * 1.5, 1.0, top_k, top_p)


N_ROWS = 20_000  # rows of one batched call, each its own request stream


@pytest.mark.parametrize("rule", ["exact", "wrong"])
def test_batched_chains_reproduce_the_target_distribution(rule):
    """20,000 chains of 3 drafts at T = 1 (target: top-k 5 and top-p 0.9; drafter:
    top-k 6 and top-p 0.95, so drafts outside the target's support occur), each row
    its own request, drafted and accepted in one call on the rows' streams: the first
    two emitted tokens follow p0 x p1. The rejection resampled from p instead of the
    residual must fail the same test."""
    g = torch.Generator().manual_seed(0)
    V, k, n = 8, 3, N_ROWS
    p = _processed(g, k + 1, V, 5, 0.9)
    q = _processed(g, k, V, 6, 0.95)
    keys, t0 = _keys(n), torch.full((n,), 7)
    tags = torch.arange(k) + STREAM_DRAFT
    salts = stream_salts(keys, t0, tags)  # [n, k]
    drafts = torch.stack([sample_rows(q[j].expand(n, V), salts[:, j].contiguous())
                          for j in range(k)], 1)
    pb, qb = p.expand(n, k + 1, V), q.expand(n, k, V)
    e, gum = step_noise(keys, t0, k, V)
    if rule == "exact":
        a, nxt = accept_chains(pb, qb, drafts, torch.full((n,), k), e, gum)
    else:
        lp = p[:k].gather(1, drafts.T)
        lq = q.gather(1, drafts.T)
        a = (e > (lq - lp).T).long().cumprod(1).sum(1)
        nxt = (p[a] + gum).argmax(-1)
    emit = chain_emits(drafts, a, nxt)
    # a row that stopped after one token: its second token from p1 (another stream)
    second = sample_rows(p[1].expand(n, V), stream_salts(keys, t0 + 1, STREAM_SAMPLE))
    pair = torch.stack([emit[:, 0], torch.where(a >= 1, emit[:, 1], second)], 1)
    counts = collections.Counter(map(tuple, pair.tolist()))
    pr = p.exp()
    probs = {(x, y): float(pr[0, x] * pr[1, y]) for x in range(V) for y in range(V)
             if pr[0, x] * pr[1, y] > 0}
    pval = _chi2_pvalue(counts, probs, n)
    assert (pval > P_MIN) if rule == "exact" else (pval < 1e-8), pval
    assert 0 < int((a == 0).sum()) and 0 < int((a == k).sum())  # both ends exercised


@pytest.mark.parametrize("rule", ["exact", "wrong"])
def test_batched_trees_reproduce_the_target_distribution(rule):
    """20,000 two-level trees at T = 1 (top-k 4, top-p 0.9): root children tokens 6, 4
    and 2 (2 outside the root's support), token 6's node with children 5 and 3, siblings
    tried in draft order with p renormalised after each rejection, every row at once on
    its stream. The first two emitted tokens follow p_root(x) p_x(y) (p_x the target at
    the accepted node; another row of p for a token no node drafted). Drawing the
    fallback from p instead of p' must fail."""
    g = torch.Generator().manual_seed(3)
    V, n = 7, N_ROWS
    p = _processed(g, 7, V, 4, 0.9)  # rows 0..5: the nodes; row 6: any other token
    tokens = torch.tensor([0, 6, 4, 2, 5, 3])
    kids = torch.tensor([[1, 2, 3], [4, 5, -1], [-1, -1, -1], [-1, -1, -1], [-1, -1, -1],
                         [-1, -1, -1]])
    keys, t0 = _keys(n, 1), torch.full((n,), 3)
    e, gum = step_noise(keys, t0, 6, V)
    pb = p[:6].expand(n, 6, V)
    path, nxt = accept_trees(pb, tokens.expand(n, 6), kids.expand(n, 6, 3), 2, e, gum)
    if rule == "wrong":  # no child accepted at the root: the fallback drawn from p
        nxt = torch.where(path[:, 0] < 0, (p[0] + gum).argmax(-1), nxt)
    emit = tree_emits(tokens.expand(n, 6), path, nxt)
    first = emit[:, 0]
    node_of = {6: 1, 4: 2, 2: 3}
    after = torch.tensor([node_of.get(x, 6) for x in range(V)])[first]
    second = sample_rows(p[after], stream_salts(keys, t0 + 1, STREAM_SAMPLE))
    # one accepted node: its child's token (or the next token at it) is the second
    second = torch.where(path[:, 0] >= 0, emit.gather(1, path[:, :1].clamp_min(0))[:, 0],
                         second)
    counts = collections.Counter(zip(first.tolist(), second.tolist()))
    pr = p.exp()
    probs = {(x, y): float(pr[0, x] * pr[node_of.get(x, 6), y])
             for x in range(V) for y in range(V) if pr[0, x] * pr[node_of.get(x, 6), y] > 0}
    pval = _chi2_pvalue(counts, probs, n)
    assert (pval > P_MIN) if rule == "exact" else (pval < 1e-8), pval
    assert (path[:, 1] >= 0).any() and (path[:, 0] < 0).any()  # deep and shallow walks


def test_the_drafts_noise_is_not_the_steps_sampling_noise():
    """The streams a step draws from differ by tag: a plain step's token, each chain
    depth's draft, the acceptance tests and the last token never share noise."""
    keys, t0 = _keys(4, 2), torch.tensor([0, 5, 9, 2])
    tags = torch.tensor([STREAM_SAMPLE, STREAM_DRAFT, STREAM_DRAFT + 1, 2, 3])
    salts = stream_salts(keys, t0, tags)
    assert len(set(salts.flatten().tolist())) == salts.numel()
    g = stream_gumbel(salts[:, 0].contiguous(), 50)
    assert not torch.equal(g, stream_gumbel(salts[:, 1].contiguous(), 50))


# ------------------------------------------------------------------------ the engine
@pytest.fixture(scope="module")
def model(tmp_path_factory, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return tiny_model_and_own_layer_drafter(tmp_path_factory.mktemp("streams"), "cpu")


def _engine(model, strategy=None, kernels="true", **cfg):
    m, arch, d = model
    sc = (SpeculativeConfig(policy="fixed", strategy=strategy, threshold=1 << 20)
          if strategy else SpeculativeConfig())
    return RolloutEngine(m, None, RolloutConfig(speculative=sc, cpu_kernels=kernels, **cfg),
                         arch=arch, eos_token_ids=[], drafter=d if strategy else None)


def _prompts(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (3 + i % 5,), generator=g).tolist() for i in range(n)]


SP = SamplingParams(temperature=1.0, top_k=40, top_p=0.9, max_new_tokens=12,
                    ignore_eos=True)


@pytest.mark.parametrize("strategy", [None, "3_1_3", "3_2_5"])
def test_same_seeds_same_responses_other_seeds_other_streams(model, strategy):
    """Standard sampling, plain and speculative: the same request seeds give the same
    responses in another call and another batch order; other seeds give other
    responses (every request differs somewhere)."""
    eng = _engine(model, strategy)
    prompts = _prompts(4)
    seeds = [101, 202, 303, 404]
    a = eng.generate(prompts, SP, request_seeds=seeds)
    if strategy:
        assert eng.last_stats.spec.summary()["steps"] > 0
    order = [2, 0, 3, 1]
    b = eng.generate([prompts[i] for i in order], SP, request_seeds=[seeds[i] for i in order])
    assert [b[order.index(i)].token_ids for i in range(4)] == [o.token_ids for o in a]
    c = eng.generate(prompts, SP, request_seeds=[s + 1 for s in seeds])
    assert all(x.token_ids != y.token_ids for x, y in zip(a, c))
    same = eng.generate([prompts[0]] * 4, SP, request_seeds=seeds)  # one prompt
    assert len({tuple(o.token_ids) for o in same}) == 4


def _counts_per_call(eng, methods, prompts, params) -> dict[str, list[int]]:
    """Torch operations inside each call of the methods ``methods`` ((object, name)
    pairs) during ``eng.generate``, per name (after a first call: tables made once
    per size, e.g. the noise's hash table, are not the step's)."""
    eng.generate(prompts, params)
    counter = OpCounter()
    calls: dict[str, list[int]] = {name: [] for _, name in methods}

    def wrap(name, inner):
        def counted(*args, **kwargs):
            n0 = counter.count
            try:
                return inner(*args, **kwargs)
            finally:
                calls[name].append(counter.count - n0)
        return counted

    saved = [(obj, name, vars(obj).get(name)) for obj, name in methods]
    for obj, name in methods:
        setattr(obj, name, wrap(name, getattr(obj, name)))
    try:
        with counter:
            eng.generate(prompts, params)
    finally:  # an object's own attribute (a module's function) back, else the method
        for obj, name, own in saved:
            if own is not None:
                setattr(obj, name, own)
            else:
                delattr(obj, name)
    return calls


@pytest.mark.parametrize("kernels", ["true", "false"])
def test_a_plain_steps_operations_do_not_grow_with_the_rows(model, kernels):
    """A plain decode step in standard sampling (forward, sampling, the finished-rows
    check) runs as many torch operations for 8 rows as for 2 (the last step, where
    every row retires and rows move, aside)."""
    got = {}
    for b in (2, 8):
        eng = _engine(model, kernels=kernels)
        sp = SamplingParams(**{**SP.__dict__, "seed": 5})
        got[b] = _counts_per_call(eng, [(eng, "_decode_step")], _prompts(b),
                                  sp)["_decode_step"][:-1]
    assert got[2] and got[2] == got[8], got


@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"])
def test_speculative_sampling_operations_do_not_grow_with_the_rows(model, strategy):
    """A speculative step's standard-sampling work (chain drafting's draws, acceptance
    of chains or trees with the emitted tokens' log-probs) runs as many torch
    operations at every step for 8 rows as for 2."""
    got = {}
    for b in (2, 8):
        eng = _engine(model, strategy)
        methods = [(decoder_mod, "accept_rows")]
        if strategy == "3_1_3":
            methods.append((eng.spec.drafting, "chain"))
        calls = _counts_per_call(eng, methods, _prompts(b),
                                 SamplingParams(**{**SP.__dict__, "seed": 5}))
        assert calls["accept_rows"], "no speculative step ran"
        got[b] = {name: set(c) for name, c in calls.items()}
    assert all(len(c) == 1 for c in got[2].values()), got  # one count for every step
    assert got[2] == got[8], got
