"""The reference decoder the engine is checked and measured against.

``recompute_generate`` samples through megatron-core's own ``GPTModel.forward`` (its
pipeline schedule at PP > 1), one sequence at a time, recomputing the whole sequence
for every token: O(length^2) work and no KV cache, but no code shared with the
engine's forward (``rollout.forward`` / ``rollout.pipeline``) beyond the sampling
functions. Tests compare the engine with it; ``tools/bench_rollout.py`` times it.
Training and tools decode through ``RolloutEngine``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..rollout.outputs import RolloutOutput
from ..rollout.sampling import SamplingParams, choose_tokens, own_seed, requested_logprobs


@torch.no_grad()
def recompute_generate(model, arch, eos_token_ids: Sequence[int], context: int,
                       prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                       request_seeds: Optional[Sequence[int]] = None,
                       sampling_mode: str = "standard") -> list[RolloutOutput]:
    """Sampling one sequence at a time, recomputing the full sequence per token through
    megatron-core's own forward (its pipeline schedule at PP > 1; no KV cache). Every
    rank of the model-parallel group calls it with the same arguments and gets the same
    outputs: the last stage samples (``choose_tokens``, per-request streams keyed as
    the engine keys them) and broadcasts each token along the pipeline. Log-probs as
    ``params.logprobs`` asks, as the engine's. ``request_seeds`` and ``sampling_mode``
    as ``RolloutEngine.generate`` and ``rollout.sampling_mode``."""
    from megatron.core import parallel_state as ps

    from .. import collectives

    from ..models.inference import forward_local_logits, gather_logits

    device = next(model.parameters()).device
    pp_group = ps.get_pipeline_model_parallel_group()
    last = ps.get_pipeline_model_parallel_world_size() - 1  # its rank in pp_group
    eos = set(int(t) for t in eos_token_ids)
    seed = params.seed
    if seed is None and request_seeds is None and not params.greedy:
        seed = int(torch.randint(0, 2**62, (1,)).item())  # a fresh draw, as the engine's
    outs = []
    for i, prompt in enumerate(prompts):
        rs = None if params.greedy else own_seed(seed, i, request_seeds)
        coupled = sampling_mode == "coupled" and not params.greedy
        seq = list(prompt)
        tokens, logprobs, reason = [], [], "length"
        while len(tokens) < params.max_new_tokens and len(seq) < context:
            ids = torch.tensor([seq], dtype=torch.long, device=device)
            local = forward_local_logits(model, ids)
            msg = torch.zeros(2, dtype=torch.float64, device=device)
            if local is not None:
                logits = gather_logits(local[:, -1:], arch)[:, -1].float()
                standard = not (params.greedy or coupled)
                tok, raw, proc = choose_tokens(logits, [params],
                                               [(rs, len(tokens)) if standard else None],
                                               coupled=[(rs, len(tokens))] if coupled else None)
                lp = requested_logprobs(logits, tok, [params], raw, proc)
                msg[0], msg[1] = float(tok[0]), float(lp[0])
            collectives.broadcast(msg, last, pp_group)
            tok = int(msg[0])
            tokens.append(tok)
            logprobs.append(float(msg[1]))
            seq.append(tok)
            if tok in eos and not params.ignore_eos:
                reason = "stop"
                break
        outs.append(RolloutOutput(i, list(prompt), tokens, logprobs, reason))
    return outs
