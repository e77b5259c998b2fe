"""Rollout: batched KV-cache generation on the megatron-core model being trained."""

from .engine import GenerateStats, PromptError, RolloutEngine, RolloutOutput
from .sampling import SamplingParams, processed_logprobs

__all__ = ["RolloutEngine", "RolloutOutput", "SamplingParams", "GenerateStats",
           "PromptError", "processed_logprobs"]
