"""Qwen3-MoE: Qwen3 attention and mixture-of-experts MLPs.

Routing (transformers' ``Qwen3MoeSparseMoeBlock``): softmax over every expert's router
logit in float32, the top ``num_experts_per_tok``, renormalised to sum to one when
``norm_topk_prob``; each chosen expert is a SiLU-gated MLP of ``moe_intermediate_size``
and the token's output is the weighted sum. Layer i is sparse when it is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; other layers have a
dense MLP of ``intermediate_size``. No shared expert.

The one-layer drafter's layer (``drafter_layer``) is dense: the target's attention (QK
norm, ``head_dim``) and a SwiGLU MLP of ``intermediate_size``, the width of the
family's dense layers, which the released checkpoints set to top-k x
``moe_intermediate_size`` (Qwen3-30B-A3B: 6144 = 8 x 768), i.e. the MLP width a token
meets in an MoE layer. A dense layer because a drafter of a few hundred million
parameters gains nothing from sparsity (one layer's experts would be most of its
weights, all streamed at the batch sizes speculation runs at), it trains on the idle
replicas without expert parallelism or routing, and its decode step is the dense
path of every family; the public EAGLE drafters for Qwen3-MoE are likewise one dense
Llama-style layer. (An ``intermediate_size`` of 0 stands for top-k x
``moe_intermediate_size``.)
"""

from __future__ import annotations

from .base import Family, require
from .qwen3 import attention


def _read(config: dict) -> dict:
    out = attention(config)
    experts = config.get("num_experts", config.get("num_local_experts"))
    require(config, isinstance(experts, int) and experts > 0, "num_experts",
            "a Qwen3-MoE config needs num_experts > 0")
    topk = config.get("num_experts_per_tok")
    require(config, isinstance(topk, int) and 1 <= topk <= experts, "num_experts_per_tok",
            f"top-k must be between 1 and num_experts={experts}")
    step = int(config.get("decoder_sparse_step", 1) or 1)
    require(config, step >= 1, "decoder_sparse_step", "must be >= 1")
    layers = int(config["num_hidden_layers"])
    dense = {int(i) for i in (config.get("mlp_only_layers") or [])}
    require(config, all(0 <= i < layers for i in dense), "mlp_only_layers",
            f"layer indices must lie in [0, {layers})")
    moe_layers = tuple(i for i in range(layers) if i not in dense and (i + 1) % step == 0)
    require(config, bool(moe_layers), "mlp_only_layers",
            "no layer is sparse: load it as model_type qwen3")
    require(config, int(config.get("moe_intermediate_size") or 0) > 0,
            "moe_intermediate_size", "must be > 0")
    require(config, not config.get("shared_expert_intermediate_size"),
            "shared_expert_intermediate_size", "shared experts are not implemented")
    out.update(num_experts=experts, moe_topk=topk,
               moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
               moe_norm_topk_prob=bool(config.get("norm_topk_prob", False)),
               moe_layers=moe_layers)
    return out


def _drafter_layer(arch) -> dict:
    """A dense decoder layer: the target's attention and a SwiGLU MLP of the dense width."""
    width = arch.ffn_hidden_size or arch.moe_topk * arch.moe_ffn_hidden_size
    return dict(ffn_hidden_size=width, num_experts=0, moe_topk=0, moe_ffn_hidden_size=0,
                moe_layers=())


FAMILY = Family("qwen3_moe", "Qwen3-MoE", _read, drafter_layer=_drafter_layer)
