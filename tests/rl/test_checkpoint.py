"""Run checkpoints on disk: safe formats only (a crafted pickle runs nothing), corrupt or
partial checkpoints (a truncated file, a flipped byte) named in the error and skipped on
request, a save killed before it is published leaves the previous one loadable,
keep-last-N, exact state round trip, no checkpoint-writer process outlives a killed
rank."""

from __future__ import annotations

import json
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from rl_fixtures import save_tiny_policy


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


def test_a_rank_killed_mid_save_leaves_no_writer_process_behind(tmp_path):
    """megatron-core's file writer is a forked process: SIGKILL the rank while it
    writes, and the writer goes too; the rank starts no other helper process."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from cli import REPO

    pidfile = tmp_path / "writer.pid"
    (tmp_path / "ckpt").mkdir()
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "tests" / "support" / "mp_checkpoint_writer_worker.py"),
         str(tmp_path / "ckpt"), str(pidfile)], stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not pidfile.is_file() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pidfile.is_file(), proc.communicate(timeout=60)[1][-3000:]
        writer, started = map(int, pidfile.read_text().split())
        assert started == 1  # the writer only: no multiprocessing manager process
        proc.kill()
        proc.wait(timeout=60)

        def alive(pid):
            try:
                return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
            except psutil.NoSuchProcess:
                return False

        deadline = time.monotonic() + 30
        while alive(writer) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(writer), "the checkpoint writer outlived its rank"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of it
        except ProcessLookupError:
            pass
