"""The run's speculative step costs (``rollout.speculative.costs=modelled``), the same
on every rank, before the first rollout.

A fresh run takes global rank 0's table: read from ``rollout.speculative.step_costs``
when that file exists, else calibrated by every rank (``rollout/speculative/
calibrate.py``; the ranks that decode together need each other) and rank 0's
broadcast to all and written to the file. The table is part of every rank's tuner
state, so checkpoints carry it and a resumed run keeps charging what the uninterrupted
run charged (it never re-measures). A copy goes to the run folder (``step_costs.json``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .. import collectives
from ..rollout.speculative.calibrate import (apply, calibrate, kind_tuners, needs_costs,
                                             table_path)
from ..rollout.speculative.step_costs import KindCosts, StepCosts

RUN_FILE = "step_costs.json"


def ensure_run_costs(engine, folder: Optional[Path]) -> Optional[StepCosts]:
    """Every rank's tuners given rank 0's step costs (see the module docstring); the
    table (None: speculation off, or costs=measured)."""
    if engine.tuner is None:
        return None
    need = collectives.broadcast_object(needs_costs(engine.tuner), 0)
    if need:
        path = table_path(engine)
        got = None
        if collectives.rank() == 0 and path.is_file():
            got = StepCosts.load(path).to_dict()
        got = collectives.broadcast_object(got, 0)
        if got is None:  # measured here, once: rank 0's numbers for everyone
            got = collectives.broadcast_object(calibrate(engine).to_dict(), 0)
            if collectives.rank() == 0:
                StepCosts.from_dict(got).save(path)
        table = StepCosts.from_dict(got)
        apply(engine, table)
        engine.spec.pack_weights()  # (as after a calibration: step 1 refreshes nothing)
    else:  # resumed (the checkpoint's costs), or nothing modelled
        costs = {k: t.costs for k, t in kind_tuners(engine.tuner).items()}
        if any(c is None for c in costs.values()):
            return None
        name = engine.spec.active_kind()
        table = StepCosts({k or name: c for k, c in costs.items()}, source="checkpoint")
    if folder is not None and collectives.rank() == 0:
        table.save(Path(folder) / RUN_FILE)
    return table


__all__ = ["ensure_run_costs", "RUN_FILE", "KindCosts"]
