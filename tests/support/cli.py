"""Running the project's scripts as users do: a subprocess, optionally under torchrun."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# torchrun's agent checks its workers every 0.1 s by default, CPU it spends for as long as
# they run; once a second is soon enough for a test (a failed rank is noticed and the
# others stopped at most a second later)
TORCHRUN_MONITOR = ["--monitor-interval", "1"]


def run_script(script: str, *args: str, nproc: int = 1, timeout: int = 300,
               torchrun: bool = False) -> subprocess.CompletedProcess:
    """``python REPO/script args`` (for nproc > 1, ``nproc`` ranks as ``torchrun
    --standalone`` starts them), each process with its share of this one's threads
    (``runtime_env.threads_for``). The processes are forks of a warm interpreter
    (``zygote``: the imports paid once per test process) where the environment allows;
    ``torchrun=True`` starts a fresh interpreter (under torchrun's agent for nproc > 1),
    for tests of the launch itself."""
    import zygote
    from megatron_tlt.runtime_env import thread_env, threads_for

    threads = threads_for(nproc)
    env = thread_env(threads)
    if not torchrun and zygote.can_fork(env):
        return zygote.run(REPO / script, list(args), env, threads, nproc=nproc,
                          timeout=timeout)
    launcher = [sys.executable]
    if nproc > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                     *TORCHRUN_MONITOR]
    return subprocess.run([*launcher, str(REPO / script), *map(str, args)],
                          capture_output=True, text=True, timeout=timeout, env=env)


def run_workers(script: str, out: Path, *args: str, nproc: int,
                timeout: int = 600) -> list[dict]:
    """``run_script`` of a torchrun worker that writes ``out/rank{R}.json`` on every rank
    (given ``--out out``); asserts it exited 0 and returns the ranks' results, by rank."""
    import json

    r = run_script(script, *args, "--out", out, nproc=nproc, timeout=timeout)
    assert r.returncode == 0, r.stderr[-4000:]
    return [json.loads((Path(out) / f"rank{k}.json").read_text()) for k in range(nproc)]


def run_main(script: str, *args: str) -> subprocess.CompletedProcess:
    """``main(argv)`` of the entry point ``REPO/script`` in this process (no interpreter
    start-up, imports or model libraries to load again), its exit status, stdout and
    stderr returned as ``run_script`` returns them. For tests that call a script several
    times: one call still goes through ``run_script``, so the command line itself stays
    tested."""
    import contextlib
    import importlib.util
    import io

    path = REPO / script
    spec = importlib.util.spec_from_file_location(f"_entry_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    argv = list(map(str, args))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = module.main(argv)
        except SystemExit as e:  # argparse errors and scripts that exit with a message
            rc = e.code
            if not (rc is None or isinstance(rc, int)):  # SystemExit("message"): as Python does
                print(rc, file=sys.stderr)
                rc = 1
    return subprocess.CompletedProcess([str(path), *argv], rc or 0, out.getvalue(),
                                       err.getvalue())


def forked_fault_inject():
    """``tools/fault_inject.py`` as a module whose ``launch`` goes through ``run_script``
    (forked ranks, see ``zygote``); a launch with ``term`` (a SIGTERM to one rank, the
    preemption path through torchrun's agent) still runs torchrun."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fault_inject",
                                                  REPO / "tools" / "fault_inject.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    original = module.launch

    def launch(args: list[str], *, nproc: int = 2, kill: str = "", term: str = "",
               timeout: int = 900):
        if term:
            return original(args, nproc=nproc, kill=kill, term=term, timeout=timeout)
        return run_script("tools/fault_inject.py", "worker", "--kill", kill, "--term", "",
                          "--", *args, nproc=nproc, timeout=timeout)

    module.launch = launch  # killed_and_resumed and the tests call it through the module
    return module
