"""Stopping on request: SIGTERM to one rank of a 2-rank run makes every rank checkpoint
after the same step and exit with the requeue code, and a resume continues from that
checkpoint; a request as the update starts abandons the step and restores what it
changed; the SLURM scripts' dry run and their requeue logic (faked SLURM commands)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli import REPO, TORCHRUN_MONITOR, run_script
from megatron_tlt.runtime_env import thread_env, threads_for
from rl_fixtures import save_tiny_policy, tiny_run_args

SBATCH = REPO / "scripts" / "slurm" / "grpo.sbatch"


@pytest.fixture(scope="module")
def tiny_policy(smollm2_dir, tmp_path_factory) -> Path:
    return save_tiny_policy(tmp_path_factory.mktemp("preempt") / "policy", smollm2_dir)


def test_sigterm_to_one_rank_checkpoints_every_rank_exits_75_and_resumes(tiny_policy,
                                                                          tmp_path):
    import psutil

    from megatron_tlt.rl.preemption import REQUEUE_EXIT_CODE

    out, ckpt = tmp_path / "runs", tmp_path / "ckpt"
    args = tiny_run_args(tiny_policy, out, f"checkpoint.save={ckpt}", "rollout.cpu_kernels=false")
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", *TORCHRUN_MONITOR, str(REPO / "pretrain_rl_tlt.py"), *args, "train.steps=5"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=thread_env(threads_for(2)))
    metrics = out / "run" / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            if metrics.is_file() and metrics.read_bytes().count(b"\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        ranks = {int(p.environ()["RANK"]): p for p in psutil.Process(proc.pid).children()}
        ranks[1].send_signal(signal.SIGTERM)  # rank 0 gets nothing: the ranks agree
        stdout, stderr = proc.communicate(timeout=600)  # the hang detector
    finally:
        proc.kill()
    marker = json.loads((ckpt / "requeue").read_text())
    step = marker["step"]
    assert marker["exit_code"] == REQUEUE_EXIT_CODE and 1 <= step < 5, marker
    assert (ckpt / "latest").read_text().strip() == f"step_{step:07d}"
    assert Path(marker["checkpoint"]) == ckpt / f"step_{step:07d}"
    assert f"stopped after step {step}" in stdout and "exit code 75" in stdout, stdout
    assert "exitcode  : 75" in stderr or "exitcode: 75" in stderr, stderr[-3000:]
    assert not (ckpt / "STOP").exists()
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] \
        == list(range(1, step + 1))

    r = run_script("pretrain_rl_tlt.py", *args, f"checkpoint.load={ckpt}",
                   f"train.steps={step + 1}", nproc=2, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"resumed from {ckpt / f'step_{step:07d}'} at step {step}" in r.stdout
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] \
        == list(range(1, step + 2))


def test_a_stop_request_mid_update_abandons_the_step_and_restores_what_it_changed(
        tiny_policy, single_process_parallel, tmp_path):
    """A request as the update starts: no micro-batch runs, no optimizer step; the
    sampler's position and the RNG streams the step used are restored, the state of
    the end of the last completed step (here: none, step 0) is checkpointed, Stopped;
    a second stop with that checkpoint under `latest` does not write it again."""
    import torch

    from megatron_tlt import checkpoint
    from megatron_tlt.config import load_config
    from megatron_tlt.launch import setup
    from megatron_tlt.rl.preemption import Stopped, StopRequest
    from megatron_tlt.rl.trainer import Trainer

    ckpt = tmp_path / "ckpt"
    cfg = load_config([], [f"model.hf_path={tiny_policy}", "grpo.prompts_per_step=2",
                           "grpo.group_size=4", "grpo.max_new_tokens=8", "data.train_size=16",
                           "rollout.cpu_kernels=false", "train.optimizer=torch",
                           "reward.format_reward=1.0", "reward.format_pattern=k",
                           f"checkpoint.save={ckpt}"])
    stop = StopRequest("", deadline_s=0)
    trainer = Trainer(cfg, setup(cfg), stop=stop)
    weights = [p.detach().clone() for p in trainer.policy.module.parameters()]
    sampler, rng = trainer.state.sampler.state_dict(), torch.get_rng_state()
    micro_batches = []
    schedule, train_step = trainer.policy._schedule, trainer.policy.train_step

    def requested(*a, **k):
        torch.rand(3)  # the step draws from the global stream before the request
        stop.request("test")
        return train_step(*a, **k)

    def counted(mbs, *a, **k):
        out = schedule(mbs, *a, **k)
        micro_batches.append(len(out))
        return out

    trainer.policy.train_step, trainer.policy._schedule = requested, counted
    with pytest.raises(Stopped) as e:
        trainer.train_step(0)
    assert e.value.abandoned and e.value.step == 0 and e.value.exit_code == 75
    assert micro_batches == [0]  # the loop stopped before the first micro-batch
    for st in trainer.policy.optimizer.state.values():  # AdamW never stepped: the
        # moments it holds from the build are still zero
        assert float(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    assert all(torch.equal(a, b) for a, b in
               zip(weights, trainer.policy.module.parameters()))
    assert trainer.state.step == 0
    assert trainer.state.sampler.state_dict() == sampler
    assert torch.equal(torch.get_rng_state(), rng)
    assert e.value.checkpoint == ckpt / "step_0000000"
    assert checkpoint.verify(e.value.checkpoint)["step"] == 0
    # still requested: the next try stops at the step barrier, and `latest` already
    # holds the state, so nothing is written again
    written = (ckpt / "step_0000000" / "run.json").stat().st_mtime_ns
    with pytest.raises(Stopped) as e:
        trainer.train_step(0)
    assert e.value.abandoned and e.value.checkpoint == ckpt / "step_0000000"
    assert (ckpt / "step_0000000" / "run.json").stat().st_mtime_ns == written
    assert micro_batches == [0] and trainer.state.sampler.state_dict() == sampler


def test_a_request_on_one_rank_reaches_the_others_through_the_store():
    """Ranks share requests through the rendezvous store (here an in-memory one): a
    request recorded on one is pending on the other within its poll, no collective."""
    import torch.distributed as dist

    from megatron_tlt.rl.preemption import StopRequest

    store = dist.HashStore()
    a, b = (StopRequest(poll_seconds=0.02, store=store) for _ in range(2))
    for r in (a, b):  # the polls only (install() also sets signal handlers)
        r._poller = threading.Thread(target=r._poll, daemon=True)
        r._poller.start()
    try:
        time.sleep(0.2)
        assert not a.pending() and not b.pending()
        b.request("SIGTERM")
        deadline = time.monotonic() + 30
        while not a.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert a.pending() and a.reason == "a request on another rank"
    finally:
        a.uninstall()
        b.uninstall()


def test_no_deadline_outlives_uninstall():
    """A request that lands after (or while) the handlers are uninstalled arms no
    deadline: a timer left running would end the process with the forced exit code
    long after the run (or a test) moved on."""
    from megatron_tlt.rl.preemption import StopRequest

    r = StopRequest(deadline_s=3600)
    r.uninstall()
    r.request("a poll that raced the uninstall")
    assert r.pending() and r._timer is None
    armed = StopRequest(deadline_s=3600)
    armed.request("SIGTERM")
    assert armed._timer is not None and armed._timer.is_alive()
    armed.uninstall()
    armed._timer.join(timeout=10)
    assert not armed._timer.is_alive()  # cancelled


def _fake_slurm(tmp_path: Path, nodes: int, srun_body: str = "exit 0") -> dict:
    """SLURM's environment for job 4242 on ``nodes`` nodes, and fake scontrol / srun /
    python on PATH (scontrol records its calls)."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    hosts = " ".join(f"gpu{k:02d}" for k in range(1, nodes + 1))
    (bin_ / "scontrol").write_text(
        f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol.log\n'
        f'[[ "$1 $2" == "show hostnames" ]] && printf "%s\\n" {hosts}\nexit 0\n')
    (bin_ / "srun").write_text(f"#!/bin/bash\n{srun_body}\n")
    (bin_ / "python").write_text("#!/bin/bash\nexit 0\n")  # the layout check
    for f in bin_.iterdir():
        f.chmod(0o755)
    return {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
            "SLURM_JOB_NAME": "grpo", "SLURM_NNODES": str(nodes),
            "SLURM_JOB_NODELIST": f"gpu[01-{nodes:02d}]", "SLURM_GPUS_ON_NODE": "8",
            "SLURM_SUBMIT_DIR": str(REPO), "CKPT_DIR": str(tmp_path / "ckpt"),
            "WANDB_PROJECT": "rl", "WANDB_ENTITY": "team"}


@pytest.mark.parametrize("nodes", [1, 4])
def test_slurm_dry_run_prints_the_rendezvous_and_resume(nodes, tmp_path):
    env = _fake_slurm(tmp_path, nodes, srun_body="exit 99")
    script = SBATCH if nodes > 1 else SBATCH.with_name("grpo_1node.sbatch")
    recipe = "examples/rl/qwen2.5_7b_grpo.yaml"

    def dry() -> list[str]:
        r = subprocess.run(["bash", str(script), recipe, "train.lr=2e-6"], env={
            **env, "DRY_RUN": "1"}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.splitlines()

    lines = dry()
    ckpt = tmp_path / "ckpt"
    run = next(x for x in lines if x.startswith("srun "))
    check = next(x for x in lines if "--dry-run" in x)
    assert f"--nnodes {nodes} --nproc_per_node 8 --rdzv_id 4242 --rdzv_backend c10d " \
           f"--rdzv_endpoint gpu01:29500 pretrain_rl_tlt.py --config {recipe}" in run
    assert f"--world-size {nodes * 8}" in check
    for arg in ("tracking.run_name=grpo-4242", f"checkpoint.save={ckpt}",
                "tracking.wandb_project=rl", "tracking.wandb_mode=online",
                "tracking.wandb_entity=team"):
        assert arg in run and arg in check, (arg, run)
    assert run.endswith("train.lr=2e-6 ")  # the user's overrides come last and win
    assert "checkpoint.load" not in run  # nothing to resume yet
    assert any(x.startswith("export MASTER_ADDR=gpu01 MASTER_PORT=29500") for x in lines)
    assert not (tmp_path / "ckpt").exists()  # a dry run writes nothing

    ckpt.mkdir()
    (ckpt / "latest").write_text("step_0000003\n")
    assert f"checkpoint.load={ckpt}" in next(x for x in dry() if x.startswith("srun "))


def test_slurm_script_turns_the_signal_into_a_stop_file_and_requeues(tmp_path):
    """The batch shell gets SIGTERM (--signal=B:TERM): the trap writes CKPT_DIR/STOP, the
    run (a fake srun) stops on it and leaves the requeue marker; the script requeues."""
    ckpt = tmp_path / "ckpt"
    srun = (f'while [[ ! -f {ckpt}/STOP ]]; do sleep 0.05; done\n'
            f'echo \'{{"exit_code": 75}}\' > {ckpt}/requeue\nexit 1')
    env = _fake_slurm(tmp_path, 2, srun_body=srun)
    proc = subprocess.Popen(["bash", str(SBATCH), "examples/rl/qwen2.5_7b_grpo.yaml"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    while not ckpt.is_dir():  # the script is past its set-up
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "requeueing job 4242" in out
    assert "requeue 4242" in (tmp_path / "scontrol.log").read_text().splitlines()
