"""tests/support/zygote.py: script runs forked from a warm interpreter behave as
``python script`` (and torchrun's ranks) do, and nothing they start outlives them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest
import zygote

pytestmark = pytest.mark.skipif(not zygote.enabled(), reason="forked runs are off here")

PROBE = """
import atexit, os, sys
print("preloaded", "torch" in sys.modules and "megatron.core" in sys.modules)
import torch
print("argv", sys.argv[1:], "cwd", os.getcwd(), "path0", sys.path[0])
print("threads", torch.get_num_threads(), os.environ["OMP_NUM_THREADS"])
print("main", __name__, os.path.basename(__file__))
atexit.register(lambda: print("atexit ran"))
print("to stderr", file=sys.stderr)
how = sys.argv[1]
if how == "code":
    sys.exit(3)
if how == "message":
    sys.exit("a message")
if how == "raise":
    raise ValueError("boom")
"""


def _script(tmp_path, name: str, body: str):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_a_forked_run_is_what_python_script_is(tmp_path, monkeypatch):
    script = _script(tmp_path, "probe.py", PROBE)
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    forked = zygote.run(script, ["ok"], env, threads=1)
    fresh = subprocess.run([sys.executable, str(script), "ok"], capture_output=True,
                           text=True, env=env)
    assert forked.returncode == fresh.returncode == 0
    assert forked.stdout.splitlines()[0] == "preloaded True"  # the imports were the server's
    assert fresh.stdout.splitlines()[0] == "preloaded False"
    assert forked.stdout.splitlines()[1:] == fresh.stdout.splitlines()[1:]
    assert "atexit ran" in forked.stdout and "path0 " + str(tmp_path) in forked.stdout
    assert forked.stderr == fresh.stderr == "to stderr\n"
    for how, code, err in (("code", 3, ""), ("message", 1, "a message"),
                           ("raise", 1, "ValueError: boom")):
        forked = zygote.run(script, [how], env, threads=1)
        fresh = subprocess.run([sys.executable, str(script), how], capture_output=True,
                               text=True, env=env)
        assert forked.returncode == fresh.returncode == code, how
        assert err in forked.stderr and err in fresh.stderr, how
        assert "atexit ran" in forked.stdout


def test_ranks_form_a_process_group_and_a_failing_rank_stops_the_others(tmp_path):
    script = _script(tmp_path, "ranks.py", """
        import os, sys, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        print(f"rank {dist.get_rank()} of {dist.get_world_size()} sum {t.item():g}")
        if sys.argv[1] == "fail" and dist.get_rank() == 1:
            sys.exit(5)
        dist.barrier()  # rank 0 would wait here for ever
        dist.destroy_process_group()
        """)
    r = zygote.run(script, ["ok"], dict(os.environ), threads=1, nproc=3)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [f"rank {k} of 3 sum 6" for k in range(3)]
    t0 = time.monotonic()
    r = zygote.run(script, ["fail"], dict(os.environ), threads=1, nproc=2)
    assert r.returncode == 5
    assert time.monotonic() - t0 < 60  # stopped, not left to the collective's timeout


def test_a_run_past_its_timeout_leaves_no_process_behind(tmp_path):
    pids = tmp_path / "pids"
    script = _script(tmp_path, "hang.py", f"""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{child.pid}}")
        time.sleep(300)
        """)
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(script, [], dict(os.environ), threads=1, timeout=15)
    deadline = time.monotonic() + 10
    alive = [int(p) for p in pids.read_text().split()]
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if os.path.exists(f"/proc/{p}")
                 and open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"]
        time.sleep(0.1)
    assert alive == []


def test_forked_runs_cpu_seconds_are_counted(tmp_path):
    script = _script(tmp_path, "busy.py", """
        import time
        t = time.process_time()
        while time.process_time() - t < 1.0:
            pass
        """)
    zygote.run(script, [], dict(os.environ), threads=1)  # the server is up
    before = zygote.cpu_seconds()
    zygote.run(script, [], dict(os.environ), threads=1)
    assert zygote.cpu_seconds() - before >= 1.0


def test_an_environment_the_server_did_not_import_under_runs_in_a_fresh_process(
        tmp_path, monkeypatch):
    env = dict(os.environ)
    assert zygote.can_fork(env)
    assert zygote.can_fork({**env, "OMP_NUM_THREADS": "7"})  # each run sets its threads
    # read at import (the server's value would win): a fresh interpreter
    for key in ("HF_HOME", "HF_HUB_OFFLINE", "MEGATRON_TLT_EAGER_IMPORTS", "PYTHONHASHSEED"):
        assert not zygote.can_fork({**env, key: "1"}), key
    # a variable nothing reads at import forks, and the run sees it
    assert zygote.can_fork({**env, "A_TESTS_OWN_VARIABLE": "7"})
    script = _script(tmp_path, "env.py", "import os; print(os.environ['A_TESTS_OWN_VARIABLE'])")
    r = zygote.run(script, [], {**env, "A_TESTS_OWN_VARIABLE": "7"}, threads=1)
    assert (r.returncode, r.stdout) == (0, "7\n")
    monkeypatch.setenv(zygote.SWITCH, "subprocess")
    assert not zygote.can_fork(dict(os.environ))
