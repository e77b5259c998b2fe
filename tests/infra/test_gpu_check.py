"""`make gpu-check`'s plumbing on CPU (tools/gpu_check.py): the part runner's time
limits, the wheel folder's requirement check, the JUnit and first-step summaries, and a
smoke run of the check itself (install from a wheel folder, the random-weight assets,
tests_gpu collected with every required test, the GRPO recipe's override list
validated by its dry run) writing its JSON summary."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "tools" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel (one module) with these Requires-Dist lines."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {0}\nVersion: 1.0\n".format(name) + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    info = f"{name}-1.0.dist-info"
    files = {f"{name}.py": "VALUE = 1\n", f"{info}/METADATA": meta,
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{k},,\n" for k in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as z:
        for k, v in files.items():
            z.writestr(k, v)
    return path


def test_manifest_lists_requirements_neither_carried_nor_on_the_gpu_image(gpu_check,
                                                                          tmp_path):
    """tools/wheel_folder.py's check of the folder (make gpu-wheels, and the install)."""
    _wheel(tmp_path, "alpha", ["numpy>=1", "beta", "typing; python_version < '3.5'",
                               "gamma[x]; extra == 'dev'", "delta_pkg"])
    _wheel(tmp_path, "beta", [])
    m = gpu_check.manifest(tmp_path)
    # numpy is on the image, beta is carried, the marker and the extra do not apply
    assert m["unmet_requirements"] == {"alpha-1.0-py3-none-any.whl": ["delta_pkg"]}
    assert m["fits"] and m["total_bytes"] == sum(m["files"].values()) > 0
    assert json.loads((tmp_path / "MANIFEST.json").read_text()) == m


def _check(gpu_check, tmp_path, **kw):
    args = argparse.Namespace(dry=True, smoke=False, budget=[], work=str(tmp_path / "w"),
                              out=str(tmp_path / "out"), wheels=str(tmp_path / "none"),
                              parts=None, **kw)
    return gpu_check.Check(args)


def test_a_part_over_its_limit_is_killed_recorded_and_the_next_part_runs(gpu_check,
                                                                         tmp_path):
    check = _check(gpu_check, tmp_path)
    check.budget.update(install=2, assets=30)
    marker = tmp_path / "child_alive"
    child = tmp_path / "child.py"   # a grandchild that would outlive a plain kill
    child.write_text(f"import time\ntime.sleep(3)\nopen({str(marker)!r}, 'w')\n")
    parent = tmp_path / "parent.py"
    parent.write_text(f"import subprocess, sys, time\n"
                      f"subprocess.Popen([sys.executable, {str(child)!r}])\ntime.sleep(60)\n")
    sleeper = [sys.executable, str(parent)]
    t0 = time.monotonic()
    check.part("install", lambda d: ("passed", {}, [check.run("install", sleeper, d)]))
    assert time.monotonic() - t0 < 15
    check.part("assets", lambda d: ("passed", {"x": 1}, [check.run(
        "assets", [sys.executable, "-c", "print('ran')"], d)]))
    summary = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    over, after = summary["parts"]["install"], summary["parts"]["assets"]
    assert over["status"] == "timeout" and over["commands"][0]["timed_out"]
    assert over["budget_s"] == 2 and 2 <= over["seconds"] < 15
    assert after["status"] == "passed" and after["result"] == {"x": 1}
    assert not summary["passed"]
    time.sleep(4)
    assert not marker.exists()  # the part's whole process group was killed
    assert "ran" in (tmp_path / "out" / "gpu_check.log").read_text()


def test_junit_and_first_step_summaries(gpu_check, tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1" time="3.5">'
        '<testcase classname="tests_gpu.test_cuda" name="test_a"/>'
        '<testcase classname="tests_gpu.test_cuda" name="test_b"><failure message="boom"/>'
        '</testcase><testcase classname="tests_gpu.test_cuda" name="test_te">'
        '<skipped message="Transformer Engine not installed"/></testcase>'
        '<testcase classname="tests_gpu.test_cuda" name="test_c"/></testsuite></testsuites>')
    s = gpu_check.junit_summary(xml)
    assert (s["tests"], s["passed"], s["failed"], s["skipped"]) == (4, 2, 1, 1)
    assert s["failed_tests"] == {"tests_gpu.test_cuda::test_b": "boom"}
    assert "Transformer Engine" in s["skipped_tests"]["tests_gpu.test_cuda::test_te"]
    assert "error" in gpu_check.junit_summary(tmp_path / "missing.xml")
    close = gpu_check.compare_first_step({"first_loss": 0.011, "first_grad_norm": 1.1},
                                         {"first_loss": 0.0, "first_grad_norm": 1.0})
    far = gpu_check.compare_first_step({"first_loss": 0.5, "first_grad_norm": 2.0},
                                       {"first_loss": 0.0, "first_grad_norm": 1.0})
    assert close["within_tolerance"] and not far["within_tolerance"]
    assert not gpu_check.compare_first_step({}, {})["within_tolerance"]
    m = gpu_check.memory_verdict({"measured_over_predicted": 1.3, "dry_run": {"gib": {}}})
    assert m["within_15pct"] is False


def test_dry_run_report_figures_by_label():
    spec = importlib.util.spec_from_file_location("gpu_check_parts",
                                                  REPO / "tools" / "gpu_check_parts.py")
    parts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(parts)
    report = ("memory per rank (estimate, 2-byte params):\n"
              "  weights     0.27 GiB   grads (fp32)     0.50 GiB   optimizer  1.5 GiB\n"
              "  reference   0.00 GiB   rollout KV cache     2.25 GiB (32 sequences x 1072 "
              "positions)   activations     0.38 GiB\n  total       4.90 GiB\n"
              "  stage 0: layers 0-29, weights    0.25 GiB; KV cache    2.25 GiB")
    got = parts._dry_run_numbers(report)
    assert got["total"] == 4.90 and got["grads"] == 0.50 and got["activations"] == 0.38
    assert got["rollout_kv_cache"] == 2.25 and got["weights"] == 0.27  # the first wins


@pytest.mark.slow
def test_smoke_run_of_the_check_writes_its_summary(tmp_path, smollm2_dir):
    """The check's first four parts on CPU (`--smoke`): install from a wheel folder,
    the random-weight assets, tests_gpu collected (every required test present), the
    GRPO recipe's overrides validated by its dry run."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "gpucheckprobe", ["numpy"])
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "tools/gpu_check.py", "--smoke", "--wheels", str(wheels), "--out",
         str(out), "--work", str(tmp_path / "work"), "--parts", "install", "assets",
         "tests_gpu", "grpo"], cwd=REPO, capture_output=True, text=True, timeout=400)
    summary = json.loads((out / "gpu_check.json").read_text())
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert summary["mode"] == "smoke" and summary["passed"] and summary["finished"]
    assert list(summary["parts"]) == ["install", "assets", "tests_gpu", "grpo"]
    for name, part in summary["parts"].items():
        assert part["status"] == "passed", (name, part)
        assert 0 < part["seconds"] <= part["budget_s"]
    assert summary["parts"]["install"]["result"]["wheels"] == [
        "gpucheckprobe-1.0-py3-none-any.whl"]
    assert (tmp_path / "work" / "site_py312_unused" / "gpucheckprobe.py").is_file()
    tests = summary["parts"]["tests_gpu"]["result"]
    assert tests["missing_required"] == [] and tests["collected"] >= 30
    assert summary["parts"]["assets"]["result"]["mini"] is True
    assert "--dry-run" in summary["parts"]["grpo"]["commands"][0]["cmd"]
