"""Qwen3-MoE: Qwen3 attention and mixture-of-experts MLPs.

Routing (transformers' ``Qwen3MoeSparseMoeBlock``): softmax over every expert's router
logit in float32, the top ``num_experts_per_tok``, renormalised to sum to one when
``norm_topk_prob``; each chosen expert is a SiLU-gated MLP of ``moe_intermediate_size``
and the token's output is the weighted sum. Layer i is sparse when it is not in
``mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``; other layers have a
dense MLP of ``intermediate_size``. No shared expert.
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


FAMILY = Family("qwen3_moe", "Qwen3-MoE", _read, speculation=False)
