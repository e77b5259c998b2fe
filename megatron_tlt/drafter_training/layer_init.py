"""Start a drafter's decoder layer from a copy of one of the target's layers.

The drafter's layer has the target's width, heads and MLP (``DrafterConfig.layer_arch``),
so any target decoder layer's weights fit it. Starting there instead of from small
random weights gives the layer working attention and MLP maps from the first step;
``fc`` (which mixes the token embedding with the target's feature) keeps its own
initialisation. Measured against the random start in docs/benchmarks.md.
"""

from __future__ import annotations

import torch

__all__ = ["copy_target_layer"]


@torch.no_grad()
def copy_target_layer(drafter, model, index: int) -> list[str]:
    """Copy target decoder layer ``index`` (negative: from the end) of ``model`` (a
    megatron-core GPT model, e.g. ``engine.runner.model``) into ``drafter.layer``.
    Returns the names copied; raises ValueError when the layers do not match."""
    layers = model.decoder.layers
    n = len(layers)
    if not -n <= index < n:
        raise ValueError(f"target layer {index} does not exist (the target has {n} "
                         f"layers: use 0..{n - 1} or -1 for the last)")
    src = {k: v for k, v in layers[index].state_dict().items()
           if not k.endswith("_extra_state")}
    dst = drafter.layer.state_dict()
    names = [k for k in dst if not k.endswith("_extra_state")]
    missing = [k for k in names if k not in src or src[k].shape != dst[k].shape]
    if missing:
        raise ValueError(f"target layer {index} does not fit the drafter's layer "
                         f"(missing or other shape: {missing[:4]})")
    for k in names:
        dst[k].copy_(src[k].to(dst[k]))
    return names
