#!/usr/bin/env python
"""The CPU learning run (docs/learning.md): GRPO on SmolLM2-135M in two arms, TLT off
and TLT on, with the same seeds and data order, then their curves compared.

    python tools/learn.py [--arms off,tlt] [--out runs/learn] [--json PATH]
                          [--figure PATH] [--report-only] [section.field=value ...]
    python tools/learn.py --speed [--speed-steps 6]  # then the fair speed comparison

Each arm is ``torchrun --nproc_per_node 2 pretrain_rl_tlt.py --config
examples/rl/smollm2_learn.yaml`` (48 steps, 200 held-out prompts answered greedily
every 8 steps) in ``{out}/{arm}``, checkpointing to ``{out}/{arm}-ckpt`` every 8
steps. ``kill -TERM`` this script (not torchrun: it would signal its ranks twice) and
the arm in progress checkpoints its last finished step and exits (the stop file
``{out}/{arm}-ckpt/STOP``); run it again and the arm resumes from its last checkpoint;
a finished arm is not run again. The arms:

- ``off``: no speculation;
- ``tlt``: standard sampling (so the arms are independent samples of the same
  distribution), both drafter kinds (the demo's one-layer drafter, trained by the
  drafter group in each step's tail, and the policy's int8 copy).

Then (also alone, ``--report-only``) it reads both run folders and writes the JSON
(each arm's held-out accuracy and reward curves, rollout seconds per step, the final
held-out difference with its paired 95 % interval and McNemar's p) and the figure,
and prints what they show. Extra ``section.field=value`` overrides go to both arms.

The arms' own rollout seconds do not compare speed (their policies drift to different
response lengths; they run at different times). ``--speed`` (after the arms, ~20 min)
measures it fairly: the ``tlt`` arm's final checkpoint exported to Hugging Face
(``{out}/speed/policy``, its trained drafter beside it), then ``tools/bench_e2e.py``
with the learn recipe and coupled sampling: TLT (that drafter and the int8 copy) against
no speculation, the two arms' GRPO steps interleaved on the same machine from the same
weights, so both roll out the same responses and only the speed differs; then an A/A
run of the same shape (both plain), the ratio's noise. The report adds them
(``speed`` in the JSON).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import signal
import sys
import time
from pathlib import Path

from megatron_tlt.bench.launcher import torchrun
from megatron_tlt.checkpoint.store import latest
from megatron_tlt.rl.learning import compare, read_run, speed, write_figure

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "examples" / "rl" / "smollm2_learn.yaml"
DEMO_RECIPE = REPO / "examples" / "rl" / "smollm2_cpu.yaml"
ARMS = ("off", "tlt")
ARM_WORDS = {"off": "no speculation",
             "tlt": "standard sampling; the demo's one-layer drafter, trained by the drafter "
                    "group in each step's tail, and the policy's int8 copy, chosen per "
                    "batch-size bucket"}


def arm_args(arm: str) -> list[str]:
    """The overrides that make an arm."""
    if arm == "off":
        return ["rollout.speculative.drafter=", "rollout.speculative.kinds.self.also=false",
                "drafter_group.enable=false"]
    if arm == "tlt":
        from megatron_tlt.drafter_training.prepared import demo_drafter

        return [f"rollout.speculative.drafter={demo_drafter(DEMO_RECIPE)}",
                "rollout.speculative.kinds.self.also=true", "drafter_group.enable=true",
                "rollout.sampling_mode=standard"]
    raise SystemExit(f"--arms: unknown arm {arm!r}; choose from {', '.join(ARMS)}")


def steps_of(overrides: list[str]) -> int:
    """train.steps: the recipe's, or an override's."""
    for o in overrides:
        if o.startswith("train.steps="):
            return int(o.split("=", 1)[1])
    from megatron_tlt.config import load_config

    return load_config([RECIPE]).train.steps


def run_arm(arm: str, out: Path, overrides: list[str], t0: float) -> int:
    run_dir, ckpt = out / arm, out / f"{arm}-ckpt"
    done = read_run(run_dir)["steps"]
    if done and done[-1]["step"] >= steps_of(overrides) and latest(ckpt) is not None:
        print(f"[learn] {arm}: finished ({done[-1]['step']} steps in {run_dir})", flush=True)
        return 0
    resume = latest(ckpt) is not None
    if not resume and run_dir.exists():  # started, killed before its first checkpoint
        aside = run_dir.with_name(f"{arm}.abandoned-{int(time.time())}")
        run_dir.rename(aside)
        print(f"[learn] {arm}: no checkpoint yet; its folder moved to {aside}", flush=True)
    print(f"[learn] {arm}: " + (f"resuming from {latest(ckpt)}" if resume else "starting"),
          flush=True)
    args = ["--config", RECIPE, f"tracking.output_dir={out}", f"tracking.run_name={arm}",
            f"checkpoint.save={ckpt}", *arm_args(arm), *overrides]
    if resume:
        args.append(f"checkpoint.load={ckpt}")

    def stop(signum, frame):  # the run's stop file: every rank checkpoints and exits 75
        ckpt.mkdir(parents=True, exist_ok=True)
        (ckpt / "STOP").touch()
        print(f"[learn] {arm}: stop requested; it checkpoints its last finished step and "
              "exits (run again to resume)", flush=True)

    for sig in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(sig, stop)
    return torchrun(f"learn {arm}", 2, REPO / "pretrain_rl_tlt.py", args, t0, cwd=REPO)


def run_speed(out: Path, steps: int) -> int:
    """The fair speed comparison on the ``tlt`` arm's final policy (module docstring)."""
    import subprocess

    from megatron_tlt.checkpoint.export import export_run_checkpoint

    folder = out / "speed"
    policy = folder / "policy"
    if not (policy / "config.json").is_file():
        if latest(out / "tlt-ckpt") is None:
            print(f"[learn] --speed: no checkpoint of the tlt arm in {out / 'tlt-ckpt'}; "
                  "run the arms first", flush=True)
            return 2
        export_run_checkpoint(out / "tlt-ckpt", policy)
    drafter = policy / "drafter" / "drafter.safetensors"
    # the pair: the arm's two kinds (its trained drafter and the int8 copy beside it)
    tlt = ["--drafter", str(drafter), "--self-too"] if drafter.is_file() else \
        ["--drafter", "self"]
    cap = load_recipe_cap()
    commands = {}
    for name, extra in (("pair", tlt), ("aa", ["--drafter", "off"])):
        cmd = [sys.executable, str(REPO / "tools" / "bench_e2e.py"), "--config", str(RECIPE),
               "--sampling-mode", "coupled", "--steps", str(steps), "--max-new-tokens",
               str(cap), *extra, "--json", str(folder / f"{name}.json"),
               f"model.hf_path={policy}"]
        print(f"[learn] speed {name}: {' '.join(cmd[1:])}", flush=True)
        rc = subprocess.run(cmd, cwd=REPO).returncode
        if rc != 0:
            return rc
        commands[name] = "python " + " ".join(cmd[1:]).replace(f"{REPO}/", "")
    (folder / "commands.json").write_text(json.dumps(commands, indent=1) + "\n")
    return 0


def load_recipe_cap() -> int:
    from megatron_tlt.config import load_config

    return load_config([RECIPE]).grpo.max_new_tokens


def report(out: Path, arms: list[str], json_path: Path, figure: Path, command: str) -> dict:
    from megatron_tlt.rollout.cpu_kernels import cpu_info

    runs = {arm: read_run(out / arm) for arm in arms}
    result = compare(runs, baseline="off")
    pair, aa = out / "speed" / "pair.json", out / "speed" / "aa.json"
    if pair.is_file():
        result["speed"] = speed(json.loads(pair.read_text()),
                                json.loads(aa.read_text()) if aa.is_file() else None)
        commands = out / "speed" / "commands.json"
        if commands.is_file():
            result["speed"]["commands"] = json.loads(commands.read_text())
    model, flags = cpu_info()
    result["config"] = {
        "command": command, "recipe": str(RECIPE.relative_to(REPO)),
        "date": datetime.date.today().isoformat(), "cpu": model,
        "cpu_isa": next((i for i, f in (("avx512", "avx512f"), ("avx2", "avx2"))
                         if f in flags), "portable"),
        "machine": platform.machine(), "arms": {a: ARM_WORDS[a] for a in arms}}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    if any(r["evals"] for r in runs.values()):
        write_figure(result, figure)
    for line in summary_lines(result):
        print("[learn] " + line, flush=True)
    print(f"[learn] wrote {json_path} and {figure}", flush=True)
    return result


def summary_lines(result: dict) -> list[str]:
    lines = []
    for arm, r in result["arms"].items():
        rise = r["rise"]
        if rise:
            lines.append(
                f"{arm}: held-out accuracy {rise['step0']:.3f} at step 0 (95 % "
                f"[{rise['step0_lo']:.3f}, {rise['step0_hi']:.3f}]) -> {rise['final']:.3f} at "
                f"step {rise['final_step']} (best {rise['best']:.3f} at step "
                f"{rise['best_step']}); "
                + ("above" if rise["final_beyond_step0_interval"] else
                   "below" if rise["final_below_step0_interval"] else "within")
                + " the step-0 interval")
        if r["rollout_s_mean"]:
            lines.append(f"{arm}: {r['steps_done']} steps, rollout {r['rollout_s_mean']:.1f} s "
                         "per step on average")
    sp = result.get("speed")
    if sp and sp["steps"]:
        lo, hi = sp["rollout_speedup_range"]
        lines.append(
            f"speed, same policy and responses (coupled, {len(sp['steps'])} steps): off / tlt "
            f"rollout time {sp['rollout_speedup_median']:.2f} (median; steps {lo:.2f}-{hi:.2f}; "
            f"total {sp['rollout_speedup_total']:.2f})"
            + (f", A/A {sp['aa_rollout_ratio_median']:.2f} "
               f"({sp['aa_rollout_ratio_range'][0]:.2f}-{sp['aa_rollout_ratio_range'][1]:.2f})"
               if sp.get("aa_rollout_ratio_median") else "")
            + f"; tail {sp['off_tail_s_mean']:.1f} -> {sp['tlt_tail_s_mean']:.1f} s")
        if sp.get("speedup_vs_plain_median"):
            lo, hi = sp["speedup_vs_plain_range"]
            lines.append(f"speed against all three plain rollouts of the same responses (the "
                         f"pair's off arm, both A/A arms): {sp['speedup_vs_plain_median']:.2f} "
                         f"(median; steps {lo:.2f}-{hi:.2f})")
    for arm, c in result.get("against_off", {}).items():
        if "rollout_time_ratio" in c:
            lines.append(f"{arm} / off rollout time per step: {c['rollout_time_ratio']:.2f}")
        h = c.get("held_out")
        if h:
            lines.append(
                f"{arm} - off held-out accuracy at step {c['final_step']}: "
                f"{h['difference']:+.3f} [{h['lo']:+.3f}, {h['hi']:+.3f}] over "
                f"{h['prompts']} prompts, McNemar p = {h['mcnemar_p']:.2f} ("
                + ("a significant difference" if h["significant"] else "no significant "
                   "difference") + ")")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="off,tlt", help="comma-separated, from: off, tlt")
    ap.add_argument("--out", default="runs/learn", help="where the arms' run folders go")
    ap.add_argument("--json", default="docs/results/learn_cpu.json")
    ap.add_argument("--figure", default="docs/learning.png")
    ap.add_argument("--report-only", action="store_true",
                    help="compare the run folders as they are, run nothing")
    ap.add_argument("--speed", action="store_true",
                    help="after the arms, the fair speed comparison on the tlt arm's final "
                         "policy (coupled, interleaved, with an A/A run; ~20 min)")
    ap.add_argument("--speed-steps", type=int, default=6,
                    help="GRPO steps of each --speed run (default 6)")
    args, overrides = ap.parse_known_args(argv)
    bad = [o for o in overrides if "=" not in o or o.startswith("-")]
    if bad:
        ap.error(f"not an option nor a section.field=value override: {' '.join(bad)}")
    arms = [a for a in args.arms.split(",") if a]
    for a in arms:
        if a not in ARMS:
            ap.error(f"--arms: unknown arm {a!r}; choose from {', '.join(ARMS)}")
    out = (REPO / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    t0 = time.perf_counter()
    if not args.report_only:
        for arm in arms:
            rc = run_arm(arm, out, overrides, t0)
            if rc != 0:  # (torchrun reports a rank's requeue exit, 75, as 1)
                last = latest(out / f"{arm}-ckpt")
                print(f"[learn] {arm} exited {rc}; its last checkpoint: {last or 'none yet'}; "
                      "run again to resume it", flush=True)
                return rc
        if args.speed:
            rc = run_speed(out, args.speed_steps)
            if rc != 0:
                return rc
    command = "python tools/learn.py " + " ".join(argv if argv is not None else sys.argv[1:])
    report(out, arms, REPO / args.json, REPO / args.figure, command.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
