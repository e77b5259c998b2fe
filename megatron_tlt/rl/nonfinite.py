"""NaN / inf rewards and losses: skip the update, report it, stop past a limit.

* A non-finite reward on any replica (a verifier bug, a reward function returning
  NaN) skips the step's whole update on every rank: the ranks agree through the
  data-parallel sum of the bad-reward count, before the first optimizer step.
* A non-finite loss makes the gradients non-finite, and the optimizer skips each
  optimizer step they reach (``rl.policy``: the global gradient norm is checked before
  stepping); the step counts as skipped here.

Either way the step reports ``nonfinite/skipped`` (1 for this step) and
``nonfinite/total`` (this run's count, kept in the checkpoint), warns on the terminal,
and once ``nonfinite/total`` exceeds ``train.max_nonfinite_steps`` the run stops with a
``NonFiniteError`` naming the step and the field to raise. The metrics that decide are
reduced over all replicas (and pipeline stages), so every rank decides the same.
"""

from __future__ import annotations

import math
import warnings
from typing import Sequence

COUNTER = "nonfinite_steps"  # in RunState.extra: survives a resume


class NonFiniteError(RuntimeError):
    """Too many steps with NaN / inf rewards or losses."""


def bad_rewards(samples: Sequence) -> int:
    """How many of this replica's samples have a NaN / inf reward."""
    return sum(1 for s in samples if not math.isfinite(s.reward))


def skipped_update(updates: int, lr: float) -> dict:
    """What ``Trainer._update`` returns for an update that did not run."""
    return {"sums": {}, "maxes": {}, "grad_norm": [], "lr": [lr], "skipped": updates,
            "updates": updates, "loss_scale": 1.0}


def after_step(step: int, metrics: dict, extra: dict, limit: int) -> None:
    """Count and report a step whose reward or loss was not finite (adds the
    ``nonfinite/*`` metrics); raise ``NonFiniteError`` past ``limit`` such steps."""
    bad = [k for k in ("reward/mean", "loss/total")
           if k in metrics and not math.isfinite(metrics[k])]
    total = int(extra.get(COUNTER, 0)) + (1 if bad else 0)
    extra[COUNTER] = total
    metrics["nonfinite/skipped"] = 1 if bad else 0
    metrics["nonfinite/total"] = total
    if not bad:
        return
    what = " and ".join(bad)
    if total > limit:
        raise NonFiniteError(
            f"step {step}: {what} is NaN or inf; {total} such steps in this run, more "
            f"than train.max_nonfinite_steps={limit}. Stopping: check the reward "
            f"function (reward.*) and the learning rate (train.lr), or raise "
            f"train.max_nonfinite_steps to skip more such steps")
    warnings.warn(f"step {step}: {what} is NaN or inf: the update was skipped "
                  f"({total} of train.max_nonfinite_steps={limit} allowed)",
                  RuntimeWarning, stacklevel=2)
