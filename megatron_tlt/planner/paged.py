"""The paged KV cache's capacity: how many rows a token budget keeps in flight.

With ``rollout.kv_cache=paged`` a row holds the blocks of the tokens it has written
(``rollout.kv_block_size`` positions each, the last one partly filled), and a GRPO
group's G rows share their prompt's full blocks (each row copies the partly filled
last one on write). A budget of T tokens per engine keeps about

    rows = T / (expected tokens a row in flight holds)

rows in flight, at most ``rollout.max_batch_size`` and the engine's responses. In a
steady stream of rows (continuous batching), a response of L tokens is in flight for L
steps holding 0..L of them: by Little's law the rows in flight hold, on average,
E[L^2] / (2 E[L]) response tokens each (a long row is in flight longer: the mean is
length-biased), plus half a block of rounding, the prompt's full blocks over G, the
prompt's partial block and the drafts' slack. The lengths are the planner's length
model (default: log-normal, median 20 % of the cap, sigma 0.8, 3 % at the cap).

The dry run (``rl/memory_model.py``, ``rl/kv_budget.py``) and the simulator
(``sim.EngineSettings.kv_tokens``) read the same numbers from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .inputs import LengthModel

# What a recipe does not say about its lengths (the planner's defaults, docs/planning.md)
DEFAULT_MEDIAN_FRACTION = 0.2  # median response = 20 % of max_new_tokens (reasoning RL)
DEFAULT_TRUNCATED = 0.03  # 3 % of responses reach max_new_tokens
DEFAULT_SIGMA = 0.8
DEFAULT_PROMPT_TOKENS = 256.0
_SAMPLE = 16384  # lengths drawn (seeded) for the moments of a length model


def default_lengths(cap: int) -> LengthModel:
    """The planner's default response lengths for a cap of ``cap`` new tokens."""
    return LengthModel(cap=cap, median=DEFAULT_MEDIAN_FRACTION * cap, sigma=DEFAULT_SIGMA,
                       cap_fraction=DEFAULT_TRUNCATED,
                       source=f"log-normal, median {DEFAULT_MEDIAN_FRACTION:.0%} of "
                       f"{cap}, sigma {DEFAULT_SIGMA}, {DEFAULT_TRUNCATED:.0%} at the cap "
                       "(assumed; pass a run's metrics.jsonl to replace it)")


def typical_prompt(max_prompt_tokens: int) -> float:
    """The prompt length a prediction assumes (a recipe gives only the cap)."""
    return min(float(max_prompt_tokens), DEFAULT_PROMPT_TOKENS)


def held_response_tokens(lengths: LengthModel) -> float:
    """E[L^2] / (2 E[L]) + 1/2: the response tokens a row in flight holds on average
    (the first token comes with the prefill)."""
    if lengths.sample:
        x = np.asarray(lengths.sample, dtype=float)
    else:
        x = lengths.draw(_SAMPLE, np.random.default_rng(0))
    return float((x * x).mean() / (2 * x.mean()) + 0.5)


def held_tokens_per_row(lengths: LengthModel, *, prompt_tokens: float, group_size: int,
                        block: int, slack: int = 0) -> float:
    """Tokens (positions) a row in flight holds on average in a paged cache: its share
    of the group's full prompt blocks, its copy of the prompt's partly filled block,
    its response tokens rounded up to blocks, and the drafts' slack."""
    full = math.floor(prompt_tokens / block) * block
    partial = prompt_tokens - full
    return full / max(group_size, 1) + partial + held_response_tokens(lengths) \
        + block / 2 + slack


@dataclass(frozen=True)
class PagedPlan:
    """A paged engine's budget and what it holds: ``tokens`` positions, ``rows`` in
    flight, ``held`` positions per row on average, ``block`` positions per block."""

    tokens: float
    rows: int
    held: float
    block: int
    limited_by: str  # "budget" | "max_batch_size" | "responses"


def plan(*, budget_tokens: float, lengths: LengthModel, prompt_tokens: float,
         group_size: int, block: int, max_rows: int, responses: int,
         slack: int = 0) -> PagedPlan:
    """Rows in flight for a budget of ``budget_tokens`` positions: min(``max_rows``,
    ``responses``, budget / tokens held per row), at least one."""
    held = held_tokens_per_row(lengths, prompt_tokens=prompt_tokens,
                               group_size=group_size, block=block, slack=slack)
    fit = int(budget_tokens // held)
    cands = {"budget": fit, "max_batch_size": max_rows, "responses": max(responses, 1)}
    why = min(cands, key=lambda k: (cands[k], k != "budget"))
    return PagedPlan(float(budget_tokens), max(1, cands[why]), held, block, why)


def min_budget_tokens(max_prompt_tokens: int, block: int, slack: int = 0) -> int:
    """The smallest budget that admits one row of the longest prompt and its first
    token (and the drafts' slack): whole blocks."""
    return -(-(max_prompt_tokens + 1 + slack) // block) * block


def token_bytes(arch, *, tp: int, layers: int, dtype_bytes: int,
                moe_layers: Optional[int] = None, route_bytes: int = 2) -> int:
    """Bytes one cached position costs on one TP rank over ``layers`` layers: the
    target's K and V and, for a mixture-of-experts model, its ``moe_layers`` x top-k
    expert routes (``route_bytes`` each, int16)."""
    from ..rollout.kv_cache import kv_bytes

    kv = kv_bytes(num_layers=layers, rows=1, kv_heads=max(arch.num_query_groups // tp, 1),
                  capacity=1, head_dim=arch.kv_channels, itemsize=dtype_bytes)
    routes = (moe_layers or 0) * arch.moe_topk * route_bytes if arch.is_moe else 0
    return kv + routes


@dataclass(frozen=True)
class PagedEngines:
    """A replica's paged engines (``for_config``): ``engines`` per replica (PP with the
    gathered rollout, else 1), each with ``plan``'s budget and rows; ``token_bytes``
    per cached position on one GPU; ``budget_bytes`` per GPU (``rollout.kv_cache_gib``:
    the drafters' paged caches, ``draft_bytes``, inside it); ``replica_rows`` the
    replica's (the EP group's at EP > 1) rows in flight over its engines."""

    plan: PagedPlan
    engines: int
    token_bytes: int
    budget_bytes: float
    replica_rows: int
    min_tokens: int
    from_config: bool  # the budget is rollout.kv_cache_gib (else max_batch_size slots')
    # the drafters' own paged caches per GPU (``drafters.paged_kv_bytes``): inside a
    # configured budget (the target's positions are what is left), beside the slots'
    draft_bytes: int = 0


def for_config(cfg, arch, world_size: int, *, lengths: Optional[LengthModel] = None,
               kv_gib: Optional[float] = None, dtype_bytes: Optional[int] = None
               ) -> PagedEngines:
    """The paged engines of ``cfg`` on ``world_size`` ranks: the target's budget is
    ``kv_gib`` (GiB per GPU), else ``rollout.kv_cache_gib``, less the drafters' own
    paged caches, else (0) what ``max_batch_size`` full-length slots reserve; the rows
    it keeps in flight on ``lengths`` (default: the planner's). The same numbers for
    the dry run and the simulator."""
    from ..models.sizes import stage_layers
    from ..rollout.speculative import drafters

    r, g, par = cfg.rollout, cfg.grpo, cfg.parallel
    tp, pp, ep = (par.tensor_model_parallel_size, par.pipeline_model_parallel_size,
                  par.expert_model_parallel_size)
    dp = max(world_size // (tp * pp), 1)
    gathered = pp > 1 and r.pipeline_mode == "gathered"
    engines = pp if gathered else 1
    if dtype_bytes is None:
        on_gpu = cfg.platform.device != "cpu"
        dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}.get(
            cfg.model.dtype, 2 if on_gpu else 4)
    layers = arch.num_layers if gathered else arch.num_layers // pp
    moe = len(arch.moe_layers) if gathered else max(
        sum(1 for i in stage_layers(arch, pp, k) if arch.is_moe_layer(i)) for k in range(pp))
    kinds = drafters.configured_kinds(cfg)
    # each position's K and V (and routes), and a feature-fed drafter's features
    tb = token_bytes(arch, tp=tp, layers=layers, dtype_bytes=dtype_bytes, moe_layers=moe) \
        + drafters.paged_feature_bytes(kinds, arch, dtype_bytes=dtype_bytes)
    slack = drafters.configured_slack(kinds, r.speculative)
    capacity = cfg.data.max_prompt_tokens + g.max_new_tokens
    max_rows = -(-r.max_batch_size // engines)
    gib = r.kv_cache_gib if kv_gib is None else kv_gib
    draft = drafters.paged_kv_bytes(kinds, arch, tp=tp, dtype_bytes=dtype_bytes,
                                    rows=max_rows, threshold=r.speculative.threshold,
                                    capacity=capacity, slack=slack,
                                    block_size=r.kv_block_size)
    budget = gib * 2 ** 30 if gib > 0 else max_rows * (capacity + slack) * tb
    target = max(0.0, budget - draft) if gib > 0 else budget
    responses = g.prompts_per_step * g.group_size // dp * ep
    p = plan(budget_tokens=target / tb, lengths=lengths or default_lengths(g.max_new_tokens),
             prompt_tokens=typical_prompt(cfg.data.max_prompt_tokens),
             group_size=g.group_size, block=r.kv_block_size, max_rows=max_rows,
             responses=-(-responses // engines), slack=slack)
    return PagedEngines(p, engines, tb, budget,
                        min(r.max_batch_size, responses, p.rows * engines),
                        min_budget_tokens(cfg.data.max_prompt_tokens, r.kv_block_size, slack),
                        gib > 0, draft)
