"""Mixture-of-experts metrics of the policy update: each MoE layer's expert load and
megatron-core's load-balancing loss.

``ExpertLoad`` counts, over the training forwards while it is attached (forward hooks
on the routers; device tensors, no host read), how many token slots each expert of
each MoE layer received (the routing map's column sums; a micro-batch's padding
positions are routed, and counted, too). ``metrics`` reduces the counts
over the data-parallel and tensor-parallel ranks (under sequence parallelism, which
megatron-core requires for MoE training at TP > 1, each TP rank routes its own chunk of
the sequence) and gathers the pipeline stages' layers, then reports per layer

    moe/load_max/layer{i} = max over experts of (tokens of the expert / mean tokens)

(1 = perfectly balanced; num_experts / k = every token on the same k experts), their
maximum ``moe/load_max``, and, when ``train.moe_aux_loss_coef`` > 0, megatron-core's
load-balancing loss averaged over layers (``moe/aux_loss``, without the coefficient).
No capacity factor is set, so no token is dropped.
"""

from __future__ import annotations

import torch

from .. import collectives
from .moe_replay import routers


class ExpertLoad:
    def __init__(self, model):
        self.counts: dict[int, torch.Tensor] = {}
        self.forwards = 0  # training forwards of the first MoE layer since the last read
        self.hooks = [router.register_forward_hook(self._hook(layer))
                      for layer, router in routers(model)]

    def _hook(self, layer: int):
        def count(module, inputs, output):
            if module.training and torch.is_grad_enabled():
                tokens = output[1].sum(0, dtype=torch.float64).detach()
                prev = self.counts.get(layer)
                self.counts[layer] = tokens if prev is None else prev + tokens
                if layer == min(self.counts):
                    self.forwards += 1
        return count

    def metrics(self) -> dict[str, float]:
        """The load metrics since the last call (collective over DP, TP and PP: every
        rank calls it); empty for a dense model."""
        from megatron.core import parallel_state as ps

        if not self.hooks:
            return {}
        layers = sorted(self.counts)
        if layers:
            stacked = torch.stack([self.counts[i] for i in layers])
            stacked = stacked.to(collectives.device_of(ps.get_data_parallel_group()))
            collectives.all_reduce(stacked, group=ps.get_data_parallel_group())
            if ps.get_tensor_model_parallel_world_size() > 1:
                collectives.all_reduce(stacked, group=ps.get_tensor_model_parallel_group())
            mean = stacked.mean(1, keepdim=True).clamp_min(1e-12)
            ratio = (stacked / mean).max(1).values.tolist()
        mine = {f"moe/load_max/layer{i}": r for i, r in zip(layers, ratio)} if layers else {}
        self.counts = {}
        out: dict[str, float] = {}
        for part in collectives.all_gather_object(mine, ps.get_pipeline_model_parallel_group()):
            out.update(part)
        if out:
            out["moe/load_max"] = max(out.values())
        aux = _aux_loss(self.forwards)
        self.forwards = 0
        if aux is not None:
            total = collectives.sum_values(aux, group=ps.get_data_parallel_group())
            out["moe/aux_loss"] = total[0] / max(total[1], 1.0)
        return out


def _aux_loss(forwards: int):
    """(sum over this rank's training forwards of megatron-core's tracked load-balancing
    loss averaged over the layers that logged it, forwards) since it was last cleared, or
    None without one."""
    from megatron.core.transformer.moe import moe_utils

    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    entry = tracker.get("load_balancing_loss")
    if not entry or entry.get("values") is None:
        return None
    values = entry["values"]
    logged = values[values != 0]
    value = float(logged.mean()) if logged.numel() else 0.0
    moe_utils.clear_aux_losses_tracker()
    return [value, float(forwards)]
