"""flash-attn's paged decode (rollout.kv_cache=paged, rollout.attention=flash) on the CPU:
a pure-torch stand-in for ``flash_attn_with_kvcache`` written from its contract
(tests/support/fake_flash.py) runs the engine's flash path, so the pools' "bsgd"
layout, the block tables handed to the kernel and the per-row lengths are checked
against SDPA over the gathered blocks and the slot cache: greedy and coupled outputs,
GRPO groups sharing a prompt's blocks, a budget that preempts rows, chain speculation
(the kernel verifies chains) and trees (SDPA over the "bsgd" pools). The stand-in takes
pages of 8 positions (flash-attn 2.x: multiples of 256) so rows span several blocks;
one case runs 256-position blocks. The real kernel on a GPU: tests_gpu/test_cuda.py.
Also the config: rollout.attention=flash with a block size flash-attn does not take is
a ConfigError naming rollout.kv_block_size and the multiple; auto picks SDPA then."""

from __future__ import annotations

import pytest
import torch

from fake_flash import make_fake, use_fake_flash
from megatron_tlt.config import ConfigError, RolloutConfig, SpeculativeConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.kv_paged import PagedKVCache
from megatron_tlt.rollout.speculative.self_drafter import SelfDrafter
from test_shared_prefill import _assert_same
from tiny_models import VOCAB, random_eagle

PAGE = 8  # the stand-in's page multiple (rows of the tiny models span several blocks)


@pytest.fixture(scope="module")
def tiny(tiny_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
            for name in ("llama_tied", "llama_untied", "qwen2")}


@pytest.fixture
def fake(monkeypatch):
    return use_fake_flash(monkeypatch, page=PAGE)


def _prompts(lengths, seed=0, group=1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    unique = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    return [p for p in unique for _ in range(group)]


def _params(n, temperature=0.0, base=3, hidden=True):
    return [SamplingParams(temperature=temperature, top_p=0.95, seed=3,
                           max_new_tokens=base + (7 * i) % 11, return_hidden_states=hidden)
            for i in range(n)]


def _engine(model, arch, kv, attention, drafter=None, strategy=None, **cfg):
    if strategy is not None:
        cfg["speculative"] = SpeculativeConfig(policy="fixed", strategy=strategy,
                                               threshold=1 << 20)
    cfg.setdefault("kv_block_size", PAGE)
    eng = RolloutEngine(model, None, RolloutConfig(kv_cache=kv, attention=attention, **cfg),
                        arch=arch, eos_token_ids=[])
    assert eng.attention == attention
    if drafter is not None:
        eng.attach_drafter(drafter)
    return eng


def _three(make, prompts, params):
    """Outputs of the slot cache (SDPA), the paged cache with SDPA over gathered blocks
    and the paged cache with the flash kernel; the last engine too."""
    outs = []
    for kv, att in (("slots", "sdpa"), ("paged", "sdpa"), ("paged", "flash")):
        eng = make(kv, att)
        outs.append(eng.generate(prompts, params))
    return outs, eng


def _paged_calls(fake) -> list[int]:
    """seqlen_q of the stand-in's paged calls."""
    return [sq for paged, sq in fake.calls if paged]


# ------------------------------------------------------------------------ the pools
def _pools(layout):
    torch.manual_seed(0)
    c = PagedKVCache(num_layers=2, max_batch=3, kv_heads=2, capacity=40, head_dim=4,
                     dtype=torch.float32, device=torch.device("cpu"), num_blocks=20,
                     block_size=PAGE, layout=layout)
    return c


def test_the_flash_layout_reads_and_moves_like_the_sdpa_layout():
    """The same writes, shares, moves and reads on "bgsd" and "bsgd" pools give the
    same K and V; the "bsgd" pools are flash-attn's [blocks, block_size, kv_heads, d]
    with an int32 table."""
    a, b = _pools("bgsd"), _pools("bsgd")
    assert b.k.shape[1:] == (20, PAGE, 2, 4) and b.tables(slice(0, 3)).dtype == torch.int32
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 3, 19, 2, 4, generator=g)
    v = torch.randn(2, 3, 19, 2, 4, generator=g)
    pos = torch.arange(19)[None].expand(3, 19)
    for c in (a, b):
        c.reserve_rows([(r, 19) for r in range(3)])
        for layer in range(2):
            c.write(layer, slice(0, 3), pos, k[layer], v[layer])
        c.copy_row(0, torch.tensor([2]), 13)  # row 2 shares row 0's first 13 positions
        c.move_positions(1, [15, 16], [3, 4])
        c.move_row(1, 0, 19)
    for layer in range(2):
        ka, va = a.write(layer, slice(0, 3), pos[:, :1] + 19, k[layer, :, :1], v[layer, :, :1], 20)
        kb, vb = b.write(layer, slice(0, 3), pos[:, :1] + 19, k[layer, :, :1], v[layer, :, :1], 20)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(a.span("k", 2, 2, 17), b.span("k", 2, 2, 17))
    c = _pools("bsgd")
    c.reserve(1, 19)
    c.copy_positions(a, 1, 0, 19)  # (the self-drafter's adoption reads spans)
    assert torch.equal(c.span("v", 1, 0, 19), a.span("v", 1, 0, 19))


def test_the_stand_in_pages_like_its_contiguous_form():
    """The stand-in's paged call equals its contiguous call (the same rows laid out in
    shuffled blocks): the reference the engine tests lean on."""
    fake = make_fake(page=4)
    g = torch.Generator().manual_seed(2)
    b, hk, d, cap = 3, 2, 8, 16
    cont_k, cont_v = torch.randn(2, b, cap, hk, d, generator=g).unbind(0)
    lens = torch.tensor([5, 0, 9], dtype=torch.int32)
    q = torch.randn(b, 3, 4, d, generator=g)
    k, v = torch.randn(2, b, 3, hk, d, generator=g).unbind(0)
    perm = torch.randperm(b * cap // 4, generator=g) + 1
    table = perm.view(b, cap // 4).to(torch.int32)
    pk = torch.zeros(b * cap // 4 + 1, 4, hk, d)
    pv = torch.zeros_like(pk)
    pk[table.long()] = cont_k.view(b, cap // 4, 4, hk, d)
    pv[table.long()] = cont_v.view(b, cap // 4, 4, hk, d)
    want = fake(q, cont_k, cont_v, k=k, v=v, cache_seqlens=lens, causal=True)
    got = fake(q, pk, pv, k=k, v=v, cache_seqlens=lens, block_table=table, causal=True)
    assert torch.allclose(want, got, atol=1e-6)
    assert torch.equal(pk[table.long()].view(b, cap, hk, d), cont_k)
    assert fake.calls == [(False, 3), (True, 3)]


# ------------------------------------------------------------------------ the engine
@pytest.mark.parametrize("name", ["llama_tied", "qwen2"])
def test_greedy_flash_paged_equals_sdpa_and_the_slots(tiny, fake, name):
    model, arch = tiny[name]
    prompts = _prompts((5, 17, 9, 33, 2, 12), seed=1)
    params = _params(len(prompts))
    (slots, sdpa, flash), eng = _three(
        lambda kv, att: _engine(model, arch, kv, att, max_batch_size=4), prompts, params)
    _assert_same(slots, sdpa)
    _assert_same(sdpa, flash, tol=1e-4)
    calls = _paged_calls(fake)  # (one per layer) the prefills, then the decode steps
    assert len(calls) == len(fake.calls) and 1 in calls and max(calls) == 33
    assert eng.last_stats.kv_blocks > 0 and eng.memory.cache.layout == "bsgd"


def test_coupled_groups_share_blocks_and_preempt(tiny, fake):
    """GRPO groups (shared prefill: the copies reference the prompt's blocks) with a
    budget so small that rows are preempted and recomputed: coupled outputs equal the
    slot cache's."""
    model, arch = tiny["qwen2"]
    prompts = _prompts((9, 30, 14, 3, 22, 17), seed=5, group=2)
    params = _params(len(prompts), temperature=1.0, base=20, hidden=False)
    gib = 3 * 64 * 2 * arch.num_layers * arch.num_query_groups * arch.kv_channels * 4 / 2**30
    (slots, sdpa, flash), eng = _three(
        lambda kv, att: _engine(model, arch, kv, att, max_batch_size=12,
                                sampling_mode="coupled",
                                **({"kv_cache_gib": gib} if kv == "paged" else {})),
        prompts, params)
    assert [o.token_ids for o in flash] == [o.token_ids for o in slots]
    _assert_same(sdpa, flash, tol=1e-4)
    s = eng.last_stats
    assert s.preemptions > 0 and s.prefill_shared_rows > 0


def test_greedy_preemption_with_256_position_blocks(tiny, monkeypatch):
    """flash-attn 2.x's own page size: 256-position blocks, rows that grow into their
    second block, a pool of 5 blocks for 4 rows in flight (rows are preempted)."""
    fake = use_fake_flash(monkeypatch, page=256)
    model, arch = tiny["llama_untied"]
    prompts = _prompts((240, 250, 236, 245), seed=6)
    params = _params(len(prompts), base=18)
    gib = 5.5 * 256 * 2 * arch.num_layers * arch.num_query_groups * arch.kv_channels * 4 / 2**30
    (slots, _, flash), eng = _three(
        lambda kv, att: _engine(model, arch, kv, att, max_batch_size=4, kv_block_size=256,
                                **({"kv_cache_gib": gib} if kv == "paged" else {})),
        prompts, params)
    _assert_same(slots, flash, tol=1e-4)
    assert eng.last_stats.preemptions > 0 and _paged_calls(fake)


@pytest.mark.parametrize("drafter", ["eagle", "self"])
@pytest.mark.parametrize("strategy", ["3_1_3", "3_2_5"], ids=["chain", "tree"])
@pytest.mark.parametrize("mode", ["greedy", "coupled"])
def test_speculation_equals_the_slot_cache(tiny, fake, drafter, strategy, mode):
    """Chains are verified by the flash kernel (several new tokens per row, causal);
    trees by SDPA over the "bsgd" pools gathered; the self-drafter adopts the target's
    keys from them."""
    model, arch = tiny["llama_tied"]
    prompts = _prompts((5, 11, 8), seed=4, group=3)
    params = _params(len(prompts), temperature=0.0 if mode == "greedy" else 1.0, base=6)
    cfg = {"sampling_mode": "coupled"} if mode == "coupled" else {}

    def make(kv, att):
        d = random_eagle(arch) if drafter == "eagle" else SelfDrafter()
        return _engine(model, arch, kv, att, d, strategy, max_batch_size=5, **cfg)

    (slots, sdpa, flash), eng = _three(make, prompts, params)
    _assert_same(slots, flash, tol=1e-4)
    _assert_same(sdpa, flash, tol=1e-4)
    assert eng.last_stats.spec.steps > 0
    # flash over fixed slots too (the self-drafter's copy: a "bsgd" slot cache)
    _assert_same(slots, make("slots", "flash").generate(prompts, params), tol=1e-4)
    if strategy == "3_1_3":  # chain verification through the kernel
        assert any(sq > 1 for sq in _paged_calls(fake)[1:])


# ------------------------------------------------------------------------ the config
def test_flash_with_a_block_size_it_does_not_take_names_the_field():
    with pytest.raises(ConfigError, match=r"rollout\.kv_block_size.*multiple of 256"):
        RolloutConfig(kv_cache="paged", attention="flash", kv_block_size=16)
    RolloutConfig(kv_cache="paged", attention="flash", kv_block_size=512)
    RolloutConfig(kv_cache="slots", attention="flash", kv_block_size=16)


def test_auto_picks_sdpa_over_gathered_blocks_below_the_multiple(tiny, monkeypatch):
    use_fake_flash(monkeypatch, page=256)
    model, arch = tiny["llama_tied"]
    small = RolloutEngine(model, None, RolloutConfig(kv_cache="paged", kv_block_size=16),
                          arch=arch, eos_token_ids=[])
    whole = RolloutEngine(model, None, RolloutConfig(kv_cache="paged", kv_block_size=256),
                          arch=arch, eos_token_ids=[])
    slots = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    assert (small.attention, whole.attention, slots.attention) == ("sdpa", "flash", "flash")
