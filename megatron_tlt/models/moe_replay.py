"""Routing replay: a training forward routes every token to the experts the rollout
chose for it.

An MoE policy's rollout (the engine's forward) and its training forwards (old
log-probs, the update) compute each router's top-k separately: where two experts'
scores are close, bf16 rounding, other kernels or another batch shape flip the choice,
and the token's log-prob differs between the two far more than in a dense model. The
engine records every position's experts (``RolloutOutput.routes``: [positions, MoE
layers, k]); with ``grpo.routing_replay`` the trainer builds its routers with
megatron-core's ``RouterReplay`` (``moe_enable_routing_replay``) and, before each
micro-batch's forward, gives every router its tokens' recorded experts
(``RouterReplayAction.REPLAY_FORWARD``: the router takes those indices and weighs them
with its own scores, so the router weights still get gradients through the chosen
experts' weights). The routers are addressed one by one (``routers``), not through
megatron-core's process-wide list of instances, which also holds other models'.

Layout: a micro-batch's ``routes`` [b, S, MoE layers, k] are aligned with its input
positions; a router sees its layer's tokens sequence-major ([S, b] flattened, this TP
rank's sequence chunk under sequence parallelism). Positions the rollout did not run
(each sequence's last token, padding) carry ``FILLER`` experts: their outputs feed no
log-prob that counts (attention is causal and those positions are masked from the
loss).

Recomputation: at pipeline-parallel size 1 the trainer runs each micro-batch's
backward before the next forward, so a recomputed forward replays the same experts; at
PP > 1 the schedule interleaves micro-batches, and replay is refused with activation
recomputation there (``check``).
"""

from __future__ import annotations

from typing import Optional

import torch

FILLER = -1  # an unrecorded position in ``Sample.routes`` aligned tensors


def routers(model) -> list:
    """(global MoE layer index, TopKRouter) of this stage's MoE layers, in order;
    ``model`` a GPTModel or a wrapper with ``.module``."""
    from megatron.core.transformer.moe.router import TopKRouter

    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    out = []
    for layer in getattr(model, "decoder", model).layers:
        router = getattr(layer.mlp, "router", None)
        if isinstance(router, TopKRouter):
            out.append((layer.layer_number - 1, router))
    return out


def enabled(model) -> bool:
    """Whether ``model``'s routers were built for replay (``moe_enable_routing_replay``)."""
    rs = routers(model)
    return bool(rs) and all(r.router_replay is not None for _, r in rs)


def check(config, arch) -> None:
    """Refuse what replay cannot do for an MoE ``arch``: activation recomputation under
    pipeline parallelism (the schedule recomputes a micro-batch after others were
    given)."""
    from ..config import ConfigError

    if (arch.is_moe and config.grpo.routing_replay
            and config.parallel.pipeline_model_parallel_size > 1
            and config.train.recompute_granularity != "none"):
        raise ConfigError(
            "grpo.routing_replay=true with parallel.pipeline_model_parallel_size > 1 needs "
            "train.recompute_granularity=none (a recomputed forward would replay another "
            "micro-batch's experts); turn recomputation off or grpo.routing_replay=false")


def set_routes(model, routes: Optional[torch.Tensor], moe_layers, *,
               sequence_parallel: bool = False) -> bool:
    """Make every router of ``model`` take the experts ``routes`` [b, S, len(moe_layers),
    k] (``moe_layers``: the model's global MoE layer indices, in the routes' order) for
    its next forwards; ``FILLER`` entries get experts 0..k-1. Returns False (nothing set)
    when ``routes`` is None or the routers were not built for replay."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    rs = routers(model)
    if routes is None or not rs or any(r.router_replay is None for _, r in rs):
        return False
    b, s, _, k = routes.shape
    filler = torch.arange(k, device=routes.device).expand(b, s, k)
    where = {layer: j for j, layer in enumerate(moe_layers)}
    if sequence_parallel:
        from megatron.core import parallel_state as ps

        tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        chunk = s // tp
        routes, filler = (t[:, rank * chunk:(rank + 1) * chunk] for t in (routes, filler))
    for layer, router in rs:
        r = routes[:, :, where[layer]].long()
        r = torch.where(r == FILLER, filler[:, : r.shape[1]], r)
        replay = router.router_replay
        replay.target_topk_idx = r.transpose(0, 1).reshape(-1, k).to(router.weight.device)
        replay.router_replay_action = RouterReplayAction.REPLAY_FORWARD
    return True


def clear(model) -> None:
    """Back to the routers' own top-k."""
    for _, router in routers(model):
        if router.router_replay is not None:
            router.router_replay.clear_indices()
            router.router_replay.clear_router_replay_action()


def aligned(samples, width: int) -> Optional[torch.Tensor]:
    """[len(samples), width, MoE layers, k] int16 of the samples' recorded experts at
    their input positions (``FILLER`` elsewhere), or None unless every sample has
    routes."""
    if not samples or any(getattr(s, "routes", None) is None for s in samples):
        return None
    _, layers, k = samples[0].routes.shape
    out = torch.full((len(samples), width, layers, k), FILLER, dtype=torch.int16)
    for i, s in enumerate(samples):
        n = min(s.routes.shape[0], width)
        out[i, :n] = s.routes[:n]
    return out
