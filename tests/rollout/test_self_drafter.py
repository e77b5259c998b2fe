"""The self-drafter (the policy's weight-only int8 copy): quantization against a float
reference, exact speculation with it (greedy identical to plain decoding, sampled
continuations following the target's exact joint distribution, coupled responses
identical to plain coupled decoding), its refresh after weight updates, and a
deliberately poor copy staying exact while its acceptance falls. Tiny random models,
single process."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.forward import ModelRunner
from megatron_tlt.rollout.speculative.quantize import int8_linear, quantize_int8
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from test_speculative import (DIST_DRAWS, P_MIN, _chi2_pvalue, _exact_joint, _prompts,
                              _sample_continuations)
from tiny_models import TINY_CONFIGS, save_tiny_hf


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
            for name in TINY_CONFIGS}


@pytest.fixture(scope="module")
def peaked(tmp_path_factory, single_process_parallel):
    """A two-layer tiny Llama with peaked next-token distributions (few tokens carry
    the mass, so 3-token continuations can be enumerated), and another model of the
    same shape (a poor copy's source)."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    out = []
    for seed in (5, 6):
        folder = save_tiny_hf("llama_tied", tmp_path_factory.mktemp(f"peaked{seed}"),
                              seed=seed, num_hidden_layers=2)
        model, arch = load_model(folder, device=torch.device("cpu"), dtype="float32",
                                 impl="local")
        with torch.no_grad():
            model.decoder.final_layernorm.weight.mul_(3.0)
        out.append((model, arch))
    return out


def _engine(model, arch, strategy="4_1_4", drafter=None, **cfg):
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafter(drafter if drafter is not None else SelfDrafter())
    return eng


# ------------------------------------------------------------------------- quantization
@pytest.mark.parametrize("group", [0, 32, 40])
def test_int8_linear_matches_a_float_reference(group):
    """q * s reconstructs w within half a quantization step per element, and the
    quantized linear is within the error that step allows of the float64 product."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=g) * 0.1
    w[3] = 0.0  # an all-zero channel quantizes to zeros, scale 1
    qw = quantize_int8(w, group)
    assert qw.q.dtype == torch.int8 and qw.q.abs().max() <= 127
    assert qw.scale.shape == (40, 1 if group == 0 else -(-96 // group))  # 40: 40, 40, 16
    step = qw.scale.repeat_interleave(qw.group, dim=1)[:, :96]
    assert ((qw.dequantize() - w).abs() <= step / 2 + 1e-7).all()
    assert (qw.dequantize()[3] == 0).all()
    x = torch.randn(5, 96, generator=g)
    b, res = torch.randn(40, generator=g), torch.randn(5, 40, generator=g)
    ref = x.double() @ w.double().t() + b.double() + res.double()
    got = int8_linear(x, qw, b, res).double()
    bound = (x.double().abs() @ (step.double() / 2).t())  # sum_k |x_k| * step_k / 2
    assert ((got - ref).abs() <= bound + 1e-5).all()
    assert (got - ref).abs().max() > 0  # it is a different (quantized) product


def test_quantization_is_deterministic_and_refuses_bad_groups():
    w = torch.randn(8, 64)
    a, b = quantize_int8(w, 16), quantize_int8(w.clone(), 16)
    assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match=">= 0"):
        quantize_int8(w, -1)


# ------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
@pytest.mark.parametrize("strategy", ["4_1_4", "3_3_8"])
@pytest.mark.parametrize("kernels", ["true", "false"])
def test_greedy_self_speculation_equals_plain_decoding(tiny, name, strategy, kernels):
    """Identical tokens, log-probs and hidden states within float tolerance; rows enter
    and leave mid-run (max_batch_size 4), the copy's cache follows them."""
    model, arch = tiny[name]
    sp = SamplingParams(temperature=0.0, max_new_tokens=14, return_hidden_states=True)
    prompts = _prompts()
    plain = RolloutEngine(model, None, RolloutConfig(max_batch_size=4, cpu_kernels=kernels),
                          arch=arch, eos_token_ids=[]).generate(prompts, sp)
    eng = _engine(model, arch, strategy, max_batch_size=4, cpu_kernels=kernels)
    # with the kernels the copy runs their int8 GEMMs (else the dequantizing reference)
    assert eng.spec.draft._int8_kernels() == (kernels == "true")
    outs = eng.generate(prompts, sp)
    for o, r in zip(outs, plain):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
        assert (o.hidden_states - r.hidden_states).abs().max() < 1e-4
    summ = eng.last_stats.spec.summary()
    assert eng.last_stats.spec_fraction == 1.0
    # a close copy: most first drafts are accepted (a random model's are not)
    assert summ["accept_rate_at_position"]["1"] > 0.6, summ


SELF_DIST_CASES = [
    ("3_1_3", SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3)),
    ("3_2_5", SamplingParams(temperature=1.0, top_k=6, max_new_tokens=3)),
]


@pytest.mark.parametrize("source", ["self", "other"])
@pytest.mark.parametrize("strategy,sp", SELF_DIST_CASES, ids=["chain-top_p", "tree-top_k"])
def test_self_speculation_reproduces_target_distribution(peaked, source, strategy, sp):
    """2,500 three-token continuations (the first from the prefill, the next two from one
    speculative step of depth 3) follow the target's exact joint distribution
    (chi-square, the method and size of test_speculative.py), with the int8 copy and with
    a copy of another model (rejections and residual resampling)."""
    (model, arch), (other, _) = peaked
    src = None if source == "self" else ModelRunner(other, arch)
    eng = _engine(model, arch, strategy, SelfDrafter(source=src), max_batch_size=2500)
    prompt = [7, 100, 33, 250, 3]
    counts = _sample_continuations(eng, prompt, sp, DIST_DRAWS)
    summ = eng.last_stats.spec.summary()
    assert summ["steps"] > 0
    rate = summ["accept_rate_at_position"]["1"]
    # the copy's drafts are mostly accepted (tree children are the top-k, not samples
    # from q, so fewer of them are), another model's mostly not
    assert (rate > 0.6) if source == "self" else (rate < 0.4), summ
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), DIST_DRAWS)
    assert pval > P_MIN, (strategy, source, sp, pval)


@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"])
def test_coupled_self_speculation_equals_plain_coupled_decoding(tiny, strategy):
    """Under coupled sampling the responses are the plain coupled ones, token for token."""
    model, arch = tiny["llama_tied"]
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=9)
    prompts = _prompts()
    seeds = list(range(100, 100 + len(prompts)))
    plain = RolloutEngine(model, None, RolloutConfig(sampling_mode="coupled", max_batch_size=4),
                          arch=arch, eos_token_ids=[]).generate(prompts, sp,
                                                                request_seeds=seeds)
    eng = _engine(model, arch, strategy, sampling_mode="coupled", max_batch_size=4)
    outs = eng.generate(prompts, sp, request_seeds=seeds)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]
    assert eng.last_stats.spec.summary()["accept_rate_at_position"]["1"] > 0.5


@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_the_copy_keeps_cache_rows_only_up_to_the_threshold(tiny, mode):
    """Only batches of ``threshold`` rows or fewer speculate, and running rows are the
    first ones, so the copy's cache has ``threshold`` rows, not the target's: rows past
    them carry no copy state and take the target's keys and values from their first
    position when a finished row's place brings them below (here 6 requests of uneven
    lengths through 4 running rows retire in every order). Outputs stay plain
    decoding's."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts()
    lens = [14, 3, 9, 5, 12, 7]
    coupled = mode == "coupled"
    sps = [SamplingParams(temperature=1.0 if coupled else 0.0, top_p=0.95, max_new_tokens=n,
                          seed=9) for n in lens]
    seeds = list(range(100, 100 + len(prompts)))
    cfg = dict(max_batch_size=4, sampling_mode="coupled" if coupled else "standard")
    plain = RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch,
                          eos_token_ids=[]).generate(prompts, sps, request_seeds=seeds)
    sc = SpeculativeConfig(policy="fixed", strategy="3_1_3", threshold=2)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafter(SelfDrafter())
    outs = eng.generate(prompts, sps, request_seeds=seeds)
    assert [o.token_ids for o in outs] == [r.token_ids for r in plain]
    assert eng.spec.cache.max_batch == 2 and eng.memory.cache.max_batch == 4
    st = eng.last_stats
    assert 0 < st.spec_fraction < 1  # plain above 2 rows, speculative below
    assert st.spec.summary()["accept_rate_at_position"]["1"] > 0.5


# ------------------------------------------------------------------------- refresh
@pytest.mark.parametrize("kernels", ["true", "false"])
def test_refresh_follows_weight_updates(tiny_hf_dirs, single_process_parallel, kernels):
    """After an in-place update of the policy the next generate re-quantizes: the copy
    equals quantizing the updated weights; with unchanged weights it is not redone
    with the CPU kernels (content fingerprints); without them every call re-quantizes."""
    model, arch = load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"),
                             dtype="float32")
    eng = _engine(model, arch, "3_1_3", cpu_kernels=kernels)
    draft = eng.spec.draft
    sp = SamplingParams(temperature=0.0, max_new_tokens=4)
    eng.generate(_prompts()[:2], sp)
    n = draft.refreshes
    eng.generate(_prompts()[:2], sp)
    assert draft.refreshes == n + (kernels == "false")  # unchanged: none with kernels
    n = draft.refreshes
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
    eng.generate(_prompts()[:2], sp)
    assert draft.refreshes == n + 1 and draft.refresh_seconds > 0
    target = eng.runner
    for mine, lw in zip(draft.layers, target.layers):
        for name in ("qkv_w", "proj_w", "fc1_w", "fc2_w"):
            want = quantize_int8(getattr(lw, name))
            got = getattr(mine, name)
            # with the kernels only their panel copy holds the int8 values
            assert got.packed == (kernels == "true") and got.shape == want.q.shape
            assert torch.equal(got.int8_values(), want.q) and torch.equal(got.scale, want.scale)
        assert torch.equal(mine.ln1, lw.ln1) and torch.equal(mine.ln2, lw.ln2)
    assert torch.equal(draft.output_w.int8_values(), quantize_int8(target.output_w).q)
    # a quarter of the float32 bytes and the scales (with the kernels the tiny matrices'
    # rows are padded to whole panels; SmolLM2's 0.3x: test_self_drafter_memory.py)
    bound = 0.3 if kernels == "false" else 0.35
    assert draft.nbytes < bound * sum(p.numel() * p.element_size() for p in model.parameters())
    # released before an update: the copy's cache goes, the copy stays and is reused
    cache = eng.spec.cache
    eng.release_memory()
    assert cache.nbytes == 0 and (draft.output_w.panel is not None) == (kernels == "true")
    eng.generate(_prompts()[:2], sp)
    assert eng.spec.cache is cache and cache.nbytes > 0
    assert draft.refreshes == n + 1 + (kernels == "false")


def test_draft_vocabulary_head_and_grouped_scales_stay_exact(tiny):
    """A copy whose head keeps a draft vocabulary (its rows quantized) and whose scales
    are per group of 32 inputs: greedy outputs still equal plain decoding."""
    model, arch = tiny["llama_untied"]
    sp = SamplingParams(temperature=0.0, max_new_tokens=10)
    prompts = _prompts()[:4]
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch,
                          eos_token_ids=[]).generate(prompts, sp)
    ids = torch.arange(0, arch.vocab_size, 2)
    eng = _engine(model, arch, "3_1_3", SelfDrafter(group=32, draft_vocab=ids))
    assert eng.spec.draft.output_w.shape[0] == ids.numel()
    assert eng.spec.draft.output_w.group == 32
    assert [o.token_ids for o in eng.generate(prompts, sp)] == [r.token_ids for r in plain]


def test_config_selects_the_self_drafter(tiny):
    """rollout.speculative.drafter=self attaches the int8 copy (kinds.self.group its
    scales' group size, kinds.self.act_block its activations' block); a negative group,
    or an activation block that is not a multiple of 4 dividing the group, is a config
    error."""
    from megatron_tlt.config import ConfigError
    from megatron_tlt.config.kinds import KindSettings, SelfSettings
    from megatron_tlt.rollout.speculative.self_decoder import SelfDraftDecoder

    model, arch = tiny["llama_tied"]
    sc = SpeculativeConfig(drafter="self", policy="fixed", strategy="2_1_2",
                           kinds=KindSettings(self=SelfSettings(group=16, act_block=8)))
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[])
    assert isinstance(eng.spec, SelfDraftDecoder)
    assert eng.spec.draft.layers[0].qkv_w.group == 16
    assert eng.spec.draft.layers[0].qkv_w.act_block == 8
    eng.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_new_tokens=5))
    assert eng.last_stats.spec.summary()["steps"] > 0
    with pytest.raises(ConfigError, match="rollout.speculative.kinds.self.group"):
        SelfSettings(group=-1)
    for group, block in ((16, 32), (0, 6), (0, -4)):
        with pytest.raises(ConfigError, match="rollout.speculative.kinds.self.act_block"):
            SelfSettings(group=group, act_block=block)
    assert SelfSettings(group=128, act_block=0).act_block == 0


def test_exact_alpha_of_the_copy(peaked):
    """drafter_training.alpha.measure_self_alpha on held-out samples: the copy of the
    policy is accepted almost always, another model's copy rarely; a draft vocabulary
    caps α at its p̃ mass."""
    from megatron_tlt.drafter_training.alpha import held_out_samples, measure_self_alpha
    from megatron_tlt.rollout.speculative.self_runner import SelfDraftRunner

    (model, arch), (other, _) = peaked
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    held = held_out_samples(eng, _prompts()[:3], SamplingParams(temperature=1.0,
                                                                 max_new_tokens=20, seed=2))
    from megatron_tlt.drafter_training.vocab import draft_vocabulary_by_mass, token_mass

    # a draft vocabulary of the 64 tokens (of 251) carrying the most p̃ mass
    by_mass = draft_vocabulary_by_mass(token_mass(eng.runner, held, temperature=1.0), 64)
    alphas = {}
    for name, drafter in (("self", SelfDrafter()),
                          ("other", SelfDrafter(source=ModelRunner(other, arch))),
                          ("vocab", SelfDrafter(draft_vocab=torch.arange(0, arch.vocab_size, 2))),
                          ("by_mass", SelfDrafter(draft_vocab=by_mass))):
        copy = SelfDraftRunner(eng.runner, drafter)
        copy.kernels = eng.runner.kernels
        copy.pack_weights()
        rep = measure_self_alpha(copy, eng.runner, held, temperature=1.0, depth=3)
        # the positions measure_alpha measures (3 responses of 20 tokens: the 20
        # predicting them and the one after the last), depth d all but the first d-1
        assert rep.tokens == 63 and rep.extra["tokens_by_depth"] == [63, 60, 57]
        alphas[name] = rep
    assert alphas["self"].alpha[0] > 0.9 and alphas["self"].vocab_mass == pytest.approx(1.0)
    assert alphas["other"].alpha[0] < 0.5
    assert alphas["vocab"].vocab_mass < 0.9
    assert alphas["vocab"].alpha[0] <= alphas["vocab"].vocab_mass + 1e-6
    # chosen by mass, a quarter of the vocabulary keeps more of p̃ than an arbitrary half,
    # and the copy restricted to it accepts nearly all of that mass
    assert alphas["by_mass"].vocab_mass > alphas["vocab"].vocab_mass
    assert alphas["by_mass"].alpha[0] > alphas["by_mass"].vocab_mass - 0.05


@pytest.mark.parametrize("copy", ["self", "degraded"])
def test_break_even_gate_keeps_the_copy_and_declines_a_degraded_one(peaked, copy,
                                                                     monkeypatch):
    """The default tuner (egreedy + break-even gate) with simulated step times (a
    speculative step costs 1.5-1.7 plain steps): the policy's copy is accepted so often
    that speculation stays on in every bucket; a deliberately degraded copy (another
    model's weights quantized) still decodes exactly but is declined apart from
    probes."""
    import json

    from test_speculative import _simulated_clock

    (model, arch), (other, _) = peaked
    sp = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (40, 160, 90, 20)]
    prompts = _prompts(lengths=(3, 9, 5, 12), seed=6)
    ref = [o.token_ids for o in RolloutEngine(model, None, RolloutConfig(), arch=arch,
                                              eos_token_ids=[]).generate(prompts, sp)]
    sc = SpeculativeConfig(threshold=64, buckets="1,2,4", arms="*:3_1_3,5_1_5")
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafter(SelfDrafter(source=None if copy == "self" else ModelRunner(other, arch)))
    _simulated_clock(eng, monkeypatch, lambda s: 1.2 + 0.1 * s.depth)
    assert [o.token_ids for o in eng.generate(prompts, sp)] == ref
    s = eng.last_stats.summary()["spec"]
    b1 = s["buckets"]["1"]
    if copy == "degraded":
        assert s["declined_fraction"] > 0.85, json.dumps(s, indent=1)
        assert 0 < s["probes"] == s["steps"]
        assert not any(b["tuner"]["speculating"] for b in s["buckets"].values())
    else:
        assert s["declined"] <= 3 * len(s["buckets"]) + 2
        assert all(b["tuner"]["speculating"] for b in s["buckets"].values())
        assert b1["tuner"]["arm_speedup"] > 1.5 and s["accept_len"] > 2.5


@pytest.mark.parametrize("strategy", ["3_1_3", "2_2_4"])
def test_the_copy_takes_the_targets_keys_and_values(tiny, strategy):
    """The copy's cache takes the target's keys and values at every position the
    target processed (prompt, accepted tokens; ``SelfDraftDecoder.adopt``), so its
    forward runs only from each step's root: no catch-up tokens, the prompt's entries
    equal to the target's bit for bit, and outputs still equal to plain decoding."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts()[:3]
    sp = SamplingParams(temperature=0.0, max_new_tokens=12)
    plain = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    want = [o.token_ids for o in plain.generate(prompts, sp)]
    eng = _engine(model, arch, strategy, release_memory=False)
    got = [o.token_ids for o in eng.generate(prompts, sp)]
    assert got == want
    st = eng.last_stats.spec
    assert st.summary()["steps"] > 0 and st.catchup_tokens == 0
    mine, theirs = eng.spec.cache, eng.memory.cache
    # rows may have moved; each prompt's first tokens sit in some row of both caches
    for row in range(len(prompts)):
        n = eng.spec.target_len[row]
        assert n > 0
        assert torch.equal(mine.k[:, row, :, :n], theirs.k[:, row, :, :n])
        assert torch.equal(mine.v[:, row, :, :n], theirs.v[:, row, :, :n])
