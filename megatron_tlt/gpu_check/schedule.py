"""The GPU check's parts under one wall deadline.

A lent GPU machine runs one command for at most 10 minutes and returns only what is in
``$OUT`` when it ends, so the check runs its parts in priority order against a single
deadline (``--deadline``, seconds from the start) and never lets the machine's own limit
cut it off:

- a part is started only when at least its ``min_s`` remain (else it is recorded as
  ``skipped`` with the reason "no time left", and the next, cheaper part may still fit);
- a started part gets ``min(cap_s, time left)``: each of its commands runs in a new
  process group; when that time is up the group and every descendant of the command
  (torchrun's workers, which run in sessions of their own, included) are killed (TERM,
  then KILL), so the GPU is never left busy and a hung part costs only its own time;
- ``gpu_check.json`` is rewritten when a part starts (as ``running``) and when it ends,
  so a result folder cut off anywhere still says what ran, what passed, and what was in
  flight.

Standard library only (and the package's ``fileio``); the process tree is read from
``/proc`` (Linux).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional

from ..fileio import write_text_atomic

RESERVE_S = 5.0  # kept back from the deadline for the last summary
LOG_LIMIT = 12 * 2 ** 20  # gpu_check.log is trimmed (head and tail kept) past this


def log(msg: str) -> None:
    print(f"[gpu-check {datetime.now().strftime('%H:%M:%S')}] {msg}", flush=True)


def _proc_table() -> dict[int, tuple[int, str, str]]:
    """Every live process: pid -> (parent pid, state, start time in clock ticks), read
    from ``/proc/<pid>/stat`` (empty where there is no ``/proc``)."""
    table = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return table
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # (it ended meanwhile)
            continue
        rest = stat[stat.rfind(")") + 2:].split()  # (the command name may hold spaces)
        if len(rest) > 19:
            table[int(name)] = (int(rest[1]), rest[0], rest[19])
    return table


def _descendants(table: dict, roots: list[int]) -> dict[int, str]:
    """The live (not zombie) descendants of ``roots`` in ``table`` (pid -> start time)."""
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(p)
    out: dict[int, str] = {}
    todo = [c for r in roots for c in children.get(r, [])]
    while todo:
        p = todo.pop()
        if p not in out and table[p][1] != "Z":
            out[p] = table[p][2]
            todo += children.get(p, [])
    return out


def process_tree(pid: int) -> dict[int, str]:
    """``pid``'s live descendants (pid -> start time), found through their parents: a
    worker in a session of its own (torchrun starts its workers with
    ``start_new_session``) is outside its launcher's process group but still its
    child."""
    return _descendants(_proc_table(), [pid])


def _alive(tree: dict[int, str]) -> dict[int, str]:
    """The members of ``tree`` still running (the same pid with the same start time, not
    a zombie), with their own descendants started since."""
    table = _proc_table()
    out = {p: start for p, start in tree.items()
           if p in table and table[p][2] == start and table[p][1] != "Z"}
    out.update(_descendants(table, list(out)))
    return out


def _signal_all(pid: int, tree: dict[int, str], sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in tree:
        try:
            os.kill(p, sig)
        except (ProcessLookupError, PermissionError):
            pass


def kill_tree(p: subprocess.Popen, grace_s: float = 5.0) -> None:
    """TERM to ``p``'s process group and to every descendant of ``p`` (those in sessions
    of their own included), ``grace_s`` for all of them to exit, then KILL to whatever is
    left. The tree is read before the first signal: a launcher that exits first leaves
    its workers orphaned, and they are still found by their pid and start time."""
    tree = process_tree(p.pid)
    end = time.monotonic() + grace_s
    _signal_all(p.pid, tree, signal.SIGTERM)
    while time.monotonic() < end:
        if p.poll() is not None and not _alive(tree):
            break
        time.sleep(0.1)
    tree.update(process_tree(p.pid) if p.poll() is None else {})
    left = _alive(tree)
    if p.poll() is None or left:
        _signal_all(p.pid, left, signal.SIGKILL)
    try:
        p.wait(timeout=10.0)
    except subprocess.TimeoutExpired:
        pass
    end = time.monotonic() + 5.0
    while _alive(left) and time.monotonic() < end:  # (KILL is not refused: a moment)
        time.sleep(0.05)


def run_command(name: str, cmd: list, deadline: float, *, log_path: Path, cwd: Path,
                env: dict, output: Optional[Path] = None) -> dict:
    """``cmd`` in a new process group until ``deadline`` (``time.monotonic()``); its output
    is appended to ``output`` (default: the log). Returns the command's record:
    ``cmd``, ``rc``, ``seconds``, ``timed_out``."""
    rec = {"cmd": " ".join(map(str, cmd))}
    left = deadline - time.monotonic()
    if left <= 0:
        return {**rec, "rc": None, "seconds": 0.0, "timed_out": True}
    log(f"{name}: {rec['cmd']}")
    t0 = time.monotonic()
    with open(output or log_path, "a") as f:
        f.write(f"\n===== {name}: {rec['cmd']}\n")
        f.flush()
        p = subprocess.Popen(list(map(str, cmd)), cwd=cwd, env=env, stdout=f,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rec["rc"] = p.wait(timeout=left)
            rec["timed_out"] = False
        except subprocess.TimeoutExpired:
            kill_tree(p)
            rec.update(rc=p.returncode, timed_out=True)
            f.write(f"\n===== {name}: killed at its time limit\n")
    rec["seconds"] = round(time.monotonic() - t0, 1)
    return rec


@dataclass
class Part:
    """One part of the check. ``fn(deadline) -> (status, result, commands)``; ``cap_s``:
    the most seconds it may take; ``min_s``: the fewest worth starting it with."""

    name: str
    fn: Callable[[float], tuple]
    cap_s: float
    min_s: float


class Schedule:
    """Runs parts in order before ``deadline_s`` from its creation and writes the summary
    (``summary(parts) -> dict``, written as ``out/gpu_check.json``) after every change."""

    def __init__(self, deadline_s: float, out: Path, summary: Callable[[dict, bool], dict],
                 log_path: Optional[Path] = None):
        self.t0 = time.monotonic()
        self.deadline_s = float(deadline_s)
        self.deadline = self.t0 + self.deadline_s
        self.out = Path(out)
        self.summary = summary
        self.log_path = log_path
        self.parts: dict[str, dict] = {}

    def left(self) -> float:
        """Seconds a part may still use (the reserve for the summary held back)."""
        return self.deadline - RESERVE_S - time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def write(self, final: bool = False) -> dict:
        if self.log_path is not None:
            trim_log(self.log_path)
        s = self.summary(self.parts, final)
        s.update(deadline_s=self.deadline_s, elapsed_s=round(self.elapsed(), 1))
        # never a half-written summary
        write_text_atomic(self.out / "gpu_check.json", json.dumps(s, indent=1, default=str))
        return s

    def run(self, part: Part) -> dict:
        left = self.left()
        if left < part.min_s:
            rec = {"status": "skipped", "seconds": 0.0, "limit_s": 0.0, "cap_s": part.cap_s,
                   "started_at_s": round(self.elapsed(), 1), "timed_out": False,
                   "no_time_left": True, "commands": [],
                   "result": {"reason": f"no time left: {max(left, 0):.0f} s of the "
                                        f"deadline remain, the part needs {part.min_s:.0f} s"}}
            self.parts[part.name] = rec
            log(f"part {part.name}: skipped: no time left ({max(left, 0):.0f} s)")
            self.write()
            return rec
        limit = min(part.cap_s, left)
        start = time.monotonic()
        self.parts[part.name] = {"status": "running", "limit_s": round(limit, 1),
                                 "cap_s": part.cap_s,
                                 "started_at_s": round(self.elapsed(), 1)}
        self.write()
        log(f"part {part.name} (limit {limit:.0f} s, {self.left():.0f} s of the deadline left)")
        try:
            status, result, cmds = part.fn(start + limit)
        except Exception as e:  # noqa: BLE001 - a broken part is recorded, the rest run
            status, result, cmds = "failed", {"error": f"{type(e).__name__}: {e}"}, []
        seconds = time.monotonic() - start
        timed_out = any(c.get("timed_out") for c in cmds)
        if timed_out and status != "failed":  # (a failure found before the cut stays one)
            status = "timeout"
        rec = {**self.parts[part.name], "status": status, "seconds": round(seconds, 1),
               "timed_out": timed_out, "commands": cmds, "result": result}
        self.parts[part.name] = rec
        log(f"part {part.name}: {status} in {seconds:.1f} s")
        self.write()
        return rec


def trim_log(path: Path, limit: int = LOG_LIMIT) -> None:
    """Keep a log under ``limit`` bytes (one returned file is at most 16 MiB): its first
    MiB and its last ``limit`` - 2 MiB, with a line saying what was cut."""
    try:
        size = path.stat().st_size
    except OSError:
        return
    if size <= limit:
        return
    with open(path, "rb") as f:
        head = f.read(2 ** 20)
        f.seek(size - (limit - 2 * 2 ** 20))
        tail = f.read()
    cut = size - len(head) - len(tail)
    path.write_bytes(head + f"\n===== [{cut} bytes cut]\n".encode() + tail)
