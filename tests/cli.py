"""Running the project's scripts as users do: a subprocess, optionally under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_script(script: str, *args: str, nproc: int = 1,
               timeout: int = 300) -> subprocess.CompletedProcess:
    """``python REPO/script args`` (or ``torchrun --standalone`` for nproc > 1)."""
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
    return subprocess.run([*launcher, str(REPO / script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)
