"""Qwen3 dense: per-head RMSNorm on queries and keys (before RoPE), an explicit
``head_dim`` (not necessarily hidden / heads), no QKV bias, tied or untied embeddings.

Its one-layer drafter's layer is the target's own layer shape, QK norm and ``head_dim``
included (the rollout's forward runs QK norm for the drafter as for the target, and a
target layer can be copied into it, ``drafter_training.layer_init``)."""

from __future__ import annotations

from .base import Family, common_checks, no_sliding_window, require


def attention(config: dict) -> dict:
    """The Qwen3 attention shared by the dense and the MoE family."""
    common_checks(config)
    no_sliding_window(config)
    require(config, not config.get("attention_bias"), "attention_bias",
            "Qwen3 attention biases are not implemented")
    return {"qkv_bias": False, "qk_layernorm": True}


FAMILY = Family("qwen3", "Qwen3", attention)
