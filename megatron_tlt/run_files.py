"""A run checkpoint's files on disk (``checkpoint.save``): their names, and whether a
folder is one. Names only, so that readers below the checkpoint package (the model
loader's error for a run checkpoint given as ``model.hf_path``) know them too."""

from __future__ import annotations

from pathlib import Path

RUN_FILE = "run.json"
POLICY_DIR = "policy"
DRAFTER_FILE = "drafter.safetensors"
STEP_PREFIX = "step_"


def step_name(step: int) -> str:
    return f"{STEP_PREFIX}{step:07d}"


def is_run_checkpoint(path: str | Path) -> bool:
    """A ``checkpoint.save`` folder (``latest`` or ``step_*`` inside) or one step folder."""
    path = Path(path)
    if not path.is_dir():
        return False
    if (path / RUN_FILE).is_file():
        return True
    return (path / "latest").is_file() or any(p.is_dir() for p in path.glob(STEP_PREFIX + "*"))
