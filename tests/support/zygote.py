"""Script runs forked from a warm interpreter, for the suite's many launches.

Every script a test runs in a new process (a torchrun rank, a tool, the entry point)
starts an interpreter and imports torch, megatron-core and transformers again: about 5
CPU seconds a process on the 2-core development machine, most of a short run's cost.
Here those imports happen once per test process, in a ``multiprocessing`` fork server
that imports ``PRELOAD`` and does nothing else (no threads, no computation, no process
group); every run is a fork of it that becomes the script:

- ``argv``, ``cwd``, the environment (with each rank's ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``, as torchrun sets them), the
  thread count and ``sys.path[0]`` (the script's folder) as ``python script`` has them;
- the script runs as ``__main__`` (``runpy``), then its ``atexit`` functions, and the
  process exits with the script's status (``SystemExit`` as Python handles it, 1 on an
  uncaught exception with its traceback on stderr);
- stdout and stderr go to files read back into a ``CompletedProcess`` (ranks in order);
- a rank that fails stops the others, as torchrun's agent does; a run past its timeout
  is killed with every process it started (each run is its own process group) and
  raises ``subprocess.TimeoutExpired``; what a finished run left running is killed.

A fork differs from a fresh interpreter in one way a test could notice: every run (and
every rank) shares the server's string-hash seed, where fresh ranks each draw their own,
so a set of strings iterates in the same order on every rank. The tests that launch
torchrun itself (below) still run ranks with their own seeds.

What a fork cannot reproduce runs as before (``subprocess``): an environment whose
variables read at import (``IMPORT_TIME``: e.g. ``MEGATRON_TLT_EAGER_IMPORTS``,
``HF_HUB_OFFLINE``, ``HF_HOME``) differ from ``BASELINE``'s (the server's), and
``MEGATRON_TLT_TEST_LAUNCH=subprocess`` turns forking off for a whole run. Tests of
torchrun's own behaviour (signals to the agent, restarts, exit 75) launch torchrun.

CPU seconds: forked runs are the server's children, not the test process's, so
``cpu_seconds()`` reads the server's own user + system time (its imports) and that of
the runs it has reaped (each with the processes it waited for), and
``tests/support/cpu_clock.py`` adds it to each test's figures.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_tlt.runtime_env import THREAD_VARS

# what the project's processes import first (a module missing there is imported by the
# forked run itself, as a fresh process would)
PRELOAD = ["zygote_preload"]
# the variables the preloaded libraries (and the interpreter) read when they are
# imported: a run whose value of one differs from the server's cannot fork (it would see
# the server's). Any other difference (a test's own variable, the NVTE_* switches
# megatron-core sets in a test process for Transformer Engine, which is not preloaded)
# goes to the run as it is. Each run sets its own
# thread counts; TorchInductor, once used in a test process, writes its cache folder's
# default there (a fresh process derives the same).
IMPORT_TIME = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TOKENIZERS", "TORCH", "PYTORCH",
               "MEGATRON", "PYTHON", "CUDA", "NVIDIA", "MPLBACKEND", "MPLCONFIG",
               "WANDB", "LD_", "MALLOC", "KMP_", "GOMP_", "OMP_", "MKL_")
FREE_KEYS = ("PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", *THREAD_VARS)
SWITCH = "MEGATRON_TLT_TEST_LAUNCH"

# the environment runs may fork under: this process's when the module is first imported
# (tests/conftest.py imports it before any test runs, so a test's temporary variables
# never become the server's)
BASELINE = dict(os.environ)
_started = False  # the server runs (under BASELINE)
_server_seen = 0.0  # the server's CPU seconds (its own and its reaped children's)


def enabled() -> bool:
    return os.environ.get(SWITCH, "fork") != "subprocess" and sys.platform == "linux"


def _context():
    """The fork server's context, started (with ``PRELOAD``) on first use."""
    global _started
    import multiprocessing as mp

    ctx = mp.get_context("forkserver")
    if not _started:
        from multiprocessing import forkserver

        _started = True
        current = dict(os.environ)
        ctx.set_forkserver_preload(PRELOAD)
        # the server is a fresh interpreter that does not take this one's sys.path:
        # PYTHONPATH lets it import PRELOAD (tests/support) and the checkout (a run's own
        # sys.path and environment are set in ``_become``)
        here = Path(__file__).resolve().parent
        os.environ.clear()
        os.environ.update(BASELINE)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(here), str(here.parents[1]), *filter(None, [BASELINE.get("PYTHONPATH")])])
        try:
            forkserver.ensure_running()
        finally:
            os.environ.clear()
            os.environ.update(current)
    return ctx


def can_fork(env: dict) -> bool:
    """Whether a run with this environment may fork from the server: every variable read
    at import (``IMPORT_TIME``, but ``FREE_KEYS``) has the server's value."""
    if not enabled():
        return False
    keep = lambda e: {k: v for k, v in e.items()  # noqa: E731
                      if k.upper().startswith(IMPORT_TIME) and k not in FREE_KEYS}
    return keep(env) == keep(BASELINE)


def _server_cpu() -> float:
    """User + system seconds of the fork server and of the runs it has reaped."""
    from multiprocessing import forkserver

    pid = getattr(forkserver._forkserver, "_forkserver_pid", None)
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError, TypeError):
        return 0.0
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def cpu_seconds() -> float:
    """CPU seconds used so far by the server's imports and by the forked runs."""
    global _server_seen
    if _started:
        _server_seen = max(_server_seen, _server_cpu())
    return _server_seen


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _become(script: str, argv: list, env: dict, cwd: str, threads: int,
            out: str, err: str) -> None:
    """In the forked child: become ``python script argv`` and exit with its status."""
    import atexit
    import runpy
    import traceback

    os.setsid()  # its own process group: a timeout kills whatever it started too
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(threads)
    if "numpy" in sys.modules:  # as a fresh process's (``random`` reseeds itself at fork)
        sys.modules["numpy"].random.seed()
    sys.argv = [script, *argv]
    sys.path[:] = [os.path.dirname(os.path.abspath(script))] + [p for p in sys.path if p]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - as the interpreter: print it, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
        os._exit(code)


def run(script: str, argv: list, env: dict, threads: int, nproc: int = 1,
        timeout: float = 300) -> subprocess.CompletedProcess:
    """``python script argv`` (``nproc`` > 1: that many ranks, as torchrun --standalone
    starts them) forked from the warm server, in this process's working folder; the
    ranks' stdout and stderr, in rank order, and the first failing rank's status (0 when
    all succeed)."""
    ctx = _context()
    cwd = os.getcwd()
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="zygote-") as tmp:
        procs = []
        for rank in range(nproc):
            rank_env = dict(env)
            if nproc > 1:
                rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            files = [os.path.join(tmp, f"{rank}.{n}") for n in ("out", "err")]
            p = ctx.Process(target=_become, args=(str(script), list(map(str, argv)),
                                                   rank_env, cwd, threads, *files))
            p.start()
            procs.append((p, files))
        deadline = time.monotonic() + timeout
        failed = None
        while any(p.exitcode is None for p, _ in procs):
            done = [p.exitcode for p, _ in procs if p.exitcode is not None]
            if failed is None and any(done):
                failed = next(c for c in done if c)
                _kill(procs, signal.SIGTERM)  # torchrun's agent stops the other ranks
                deadline = min(deadline, time.monotonic() + 30)
            if time.monotonic() > deadline:
                _kill(procs, signal.SIGKILL)
                for p, _ in procs:
                    p.join(10)
                raise subprocess.TimeoutExpired([str(script), *map(str, argv)], timeout,
                                                output=_read(procs, 0), stderr=_read(procs, 1))
            time.sleep(0.05)
        for p, _ in procs:
            p.join()
        _kill(procs, signal.SIGKILL, finished=True)  # what a run left behind goes with it
        codes = [p.exitcode for p, _ in procs]  # -N: killed by signal N, as subprocess
        rc = failed if failed is not None else next((c for c in codes if c), 0)
        return subprocess.CompletedProcess([str(script), *map(str, argv)], rc,
                                           _read(procs, 0), _read(procs, 1))


def _kill(procs, sig, finished: bool = False) -> None:
    """``sig`` to the process group of each rank still running (``finished``: of each
    rank, whatever it left running)."""
    for p, _ in procs:
        if (finished or p.exitcode is None) and p.pid:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _read(procs, which: int) -> str:
    parts = []
    for _, files in procs:
        try:
            parts.append(Path(files[which]).read_text(errors="replace"))
        except OSError:
            pass
    return "".join(parts)
