"""The paged KV cache in the planner and the dry run: rows in flight from the token
budget and the lengths, the budget the dry run proposes, the recipes' rows against
full-length slots in the same memory, and ``plan_tlt.py --recommend`` on every
shipped recipe (each recommendation passes the dry run's checks and bound)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from megatron_tlt.config import ConfigError, load_config
from megatron_tlt.models.known import architecture
from megatron_tlt.planner import EngineSettings, LengthModel
from megatron_tlt.planner import paged
from megatron_tlt.planner.inputs import StepCost
from megatron_tlt.planner.sim import run_engine
from megatron_tlt.rl import kv_budget, memory_model, recommend

ROOT = Path(__file__).resolve().parents[2]
RECIPES = sorted((ROOT / "examples" / "rl").glob("*.yaml"))
WORLD = {"smollm2_cpu": 2, "qwen2.5_32b_grpo": 64, "qwen3_30b_a3b_grpo": 16}
GIB = 2 ** 30


def _cfg(name, *over):
    return load_config([str(ROOT / "examples" / "rl" / f"{name}.yaml")], list(over))


def test_held_tokens_is_littles_law_and_shares_the_prompt():
    """Constant lengths L: a row holds L/2 (+1/2) response tokens on average; a group
    of G shares its prompt's full blocks (the partial block is each row's)."""
    fixed = LengthModel(cap=1000, sample=(1000,))
    assert paged.held_response_tokens(fixed) == pytest.approx(500.5)
    one = paged.held_tokens_per_row(fixed, prompt_tokens=264, group_size=1, block=16)
    eight = paged.held_tokens_per_row(fixed, prompt_tokens=264, group_size=8, block=16)
    assert one - eight == pytest.approx(256 * 7 / 8)
    # the time average over a simulated stream of rows of these lengths
    rng = np.random.default_rng(1)
    lens = paged.default_lengths(4096).draw(20000, rng)
    held = sum(x * x / 2 for x in lens) / lens.sum()
    model = paged.held_response_tokens(paged.default_lengths(4096))
    assert model == pytest.approx(held + 0.5, rel=0.03)


def test_rows_in_flight_take_the_tightest_bound():
    lm = paged.default_lengths(8192)
    kw = dict(lengths=lm, prompt_tokens=256, group_size=8, block=16)
    held = paged.held_tokens_per_row(**kw)
    p = paged.plan(budget_tokens=100 * held, max_rows=1000, responses=1000, **kw)
    assert (p.rows, p.limited_by) == (100, "budget")
    assert paged.plan(budget_tokens=100 * held, max_rows=60, responses=1000,
                      **kw).limited_by == "max_batch_size"
    assert paged.plan(budget_tokens=100 * held, max_rows=1000, responses=30, **kw).rows == 30


@pytest.mark.parametrize("name,world", [("qwen3_8b_grpo", 8), ("qwen3_30b_a3b_grpo", 16)])
def test_the_recipes_hold_4x_the_rows_in_the_same_memory(name, world):
    """The issue's goal: at the bytes full-length slots reserve (max_batch_size 40 /
    56 as shipped before: the target's KV and routes, the drafter's KV cache and its
    feature store), the paged cache keeps 4x the rows in flight or more, the drafter's
    paged cache and its features inside the same bytes."""
    old = {"qwen3_8b_grpo": 40, "qwen3_30b_a3b_grpo": 56}[name]
    slots = _cfg(name, "rollout.kv_cache=slots", f"rollout.max_batch_size={old}")
    arch = architecture(slots)[0]
    e = memory_model.estimate(slots, arch, world)
    same = sum(e.as_dict().get(t, 0.0) for t in
               ("KV cache", "expert routes (KV)", "drafter KV + features"))
    cfg = _cfg(name, "rollout.kv_cache=paged", f"rollout.kv_cache_gib={same / GIB}")
    p = memory_model.estimate(cfg, arch, world)
    assert e.settings.rollout_rows == old
    assert p.settings.rollout_rows >= 4 * old
    kv = p.as_dict()["KV cache"] + p.as_dict().get("expert routes (KV)", 0.0)
    draft = paged.for_config(cfg, arch, world).draft_bytes
    assert draft > 0  # (the recipes' trained one-layer drafter)
    feats = p.settings.kv_tokens * arch.hidden_size * p.settings.dtype_bytes
    assert kv + feats + draft == pytest.approx(same, rel=1e-6)


def test_a_budget_below_one_row_names_the_field_and_the_minimum():
    cfg = _cfg("qwen3_8b_grpo", "rollout.kv_cache_gib=0.01")
    # (the minimum holds the drafter's paged cache: 32 rows that speculate, 0.56 GiB)
    with pytest.raises(ConfigError, match=r"drafters' paged caches \(0\.56.*"
                                          r"rollout.kv_cache_gib to at least 0\.6"):
        memory_model.estimate(cfg, architecture(cfg)[0], 8)


def test_the_proposal_is_the_largest_budget_that_fits():
    cfg = _cfg("qwen3_8b_grpo", "rollout.max_batch_size=1024")
    arch = architecture(cfg)[0]
    prop = kv_budget.propose(cfg, arch, 8)
    target = memory_model.GPU_BYTES * memory_model.GPU_USABLE - kv_budget.MARGIN_GIB * GIB
    assert prop.gib > 0 and prop.estimate.rollout_total <= target
    over = memory_model.estimate(cfg, arch, 8, kv_gib=prop.gib + kv_budget.STEP_GIB)
    assert over.rollout_total > target
    # what lowers the rest of the rollout phase raises the budget (the same search)
    less = kv_budget.propose(cfg, arch, 8, limit_bytes=target + (kv_budget.MARGIN_GIB - 4)
                             * GIB)
    assert less.gib < prop.gib


def test_the_simulator_admits_while_the_budget_has_room():
    """Paged: a row enters only while the tokens held (a group's prompt once, each row's
    written tokens, half a block) leave room for it; slots: the row bound alone. A
    budget that fits every row's prompt equals the slot engine; a tighter one runs
    more waves, more the tighter it is."""
    lens = np.full(64, 100.0)
    cost = StepCost(batches=(1, 64), seconds=(1.0, 1.0))

    def finish(kv):
        return run_engine(lens, 32.0, cost, EngineSettings(64, 0, kv_tokens=kv), None,
                          group=8).finish

    slots = finish(0.0)
    assert finish(1e9) == pytest.approx(slots)
    assert finish(2000) == pytest.approx(slots)
    assert slots < finish(400) < finish(200)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recommend_on_every_shipped_recipe_passes_the_dry_run(recipe):
    world = WORLD.get(recipe.stem, 8)
    out = recommend.recommend([str(recipe)], [], world, top=2, steps=1, refine=0)
    recs = out["recommendations"]
    assert recs and [r["step_with_tlt_s"] for r in recs] == sorted(
        r["step_with_tlt_s"] for r in recs)
    for r in recs:
        cfg = load_config([str(recipe)], [f"{k}={v}" for k, v in r["overrides"].items()])
        arch = architecture(cfg)[0]
        est = recommend.check(cfg, arch, world)  # raises where the dry run would fail
        assert est.settings.kv_paged and est.settings.rollout_rows == r["rows_in_flight"]
        assert r["reason"]
    assert math.isfinite(out["recipe"]["step_with_tlt_s"])


def test_the_dry_run_prints_the_proposal_and_the_rows():
    from megatron_tlt.rl.plan import dry_run

    text = dry_run(_cfg("qwen3_8b_grpo"), 8)
    assert "proposed   : rollout.kv_cache_gib=" in text
    assert "rows in flight" in text
