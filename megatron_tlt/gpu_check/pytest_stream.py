"""A pytest plugin that writes each test's result to a JSONL file the moment it is known
(``pytest -p megatron_tlt.gpu_check.pytest_stream``, file ``$GPU_CHECK_STREAM``; without
that variable it does nothing).

Lines (one JSON object each, flushed and synced as written, so a killed pytest loses
only the test in flight):

- ``{"event": "collect_error", "nodeid": file, "message": ...}`` for a file that does not
  import, and ``{"event": "collected", "nodeids": [...], "errors": n}`` once collection
  ends;
- ``{"event": "start", "nodeid": ..., "t": unix time}`` as a test begins;
- ``{"event": "result", "nodeid": ..., "outcome": "passed" | "failed" | "skipped" |
  "error", "when": "setup" | "call" | "teardown", "seconds": ..., "message": ...}``
  for the test's call, and for a setup that did not pass or a teardown that failed.

``tests_run`` reads the file while pytest runs: a test with a start and no result when
pytest dies or is killed was in flight.
"""

from __future__ import annotations

import json
import os
import time

ENV = "GPU_CHECK_STREAM"
MESSAGE_CHARS = 2000


def _write(obj: dict) -> None:
    path = os.environ.get(ENV)
    if not path:
        return
    with open(path, "a") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _message(report) -> str:
    """A skip's reason; a failure's ``E`` lines (the assertion) and its last line."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:MESSAGE_CHARS]
    text = getattr(report, "longreprtext", "") or ""
    lines = text.splitlines()
    picked = [x for x in lines if x.startswith("E ")][:20]
    if lines and (not picked or lines[-1] != picked[-1]):
        picked.append(lines[-1])
    return "\n".join(picked)[-MESSAGE_CHARS:]


def pytest_collection_finish(session) -> None:
    _write({"event": "collected", "nodeids": [i.nodeid for i in session.items],
            "errors": int(getattr(session, "testsfailed", 0) or 0)})


def pytest_collectreport(report) -> None:
    if report.failed:  # a test file that does not import: its tests are never collected
        _write({"event": "collect_error", "nodeid": report.nodeid,
                "message": _message(report)})


def pytest_runtest_logstart(nodeid, location) -> None:
    _write({"event": "start", "nodeid": nodeid, "t": time.time()})


def pytest_runtest_logreport(report) -> None:
    when, outcome = report.when, report.outcome
    if when == "call" or (when == "setup" and outcome != "passed") or (
            when == "teardown" and outcome == "failed"):
        if when != "call" and outcome == "failed":
            outcome = "error"
        _write({"event": "result", "nodeid": report.nodeid, "outcome": outcome, "when": when,
                "seconds": round(float(report.duration), 2), "message": _message(report)})
