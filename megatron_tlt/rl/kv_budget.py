"""The paged KV cache's budget, sized from what the memory model leaves in the rollout.

``propose(cfg, arch, world_size)`` finds the largest ``rollout.kv_cache_gib`` (in steps
of ``STEP_GIB``) whose estimate keeps the rollout phase (and, when the cache is not
released, the update) ``MARGIN_GIB`` under the device's usable memory: every other
rollout term comes from ``memory_model.estimate`` as it stands, so whatever lowers the
rollout phase (``train.offload_during_rollout`` lending it the update's state) raises
the budget without a change here. The budget holds the drafters' own paged caches (a
pool of the rows that speculate, ``planner/paged.for_config``) beside the target's
blocks; the search re-estimates at each budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from . import memory_model
from .memory_model import GIB

MARGIN_GIB = 2.0   # left free beside the budget: the allocator's fragmentation, spikes
STEP_GIB = 0.25    # the proposal's resolution


@dataclass
class Proposal:
    gib: float                   # the proposed rollout.kv_cache_gib (0: nothing fits)
    rows: int                    # rows in flight (the replica's) at it
    held: float                  # positions a row holds on average
    tokens: float                # positions per engine
    limit_gib: float             # the device's usable memory
    estimate: Optional[memory_model.Estimate]  # at the proposal
    limited_by: str = ""         # budget | max_batch_size | responses


def _bound(est: memory_model.Estimate) -> float:
    """What the budget moves: the rollout phase, and the update when the cache stays."""
    s = est.settings
    return est.rollout_total if s.kv_released else max(est.rollout_total, est.update_total)


def propose(cfg, arch, world_size: int, *,
            limit_bytes: float = memory_model.GPU_BYTES * memory_model.GPU_USABLE
            ) -> Proposal:
    """The largest budget that fits (bisection on ``STEP_GIB`` steps; the estimate
    grows with the budget). The budget is rows-limited past the point where every
    response of the replica is in flight: the search stops there too."""
    from ..planner.paged import for_config

    target = limit_bytes - MARGIN_GIB * GIB

    def est(gib: float) -> memory_model.Estimate:
        return memory_model.estimate(cfg, arch, world_size, kv_gib=gib)

    lo, hi = 0, int(limit_bytes / GIB / STEP_GIB)
    # past the budget that holds every row an engine may run, more adds no rows
    pe = for_config(cfg, arch, world_size, kv_gib=STEP_GIB)
    rows = min(-(-cfg.rollout.max_batch_size // pe.engines),
               -(-_responses(cfg, world_size) // pe.engines))
    hi = min(hi, int((pe.plan.held * (rows + 1) * pe.token_bytes + pe.draft_bytes)
                     / GIB / STEP_GIB) + 1)
    best = None
    while lo < hi:  # the largest k in [1, hi] with est(k * STEP) within the target
        mid = (lo + hi + 1) // 2
        try:
            e = est(mid * STEP_GIB)
        except ValueError:  # below one row of the longest prompt
            lo = mid
            continue
        if _bound(e) <= target:
            lo, best = mid, e
        else:
            hi = mid - 1
    gib = lo * STEP_GIB
    if best is None or lo == 0:
        return Proposal(0.0, 0, 0.0, 0.0, limit_bytes / GIB, None)
    s = best.settings
    p = for_config(cfg, arch, world_size, kv_gib=gib).plan
    return Proposal(gib, s.rollout_rows, s.kv_held, s.kv_tokens, limit_bytes / GIB, best,
                    p.limited_by)


def _responses(cfg, world_size: int) -> int:
    par, g = cfg.parallel, cfg.grpo
    dp = max(world_size // (par.tensor_model_parallel_size
                            * par.pipeline_model_parallel_size), 1)
    return g.prompts_per_step * g.group_size // dp * par.expert_model_parallel_size


def report_lines(cfg, arch, world_size: int, est: memory_model.Estimate) -> list[str]:
    """The dry run's lines on the paged cache: the budget in use, the rows it keeps in
    flight, and the proposed rollout.kv_cache_gib."""
    s = est.settings
    if not s.kv_paged:
        return [f"KV cache   : slots (rollout.kv_cache=slots): {s.rollout_rows} rows x "
                f"{s.capacity} positions reserved; rollout.kv_cache=paged holds the rows "
                "in blocks as they are written (python tools/plan_tlt.py --recommend)"]
    if not s.on_gpu:
        return [f"KV cache   : {s.kv_note}"]
    prop = propose(cfg, arch, world_size)
    out = [f"KV cache   : {s.kv_note}; {s.kv_budget_bytes / GIB:.2f} GiB per GPU"]
    if prop.gib:
        out.append(f"proposed   : rollout.kv_cache_gib={prop.gib:g} (what the rollout phase "
                   f"leaves under {prop.limit_gib:.1f} GiB, {MARGIN_GIB:g} GiB kept free): "
                   f"{prop.rows} rows in flight (limited by {prop.limited_by}), rollout "
                   f"total {prop.estimate.rollout_total / GIB:.1f} GiB")
    else:
        out.append("proposed   : no KV budget fits beside the rollout's other terms: "
                   + memory_model.advice(est))
    return out
