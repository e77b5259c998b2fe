"""Starting a script under torchrun from an entry point (the demo, bench_e2e, bench_drift):
one process per replica on this machine, one thread each unless OMP_NUM_THREADS says
otherwise (in every thread pool: runtime_env.thread_env)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterable

__all__ = ["torchrun"]


def torchrun(tag: str, nproc: int, script: Path | str, args: Iterable, t0: float, *,
             cwd: Path | str) -> int:
    """``torchrun --standalone --nproc_per_node nproc script args`` in ``cwd`` (relative
    paths in ``args`` are read from there); prints the command, prefixed ``[tag]``, and
    the total time since ``t0`` (a ``time.perf_counter()`` reading); returns the exit
    code."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), str(script), *map(str, args)]
    print(f"[{tag}] " + " ".join(cmd[1:]), flush=True)
    from megatron_tlt.runtime_env import thread_env

    # one core per replica, unless OMP_NUM_THREADS says otherwise
    env = thread_env(int(os.environ.get("OMP_NUM_THREADS") or 1))
    r = subprocess.run(cmd, env=env, cwd=cwd)
    print(f"[{tag}] total {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    return r.returncode
