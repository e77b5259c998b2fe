"""The CUDA paths, on a machine with a GPU: ``python -m pytest tests_gpu``.

`make test` (CPU) does not collect this folder. Here every test needs CUDA; a machine
without it fails at collection rather than skipping (conftest.py), so a GPU run cannot
pass vacuously. Tests that need an optional package (Transformer Engine, flash-attn)
skip with the reason when it is absent, and `make gpu-check` (tools/gpu_check.py)
records which ones ran.

Covered: the rollout engine on CUDA against the CPU engine (fp32), CUDA graphs against
eager decoding, bf16 decoding, greedy speculation equal to plain decoding (chain and
tree, with and without graphs), the sampled-speculation chi-square test on CUDA, the
Transformer Engine target, the FP8 drafter (decoding, training, exactness, acceptance
against bf16) and flash-attn's KV-cache kernel, over fixed slots and the paged cache.
"""

from __future__ import annotations

import collections

import pytest
import torch

from megatron_tlt.models import load_model
from megatron_tlt.models.gpt import te_available
from megatron_tlt.rollout import SamplingParams

# the CPU suite's helpers: tests/support/ is on the import path (pyproject), and
# tests/rollout/test_speculative.py is loaded by conftest.py
from test_speculative import (P_MIN, _chi2_pvalue, _exact_joint, _prompts,
                              _spec_engine, build_one_layer, self_distilled_samples,
                              train_and_measure)
from test_speculative import _random_drafter as _random_drafter_on
from tiny_models import TINY_CONFIGS, save_tiny_hf

CUDA = torch.device("cuda", 0)
needs_te = pytest.mark.skipif(not te_available(), reason="Transformer Engine not installed")


def _has_flash() -> bool:
    try:
        import flash_attn  # noqa: F401
        return True
    except ImportError:
        return False


_engine = _spec_engine  # speculation fixed at a strategy, on whenever a drafter is given


def _random_drafter(arch, dtype, seed=1, **kw):
    return _random_drafter_on(arch, seed=seed, dtype=dtype, device=CUDA, **kw)


SP = SamplingParams(temperature=0.0, max_new_tokens=14, return_hidden_states=True)


# ----------------------------------------------------------------------------- plain decoding
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_cuda_engine_matches_transformers(parallel, hf_dirs, name):
    """fp32 on CUDA (local modules, sdpa): the engine's greedy tokens and log-probs are
    Hugging Face transformers' on the same GPU."""
    from transformers import AutoModelForCausalLM

    model, arch = load_model(hf_dirs[name], device=CUDA, dtype="float32", impl="local")
    hf = AutoModelForCausalLM.from_pretrained(hf_dirs[name], torch_dtype=torch.float32).to(CUDA)
    prompts = _prompts()
    outs = _engine(model, arch, max_batch_size=4).generate(prompts, SP)
    for p, o in zip(prompts, outs):
        ids = torch.tensor([p], device=CUDA)
        with torch.no_grad():  # greedy by full forwards (no generate() EOS handling)
            for _ in range(SP.max_new_tokens):
                ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], 1)
        assert o.token_ids == ids[0, len(p):].tolist()
        with torch.no_grad():
            full = torch.tensor([p + o.token_ids], device=CUDA)
            lp = torch.log_softmax(hf(full).logits[0, len(p) - 1:-1].float(), -1)
        want = lp.gather(1, torch.tensor(o.token_ids, device=CUDA)[:, None])[:, 0]
        assert (torch.tensor(o.logprobs, device=CUDA) - want).abs().max() < 1e-3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graphs_match_eager_decoding(parallel, hf_dirs, dtype):
    """Graph replay (fixed attention span with a length mask, padded buckets) gives the
    eager engine's tokens; rows enter and leave mid-run (max_batch_size 4 < 6 prompts)."""
    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype=dtype, impl="local")
    prompts = _prompts()
    eager = _engine(model, arch, max_batch_size=4, attention="sdpa",
                    cuda_graphs=False).generate(prompts, SP)  # (auto: on with CUDA)
    eng = _engine(model, arch, max_batch_size=4, attention="sdpa", cuda_graphs=True)
    graphed = eng.generate(prompts, SP)
    again = eng.generate(prompts, SP)  # replays the captured graphs
    for e, g, a in zip(eager, graphed, again):
        assert a.token_ids == g.token_ids and a.logprobs == g.logprobs  # replay is stable
        assert g.token_ids[0] == e.token_ids[0]  # the prefill (not graphed)
        if dtype == "float32":
            assert g.token_ids == e.token_ids
            assert max(abs(x - y) for x, y in zip(g.logprobs, e.logprobs)) < 1e-4
        # bf16: the tiny random model's next-token distributions are nearly flat, and a
        # graph's attention over the whole cache span sums in another order, so bf16
        # may flip near-ties; exactness is checked in fp32


def test_rollout_memory_is_released_and_graphs_recaptured(parallel, hf_dirs):
    """rollout.memory on CUDA: a fixed-size engine with CUDA graphs frees its cache,
    graphs and pool (device memory drops by at least the cache), re-makes them at the
    next generate and decodes exactly as before the release."""
    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.rollout import RolloutEngine

    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype="float32",
                             impl="local")
    prompts = _prompts()
    eng = RolloutEngine(model, None, RolloutConfig(max_batch_size=4, attention="sdpa",
                                                   cuda_graphs=True),
                        arch=arch, eos_token_ids=[], max_prompt_tokens=32,
                        max_new_tokens=SP.max_new_tokens)
    first = eng.generate(prompts, SP)
    kv = eng.memory.cache.nbytes
    assert kv > 0 and eng._graphs.captured > 0
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    eng.release_memory()
    torch.cuda.synchronize()
    assert held - torch.cuda.memory_allocated() >= kv
    assert eng._graphs.captured == 0 and eng.memory.resident_bytes()["kv_cache"] == 0
    again = eng.generate(prompts, SP)
    assert eng.memory.allocations == 2 and eng._graphs.captured > 0
    for a, b in zip(first, again):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert torch.equal(a.hidden_states, b.hidden_states)


def test_bf16_decoding_follows_fp32(parallel, hf_dirs):
    """The bf16 engine's log-probs of fp32's greedy tokens stay close (first steps)."""
    m32, arch = load_model(hf_dirs["qwen2"], device=CUDA, dtype="float32", impl="local")
    m16, _ = load_model(hf_dirs["qwen2"], device=CUDA, dtype="bfloat16", impl="local")
    sp = SamplingParams(temperature=0.0, max_new_tokens=3)
    prompts = _prompts()
    ref = _engine(m32, arch).generate(prompts, sp)
    got = _engine(m16, arch).generate(prompts, sp)
    first = [g.token_ids[0] == r.token_ids[0] for g, r in zip(got, ref)]
    assert sum(first) >= len(first) - 1
    for g, r in zip(got, ref):
        assert abs(g.logprobs[0] - r.logprobs[0]) < 0.15


@needs_te
def test_transformer_engine_target_matches_local(parallel, hf_dirs):
    """The same checkpoint built with Transformer Engine modules decodes like the local
    modules (the engine reads TE's fused-norm weight names)."""
    local, arch = load_model(hf_dirs["llama_tied"], device=CUDA, dtype="float32", impl="local")
    te, _ = load_model(hf_dirs["llama_tied"], device=CUDA, dtype="float32",
                       impl="transformer_engine")
    prompts = _prompts()
    a = _engine(local, arch).generate(prompts, SP)
    b = _engine(te, arch).generate(prompts, SP)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) < 1e-3


@pytest.mark.skipif(not _has_flash(), reason="flash-attn not installed")
def test_flash_attention_matches_sdpa(parallel, hf_dirs):
    model, arch = load_model(hf_dirs["llama_tied"], device=CUDA, dtype="bfloat16", impl="local")
    prompts = _prompts()
    sdpa = _engine(model, arch, attention="sdpa").generate(prompts, SP)
    flash = _engine(model, arch, attention="flash").generate(prompts, SP)
    for s, f in zip(sdpa, flash):
        assert s.token_ids[:4] == f.token_ids[:4]


def _paged_flash_case():
    """Rows that cross a 256-position block while decoding, and one whose prompt fills
    most of two: every call's capacity is 512 positions, so fixed slots and the paged
    tables (2 blocks of 256) give the kernel the same key length (its split of the
    keys, hence its sums, are the same)."""
    prompts = _prompts(lengths=(500, 250, 245, 248), seed=3)
    return prompts, SamplingParams(temperature=0.0, max_new_tokens=12,
                                   return_hidden_states=False)


@pytest.mark.skipif(not _has_flash(), reason="flash-attn not installed")
def test_flash_paged_decode_matches_slots_and_sdpa(parallel, hf_dirs):
    """flash-attn's paged kernel (rollout.kv_cache=paged, 256-position blocks read through
    the block tables, no gather) on a bf16 tiny model: greedy outputs equal flash over
    fixed slots (the same kernel over contiguous rows), and SDPA over the gathered blocks
    for the first tokens (bf16 near-ties beyond, as test_flash_attention_matches_sdpa).
    Eager steps: a graph's padded bucket would change the kernel's batch."""
    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype="bfloat16",
                             impl="local")
    prompts, sp = _paged_flash_case()
    common = dict(max_batch_size=4, cuda_graphs=False)
    slots = _engine(model, arch, attention="flash", **common).generate(prompts, sp)
    eng = _engine(model, arch, attention="flash", kv_cache="paged", kv_block_size=256,
                  **common)
    assert eng.attention == "flash"
    paged = eng.generate(prompts, sp)
    assert eng.memory.cache.layout == "bsgd" and eng.last_stats.kv_blocks > 0
    sdpa = _engine(model, arch, attention="sdpa", kv_cache="paged", kv_block_size=256,
                   **common).generate(prompts, sp)
    for s, p, q in zip(slots, paged, sdpa):
        assert p.token_ids == s.token_ids
        assert max(abs(x - y) for x, y in zip(p.logprobs, s.logprobs)) < 1e-3
        assert p.token_ids[:4] == q.token_ids[:4]


@pytest.mark.skipif(not _has_flash(), reason="flash-attn not installed")
def test_flash_paged_decode_with_graphs_and_preemption(parallel, hf_dirs):
    """The paged flash steps captured in CUDA graphs, with a budget of 5 blocks for 4
    rows (the rows crossing a block are preempted and recomputed): replays are stable
    and the first tokens are the eager slot engine's (bf16: exactness under preemption
    is the CPU suite's, tests/rollout/test_paged_flash.py)."""
    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype="bfloat16",
                             impl="local")
    prompts, sp = _paged_flash_case()
    eager = _engine(model, arch, attention="flash", max_batch_size=4,
                    cuda_graphs=False).generate(prompts, sp)
    block = 2 * arch.num_layers * arch.num_query_groups * 256 * arch.kv_channels * 2
    eng = _engine(model, arch, attention="flash", kv_cache="paged", kv_block_size=256,
                  kv_cache_gib=5.5 * block / 2**30, max_batch_size=4, cuda_graphs=True)
    graphed = eng.generate(prompts, sp)
    assert eng.last_stats.preemptions > 0
    again = eng.generate(prompts, sp)
    for e, g, a in zip(eager, graphed, again):
        assert a.token_ids == g.token_ids and a.logprobs == g.logprobs
        assert len(g.token_ids) == sp.max_new_tokens
        assert g.token_ids[:4] == e.token_ids[:4]


# ----------------------------------------------------------------------------- speculation
@pytest.mark.parametrize("strategy", ["4_1_4", "3_3_8", "1_1_1"])
@pytest.mark.parametrize("graphs", [False, True])
def test_greedy_speculation_equals_plain_on_cuda(parallel, hf_dirs, strategy, graphs):
    model, arch = load_model(hf_dirs["llama_untied"], device=CUDA, dtype="float32",
                             impl="local")
    prompts = _prompts()
    plain = _engine(model, arch, max_batch_size=4, cuda_graphs=False).generate(prompts, SP)
    eng = _engine(model, arch, _random_drafter(arch, torch.float32), strategy,
                  max_batch_size=4, cuda_graphs=graphs)
    outs = eng.generate(prompts, SP)
    for o, r in zip(outs, plain):
        assert o.token_ids == r.token_ids
        assert max(abs(a - b) for a, b in zip(o.logprobs, r.logprobs)) < 1e-4
        assert (o.hidden_states - r.hidden_states).abs().max() < 1e-4
    assert eng.last_stats.spec_fraction == 1.0


@pytest.fixture(scope="module")
def one_layer_cuda(parallel, tmp_path_factory):
    folder = save_tiny_hf("llama_tied", tmp_path_factory.mktemp("one_layer"), seed=5,
                          num_hidden_layers=1)
    return build_one_layer(folder, device=CUDA)


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("drafter", ["good", "bad"])
def test_sampled_speculation_reproduces_target_distribution_on_cuda(one_layer_cuda, kind,
                                                                    drafter):
    """20,000 three-token continuations sampled through the CUDA engine follow the
    target's exact joint distribution (chi-square), as on CPU."""
    model, arch, good, bad = one_layer_cuda
    sp = SamplingParams(temperature=0.7, top_k=6, max_new_tokens=3)
    eng = _engine(model, arch, good if drafter == "good" else bad,
                  "3_2_5" if kind == "tree" else "3_1_3", max_batch_size=5000)
    prompt = [7, 100, 33, 250, 3]
    counts = collections.Counter()
    for call in range(4):
        outs = eng.generate([prompt] * 5000,
                            SamplingParams(**{**sp.__dict__, "seed": 1000 * call + 17}))
        counts.update(tuple(o.token_ids) for o in outs)
    assert eng.last_stats.spec.summary()["steps"] > 0
    pval = _chi2_pvalue(counts, _exact_joint(model, arch, prompt, sp, 3), 20_000)
    assert pval > P_MIN, (kind, drafter, pval)


# ----------------------------------------------------------------------------- FP8 drafter
def _acceptance(model, arch, drafter, prompts):
    sp = SamplingParams(temperature=0.0, max_new_tokens=24)
    ref = [o.token_ids for o in _engine(model, arch).generate(prompts, sp)]
    eng = _engine(model, arch, drafter, "4_1_4")
    got = [o.token_ids for o in eng.generate(prompts, sp)]
    return eng.last_stats.spec.accept_len, sum(g == r for g, r in zip(got, ref)) / len(ref)


@needs_te
def test_fp8_drafter_keeps_acceptance(parallel, tmp_path):
    """The near-oracle drafter of the one-layer target, run through Transformer Engine's
    FP8 GEMMs, accepts nearly as many tokens as in bf16 (the failure this guards against:
    an FP8 drafter whose drafts are never accepted). bf16 verification may part from
    plain decoding at near-ties, so exactness is asserted as a share of identical
    outputs. SmolLM2 with a warmed drafter: tools/drafter_precision.py."""
    folder = save_tiny_hf("llama_tied", tmp_path / "one_layer", seed=5, num_hidden_layers=1)
    model, arch, good, _ = build_one_layer(folder, device=CUDA, dtype="bfloat16")
    fp8 = _random_drafter(arch, torch.bfloat16, fp8=True)
    fp8.load_own_state(good.own_state())
    prompts = _prompts(lengths=[3 + i % 9 for i in range(24)], seed=8)
    acc = {name: _acceptance(model, arch, d, prompts) for name, d in
           [("bf16", good), ("fp8", fp8),
            ("random", _random_drafter(arch, torch.bfloat16, seed=9))]}
    print("acceptance (mean tokens per step, share identical):", acc)
    assert acc["bf16"][0] > acc["random"][0] + 0.5, acc
    assert acc["fp8"][0] > 0.85 * acc["bf16"][0], acc
    for _, share in acc.values():
        assert share >= 0.75, acc


@needs_te
def test_fp8_drafter_trains_like_bf16(parallel, hf_dirs):
    """Training under fp8_autocast lowers the held-out EAGLE loss about as much as bf16
    training does, from the same start."""
    model, arch = load_model(hf_dirs["llama_tied"], device=CUDA, dtype="bfloat16",
                             impl="local")
    plain = _engine(model, arch)
    train, held = self_distilled_samples(plain)
    result = {}
    for name, fp8 in (("bf16", False), ("fp8", True)):
        before, after = train_and_measure(_random_drafter(arch, torch.bfloat16, seed=2, fp8=fp8),
                                          plain.runner, train, held)
        result[name] = (before["hidden"], after["hidden"])
    print("held-out hidden loss (before, after):", result)
    for name, (before, after) in result.items():
        assert after < 0.85 * before, result
    assert result["fp8"][1] < 1.15 * result["bf16"][1], result


# ----------------------------------------------------------------------------- checkpoints
def test_async_save_on_cuda_is_a_host_snapshot(parallel, hf_dirs, tmp_path):
    """megatron-core's async save of a CUDA policy (its distributed optimizer): the save
    returns once the shards are copied to host memory, so an optimizer step taken right
    after it does not reach the checkpoint; the checkpoint is published by the finalize
    step only, and loads to exactly what a synchronous save of the same state loads to."""
    from rl_fixtures import saved_tensors

    from megatron_tlt import checkpoint
    from megatron_tlt.checkpoint.background import BackgroundSaves
    from megatron_tlt.config import TrainConfig
    from megatron_tlt.parallel import layout
    from megatron_tlt.rl.policy import Policy
    from megatron_tlt.rl.samples import Sample, collate

    model, arch = load_model(hf_dirs["llama_tied"], device=CUDA, dtype="float32")
    policy = Policy(model, arch, TrainConfig(lr=1e-2), total_optimizer_steps=8)
    assert policy.kind == "megatron"
    gen = torch.Generator().manual_seed(0)
    samples = [Sample(prompt_index=0, prompt_ids=[1, 2, 3],
                      response_ids=torch.randint(3, 60, (5,), generator=gen).tolist(),
                      rollout_logprobs=[-1.0] * 5, finish_reason="stop") for _ in range(2)]
    mb = collate(samples, range(2), pad_id=0, device=CUDA)

    def optimizer_step():
        result, _ = policy.train_step(
            [mb], lambda m, logits: (logits.float().pow(2).mean(), {}))
        assert result.updated

    optimizer_step()  # optimizer state to save
    state, lay = checkpoint.RunState(policy=policy, step=1), layout()
    before = saved_tensors(policy)
    sync = checkpoint.save(state, tmp_path / "sync", lay)
    background = BackgroundSaves()
    path = checkpoint.save(state, tmp_path / "async", lay, background=background)
    optimizer_step()  # while the background process writes
    moved = saved_tensors(policy)
    assert any(not moved[k].equal(v) for k, v in before.items())
    assert checkpoint.latest(tmp_path / "async") is None
    assert background.finalize(blocking=True) == 1
    assert checkpoint.latest(tmp_path / "async") == path
    for saved in (sync, path):
        optimizer_step()
        checkpoint.load(state, saved, lay)
        got = saved_tensors(policy)
        assert got.keys() == before.keys()
        assert all(got[k].equal(v) for k, v in before.items()), saved
