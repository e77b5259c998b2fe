"""Model families: one module per Hugging Face ``model_type`` (``base.Family``), and
their registry. A new family is a new module here plus its entry in ``FAMILIES``."""

from __future__ import annotations

from . import llama, qwen2, qwen3, qwen3_moe
from .base import Family, UnsupportedModelError

FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    llama.FAMILY, qwen2.FAMILY, qwen3.FAMILY, qwen3_moe.FAMILY)}


def supported() -> str:
    """'llama (Llama), qwen2 (Qwen2/Qwen2.5), ...' for messages."""
    return ", ".join(f"{f.model_type} ({f.label})" for f in FAMILIES.values())


def family_of(config: dict) -> Family:
    """The family of a config.json dict; an unknown ``model_type`` names every one
    supported."""
    model_type = config.get("model_type")
    if model_type not in FAMILIES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; supported: {supported()}")
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "family_of", "supported"]
