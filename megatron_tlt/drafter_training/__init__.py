"""Drafter training: losses for sampled acceptance, the exact α metric, self-distillation
data, the optimizer loop and the offline warm-up."""

from .alpha import AlphaReport, measure_alpha
from .losses import LOSS_PRESETS, LossConfig, drafter_loss, drafter_pairs
from .trainer import DraftSample, DrafterTrainer, target_features
from .warmup import WarmupConfig, run_warmup

__all__ = ["AlphaReport", "DraftSample", "DrafterTrainer", "LOSS_PRESETS", "LossConfig",
           "WarmupConfig", "drafter_loss", "drafter_pairs", "measure_alpha", "run_warmup",
           "target_features"]
