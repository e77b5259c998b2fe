"""What the entry points share from the package instead of from each other: the cached
warmed drafters (drafter_training/prepared.py) and the torchrun launcher
(bench/launcher.py)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from megatron_tlt.bench.launcher import torchrun
from megatron_tlt.drafter_training import prepared


def test_cached_drafters_are_reused_without_a_warm_up(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MEGATRON_TLT_CACHE", str(tmp_path))

    def no_warmup(cfg):
        raise AssertionError("a cached drafter was warmed up again")

    monkeypatch.setattr(prepared, "run_warmup", no_warmup)
    full, quick = prepared.default_drafter_path(), prepared.default_drafter_path(quick=True)
    assert full.parent == quick.parent == tmp_path / "drafters" and full != quick
    quick.parent.mkdir()
    quick.write_bytes(b"")
    assert prepared.ensure_drafter(quick, quick=True) == quick
    demo = tmp_path / "drafters" / "smollm2-chain_sum-demo-sampled.safetensors"
    demo.write_bytes(b"")
    assert prepared.demo_drafter() == demo and "(cached)" in capsys.readouterr().out


def test_a_missing_drafter_is_warmed_up_with_the_benchmark_settings(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(prepared, "run_warmup", seen.append)
    path = tmp_path / "d.safetensors"
    assert prepared.ensure_drafter(path, quick=True) == path
    assert prepared.ensure_drafter(path, quick=False) == path
    quick, full = seen
    assert (quick.out, quick.train_prompts, quick.epochs, quick.responses) == (
        str(path), 64, 4, None)
    assert (full.train_prompts, full.unroll, full.lr) == (8192, 2, 3e-3)
    assert full.responses == str(tmp_path / "d.responses.jsonl")  # a warm-up resumes
    assert prepared.DEMO_RECIPE.is_file()


def test_the_shipped_demo_settings_are_the_demo_recipes():
    """The package ships the demo recipe's warm-up settings (it reads no checkout's
    examples/): they give the warm-up the recipe itself gives."""
    from dataclasses import asdict

    from cli import REPO
    from megatron_tlt.drafter_training.warmup import WarmupConfig

    assert prepared.DEMO_RECIPE.parent.parent == Path(prepared.__file__).parent
    shipped = asdict(WarmupConfig.from_recipe(prepared.DEMO_RECIPE))
    recipe = asdict(WarmupConfig.from_recipe(REPO / "examples" / "rl" / "smollm2_cpu.yaml"))
    shipped.pop("recipe"), recipe.pop("recipe")
    assert shipped == recipe


@pytest.mark.multiproc
def test_torchrun_runs_the_script_in_cwd_with_one_thread_per_process(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = tmp_path / "probe.py"
    script.write_text(
        "import json, os, sys\n"
        "json.dump({'cwd': os.getcwd(), 'omp': os.environ.get('OMP_NUM_THREADS'),\n"
        "           'world': os.environ.get('WORLD_SIZE'), 'args': sys.argv[1:]},\n"
        "          open(sys.argv[1], 'w'))\n"
        "sys.exit(3)\n")
    rc = torchrun("probe", 1, script, ["out.json", 7], time.perf_counter(), cwd=tmp_path)
    got = json.loads((tmp_path / "out.json").read_text())  # relative to cwd
    assert rc != 0  # the script's failure reaches the caller
    assert got == {"cwd": str(tmp_path), "omp": "1", "world": "1", "args": ["out.json", "7"]}
    out = capsys.readouterr().out
    assert out.startswith(f"[probe] -m torch.distributed.run --standalone --nproc_per_node 1 "
                          f"{script} out.json 7") and "[probe] total" in out
