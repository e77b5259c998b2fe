"""The run folder, and the rule that no run destroys another run's records.

    {tracking.output_dir}/{tracking.run_name}/
      config.json                  the first attempt's configuration
      config.resume-1.json, ...    each resumed attempt's
      metrics.jsonl                one JSON line per step, only ever appended to
      metrics.after-step-N.jsonl   records an interrupted attempt wrote past step N, the
                                   step a later attempt resumed from (moved, not deleted)
      summary.json, *.png          rewritten atomically at the end of each attempt
      wandb/                       one folder per attempt (W&B offline-run-...), all with
                                   the run's W&B id (wandb_id.txt), so a resumed attempt
                                   continues the same W&B run

A new run (``checkpoint.load`` empty) whose folder already holds files stops with an
error naming the folder and the ways on (``tracking.on_existing_run=error``, the
default), or writes ``{run_name}-1`` (then ``-2``, ...) instead (``new_version``).
A run named by its start time (no ``tracking.run_name``) always takes a versioned name
on a clash. A resumed run writes into ``{run_name}`` itself.

The folder is decided twice: ``choose`` reads the file system only and runs on every
rank before the model is loaded (a clash fails in seconds); ``open_run`` runs on rank 0
after every other check has passed (model, tokenizer, data, checkpoint), and is the
first thing that writes.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

from ..config import ConfigError, TrackingConfig
from ..fileio import write_bytes_atomic, write_text_atomic
from ..tracking import jsonable

METRICS = "metrics.jsonl"


def holds_run(folder: Path) -> bool:
    """Whether ``folder`` exists and is not an empty directory."""
    folder = Path(folder)
    if not folder.exists():
        return False
    return not folder.is_dir() or any(folder.iterdir())


def choose(cfg: TrackingConfig, name: str, *, resume: bool) -> Path:
    """The folder a run named ``name`` writes, decided without touching anything.

    Raises:
        ConfigError: a new run whose folder holds files, with
            ``tracking.on_existing_run=error`` and an explicit ``tracking.run_name``.
    """
    base = Path(cfg.output_dir).expanduser() / name
    if base.exists() and not base.is_dir():
        raise ConfigError(f"the run folder {base} is a file; choose another "
                          f"tracking.run_name or tracking.output_dir")
    if resume or not holds_run(base):
        return base
    versions = (base.with_name(f"{base.name}-{k}") for k in itertools.count(1))
    if cfg.on_existing_run == "error" and cfg.run_name:
        spare = next(p for p in versions if not holds_run(p))
        raise ConfigError(
            f"the run folder {base} already holds a run ({_listing(base)}); nothing was "
            f"written. Choose another tracking.run_name, set "
            f"tracking.on_existing_run=new_version to write {spare} instead, resume that "
            f"run with checkpoint.load=<its checkpoint.save folder>, or move {base} away")
    return next(p for p in versions if not holds_run(p))


@dataclass
class OpenedRun:
    """What ``open_run`` decided and wrote."""

    path: Path                      # the run folder
    config_file: Path               # this attempt's config (config.json, config.resume-K.json)
    set_aside: Optional[Path]       # where records past the resumed step went, if any

    def describe(self, requested: Path) -> str:
        """One line for the log: the folder, and anything that was not plain."""
        line = f"run folder {self.path}"
        if self.path != requested:
            line += f" ({requested} already holds a run)"
        if self.config_file.name != "config.json":
            line += f"; this attempt's config: {self.config_file.name}"
        if self.set_aside is not None:
            line += f"; records past the resumed step moved to {self.set_aside.name}"
        return line


def open_run(cfg: TrackingConfig, name: str, *, resumed_step: Optional[int],
             config: dict) -> OpenedRun:
    """Create (or, resuming, reuse) the run folder and write this attempt's config.

    ``resumed_step``: the step a resumed run continues after (None for a new run);
    the metrics past it are moved aside so the file holds every step once.
    """
    path = choose(cfg, name, resume=resumed_step is not None)
    path.mkdir(parents=True, exist_ok=True)
    aside = set_aside_after(path / METRICS, resumed_step) if resumed_step is not None \
        else None
    config_file = _first_free(path, itertools.chain(
        ["config.json"], (f"config.resume-{k}.json" for k in itertools.count(1))))
    write_text_atomic(config_file, json.dumps(jsonable(config), indent=1))
    return OpenedRun(path, config_file, aside)


def set_aside_after(metrics: Path, step: int) -> Optional[Path]:
    """Move the records of ``metrics`` past ``step``, and any line that is not a whole
    record (a write cut short by a crash), to ``metrics.after-step-{step}.jsonl`` (or
    ``.2.jsonl``, ...); the rest stays in ``metrics`` in order. Returns the side file,
    or None when nothing had to move.

    The side file is complete on disk before ``metrics`` is replaced (both atomically),
    so a crash in between leaves a record in both files, never in neither.
    """
    metrics = Path(metrics)
    if not metrics.is_file():
        return None
    data = metrics.read_bytes()
    keep, move = [], []
    for line in data.splitlines(keepends=True):
        s = _step_of(line)
        if s is not None and s <= step:
            keep.append(line if line.endswith(b"\n") else line + b"\n")
        elif line.strip():
            move.append(line)
    kept = b"".join(keep)
    aside = None
    if move:
        stem = f"metrics.after-step-{step}"
        aside = _first_free(metrics.parent, itertools.chain(
            [f"{stem}.jsonl"], (f"{stem}.{k}.jsonl" for k in itertools.count(2))))
        write_bytes_atomic(aside, b"".join(move))
    if kept != data:
        write_bytes_atomic(metrics, kept)
    return aside


def _step_of(line: bytes) -> Optional[int]:
    """The step of a whole JSON record; None for a torn or foreign line."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def _first_free(folder: Path, names: Iterable[str]) -> Path:
    """``folder / name`` for the first of ``names`` that does not exist."""
    return next(folder / n for n in names if not (folder / n).exists())


def _listing(folder: Path, limit: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir())
    return ", ".join(names[:limit]) + (", ..." if len(names) > limit else "")
