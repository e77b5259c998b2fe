"""What a model family is: how one Hugging Face ``model_type`` maps onto the features the
builder, the weight conversion and the rollout engine implement once for every family.

A family reads its config.json fields into ``ModelArch`` fields (``Family.read``) and
refuses, with the field named, whatever those shared features do not cover. Adding a
family is a new module in this package that defines one ``Family`` and its entry in
``families.FAMILIES``.

Features (``ModelArch`` fields a family sets):
  * ``qkv_bias``: biases on the query, key and value projections (Qwen2);
  * ``qk_layernorm``: RMSNorm over each query and key head after the projection and
    before RoPE (Qwen3; megatron-core's ``qk_layernorm``);
  * ``num_experts`` > 0: mixture-of-experts MLPs on the layers ``moe_layers`` (top-k
    routing over softmax scores, ``moe_norm_topk_prob``: the k weights renormalised to
    sum to one; experts of ``moe_ffn_hidden_size``; megatron-core's MoE layer).

The one-layer (EAGLE) drafter of a target of the family is one dense decoder layer of the
target's width and attention; ``Family.drafter_layer`` says which ``ModelArch`` fields
that layer takes instead of the target's (an MoE family: a dense MLP).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


class UnsupportedModelError(ValueError):
    """A Hugging Face config asks for something this project cannot build exactly."""


@dataclass(frozen=True)
class Family:
    """One Hugging Face ``model_type``.

    ``read(config) -> dict``: the family's ``ModelArch`` fields (features and sizes
    that differ between families) from the config.json dict, after checking the fields
    the shared code does not implement; raises ``UnsupportedModelError`` naming them.
    """

    model_type: str
    label: str  # the checkpoints it covers, for messages ("Llama", "Qwen2/Qwen2.5")
    read: Callable[[dict[str, Any]], dict[str, Any]]
    # ``drafter_layer(arch) -> dict``: the ``ModelArch`` fields of the one-layer drafter's
    # decoder layer that differ from the target's (``arch``); {} = the target's own layer
    drafter_layer: Callable[[Any], dict[str, Any]] = lambda arch: {}


def require(config: dict, cond: bool, field: str, why: str) -> None:
    """Raise ``UnsupportedModelError`` naming config.json's ``field`` unless ``cond``."""
    if not cond:
        raise UnsupportedModelError(
            f"config.json: {field}={config.get(field)!r} is not supported ({why}) "
            f"for model_type {config.get('model_type')!r}")


def common_checks(config: dict) -> None:
    """What every family here shares: SiLU-gated MLPs without biases."""
    require(config, config.get("hidden_act", "silu") == "silu", "hidden_act",
            "only 'silu' is implemented")
    require(config, not config.get("mlp_bias"), "mlp_bias", "MLP biases are not implemented")


def no_sliding_window(config: dict) -> None:
    require(config, not config.get("use_sliding_window"), "use_sliding_window",
            "sliding-window attention is not implemented")
