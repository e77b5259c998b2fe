"""Predict TLT's speedup for a layout before running it: a discrete-event simulator of
synchronous RL steps (``sim``) fed by the project's own measurements or a roofline
(``inputs``), checked against our runs and published figures (``validate``).

    from megatron_tlt.planner import predict_for_config
    print("\\n".join(predict_for_config(cfg, world_size).lines()))
"""

from .inputs import (Acceptance, DrafterGroup, LengthModel, StepCost, TrainCost,
                     accept_length, alpha_curve, roofline)
from .report import Prediction, predict
from .sim import EngineSettings, Layout, Scenario, simulate_arm

__all__ = ["Acceptance", "DrafterGroup", "EngineSettings", "Layout", "LengthModel",
           "Prediction", "Scenario", "StepCost", "TrainCost", "accept_length",
           "alpha_curve", "predict", "predict_for_config", "roofline", "simulate_arm"]


def predict_for_config(cfg, world_size: int, **kw) -> Prediction:
    """The prediction for a recipe and world size (``recipe.predict_for_config``: the
    hardware, lengths, acceptance, a measured table and the model's arch may be given)."""
    from .recipe import predict_for_config as _p

    return _p(cfg, world_size, **kw)
