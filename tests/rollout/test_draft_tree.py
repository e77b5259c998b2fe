"""Tree drafting: the chosen nodes are closed under parents for any scores (property
tests over the node pool and over the engine's tree drafting with random draft logits,
coupled noise, sampling settings and tree shapes), and coupled sampling with trees is
token for token plain decoding at scale with a confident random drafter."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_tlt.rollout import SamplingParams
from megatron_tlt.rollout.speculative.draft_tree import TreePool, ancestor_mask, row_layout
from megatron_tlt.rollout.sampling import coupled_gumbel, processed_logprobs, request_seed
from megatron_tlt.rollout.speculative.drafting import Drafting
from megatron_tlt.spec_strategy import Strategy
from test_speculative import _prompts, _spec_engine, one_layer  # noqa: F401

INF = float("inf")
# scores with ties, -inf, NaN and positive increments (which log-probabilities never
# have, but a selection closed "by construction" must not rely on that)
SCORES = st.sampled_from([-INF, math.nan, -3.0, -1.0, -1e-7, 0.0, 0.0, 0.5, 2.0, -40.0])


def _path_keys(par: list[int], score: list[float]) -> list[float]:
    """A node's selection key computed the slow way: the least score on its path from
    the root (NaN counted as -inf)."""
    key = []
    for j, s in enumerate(score):
        s = -INF if math.isnan(s) else s
        key.append(s if par[j] < 0 else min(key[par[j]], s))
    return key


def _check_tree(node_par: list[int], kids: list[list[int]], mask, depth: list[int]):
    """The verify inputs describe one tree: parents precede children, depth grows by
    one per edge, children lists invert the parent links, the mask is ancestor-or-self."""
    n = len(node_par)
    assert node_par[0] == -1 and depth[0] == 0
    for j in range(1, n):
        assert 0 <= node_par[j] < j
        assert depth[j] == depth[node_par[j]] + 1
        assert j in kids[node_par[j]]
    assert sorted(c for kl in kids for c in kl) == list(range(1, n))
    for j in range(n):
        anc, a = set(), j
        while a >= 0:
            anc.add(a)
            a = node_par[a]
        assert [bool(mask[j][a]) for a in range(n)] == [a in anc for a in range(n)]


@settings(max_examples=100, deadline=None)
@given(data=st.data(), b=st.integers(1, 3), k=st.integers(1, 4), depth=st.integers(1, 4))
def test_pool_selection_is_closed_for_any_scores(data, b, k, depth):
    vocab = data.draw(st.integers(k, 7))
    grid = lambda *shape: torch.tensor(  # noqa: E731
        data.draw(st.lists(SCORES, min_size=math.prod(shape), max_size=math.prod(shape)))
    ).view(*shape)
    pool = TreePool(grid(b, vocab), k)
    for _ in range(depth - 1):
        pool.grow(grid(b, k, vocab))
    n = data.draw(st.integers(1, pool.size + 2))
    tok, par, dep, score, chosen = pool.select(n)
    assert chosen.shape == (b, min(n, pool.size))
    assert not torch.isnan(score).any()
    for i in range(b):
        ch, p = chosen[i].tolist(), par[i].tolist()
        assert ch == sorted(set(ch))
        assert all(p[c] < 0 or p[c] in ch for c in ch)  # closed under parents
        key = _path_keys(p, score[i].tolist())
        rest = [key[j] for j in range(pool.size) if j not in ch]
        assert not rest or max(rest) <= min(key[c] for c in ch)  # the best keys
        node_par, kids = row_layout(p, ch, score[i].tolist())
        d = [0] + [dep[i, c].item() for c in ch]
        _check_tree(node_par, kids, ancestor_mask(node_par), d)
        for kl in kids:  # siblings: distinct tokens, best own score first
            assert len({tok[i, ch[c - 1]].item() for c in kl}) == len(kl)
            s = [score[i, ch[c - 1]].item() for c in kl]
            assert s == sorted(s, reverse=True)


# --------------------------------------------- the engine's tree drafting, drafter stubbed
class _StubDrafter:
    """Returns random draft logits (quantised: many exact ties, and confident when the
    scale is large) in place of the drafter's forward; the rest is the engine's code."""

    d2t = None

    def __init__(self, gen: torch.Generator, vocab: int, scale: float, quantum: float):
        self.gen, self.vocab, self.scale, self.quantum = gen, vocab, scale, quantum
        self.root = None

    def logits(self, *shape) -> torch.Tensor:
        x = torch.randn(*shape, self.vocab, generator=self.gen) * self.scale
        return (x / self.quantum).round() * self.quantum if self.quantum else x

    def inputs(self, tok, h, *, target_features):
        return torch.zeros(tok.shape[0], 4)

    def extend(self, cache, rows, tok, pos, *, rope_positions, new_token_mask, embeds,
               span=None):
        return torch.zeros(*tok.shape, 4)

    def draft_logits(self, out):
        return self.logits(*out.shape[:-1])


def _drafting(vocab: int, drafter: _StubDrafter) -> Drafting:
    return Drafting(drafter, SimpleNamespace(device=torch.device("cpu"),
                                             arch=SimpleNamespace(vocab_size=vocab)))


SETTINGS = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_k=3),
            SamplingParams(temperature=0.7, top_k=1), SamplingParams(temperature=1.0),
            SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.3, top_p=0.2),
            SamplingParams(temperature=0.3, top_k=5, top_p=0.5)]


@settings(max_examples=80, deadline=None)
@given(data=st.data(), b=st.integers(1, 4), k=st.integers(1, 3), depth=st.integers(1, 4),
       vocab=st.integers(3, 24), coupled=st.booleans(), seed=st.integers(0, 2**31),
       scale=st.sampled_from([0.5, 3.0, 60.0, 400.0]), quantum=st.sampled_from([0, 0.5, 4.0]))
def test_engine_draft_trees_are_closed_and_consistent(data, b, k, depth, vocab, coupled, seed,
                                                      scale, quantum):
    """Any drafter logits (confident, tied), any sampling settings per row, coupled or
    standard: the verify inputs form a tree over the chosen nodes, and a coupled row's
    first child of the root is the drafter's coupled token (what a chain drafts)."""
    k = min(k, vocab)
    size = sum(k ** d for d in range(1, depth + 1))
    n = data.draw(st.integers(depth, size)) if k > 1 else depth
    strategy = Strategy(depth, k, n)
    params = [data.draw(st.sampled_from(SETTINGS)) for _ in range(b)]
    rows = [SimpleNamespace(params=sp, length=5 + i, tokens=[7] * (i + 1),
                            key=request_seed(seed, i) if coupled else None)
            for i, sp in enumerate(params)]
    drafter = _StubDrafter(torch.Generator().manual_seed(seed), vocab, scale, quantum)
    root = drafter.logits(b)
    tree = _drafting(vocab, drafter).tree(rows, strategy, torch.zeros(b, 4), root)
    vtok = tree.verify_tokens
    width = 1 + min(n, k + (depth - 1) * k * k)
    assert vtok.shape == (b, width) and tree.mask.shape == (b, width, width)
    for i, r in enumerate(rows):
        kids = tree.children[i]
        node_par = [-1] * width
        for j, kl in enumerate(kids):
            for c in kl:
                node_par[c] = j
        _check_tree(node_par, kids, tree.mask[i].tolist(), tree.depth[i].tolist())
        assert tree.tokens[i] == vtok[i].tolist() and vtok[i, 0] == r.tokens[-1]
        if coupled and not r.params.greedy:
            sp = r.params
            q = processed_logprobs(root[i:i + 1], sp.temperature, sp.top_k, sp.top_p)
            g = coupled_gumbel([r.key], [len(r.tokens)], vocab, "cpu")
            best = (q + g)[0]
            assert best[vtok[i, kids[0][0]]] == best.max()


# --------------------------------------------- coupled identity at scale, through generate
def test_coupled_trees_equal_plain_decoding_at_scale(one_layer):
    """5,000 requests in batches of 2,500 decoded at once, a 3-deep 2-wide tree of 6
    nodes drafted by a confident random drafter (the case that once crashed the
    selection), top-k at T=0.7 and top-p at T=1.0 (the other two pairings reach the
    tree's scores through the same processed log-probabilities): every response is
    plain coupled decoding's, token for token."""
    model, arch, _, bad = one_layer
    plain = _spec_engine(model, arch, sampling_mode="coupled", max_batch_size=2500)
    eng = _spec_engine(model, arch, bad, "3_2_6", sampling_mode="coupled",
                       max_batch_size=2500)
    prompts = _prompts(lengths=[1 + i % 13 for i in range(2500)], seed=33)
    for c, sp in enumerate([
            SamplingParams(temperature=0.7, top_k=20, max_new_tokens=3, ignore_eos=True),
            SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=3, ignore_eos=True)]):
        seeds = [request_seed(33, c * 10_000 + i) for i in range(len(prompts))]
        got = eng.generate(prompts, sp, request_seeds=seeds)
        assert eng.last_stats.spec.steps > 0 and eng.last_stats.spec.drafted > 0
        ref = plain.generate(prompts, sp, request_seeds=seeds)
        diff = [i for i, (a, r) in enumerate(zip(got, ref)) if a.token_ids != r.token_ids]
        assert not diff, (sp, len(diff), diff[:5])


def test_a_broken_selection_names_the_row_and_the_settings(monkeypatch):
    """The invariant is kept by construction; were it broken, the error says where."""
    def orphans(self, n):  # a depth-2 node alone, its parent left out
        tok, par, dep, score, chosen = real(self, n)
        return tok, par, dep, score, torch.full_like(chosen[:, :1], self.k)

    real = TreePool.select
    monkeypatch.setattr(TreePool, "select", orphans)
    sp = SamplingParams(temperature=0.7, top_k=3)
    rows = [SimpleNamespace(params=sp, length=4, tokens=[1], key=request_seed(1, i))
            for i in range(2)]
    drafter = _StubDrafter(torch.Generator().manual_seed(0), 9, 1.0, 0)
    with pytest.raises(RuntimeError, match=r"batch row 0 .*strategy 2_2_3, temperature=0.7 "
                                           r"top_k=3 top_p=1.0, coupled sampling"):
        _drafting(9, drafter).tree(rows, Strategy(2, 2, 3), torch.zeros(2, 4),
                                   drafter.logits(2))
