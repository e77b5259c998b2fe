"""Speculative decoding: exact acceptance (statistical tests), greedy outputs identical
to plain decoding, the drafter's training/decoding pairing, checkpoints, adaptive
switching and metrics. Tiny random models, single process (TP=2 is in
test_rollout_tp.py)."""

from __future__ import annotations

import collections
import json

import pytest
import torch
from scipy import stats as sps

from megatron_tlt.config import ConfigError, RolloutConfig, SpeculativeConfig
from megatron_tlt.drafter_training.losses import drafter_pairs
from megatron_tlt.drafter_training.trainer import (DraftSample, DrafterTrainer,
                                                   draft_vocabulary, target_features)
from megatron_tlt.models import load_model
from megatron_tlt.models.drafter import (DrafterConfig, DrafterMismatchError, EagleDrafter,
                                         load_drafter, save_drafter)
from megatron_tlt.models.inference import forward_local_logits, gather_logits
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.sampling import processed_logprobs
from megatron_tlt.rollout.speculative import decoder as decoder_mod
from megatron_tlt.rollout.speculative import emissions as emissions_mod
from megatron_tlt.rollout.speculative.acceptance import accept_chain, accept_tree
from megatron_tlt.rollout.speculative.acceptance_batched import accept_chains, accept_trees
from megatron_tlt.rollout.speculative.stats import SpecStats
from tiny_models import TINY_CONFIGS, VOCAB, save_tiny_hf

P_MIN = 1e-4  # chi-square p-value below which a distribution test fails


# ------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
            for name in TINY_CONFIGS}


def build_one_layer(folder, device=torch.device("cpu"), dtype="float32"):
    """A one-layer tiny Llama and an oracle-like drafter: the target's own layer and
    final norm, fc selecting the token embedding. It sees the sequence shifted by one
    position (the first token missing), so q is close to p but not equal. Also a
    confident random drafter. (tests_gpu/ builds the same on CUDA.)"""
    model, arch = load_model(folder, device=device, dtype=dtype, impl="local")
    with torch.no_grad():  # peaked next-token distributions (few tokens carry the mass)
        model.decoder.final_layernorm.weight.mul_(3.0)
    wdt = model.decoder.final_layernorm.weight.dtype
    good = EagleDrafter(DrafterConfig.for_target(arch), arch, dtype=wdt, device=device)
    with torch.no_grad():
        good.layer.load_state_dict(model.decoder.layers[0].state_dict())
        h = arch.hidden_size
        good.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
        good.norm.copy_(model.decoder.final_layernorm.weight)
    bad = EagleDrafter(DrafterConfig.for_target(arch), arch, dtype=wdt, device=device)
    bad.reset_parameters(seed=11)
    with torch.no_grad():  # adversarial: confident, random proposals
        bad.norm.mul_(8.0)
    return model, arch, good, bad


@pytest.fixture(scope="module")
def one_layer(tmp_path_factory, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    folder = save_tiny_hf("llama_tied", tmp_path_factory.mktemp("one_layer"), seed=5,
                          num_hidden_layers=1)
    return build_one_layer(folder)


def _prompts(lengths=(3, 9, 1, 17, 5, 12), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _spec_engine(model, arch, drafter=None, strategy="4_1_4", threshold=1 << 20, **cfg):
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=threshold)
    return RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                         eos_token_ids=[], drafter=drafter)


def _random_drafter(arch, seed=1, dtype=torch.float32, device="cpu", **kw):
    d = EagleDrafter(DrafterConfig.for_target(arch, **kw), arch, dtype=dtype, device=device)
    d.reset_parameters(seed=seed)
    return d


# ------------------------------------------------------------------------- acceptance rules
def _chi2_pvalue(counts: dict, probs: dict, n: int) -> float:
    """Chi-square goodness of fit; cells with expected count < 5 are pooled."""
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for cell, p in probs.items():
        e = n * p
        if e < 5:
            pool_o += counts.get(cell, 0)
            pool_e += e
        else:
            obs.append(counts.get(cell, 0))
            exp.append(e)
    stray = sum(c for cell, c in counts.items() if cell not in probs)
    if stray:
        return 0.0  # a token with target probability 0 was emitted
    if pool_e > 0:
        obs.append(pool_o)
        exp.append(pool_e)
    exp = [e * sum(obs) / sum(exp) for e in exp]
    return float(sps.chisquare(obs, exp).pvalue)


def _wrong_accept_chain(p, q, drafts, gen, greedy, kernels=None):
    """A lossy rule seen in the wild: sample from p (not the residual) on rejection."""
    for i, x in enumerate(drafts):
        if float(torch.rand((), generator=gen)) * float(q[i, x].exp()) < float(p[i, x].exp()):
            continue
        return i, int(torch.multinomial(p[i].exp(), 1, generator=gen))
    return len(drafts), int(torch.multinomial(p[len(drafts)].exp(), 1, generator=gen))


def _wrong_accept_chains(p, q, drafts, counts, e, g, kernels=None):
    """``_wrong_accept_chain`` in the form the batched step calls (every row at once)."""
    b, k = drafts.shape
    lp = p[:, :k].gather(2, drafts[..., None])[..., 0]
    lq = q[:, :k].gather(2, drafts[..., None])[..., 0]
    ok = (e[:, :k] > lq - lp) & (torch.arange(k)[None, :] < counts[:, None])
    a = ok.long().cumprod(1).sum(1)
    pa = p.gather(1, a[:, None, None].expand(b, 1, p.shape[2]))[:, 0]
    return a, (pa + g).argmax(-1)


def _torch_noise(gen, slots, vocab):
    """Exp(1) draws [1, slots] and a Gumbel row [1, vocab] from a torch generator (the
    batched rules' math checked apart from the streams)."""
    e = torch.empty(1, slots).exponential_(generator=gen)
    g = -torch.empty(1, vocab).exponential_(generator=gen).log()
    return e, g


def _device_accept_chain(p, q, drafts, gen, greedy, kernels=None):
    """The batched step's rule (``accept_chains``) on one row."""
    k = len(drafts)
    e, g = _torch_noise(gen, k, p.shape[-1])
    a, nxt = accept_chains(p[None], q[None], torch.tensor([drafts], dtype=torch.long),
                           torch.tensor([k]), e, g)
    return int(a[0]), int(nxt[0])


@pytest.mark.parametrize("rule", ["exact", "device", "wrong"])
def test_chain_rule_reproduces_target_distribution(rule):
    """Unit test of the chain rule with position-independent p and q over 6 tokens:
    the first two emitted tokens must be distributed as p0 x p1 (5,000 draws); the
    lossy rule must be caught by the same test.

    Power at 5,000 draws (scipy.stats.ncx2): the lossy rule gives chi-square 618 on 32
    d.o.f. (non-centrality ~586); the critical value at 1e-8 is 99, so it is missed with
    probability ~1e-52. The exact rule's false-positive rate is P_MIN, as before."""
    g = torch.Generator().manual_seed(0)
    V, k, n = 6, 3, 5_000
    p = torch.log_softmax(torch.randn(k + 1, V, generator=g) * 1.5, -1)
    q = torch.log_softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    fn = {"exact": accept_chain, "device": _device_accept_chain,
          "wrong": _wrong_accept_chain}[rule]
    counts = collections.Counter()
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i].exp(), 1, generator=g)) for i in range(k)]
        a, nxt = fn(p, q, drafts, g, greedy=False)
        out = drafts[:a] + [nxt]
        if len(out) < 2:  # rejected at the first draft: draw the second token from p1
            out.append(int(torch.multinomial(p[1].exp(), 1, generator=g)))
        counts[tuple(out[:2])] += 1
    pr = p.exp()
    probs = {(x, y): float(pr[0, x] * pr[1, y]) for x in range(V) for y in range(V)}
    pval = _chi2_pvalue(counts, probs, n)
    if rule != "wrong":
        assert pval > P_MIN
    else:
        assert pval < 1e-8


def _device_accept_trees(p, tokens, children, gen, n):
    """The batched step's tree rule (``accept_trees``) on n rows at once, with noise
    from a torch generator: per row (accepted path, next token)."""
    width = max(1, max(len(c) for c in children))
    kids = torch.tensor([c + [-1] * (width - len(c)) for c in children])
    tok = torch.tensor([0 if t is None else t for t in tokens])
    depth, frontier = 0, [0]
    while any(children[c] for c in frontier):
        depth += 1
        frontier = [k for c in frontier for k in children[c]]
    e = torch.empty(n, len(tokens)).exponential_(generator=gen)
    g = -torch.empty(n, p.shape[-1]).exponential_(generator=gen).log()
    path, nxt = accept_trees(p.expand(n, *p.shape), tok.expand(n, -1),
                             kids.expand(n, -1, -1), depth, e, g)
    return [([int(c) for c in row if c >= 0], int(x))
            for row, x in zip(path.tolist(), nxt.tolist())]


@pytest.mark.parametrize("rule", ["exact", "device", "wrong"])
def test_tree_rule_reproduces_target_distribution(rule):
    """Deterministic 3-way sibling tries at the root: the emitted token must follow
    p_root; sampling the fallback from p instead of p' must be caught.

    Power at 5,000 draws: the lossy fallback gives chi-square 1,188 on 6 d.o.f.
    (non-centrality ~1,180, critical value at 1e-8: 48; missed with probability ~0)."""
    g = torch.Generator().manual_seed(1)
    V, n = 7, 5_000
    p = torch.log_softmax(torch.randn(4, V, generator=g) * 1.5, -1)
    tokens = [None, 2, 5, 0]
    children = [[1, 2, 3], [], [], []]
    counts = collections.Counter()
    batched = _device_accept_trees(p, tokens, children, g, n) if rule == "device" else None
    for i in range(n):
        if rule == "exact":
            path, nxt = accept_tree(p, tokens, children, g, greedy=False)
        elif rule == "device":
            path, nxt = batched[i]
        else:  # wrong: reject siblings but then sample from the unmodified p
            path, nxt = accept_tree(p, tokens, children, g, greedy=False)
            if not path:
                nxt = int(torch.multinomial(p[0].exp(), 1, generator=g))
        counts[tokens[path[0]] if path else nxt] += 1
    probs = {x: float(p[0, x].exp()) for x in range(V)}
    pval = _chi2_pvalue(counts, probs, n)
    assert (pval > P_MIN) if rule != "wrong" else (pval < 1e-8)


@pytest.mark.parametrize("rule", ["exact", "device"])
def test_two_level_tree_rule_reproduces_target_distribution(rule):
    """A two-level tree (root children: tokens 2 and 5; token 2's node has children
    1 and 4): the first two emitted tokens must follow p_root(x) p_x(y), with p_x the
    target's distribution at the accepted node (row 5 for a token no node drafted,
    drawn here when the step ends after one token)."""
    g = torch.Generator().manual_seed(3)
    V, n = 6, 5_000
    p = torch.log_softmax(torch.randn(6, V, generator=g) * 1.5, -1)
    tokens = [None, 2, 5, 1, 4]
    children = [[1, 2], [3, 4], [], [], []]
    batched = _device_accept_trees(p, tokens, children, g, n) if rule == "device" else None
    counts = collections.Counter()
    for i in range(n):
        path, nxt = (accept_tree(p, tokens, children, g, greedy=False) if batched is None
                     else batched[i])
        out = [tokens[c] for c in path] + [nxt]
        if len(out) < 2:  # ended after one token: the next one from that token's node
            row = {2: 1, 5: 2}.get(out[0], 5)
            out.append(int(torch.multinomial(p[row].exp(), 1, generator=g)))
        counts[tuple(out[:2])] += 1
    pr = p.exp()
    probs = {(x, y): float(pr[0, x] * pr[{2: 1, 5: 2}.get(x, 5), y])
             for x in range(V) for y in range(V)}
    assert _chi2_pvalue(counts, probs, n) > P_MIN


def test_greedy_rules_follow_argmax():
    p = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [0.0, 0.0, 5.0]]), -1)
    assert accept_chain(p, None, [1, 0], None, greedy=True) == (2, 2)
    assert accept_chain(p, None, [1, 2], None, greedy=True) == (1, 0)
    assert accept_chain(p, None, [0, 0], None, greedy=True) == (0, 1)
    # tree: root children 1 (token 0) and 2 (token 1); node 2 has child 3 (token 0)
    pt = torch.log_softmax(torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 0.0], [5.0, 0.0, 0.0],
                                         [0.0, 0.0, 5.0]]), -1)
    kids = [[1, 2], [], [3], []]
    assert accept_tree(pt, [None, 0, 1, 0], kids, None, greedy=True) == ([2, 3], 2)
    assert accept_tree(pt, [None, 0, 2, 0], kids, None, greedy=True) == ([], 1)


# ------------------------------------------------------------------------- end to end
def _exact_joint(model, arch, prompt, sp: SamplingParams, n_tokens: int) -> dict:
    """Target probability of every ``n_tokens``-token continuation of ``prompt`` under
    ``sp`` (processed distributions, enumerated over their supports)."""
    probs = {(): 1.0}
    for _ in range(n_tokens):
        prefixes = list(probs)
        ids = torch.tensor([prompt + list(c) for c in prefixes],
                           device=model.decoder.final_layernorm.weight.device)
        with torch.no_grad():
            lg = gather_logits(forward_local_logits(model, ids), arch)[:, -1]
            p = processed_logprobs(lg.float(), sp.temperature, sp.top_k, sp.top_p).exp().cpu()
        nxt = {}
        for i, c in enumerate(prefixes):
            for y in torch.nonzero(p[i] > 0)[:, 0].tolist():
                nxt[c + (y,)] = probs[c] * float(p[i, y])
        probs = nxt
    return probs


# Each acceptance path (chain accept/reject with a near-oracle and with a confident random
# drafter, tree sibling tries with both, the chain's confidence stop) once. The sampling
# settings alternate between top-k and top-p: both reach the engine as the processed
# distributions p and q (``processed_logprobs``, tested in test_sampling.py), through the
# same acceptance code, so each path needs only one of them.
DIST_CASES = [
    ("chain", "good", SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3)),
    ("chain", "bad", SamplingParams(temperature=0.7, top_k=6, max_new_tokens=3)),
    ("tree", "good", SamplingParams(temperature=0.7, top_k=6, max_new_tokens=3)),
    ("tree", "bad", SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3)),
    ("chain-stop", "good", SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3)),
]
DIST_DRAWS = 2_500  # continuations per case (one call of 2,500 rows)
WRONG_DRAWS = 2_500


def _sample_continuations(eng, prompt, sp: SamplingParams, n: int) -> collections.Counter:
    per_call = 2500
    counts = collections.Counter()
    for call in range(n // per_call):
        outs = eng.generate([prompt] * per_call,
                            SamplingParams(**{**sp.__dict__, "seed": 1000 * call + 17}))
        counts.update(tuple(o.token_ids) for o in outs)
    return counts


@pytest.mark.parametrize("kind,drafter,sp", DIST_CASES,
                         ids=[f"{k}-{d}-t{s.temperature}-k{s.top_k}-p{s.top_p}"
                              for k, d, s in DIST_CASES])
def test_sampled_speculation_reproduces_target_distribution(one_layer, kind, drafter, sp):
    """2,500 three-token continuations sampled through the engine follow the target's
    exact joint distribution (chi-square). The first token comes from the prefill; the
    next two from one speculative step (chain depth 3, or a tree 3 deep, 2 wide, 5
    verified), so acceptance, rejection-resampling and the bonus token all shape them.
    With a near-oracle drafter and with a confident random one.

    Power, measured at 2,500 draws with these seeds for each case under a lossy rule
    (chains: _wrong_accept_chains, the rejection resampled from p instead of the
    residual; trees: the fallback drawn from p instead of p with the rejected siblings
    removed), and computed with scipy.stats.ncx2. Chi-square / d.o.f. on the
    counter-based streams: chain-good 336 / 72, chain-bad 771 / 39, chain-stop 229 / 63;
    trees (measured with the earlier per-request generators): tree-good 1,093 / 39,
    tree-bad 685 / 72; i.e. non-centralities of at least ~165 (chain-stop; ~264 for
    chain-good, the rule of test_wrong_rule_fails_the_end_to_end_test). The critical
    value at P_MIN is 125 on 72 d.o.f. (114 on 63), so each lossy rule is missed with
    probability < 1e-6, and any bias with a non-centrality of 110 at this size is
    caught with probability >= 0.99. The exact rule passes every case (p 0.30-0.85 on
    the streams); its false-positive rate is P_MIN per case, as at 10,000 draws, which
    bought power only against biases under half that size, at four times the time."""
    model, arch, good, bad = one_layer
    strategy = "3_2_5" if kind == "tree" else "3_1_3"
    eng = _spec_engine(model, arch, good if drafter == "good" else bad, strategy,
                       max_batch_size=2500)
    if kind == "chain-stop":  # drafts cut where the drafter's confidence runs out
        eng.spec.min_draft_prob = 0.3
    prompt = [7, 100, 33, 250, 3]
    n = DIST_DRAWS
    counts = _sample_continuations(eng, prompt, sp, n)
    summ = eng.last_stats.spec.summary()
    assert summ["steps"] > 0
    if kind == "chain-stop":  # some rows stop early, others draft on
        assert 0.3 < summ["drafted_per_row"] < 2.7, summ
    elif drafter == "good":  # drafts are often accepted: the accept path is exercised
        assert summ["accept_rate_at_position"]["1"] > 0.5
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), n)
    assert pval > P_MIN, (kind, drafter, sp, pval)


def test_wrong_rule_fails_the_end_to_end_test(one_layer, monkeypatch):
    """The same end-to-end test catches a lossy acceptance rule at its sample size
    (chi-square 336 on 72 d.o.f. at 2,500 draws on the streams: p ~ 1e-35; the critical
    value at 1e-8 is 161, missed with probability ~8e-10 by ncx2)."""
    model, arch, good, _ = one_layer
    monkeypatch.setattr(emissions_mod, "accept_chains", _wrong_accept_chains)
    sp = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3)
    eng = _spec_engine(model, arch, good, "3_1_3", max_batch_size=2500)
    prompt = [7, 100, 33, 250, 3]
    counts = _sample_continuations(eng, prompt, sp, WRONG_DRAWS)
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), WRONG_DRAWS)
    assert pval < 1e-8


@pytest.mark.parametrize("mode", ["raw", "tempered", "processed"])
def test_sampled_speculation_returns_the_requested_logprobs(tiny, mode):
    """Each token a speculative step emits carries the log-prob its request asked for:
    raw, log softmax(logits / T) (no top-k/top-p) or the processed distribution's,
    equal to a full forward's."""
    model, arch = tiny["llama_tied"]
    sp = SamplingParams(temperature=0.7, top_k=50, top_p=0.9, max_new_tokens=12, seed=4,
                        logprobs=mode)
    prompts = _prompts()[:3]
    eng = _spec_engine(model, arch, _random_drafter(arch), "3_3_8", max_batch_size=4)
    outs = eng.generate(prompts, sp)
    assert eng.last_stats.spec_fraction == 1.0
    settings = {"raw": (1.0,), "tempered": (0.7,), "processed": (0.7, 50, 0.9)}[mode]
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            z = gather_logits(forward_local_logits(model, torch.tensor([p + o.token_ids])),
                              arch)[0, len(p) - 1:-1].float()
        want = processed_logprobs(z, *settings).gather(
            -1, torch.tensor(o.token_ids)[:, None])[:, 0]
        assert (torch.tensor(o.logprobs) - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("strategy", ["4_1_4", "3_3_8", "1_1_1"])
def test_greedy_speculation_equals_plain_decoding(tiny, name, strategy):
    """Identical tokens, log-probs and hidden states within float tolerance, for every
    prompt, with a random drafter; rows enter and leave mid-run (max_batch_size 4)."""
    model, arch = tiny[name]
    sp = SamplingParams(temperature=0.0, max_new_tokens=14, return_hidden_states=True)
    prompts = _prompts()
    plain = RolloutEngine(model, None, RolloutConfig(max_batch_size=4), arch=arch,
                          eos_token_ids=[]).generate(prompts, sp)
    eng = _spec_engine(model, arch, _random_drafter(arch), strategy, max_batch_size=4)
    outs = eng.generate(prompts, sp)
    for o, r in zip(outs, plain):
        assert o.token_ids == r.token_ids
        assert o.finish_reason == r.finish_reason
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
        assert (o.hidden_states - r.hidden_states).abs().max() < 1e-4
    assert eng.last_stats.spec_fraction == 1.0


def _recorded_drafts(eng, prompts, sp):
    """Every speculative step's chain drafts (per row), and the outputs."""
    seen, verify = [], eng.spec._verify_chains

    def record(cache, rows, drafts, hook):
        seen.append([list(d) for d in drafts])
        return verify(cache, rows, drafts, hook)
    eng.spec._verify_chains = record
    return seen, [o.token_ids for o in eng.generate(prompts, sp)]


@pytest.mark.parametrize("kind", ["good", "pruned", "eagle3"])
def test_fused_greedy_drafting_equals_the_step_by_step_path(tiny, one_layer, kind,
                                                            monkeypatch):
    """cpu_kernels.draft_chain (catch-up and the whole greedy chain in one call) drafts
    exactly what the step-by-step path drafts, step by step, with rows entering and
    leaving the batch and multi-token catch-ups (a good drafter)."""
    if kind == "good":
        model, arch, drafter, _ = one_layer
    else:
        model, arch = tiny["qwen2"]
        drafter = (_random_drafter(arch, seed=3, draft_vocab_size=64) if kind == "pruned"
                   else _random_drafter(arch, seed=3, feature_layers="auto"))
        if kind == "pruned":
            drafter.d2t.copy_(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))
                              [:64].sort().values)
    sp = SamplingParams(temperature=0.0, max_new_tokens=20)
    prompts = _prompts(lengths=(3, 9, 1, 17, 5, 12, 4), seed=4)
    fused = _spec_engine(model, arch, drafter, "5_1_5", max_batch_size=3)
    calls = []
    kernel = fused.spec.draft.kernels
    assert kernel is not None

    class Counting:  # count the fused calls, pass everything else through
        def __getattr__(self, name):
            if name == "draft_chain":
                calls.append(1)
            return getattr(kernel, name)
    fused.spec.draft.kernels = Counting()
    got_drafts, got = _recorded_drafts(fused, prompts, sp)
    assert len(calls) == len(got_drafts) > 0
    ref_eng = _spec_engine(model, arch, drafter, "5_1_5", max_batch_size=3)
    monkeypatch.setattr(type(ref_eng.spec.drafting), "fused", lambda self, rows: False)
    ref_drafts, ref = _recorded_drafts(ref_eng, prompts, sp)
    assert got == ref
    assert got_drafts == ref_drafts
    if kind == "good":
        assert fused.last_stats.spec.accept_len > 2.0  # catch-ups span several positions


@pytest.mark.parametrize("kernels", ["true", "false"])
def test_catch_up_apart_drafts_what_the_step_would(tiny, kernels, monkeypatch):
    """Before a speculative step the engine feeds the positions the drafter missed
    (prompts, plain steps) in one call timed apart (SpeculativeDecoder.catch_up; the
    step then feeds only the roots). The drafts are those of the step's own catch-up,
    on the fused-kernel and the eager path, and outputs equal plain decoding."""
    model, arch = tiny["qwen2"]
    drafter = _random_drafter(arch, seed=3)
    prompts = _prompts(lengths=(3, 9, 1, 17, 5, 12, 4), seed=4)
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
              for n in (3, 20, 5, 30, 8, 2, 16)]
    plain = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                                eos_token_ids=[]).generate(prompts, params)]
    eng = _spec_engine(model, arch, drafter, "3_1_3", threshold=2, max_batch_size=3,
                       cpu_kernels=kernels)
    assert (eng.runner.kernels is not None) == (kernels == "true")
    got_drafts, got = _recorded_drafts(eng, prompts, params)
    st = eng.last_stats.spec
    assert st.catchup_seconds > 0 and st.catchup_tokens > 0
    monkeypatch.setattr(decoder_mod.SpeculativeDecoder, "catch_up", lambda self, rows, stats, *cache: 0)
    ref_eng = _spec_engine(model, arch, drafter, "3_1_3", threshold=2, max_batch_size=3,
                           cpu_kernels=kernels)
    ref_drafts, ref = _recorded_drafts(ref_eng, prompts, params)
    assert got == ref == plain
    assert got_drafts == ref_drafts
    assert ref_eng.last_stats.spec.catchup_tokens == st.catchup_tokens


def test_drafter_shares_the_targets_packed_output_layer(tiny):
    """A drafter with the full vocabulary multiplies by the target's output layer: its
    runner reads the target's panel copy instead of packing a second one."""
    model, arch = tiny["llama_untied"]
    eng = _spec_engine(model, arch, _random_drafter(arch))
    eng.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_new_tokens=4))
    target, draft = eng.runner, eng.spec.draft
    assert target.kernels is not None and draft.output_w is target.output_w
    assert draft._panel(draft.output_w) is target._panel(target.output_w)
    assert id(target.output_w) not in draft._panels
    assert id(draft.fc_w) in draft._panels


def test_good_drafter_is_accepted_and_greedy_stays_exact(one_layer):
    model, arch, good, _ = one_layer
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = _prompts(seed=3)
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[]
                          ).generate(prompts, sp)
    for strategy in ("6_1_6", "4_3_10"):
        eng = _spec_engine(model, arch, good, strategy)
        assert [o.token_ids for o in eng.generate(prompts, sp)] == [o.token_ids for o in plain]
        assert eng.last_stats.spec.accept_len > 1.8, strategy  # a random drafter: ~1.2


def test_confidence_stop_keeps_greedy_exact_and_verifies_fewer_tokens(one_layer):
    model, arch, good, _ = one_layer
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    prompts = _prompts(seed=5)
    ref = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                              eos_token_ids=[]).generate(prompts, sp)]
    drafted = {}
    for min_prob in (0.0, 0.6):
        sc = SpeculativeConfig(policy="fixed", strategy="6_1_6", threshold=64,
                               min_draft_prob=min_prob)
        eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                            eos_token_ids=[], drafter=good)
        assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
        drafted[min_prob] = eng.last_stats.spec.summary()["drafted_per_row"]
    assert drafted[0.0] == 6.0 and drafted[0.6] < 5.0


def test_stop_tokens_and_length_cut_accepted_runs(one_layer):
    """An EOS inside an accepted run ends the sequence there; max_new_tokens is exact."""
    model, arch, good, _ = one_layer
    prompts = _prompts(seed=4)
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[]
                          ).generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=20))
    stop = plain[0].token_ids[5]
    for mnt in (1, 7, 20):
        sp = SamplingParams(temperature=0.0, max_new_tokens=mnt, stop_token_ids=(stop,))
        ref = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[]
                            ).generate(prompts, sp)
        got = _spec_engine(model, arch, good, "6_1_6").generate(prompts, sp)
        for o, r in zip(got, ref):
            assert (o.token_ids, o.finish_reason) == (r.token_ids, r.finish_reason)
            assert len(o.token_ids) <= mnt


def test_speculation_switches_on_in_the_tail_without_prefill(tiny):
    """threshold 2 with 6 prompts of different lengths: plain steps first, speculation
    once two rows are left; the target is prefilled once per prompt only."""
    model, arch = tiny["qwen2"]
    prompts = _prompts()
    params = [SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
              for n in (3, 20, 5, 30, 8, 2)]
    plain_eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    plain = plain_eng.generate(prompts, params)
    eng = _spec_engine(model, arch, _random_drafter(arch), "3_1_3", threshold=2)
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    st = eng.last_stats
    assert 0.0 < st.spec_fraction < 1.0
    assert st.prefill_tokens == plain_eng.last_stats.prefill_tokens
    assert st.spec.catchup_tokens > 0  # the drafter caught up on what it missed
    assert all(b <= 2 for b in st.batch_sizes[-st.spec.steps:])
    # per-step records line up with the steps: the speculative ones are the last, timed
    assert len(st.step_seconds) == len(st.step_speculative) == st.decode_steps
    assert st.step_speculative == [False] * (st.decode_steps - st.spec.steps) + \
        [True] * st.spec.steps
    assert all(s > 0 for s in st.step_seconds)
    assert sum(st.step_seconds) == pytest.approx(st.decode_seconds)


def test_metrics_and_tuner_state(tiny, tmp_path):
    model, arch = tiny["llama_tied"]
    state = tmp_path / "tuner.json"
    sc = SpeculativeConfig(policy="egreedy", threshold=8, buckets="1,2,4,8",
                           arms="*:2_1_2,3_1_3,2_2_3", tuner_state=str(state),
                           break_even=False)  # the bandit's own bookkeeping
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch, eos_token_ids=[],
                        drafter=_random_drafter(arch))
    eng.generate(_prompts(), SamplingParams(temperature=0.0, max_new_tokens=12))
    s = eng.last_stats.summary()
    json.dumps(s)
    sp = s["spec"]
    assert sp["steps"] == sum(sp["arms"].values()) > 0
    assert set(sp["arms"]) <= {"2_1_2", "3_1_3", "2_2_3"}
    assert sp["accept_len"] >= 1.0 and sp["draft_seconds"] > 0 and sp["verify_seconds"] > 0
    assert set(sp["accept_len_by_depth"]) <= {"2", "3"}
    rows = sum(eng.last_stats.batch_sizes[-sp["steps"]:])
    assert sp["rows"] == rows
    assert state.is_file()
    saved = json.loads(state.read_text())["pulls"]  # per bucket: arm name -> pulls
    assert sum(sum(b.values()) for b in saved) == sp["steps"]
    eng2 = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                         eos_token_ids=[], drafter=_random_drafter(arch))
    assert eng2.tuner.state_dict()["pulls"] == eng.tuner.state_dict()["pulls"]


def test_speculative_config_errors():
    with pytest.raises(ConfigError, match="strategy|Strategy"):
        SpeculativeConfig(strategy="6_x_6")
    with pytest.raises(ConfigError, match="threshold"):
        SpeculativeConfig(threshold=0)
    with pytest.raises(ConfigError, match="policy"):
        SpeculativeConfig(policy="greedy")


# ------------------------------------------------------------------------- drafter
def test_training_pairs_match_decoding_pairs(tiny):
    """The drafter's training forward over drafter_pairs (s_{p+1}, h_p) gives, at the
    last position, exactly what decoding's catch-up/root step computes for the same
    sequence: training and decoding pair tokens with hidden states the same way."""
    model, arch = tiny["llama_untied"]
    drafter = _random_drafter(arch, seed=4)
    eng = _spec_engine(model, arch, drafter)
    seq = _prompts((11,))[0]
    feats, final = target_features(eng.runner, [seq])[0]
    nxt, f = drafter_pairs(seq, feats)
    assert nxt.tolist() == seq[1:] and torch.equal(f, feats[:-1])
    with torch.no_grad():
        emb = torch.nn.functional.embedding(nxt[None], eng.runner.embed_w)
        train_out = drafter(emb, drafter.reduce_features(f[None]),
                            model.rotary_pos_emb(len(seq) - 1))[0]
    # decoding: a row whose cache holds seq[:-1] and whose last sampled token is seq[-1]
    sd = eng.spec
    sd.begin(1, 32, 8)
    sd.store(0, 0, feats)
    row = type("Row", (), {})()
    row.prompt, row.tokens, row.length = seq[:-1], [seq[-1]], len(seq) - 1
    stats = SpecStats()
    root_h, _ = sd._catch_up([row], stats)
    assert (root_h[0] - train_out[-1]).abs().max() < 1e-4
    # ... and a shifted pairing (s_p, h_p) would not match
    wrong = drafter(torch.nn.functional.embedding(torch.tensor([seq[:-1]]), eng.runner.embed_w),
                    f[None], model.rotary_pos_emb(len(seq) - 1))[0]
    assert (root_h[0] - wrong[-1]).abs().max() > 1e-2


def test_drafter_checkpoint_round_trip_and_mismatch(tiny, tmp_path):
    model, arch = tiny["llama_tied"]
    d = _random_drafter(arch, seed=9, draft_vocab_size=100)
    d.d2t.copy_(torch.arange(100) * 2)
    path = save_drafter(d, tmp_path / "d")
    assert path.name == "drafter.safetensors"
    from safetensors.torch import load_file

    keys = set(load_file(str(path)))
    assert "fc.weight" in keys and "d2t" in keys
    assert not any("embedding" in k or "output_layer" in k for k in keys)  # shared, not stored
    d2 = load_drafter(tmp_path / "d", arch)
    own, loaded = d.own_state(), d2.own_state()
    assert own.keys() == loaded.keys() == keys
    for k in own:
        assert torch.equal(own[k], loaded[k]), k
    _, other = tiny["llama_untied"]
    with pytest.raises(DrafterMismatchError, match="ffn_hidden_size"):
        load_drafter(path, other)
    bad = tmp_path / "not_drafter.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(bad))
    with pytest.raises(ValueError, match="not a megatron_tlt drafter"):
        load_drafter(bad, arch)
    with pytest.raises(FileNotFoundError):
        load_drafter(tmp_path / "missing", arch)


def test_pruned_vocabulary_and_eagle3_drafters_decode_exactly(tiny):
    model, arch = tiny["qwen2"]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompts = _prompts()
    plain = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                                eos_token_ids=[]).generate(prompts, sp)]
    pruned = _random_drafter(arch, draft_vocab_size=64)
    pruned.d2t.copy_(draft_vocabulary([p + r for p, r in zip(prompts, plain)], 64, VOCAB))
    eagle3 = _random_drafter(arch, feature_layers="auto")
    assert eagle3.config.feature_width == 3 * arch.hidden_size
    for d in (pruned, eagle3):
        for strategy in ("4_1_4", "3_2_5"):
            eng = _spec_engine(model, arch, d, strategy)
            assert [o.token_ids for o in eng.generate(prompts, sp)] == plain


def test_set_draft_vocabulary_reselects_rows_without_touching_weights(tiny, tmp_path):
    """Re-selecting a trained drafter's draft vocabulary (warmup_drafter --init
    --draft-vocab N --epochs 0): only d2t changes, the checkpoint keeps the choice, the
    draft logits are the full head's logits at those ids, decoding stays exact."""
    from megatron_tlt.rollout.speculative.draft_runner import DraftRunner

    model, arch = tiny["qwen2"]
    d = _random_drafter(arch, seed=4)
    before = d.own_state()
    ids = torch.tensor([7, 3, 90, 41, 5])
    d.set_draft_vocabulary(ids)
    assert d.config.draft_vocab_size == 5 and d.d2t.tolist() == [3, 5, 7, 41, 90]
    after = d.own_state()
    assert after.keys() - before.keys() == {"d2t"}
    assert all(torch.equal(before[k], after[k]) for k in before)
    loaded = load_drafter(save_drafter(d, tmp_path / "p.safetensors"), arch)
    assert loaded.config.draft_vocab_size == 5 and torch.equal(loaded.d2t, d.d2t)

    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    full = DraftRunner(_random_drafter(arch, seed=4), plain.runner)
    pruned = DraftRunner(d, plain.runner)
    for r in (full, pruned):
        r.refresh()
    h = torch.randn(3, arch.hidden_size)
    assert torch.allclose(pruned.draft_logits(h), full.draft_logits(h)[:, d.d2t], atol=1e-5)

    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompts = _prompts()
    ref = [o.token_ids for o in plain.generate(prompts, sp)]
    d.set_draft_vocabulary(draft_vocabulary([p + r for p, r in zip(prompts, ref)], 32, VOCAB))
    assert d.config.draft_vocab_size == 32
    got = _spec_engine(model, arch, d, "4_1_4").generate(prompts, sp)
    assert [o.token_ids for o in got] == ref

    d.set_draft_vocabulary(None)  # back to the full vocabulary
    assert d.d2t is None and d.config.draft_vocab_size == 0 and "d2t" not in d.own_state()
    for bad in ([], [1, 1], [-1, 2], [VOCAB]):
        with pytest.raises(ValueError, match="distinct target token ids"):
            d.set_draft_vocabulary(torch.tensor(bad, dtype=torch.long))


def self_distilled_samples(plain: RolloutEngine, n_train=300, n_held=40):
    """The target's own sampled responses to random prompts, with their features, as
    (train, held-out) DraftSample lists. (tests_gpu/ uses it too.)"""
    prompts = _prompts(lengths=[3 + i % 9 for i in range(n_train + n_held)], seed=8)
    outs = plain.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=16, seed=0))
    seqs = [o.prompt_token_ids + o.token_ids for o in outs]
    samples = [DraftSample(s, len(o.prompt_token_ids), f, h)
               for s, o, (f, h) in zip(seqs, outs, target_features(plain.runner, seqs))]
    return samples[:n_train], samples[n_train:]


def train_and_measure(drafter, runner, train, held):
    """Held-out loss parts before and after 12 epochs of EAGLE training."""
    trainer = DrafterTrainer(drafter, runner, lr=3e-3, total_steps=300, warmup_steps=10)
    with torch.no_grad():
        _, before = trainer.loss(held)
    trainer.fit(train, epochs=12, batch_tokens=1024, log=None)
    with torch.no_grad():
        _, after = trainer.loss(held)
    return before, after


def test_drafter_training_learns_the_target(tiny):
    """A few hundred steps of the EAGLE loss on the target's own responses lower the
    held-out loss (SmolLM2's acceptance after warm-up is checked in test_smollm2.py)."""
    model, arch = tiny["llama_tied"]
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    train, held = self_distilled_samples(plain)
    before, after = train_and_measure(_random_drafter(arch, seed=2), plain.runner, train, held)
    # the random tiny target's next-token distributions are nearly uniform (soft CE
    # ~ ln 251), so the learnable signal is the next hidden state
    assert after["hidden"] < 0.85 * before["hidden"], (before, after)
    assert after["loss"] < before["loss"], (before, after)


def test_unrolled_training_feeds_the_drafters_own_outputs(tiny):
    """unroll=2 adds a pass whose h inputs are the drafter's previous outputs shifted by
    one position (drafting's feedback), so its loss differs from unroll=1's."""
    model, arch = tiny["llama_tied"]
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    seqs = [p + o.token_ids for p, o in zip(_prompts(), plain.generate(
        _prompts(), SamplingParams(temperature=0.0, max_new_tokens=8)))]
    samples = [DraftSample(s, len(p), f, h) for s, p, (f, h) in
               zip(seqs, _prompts(), target_features(plain.runner, seqs))]
    d = _random_drafter(arch, seed=6)
    with torch.no_grad():
        l1, p1 = DrafterTrainer(d, plain.runner, unroll=1).loss(samples)
        l2, p2 = DrafterTrainer(d, plain.runner, unroll=2).loss(samples)
    assert torch.isfinite(l2) and p1["top1"] == p2["top1"] and abs(float(l1) - float(l2)) > 1e-6
    with pytest.raises(ValueError, match="unroll"):
        DrafterTrainer(d, plain.runner, unroll=0)


def test_off_arm_lets_a_bucket_choose_plain_steps(tiny):
    """With only the '0_0_0' arm below the threshold every step is plain (and rewarded),
    outputs equal plain decoding, and the drafter still catches up when speculation
    starts in a bucket that has drafting arms."""
    from megatron_tlt.spec_strategy import Strategy

    assert Strategy.parse("0_0_0").is_off and not Strategy.parse("1_1_1").is_off
    model, arch = tiny["llama_tied"]
    sp = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (4, 20, 6, 9, 24, 3)]
    prompts = _prompts()
    ref = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                              eos_token_ids=[]).generate(prompts, sp)]
    sc = SpeculativeConfig(threshold=8, buckets="2,8", arms="2:3_1_3;8:0_0_0")
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[], drafter=_random_drafter(arch))
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    s = eng.last_stats.spec
    assert s.arms.get("0_0_0", 0) > 0 and s.arms.get("3_1_3", 0) == s.steps > 0
    buckets = eng.tuner.stats()["buckets"]
    assert set(buckets["3+"]) == {"0_0_0"}  # a bucket without drafting arms never drafts
    # plain steps the tuner chose: all of bucket 3+'s, and those bucket 1-2's break-even
    # gate declined (a random drafter loses)
    assert sum(b.get("0_0_0", {}).get("pulls", 0) for b in buckets.values()) == \
        s.arms["0_0_0"] == s.declined


def _simulated_clock(eng, monkeypatch, spec_cost):
    """The engine's clock, simulated: a plain decode step takes 1.0, a speculative step
    ``spec_cost(strategy)`` (and the rest no time), so the tuner's decisions depend on
    the drafter's acceptance, not on this machine's speed."""
    import types

    from megatron_tlt.rollout import engine as engine_mod
    from megatron_tlt.rollout.speculative import controller as controller_mod

    now = [0.0]
    clock = types.SimpleNamespace(perf_counter=lambda: now[0])
    monkeypatch.setattr(engine_mod, "time", clock)
    monkeypatch.setattr(controller_mod, "time", clock)
    emit, step = eng._emit, eng.spec.step

    def timed_emit(*args, **kw):
        now[0] += 1.0
        return emit(*args, **kw)

    def timed_step(cache, rows, strategy, *args, **kw):
        now[0] += spec_cost(strategy)
        return step(cache, rows, strategy, *args, **kw)
    eng._emit, eng.spec.step = timed_emit, timed_step


@pytest.mark.parametrize("kind", ["random", "good"])
def test_break_even_gate_declines_a_random_drafter_and_keeps_a_good_one(tiny, one_layer,
                                                                          kind, monkeypatch):
    """The default (egreedy + break-even gate) tuner in the engine, with step times
    simulated (a speculative step costs 1.5-1.7 plain steps): with a random drafter
    (acceptance ~1.1) almost every step is declined (plain) apart from a few probes;
    with a good one (acceptance ~2.5-3) speculation stays on. Greedy outputs equal plain
    decoding either way, and summary()['spec'] reports the decision per bucket."""
    if kind == "good":
        model, arch, drafter, _ = one_layer
    else:
        model, arch = tiny["llama_untied"]
        drafter = _random_drafter(arch)
    sp = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (40, 160, 90, 20)]
    prompts = _prompts(lengths=(3, 9, 5, 12), seed=6)
    ref = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                              eos_token_ids=[]).generate(prompts, sp)]
    sc = SpeculativeConfig(threshold=64, buckets="1,2,4", arms="*:3_1_3,5_1_5")
    assert sc.break_even and sc.policy == "egreedy"  # the defaults
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[], drafter=drafter)
    _simulated_clock(eng, monkeypatch, lambda s: 1.2 + 0.1 * s.depth)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    s = eng.last_stats.summary()["spec"]
    json.dumps(s)
    b1 = s["buckets"]["1"]  # the 70-step tail of the longest request
    steps = eng.last_stats.decode_steps
    assert sum(b["steps"] for b in s["buckets"].values()) == steps  # all tuned (<= 64)
    assert s["declined"] == sum(b["declined"] for b in s["buckets"].values())
    assert s["declined"] + s["steps"] == steps
    assert b1["tuner"]["plain_tok_s"] == pytest.approx(1.0)  # the simulated clock
    if kind == "random":
        assert s["declined_fraction"] > 0.85, json.dumps(s, indent=1)
        assert 0 < s["probes"] == s["steps"]  # it only speculated to re-measure
        assert not any(b["tuner"]["speculating"] for b in s["buckets"].values())
        assert b1["tuner"]["arm_speedup"] < 1.0 and b1["spec_tok_s"] < b1["plain_tok_s"]
    else:
        # plain steps: the reference each bucket measures first (three), hardly more
        assert s["declined"] <= 3 * len(s["buckets"]) + 2
        assert all(b["tuner"]["speculating"] for b in s["buckets"].values())
        assert b1["tuner"]["arm_speedup"] > 1.3 and b1["speedup"] > 1.3
        assert s["accept_len"] > 2.0


def test_fp8_training_pads_positions_without_changing_outputs(tiny, monkeypatch):
    """FP8 GEMMs need the token count to be a multiple of 8, so fp8 training pads the
    positions at the end; causal attention keeps the real positions' outputs unchanged.
    (The padding runs here with fp8_context stubbed out; tests_gpu/ runs it under TE.)"""
    import contextlib

    from megatron_tlt.models import drafter as drafter_mod

    model, arch = tiny["llama_tied"]
    d = _random_drafter(arch, seed=3)
    g = torch.Generator().manual_seed(0)
    t, h = 13, arch.hidden_size
    emb, hid = torch.randn(2, t, h, generator=g), torch.randn(2, t, h, generator=g)
    rope = model.rotary_pos_emb(t)
    with torch.no_grad():
        ref = d(emb, hid, rope)
        monkeypatch.setattr(drafter_mod, "fp8_context", lambda enabled: contextlib.nullcontext())
        d.config.fp8 = True
        got = d(emb, hid, rope)
    assert got.shape == ref.shape == (2, t, h)
    assert torch.allclose(got, ref, atol=1e-5), (got - ref).abs().max()


@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"])
def test_standard_speculation_is_reproducible_per_request(one_layer, strategy):
    """Standard sampling with speculation: a request's tokens depend on its own seed
    only, not on the batch it runs in (each row's draws come from its own stream,
    keyed by its seed and response position), and a rerun gives the same ones."""
    model, arch, good, _ = one_layer
    eng = _spec_engine(model, arch, good, strategy)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=10, ignore_eos=True)
    prompts = _prompts()[:4]
    seeds = [11, 12, 13, 14]
    together = eng.generate(prompts, sp, request_seeds=seeds)
    assert eng.last_stats.spec.summary()["steps"] > 0
    again = eng.generate(prompts, sp, request_seeds=seeds)
    assert [o.token_ids for o in again] == [o.token_ids for o in together]
    for i in (0, 3):
        alone = eng.generate([prompts[i]], sp, request_seeds=[seeds[i]])[0]
        assert alone.token_ids == together[i].token_ids
        assert alone.logprobs == pytest.approx(together[i].logprobs, abs=1e-5)
