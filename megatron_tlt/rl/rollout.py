"""One replica's rollout: its prompts x group_size samples on the model being trained.

At PP = 1 the ``RolloutEngine`` (KV cache, adaptive speculative decoding) runs on the
trained GPTModel's own parameters, the replica's TP ranks together. At PP > 1 the
stages decode together through megatron-core's pipeline schedule, recomputing the
whole sequence for every token (``pipeline_generate``): correct first, and the same
sampling function and per-request generators as the engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..rollout import SamplingParams
from ..rollout.engine import RolloutOutput
from ..rollout.sampling import own_seed, request_seed, seeded_generator
from .samples import Sample


@dataclass
class ReplicaRollout:
    samples: list[Sample]
    seconds: float                 # this replica's rollout wall time
    finished_at: float             # seconds after the step started
    generated_tokens: int
    stats: dict = field(default_factory=dict)  # the engine's last_stats.summary()


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
    """Generate ``group_size`` responses for each prompt with ``generate`` (the engine's
    or the pipeline's) and wrap them as samples, grouped prompt by prompt."""
    ids, owners, seeds = [], [], []
    for p, idx in zip(prompts, prompt_indices):
        for j in range(group_size):
            ids.append(p.token_ids)
            owners.append((p, idx))
            seeds.append(sample_seed(params.seed, idx, j, group_size))
    t0 = time.perf_counter()
    outs: list[RolloutOutput] = generate(ids, params, request_seeds=seeds) if ids else []
    seconds = time.perf_counter() - t0
    samples = [Sample(prompt_index=idx, prompt_ids=list(o.prompt_token_ids),
                      response_ids=list(o.token_ids), rollout_logprobs=list(o.logprobs),
                      finish_reason=o.finish_reason, uid=p.uid,
                      extra={} if o.hidden_states is None
                      else {"hidden_states": o.hidden_states})  # the drafter group's data
               for o, (p, idx) in zip(outs, owners)]
    return ReplicaRollout(samples, seconds, time.perf_counter() - step_start,
                          sum(len(o.token_ids) for o in outs),
                          stats_fn() if stats_fn is not None and ids else {})


@torch.no_grad()
def pipeline_generate(model, arch, eos_token_ids: Sequence[int], context: int,
                      prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                      request_seeds: Optional[Sequence[int]] = None,
                      sampling_mode: str = "standard") -> list[RolloutOutput]:
    """Sampling through a pipeline-parallel model, one sequence at a time, recomputing
    the full sequence per token (no KV cache). Every rank of the model-parallel group
    calls it with the same arguments and gets the same outputs: the last stage samples
    (``choose_tokens``, per-request generators as the engine seeds them) and broadcasts
    each token along the pipeline. Log-probs as ``params.logprobs`` asks, as the
    engine's.
    ``request_seeds`` and ``sampling_mode`` as ``RolloutEngine.generate`` and
    ``rollout.sampling_mode``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from ..models.inference import forward_local_logits, gather_logits
    from ..rollout.sampling import choose_tokens, requested_logprobs

    device = next(model.parameters()).device
    pp_group = ps.get_pipeline_model_parallel_group()
    last = ps.get_pipeline_model_parallel_last_rank()
    eos = set(int(t) for t in eos_token_ids)
    seed = params.seed
    if seed is None and request_seeds is None and not params.greedy:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # a fresh draw, as the engine's
    outs = []
    for i, prompt in enumerate(prompts):
        rs = None if params.greedy else own_seed(seed, i, request_seeds)
        coupled = sampling_mode == "coupled" and not params.greedy
        gen = None if params.greedy or coupled else seeded_generator(rs, device)
        seq = list(prompt)
        tokens, logprobs, reason = [], [], "length"
        while len(tokens) < params.max_new_tokens and len(seq) < context:
            ids = torch.tensor([seq], dtype=torch.long, device=device)
            local = forward_local_logits(model, ids)
            msg = torch.zeros(2, dtype=torch.float64, device=device)
            if local is not None:
                logits = gather_logits(local[:, -1:], arch)[:, -1].float()
                tok, raw, proc = choose_tokens(logits, [params], [gen],
                                               coupled=[(rs, len(tokens))] if coupled else None)
                lp = requested_logprobs(logits, tok, [params], raw, proc)
                msg[0], msg[1] = float(tok[0]), float(lp[0])
            dist.broadcast(msg, src=last, group=pp_group)
            tok = int(msg[0])
            tokens.append(tok)
            logprobs.append(float(msg[1]))
            seq.append(tok)
            if tok in eos and not params.ignore_eos:
                reason = "stop"
                break
        outs.append(RolloutOutput(i, list(prompt), tokens, logprobs, reason))
    return outs
