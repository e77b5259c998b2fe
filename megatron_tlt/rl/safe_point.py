"""Where an RL step may be saved or stopped.

``SafePoints`` holds what these points need: the run state, the saver, the checkpoint
settings, the layout, the run's last step, the stop request (or None) and what must
settle before a snapshot is restored (the drafter group's averaging in flight).

At the end of the step, after the update and its metrics, nothing of the step is half
done: ``end_of_step`` writes the regular checkpoint when one is due (with
``model.json``, the record of the model it was saved from, see ``rl.preflight``) and
then acts on an agreed stop request (``rl.preemption``): a checkpoint unless this
step's was just written, the requeue marker, ``Stopped``. A request that reaches the
end of the last step is not acted on: the run finishes (exit 0), and there is nothing
to requeue.

Inside a step (after the rollout, before the first optimizer step) a stop request
abandons the step instead: ``step_start`` copies, when the step begins, what the step
may change before its first optimizer step and a checkpoint holds (RNG streams, the
sampler's position, counters, the tuner, the drafter, its optimizer and data buffer);
``abandon_if_agreed`` restores that copy once every rank agrees, so the run state is
the end of the last completed step again, checkpoints it and raises ``Stopped``.

With asynchronous saves (``checkpoint.async_save``, ``checkpoint.background``) a save
returns before it is published: ``step_boundary`` publishes a finished one between
steps without waiting; the next save, the end of the last step and a stop request wait
for it (a stop request's own checkpoint is published before ``Stopped``), and
``on_error`` decides what a failing loop does with one still in flight.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Callable, Optional

import torch.distributed as dist

from .. import checkpoint as checkpointing
from . import preflight


class SafePoints:
    """The points of a run where it may be saved or stopped (module docstring)."""

    def __init__(self, state, saver, checkpoint_cfg, layout, *, last_step: int,
                 stop=None, settle: Optional[Callable[[], None]] = None):
        """``state``: the ``checkpoint.RunState``; ``saver``: its ``checkpoint.Saver``;
        ``checkpoint_cfg``: the ``checkpoint`` config section; ``last_step``:
        ``train.steps``; ``stop``: the run's ``preemption.StopRequest`` (None: no stop
        requests); ``settle``: called before a snapshot is restored."""
        self.state = state
        self.saver = saver
        self.cfg = checkpoint_cfg
        self.layout = layout
        self.last_step = last_step
        self.stop = stop
        self.settle = settle

    def save(self, wait: bool = False) -> Path:
        """Checkpoint the run state (``wait``: and publish it before returning, also
        when saves are asynchronous)."""
        meta = self.state.meta

        def published(path: Path) -> None:
            if not dist.is_initialized() or dist.get_rank() == 0:
                preflight.record_model(path, meta)

        path = self.saver.save(self.state, self.cfg.save, self.layout,
                               keep_last=self.cfg.keep_last, published=published)
        if wait:
            self.saver.finalize(blocking=True)
        return path

    def step_boundary(self) -> dict:
        """Between steps (every rank): publish an asynchronous save whose writes have
        finished, without waiting for one that has not; returns the ``checkpoint/*``
        timings of the saves since the last call, for the step's metrics."""
        self.saver.finalize()
        return self.saver.take_metrics()

    def on_error(self, error: BaseException) -> None:
        """The training loop leaves on ``error``: a save in flight is finished and
        published when every rank leaves at this point (an error every rank raises at
        the same point, or a one-rank run), else this rank's writers are stopped and it
        stays unpublished (``checkpoint.background.Saver.close``)."""
        on_error(self.saver, error)

    def _saved(self) -> Optional[Path]:
        """The checkpoint of the current state when ``latest`` already names it (a save
        still in flight is published first)."""
        self.saver.finalize(blocking=True)
        done = Path(self.cfg.save) / checkpointing.store.step_name(self.state.step)
        newest = checkpointing.latest(self.cfg.save)
        return done if newest is not None and newest.resolve() == done.resolve() else None

    def step_start(self) -> Optional[dict]:
        """The copy ``abandon_if_agreed`` restores (None when the run takes no stop
        requests). Every rank calls it when a step begins (the drafter's weights are
        gathered over TP)."""
        if self.stop is None:
            return None
        state = self.state
        snap = state.rank_state()  # fresh RNG states and buffer record lists
        for key in ("sampler", "tuner", "extra", "drafter_group"):
            if snap.get(key) is not None:  # the live objects' own dicts and tensors
                snap[key] = copy.deepcopy(snap[key])
        if state.drafter is not None and state.drafter_group is not None:
            snap["drafter_weights"] = {k: v.clone()
                                       for k, v in state.drafter.own_state().items()}
        return snap

    def abandon_if_agreed(self, snap: Optional[dict]) -> None:
        """An agreement point inside a step: every rank calls it at the same point. When
        any rank has a stop request, restore ``snap`` (``step_start``'s), checkpoint the
        state of the end of the last completed step (unless ``latest`` already holds
        it) and raise ``preemption.Stopped``."""
        stop = self.stop
        if stop is None or snap is None or not stop.agreed():
            return
        state = self.state
        if self.settle is not None:  # an averaging still in flight, then the old state
            self.settle()
        if "drafter_weights" in snap:
            state.drafter.load_own_state(snap["drafter_weights"])
        state.load_rank_state(snap)
        path = None
        if self.cfg.save:
            path = self._saved() or self.save(wait=True)
        raise stop.stop(state.step, path, abandoned=True)

    def end_of_step(self, step: int, due: bool) -> Optional[Path]:
        """Save when ``due``; raise ``preemption.Stopped`` when every rank agrees to
        stop. After the last step, wait until the checkpoint is published."""
        folder = self.cfg.save
        last = step >= self.last_step  # the run ends here anyway: exit 0, no requeue
        path = self.save() if folder and due else None
        if last:
            self.saver.finalize(blocking=True)
        stop = self.stop
        if stop is not None and not last and stop.agreed():
            if folder and path is None:
                path = self.save()
            self.saver.finalize(blocking=True)  # published before the requeue marker
            raise stop.stop(step, path)
        return path

    def resume(self, folder: str | Path) -> Path:
        """Check the checkpoint's recorded model against this run's, then load it."""
        # the folder a resume uses (``latest``, or an older complete one with
        # checkpoint.fallback_to_previous), verified on every rank
        notes: list[str] = []
        chosen = checkpointing.choose(folder,
                                      fallback_to_previous=self.cfg.fallback_to_previous,
                                      notes=notes)
        if notes and (not dist.is_initialized() or dist.get_rank() == 0):
            for n in notes:
                print(f"[checkpoint] {n}", flush=True)
        preflight.check_checkpoint_model(chosen[0], self.state.meta)
        return checkpointing.load(self.state, chosen[0], self.layout, chosen=chosen)


def on_error(saver, error: BaseException) -> None:
    """``SafePoints.on_error`` for ``saver``: publish a save in flight only where every
    rank leaves the loop at this point."""
    from .nonfinite import NonFiniteError
    from .preemption import Stopped

    one_rank = not dist.is_initialized() or dist.get_world_size() == 1
    try:
        saver.close(agreed=one_rank or isinstance(error, (NonFiniteError, Stopped)))
    except Exception as e:  # noqa: BLE001 - ``error`` is the one to report
        print(f"[checkpoint] the save in flight was not published: {e}", file=sys.stderr,
              flush=True)
