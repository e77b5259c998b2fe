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


def check_speculation(cfg, model_type: str) -> None:
    """Refuse speculative decoding or the drafter group for a family its drafter kinds
    do not draft for yet (their layers have no QK norm or experts)."""
    from ...config import ConfigError

    fam = FAMILIES.get(model_type)
    if fam is None or fam.speculation:
        return
    if cfg.rollout.speculative.drafter or cfg.drafter_group.enable:
        able = ", ".join(f.model_type for f in FAMILIES.values() if f.speculation)
        raise ConfigError(
            f"rollout.speculative.drafter={cfg.rollout.speculative.drafter!r} / "
            f"drafter_group.enable={cfg.drafter_group.enable}: the drafters do not draft "
            f"for {fam.label} ({model_type}) models yet (supported: {able}); set "
            f"rollout.speculative.drafter='' and drafter_group.enable=false")


__all__ = ["FAMILIES", "Family", "UnsupportedModelError", "check_speculation", "family_of",
           "supported"]
