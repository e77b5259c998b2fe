"""A pytest plugin (loaded by tests/conftest.py): the CPU seconds each test costs.

``--cpu-durations=N`` lists the N tests that took the most CPU time, user + system, of
the test process and of the processes it started and waited for (torchrun and its
workers, scripts), and of the script runs forked for it (``zygote``: the fork server's
children): ``os.times()`` and ``zygote.cpu_seconds()`` before and after each phase
(setup, call, teardown).
On a machine whose cores are shared, CPU seconds say what a test costs where wall
seconds say how busy the machine was. ``--cpu-json=PATH`` writes every test's figures.
With pytest-xdist each worker measures its own tests and the figures travel to the
controller in the reports' ``user_properties``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import pytest

_KEY = "cpu_s"
_PHASES = pytest.StashKey[dict]()


def pytest_addoption(parser):
    group = parser.getgroup("cpu_clock")
    group.addoption("--cpu-durations", type=int, default=0, metavar="N",
                    help="list the N tests with the most CPU seconds (this process and "
                         "its waited-for children, user + system)")
    group.addoption("--cpu-json", default=None, metavar="PATH",
                    help="write each test's CPU seconds per phase to PATH (JSON)")


def _cpu_now() -> float:
    """This process's and its waited-for children's CPU seconds, and the forked runs'
    (``zygote``: the fork server's children, not this process's)."""
    import zygote

    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + zygote.cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    t0 = _cpu_now()
    yield
    item.stash.setdefault(_PHASES, {})["setup"] = _cpu_now() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    t0 = _cpu_now()
    yield
    item.stash.setdefault(_PHASES, {})["call"] = _cpu_now() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    t0 = _cpu_now()
    yield
    item.stash.setdefault(_PHASES, {})["teardown"] = _cpu_now() - t0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    seconds = item.stash.get(_PHASES, {}).get(call.when)
    if seconds is not None:
        report.user_properties.append((_KEY, round(seconds, 3)))


class _Collector:
    def __init__(self):
        self.by_test: dict[str, dict[str, float]] = defaultdict(dict)

    def pytest_runtest_logreport(self, report):
        for key, value in report.user_properties:
            if key == _KEY:
                self.by_test[report.nodeid][report.when] = value


def pytest_configure(config):
    if config.getoption("cpu_durations") or config.getoption("cpu_json"):
        config.pluginmanager.register(_Collector(), "cpu_clock_collector")


def pytest_terminal_summary(terminalreporter, config):
    collector = config.pluginmanager.get_plugin("cpu_clock_collector")
    if collector is None or hasattr(config, "workerinput"):
        return
    rows = sorted(((sum(p.values()), nodeid, p) for nodeid, p in collector.by_test.items()),
                  reverse=True)
    path = config.getoption("cpu_json")
    if path:
        with open(path, "w") as f:
            json.dump({nodeid: {**p, "total": round(total, 3)} for total, nodeid, p in rows},
                      f, indent=1)
    n = config.getoption("cpu_durations")
    if not n:
        return
    total = sum(r[0] for r in rows)
    terminalreporter.write_sep("=", f"{min(n, len(rows))} tests with the most CPU seconds "
                                    f"(process + children, user + system; all tests "
                                    f"{total:.0f} s)")
    for seconds, nodeid, p in rows[:n]:
        phases = " ".join(f"{k} {v:.1f}" for k, v in p.items() if v >= 0.05)
        terminalreporter.write_line(f"{seconds:8.1f} s  {nodeid}  ({phases})")
