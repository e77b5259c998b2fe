"""train.offload_during_rollout (rl/offload.py): the update's memory lent to the rollout.

Three GRPO steps with it on give the metrics, weights and optimizer state of the same
steps with it off, bit for bit (an evaluation inside the window included); while lent
the gradient buffers, Adam's moments and the fp32 main parameters hold no memory and a
checkpoint refuses the policy; a checkpoint written by a run with it on resumes to the
uninterrupted run's steps (the checkpoint holds the real state, not the lent one).
"""

from __future__ import annotations

import pytest
import torch

from rl_fixtures import save_tiny_policy, saved_tensors, tiny_run_args


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory):
    return save_tiny_policy(tmp_path_factory.mktemp("offload") / "policy", smollm2_dir)


def _run(policy, out, steps: int, *extra: str, resume=None):
    """A trainer for the tiny policy that ran ``steps`` steps (two optimizer steps each:
    two mini-batches, so the old log-prob pass runs too), evaluations at step 0 and
    after step 2."""
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.trainer import Trainer

    cfg = load_config([], [*tiny_run_args(policy, out), "train.lr=1e-3",
                           "train.global_batch_size=4", "rollout.cpu_kernels=false",
                           "data.eval_size=2", "train.eval_interval=2",
                           f"train.steps={steps}", *extra])
    trainer = Trainer(cfg, setup(cfg))
    if resume is not None:
        trainer.resume(resume)
    history = trainer.train()
    return trainer, [_deterministic(h) for h in history]


def _deterministic(metrics: dict) -> dict:
    """A step's metrics without the wall-clock ones."""
    return {k: v for k, v in metrics.items() if k not in ("timing", "timeline")
            and "second" not in k and not k.startswith("checkpoint/")}


def _same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lent_steps_equal_the_plain_steps_and_the_state_really_leaves(
        tiny_policy, tmp_path, single_process_parallel, dtype):
    off, m_off = _run(tiny_policy, tmp_path / "off", 2, f"model.dtype={dtype}")
    on, m_on = _run(tiny_policy, tmp_path / "on", 2, f"model.dtype={dtype}",
                    "train.offload_during_rollout=true")
    assert [h["step"] for h in m_on] == [0, 1, 2] and "eval/accuracy" in m_on[-1]
    assert [sorted(h) for h in m_on] == [sorted(h) for h in m_off]
    assert [[k for k in h if h[k] != g[k]] for h, g in zip(m_on, m_off)] == [[]] * 3
    state = saved_tensors(on.policy)
    _same_tensors(state, saved_tensors(off.policy))
    assert off.update_memory.restore() == {}  # disabled: nothing lent, nothing timed

    from megatron_tlt.checkpoint.safe_files import CheckpointError
    from megatron_tlt.rl.offload import grad_buffer_bytes, update_only_tensors

    mem = on.update_memory
    lent = update_only_tensors(on.policy)
    n = sum(p.numel() for p in on.policy.module.parameters())
    # Adam's two moments (+ the fp32 main copy of 16-bit weights), fp32 gradients
    assert sum(t.numel() * 4 for t in lent) == n * (8 if dtype == "float32" else 12)
    assert grad_buffer_bytes(on.policy.ddp) == 4 * n
    mem.lend()
    assert mem.is_lent and mem.bytes_lent == n * (12 if dtype == "float32" else 16)
    assert all(t.untyped_storage().nbytes() == 0 for t in lent)
    assert all(b.grad_data.untyped_storage().nbytes() == 0 for b in on.policy.ddp.buffers)
    assert all(p.untyped_storage().nbytes() > 0 for p in on.policy.module.parameters())
    with pytest.raises(CheckpointError, match="train.offload_during_rollout"):
        saved_tensors(on.policy)
    seconds = mem.restore()
    assert set(seconds) == {"offload", "reload"} and not mem.is_lent
    _same_tensors(saved_tensors(on.policy), state)


def test_a_checkpoint_of_a_lent_run_resumes_exactly(tiny_policy, tmp_path,
                                                    single_process_parallel):
    on = ["train.offload_during_rollout=true"]
    ckpt = tmp_path / "ckpt"
    full, m_full = _run(tiny_policy, tmp_path / "full", 2, *on, f"checkpoint.save={ckpt}",
                        "checkpoint.save_interval=1", "checkpoint.keep_last=2")
    assert (ckpt / "latest").read_text().strip() == "step_0000002"
    part, m_part = _run(tiny_policy, tmp_path / "part", 2, *on,
                        resume=ckpt / "step_0000001")
    assert [h["step"] for h in m_part] == [2]
    assert m_part == m_full[-1:]  # step 2's metrics and evaluation
    _same_tensors(saved_tensors(part.policy), saved_tensors(full.policy))
