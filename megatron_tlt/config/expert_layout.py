"""Checks of ``parallel.expert_model_parallel_size`` against the model and the world."""

from __future__ import annotations

from .base import ConfigError


def check_expert_layout(cfg, arch, world_size: int) -> None:
    """EP must divide the experts and the data-parallel size; > 1 only for an MoE model."""
    ep = cfg.parallel.expert_model_parallel_size
    if ep == 1:
        return
    if not arch.num_experts:
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} needs a mixture-of-experts model; "
            f"{arch.model_type} has no experts: set parallel.expert_model_parallel_size=1")
    if arch.num_experts % ep:
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} does not divide the model's "
            f"{arch.num_experts} experts (num_experts); use a divisor of {arch.num_experts}")
    mp = cfg.parallel.tensor_model_parallel_size * cfg.parallel.pipeline_model_parallel_size
    if world_size % (mp * ep):
        raise ConfigError(
            f"parallel.expert_model_parallel_size={ep} does not divide the data-parallel "
            f"size {world_size // mp} (world size {world_size} / (tensor x pipeline "
            f"parallel {mp})); launch a multiple of {mp * ep} processes")
