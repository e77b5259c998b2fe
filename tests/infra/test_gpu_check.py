"""`make gpu-check`'s plumbing on CPU (tools/gpu_check.py, megatron_tlt/gpu_check/): the
deadline (a part over its time is killed with its process group, the rest still run
and report, a part with too little time left is skipped), tests_gpu's streamed results
(a hung or crashed test costs only itself), the wheel folder's requirement check, the
summaries, and a smoke run of the check itself."""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from megatron_tlt.gpu_check import first_step, parts, tests_run, wheels
from megatron_tlt.gpu_check.schedule import Part, Schedule, run_command

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _environ_restored():
    """The check sets the hub's offline switches in ``os.environ`` for what it runs; a
    test's check leaves the test process's environment as it found it (the forked
    script runs, tests/support/zygote.py, need the environment they started under)."""
    import os

    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(folder: Path, name: str, requires: list[str], version: str = "1.0") -> Path:
    """A minimal pure-Python wheel (one module) with these Requires-Dist lines."""
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "VALUE = 1\n", f"{info}/METADATA": meta,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def _sleeper(tmp_path: Path) -> tuple[list[str], Path]:
    """A command that sleeps 60 s and has a grandchild that would outlive a plain kill
    (it writes ``marker`` after 3 s unless its process group is killed)."""
    marker = tmp_path / "grandchild_alive"
    child = tmp_path / "child.py"
    child.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w')\n")
    parent = tmp_path / "parent.py"
    parent.write_text(f"import subprocess, sys, time\n"
                      f"subprocess.Popen([sys.executable, {str(child)!r}])\ntime.sleep(60)\n")
    return [sys.executable, str(parent)], marker


def test_manifest_lists_requirements_neither_carried_nor_on_the_gpu_image(tmp_path):
    """The wheel folder's check (make gpu-wheels, and the install part)."""
    _wheel(tmp_path, "alpha", ["numpy>=1", "beta", "typing; python_version < '3.5'",
                               "gamma[x]; extra == 'dev'", "delta_pkg"])
    _wheel(tmp_path, "beta", [])
    m = wheels.manifest(tmp_path)
    # numpy is on the image, beta is carried, the marker and the extra do not apply
    assert m["unmet_requirements"] == {"alpha-1.0-py3-none-any.whl": ["delta_pkg"]}
    assert m["fits"] and m["total_bytes"] == sum(m["files"].values()) > 0
    assert m["smollm2_shape"] is False
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == m


def test_image_requirements_pin_what_the_wheel_folder_carries():
    """requirements-image.txt (make test-image) and the wheel folder pin the same versions."""
    pins = {}
    for line in (REPO / "requirements-image.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.strip().split("==")
            pins[wheels._norm(name)] = version
    for spec in wheels.BINARY_WHEELS + wheels.SDIST_PURE + wheels.SDIST_C:
        name, version = spec.split("==")
        assert pins.get(wheels._norm(name)) == version, spec
    assert pins["torch"] == "2.11.0" and pins["transformers"] == "5.17.0"


def _complete_folder(folder: Path) -> Path:
    """A wheel folder with every pinned package (empty stand-ins) and the shape files."""
    folder.mkdir()
    for spec in wheels.BINARY_WHEELS + wheels.SDIST_PURE:
        name, version = spec.split("==")
        _wheel(folder, name.replace("-", "_"), [], version)
    for spec in wheels.SDIST_C:
        (folder / "{}-{}.tar.gz".format(*spec.split("=="))).write_bytes(b"")
    (folder / "smollm2_shape").mkdir()
    for name in wheels.SHAPE_FILES:
        (folder / "smollm2_shape" / name).write_text("{}")
    return folder


def test_the_folder_check_names_each_missing_piece_and_how_to_make_it(tmp_path):
    folder = _complete_folder(tmp_path / "wheels")
    assert wheels.folder_problems(folder) == []
    (folder / "smollm2_shape" / "tokenizer.json").unlink()
    next(folder.glob("omegaconf-*.whl")).unlink()
    old = next(folder.glob("pytz-*.whl"))
    old.rename(folder / "pytz-2020.1-py3-none-any.whl")
    _wheel(folder, "extra", ["no_such_requirement"])
    problems = wheels.folder_problems(folder)
    assert len(problems) == 4, problems
    text = "\n".join(problems)
    assert "omegaconf==2.4.0 missing" in text and "pytz==2026.6 at 2020.1" in text
    assert "smollm2_shape lacks tokenizer.json" in text
    assert "extra-1.0-py3-none-any.whl requires no_such_requirement" in text
    assert all("make gpu-wheels" in p for p in problems)
    assert "make assets" in problems[2]
    assert wheels.folder_problems(tmp_path / "nowhere")[0].startswith("no wheel folder")


def test_gpu_wheels_without_the_asset_fails_before_downloading(tmp_path):
    """`make gpu-wheels` (tools/wheel_folder.py) on a machine without the prepared
    SmolLM2 asset: exit 1 at once, naming the asset folder and `make assets`, nothing
    downloaded."""
    dest = tmp_path / "gpu_wheels"
    r = subprocess.run([sys.executable, "tools/wheel_folder.py", "--dest", str(dest)],
                       cwd=REPO, capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "PYTHONPATH": str(REPO),
                            "MEGATRON_TLT_CACHE": str(tmp_path / "empty_cache")})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "make assets" in r.stderr and str(tmp_path / "empty_cache") in r.stderr
    assert "config.json" in r.stderr and not dest.exists()


def test_an_incomplete_folder_stops_the_check_before_any_part(gpu_check, tmp_path):
    folder = _complete_folder(tmp_path / "wheels")
    (folder / "smollm2_shape" / "config.json").unlink()
    args = gpu_check.build_parser().parse_args(
        ["--dry", "--wheels", str(folder), "--out", str(tmp_path / "out"), "--work",
         str(tmp_path / "w")])
    assert gpu_check.Check(args).main() == 2
    s = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert s["parts"] == {} and s["finished"] and not s["complete"]
    assert len(s["wheel_folder_problems"]) == 1
    assert "smollm2_shape lacks config.json" in s["wheel_folder_problems"][0]


def test_the_gpu_caps_fit_the_deadline_in_order_of_value(gpu_check):
    """On the GPU the parts' caps add up to no more than the deadline less the
    summary's reserve (tests_gpu_rest takes what the others leave), in order of value:
    CUDA correctness, the GRPO steps, graphed decode step times, then the benches."""
    from megatron_tlt.gpu_check.schedule import RESERVE_S

    plan = gpu_check.PLAN
    caps = sum(cap for name, (cap, _) in plan.items() if name != "tests_gpu_rest")
    assert caps <= gpu_check.DEADLINE_S - RESERVE_S, caps
    assert all(least <= cap for cap, least in plan.values())
    order = list(plan)
    assert order[:4] == ["install", "assets", "tests_gpu", "grpo"]
    assert order.index("bench_rollout") < order.index("bench_spec")
    assert order[-1] == "tests_gpu_rest" and list(gpu_check.DRY_PLAN) == order


def test_a_part_over_its_time_is_killed_and_the_rest_run_and_report(tmp_path):
    """The schedule alone: a part past its cap is killed with its whole process group and
    recorded; the summary was rewritten before the next part started; a later part
    runs; a part that needs more than is left is skipped, not started."""
    out = tmp_path / "out"
    out.mkdir()
    sleeper, marker = _sleeper(tmp_path)
    log = tmp_path / "log"
    sched = Schedule(60, out, lambda p, final: {"parts": p, "finished": final}, log)

    def run(name, cmd):
        return lambda d: ("passed", {}, [run_command(name, cmd, d, log_path=log,
                                                     cwd=tmp_path, env=None)])

    seen = {}

    def second(deadline):
        seen.update(json.loads((out / "gpu_check.json").read_text())["parts"])
        return run("second", [sys.executable, "-c", "print('second ran')"])(deadline)

    t0 = time.monotonic()
    sched.run(Part("slow", run("slow", sleeper), cap_s=2, min_s=1))
    assert time.monotonic() - t0 < 30
    sched.run(Part("second", second, cap_s=30, min_s=1))
    sched.run(Part("greedy", run("greedy", sleeper), cap_s=30, min_s=10_000))
    summary = json.loads((out / "gpu_check.json").read_text())["parts"]
    assert seen["slow"]["status"] == "timeout" and seen["second"]["status"] == "running"
    slow, second_, greedy = summary["slow"], summary["second"], summary["greedy"]
    assert slow["status"] == "timeout" and slow["timed_out"] and slow["limit_s"] == 2
    assert slow["commands"][0]["timed_out"] and 2 <= slow["seconds"] < 30
    assert second_["status"] == "passed" and "second ran" in log.read_text()
    assert greedy["status"] == "skipped" and greedy["no_time_left"]
    assert greedy["result"]["reason"].startswith("no time left")
    time.sleep(4)
    assert not marker.exists()  # the part's whole process group was killed


WORKER = """import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a worker stuck in a CUDA call
if sys.argv[1] == "worker":  # its own child, in yet another session
    subprocess.Popen([sys.executable, __file__, "grandchild", sys.argv[2]],
                     start_new_session=True)
with open(sys.argv[2], "a") as f:
    f.write(f"{os.getpid()} {os.getsid(0)}\\n")
time.sleep(60)
"""
LAUNCHER = """import subprocess, sys, time
# as torchrun starts its workers: each in a session of its own (start_new_session)
subprocess.Popen([sys.executable, sys.argv[1], "worker", sys.argv[2]], start_new_session=True)
time.sleep(60)
"""


def _running(pid: int) -> bool:
    """``pid`` exists and is not a zombie (an orphan killed and not yet reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def test_a_part_that_overruns_leaves_no_process_behind(tmp_path):
    """A launcher whose worker runs in a session of its own (torchrun's way: outside the
    process group the deadline kills) and ignores TERM, and whose worker has a child in a
    third session: when the part's time is up, every one of them is gone."""
    (tmp_path / "worker.py").write_text(WORKER)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    pids = tmp_path / "pids"
    log = tmp_path / "log"
    out = tmp_path / "out"
    out.mkdir()
    sched = Schedule(60, out, lambda p, final: {"parts": p}, log)
    launched = {}

    def part(deadline):
        cmd = [sys.executable, str(tmp_path / "launcher.py"), str(tmp_path / "worker.py"),
               str(pids)]
        return "passed", {}, [run_command("torchrun_like", cmd, deadline, log_path=log,
                                          cwd=tmp_path, env=None)]

    rec = sched.run(Part("overrun", part, cap_s=6, min_s=1))
    assert rec["status"] == "timeout" and rec["commands"][0]["timed_out"]
    rows = [line.split() for line in pids.read_text().splitlines()]
    assert len(rows) == 2, rows  # the worker and its child both started before the cut
    launched.update({int(pid): int(sid) for pid, sid in rows})
    assert len(set(launched.values())) == 2  # each in a session of its own
    assert not [pid for pid in launched if _running(pid)], launched


def test_the_deadline_bounds_a_part_with_a_larger_cap(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    sleeper, _ = _sleeper(tmp_path)
    sched = Schedule(8, out, lambda p, final: {"parts": p}, tmp_path / "log")
    t0 = time.monotonic()
    rec = sched.run(Part("long", lambda d: ("passed", {}, [run_command(
        "long", sleeper, d, log_path=tmp_path / "log", cwd=tmp_path, env=None)]), 600, 1))
    assert rec["status"] == "timeout" and rec["limit_s"] <= 8
    assert time.monotonic() - t0 < 20
    assert sched.run(Part("next", lambda d: ("passed", {}, []), 60, 1))["status"] == "skipped"


def test_the_dry_check_runs_on_past_an_overrunning_part(gpu_check, tmp_path, monkeypatch):
    """tools/gpu_check.py --dry with its assets part made to overrun: it is killed at its
    cap, tests_gpu still runs through the streaming runner (collected, every required
    test present), a part with too little time left is skipped, and gpu_check.json says
    all of it. The tool sets the hub's offline switches itself."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    _wheel(wheel_dir, "gpucheckprobe", ["numpy"])
    args = argparse.Namespace(dry=True, smoke=False, cap=["assets=2"], work=str(tmp_path / "w"),
                              tests_after=None, allow_incomplete_wheels=True,
                              out=str(tmp_path / "out"), wheels=str(wheel_dir),
                              parts=["tests_gpu", "grpo"], deadline=300, per_test=60)
    check = gpu_check.Check(args)
    assert check.env["HF_HUB_OFFLINE"] == check.env["TRANSFORMERS_OFFLINE"] == "1"
    sleeper, marker = _sleeper(tmp_path)
    check.assets = lambda d: ("passed", {}, [check.run("assets", sleeper, d)])
    check.plan["grpo"][1] = 10_000  # needs more than the deadline leaves
    assert check.main() == 1
    s = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert list(s["parts"]) == ["install", "assets", "tests_gpu", "grpo"]
    p = s["parts"]
    assert p["install"]["status"] == "passed", p["install"]
    assert p["install"]["result"]["probe"]["fp8"]["reason"] == "no CUDA device"
    assert p["assets"]["status"] == "timeout" and p["assets"]["limit_s"] == 2
    tests = p["tests_gpu"]["result"]
    assert p["tests_gpu"]["status"] == "passed", tests
    assert tests["collected"] >= 60 and tests["missing_required"] == []
    assert p["grpo"]["status"] == "skipped" and "no time left" in p["grpo"]["result"]["reason"]
    assert s["finished"] and not s["passed"] and not s["complete"]
    assert s["elapsed_s"] <= s["deadline_s"]
    assert {"gpu_check.json", "gpu_check.log", "tests_gpu.jsonl"} <= set(s["files"])
    time.sleep(4)
    assert not marker.exists()


FAKE_TESTS = '''
import os, time, pytest

def test_a_passes():
    pass

def test_b_hangs():
    time.sleep(120)

def test_c_fails():
    assert 1 + 1 == 3

def test_d_crashes():
    os._exit(3)

@pytest.mark.skip(reason="needs a thing")
def test_e_skips():
    pass

def test_f_passes_after_the_crash():
    pass
'''


def _run_fake(tmp_path, deadline_s, stream, targets=None, per_test_s=4):
    folder = tmp_path / "fake"
    folder.mkdir(exist_ok=True)
    (folder / "test_fake.py").write_text(FAKE_TESTS)
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    return tests_run.run_tests(sys.executable, targets or [folder / "test_fake.py"],
                               time.monotonic() + deadline_s, stream=stream,
                               log_path=tmp_path / "log", cwd=folder, env=env,
                               per_test_s=per_test_s,
                               poll_s=0.2)


def test_streamed_tests_lose_only_the_test_in_flight(tmp_path):
    """A hung test is killed at the per-test limit and a crashing one ends its pytest;
    each is recorded and pytest starts again on the tests without a result."""
    stream = tmp_path / "tests.jsonl"
    cmds = _run_fake(tmp_path, 90, stream)
    s = tests_run.summarize(stream)
    outcome = {n.split("::")[-1]: r.split(":")[0] for n, r in s["failed_tests"].items()}
    assert outcome == {"test_b_hangs": "timeout", "test_c_fails": "failed",
                       "test_d_crashes": "crashed"}
    assert "assert (1 + 1) == 3" in s["failed_tests"]["test_fake.py::test_c_fails"]
    assert s["skipped_tests"] == {"test_fake.py::test_e_skips": "needs a thing"}
    assert (s["collected"], s["passed"], s["not_run"]) == (6, 2, [])
    assert len(cmds) == 3  # the first pytest, after the hang, after the crash


def test_a_file_that_does_not_import_is_reported_and_the_others_run(tmp_path):
    folder = tmp_path / "fake"
    folder.mkdir()
    (folder / "test_broken.py").write_text("import no_such_module_here\n")
    (folder / "test_fine.py").write_text("def test_fine():\n    pass\n")
    stream = tmp_path / "tests.jsonl"
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    tests_run.run_tests(sys.executable, sorted(folder.glob("test_*.py")),
                        time.monotonic() + 60, stream=stream, log_path=tmp_path / "log",
                        cwd=folder, env=env, per_test_s=30, poll_s=0.2)
    s = tests_run.summarize(stream)
    assert s["passed"] == 1 and s["collection_errors"] == 1
    assert "no_such_module_here" in s["failed_tests"]["test_broken.py"]


def test_tests_cut_by_the_deadline_run_in_a_later_call(tmp_path):
    stream = tmp_path / "tests.jsonl"
    _run_fake(tmp_path, 6, stream, per_test_s=60)  # ends inside test_b's sleep
    s = tests_run.summarize(stream)
    assert s["passed"] == 1 and s["not_run"][0].endswith("test_b_hangs")
    assert s["killed"] == 1 and s["failed_tests"] == {}
    _run_fake(tmp_path, 90, stream, targets=s["not_run"])
    s = tests_run.summarize(stream)
    assert s["not_run"] == [] and s["passed"] == 2 and s["timeout"] == 1


def test_tests_gpu_files_run_most_valuable_first(tmp_path):
    for name in ("test_zz_new.py", *tests_run.ORDER[::-1]):
        (tmp_path / name).write_text("")
    assert [p.name for p in tests_run.ordered_files(tmp_path)] == [
        *tests_run.ORDER, "test_zz_new.py"]
    assert [p.name for p in tests_run.ordered_files(REPO / "tests_gpu")] == tests_run.ORDER


def test_first_step_and_memory_summaries():
    close = first_step.compare_first_step({"loss": 0.011, "grad_norm": 1.05},
                                          {"loss": 0.0, "grad_norm": 1.0})
    far = first_step.compare_first_step({"loss": 0.011, "grad_norm": 1.2},
                                        {"loss": 0.0, "grad_norm": 1.0})
    assert close["within_tolerance"] and not far["within_tolerance"]
    assert not first_step.compare_first_step({}, {})["within_tolerance"]
    m = parts.memory_verdict({"measured_over_predicted": 1.3, "dry_run": {"gib": {}}})
    assert m["within_15pct"] is False


def test_teacher_forced_samples_are_fixed_and_balanced():
    a = first_step.teacher_forced_samples(1000, 48)
    b = first_step.teacher_forced_samples(1000, 48)
    assert [s.response_ids for s in a] == [s.response_ids for s in b]
    assert len(a) == first_step.PROMPTS * first_step.GROUP
    assert sum(s.advantage for s in a) == 0
    assert max(len(s.response_ids) for s in a) == 48


def test_dry_run_report_figures_by_label():
    report = ("memory per rank (estimate, 2-byte params):\n"
              "  weights     0.27 GiB   grads (fp32)     0.50 GiB   optimizer  1.5 GiB\n"
              "  reference   0.00 GiB   rollout KV cache     2.25 GiB (32 sequences x 1072 "
              "positions)   activations     0.38 GiB\n  total       4.90 GiB\n"
              "  stage 0: layers 0-29, weights    0.25 GiB; KV cache    2.25 GiB")
    got = parts._dry_run_numbers(report)
    assert got["total"] == 4.90 and got["grads"] == 0.50 and got["activations"] == 0.38
    assert got["rollout_kv_cache"] == 2.25 and got["weights"] == 0.27  # the first wins


def test_the_check_imports_no_other_tool_and_no_make():
    """tools/ holds one entry point for the check; nothing it runs calls make (make
    targets install)."""
    text = (REPO / "tools" / "gpu_check.py").read_text()
    assert "gpu_check_parts" not in text and "_sibling" not in text
    assert not (REPO / "tools" / "gpu_check_parts.py").exists()
    for path in [REPO / "tools" / "gpu_check.py", *(REPO / "megatron_tlt" / "gpu_check").glob(
            "*.py")]:
        assert not re.search(r"""["']make["']""", path.read_text()), path


@pytest.mark.slow
def test_smoke_run_of_the_check_writes_its_summary(tmp_path, smollm2_dir):
    """The check's first parts on CPU (`--smoke`): install from a wheel folder, the
    random-weight assets, tests_gpu collected (every required test present), the GRPO
    recipe's overrides validated by its dry run."""
    wheel_dir = tmp_path / "wheels"
    wheel_dir.mkdir()
    _wheel(wheel_dir, "gpucheckprobe", ["numpy"])
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--smoke", "--wheels", str(wheel_dir), "--out",
         str(out), "--work", str(tmp_path / "work"), "--allow-incomplete-wheels", "--parts",
         "install", "assets",
         "tests_gpu", "grpo", "--deadline", "400"], cwd=REPO, capture_output=True, text=True,
        timeout=450)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert summary["mode"] == "smoke" and summary["passed"] and summary["finished"]
    assert summary["complete"]
    assert list(summary["parts"]) == ["install", "assets", "tests_gpu", "grpo"]
    for name, part in summary["parts"].items():
        assert part["status"] == "passed", (name, part)
        assert 0 < part["seconds"] <= part["limit_s"]
    assert summary["parts"]["install"]["result"]["wheels"] == [
        "gpucheckprobe-1.0-py3-none-any.whl"]
    assert (tmp_path / "work" / "site_py312_unused" / "gpucheckprobe.py").is_file()
    tests = summary["parts"]["tests_gpu"]["result"]
    assert tests["missing_required"] == [] and tests["collected"] >= 30
    assert summary["parts"]["assets"]["result"]["mini"] is True
    assert "--dry-run" in summary["parts"]["grpo"]["commands"][0]["cmd"]


def test_random_weights_label_the_figures_timing_only(tmp_path, smollm2_dir):
    """The check's random-weight model says so in its marker, and a benchmark on it (or
    with an untrained drafter) labels its JSON timing only; a prepared (converted)
    SmolLM2 does not."""
    from megatron_tlt.assets import weights_are_random
    from megatron_tlt.bench.common import timing_only

    made = parts.assets(argparse.Namespace(shape=str(smollm2_dir), cache=str(tmp_path),
                                           mini=True))
    assert weights_are_random(Path(made["path"])) and not weights_are_random(smollm2_dir)
    assert not weights_are_random(tmp_path / "nowhere")
    label = timing_only(target_random=True)
    assert label["timing_only"] and "random" in label["timing_only_reason"]
    assert timing_only(target_random=False, drafter_random=True)["timing_only"]
    assert timing_only(target_random=False) == {"timing_only": False,
                                                "timing_only_reason": None}


def test_the_planner_takes_step_times_not_acceptance_from_a_timing_only_run(tmp_path, capsys):
    """tools/plan_tlt.py: a timing-only bench_spec JSON serves as --spec-table (its step
    costs), not as --accept-by-bucket (its acceptance): that is refused, naming the
    file, so the prediction combines the GPU's step times with acceptance measured on
    trained weights."""
    from megatron_tlt.planner.inputs import load_table, table_from_bench_rollout

    spec = {**load_table("bench_spec_1k_drafter_cpu.json"), "timing_only": True,
            "timing_only_reason": "the target's weights are random"}
    cost = table_from_bench_rollout(load_table("bench_rollout_quick_amd_epyc_avx2_cpu.json"),
                                    spec_doc=spec)
    assert "timing only" in cost.source and cost.spec_slope
    path = tmp_path / "bench_spec_t0.json"
    path.write_text(json.dumps(spec))
    mod_spec = importlib.util.spec_from_file_location("plan_tlt", REPO / "tools" / "plan_tlt.py")
    plan_tlt = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(plan_tlt)
    rc = plan_tlt.main(["--config", str(REPO / "examples/rl/smollm2_cpu.yaml"),
                        "--world-size", "2", "--accept-by-bucket", str(path)])
    err = capsys.readouterr().err
    assert rc == 2 and "timing only" in err and str(path) in err and "--spec-table" in err


def test_a_part_cut_at_its_limit_is_a_timeout_not_a_failure(gpu_check):
    cut = {"rc": -15, "timed_out": True}
    assert gpu_check._status(False, [cut]) == "timeout"
    assert gpu_check._status(False, [{"rc": 1, "timed_out": False}, cut]) == "failed"
    assert gpu_check._status(False, [{"rc": 0, "timed_out": False}]) == "failed"
    assert gpu_check._status(True, [{"rc": 0, "timed_out": False}]) == "passed"
