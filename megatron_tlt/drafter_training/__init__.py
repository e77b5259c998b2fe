"""Drafter training: the EAGLE loss, self-distillation data and the optimizer loop."""

from .trainer import DraftSample, DrafterTrainer, drafter_pairs, target_features

__all__ = ["DraftSample", "DrafterTrainer", "drafter_pairs", "target_features"]
