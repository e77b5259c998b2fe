#!/usr/bin/env python
"""Drafter drift: does the online drafter group keep acceptance up while the policy moves?

    python tools/bench_drift.py --quick                       # 3 short arms
    python tools/bench_drift.py --steps 12 --json docs/results/bench_drift_cpu.json
    python tools/bench_drift.py --quick train.lr=3e-4         # any recipe override

K GRPO steps of SmolLM2 (examples/rl/smollm2_cpu.yaml, 2 DP replicas, gloo, one thread
per process) with a policy learning rate high enough that the policy drifts
(``--policy-lr``), three arms from the same weights, seed and prompts, coupled sampling
(so every arm decodes the same responses whatever its drafter, up to floating-point
near-ties) and a fixed drafting strategy (``--strategy``, so every tail step measures
the drafter's acceptance instead of the tuner declining a weak drafter):

- ``frozen``: the warm-up drafter (``--drafter``, default the demo's), never trained: its
  drafter group runs with ``drafter_group.train=false``, so the same after-update canary
  measures its alpha each step and nothing trains in its tail;
- ``online``: the same drafter, trained by the drafter group in the rollout tail;
- ``cold``:   the drafter group from a random drafter.

Each arm is one ``torchrun pretrain_rl_tlt.py`` run; its metrics.jsonl is read back.
Reported per step: acceptance length (``spec.accept_len``), the canary's alpha
(``drafter/alpha``), step and rollout time. JSON keys:

- ``accept_gain``: mean online / frozen acceptance length over the last half of steps;
- ``critical_path_overhead``: mean over steps of (sync + preemption wait) / step time,
  online arm (``drafter/sync_seconds`` + ``drafter/preempt_latency``);
- ``contention_slowdown``: mean over steps of the last replica's rollout time online /
  frozen, minus 1 (replicas that train share the CPU's cores and memory bandwidth with
  the replica still decoding; the online drafter's better acceptance works the other
  way, so this is an upper bound on neither: it is what the still-running replica saw);
- ``cold_start_accept``: the cold arm's acceptance length at its last step;
- ``drift_alpha_gain``: mean online / frozen canary alpha over the last 10 steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from megatron_tlt.bench.launcher import torchrun
from megatron_tlt.drafter_training.prepared import demo_drafter
from megatron_tlt.fileio import write_json
from megatron_tlt.tracking import read_metrics

REPO = Path(__file__).resolve().parents[1]

ARMS = ("frozen", "online", "cold")


def arm_args(arm: str, drafter: Path, a) -> list[str]:
    common = ["--config", str(REPO / "examples" / "rl" / "smollm2_cpu.yaml"),
              f"train.steps={a.steps}", f"train.lr={a.policy_lr}",
              f"grpo.max_new_tokens={a.max_new_tokens}",
              f"grpo.prompts_per_step={a.prompts}", f"grpo.group_size={a.group_size}",
              "train.eval_interval=0",  # held-out accuracy measures nothing here
              "rollout.sampling_mode=coupled", *strategy_args(a.strategy), "tracking.wandb_project=",
              "tracking.plots=false", "tracking.progress=false",
              f"tracking.output_dir={a.out_dir}", f"tracking.run_name={arm}"]
    if arm == "frozen":
        return common + [f"rollout.speculative.drafter={drafter}",
                         "drafter_group.enable=true", "drafter_group.train=false"]
    if arm == "online":
        return common + [f"rollout.speculative.drafter={drafter}",
                         "drafter_group.enable=true"]
    return common + ["rollout.speculative.drafter=", "drafter_group.enable=true"]


def strategy_args(strategy: str) -> list[str]:
    """A fixed strategy (default) speculates on every step below the threshold, so each
    step measures its drafter's acceptance; "adaptive" leaves the recipe's tuner."""
    if strategy == "adaptive":
        return []
    return ["rollout.speculative.policy=fixed", f"rollout.speculative.strategy={strategy}"]


def per_step(recs: list[dict]) -> list[dict]:
    out = []
    for r in recs:
        spec = r.get("spec") or {}
        out.append({"step": r["step"], "accept_len": spec.get("accept_len"),
                    "alpha": r.get("drafter/alpha"), "step_s": r["timing"]["step"],
                    "rollout_s": max(r["timeline"]["replica_finish"]),
                    "drafter_steps": r.get("drafter/steps"),
                    "sync_s": r.get("drafter/sync_seconds"),
                    "preempt_s": r.get("drafter/preempt_latency"),
                    "idle_used": r.get("drafter/idle_used_fraction"),
                    "identical": r.get("drafter/identical"),
                    "reward": r["reward/mean"]})
    return out


def _mean(xs):
    xs = [x for x in xs if x is not None]
    return statistics.fmean(xs) if xs else None


def summarise(rows: dict[str, list[dict]]) -> dict:
    res: dict = {"per_step": rows}
    fro, onl = rows.get("frozen"), rows.get("online")
    if fro and onl:
        last_on = _mean([r["alpha"] for r in onl[-10:]])
        last_fr = _mean([r["alpha"] for r in fro[-10:]])
        res["drift_alpha_gain"] = last_on / last_fr if last_on and last_fr else None
        half = len(onl) // 2
        a_on = _mean([r["accept_len"] for r in onl[half:]])
        a_fr = _mean([r["accept_len"] for r in fro[half:]])
        res["accept_gain"] = a_on / a_fr if a_on and a_fr else None
        res["contention_slowdown"] = _mean(
            [o["rollout_s"] / f["rollout_s"] - 1 for o, f in zip(onl, fro)])
        res["step_time_online_over_frozen"] = _mean(
            [o["step_s"] / f["step_s"] for o, f in zip(onl, fro)])
    if onl:
        res["critical_path_overhead"] = _mean(
            [((r["sync_s"] or 0) + (r["preempt_s"] or 0)) / r["step_s"] for r in onl])
        res["drafters_identical_every_step"] = all(r["identical"] for r in onl)
    if rows.get("cold"):
        res["cold_start_accept"] = rows["cold"][-1]["accept_len"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true",
                    help="4 steps, 4 prompts x 4 samples, 96 new tokens")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--policy-lr", type=float, default=1e-4)
    ap.add_argument("--drafter", default=None, help="warm-up drafter (default: the demo's)")
    ap.add_argument("--strategy", default="4_1_4",
                    help="fixed drafting strategy for every arm, or 'adaptive'")
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--out-dir", default=str(REPO / "runs" / "bench_drift"))
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*", help="section.field=value for every arm")
    a = ap.parse_args(argv)
    if a.quick:
        a.steps, a.prompts, a.group_size, a.max_new_tokens = 4, 4, 4, 96
    drafter = Path(a.drafter) if a.drafter else demo_drafter()
    rows = {}
    t0 = time.perf_counter()
    for arm in a.arms.split(","):
        rc = torchrun(f"drift/{arm}", 2, REPO / "pretrain_rl_tlt.py",
                      arm_args(arm, drafter, a) + list(a.overrides), t0, cwd=REPO)
        if rc != 0:
            print(f"[drift] arm {arm} failed (exit {rc})", file=sys.stderr)
            return rc
        rows[arm] = per_step([r for r in read_metrics(Path(a.out_dir) / arm / "metrics.jsonl")
                              if "reward/mean" in r])
    res = summarise(rows)
    res["config"] = {"steps": a.steps, "prompts": a.prompts, "group_size": a.group_size,
                     "max_new_tokens": a.max_new_tokens, "policy_lr": a.policy_lr,
                     "strategy": a.strategy,
                     "drafter": str(drafter), "overrides": a.overrides,
                     "minutes": (time.perf_counter() - t0) / 60}
    for arm, rs in rows.items():
        print(f"{arm:>7}: accept " + " ".join(
            "-" if r["accept_len"] is None else f"{r['accept_len']:.2f}" for r in rs)
            + "  alpha " + " ".join("-" if r["alpha"] is None else f"{r['alpha']:.3f}"
                                    for r in rs)
            + "  step s " + " ".join(f"{r['step_s']:.0f}" for r in rs))
    print(json.dumps({k: v for k, v in res.items() if k != "per_step"}, indent=1))
    if a.json:
        write_json(a.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
