"""tests_gpu under a deadline, with every result kept.

One pytest process runs the files in priority order (``ORDER``) with the
``pytest_stream`` plugin, which appends each test's result to a JSONL file as it
finishes. The runner reads that file while pytest runs:

- a test running longer than ``per_test_s`` is killed with pytest's process tree
  (a hung CUDA call cannot be interrupted from inside), recorded as ``timeout``, and
  pytest starts again on the tests that have no result yet;
- a pytest that dies (a crash in a CUDA library, an ``os._exit``) has its test in
  flight recorded as ``crashed`` and is started again on the rest the same way;
- at the part's deadline the test in flight is recorded as ``killed`` and the tests not
  started as not run: ``run_tests`` can be called again later with those (the check's
  ``tests_gpu_rest`` part uses the time the other parts left).

So a timeout loses only what was in flight. Standard library only.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Optional

from .schedule import kill_tree, log

# most valuable first: the engine against transformers, graphs against eager, bf16 and
# speculation exactness; the FP8 self-drafter (new kernels on each torch release); graphed
# speculation; the collectives on NCCL and the rollout's memory; the memory controls
ORDER = ["test_cuda.py", "test_self_drafter_cuda.py", "test_graphs_spec_cuda.py",
         "test_moe_cuda.py", "test_one_gpu.py", "test_memory_controls_cuda.py"]
PLUGIN = "megatron_tlt.gpu_check.pytest_stream"
MAX_STARTS = 12  # pytest (re)starts per call: each must record at least one result


def ordered_files(folder: Path) -> list[Path]:
    """tests_gpu's test files, ``ORDER`` first, then any other ``test_*.py`` by name."""
    files = sorted(Path(folder).glob("test_*.py"))
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(files, key=lambda p: (rank.get(p.name, len(ORDER)), p.name))


def read_stream(path: Path) -> list[dict]:
    """Every complete line of a stream file (a line cut by a kill is dropped)."""
    out = []
    try:
        text = Path(path).read_text()
    except OSError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _append(path: Path, obj: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")


def _state(lines: list[dict]) -> tuple[list[str], dict[str, dict], Optional[dict]]:
    """(collected node ids in order, final result by node id, the start in flight)."""
    collected: list[str] = []
    seen: set[str] = set()
    results: dict[str, dict] = {}
    current = None
    for x in lines:
        ev = x.get("event")
        if ev == "collected":
            for n in x.get("nodeids", []):
                if n not in seen:
                    seen.add(n)
                    collected.append(n)
        elif ev == "start":
            current = x
        elif ev == "result":
            prev = results.get(x["nodeid"])
            # a failing teardown overrides a passed call; a rerun, a test killed for
            # want of time (not a result: it runs again in the next call)
            if prev is None or prev["outcome"] in ("passed", "skipped", "killed"):
                results[x["nodeid"]] = x
            if current is not None and current["nodeid"] == x["nodeid"]:
                current = None  # (a setup line is written only when the setup did not pass)
    return collected, results, current


def run_tests(py: str, targets: list, deadline: float, *, stream: Path, log_path: Path,
              cwd: Path, env: dict, per_test_s: float, collect_only: bool = False,
              poll_s: float = 0.5) -> list[dict]:
    """pytest on ``targets`` (files or node ids) until every collected test has a result
    or ``deadline`` (``time.monotonic()``) passes; returns the pytest commands' records."""
    env = {**env, "GPU_CHECK_STREAM": str(stream)}
    base = [py, "-m", "pytest", "-p", PLUGIN, "-p", "no:cacheprovider", "-q", "-rs",
            "--continue-on-collection-errors"]
    if collect_only:
        base.append("--collect-only")
    commands: list[dict] = []
    pending: Optional[list[str]] = None
    for _ in range(MAX_STARTS):
        args = [str(t) for t in (targets if pending is None else pending)]
        if not args or deadline - time.monotonic() <= 1:
            break
        offset = len(read_stream(stream))
        rec = {"cmd": " ".join(base + ([f"<{len(args)} tests>"] if pending else args))}
        t0 = time.monotonic()
        log(f"tests_gpu: {rec['cmd']}")
        with open(log_path, "a") as f:
            f.write(f"\n===== tests_gpu: {rec['cmd']}\n")
            f.flush()
            p = subprocess.Popen(base + args, cwd=cwd, env=env, stdout=f,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        killed = None
        while p.poll() is None:
            time.sleep(poll_s)
            _, _, current = _state(read_stream(stream)[offset:])
            now = time.monotonic()
            if now >= deadline:
                kill_tree(p)
                killed = ("killed", "no time left in the part")
            elif current is not None and time.time() - current["t"] > per_test_s:
                kill_tree(p)
                killed = ("timeout", f"over the per-test limit of {per_test_s:.0f} s")
        rec.update(rc=p.returncode, seconds=round(time.monotonic() - t0, 1),
                   timed_out=bool(killed and killed[0] == "killed"))
        commands.append(rec)
        lines = read_stream(stream)
        collected, results, current = _state(lines[offset:])
        if pending is None and not collected:
            rec["error"] = "pytest collected nothing (see the log)"
            break
        if current is not None:  # the test in flight when pytest died or was killed
            outcome, why = killed or ("crashed", f"pytest exited with code {p.returncode} "
                                                 "during this test")
            _append(stream, {"event": "result", "nodeid": current["nodeid"],
                             "outcome": outcome, "when": "runner",
                             "seconds": round(time.time() - current["t"], 1),
                             "message": why})
        elif killed is None and p.returncode not in (0, 1, 5) and collected:
            rec["error"] = f"pytest exited with code {p.returncode} between tests"
        if collect_only or (killed is not None and killed[0] == "killed"):
            break
        _, all_results, _ = _state(read_stream(stream))
        base_ids = collected if pending is None else pending
        left = [n for n in base_ids if n not in all_results]
        if not left or (current is None and len(left) == len(base_ids)):
            break  # all done, or no progress at all (do not loop)
        pending = left
    return commands


def summarize(stream: Path, required: tuple = ()) -> dict:
    """Counts, failures with their messages, skips with their reasons, the tests that
    did not run, and the required tests that were not collected."""
    lines = read_stream(stream)
    collected, results, _ = _state(lines)
    out: dict = {"collected": len(collected),
                 "collection_errors": max((x.get("errors", 0) for x in lines
                                           if x.get("event") == "collected"), default=0)}
    for kind in ("passed", "failed", "error", "skipped", "timeout", "crashed", "killed"):
        out[kind] = sum(1 for r in results.values() if r["outcome"] == kind)
    out["failed_tests"] = {n: f"{r['outcome']}: {r['message']}" for n, r in results.items()
                           if r["outcome"] not in ("passed", "skipped", "killed")}
    out["failed_tests"].update({x["nodeid"]: f"collection error: {x['message']}"
                                for x in lines if x.get("event") == "collect_error"})
    out["skipped_tests"] = {n: r["message"] for n, r in results.items()
                            if r["outcome"] == "skipped"}
    out["not_run"] = [n for n in collected
                      if n not in results or results[n]["outcome"] == "killed"]
    out["seconds_in_tests"] = round(sum(r.get("seconds", 0) for r in results.values()), 1)
    slow = sorted(results.values(), key=lambda r: -r.get("seconds", 0))[:8]
    out["slowest"] = {r["nodeid"]: r.get("seconds", 0) for r in slow}
    names = {n.split("::")[-1].split("[")[0] for n in collected}
    out["missing_required"] = [t for t in required if t not in names]
    return out
