"""Llama (and every checkpoint saved as ``model_type: llama``, e.g. SmolLM2)."""

from __future__ import annotations

from .base import Family, common_checks, require


def _read(config: dict) -> dict:
    common_checks(config)
    require(config, not config.get("attention_bias"), "attention_bias",
            "Llama attention biases are not implemented")
    return {"qkv_bias": False}


FAMILY = Family("llama", "Llama", _read)
