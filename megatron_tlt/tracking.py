"""Where a run's metrics go: a JSONL file, Weights & Biases, the terminal.

Only global rank 0 writes. Metrics are one flat namespace (``reward/mean``,
``timing/rollout``, ``spec/accept_len``, ...); each step is one JSON line with its
``step``; nested values (per-replica timelines, per-bucket acceptance) stay nested in
the JSONL and are flattened for W&B.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

from .fileio import write_text_atomic

WANDB_ID_FILE = "wandb_id.txt"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif isinstance(v, (int, float, bool)) and not isinstance(v, bool):
            out[key] = v
        elif isinstance(v, bool):
            out[key] = int(v)
    return out


def jsonable(v: Any):
    """``v`` with non-finite floats as None, tensors / numpy scalars as numbers and
    dict keys as strings, so ``json.dumps`` writes strict JSON."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if hasattr(v, "item"):
        return jsonable(v.item())
    return v



class Tracker:
    """JSONL + optional W&B + rich progress; a no-op on ranks other than 0.

    It only appends to ``metrics.jsonl`` and adds a W&B folder per attempt: the run
    folder itself (config, what a resume keeps) is ``rl.run_dir``'s job."""

    def __init__(self, cfg, run_dir: Path, *, rank: int, config_dict: dict):
        self.cfg = cfg
        self.enabled = rank == 0
        self.run_dir = Path(run_dir)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.wandb_run = None
        self._wandb_dir: Optional[str] = None
        self._progress = None
        if not self.enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.wandb_project and cfg.wandb_mode != "disabled":
            self.wandb_run = self._start_wandb(config_dict)
            self._wandb_dir = str(Path(self.wandb_run.dir).parent)

    def _start_wandb(self, config_dict: dict):
        """One W&B run per run folder: its id is kept in ``wandb_id.txt``, so a later
        attempt in the folder (a resume) continues it, in a W&B folder of its own."""
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb

        id_file = self.run_dir / WANDB_ID_FILE
        run_id = id_file.read_text().strip() if id_file.is_file() else ""
        if not run_id:
            run_id = secrets.token_hex(4)
            write_text_atomic(id_file, run_id + "\n")
        return wandb.init(project=self.cfg.wandb_project, entity=self.cfg.wandb_entity or None,
                          name=self.run_dir.name, mode=self.cfg.wandb_mode,
                          dir=str(self.run_dir), config=jsonable(config_dict),
                          id=run_id, resume="allow")

    @property
    def wandb_dir(self) -> Optional[str]:
        """The W&B run folder (offline runs: `wandb sync` it), also after close()."""
        return self._wandb_dir

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        # the 1-minute load average beside the time: a CPU run's seconds mean little
        # without how busy the machine was
        record = {"step": step, "time": time.time(), "load_1m": _load_1m(), **metrics}
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(jsonable(record)) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log(_flatten(metrics), step=step)

    def append(self, name: str, record: dict) -> None:
        """One JSON line appended to ``name`` in the run folder (rank 0): records too
        wide for the metrics, e.g. every held-out prompt's result."""
        if self.enabled:
            with open(self.run_dir / name, "a") as f:
                f.write(json.dumps(jsonable(record)) + "\n")

    def info(self, message: str) -> None:
        if self.enabled:
            if self._progress is not None:
                self._progress.console.print(message)
            else:
                print(message, flush=True)

    # ----------------------------------------------------------------- progress
    def start_progress(self, total_steps: int, done: int = 0) -> None:
        if not (self.enabled and self.cfg.progress):
            return
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)

        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(),
                                  MofNCompleteColumn(), TimeElapsedColumn(),
                                  TextColumn("ETA"), TimeRemainingColumn(),
                                  TextColumn("{task.fields[info]}"), transient=False)
        self._progress.start()
        self._steps = self._progress.add_task("RL steps", total=total_steps, completed=done,
                                              info="")
        self._phase = None

    @contextmanager
    def phase(self, name: str, total: Optional[int] = None):
        """A progress line for one phase of a step (rollout, update, ...)."""
        if self._progress is None:
            yield None
            return
        task = self._progress.add_task(f"  {name}", total=total, info="")
        try:
            yield lambda n=1, info="": self._progress.update(task, advance=n, info=info)
        finally:
            self._progress.remove_task(task)

    def step_done(self, info: str = "") -> None:
        if self._progress is not None:
            self._progress.update(self._steps, advance=1, info=info)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


def read_metrics(path: str | Path) -> list[dict]:
    """A run's metrics.jsonl as a list of step records (resumed runs: last record per
    step wins)."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step)]


def _load_1m() -> Optional[float]:
    """The host's 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None
