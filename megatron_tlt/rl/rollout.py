"""One replica's rollout: its prompts x group_size samples on the model being trained.

The ``RolloutEngine`` (KV cache, adaptive speculative decoding) runs on the trained
GPTModel's own parameters, the replica's TP ranks and pipeline stages together
(``rollout.pipeline`` at PP > 1).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

from ..rollout import SamplingParams
from ..rollout.engine import RolloutOutput
from ..rollout.sampling import request_seed
from .samples import Sample


@dataclass
class ReplicaRollout:
    samples: list[Sample]
    seconds: float                 # this replica's rollout wall time
    finished_at: float             # seconds after the step started
    generated_tokens: int
    stats: dict = field(default_factory=dict)  # the engine's last_stats.summary()
    started_at: float = 0.0        # seconds after the step started (the generate call)


def sampling_params(grpo_cfg, seed: int, *, hidden: bool = False) -> SamplingParams:
    """A step's rollout settings. The log-probs returned are "tempered" (logits / T,
    no top-k/top-p): the quantity the trainer's old, new and reference forwards
    compute, so ratios, TIS weights and the mismatch metric compare like with like."""
    return SamplingParams(temperature=grpo_cfg.temperature, top_p=grpo_cfg.top_p,
                          top_k=grpo_cfg.top_k, max_new_tokens=grpo_cfg.max_new_tokens,
                          seed=seed, logprobs="tempered", return_hidden_states=hidden)


def sample_seed(seed: int, prompt_index: int, j: int, group_size: int) -> int:
    """Response j of prompt ``prompt_index``'s own seed under the step's ``seed``: the
    same whichever replica generates it and whoever shares its batch, so a rollout
    does not depend on the DP layout (and, with coupled sampling, neither on
    speculation: the same responses token for token)."""
    return request_seed(seed, prompt_index * group_size + j)


def rollout_replica(generate, prompts: Sequence, prompt_indices: Sequence[int],
                    group_size: int, params: SamplingParams, step_start: float,
                    stats_fn=None) -> ReplicaRollout:
    """Generate ``group_size`` responses for each prompt with ``generate`` (the engine's)
    and wrap them as samples, grouped prompt by prompt."""
    ids, owners, seeds = [], [], []
    for p, idx in zip(prompts, prompt_indices):
        for j in range(group_size):
            ids.append(p.token_ids)
            owners.append((p, idx))
            seeds.append(sample_seed(params.seed, idx, j, group_size))
    t0 = time.perf_counter()
    # (called without prompts too: at EP > 1 the group's replicas decode together)
    outs: list[RolloutOutput] = generate(ids, params, request_seeds=seeds)
    seconds = time.perf_counter() - t0
    samples = [Sample(prompt_index=idx, prompt_ids=list(o.prompt_token_ids),
                      response_ids=list(o.token_ids), rollout_logprobs=list(o.logprobs),
                      finish_reason=o.finish_reason, uid=p.uid, routes=o.routes,
                      extra={} if o.hidden_states is None
                      else {"hidden_states": o.hidden_states})  # the drafter group's data
               for o, (p, idx) in zip(outs, owners)]
    return ReplicaRollout(samples, seconds, time.perf_counter() - step_start,
                          sum(len(o.token_ids) for o in outs),
                          stats_fn() if stats_fn is not None and ids else {},
                          t0 - step_start)
