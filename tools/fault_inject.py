"""Kill a training run at chosen points and check that resuming reproduces it exactly.

Two modes:

``worker``: run ``pretrain_rl_tlt.py`` (same arguments) with a kill point armed: every
rank SIGKILLs itself when it reaches ``--kill PHASE:STEP`` (STEP counts from 1)::

    torchrun --standalone --nproc_per_node 2 tools/fault_inject.py worker \
        --kill update:3 -- model.hf_path=... checkpoint.save=DIR ...

PHASE is ``rollout`` (generating step STEP's responses), ``update`` (between
backward and the optimizer step of STEP's first mini-batch), ``save`` (writing
checkpoint STEP: its folder made, the per-rank and policy files not yet written) or
``publish`` (checkpoint STEP complete on disk, not yet renamed to its final name; with
``checkpoint.async_save=true`` that comes when the background writes are finalized).

``--term PHASE:STEP[:RANK]`` sends SIGTERM instead, to one rank only (default 1): a
stop request, which abandons the step in progress. PHASE is ``rollout`` (just before
step STEP's generation) or ``update`` (just before step STEP's first micro-batch).

``sweep``: an uninterrupted reference run of ``--steps`` steps (2 ranks, a checkpoint
every step), then ``--points`` runs each killed at a random (phase, step) and resumed
from ``latest`` until done; every resumed run's metrics for each step must equal the
reference's exactly. Prints and writes (``--report``) a JSON summary: the points, the
phases hit (a point whose run exited 0 was not reached), whether every resumed run
reproduced the reference (``all_exact``), seconds per killed-and-resumed pair, and
each point's record::

    python tools/fault_inject.py sweep --make-tiny-policy --policy runs/faults/policy \
        --out runs/faults --points 20 --report docs/results/fault_inject_kill.json

``--policy`` is an HF folder (``tests/rl_fixtures.save_tiny_policy`` writes the tiny one
with SmolLM2's tokenizer; ``--make-tiny-policy`` does that first).

``--config NAME`` (sweep) runs one of ``CONFIGS`` instead of the plain run: speculation
active, on a tiny Llama or a tiny Qwen3-MoE at EP 2 (``--make-tiny-policy`` writes the
model the configuration names, and a random one-layer drafter beside it where it needs
one), in the configurations docs/running_at_scale.md, "Reproducibility", calls exact::

    python tools/fault_inject.py sweep --config moe_ep2_self_standard --make-tiny-policy \
        --policy runs/faults/moe --out runs/faults/moe_self --points 4
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PHASES = ("rollout", "update", "save", "publish")
# metrics that depend on wall-clock time, not on the computation
VOLATILE = ("timing", "time", "timeline", "throughput", "per_second", "seconds", "elapsed",
            "mem", "load")


# Speculation active in every decode step (threshold above the rows, no plain arm, the
# break-even gate off): the tuner's choice among two chains, from modelled costs.
SPEC_ON = ["rollout.speculative.threshold=64", "rollout.speculative.break_even=false",
           "rollout.speculative.arms=*:2_1_2,3_1_3", "rollout.speculative.kinds.self.arms=auto"]
# name -> (model: llama | moe, the drafter: copy (the self-drafter) | trained (the one-layer
# drafter) | both | group (group_history alone; 2 prompts, so the second step drafts
# from the first's responses: a resume restores them from the checkpoint), overrides);
# moe runs at
# EP 2, the drafter group trains the one-layer drafter (coupled sampling: exact)
CONFIGS = {
    "llama_self_standard": ("llama", "copy", []),
    "llama_eagle_standard": ("llama", "trained", []),
    "llama_both_standard": ("llama", "both", []),
    "llama_eagle_coupled_group": ("llama", "trained", [
        "rollout.sampling_mode=coupled", "drafter_group.enable=true"]),
    "moe_ep2_self_standard": ("moe", "copy", []),
    "moe_ep2_group_standard": ("moe", "group", [  # every step speculates (its own arms
        "data.train_size=2", "rollout.speculative.policy=fixed",  # hold 0_0_0)
        "rollout.speculative.strategy=3_1_3"]),
    "moe_ep2_eagle_standard": ("moe", "trained", []),
    "moe_ep2_eagle_coupled_group": ("moe", "trained", [
        "rollout.sampling_mode=coupled", "drafter_group.enable=true"]),
}


def config_args(name: str, policy: Path, costs: Path) -> list[str]:
    """The overrides of configuration ``name`` for ``policy`` (its drafter checkpoint
    ``policy/drafter.safetensors``, ``make_drafter``), charging the step-cost table
    ``costs`` (written by the first run, read by the others)."""
    model, drafter, extra = CONFIGS[name]
    eagle = f"rollout.speculative.drafter={policy / 'drafter.safetensors'}"
    # the drafters: the policy's copy ("copy"), the one-layer drafter ("trained"), both
    kinds = {"copy": ["rollout.speculative.drafter=self"], "trained": [eagle],
             "both": [eagle, "rollout.speculative.kinds.self.also=true"],
             "group": ["rollout.speculative.drafter=group_history"]}[drafter]
    if drafter == "trained" and "drafter_group.enable=true" in extra:
        kinds = []  # the group starts from an untrained drafter
    ep = ["parallel.expert_model_parallel_size=2"] if model == "moe" else []
    return [*ep, *kinds, *SPEC_ON, f"rollout.speculative.step_costs={costs}", *extra]


def make_drafter(policy: Path) -> Path:
    """A random one-layer drafter for ``policy`` at ``policy/drafter.safetensors``."""
    import torch
    from megatron.core import parallel_state as ps

    from megatron_tlt.models import arch_from_source
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter, save_drafter

    if not ps.model_parallel_is_initialized():  # (one process: TP = 1)
        from megatron_tlt.parallel import initialize_model_parallel
        from megatron_tlt.runtime_env import init_distributed

        init_distributed("cpu", "auto")
        initialize_model_parallel(1, 1, seed=0)
    arch = arch_from_source(policy)
    torch.manual_seed(0)
    return save_drafter(EagleDrafter(DrafterConfig.for_target(arch), arch),
                        policy / "drafter.safetensors")


def _die() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


TERM_PHASES = ("rollout", "update")


def _terminate() -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode


def arm(phase: str, step: int, action=_die) -> None:
    """Patch the trainer so this process calls ``action`` (SIGKILL itself) at
    ``phase`` of ``step``; ``action=_terminate`` at ``rollout`` / ``update`` sends a
    stop request at the start of that phase instead."""
    from megatron_tlt.checkpoint import store
    from megatron_tlt.rl import policy as policy_mod
    from megatron_tlt.rl import trainer as trainer_mod

    current = {"step": 0}
    train_step = trainer_mod.Trainer.train_step

    def tracked_step(self, s):
        current["step"] = s + 1
        return train_step(self, s)

    trainer_mod.Trainer.train_step = tracked_step

    def at(name, fn):
        def wrapped(*a, **k):
            if phase == name and current["step"] == step:
                action()
            return fn(*a, **k)
        return wrapped

    if phase == "rollout":
        trainer_mod.rollout_replica = at("rollout", trainer_mod.rollout_replica)
    elif phase == "update" and action is _terminate:
        policy_mod.Policy.train_step = at("update", policy_mod.Policy.train_step)
    elif phase == "update":
        policy_mod.Policy._optimizer_step = at("update", policy_mod.Policy._optimizer_step)
    elif phase == "save":
        store.write_tree = at("save", store.write_tree)
    elif phase == "publish":
        store.publish_dir = at("publish", store.publish_dir)


def worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fault_inject.py worker")
    p.add_argument("--kill", default="", help="PHASE:STEP, e.g. update:3 (empty: none)")
    p.add_argument("--term", default="", help="PHASE:STEP[:RANK], e.g. rollout:2 "
                   "(SIGTERM to RANK, default 1; empty: none)")
    p.add_argument("rest", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    if args.kill:
        phase, step = args.kill.split(":")
        if phase not in PHASES:
            raise SystemExit(f"--kill {args.kill}: phase must be one of {PHASES}")
        arm(phase, int(step))
    if args.term:
        phase, step, *rank = args.term.split(":")
        if phase not in TERM_PHASES:
            raise SystemExit(f"--term {args.term}: phase must be one of {TERM_PHASES}")
        if int(os.environ.get("RANK", "0")) == int(rank[0] if rank else 1):
            arm(phase, int(step), _terminate)
    rest = args.rest[1:] if args.rest[:1] == ["--"] else args.rest
    from megatron_tlt.cli import main

    # the training entry point, run in this process so the patches above apply
    return main(rest)


# ------------------------------------------------------------------ sweep
def run_args(policy: Path, out: Path, ckpt: Path, steps: int) -> list[str]:
    """The tiny 2-rank run: tiny policy, short responses, a checkpoint every step (no
    end-of-run plots: the metrics are what a resume must reproduce)."""
    return [f"model.hf_path={policy}", "grpo.prompts_per_step=2", "grpo.group_size=4",
            "grpo.max_new_tokens=8", "data.train_size=16", "tracking.run_name=run",
            f"tracking.output_dir={out}", "tracking.progress=false", "tracking.wandb_mode=disabled",
            "tracking.plots=false",
            "reward.format_reward=1.0", "reward.format_pattern=k", "train.lr=1e-3",
            f"train.steps={steps}", f"checkpoint.save={ckpt}", "checkpoint.save_interval=1",
            "checkpoint.keep_last=0"]


def launch(args: list[str], *, nproc: int = 2, kill: str = "", term: str = "",
           timeout: int = 900):
    # (the agent checks its workers once a second, not every 0.1 s: less CPU while they run)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc_per_node", str(nproc), "--monitor-interval", "1"] \
        if nproc > 1 else [sys.executable]
    cmd += [str(REPO / "tools" / "fault_inject.py"), "worker", "--kill", kill,
            "--term", term, "--", *args]
    # Output goes to files and the launch runs in its own session; whatever of it is
    # left when it returns is killed with the session (a safety net: the checkpoint
    # writers die with their rank, checkpoint.sharded.writers_die_with_rank).
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        from megatron_tlt.runtime_env import thread_env, threads_for

        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True,
                                start_new_session=True, env=thread_env(threads_for(nproc)))
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, rc, out.read(), err.read())


def _stable(rec, skip=VOLATILE):
    """``rec`` without the keys naming a wall-clock quantity (``skip``), at any depth."""
    if not isinstance(rec, dict):
        return rec
    return {k: _stable(v, skip) for k, v in rec.items() if not any(w in k for w in skip)}


def metrics(run_folder: Path, skip=VOLATILE) -> dict[int, dict]:
    """A run's metrics by step (the last record of a step wins), without the
    wall-clock ones (``VOLATILE``, at any depth, or ``skip``)."""
    from megatron_tlt.tracking import read_metrics

    return {int(rec["step"]): _stable(rec, skip)
            for rec in read_metrics(run_folder / "metrics.jsonl")}


def killed_and_resumed(policy: Path, root: Path, steps: int, kill: str,
                       nproc: int = 2, extra: tuple = ()) -> dict:
    """Kill a run at ``kill``, resume from ``latest`` until it finishes; returns the
    run folder, the checkpoint it resumed from and the launches' return codes."""
    shutil.rmtree(root, ignore_errors=True)
    out, ckpt = root / "runs", root / "ckpt"
    args = run_args(policy, out, ckpt, steps) + list(extra)
    t0 = time.perf_counter()
    first = launch(args, nproc=nproc, kill=kill)
    latest = (ckpt / "latest").read_text().strip() if (ckpt / "latest").is_file() else None
    second = launch(args + [f"checkpoint.load={ckpt}"], nproc=nproc)
    return {"kill": kill, "killed_rc": first.returncode, "resumed_from": latest,
            "resume_rc": second.returncode, "seconds": round(time.perf_counter() - t0, 1),
            "run": out / "run", "stderr": second.stderr[-2000:]}


def compare(reference: dict[int, dict], got: dict[int, dict]) -> list[str]:
    diffs = []
    for step, ref in reference.items():
        if step not in got:
            diffs.append(f"step {step} missing")
            continue
        for k, v in ref.items():
            if got[step].get(k) != v:
                diffs.append(f"step {step} {k}: {v!r} != {got[step].get(k)!r}")
    return diffs


def make_tiny_policy(path: Path, model: str = "llama") -> None:
    """The tests' tiny policy (a checkout's tests/support/rl_fixtures.py, which imports
    its neighbour tiny_models) with SmolLM2's tokenizer, written to ``path``: the
    one-layer Llama, or (``model="moe"``) the two-layer Qwen3-MoE."""
    import importlib.util

    from megatron_tlt.assets import prepare_smollm2

    support = REPO / "tests" / "support"
    for name in ("tiny_models", "rl_fixtures"):
        spec = importlib.util.spec_from_file_location(name, support / f"{name}.py")
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    fixtures = sys.modules["rl_fixtures"]
    if model == "moe":
        fixtures.save_tiny_moe_policy(path, prepare_smollm2())
    else:
        fixtures.save_tiny_policy(path, prepare_smollm2(), layers=1)


def kill_point_run(args, i: int, kill: str, reference: dict) -> dict:
    """One point: killed at ``kill``, resumed, its metrics compared with the reference."""
    res = killed_and_resumed(args.policy, args.out / f"kill_{i:02d}", args.steps, kill,
                             extra=tuple(args.extra))
    got = metrics(res.pop("run")) if res["resume_rc"] == 0 else {}
    res["diffs"] = compare(reference, got)[:5] if got else ["resume failed"]
    res["exact"] = not res["diffs"]
    if res["exact"]:
        res.pop("stderr")
    return res


def sweep_summary(args, points, results, reference, reference_seconds) -> dict:
    hit: dict[str, int] = {}
    for r in results:
        if r["killed_rc"] != 0:
            phase = r["kill"].split(":")[0]
            hit[phase] = hit.get(phase, 0) + 1
    pairs = [r["seconds"] for r in results]
    return {"steps": args.steps, "ranks": 2, "config": args.config or "plain",
            "spec_on_fraction": {s: m.get("spec", {}).get("on_fraction")
                                 for s, m in reference.items()} if args.config else None,
            "points": len(points), "kills": points,
            "phases_hit": hit, "exact": sum(r["exact"] for r in results),
            "all_exact": all(r["exact"] for r in results),
            "killed_nonzero": sum(r["killed_rc"] != 0 for r in results),
            "reference_seconds": reference_seconds,
            "seconds_per_pair": {"mean": round(sum(pairs) / max(len(pairs), 1), 1),
                                 "min": min(pairs, default=0.0),
                                 "max": max(pairs, default=0.0)},
            "compared_metrics": sorted(next(iter(reference.values()))),
            "results": results}


def sweep(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="fault_inject.py sweep")
    p.add_argument("--policy", type=Path, required=True)
    p.add_argument("--make-tiny-policy", action="store_true",
                   help="write the tiny policy (SmolLM2 tokenizer) to --policy first")
    p.add_argument("--out", type=Path, default=Path("runs/faults"))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--points", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--report", type=Path, default=None)
    p.add_argument("--config", default="", choices=["", *CONFIGS],
                   help="a configuration with speculation active (CONFIGS; empty: none)")
    args = p.parse_args(argv)
    args.extra = []
    if args.make_tiny_policy:
        make_tiny_policy(args.policy, CONFIGS[args.config][0] if args.config else "llama")
    if args.config:
        if not (args.policy / "drafter.safetensors").is_file():
            make_drafter(args.policy)
        costs = args.out / "step_costs.json"
        costs.unlink(missing_ok=True)  # calibrated by the reference, read by the rest
        args.extra = config_args(args.config, args.policy, costs)
    ref_root = args.out / "reference"
    shutil.rmtree(ref_root, ignore_errors=True)
    t0 = time.perf_counter()
    r = launch(run_args(args.policy, ref_root / "runs", ref_root / "ckpt", args.steps)
               + args.extra)
    reference_seconds = round(time.perf_counter() - t0, 1)
    if r.returncode != 0:
        print(r.stderr[-3000:], file=sys.stderr)
        return 1
    reference = metrics(ref_root / "runs" / "run")
    rng = random.Random(args.seed)
    # a kill needs a checkpoint to resume from: steps 2..N (step 1 is saved after it)
    points = [f"{rng.choice(PHASES)}:{rng.randint(2, args.steps)}" for _ in range(args.points)]
    results = []
    for i, kill in enumerate(points):
        res = kill_point_run(args, i, kill, reference)
        results.append(res)
        print(f"[{i + 1}/{len(points)}] kill {kill}: killed rc {res['killed_rc']}, resumed "
              f"from {res['resumed_from']}, exact={res['exact']} ({res['seconds']} s)",
              flush=True)
    summary = sweep_summary(args, points, results, reference, reference_seconds)
    text = json.dumps(summary, indent=1) + "\n"
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(text)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1))
    print(f"{summary['exact']}/{summary['points']} resumed runs reproduce the reference "
          f"exactly")
    return 0 if summary["exact"] == summary["points"] else 1


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("worker", "sweep"):
        print(__doc__)
        return 2
    mode, rest = sys.argv[1], sys.argv[2:]
    return worker(rest) if mode == "worker" else sweep(rest)


if __name__ == "__main__":
    sys.exit(main())
