"""The drafter's sampled-acceptance losses and the exact α metric: α against hand-computed
numbers and the sampler itself, losses reaching only drafter parameters, the unrolled
training passes paired exactly as decoding's drafting chain. Tiny random models."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_tlt.config import RolloutConfig
from megatron_tlt.drafter_training.alpha import measure_alpha, predicted_accept_len
from megatron_tlt.drafter_training.losses import (LOSS_PRESETS, LossConfig, cache_target_probs,
                                                  chain_mask,
                                                  drafter_loss, sampled_acceptance,
                                                  unrolled_forward)
from megatron_tlt.drafter_training.losses import drafter_pairs
from megatron_tlt.drafter_training.trainer import (DraftSample, DrafterTrainer,
                                                   target_features)
from megatron_tlt.drafter_training.vocab import draft_vocabulary_by_mass, token_mass
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.speculative.stats import SpecStats
from megatron_tlt.rollout.sampling import processed_logprobs
from megatron_tlt.rollout.speculative.acceptance import accept_chain
from tiny_models import VOCAB


def _drafter(arch, seed=3, **kw):
    d = EagleDrafter(DrafterConfig.for_target(arch, **kw), arch)
    d.reset_parameters(seed)
    return d


def _samples(engine, n=6, new=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (3 + i % 5,), generator=g).tolist() for i in range(n)]
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new,
                                                   seed=seed, ignore_eos=True))
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    return [DraftSample(s, len(p), f, h)
            for s, p, (f, h) in zip(seqs, prompts, target_features(engine.runner, seqs))]


# --------------------------------------------------------------------------- alpha
def test_alpha_of_a_hand_computed_case():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()
    q = torch.tensor([[0.2, 0.6, 0.2, 0.0]]).log()
    assert sampled_acceptance(p, q).item() == pytest.approx(0.2 + 0.3 + 0.2)
    # a draft vocabulary {1, 2}: q over it only; p's mass outside (0.5) is never accepted
    q_d = torch.tensor([[0.75, 0.25]]).log()
    assert sampled_acceptance(p, q_d, torch.tensor([1, 2])).item() == pytest.approx(0.3 + 0.2)
    # processing first: at top_k=2 both are renormalised over their own two best tokens
    logits_p = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    logits_q = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    e = math.e
    p2 = [e / (e + 1), 1 / (e + 1), 0, 0]
    q2 = [0, e / (e + 1), 1 / (e + 1), 0]
    want = sum(min(a, b) for a, b in zip(p2, q2))
    got = sampled_acceptance(processed_logprobs(logits_p, 1.0, top_k=2),
                             processed_logprobs(logits_q, 1.0, top_k=2))
    assert got.item() == pytest.approx(want)
    # chain length: 1 + a1 + a1*a2 + a1*a2*a3
    assert predicted_accept_len([0.5, 0.4, 0.5]) == pytest.approx(1 + 0.5 + 0.2 + 0.1)


def test_alpha_is_the_rate_speculative_sampling_accepts():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]]).log()
    q = torch.tensor([[0.1, 0.1, 0.3, 0.5]]).log()
    alpha = sampled_acceptance(p[:1], q).item()  # 0.1 + 0.1 + 0.2 + 0
    g = torch.Generator().manual_seed(0)
    n, hits = 6000, 0
    for _ in range(n):
        x = int(torch.multinomial(q[0].exp(), 1, generator=g))
        a, _ = accept_chain(p, q, [x], g, greedy=False)
        hits += a
    assert abs(hits / n - alpha) < 4 * math.sqrt(alpha * (1 - alpha) / n)


def test_measure_alpha_reports_depths_and_bars(tiny_llama):
    model, arch = tiny_llama
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    held = _samples(eng)
    rep = measure_alpha(_drafter(arch), eng.runner, held, temperature=1.0, depth=3)
    assert len(rep.alpha) == 3 and all(0.0 <= a <= 1.0 for a in rep.alpha)
    assert rep.tokens == sum(len(s.tokens) - max(s.prompt_len - 1, 1) for s in held)
    assert rep.vocab_mass == pytest.approx(1.0)  # full vocabulary
    assert 0 < rep.e_max_p < 1 and rep.predicted_accept_len == predicted_accept_len(rep.alpha)
    # a pruned vocabulary holds less of p's mass, and alpha never exceeds it
    d = _drafter(arch, draft_vocab_size=40)
    mass = token_mass(eng.runner, held, temperature=1.0)
    d.set_draft_vocabulary(draft_vocabulary_by_mass(mass, 40))
    pr = measure_alpha(d, eng.runner, held, temperature=1.0, depth=1)
    assert pr.vocab_mass < 1.0 and pr.alpha[0] <= pr.vocab_mass + 1e-6
    # the mass-chosen vocabulary holds at least as much mass as any other of its size
    ids = draft_vocabulary_by_mass(mass, 40)
    assert mass[ids].sum() >= mass[torch.randperm(VOCAB)[:40]].sum()


# --------------------------------------------------------------------------- losses
@pytest.mark.parametrize("preset,unroll", [("eagle", 1), ("kl", 2), ("tv", 1),
                                           ("log_accept", 3), ("kl+tv", 2)])
def test_drafter_losses_reach_only_drafter_parameters(tiny_llama, preset, unroll):
    """The policy's gradients are the same with and without a drafter loss added, even
    when the features handed to the drafter still carry the policy's autograd graph."""
    model, arch = tiny_llama
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    samples = _samples(eng, n=3, new=6)
    ids = torch.tensor([samples[0].tokens])

    def policy_loss():
        logits = model(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None],
                       attention_mask=None)
        return logits.float().logsumexp(-1).mean()

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.zero_grad(set_to_none=True)
    policy_loss().backward()
    alone = grads()
    model.zero_grad(set_to_none=True)
    d = _drafter(arch)
    # features with the policy's graph attached (as an online trainer might hand them)
    w = next(model.parameters())
    graph = (w - w.detach()).sum()  # value 0, gradient 1 into the policy's weight
    live = [DraftSample(s.tokens, s.prompt_len, s.features + graph, s.final_hidden + graph)
            for s in samples]
    cfg = LossConfig.preset(preset, unroll=unroll, top_p=0.9)
    loss, parts = drafter_loss(d, eng.runner, live, cfg)
    (policy_loss() + loss).backward()
    both = grads()
    assert alone.keys() == both.keys()
    for n in alone:
        assert torch.equal(alone[n], both[n]), n
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in (d.fc.weight, d.layer.mlp.linear_fc1.weight))
    assert len(parts["alpha_by_depth"]) == unroll and math.isfinite(parts["loss"])


def test_acceptance_loss_raises_alpha(tiny_llama):
    """Training on the TV / -log alpha terms raises held-out alpha (the exact metric)."""
    model, arch = tiny_llama
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    train, held = _samples(eng, n=40, new=12, seed=1), _samples(eng, n=8, seed=2)
    d = _drafter(arch, seed=5)
    before = measure_alpha(d, eng.runner, held, temperature=1.0, depth=1).alpha[0]
    cfg = LossConfig.preset("log_accept", temperature=1.0)
    DrafterTrainer(d, eng.runner, lr=3e-3, total_steps=60, warmup_steps=5,
                   loss=cfg).fit(train, epochs=6, batch_tokens=512, log=None)
    after = measure_alpha(d, eng.runner, held, temperature=1.0, depth=1).alpha[0]
    assert after > before + 0.02, (before, after)


def test_loss_config_errors_name_the_field():
    with pytest.raises(ValueError, match="tv must be >= 0"):
        LossConfig(tv=-1)
    with pytest.raises(ValueError, match="every weight is 0"):
        LossConfig(kl=0)
    with pytest.raises(ValueError, match="unknown drafter loss 'x'"):
        LossConfig.preset("x")
    assert set(LOSS_PRESETS) >= {"eagle", "kl", "tv", "log_accept"}


def test_loss_at_a_rollouts_sampling_settings():
    lc = LossConfig.for_sampling("kl+tv", 0.7, 20, 0.9, unroll=2)
    assert (lc.kl, lc.tv, lc.temperature, lc.top_k, lc.top_p, lc.unroll) == \
        (1.0, 1.0, 0.7, 20, 0.9, 2)
    eagle = LossConfig.for_sampling("eagle", 0.7, 20, 0.9)  # soft CE at T=1, untruncated
    assert (eagle.temperature, eagle.top_k, eagle.top_p) == (1.0, 0, 1.0)


# --------------------------------------------------------------------------- unrolling
def test_chain_mask_small_case():
    m = ~chain_mask(3, 2)  # True = seen; order: pass 1 positions 0..2, pass 2 positions 0..2
    # pass 2 at position 2: root 1 -> pass-1 positions 0, 1 and itself
    assert m[5].tolist() == [True, True, False, False, False, True]
    assert m[2].tolist() == [True, True, True, False, False, False]  # pass 1: causal


@pytest.mark.parametrize("depth", [2, 4])
def test_unrolled_pairing_equals_decodings_chain(tiny_llama, depth):
    """Pass j of the unrolled forward at position root+j-1 equals the drafter output of
    decoding's depth-j draft for the same tokens (greedy chain drafting from a root),
    and the naive causal unroll (every position fed drafter outputs) does not."""
    model, arch = tiny_llama
    d = _drafter(arch, seed=4)
    from megatron_tlt.config import SpeculativeConfig

    eng = RolloutEngine(model, None, RolloutConfig(speculative=SpeculativeConfig(
        policy="fixed", strategy=f"{depth}_1_{depth}", threshold=1 << 20)), arch=arch,
        eos_token_ids=[], drafter=d)
    seq = torch.randint(0, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    sd = eng.spec
    sd.begin(1, 64, 8)
    feats0, _ = target_features(eng.runner, [seq])[0]
    sd.store(0, 0, feats0)
    row = type("Row", (), {})()
    row.prompt, row.tokens, row.length = seq[:-1], [seq[-1]], len(seq) - 1
    row.params, row.generator, row.key = SamplingParams(temperature=0.0), None, None
    seen = []
    orig = sd.draft.draft_logits
    sd.draft.draft_logits = lambda h: (seen.append(h.detach().clone()), orig(h))[1]
    root_h, root_logits = sd._catch_up([row], SpecStats())
    drafts, _ = sd.drafting.chain([row], depth, root_h, root_logits)
    sd.draft.draft_logits = orig
    assert len(drafts[0]) == depth and len(seen) == depth  # root + depth-1 chain steps
    full = seq + drafts[0][:-1]
    feats, _ = target_features(eng.runner, [full])[0]
    nxt, f = drafter_pairs(full, feats)
    with torch.no_grad():
        emb = torch.nn.functional.embedding(nxt[None], eng.runner.embed_w)
        rope = model.rotary_pos_emb(len(full) - 1)
        outs = unrolled_forward(d, emb, d.reduce_features(f[None]), rope, depth)
    root = len(seq) - 2
    for j in range(depth):
        assert (outs[j, 0, root + j] - seen[j][0]).abs().max() < 1e-4, j
    # the naive unroll: pass j attends causally to pass j's own (drafter-fed) inputs
    with torch.no_grad():
        h = d.reduce_features(f[None])
        naive = d(emb, h, rope)
        for _ in range(1, depth):
            naive = d(emb, torch.cat([h[:, :1], naive[:, :-1]], 1), rope)
    assert (naive[0, root + depth - 1] - seen[-1][0]).abs().max() > 1e-3


def test_cached_target_probabilities_give_the_same_loss(tiny_llama):
    model, arch = tiny_llama
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    samples = _samples(eng, n=4, new=8)
    d = _drafter(arch, draft_vocab_size=60)
    d.set_draft_vocabulary(torch.arange(60) * 4)
    cfg = LossConfig.preset("kl+tv", top_p=0.8, unroll=2, hidden=0.5)
    with torch.no_grad():
        _, plain = drafter_loss(d, eng.runner, samples, cfg)
        cache_target_probs(samples, eng.runner, d, cfg)
        assert all(s.target_probs is not None for s in samples)
        kept = [s.target_probs for s in samples]
        cache_target_probs(samples, eng.runner, d, cfg)  # same settings: kept as is
        assert all(s.target_probs is k for s, k in zip(samples, kept))
        _, cached = drafter_loss(d, eng.runner, samples, cfg)
        for k in ("loss", "alpha", "kl", "tv", "top1"):
            assert cached[k] == pytest.approx(plain[k], rel=1e-5, abs=1e-6), k
        d.set_draft_vocabulary(torch.arange(60) * 3)  # another vocabulary: cache ignored
        _, other = drafter_loss(d, eng.runner, samples, cfg)
        _, fresh = drafter_loss(d, eng.runner, [DraftSample(s.tokens, s.prompt_len, s.features,
                                                            s.final_hidden) for s in samples], cfg)
        assert other["loss"] == pytest.approx(fresh["loss"], rel=1e-6)


# --------------------------------------------------------------------------- warm-up config
def test_warmup_takes_the_recipes_task_and_sampling(tmp_path):
    from megatron_tlt.drafter_training.warmup import WarmupConfig, WarmupError

    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {task: chain_sum, task_params: {min_terms: 2}, instruction: Go}\n"
                      "grpo: {group_size: 4, temperature: 0.7, top_p: 0.9, top_k: 20, "
                      "max_new_tokens: 64}\n")
    cfg = WarmupConfig.from_recipe(recipe, train_prompts=5, top_k=None)
    assert (cfg.task, cfg.task_params, cfg.instruction) == ("chain_sum", {"min_terms": 2}, "Go")
    assert (cfg.samples_per_prompt, cfg.temperature, cfg.top_p, cfg.top_k,
            cfg.max_new_tokens, cfg.train_prompts) == (4, 0.7, 0.9, 20, 64, 5)
    lc = cfg.loss_config()  # the loss is taken at the rollout's settings
    assert (lc.temperature, lc.top_p, lc.top_k) == (0.7, 0.9, 20)
    assert WarmupConfig.from_recipe(recipe, temperature=1.0).temperature == 1.0
    files = tmp_path / "f.yaml"
    files.write_text("data: {source: jsonl, path: x.jsonl}\n")
    with pytest.raises(WarmupError, match="data.source=jsonl.*--task"):
        WarmupConfig.from_recipe(files)
    with pytest.raises(WarmupError, match="--epochs 0 .*needs --init"):
        WarmupConfig(epochs=0)
    with pytest.raises(WarmupError, match="loss 'x' is not one of"):
        WarmupConfig(loss="x")
