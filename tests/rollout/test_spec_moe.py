"""Speculation on Qwen3 and Qwen3-MoE targets with both drafter kinds: the one-layer
drafter (a dense layer with the target's QK norm) and the self-drafter (the policy's
int8 copy, experts quantized too). Exact: sampled continuations at T=1 with top-p
follow the target's joint distribution (chi-square, chains and trees, the method and
size of test_speculative.py); greedy outputs, and the experts recorded for every
accepted token, equal plain decoding's (tree nodes' routes move with their keys when
accepted nodes are compacted); coupled outputs equal plain coupled decoding's. Tiny
random models, single process."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig, SpeculativeConfig
from megatron_tlt.drafter_training.layer_init import copy_target_layer
from megatron_tlt.models import load_model
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout import experts
from megatron_tlt.rollout.speculative.quantize_experts import (QuantExperts,
                                                              activation_rounding, moe_int8,
                                                              quantize_experts)
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from test_speculative import (DIST_DRAWS, P_MIN, _chi2_pvalue, _exact_joint, _prompts,
                              _sample_continuations)
from tiny_models import save_tiny_hf

KINDS = ("eagle", "self")


@pytest.fixture(scope="module")
def moe(tmp_path_factory, single_process_parallel):
    """A two-layer tiny Qwen3-MoE (layer 0 sparse: 8 experts, top-2; layer 1 dense,
    ``mlp_only_layers``) with peaked next-token distributions, and a one-layer drafter
    made of its dense layer (QK norm included), fc passing the token embedding through
    and the target's final norm."""
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    folder = save_tiny_hf("qwen3_moe", tmp_path_factory.mktemp("moe"), seed=5,
                          num_hidden_layers=2)
    model, arch = load_model(folder, device=torch.device("cpu"), dtype="float32",
                             impl="local")
    with torch.no_grad():
        model.decoder.final_layernorm.weight.mul_(3.0)
    drafter = EagleDrafter(DrafterConfig.for_target(arch), arch)
    copy_target_layer(drafter, model, 1)
    with torch.no_grad():
        h = arch.hidden_size
        drafter.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1))
        drafter.norm.copy_(model.decoder.final_layernorm.weight)
    return model, arch, drafter


@pytest.fixture(scope="module")
def qwen3(qwen3_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(qwen3_hf_dirs[name], device=torch.device("cpu"),
                             dtype="float32") for name in ("qwen3_untied", "qwen3_moe")}


def _drafter(kind: str, arch, good=None):
    if kind == "self":
        return SelfDrafter()
    if good is not None:
        return good
    d = EagleDrafter(DrafterConfig.for_target(arch), arch)
    d.reset_parameters(seed=1)
    return d


def _engine(model, arch, drafter, strategy: str, **cfg) -> RolloutEngine:
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(speculative=sc, **cfg), arch=arch,
                        eos_token_ids=[])
    eng.attach_drafter(drafter)
    return eng


# ------------------------------------------------------------------------- the drafters
def test_the_drafter_layers_for_qwen3_targets(qwen3):
    """The one-layer drafter of a Qwen3 target has its QK norm and head_dim; of a
    Qwen3-MoE target, a dense MLP of the config's intermediate_size. The self-drafter's
    copy of the MoE keeps int8 experts (a quarter of the stacked float32 experts and
    their scales), a float router and the QK norms."""
    _, arch = qwen3["qwen3_untied"]
    cfg = DrafterConfig.for_target(arch)
    assert cfg.qk_layernorm and cfg.kv_channels == 24 != arch.hidden_size // 4
    model, arch = qwen3["qwen3_moe"]
    cfg = DrafterConfig.for_target(arch)
    assert cfg.qk_layernorm and cfg.ffn_hidden_size == 96
    layer = EagleDrafter(cfg, arch).layer
    assert not hasattr(layer.mlp, "router") and layer.self_attention.q_layernorm is not None
    eng = _engine(model, arch, SelfDrafter(), "2_1_2")
    eng.generate(_prompts()[:2], SamplingParams(temperature=0.0, max_new_tokens=3))
    copy, target = eng.spec.draft, eng.runner
    moe = [i for i, lw in enumerate(target.layers) if lw.router_w is not None]
    assert moe == [0, 2, 3]  # mlp_only_layers=[1]
    for i in moe:
        mine, lw = copy.layers[i], target.layers[i]
        assert isinstance(mine.w13, QuantExperts) and mine.w13.q.dtype == torch.int8
        want = quantize_experts(lw.w13)
        assert torch.equal(mine.w13.q, want.q) and torch.equal(mine.w13.scale, want.scale)
        assert mine.fc1_w is None and torch.equal(mine.router_w, lw.router_w)
        assert torch.equal(mine.q_norm, lw.q_norm)
        stacked = lw.w13.numel() * 4 + lw.w2.numel() * 4
        assert mine.w13.nbytes + mine.w2.nbytes < 0.3 * stacked


# ------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"], ids=["chain", "tree"])
def test_sampled_speculation_on_moe_reproduces_the_target_distribution(moe, kind, strategy):
    """2,500 three-token continuations at T=1, top-p 0.8 (the first from the prefill,
    the next two from one speculative step of depth 3: a chain, or a tree 3 deep, 2
    wide, 5 verified) follow the target's exact joint distribution."""
    model, arch, good = moe
    sp = SamplingParams(temperature=1.0, top_p=0.8, max_new_tokens=3)
    eng = _engine(model, arch, _drafter(kind, arch, good), strategy, max_batch_size=2500)
    prompt = [7, 100, 33, 250, 3]
    counts = _sample_continuations(eng, prompt, sp, DIST_DRAWS)
    summ = eng.last_stats.spec.summary()
    assert summ["steps"] > 0
    # accepted and rejected drafts both shape the outputs: the copy's drafts are
    # mostly accepted; the one-layer drafter (the dense layer alone, the MoE layer
    # skipped) is a poor drafter here (~5 % at depth 1), so its cases are mostly
    # rejections and residual draws
    rate = summ["accept_rate_at_position"]["1"]
    assert (0.5 if kind == "self" else 0.01) < rate < 0.99, summ
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), DIST_DRAWS)
    assert pval > P_MIN, (kind, strategy, pval)


@pytest.mark.parametrize("kernels", ["true", "false"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", ["qwen3_untied", "qwen3_moe"])
def test_greedy_speculation_equals_plain_decoding_with_its_routes(qwen3, name, kind,
                                                                  kernels):
    """Chains and trees: identical tokens and log-probs, and for the MoE every
    position's recorded experts (prompt and accepted tokens) equal plain decoding's;
    rows enter and leave mid-run (max_batch_size 4)."""
    model, arch = qwen3[name]
    sp = SamplingParams(temperature=0.0, max_new_tokens=14)
    prompts = _prompts()
    plain = RolloutEngine(model, None, RolloutConfig(max_batch_size=4, cpu_kernels=kernels),
                          arch=arch, eos_token_ids=[]).generate(prompts, sp)
    for strategy in ("4_1_4", "3_3_8"):
        eng = _engine(model, arch, _drafter(kind, arch), strategy, max_batch_size=4,
                      cpu_kernels=kernels)
        outs = eng.generate(prompts, sp)
        assert eng.last_stats.spec_fraction == 1.0
        for o, r in zip(outs, plain):
            assert o.token_ids == r.token_ids
            assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
            assert (o.routes is None) == (r.routes is None) == (not arch.is_moe)
            if arch.is_moe:
                assert o.routes.shape == (len(o.prompt_token_ids) + len(o.token_ids) - 1, 3, 2)
                assert torch.equal(o.routes, r.routes), (strategy, o.index)
        accepted = eng.last_stats.spec.summary()["accept_rate_at_position"]["1"]
        if kind == "self":  # a close copy: most first drafts are accepted
            assert accepted > 0.6
        elif strategy == "3_3_8" and arch.is_moe:  # tree nodes were compacted
            assert accepted > 0


@pytest.mark.parametrize("kind", KINDS)
def test_coupled_speculation_on_moe_equals_plain_coupled_decoding(qwen3, kind):
    """Coupled sampling (T=1, top-p 0.95): chains and trees give the plain coupled
    responses token for token."""
    model, arch = qwen3["qwen3_moe"]
    sp = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=12, seed=9)
    prompts = _prompts()
    seeds = list(range(100, 100 + len(prompts)))
    cfg = dict(sampling_mode="coupled", max_batch_size=4)
    plain = RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch,
                          eos_token_ids=[]).generate(prompts, sp, request_seeds=seeds)
    for strategy in ("3_1_3", "3_2_5"):
        eng = _engine(model, arch, _drafter(kind, arch), strategy, **cfg)
        outs = eng.generate(prompts, sp, request_seeds=seeds)
        assert [o.token_ids for o in outs] == [r.token_ids for r in plain], strategy
        assert all(torch.equal(o.routes, r.routes) for o, r in zip(outs, plain))


@pytest.mark.parametrize("act_block", [0, 16])
@pytest.mark.parametrize("first,local", [(0, 8), (4, 4)], ids=["ep1", "ep2_rank1"])
def test_the_copys_small_batch_moe_step_is_its_grouped_step(first, local, act_block):
    """Fewer (token, expert) pairs than experts: the int8 copy dequantizes only the
    chosen experts and multiplies pair by pair; the result and the routes are the
    grouped path's over all dequantized experts (this rank's experts only at EP > 1)."""
    g = torch.Generator().manual_seed(0)
    h, f, e = 32, 24, 8
    shape = experts.MoeShape(num_experts=e, topk=2, norm_topk_prob=True, first=first,
                             local=local)
    router = torch.randn(e, h, generator=g)
    w13 = quantize_experts(torch.randn(local, 2 * f, h, generator=g), 0, act_block)
    w2 = quantize_experts(torch.randn(local, h, f, generator=g), 0, act_block)
    for n in (1, 3):  # 2 and 6 pairs: under the 8 (or 4 ... 8) experts only at n=1
        x = torch.randn(n, h, generator=g)
        got, routes = moe_int8(x, router, w13, w2, shape)
        want, want_routes = experts.moe(x, router, w13.dequantize(), w2.dequantize(), shape,
                                        act=activation_rounding(act_block))
        assert torch.equal(routes, want_routes)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
