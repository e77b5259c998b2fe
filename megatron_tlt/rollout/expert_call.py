"""Rollout at expert parallelism > 1: the replicas of an expert-parallel group decode
their prompts together.

At EP > 1 each rank holds 1/EP of every MoE layer's experts, and an EP group's ranks
are different data-parallel replicas (each with its own prompts). A token's MoE layer
needs experts on every rank of the group, so the group's ranks run every forward
together: each rank gathers the group's requests (prompts, sampling settings and
per-request seeds; small objects), decodes the union as one call, every rank the same
batch, and keeps its own requests' outputs. In each MoE layer a rank computes its own
experts' share for every token of the step and the shares are summed by one
all-reduce over the expert tensor-and-model group (``experts``): per MoE layer and
forward, an all-reduce of [tokens, hidden] in the model dtype, i.e. about
2 x (EP - 1) / EP x tokens x hidden x bytes sent per rank (ring), on top of attention's
TP all-reduces. The rest of the step (embedding, attention, the LM head, sampling) is
computed by every rank of the group on the same rows, and the tokens are agreed from
EP rank 0 (``ModelRunner.agree``), so the ranks' loops take the same decisions.

A request's random stream or coupled-noise key is its own seed, as the replica alone
would have derived it (``request_seeds``, or the call's ``SamplingParams.seed`` and its
index in the replica's call), so outputs do not depend on which requests share the
union. Every rank of the group must call ``generate`` (with no prompts if it has none).
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

from .. import collectives
from .outputs import RolloutOutput
from .sampling import SamplingParams, own_seed


def generate_together(decode: Callable[..., list[RolloutOutput]], group,
                      prompts: Sequence[Sequence[int]], params,
                      request_seeds: Optional[Sequence[int]]) -> list[RolloutOutput]:
    """This rank's requests decoded with the EP group ``group``'s others: the union
    gathered, ``decode(prompts, params, request_seeds=...)`` run on it (the engine's
    ``generate_union``, the same call on every rank of the group), this rank's outputs
    kept."""
    prompts = [list(map(int, p)) for p in prompts]
    plist = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    seeds = [None if sp.greedy or (request_seeds is None and sp.seed is None)
             else own_seed(sp.seed, i, request_seeds) for i, sp in enumerate(plist)]
    parts = collectives.all_gather_object((prompts, plist, seeds), group)
    all_prompts = [p for part in parts for p in part[0]]
    all_params = [sp for part in parts for sp in part[1]]
    all_seeds = [s for part in parts for s in part[2]]
    union_seeds = None
    if all(s is not None or sp.greedy for s, sp in zip(all_seeds, all_params)):
        union_seeds = [0 if s is None else s for s in all_seeds]
    outs = decode(all_prompts, all_params, request_seeds=union_seeds)
    first = sum(len(part[0]) for part in parts[: collectives.rank(group)])
    return [dataclasses.replace(o, index=i)
            for i, o in enumerate(outs[first: first + len(prompts)])]
