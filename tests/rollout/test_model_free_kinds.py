"""The model-free drafter kinds ``prompt_lookup`` (n-gram lookup in the row's prompt) and
``group_history`` (a suffix index over the GRPO group's responses, in flight, finished and from
earlier calls): exact (chi-square of 3-token continuations against the target's joint
distribution, chains and multi-candidate trees, at T=1 with top-p and at T=0.7 with
top-k; greedy and coupled outputs equal to plain decoding), and the index's bounds
(tokens held, O(new tokens) per update, trees closed under parents)."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative import drafters, suffix_index
from megatron_tlt.rollout.speculative.kind_group import GroupHistory
from megatron_tlt.rollout.speculative.kind_prompt import PromptLookup
from megatron_tlt.rollout.speculative.suffix_index import SuffixIndex
from test_speculative import (DIST_DRAWS, P_MIN, _chi2_pvalue, _exact_joint,
                              _sample_continuations, one_layer)  # noqa: F401

BASE = [7, 100, 33, 250, 3]
SPS = [SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3),
       SamplingParams(temperature=0.7, top_k=8, max_new_tokens=3)]


def _engine(model, arch, kind, strategy, **cfg):
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, max_batch_size=2500, **cfg),
                        arch=arch, eos_token_ids=[])
    eng.attach_drafter(kind)
    return eng


def _record_trees(eng) -> list[int]:
    """Wrap the decoder's ``propose``: per step, the most children any tree node had
    (1 for chains)."""
    seen: list[int] = []
    inner = eng.spec.propose

    def propose(rows, strategy, stats, target_cache=None):
        p = inner(rows, strategy, stats, target_cache)
        if p.tree is None:
            seen.append(1 if any(p.drafts) else 0)
        else:
            seen.append(max(len(c) for row in p.tree.children for c in row))
        return p
    eng.spec.propose = propose
    return seen


def _prompt_with_continuations(model, arch, sp) -> list[int]:
    """BASE, then four sampled continuations of it each followed by BASE again: the
    prompt holds what tends to follow BASE, in several versions."""
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    outs = plain.generate([BASE] * 4, SamplingParams(**{**sp.__dict__, "max_new_tokens": 4,
                                                        "seed": 3}))
    prompt = list(BASE)
    for o in outs:
        prompt += o.token_ids + BASE
    return prompt


@pytest.mark.parametrize("sp", SPS, ids=["t1-topp", "t0.7-topk"])
@pytest.mark.parametrize("strategy", ["3_1_3", "3_3_6"])
@pytest.mark.parametrize("kind", ["prompt_lookup", "group_history"])
def test_model_free_kinds_draft_exactly(one_layer, kind, strategy, sp):  # noqa: F811
    model, arch, _, _ = one_layer
    d = drafters.make_drafter(kind, arch=arch, dtype=torch.float32, device="cpu")
    eng = _engine(model, arch, d, strategy)
    if kind == "prompt_lookup":
        d.min_n = 1  # the first response token's context: the prompt's last token
        prompt = _prompt_with_continuations(model, arch, sp)
    else:  # an earlier call's responses to the same prompt are in the history
        prompt = BASE
        eng.generate([prompt] * 200, SamplingParams(**{**sp.__dict__, "seed": 5,
                                                       "max_new_tokens": 6}))
        assert d.tokens > 200 * 6
    seen = _record_trees(eng)
    counts = _sample_continuations(eng, prompt, sp, DIST_DRAWS)
    summ = eng.last_stats.spec.summary()
    assert summ["kinds"][kind]["steps"] > 0 and summ["drafted_per_row"] > 0.05, summ
    if strategy != "3_1_3":
        assert max(seen) >= 2, seen  # candidates where the continuations diverge
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), DIST_DRAWS)
    assert pval > P_MIN, (kind, strategy, sp, pval)


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("strategy", ["4_1_4", "4_3_8"])
@pytest.mark.parametrize("kind", ["prompt_lookup", "group_history"])
def test_greedy_and_coupled_outputs_equal_plain_decoding(one_layer, kind, strategy,  # noqa: F811
                                                         mode):
    """Groups of 4 responses per prompt, uneven lengths through 3 running rows (rows
    finish and move while their siblings decode), two calls (the second proposes from
    the first's responses too): the tokens plain decoding gives."""
    model, arch, _, _ = one_layer
    coupled = mode == "coupled"
    base = [[5, 9, 9, 9, 5, 9], [1, 2, 3, 1, 2], [42] * 6]
    prompts = [p for p in base for _ in range(4)]
    lens = [16, 7, 11, 20] * 3
    seeds = list(range(100, 100 + len(prompts)))
    cfg = dict(max_batch_size=3, sampling_mode="coupled" if coupled else "standard")
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=3)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafter(drafters.make_drafter(kind, arch=arch, dtype=torch.float32,
                                             device="cpu"))
    plain = RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch, eos_token_ids=[])
    for seed in (9, 10):
        sps = [SamplingParams(temperature=1.0 if coupled else 0.0, top_p=0.95,
                              max_new_tokens=n, seed=seed) for n in lens]
        want = plain.generate(prompts, sps, request_seeds=seeds)
        got = eng.generate(prompts, sps, request_seeds=seeds)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert eng.last_stats.spec.summary()["kinds"][kind]["emitted"] > 0


# ------------------------------------------------------------------------- the index
def test_the_suffix_index_proposes_the_longest_match_latest_first():
    idx = SuffixIndex(min_n=1, max_n=3)
    idx.extend(0, [1, 2, 3, 4, 5])
    idx.extend(1, [9, 2, 3, 7, 8])
    idx.extend(2, [2, 3, 4, 6])
    # "2 3" occurred three times; "1 2 3" once: the longest wins
    assert idx.candidates([1, 2, 3], 2) == [[4, 5]]
    assert idx.candidates([5, 2, 3], 3) == [[4, 6], [7, 8], [4, 5]]
    assert idx.candidates([0, 0], 2) == []
    # the chain follows the most frequent continuation, the tree keeps the divergence
    conts = idx.candidates([5, 2, 3], 3)
    assert suffix_index.chain(conts, 3) == [4, 6]
    toks, par = suffix_index.tree(conts, 3, 2, 10)
    assert toks == [-1, 4, 7, 6, 8, 5] and par == [-1, 0, 0, 1, 2, 1]
    toks, par = suffix_index.tree(conts, 3, 1, 10)  # one child per node: a chain
    assert toks == [-1, 4, 6] and par == [-1, 0, 1]
    toks, par = suffix_index.tree(conts, 1, 3, 10)  # depth 1
    assert toks == [-1, 4, 7] and par == [-1, 0, 0]


def test_trees_are_closed_under_parents():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        conts = [torch.randint(0, 3, (int(torch.randint(1, 5, (1,), generator=g)),),
                               generator=g).tolist() for _ in range(6)]
        toks, par = suffix_index.tree(conts, 4, 2, 7)
        assert len(toks) <= 7 and par[0] == -1
        assert all(0 <= par[j] < j for j in range(1, len(par)))
        for j in range(len(par)):  # at most 2 children, distinct tokens
            kids = [toks[c] for c in range(len(par)) if par[c] == j]
            assert len(kids) <= 2 and len(set(kids)) == len(kids)


def test_the_index_is_bounded_and_updates_cost_the_new_tokens():
    idx = SuffixIndex(min_n=2, max_n=4, per_key=4, max_tokens=100)
    entries = lambda: sum(len(q) for q in idx.table.values())  # noqa: E731
    g = torch.Generator().manual_seed(1)
    for s in range(30):
        toks = torch.randint(0, 20, (25,), generator=g).tolist()
        before = entries()
        idx.extend(s, toks[:10])
        assert entries() - before <= 10 * 3  # (max_n - min_n + 1) entries per token
        idx.extend(s, toks[10:], live=False)
        assert len(idx) <= 100 + 25  # past the bound, the oldest finished dropped
        assert entries() <= 3 * len(idx)
    assert sorted(idx.seqs) == list(range(30 - len(idx.seqs), 30))
    # a live sequence is never dropped
    idx.extend(99, list(range(150)))
    assert 99 in idx.seqs
    idx.finish(99)
    assert len(idx) <= 150


def test_the_group_history_is_bounded_across_prompts():
    h = GroupHistory(group_tokens=64, history_tokens=200)
    for p in range(20):
        idx, seq = h.new_sequence([p, p + 1, p + 2])
        idx.extend(seq, list(range(50)), live=False)
        h.bound()
        assert h.tokens <= 200 + 64
    assert len(h.groups) < 20 and tuple([19, 20, 21]) in h.groups


def _index_contents(idx: SuffixIndex):
    return (list(idx.seqs.items()), sorted(idx.live), len(idx),
            [(k, list(q), q.maxlen) for k, q in idx.table.items()])


def test_the_suffix_index_is_restored_entry_for_entry(tmp_path):
    """Interleaved sequences (siblings decoding side by side), some dropped past the
    bound and one still growing: through the checkpoint's file format, the restored
    index holds the same sequences, n-gram occurrences in the same order, and proposes
    the same chains and trees for every context."""
    from megatron_tlt.checkpoint.safe_files import read_tree, write_tree

    idx = SuffixIndex(min_n=2, max_n=4, per_key=3, max_tokens=120)
    g = torch.Generator().manual_seed(2)
    for s in range(12):
        for part in range(3):  # 3 siblings at a time, extended in turns
            for sib in range(3):
                toks = torch.randint(0, 6, (5,), generator=g).tolist()
                idx.extend(3 * s + sib, toks, live=part < 2 or s == 11)
    assert idx.live and min(idx.seqs) > 0  # some dropped, some growing
    write_tree(tmp_path / "idx", idx.state_dict())
    back = SuffixIndex(min_n=2, max_n=4, per_key=3, max_tokens=120)
    back.load_state_dict(read_tree(tmp_path / "idx"))
    assert _index_contents(back) == _index_contents(idx)
    for ctx in {tuple(k) for k in idx.table} | {(0, 0), (5, 1, 2)}:
        assert back.candidates(list(ctx), 4) == idx.candidates(list(ctx), 4)
    idx.extend(99, [1, 2, 3, 4], live=False)  # and they keep evolving alike
    back.extend(99, [1, 2, 3, 4], live=False)
    assert _index_contents(back) == _index_contents(idx)


def test_a_resumed_group_history_drafts_as_the_uninterrupted_one(one_layer, tmp_path):  # noqa: F811
    """The history travels in the run state's rank file (``RunState.drafters``): an
    engine restored from it after a first call samples (standard sampling, T=1, drafts
    from the first call's responses) the same tokens in its second call as the engine
    that made the first call; one started empty samples others."""
    from megatron_tlt.checkpoint.safe_files import read_tree, write_tree
    from megatron_tlt.checkpoint.state import RunState

    model, arch, _, _ = one_layer
    prompts = [p for p in ([3, 8, 3, 8], [1, 2, 1, 2, 1]) for _ in range(4)]

    def engine():
        return _engine(model, arch, GroupHistory(), "4_2_6")

    def second_call(eng):
        return [o.token_ids for o in eng.generate(
            prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=8))]

    first = engine()
    first.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=7))
    write_tree(tmp_path / "rank", RunState(drafters=first.drafters).rank_state())
    resumed, empty = engine(), engine()
    RunState(drafters=resumed.drafters).load_rank_state(read_tree(tmp_path / "rank"))
    (h,) = resumed.drafters.values()
    assert h.tokens == first.drafters["group_history"].tokens > 8 * 12
    want = second_call(first)
    assert second_call(resumed) == want
    assert second_call(empty) != want


def test_the_prompt_kind_looks_in_the_rows_prompt():
    d = PromptLookup(min_n=2, max_n=3)
    row = type("Row", (), {"prompt": [1, 2, 3, 9, 1, 2, 4, 9, 1], "tokens": [2]})()
    assert d.lookup(row, 3) == [[4, 9, 1]]  # the longest match: "9 1 2"
    row.tokens = [2, 7]
    assert d.lookup(row, 2) == []
    row.tokens = [5, 1, 2]  # "1 2": latest occurrence first
    assert d.lookup(row, 2) == [[4, 9], [3, 9]]


def test_every_kind_only_proposes():
    """One verifier: no decoder of any kind (nor several kinds' ``KindDecoder``)
    defines a verification method again; each is a ``SpeculativeDecoder`` subclass
    implementing the proposer."""
    from megatron_tlt.rollout.speculative import decoder, multi, self_decoder  # noqa: F401

    def subclasses(c):
        for s in c.__subclasses__():
            yield s
            yield from subclasses(s)
    found = {c.__name__: c for c in subclasses(decoder.SpeculativeDecoder)}
    assert {"EagleDecoder", "SelfDraftDecoder", "ModelFreeDecoder", "GroupDecoder",
            "KindDecoder"} <= set(found)
    for name, c in found.items():
        assert not set(vars(c)) & set(decoder.VERIFICATION), name
        assert "propose" in {k for b in c.__mro__ for k in vars(b)
                             if b is not decoder.Proposer}, name


# ------------------------------------------------------------------------- per row
def _mixed_engine(model, arch, drafter, strategy, threshold=1 << 20, **cfg):
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=threshold)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafters({"eagle": drafter, "group_history": GroupHistory()})
    return eng


@pytest.mark.parametrize("strategy", ["3_1_3", "3_3_6"])
def test_rows_choose_their_kind_in_one_verification(one_layer, strategy):  # noqa: F811
    """EAGLE and the group's history in one engine: per row the group's match where it
    is expected to emit as much, else EAGLE's drafts, verified together; exact (chi-
    square at T=1 with top-p) and the rows' tokens counted by the kind that proposed
    them."""
    model, arch, _, bad = one_layer
    sp = SPS[0]
    eng = _mixed_engine(model, arch, bad, strategy, max_batch_size=2500)
    # every match of the group's history counts as worth more than EAGLE's drafts (the
    # learned rule's choice aside: both kinds propose in the same steps)
    eng.tuner.expected = lambda kind, n: 1.0 + n if kind == "group_history" else 1.0
    eng.generate([BASE] * 200, SamplingParams(**{**sp.__dict__, "seed": 5,
                                                 "max_new_tokens": 6}))
    counts = _sample_continuations(eng, BASE, sp, DIST_DRAWS)
    summ = eng.last_stats.spec.summary()
    kinds = summ["kinds"]
    assert kinds["group_history"]["proposed_rows"] > 0 and kinds["eagle"]["proposed_rows"] > 0
    assert kinds["group_history"]["chosen"] == 0  # a free kind rides along, per row
    assert kinds["group_history"]["proposed_rows"] + kinds["eagle"]["proposed_rows"] == summ["rows"]
    assert (kinds["group_history"]["proposed_emitted"] + kinds["eagle"]["proposed_emitted"]
            == summ["emitted"])
    # the call's timeline of tokens by proposing kind holds the same totals
    for k in ("group_history", "eagle"):
        assert sum(t.get(k, 0) for _, _, t in summ["kind_tokens"]) \
            == kinds[k]["proposed_emitted"]
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, BASE, sp, 3), DIST_DRAWS)
    assert pval > P_MIN, (strategy, pval)


def uneven_config(mode: str) -> dict:
    """The engine settings of ``assert_decodes_as_plain``: 3 running rows, greedy or
    coupled sampling."""
    return dict(max_batch_size=3, sampling_mode="coupled" if mode == "coupled" else "standard")


def assert_decodes_as_plain(eng, model, arch, cfg: dict, after_call=None) -> None:
    """Groups of 4 responses to 3 repetitive prompts, uneven lengths through the 3
    running rows of ``cfg`` (``uneven_config``), two calls: ``eng`` gives the tokens
    plain decoding gives (greedy, or coupled at T=1); ``after_call(eng)`` after each."""
    coupled = cfg["sampling_mode"] == "coupled"
    prompts = [p for p in ([5, 9, 9, 9, 5, 9], [1, 2, 3, 1, 2], [42] * 6) for _ in range(4)]
    seeds = list(range(100, 100 + len(prompts)))
    plain = RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch, eos_token_ids=[])
    for seed in (9, 10):
        sps = [SamplingParams(temperature=1.0 if coupled else 0.0, top_p=0.95,
                              max_new_tokens=n, seed=seed) for n in [16, 7, 11, 20] * 3]
        want = plain.generate(prompts, sps, request_seeds=seeds)
        got = eng.generate(prompts, sps, request_seeds=seeds)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        if after_call is not None:
            after_call(eng)


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
@pytest.mark.parametrize("strategy", ["4_1_4", "4_3_8"])
def test_rows_choosing_their_kind_decode_as_plain(one_layer, strategy, mode):  # noqa: F811
    model, arch, good, _ = one_layer
    cfg = uneven_config(mode)
    eng = _mixed_engine(model, arch, good, strategy, threshold=3, **cfg)
    assert_decodes_as_plain(eng, model, arch, cfg)


def test_the_free_kinds_bench_measures_each_call(one_layer):  # noqa: F811
    """``bench.free_kinds.measure`` (tools/bench_free_kinds.py): per call the tail's
    speculative steps with their acceptance and the proposer's host time; the engine
    is left as it was (no drafter, its speculative settings)."""
    from megatron_tlt.bench.free_kinds import measure

    model, arch, _, _ = one_layer
    eng = RolloutEngine(model, None, RolloutConfig(max_batch_size=8), arch=arch,
                        eos_token_ids=[])
    before = eng.config.speculative
    r = measure(eng, "group_history", [[3, 8, 3, 8], [1, 2, 1, 2]], 4,
                SamplingParams(temperature=1.0, max_new_tokens=10, seed=3),
                strategy="3_1_3", threshold=8, calls=2)
    assert eng.spec is None and eng.config.speculative is before
    for c in r["calls"]:
        assert c["spec_steps"] > 0 and c["spec_rows"] >= c["spec_steps"]
        assert c["emitted"] == pytest.approx(c["accept_len"] * c["spec_rows"])
        assert 1.0 <= c["accept_len"] <= 4.0 and 0.0 <= c["rows_with_draft"] <= 1.0
        assert c["host_us_per_row"] > 0.0
    assert r["calls"][1]["rows_with_draft"] > 0.0  # the first call's responses
