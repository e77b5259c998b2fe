"""The engine with the paged KV cache (rollout.kv_cache=paged) against fixed slots: the
same outputs (tokens, finish reasons, log-probs, hidden states) for plain decoding
(greedy, standard and coupled sampling, refill, shared prefill), with a budget so small
that rows are preempted and recomputed, for speculation (EAGLE, the self-drafter, both
kinds; chains and trees), and the memory: a group's prompt stored once, blocks in use
following the tokens held, a budget too small for one row refused. Tiny random models,
single process (TP = 2, PP = 2 and the MoE at EP = 2: tests/support/paged_cases.py, run
in test_rollout_tp.py's and tests/models/test_multiproc.py's launches)."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import ConfigError, RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.kv_blocks import blocks_for
from megatron_tlt.rollout.speculative.drafter_kind import draft_slack
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from test_shared_prefill import _assert_same
from tiny_models import TINY_CONFIGS, VOCAB, random_eagle


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
            for name in TINY_CONFIGS}


def _prompts(lengths, seed=0, group=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    unique = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return [p for p in unique for _ in range(group)]


def _engine(model, arch, kv, drafter=None, strategy=None, **cfg) -> RolloutEngine:
    if strategy is not None:
        cfg["speculative"] = SpeculativeConfig(policy="fixed", strategy=strategy,
                                               threshold=1 << 20)
    eng = RolloutEngine(model, None, RolloutConfig(kv_cache=kv, **cfg), arch=arch,
                        eos_token_ids=[])
    if drafter is not None:
        eng.attach_drafters(drafter) if isinstance(drafter, dict) else \
            eng.attach_drafter(drafter)
    return eng


def drafter_pool_gib(eng, prompts, params) -> float:
    """GiB of the drafters' paged caches (their pools: ``rollout.speculative.threshold``
    rows of the call's positions) for ``eng.generate(prompts, params)``, which
    ``rollout.kv_cache_gib`` holds beside the target's blocks."""
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else params
    capacity = max(len(p) + sp.max_new_tokens for p, sp in zip(prompts, plist))
    rows = min(eng.config.max_batch_size, len(prompts))
    slack = draft_slack(eng.tuner.all_arms())
    return eng.spec.paged_kv_bytes(rows, capacity, slack,
                                   min(rows, eng.config.speculative.threshold),
                                   eng.config.kv_block_size) / 2**30


def _both(make, prompts, params, **kw):
    """(outputs, stats) with fixed slots, then paged, on engines made by ``make(kv)``."""
    out = []
    for kv in ("slots", "paged"):
        eng = make(kv)
        out.append((eng.generate(prompts, params, **kw), eng.last_stats))
    return out


def _lengths_params(n, temperature=0.0, seed=3, hidden=False, base=3):
    """Ragged response lengths (rows finish at different steps and refill)."""
    return [SamplingParams(temperature=temperature, top_p=0.95, max_new_tokens=base + (7 * i) % 11,
                           seed=seed, return_hidden_states=hidden) for i in range(n)]


# ------------------------------------------------------------------------ plain decoding
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_greedy_outputs_equal_the_slot_cache(tiny, name):
    model, arch = tiny[name]
    prompts = _prompts((5, 17, 9, 33, 2, 12), seed=1)
    params = _lengths_params(len(prompts), hidden=True)
    (old, s_old), (new, s_new) = _both(
        lambda kv: _engine(model, arch, kv, max_batch_size=4), prompts, params)
    _assert_same(old, new)
    assert s_new.kv_blocks > 0 and s_new.preemptions == 0
    assert s_old.kv_blocks == 0


@pytest.mark.parametrize("strategy", [None, "3_1_3"], ids=["plain", "chain"])
def test_the_fused_kernels_read_the_blocks_in_place(tiny, monkeypatch, strategy):
    """The fused CPU kernels run on the paged cache (its block table passed to every
    decode step's and chain verification's kernel call) and give bitwise the slot
    cache's outputs: the same kernels visit the same positions in the same order."""
    from megatron_tlt.rollout.forward import ModelRunner
    from megatron_tlt.rollout.kv_paged import PagedKVCache

    model, arch = tiny["llama_tied"]
    prompts = _prompts((5, 17, 9), seed=6, group=2)
    params = _lengths_params(len(prompts), temperature=1.0, hidden=True, base=8)
    seen = []
    fused = ModelRunner.extend_chains

    def spy(self, cache, row_of, pos, x, capture=None):
        if cache.paged and self.kernels is not None:
            seen.append(pos.numel())
        return fused(self, cache, row_of, pos, x, capture)

    monkeypatch.setattr(ModelRunner, "extend_chains", spy)
    tables = []
    monkeypatch.setattr(PagedKVCache, "block_table",
                        lambda self: tables.append(1) or self.pool.flush())
    drafter = random_eagle(arch) if strategy else None
    (old, _), (new, s_new) = _both(
        lambda kv: _engine(model, arch, kv, drafter, strategy, max_batch_size=4,
                           sampling_mode="coupled", kv_block_size=4), prompts, params)
    _assert_same(old, new, tol=0.0)
    assert len(tables) >= len(seen) > 0
    if strategy:
        assert s_new.spec.steps > 0


@pytest.mark.parametrize("mode", ["standard", "coupled"])
def test_sampled_groups_equal_the_slot_cache(tiny, mode):
    """GRPO groups (4 responses per prompt, shared prefill: the paged rows share the
    prompt's blocks), refill with a batch smaller than the call."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts((21, 6, 40), seed=2, group=4)
    params = _lengths_params(len(prompts), temperature=1.0)
    (old, _), (new, s_new) = _both(
        lambda kv: _engine(model, arch, kv, max_batch_size=6, sampling_mode=mode),
        prompts, params)
    _assert_same(old, new)
    assert s_new.prefill_shared_rows > 0


@pytest.mark.parametrize("mode", ["coupled", "greedy"])
def test_a_small_budget_preempts_and_outputs_do_not_change(tiny, mode):
    """A pool of a few rows' worth of blocks for 12 rows in flight: rows are preempted
    when blocks run out and recomputed later; coupled sampling draws per (request,
    position), so every response equals the slot cache's."""
    model, arch = tiny["qwen2"]
    prompts = _prompts((9, 30, 14, 3, 22, 17), seed=5, group=2)
    params = _lengths_params(len(prompts), temperature=0.0 if mode == "greedy" else 1.0,
                             hidden=True, base=20)
    gib = 3 * 64 * 2 * arch.num_layers * arch.num_query_groups * arch.kv_channels * 4 / 2**30
    cfg = {"sampling_mode": "coupled"} if mode == "coupled" else {}
    old_eng = _engine(model, arch, "slots", max_batch_size=12, **cfg)
    new_eng = _engine(model, arch, "paged", max_batch_size=12, kv_cache_gib=gib,
                      kv_block_size=8, **cfg)
    old = old_eng.generate(prompts, params)
    new = new_eng.generate(prompts, params)
    s = new_eng.last_stats
    _assert_same(old, new, tol=1e-4)
    assert s.preemptions > 0
    assert s.kv_blocks_peak <= s.kv_blocks
    assert s.summary()["preemptions"] == s.preemptions


def test_a_budget_below_one_row_names_the_field_and_the_minimum(tiny):
    model, arch = tiny["llama_tied"]
    eng = _engine(model, arch, "paged", kv_cache_gib=1e-7)
    with pytest.raises(ConfigError, match=r"rollout\.kv_cache_gib.*at least"):
        eng.generate(_prompts((30,)), SamplingParams(temperature=0.0, max_new_tokens=50))


def test_paged_flash_attention_with_blocks_flash_cannot_read_is_refused():
    """The default 16-position blocks: flash-attn's paged kernel needs multiples of 256
    (test_paged_flash.py covers the supported case)."""
    with pytest.raises(ConfigError, match="rollout.kv_block_size"):
        RolloutConfig(kv_cache="paged", attention="flash")
    RolloutConfig(kv_cache="paged", attention="flash", kv_block_size=256)


# ------------------------------------------------------------------------ memory
def test_a_group_of_8_stores_its_prompt_once(tiny):
    """8 responses of one 224-token prompt (the tiny models' context is 256; the cache
    test takes 256): the blocks in use at the first decode step are the prompt's once
    plus one block per response (its first step's position)."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts((224,), seed=6, group=8)
    eng = _engine(model, arch, "paged", max_batch_size=8, kv_block_size=16)
    eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True))
    s = eng.last_stats
    # each row's step writes position 224, the first of a new block
    assert s.kv_blocks_peak == 224 // 16 + 8
    assert s.prefill_shared_rows == 7
    # the slot cache would hold the prompt 8 times
    assert s.kv_blocks_peak * 16 < 8 * 224 / 4


def test_blocks_in_use_follow_the_tokens_held(tiny):
    """At every step the blocks in use are within one block per row of the positions
    the rows hold (a long-tailed batch, no sharing)."""
    model, arch = tiny["llama_untied"]
    prompts = _prompts((3, 40, 7, 19, 60, 11, 5, 28), seed=7)
    params = _lengths_params(len(prompts), base=5)
    eng = _engine(model, arch, "paged", max_batch_size=8, kv_block_size=8, share_prefill=False)
    seen = []
    orig = eng._decode_step

    def spy(cache, rows, *a, **k):
        orig(cache, rows, *a, **k)  # (finished rows retired, their blocks returned)
        seen.append((cache.pool.used * 8, sum(r.length for r in rows), len(rows)))

    eng._decode_step = spy
    eng.generate(prompts, params)
    assert seen
    assert max(rows for *_, rows in seen) == 8
    for used, held, rows in seen:
        assert held <= used < held + max(rows, 1) * 8


# ------------------------------------------------------------------------ speculation
@pytest.mark.parametrize("drafter", ["eagle", "self"])
@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"], ids=["chain", "tree"])
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_speculation_equals_the_slot_cache(tiny, drafter, strategy, mode):
    model, arch = tiny["llama_tied"]
    prompts = _prompts((5, 11, 8), seed=4, group=3)
    params = _lengths_params(len(prompts), temperature=0.0 if mode == "greedy" else 1.0,
                             hidden=True, base=6)
    cfg = {"sampling_mode": "coupled"} if mode == "coupled" else {}

    def make(kv):
        d = random_eagle(arch) if drafter == "eagle" else SelfDrafter()
        return _engine(model, arch, kv, d, strategy, max_batch_size=5, **cfg)

    (old, _), (new, s_new) = _both(make, prompts, params)
    _assert_same(old, new, tol=1e-4)
    assert s_new.spec.steps > 0


def test_both_kinds_with_preemption_keep_coupled_outputs(tiny):
    """Both drafter kinds, coupled sampling, a budget that preempts: the same responses
    as fixed slots without speculation."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts((7, 4, 13), seed=8, group=3)
    params = _lengths_params(len(prompts), temperature=1.0, base=15)
    plain = _engine(model, arch, "slots", sampling_mode="coupled").generate(prompts, params)
    sc = SpeculativeConfig(threshold=64, buckets="1,4", arms="*:3_1_3,3_2_5")
    gib = 3 * 48 * 2 * arch.num_layers * arch.num_query_groups * arch.kv_channels * 4 / 2**30
    eng = RolloutEngine(model, None, RolloutConfig(
        speculative=sc, sampling_mode="coupled", kv_cache="paged", kv_cache_gib=gib,
        kv_block_size=8, max_batch_size=9), arch=arch, eos_token_ids=[])
    eng.attach_drafters({"eagle": random_eagle(arch), "self": SelfDrafter()}, epsilon=0.5)
    eng.config.kv_cache_gib += drafter_pool_gib(eng, prompts, params)
    new = eng.generate(prompts, params)
    assert [o.token_ids for o in new] == [o.token_ids for o in plain]
    assert eng.last_stats.spec.steps > 0 and eng.last_stats.preemptions > 0
    assert blocks_for(1, 8) == 1


@pytest.mark.parametrize("drafter,strategy,mode", [
    ("eagle", "3_1_3", "greedy"), ("eagle", "3_2_5", "coupled"),
    ("self", "3_1_3", "coupled"), ("self", "3_2_5", "greedy")])
def test_paged_drafters_with_preemption_equal_the_slot_cache(tiny, drafter, strategy, mode):
    """Each drafter kind's own cache paged (its blocks returned when a row is
    preempted, its state caught up again after the recompute), a budget that preempts:
    the same outputs as fixed slots with the same drafter."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts((9, 21, 4, 15), seed=9, group=2)
    params = _lengths_params(len(prompts), temperature=0.0 if mode == "greedy" else 1.0,
                             hidden=True, base=14)
    cfg = {"sampling_mode": "coupled"} if mode == "coupled" else {}

    def make(kv, **kw):
        d = random_eagle(arch) if drafter == "eagle" else SelfDrafter()
        return _engine(model, arch, kv, d, strategy, max_batch_size=8, **cfg, **kw)

    old = make("slots").generate(prompts, params)
    eng = make("paged", kv_block_size=8, kv_cache_gib=3 * 48 * 2 * arch.num_layers
               * arch.num_query_groups * arch.kv_channels * 4 / 2**30)
    eng.config.kv_cache_gib += drafter_pool_gib(eng, prompts, params)
    new = eng.generate(prompts, params)
    _assert_same(old, new, tol=1e-4)
    s = eng.last_stats
    assert s.preemptions > 0 and s.spec.steps > 0
    (d,) = eng.spec.each()
    assert d.cache.paged and d.cache.pool.used == 0  # every row's blocks returned
    # the one-layer drafter's features live in the target's blocks
    assert (eng.memory.cache.feat is not None) == (drafter == "eagle")


@pytest.mark.parametrize("drafter", ["eagle", "self"])
def test_drafter_blocks_follow_the_tokens_they_hold(tiny, drafter):
    """After every decode step the drafter's KV bytes in use are its rows' positions
    (what it was fed) within one block per row, those never more than the target's
    rows hold plus a block each; a finished row's blocks come back."""
    model, arch = tiny["llama_untied"]
    prompts = _prompts((3, 40, 7, 19, 60, 11), seed=10)
    params = _lengths_params(len(prompts), base=12)
    d = random_eagle(arch) if drafter == "eagle" else SelfDrafter()
    bs = 8
    eng = _engine(model, arch, "paged", d, "3_1_3", max_batch_size=6, kv_block_size=bs,
                  share_prefill=False)
    seen = []
    orig = eng._decode_step

    def spy(cache, rows, *a, **k):
        orig(cache, rows, *a, **k)
        (dec,) = eng.spec.each()
        held = sum(dec.draft_len[: len(rows)])
        per_pos = dec.cache.block_nbytes // bs
        seen.append((dec.kv_bytes_in_use(), held * per_pos, per_pos, len(rows),
                     sum(r.length for r in rows), dec.cache.pool.used))

    eng._decode_step = spy
    eng.generate(prompts, params)
    (dec,) = eng.spec.each()
    assert dec.cache.paged and dec.cache.pool.used == 0
    assert seen and any(held for _, held, *_ in seen)
    for used, held, per_pos, rows, target_held, blocks in seen:
        assert used == blocks * bs * per_pos
        assert held <= used < held + max(rows, 1) * bs * per_pos
        assert blocks * bs < target_held + max(rows, 1) * bs
