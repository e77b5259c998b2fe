"""No run destroys another run's records: the run folder rules (rl/run_dir.py), atomic
writes (fileio.py), and the entry point end to end on a tiny policy: failing start-ups
leave an existing run byte-identical, a second run of the same name leaves the first
alone, and a resume after SIGKILL keeps every earlier record exactly once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli import REPO, run_script
from rl_fixtures import save_tiny_policy, tiny_run_args


def snapshot(root: Path) -> dict[str, object]:
    """Every file's bytes and every link's target under ``root``, by relative path."""
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_file():
                out[rel] = p.read_bytes()
            else:
                out[rel] = "dir"
    return out


def _tracking(output_dir: Path, run_name: str = "run", on_existing_run: str = "error"):
    from megatron_tlt.config import TrackingConfig

    return TrackingConfig(output_dir=str(output_dir), run_name=run_name,
                          on_existing_run=on_existing_run)


def _records(*steps: int) -> list[bytes]:
    return [json.dumps({"step": s, "time": 1.0 + s, "reward/mean": s / 10}).encode() + b"\n"
            for s in steps]


# ----------------------------------------------------------------------- atomic writes

def test_atomic_write_leaves_the_previous_file_when_the_write_fails(tmp_path):
    from megatron_tlt.fileio import atomic_write, write_text_atomic

    target = tmp_path / "summary.json"
    write_text_atomic(target, "old")
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_write(target) as f:
            f.write("half a new fi")
            f.flush()
            raise RuntimeError("crash mid-write")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # no temp left
    write_text_atomic(target, "new")
    assert target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


# ----------------------------------------------------------------------- folder rules

def test_a_new_run_into_a_folder_holding_a_run_stops_naming_the_folder_and_options(tmp_path):
    from megatron_tlt.config import ConfigError
    from megatron_tlt.rl import run_dir

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_bytes(b"".join(_records(1, 2)))
    before = snapshot(tmp_path)
    with pytest.raises(ConfigError) as e:
        run_dir.choose(_tracking(tmp_path), "run", resume=False)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(tmp_path / "run") in msg and "metrics.jsonl" in msg
    for option in ("tracking.run_name", "tracking.on_existing_run=new_version",
                   str(tmp_path / "run-1"), "checkpoint.load"):
        assert option in msg, option
    assert snapshot(tmp_path) == before
    (tmp_path / "a-file").write_text("x")
    for resume in (False, True):
        with pytest.raises(ConfigError, match="is a file; choose another tracking.run_name"):
            run_dir.choose(_tracking(tmp_path), "a-file", resume=resume)
    # an empty folder holds no run: it is used as is
    (tmp_path / "empty").mkdir()
    assert run_dir.choose(_tracking(tmp_path), "empty", resume=False) == tmp_path / "empty"


def test_new_version_takes_the_first_free_name_and_leaves_the_others(tmp_path):
    from megatron_tlt.rl import run_dir

    for name in ("run", "run-1"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(f'{{"name": "{name}"}}')
    (tmp_path / "run-2").mkdir()  # empty: free
    before = snapshot(tmp_path)
    cfg = _tracking(tmp_path, on_existing_run="new_version")
    opened = run_dir.open_run(cfg, "run", resumed_step=None, config={"x": 1})
    assert opened.path == tmp_path / "run-2"
    assert json.loads((opened.path / "config.json").read_text()) == {"x": 1}
    after = snapshot(tmp_path)
    assert {k: v for k, v in after.items() if not k.startswith("run-2")} == \
        {k: v for k, v in before.items() if not k.startswith("run-2")}
    assert f"({tmp_path / 'run'} already holds a run)" in opened.describe(tmp_path / "run")
    # a run named by its start time never stops on a clash: it takes a version too
    unnamed = _tracking(tmp_path, run_name="")
    assert run_dir.choose(unnamed, "run", resume=False) == tmp_path / "run-3"


def test_a_resume_moves_records_past_its_step_aside_and_keeps_each_config(tmp_path):
    from megatron_tlt.rl import run_dir

    folder = tmp_path / "run"
    folder.mkdir()
    first = _records(1, 2, 3, 4, 5)
    torn = b'{"step": 6, "time": 7.0, "rew'  # the write SIGKILL cut short
    (folder / "metrics.jsonl").write_bytes(b"".join(first) + torn)
    (folder / "config.json").write_text('{"attempt": 0}')
    cfg = _tracking(tmp_path)

    opened = run_dir.open_run(cfg, "run", resumed_step=3, config={"attempt": 1})
    assert opened.path == folder
    assert (folder / "metrics.jsonl").read_bytes() == b"".join(first[:3])
    assert opened.set_aside == folder / "metrics.after-step-3.jsonl"
    assert opened.set_aside.read_bytes() == b"".join(first[3:]) + torn
    assert (folder / "config.json").read_text() == '{"attempt": 0}'
    assert opened.config_file.name == "config.resume-1.json"
    assert json.loads(opened.config_file.read_text()) == {"attempt": 1}

    # the second attempt writes step 4 and dies too; a third resumes from 3 again
    second = _records(4)
    with open(folder / "metrics.jsonl", "ab") as f:
        f.write(second[0])
    opened = run_dir.open_run(cfg, "run", resumed_step=3, config={"attempt": 2})
    assert opened.set_aside == folder / "metrics.after-step-3.2.jsonl"
    assert opened.set_aside.read_bytes() == second[0]
    assert opened.config_file.name == "config.resume-2.json"
    # every record ever written is in exactly one file
    lines = [line for p in sorted(folder.glob("metrics*.jsonl"))
             for line in p.read_bytes().splitlines(keepends=True)]
    assert sorted(lines) == sorted(first + [torn] + second)

    # nothing past the step: the file is left as it is
    before = snapshot(folder)
    opened = run_dir.open_run(cfg, "run", resumed_step=3, config={"attempt": 3})
    assert opened.set_aside is None
    after = snapshot(folder)
    assert after.pop("config.resume-3.json") and after == before


# ----------------------------------------------------------------------- end to end

@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory) -> Path:
    return save_tiny_policy(tmp_path_factory.mktemp("run_dir") / "policy", smollm2_dir)


def _args(policy: Path, out: Path, *extra: str) -> list[str]:
    return tiny_run_args(policy, out, "tracking.wandb_mode=offline", *extra)  # W&B resumes


@pytest.fixture(scope="module")
def finished_run(tiny_policy, tmp_path_factory) -> tuple[Path, Path]:
    """(runs folder holding the finished one-step run ``run``, its checkpoint folder)."""
    root = tmp_path_factory.mktemp("finished")
    out, ckpt = root / "runs", root / "ckpt"
    r = run_script("pretrain_rl_tlt.py", *_args(tiny_policy, out, "train.steps=1",
                                                f"checkpoint.save={ckpt}"), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [json.loads(x)["step"] for x in
            (out / "run" / "metrics.jsonl").read_text().splitlines()] == [1]
    assert list((out / "run" / "wandb").glob("offline-run-*"))
    return out, ckpt


@pytest.mark.parametrize("case", ["data", "data_on_resume", "checkpoint", "model"])
def test_a_failing_start_up_leaves_an_existing_run_byte_identical(case, tiny_policy,
                                                                  finished_run, tmp_path):
    out, ckpt = finished_run
    bad_data = ("data.source=jsonl", f"data.path={tmp_path / 'nonexistent.jsonl'}")
    extra, expected = {
        # a new run that would write run-1, a resume that would append to run
        "data": (("tracking.on_existing_run=new_version", *bad_data), "data.path="),
        "data_on_resume": ((f"checkpoint.load={ckpt}", *bad_data), "data.path="),
        "checkpoint": ((f"checkpoint.load={tmp_path / 'none'}",), "no checkpoint found"),
        "model": (("tracking.on_existing_run=new_version",
                   f"model.hf_path={tmp_path / 'no-model'}"), "no-model"),
    }[case]
    before = snapshot(out)
    r = run_script("pretrain_rl_tlt.py", *_args(tiny_policy, out, "train.steps=2", *extra),
                   timeout=600)
    assert r.returncode == 2, r.stderr[-3000:]
    assert expected in r.stderr and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert snapshot(out) == before


def test_a_second_run_with_the_same_name_does_not_touch_the_first(tiny_policy, finished_run):
    out, _ = finished_run
    before = snapshot(out / "run")
    r = run_script("pretrain_rl_tlt.py", *_args(tiny_policy, out, "train.steps=1"))
    assert r.returncode == 2
    assert f"the run folder {out / 'run'} already holds a run" in r.stderr
    assert "tracking.on_existing_run=new_version" in r.stderr
    assert not (out / "run-1").exists()

    r = run_script("pretrain_rl_tlt.py", *_args(tiny_policy, out, "train.steps=1",
                                                "tracking.on_existing_run=new_version"),
                   timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"run folder {out / 'run-1'}" in r.stdout
    assert snapshot(out / "run") == before
    new = out / "run-1"
    assert [json.loads(x)["step"] for x in (new / "metrics.jsonl").read_text().splitlines()] \
        == [1]
    assert (new / "config.json").is_file() and (new / "summary.json").is_file()
    assert (new / "wandb_id.txt").read_text() != (out / "run" / "wandb_id.txt").read_text()


def test_a_resume_after_sigkill_keeps_every_earlier_record_exactly_once(tiny_policy,
                                                                        tmp_path):
    out, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    folder = out / "run"
    args = _args(tiny_policy, out, "train.steps=4", "grpo.max_new_tokens=16",
                 f"checkpoint.save={ckpt}", "checkpoint.save_interval=2")
    proc = subprocess.Popen([sys.executable, str(REPO / "pretrain_rl_tlt.py"), *args],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    metrics = folder / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:  # killed once step 3 is logged: checkpoint 2 on disk, step 4 running
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_bytes().count(b"\n") >= 3:
                break
            time.sleep(0.02)
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    killed = metrics.read_bytes().splitlines(keepends=True)
    config = (folder / "config.json").read_bytes()
    saved = int((ckpt / "latest").read_text().strip().split("_")[1])
    assert saved in (2, 4)

    r = run_script("pretrain_rl_tlt.py", *args, f"checkpoint.load={ckpt}", timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ckpt / f'step_{saved:07d}'} at step {saved}" in r.stdout
    final = metrics.read_bytes().splitlines(keepends=True)
    assert [json.loads(x)["step"] for x in final] == [1, 2, 3, 4]
    past = [x for x in killed if json.loads(x)["step"] > saved]
    assert final[:saved] == killed[:saved]  # the records up to the checkpoint, unchanged
    aside = folder / f"metrics.after-step-{saved}.jsonl"
    if past:
        assert aside.read_bytes().splitlines(keepends=True) == past
    else:
        assert not aside.exists()
    # every record of the killed attempt is kept exactly once
    kept = final[:saved] + (aside.read_bytes().splitlines(keepends=True) if past else [])
    assert sorted(kept) == sorted(killed)
    assert (folder / "config.json").read_bytes() == config
    assert (folder / "config.resume-1.json").is_file()
    # one W&B run id, one W&B folder per attempt: the killed attempt's folder remains
    runs = sorted((folder / "wandb").glob("offline-run-*"))
    run_id = (folder / "wandb_id.txt").read_text().strip()
    assert len(runs) == 2 and all(p.name.endswith("-" + run_id) for p in runs)
