"""Qwen2 / Qwen2.5: Llama with biases on the query, key and value projections."""

from __future__ import annotations

from .base import Family, common_checks, no_sliding_window


def _read(config: dict) -> dict:
    common_checks(config)
    no_sliding_window(config)
    return {"qkv_bias": True}


FAMILY = Family("qwen2", "Qwen2/Qwen2.5", _read)
