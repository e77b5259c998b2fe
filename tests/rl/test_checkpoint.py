"""Run checkpoints on disk: safe formats only (a crafted pickle runs nothing), corrupt or
partial checkpoints (a truncated file, a flipped byte) named in the error and skipped on
request, a save killed before it is published leaves the previous one loadable,
keep-last-N, exact state round trip, no checkpoint-writer process outlives a killed
rank (synchronous or asynchronous save). Asynchronous saves: the same checkpoint as a
synchronous save, a snapshot of the moment the save returned (weights and optimizer
state changed right after it are saved as they were), published only by the finalize
step, a save killed mid-write leaves the previous checkpoint, and a resume from one
continues exactly."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_fixtures import save_tiny_policy, saved_tensors


class _Marker:
    """Unpickling this creates the file ``path``: what a malicious checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def trainer(smollm2_dir, tmp_path_factory, single_process_parallel):
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.trainer import Trainer

    policy = save_tiny_policy(tmp_path_factory.mktemp("ckpt") / "policy", smollm2_dir,
                              layers=1)
    cfg = load_config([], [f"model.hf_path={policy}", "grpo.prompts_per_step=2",
                           "grpo.group_size=4", "grpo.max_new_tokens=8", "data.train_size=16",
                           "rollout.cpu_kernels=false", "train.optimizer=torch",
                           "train.lr=1e-3", "reward.format_reward=1.0",
                           "reward.format_pattern=k"])
    t = Trainer(cfg, setup(cfg))
    t.train_step(0)  # optimizer moments and a moved sampler / RNG to restore
    return t


def _save(trainer, root: Path, step: int, **kw) -> Path:
    from megatron_tlt import checkpoint

    trainer.state.step = step
    return checkpoint.save(trainer.state, root, trainer.layout, **kw)


def _record_size(step_dir: Path, name: str) -> None:
    """Make run.json agree with a replaced file (size and checksum, as a forger would)."""
    from megatron_tlt.checkpoint.store import crc32

    run = json.loads((step_dir / "run.json").read_text())
    run["files"][name] = (step_dir / name).stat().st_size
    run["crc32"][name] = crc32(step_dir / name)
    (step_dir / "run.json").write_text(json.dumps(run))


def test_tree_round_trip_keeps_int_keys_tuples_and_rng_states(tmp_path):
    from megatron_tlt.checkpoint.safe_files import read_tree, write_tree

    tree = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(2, 3)}},
            "param_groups": [{"betas": (0.9, 0.99), "params": [0], "lr": 1e-3}],
            "python": random.getstate(), "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(), "none": None}
    write_tree(tmp_path / "x", tree)
    back = read_tree(tmp_path / "x")
    assert back["state"][0]["exp_avg"].equal(tree["state"][0]["exp_avg"])
    assert back["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["python"] == tree["python"]
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(back["numpy"], tree["numpy"]))
    assert back["torch"].equal(tree["torch"]) and back["none"] is None


def test_save_load_restores_weights_optimizer_sampler_and_rng(trainer, tmp_path):
    from megatron_tlt import checkpoint

    path = _save(trainer, tmp_path, 1)
    # one copy of everything: no pickle besides dist_checkpointing's two checked files
    pickles = sorted(p.name for p in path.rglob("*") if p.suffix in (".pt", ".pkl"))
    assert pickles == ["common.pt"]
    weights = {k: v.clone() for k, v in trainer.policy.module.state_dict().items()
               if isinstance(v, torch.Tensor)}
    moments = [trainer.policy.optimizer.state[p]["exp_avg"].clone()
               for g in trainer.policy.optimizer.param_groups for p in g["params"]]
    sampler = trainer.state.sampler.state_dict()
    draws = torch.rand(3)
    with torch.no_grad():  # move everything away from the saved state
        for p in trainer.policy.module.parameters():
            p.add_(1.0)
    for st in trainer.policy.optimizer.state.values():
        st["exp_avg"].zero_()
    trainer.state.sampler.next_batch(3)
    trainer.state.step = 99
    assert checkpoint.load(trainer.state, tmp_path, trainer.layout) == path
    assert trainer.state.step == 1
    now = trainer.policy.module.state_dict()
    assert all(now[k].equal(v) for k, v in weights.items())
    assert all(trainer.policy.optimizer.state[p]["exp_avg"].equal(m) for p, m in zip(
        [p for g in trainer.policy.optimizer.param_groups for p in g["params"]], moments))
    assert trainer.state.sampler.state_dict() == sampler
    assert torch.rand(3).equal(draws)  # the RNG continues where the save left it


@pytest.mark.parametrize("target", ["policy/.metadata", "policy/common.pt"])
def test_a_crafted_pickle_executes_nothing_and_names_the_file(target, trainer, tmp_path):
    from megatron_tlt import checkpoint

    path = _save(trainer, tmp_path / "ckpt", 1)
    marker = tmp_path / "pwned"
    if target.endswith(".pt"):
        torch.save({"x": _Marker(marker)}, path / target)
    else:
        (path / target).write_bytes(pickle.dumps(_Marker(marker)))
    _record_size(path, target)
    with pytest.raises(checkpoint.CheckpointError, match=str(path / target)) as e:
        checkpoint.load(trainer.state, tmp_path / "ckpt", trainer.layout)
    assert "refus" in str(e.value)
    assert not marker.exists()


def test_corrupt_checkpoint_names_the_file_and_falls_back_when_asked(trainer, tmp_path):
    from megatron_tlt import checkpoint

    _save(trainer, tmp_path, 1)
    bad = _save(trainer, tmp_path, 2)
    shard = next((bad / "policy").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-100])  # truncated
    with pytest.raises(checkpoint.CheckpointError, match=str(shard)) as e:
        checkpoint.load(trainer.state, tmp_path, trainer.layout)
    assert "checkpoint.fallback_to_previous=true" in str(e.value)
    (bad / "run.json").write_text("{not json")
    with pytest.raises(checkpoint.CheckpointError, match=str(bad / "run.json")):
        checkpoint.load(trainer.state, bad, trainer.layout)
    got = checkpoint.load(trainer.state, tmp_path, trainer.layout, fallback_to_previous=True)
    assert got.name == "step_0000001" and trainer.state.step == 1


@pytest.mark.parametrize("target", ["policy/*.distcp", "rank_*.safetensors"])
def test_a_flipped_byte_fails_its_checksum_and_falls_back_when_asked(target, trainer,
                                                                     tmp_path):
    from megatron_tlt import checkpoint

    _save(trainer, tmp_path, 1)
    bad = _save(trainer, tmp_path, 2)
    f = next(bad.glob(target))
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only the checksum can tell
    f.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match=f"{f}: its CRC-32 differs"):
        checkpoint.load(trainer.state, tmp_path, trainer.layout)
    got = checkpoint.load(trainer.state, tmp_path, trainer.layout, fallback_to_previous=True)
    assert got.name == "step_0000001" and trainer.state.step == 1


def test_a_save_killed_before_publishing_leaves_the_previous_one_loadable(
        trainer, tmp_path, monkeypatch):
    from megatron_tlt import checkpoint
    from megatron_tlt.checkpoint import store

    _save(trainer, tmp_path, 1)

    def killed(*a, **k):
        raise KeyboardInterrupt("killed mid-save")

    monkeypatch.setattr(store, "publish_dir", killed)
    with pytest.raises(KeyboardInterrupt):
        _save(trainer, tmp_path, 2)
    monkeypatch.undo()
    assert (tmp_path / ".step_0000002.partial").is_dir()  # what the kill left
    assert checkpoint.latest(tmp_path).name == "step_0000001"
    assert checkpoint.load(trainer.state, tmp_path, trainer.layout).name == "step_0000001"
    # the next save clears the remains and keeps the newest keep_last
    for step in (2, 3, 4):
        _save(trainer, tmp_path, step, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000003",
                                                          "step_0000004"]


def test_the_drafter_buffer_is_kept_not_dropped(tmp_path):
    """Buffered responses (tokens, feature rows, step) survive a save / load exactly."""
    from megatron_tlt.checkpoint.safe_files import read_tree, write_tree
    from megatron_tlt.checkpoint.state import buffer_state, load_buffer_state
    from megatron_tlt.drafter_training.buffer import BufferedResponse, DataBuffer

    buf = DataBuffer(budget_tokens=12)
    buf.add(3, [BufferedResponse([1, 2, 3, 4, 5], 2, torch.randn(3, 4), 3)])
    buf.add(4, [BufferedResponse([1, 7, 8, 9, 9, 9], 1, torch.randn(5, 4), 4),
                BufferedResponse(list(range(20)), 2, torch.randn(18, 4), 4)])  # too long
    write_tree(tmp_path / "b", buffer_state(buf))
    back = DataBuffer(budget_tokens=12)
    load_buffer_state(back, read_tree(tmp_path / "b"))
    assert (back.tokens, back.dropped, back.steps) == (buf.tokens, buf.dropped, [3, 4])
    assert [(r.tokens, r.prompt_len, r.step) for r in back] == \
        [(r.tokens, r.prompt_len, r.step) for r in buf]
    assert all(a.features.equal(b.features) for a, b in zip(back, buf))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_rank_killed_mid_save_leaves_no_writer_process_behind(mode, tmp_path):
    """megatron-core's file writer is a forked process (an asynchronous save forks a
    background process that forks the writer): SIGKILL the rank while it writes, and
    they go too; the rank starts no other helper process."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cli import REPO

    pidfile = tmp_path / "writer.pid"
    (tmp_path / "ckpt").mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "support" / "mp_checkpoint_writer_worker.py"),
         str(tmp_path / "ckpt"), str(pidfile), mode], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not pidfile.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pidfile.is_file(), proc.communicate(timeout=60)[1][-3000:]
        started = [int(x) for x in pidfile.read_text().split()]
        # the writer (and the background process of an asynchronous save) only: no
        # multiprocessing manager process
        assert len(started) == (1 if mode == "sync" else 2), started
        proc.kill()
        proc.wait(timeout=60)

        assert _all_exited(started), "a checkpoint writer outlived its rank"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of it
        except ProcessLookupError:
            pass


# ------------------------------------------------------------------ asynchronous saves
def _all_exited(pids, seconds: float = 30.0) -> bool:
    """Whether every process in ``pids`` has exited (zombies count) within ``seconds``."""
    import time

    import psutil

    def alive(pid):
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    deadline = time.monotonic() + seconds
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(map(alive, pids))


def _late_writer(monkeypatch, seconds: float) -> None:
    """megatron-core's file writers start writing ``seconds`` after they are forked."""
    import time

    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync)

    write = FileSystemWriterAsync.write_preloaded_data

    def late(*a, **k):
        time.sleep(seconds)
        return write(*a, **k)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data", staticmethod(late))


def test_an_async_save_is_the_checkpoint_a_synchronous_save_writes(trainer, tmp_path):
    from megatron_tlt import checkpoint
    from megatron_tlt.checkpoint.background import BackgroundSaves

    expected = saved_tensors(trainer.policy)
    sync = _save(trainer, tmp_path / "sync", 1)
    background = BackgroundSaves()
    path = checkpoint.save(trainer.state, tmp_path / "async", trainer.layout,
                           background=background)
    assert background.in_flight == 1
    assert checkpoint.latest(tmp_path / "async") is None  # not published before finalize
    assert background.finalize(blocking=True) == 1
    assert checkpoint.latest(tmp_path / "async") == path
    runs = [json.loads((p / "run.json").read_text()) for p in (sync, path)]
    assert sorted(runs[0]["files"]) == sorted(runs[1]["files"])  # the same files
    # the same bytes in the shards and per-rank files (.metadata names its folder)
    shards = [n for n in runs[0]["crc32"] if n.endswith(".distcp") or n.startswith("rank_")]
    assert shards and all(runs[0]["crc32"][n] == runs[1]["crc32"][n] for n in shards)
    for p in (sync, path):
        with torch.no_grad():
            for w in trainer.policy.module.parameters():
                w.add_(1.0)
        checkpoint.load(trainer.state, p, trainer.layout)
        got = saved_tensors(trainer.policy)
        assert got.keys() == expected.keys()
        assert all(got[k].equal(v) for k, v in expected.items())


def test_an_async_save_holds_the_state_of_the_moment_it_returned(trainer, tmp_path,
                                                                 monkeypatch):
    """On CPU megatron-core's preload is no copy: the fork of the background writer is
    the snapshot. Weights and optimizer moments changed right after the save returned,
    before the writers wrote a byte, are saved as they were."""
    from megatron_tlt import checkpoint
    from megatron_tlt.checkpoint.background import BackgroundSaves

    _late_writer(monkeypatch, 1.0)
    trainer.state.step = 1
    before = saved_tensors(trainer.policy)
    background = BackgroundSaves()
    checkpoint.save(trainer.state, tmp_path, trainer.layout, background=background)
    with torch.no_grad():
        for p in trainer.policy.module.parameters():
            p.add_(1.0)
        for st in trainer.policy.optimizer.state.values():
            st["exp_avg"].add_(1.0)
            st["exp_avg_sq"].add_(1.0)
    trainer.state.step = 7
    changed = saved_tensors(trainer.policy)
    assert all(not changed[k].equal(v) for k, v in before.items())  # every tensor moved
    background.finalize(blocking=True)
    assert checkpoint.load(trainer.state, tmp_path, trainer.layout).name == "step_0000001"
    assert trainer.state.step == 1
    after = saved_tensors(trainer.policy)
    assert all(after[k].equal(v) for k, v in before.items())


def test_an_async_save_killed_mid_write_leaves_the_previous_checkpoint(trainer, tmp_path,
                                                                       monkeypatch):
    """The rank dies while its background writers write (here: they are killed as the
    rank's death kills them): nothing is published, the previous checkpoint loads, the
    writers' own forks die with them, and the next save clears the remains."""
    import time

    import psutil

    from megatron_tlt import checkpoint
    from megatron_tlt.checkpoint.background import BackgroundSaves

    def started():
        return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]

    _save(trainer, tmp_path, 1)
    _late_writer(monkeypatch, 600.0)
    background = BackgroundSaves()
    trainer.state.step = 2
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    checkpoint.save(trainer.state, tmp_path, trainer.layout, background=background)
    deadline = time.monotonic() + 60
    while len(started()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # the background process, then the file writers it forks
    time.sleep(1.0)  # (all of them)
    helpers = started()
    assert len(helpers) >= 2, helpers
    background.abort()  # SIGKILL the background process

    assert _all_exited([h.pid for h in helpers]), \
        "a file writer outlived the background writer"
    monkeypatch.undo()
    assert (tmp_path / ".step_0000002.partial").is_dir()
    assert checkpoint.latest(tmp_path).name == "step_0000001"
    assert checkpoint.load(trainer.state, tmp_path, trainer.layout).name == "step_0000001"
    _save(trainer, tmp_path, 3, keep_last=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_0000003"]


def test_a_resume_from_an_async_save_continues_exactly(trainer, tmp_path):
    """A step runs while the save before it is written; the step rerun from that
    checkpoint gives the same metrics and weights. The save's timings are recorded."""
    from megatron_tlt import checkpoint

    saver = checkpoint.Saver(asynchronous=True)
    trainer.state.step = 1
    saver.save(trainer.state, tmp_path, trainer.layout)
    first = trainer.train_step(1)
    saver.finalize(blocking=True)
    timings = saver.take_metrics()
    assert 0 < timings["checkpoint/blocking_seconds"] <= timings["checkpoint/publish_seconds"]
    weights = saved_tensors(trainer.policy)
    assert checkpoint.load(trainer.state, tmp_path, trainer.layout).name == "step_0000001"
    again = trainer.train_step(1)
    for key in ("reward/mean", "response_length/mean", "loss/total", "grad_norm"):
        assert again[key] == first[key], key
    got = saved_tensors(trainer.policy)
    assert all(got[k].equal(v) for k, v in weights.items())


def test_a_failing_loop_publishes_the_save_in_flight_only_if_every_rank_fails_there(
        trainer, tmp_path, monkeypatch):
    """An error of one rank alone (its peers may be in another collective) leaves the
    save in flight unpublished; an error every rank raises at the same point (a NaN
    stop) finishes and publishes it."""
    from types import SimpleNamespace

    from megatron_tlt import checkpoint
    from megatron_tlt.rl import safe_point
    from megatron_tlt.rl.nonfinite import NonFiniteError

    run = SimpleNamespace(saver=checkpoint.Saver(asynchronous=True))
    monkeypatch.setattr(safe_point, "dist", SimpleNamespace(  # as one rank of two
        is_initialized=lambda: True, get_world_size=lambda: 2))
    trainer.state.step = 1
    run.saver.save(trainer.state, tmp_path, trainer.layout)
    safe_point.on_error(run.saver, RuntimeError("this rank only"))
    assert run.saver.in_flight == 0 and checkpoint.latest(tmp_path) is None
    trainer.state.step = 2
    run.saver.save(trainer.state, tmp_path, trainer.layout)
    safe_point.on_error(run.saver, NonFiniteError("every rank"))
    assert run.saver.in_flight == 0 and checkpoint.latest(tmp_path).name == "step_0000002"
