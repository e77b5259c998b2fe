"""The end of an RL step: the one point where the run may be saved or stopped.

After the update and its metrics, nothing of the step is half done: ``end_of_step``
writes the regular checkpoint when one is due (with ``model.json``, the record of the
model it was saved from, see ``rl.preflight``) and then acts on an agreed stop request
(``rl.preemption``): a checkpoint unless this step's was just written, the requeue
marker, ``Stopped``. A request during the last step is not acted on: the run finishes
(exit 0), and there is nothing to requeue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch.distributed as dist

from .. import checkpoint as checkpointing
from . import preflight


def save(trainer) -> Path:
    path = checkpointing.save(trainer.state, trainer.cfg.checkpoint.save, trainer.layout,
                              keep_last=trainer.cfg.checkpoint.keep_last)
    if not dist.is_initialized() or dist.get_rank() == 0:
        preflight.record_model(path, trainer.state.meta)
    return path


def end_of_step(trainer, step: int, due: bool) -> Optional[Path]:
    """Save when ``due``; raise ``preemption.Stopped`` when every rank agrees to stop."""
    folder = trainer.cfg.checkpoint.save
    path = save(trainer) if folder and due else None
    stop = getattr(trainer, "stop", None)
    last = step >= trainer.cfg.train.steps  # the run ends here anyway: exit 0, no requeue
    if stop is not None and not last and stop.agreed():
        if folder and path is None:
            path = save(trainer)
        raise stop.stop(step, path)
    return path


def resume(trainer, folder: str | Path) -> Path:
    """Check the checkpoint's recorded model against this run's, then load it."""
    # the folder a resume uses (``latest``, or an older complete one with
    # checkpoint.fallback_to_previous), verified on every rank
    step_folder, _ = checkpointing.choose(
        folder, fallback_to_previous=trainer.cfg.checkpoint.fallback_to_previous)
    preflight.check_checkpoint_model(step_folder, trainer.state.meta)
    return checkpointing.load(trainer.state, step_folder, trainer.layout)
