"""The planner from an installed package: its measured tables travel as package data.

The package is installed non-editably into a temporary folder and the two entry points
that predict (``tools/plan_tlt.py`` and ``pretrain_rl_tlt.py --dry-run``) run from a
folder outside the clone, with only that install on the path: nothing may read the
clone's docs/results/."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from cli import REPO

from megatron_tlt.planner.inputs import shipped_tables

# what `pip install .` reads; copied first because pip builds in the source folder
# (build/, *.egg-info), which must not be the clone that other runs share
SOURCES = ("megatron_tlt", "pyproject.toml", "setup.py", "README.md")
CPU_RECIPE, GPU_RECIPE = "smollm2_cpu.yaml", "qwen2.5_7b_grpo.yaml"


def test_the_shipped_tables_have_one_copy():
    """megatron_tlt/planner/data/ holds the one copy of each measured table the planner
    reads (package data): docs/results/ holds none of them again."""
    names = shipped_tables()
    assert "bench_spec_1k_drafter_cpu.json" in names and "drafter_alpha_curves_t1_cpu.json" in names
    twice = [n for n in names if (REPO / "docs" / "results" / n).exists()]
    assert not twice, f"keep one copy, in megatron_tlt/planner/data/: {twice}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict]:
    """(a working folder outside the clone holding the two scripts and the recipes, the
    environment that puts only the temporary install on the path)."""
    root = tmp_path_factory.mktemp("installed")
    src, site, work = root / "src", root / "site", root / "work"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in SOURCES:
        p = REPO / name
        (shutil.copytree(p, src / name, ignore=skip) if p.is_dir() else shutil.copy(p, src))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps",
                        "--no-build-isolation", "--no-index", "--quiet", "--target",
                        str(site), str(src)], capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    work.mkdir()
    for script in ("tools/plan_tlt.py", "pretrain_rl_tlt.py"):
        shutil.copy(REPO / script, work)
    for recipe in (CPU_RECIPE, GPU_RECIPE):
        shutil.copy(REPO / "examples" / "rl" / recipe, work)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {
        "PYTHONPATH": str(site)}
    return work, env


def _run(installed, *args: str) -> subprocess.CompletedProcess:
    work, env = installed
    return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_install_is_what_runs(installed):
    r = _run(installed, "-c", "import megatron_tlt; print(megatron_tlt.__file__)")
    assert r.returncode == 0, r.stderr[-2000:]
    where = Path(r.stdout.strip()).resolve()
    assert installed[0].parent / "site" in where.parents and REPO not in where.parents
    data = where.parent / "planner" / "data"
    assert sorted(p.name for p in data.glob("*.json")) == shipped_tables()


def test_plan_tlt_predicts_a_cpu_recipe_from_the_install(installed):
    r = _run(installed, "plan_tlt.py", "--config", CPU_RECIPE, "--world-size", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "without TLT" in r.stdout and "s/step" in r.stdout and "expected speedup" in r.stdout
    # the CPU prediction reads the co-run tables, the speculative costs, the bench_e2e
    # runs (the update) and the demo drafter's alpha
    for table in ("bench_rollout_pp2_corun_avx512_cpu.json", "bench_spec_1k_drafter_cpu.json",
                  "bench_e2e_g8_avx512_cpu.json", "bench_spec_T1_demo_drafter_cpu.json"):
        assert table in r.stdout
    assert str(REPO) not in r.stdout + r.stderr


def test_the_dry_run_predicts_from_the_install(installed):
    r = _run(installed, "pretrain_rl_tlt.py", "--config", GPU_RECIPE, "--dry-run",
             "--world-size", "8")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "peak" in r.stdout and "GiB" in r.stdout  # the memory by phase
    assert "predicted step time" in r.stdout and "not available" not in r.stdout
    assert "without TLT" in r.stdout and "alpha curve" in r.stdout  # the shipped curve


def test_the_validation_asks_for_a_clone(installed):
    r = _run(installed, "plan_tlt.py", "--validate")
    assert r.returncode == 2
    assert "docs/results" in r.stderr and "clone" in r.stderr
