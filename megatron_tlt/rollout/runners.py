"""The engine's runner for this rank's layout: the one place that knows which exist.

The generation loop (``RolloutEngine``) drives a ``ModelRunner`` through its interface
(``extend`` / ``logits`` / ``agree``, and ``run_call`` / ``call_rows`` for how a call's
requests are spread over the pipeline ranks) and never imports a runner module; the
runners import nothing of the engine. Layers point down:

    engine (the generation loop) -> runners -> forward / gathered / pipeline -> outputs
"""

from __future__ import annotations

from ..models.gpt import ModelArch
from .forward import ModelRunner
from .gathered import GatheredRunner
from .pipeline import PipelinedRunner


def make_runner(model, arch: ModelArch, pipeline_mode: str = "gathered") -> ModelRunner:
    """The engine's runner: the whole model at PP = 1; at PP > 1 this stage's share
    (``pipeline_mode="pipelined"``, ``rollout.pipeline``) or the whole model gathered
    from the stages (``"gathered"``, ``rollout.gathered``)."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() > 1:
        if pipeline_mode == "gathered":
            return GatheredRunner(model, arch)
        return PipelinedRunner(model, arch)
    return ModelRunner(model, arch)
