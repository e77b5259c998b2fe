#!/usr/bin/env python
"""End to end: whole GRPO steps with TLT rollouts (adaptive speculation) vs without.

    python tools/bench_e2e.py --quick                     # both sampling modes, ~5 min
    python tools/bench_e2e.py --json docs/results/bench_e2e_cpu.json
    python tools/bench_e2e.py --sampling-mode coupled --task basic_arithmetic --steps 4
    python tools/bench_e2e.py --quick --drafter off       # A/A: both arms plain
    python tools/bench_e2e.py --quick --drafter random    # an untrained drafter (loses)
    python tools/bench_e2e.py --quick --drafter self --off-arm measured  # tuner costs
    python tools/bench_e2e.py --quick --drafter group_history --self-too --off-drafter self
    python tools/bench_e2e.py --quick --drafter D --free-too group_history --off-drafter D

The same recipe (examples/rl/smollm2_cpu.yaml plus the flags below and any
``section.field=value`` overrides), seed and prompts for N GRPO steps, two arms
interleaved step by step from the same starting weights: ``tlt`` (the drafter attached,
``rollout.speculative.drafter=PATH``) and ``off`` (``rollout.speculative.drafter=""``;
``--off-arm measured``: the same drafter, its tuner charging measured step times,
``rollout.speculative.costs=measured``, where ``tlt`` charges modelled ones;
``--off-arm modelled``: the same drafter and costs, the A/A control of that ratio;
``--off-drafter X``: drafter X, so the ratio compares two drafter choices, e.g. kinds
chosen per row, ``--drafter group_history --self-too``, against the self-drafter alone,
with ``--drafter self --off-drafter self`` its A/A control).
Before its first step each arm's tuner gets its step-cost table (calibrated once on
this machine, ``rl/spec_costs.py``).
Each step runs both arms' ``Trainer.train_step`` one after the other, the first arm
alternating (TLT first on steps 1, 3, ...), so drift of a shared machine cancels over
pairs.

The script starts ``torchrun --nproc_per_node 2`` (2 DP replicas, gloo, one thread per
process) on itself with ``--worker``. Every rank builds both arms: two megatron-core
models loaded from the same source, two optimizers, two rollout engines, one parallel
state (SmolLM2-135M fp32 + Adam + the CPU kernels' weight copies: ~4 GB per rank built,
~8.5 GB peak with the update's activations). No tracking (no W&B).

``--sampling-mode`` (default both: coupled, then standard, each from fresh weights):
``rollout.sampling_mode`` for both arms. Coupled sampling makes a response the same
token for token whether speculation is on, so the two arms see the same responses
(their trajectories coincide up to floating-point near-ties); standard sampling gives
the same distribution, not the same samples.

Reported per step and overall (medians of per-step ratios, with min and max):
rollout time (the last replica's finish: generation + scoring, ``timeline``), step time
(slowest rank), ``rollout_fraction`` f (rollout / step of the ``off`` arm),
``rollout_speedup`` s (``off`` rollout / ``tlt`` rollout), ``step_speedup``, the Amdahl
bound 1 / ((1 - f) + f / s) (the step speedup a rollout speedup s can give when the
rest of the step is unchanged), tail (last replica finish - first), idle
replica-seconds, acceptance length (the engine's spec summary), and whether the arms
agree: fraction of responses token-identical across arms (``coupled_identical``), of
rewards equal, the largest |parameter difference| between the arms after each step,
and the mean reward difference tlt - off paired over (step, prompt) with a 95 %
interval. ``--drafter off`` runs both arms without speculation (an A/A run: the noise
floor of the ratios; the arms must agree exactly).

JSON (``--json``): ``benchmark``, ``config`` (recipe, sizes, seed, drafter, versions,
CPU model and instruction set), ``results`` (one row per mode and step) and ``modes``
with, per sampling mode, ``rollout_speedup``, ``step_speedup``, ``amdahl_bound``,
``rollout_fraction``, ``coupled_identical``, ``reward_delta`` and the per-step rows.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from dataclasses import replace
from datetime import date
from pathlib import Path

from megatron_tlt.bench.e2e import (ARMS, arm_numbers, compare_responses, max_param_delta,
                                    step_row, summarize)

REPO = Path(__file__).resolve().parents[1]

RECIPE = REPO / "examples" / "rl" / "smollm2_cpu.yaml"
QUICK = dict(steps=2, prompts_per_step=2, group_size=4, max_new_tokens=512)
FULL = dict(steps=6, prompts_per_step=4, group_size=8, max_new_tokens=512)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--sampling-mode", choices=("coupled", "standard", "both"),
                    default="both", help="rollout.sampling_mode of both arms (both: "
                    "coupled, then standard)")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"GRPO steps per mode (default {FULL['steps']}; --quick "
                         f"{QUICK['steps']})")
    ap.add_argument("--prompts-per-step", type=int, default=None,
                    help=f"grpo.prompts_per_step (default {FULL['prompts_per_step']}; "
                         f"--quick {QUICK['prompts_per_step']})")
    ap.add_argument("--group-size", type=int, default=None,
                    help=f"grpo.group_size (default {FULL['group_size']}; --quick "
                         f"{QUICK['group_size']})")
    ap.add_argument("--max-new-tokens", type=int, default=None,
                    help=f"grpo.max_new_tokens, the response cap (default "
                         f"{FULL['max_new_tokens']})")
    ap.add_argument("--seed", type=int, default=1234,
                    help="platform.seed (sampling) and data.seed (the prompt set)")
    ap.add_argument("--task", default=None,
                    help="reasoning-gym task (default: the recipe's, chain_sum)")
    ap.add_argument("--task-params", default=None,
                    help="JSON object of task parameters (default: the recipe's for its "
                         "own task, the task's preset for another task)")
    ap.add_argument("--drafter", default=None,
                    help="drafter checkpoint for the tlt arm (default: the demo's, "
                         "tools/demo.py, warmed up if absent); 'self': the policy's int8 "
                         "copy (rollout.speculative.drafter=self); 'random': an untrained "
                         "drafter of the target's shape (seeded; a drafter that loses); "
                         "'off': no drafter in either arm (A/A)")
    ap.add_argument("--off-arm", choices=("off", "measured", "modelled"), default="off",
                    help="the second arm: no drafter (off), or the tlt arm's drafter with "
                         "rollout.speculative.costs=measured / modelled")
    ap.add_argument("--off-drafter", default="",
                    help="the second arm speculates with this drafter (a config value, "
                         "e.g. self) instead of none")
    ap.add_argument("--self-too", action="store_true",
                    help="the tlt arm adds the self-drafter beside --drafter "
                         "(rollout.speculative.kinds.self.also; a model-free --drafter then "
                         "proposes per row over it)")
    ap.add_argument("--free-too", default="",
                    help="the tlt arm also attaches this model-free kind (e.g. "
                         "group_history) beside --drafter, proposing per row over it")
    ap.add_argument("--config", default=str(RECIPE), help="base recipe (YAML)")
    ap.add_argument("--nproc", type=int, default=2, help="DP replicas (processes)")
    ap.add_argument("--warmup-tokens", type=int, default=16,
                    help="before the first step of a mode, each arm's engine generates "
                         "this many tokens for one prompt (kernels, caches; 0 = none)")
    ap.add_argument("--strict", action="store_true",
                    help="fail when coupled mode gives responses that differ across arms")
    ap.add_argument("--quick", action="store_true",
                    help=f"{QUICK['steps']} steps of {QUICK['prompts_per_step']} prompts x "
                         f"{QUICK['group_size']}, cap {QUICK['max_new_tokens']} (explicit "
                         f"flags win)")
    ap.add_argument("--json", default=None, help="write the result here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", metavar="section.field=value",
                    help="config overrides applied to both arms (after the flags above)")
    return ap


def resolve_sizes(args) -> None:
    base = QUICK if args.quick else FULL
    for k, v in base.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


# --------------------------------------------------------------------------- the worker
class Arm:
    """One arm on this rank: a Trainer on its own model instance, and what its idle
    window hook saw of the step's responses."""

    def __init__(self, name: str, cfg, session, model):
        from megatron_tlt.rl.trainer import Trainer

        self.name = name
        self.cfg = cfg
        self.model = model
        self.trainer = Trainer(cfg, replace(session, model=model))
        self.seen: list = []
        self.trainer.idle_window_hooks.append(self._capture)

    def _capture(self, step: int, roll) -> None:
        """(prompt index, place in its group, response tokens, reward) of every sample
        of this replica, after scoring."""
        place: dict[int, int] = {}
        seen = []
        for s in roll.samples:
            j = place.get(s.prompt_index, 0)
            place[s.prompt_index] = j + 1
            seen.append((s.prompt_index, j, list(s.response_ids), float(s.reward)))
        self.seen = seen

    def warm_up(self, tokens: int) -> None:
        """Kernels, caches and weight copies of the engine, outside the timed steps."""
        from megatron_tlt.rl.spec_costs import ensure_run_costs

        t = self.trainer
        ensure_run_costs(t.engine, None)  # costs=modelled: the table, before any step
        if tokens <= 0:
            return
        from megatron_tlt.rollout import SamplingParams

        t.engine.generate([t.train_prompts[0].token_ids],
                          SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=7))

    def probe(self):
        """A small parameter (the last one) to tell whether a step moved the weights."""
        return list(self.model.parameters())[-1].detach().clone()


def attach_random_drafter(engine, seed: int) -> None:
    """An untrained drafter of the target's shape (a 1,024-token draft vocabulary, as
    the warmed ones), seeded, on the engine; its tuner as the config makes it."""
    from megatron_tlt.rollout.speculative.drafters import make_drafter, untrained_value

    engine.attach_drafter(make_drafter(untrained_value(), arch=engine.arch,
                                       dtype=engine.runner.dtype, device=engine.device,
                                       seed=seed))


def make_config(args, mode: str):
    from megatron_tlt.config import load_config

    overrides = [f"grpo.prompts_per_step={args.prompts_per_step}",
                 f"grpo.group_size={args.group_size}",
                 f"grpo.max_new_tokens={args.max_new_tokens}",
                 f"train.steps={args.steps}", f"platform.seed={args.seed}",
                 f"data.seed={args.seed}",
                 f"data.train_size={max(64, args.steps * args.prompts_per_step)}",
                 "data.eval_size=0", "train.eval_interval=0",
                 f"rollout.sampling_mode={mode}"]
    if args.task:
        overrides.append(f"data.task={args.task}")
    cfg = load_config([args.config], overrides + list(args.overrides))
    if args.task_params is not None:
        cfg.data.task_params = json.loads(args.task_params)
    elif args.task:
        cfg.data.task_params = {}
    return cfg


def build_arms(args, mode: str, session, first_model) -> dict:
    """Both arms of one sampling mode on this rank, from the same weights (the first
    model is the set-up's), warmed up; fails when they do not start equal."""
    from megatron_tlt.models import load_model
    from megatron_tlt.runtime_env import seed_everything

    from megatron_tlt.rollout.speculative.drafters import is_untrained

    cfg = make_config(args, mode)
    untrained = is_untrained(str(args.drafter))  # attached after the arms are built
    drafter = "" if args.drafter == "off" or untrained else str(args.drafter)
    second = "" if args.off_drafter == "off" else args.off_drafter
    sc = cfg.rollout.speculative
    also = replace(sc.kinds, self=replace(sc.kinds.self, also=args.self_too))
    cfgs = {"tlt": replace(cfg, rollout=replace(cfg.rollout, speculative=replace(
        sc, drafter=drafter, kinds=also))),
        "off": replace(cfg, rollout=replace(cfg.rollout, speculative=replace(
            cfg.rollout.speculative, drafter=second)))}
    if args.off_arm != "off":  # the same drafter, the tuner charging the other costs
        cfgs["off"] = replace(cfg, rollout=replace(cfg.rollout, speculative=replace(
            cfgs["tlt"].rollout.speculative, costs=args.off_arm)))
    seed_everything(cfg.platform.seed)
    arms = {}
    for name in ARMS:
        model = first_model.pop() if first_model else load_model(
            session.source, device=session.platform.device, dtype=cfg.model.dtype,
            impl=cfg.model.transformer_impl)[0]
        arms[name] = Arm(name, cfgs[name], session, model)
    if untrained:
        attach_random_drafter(arms["tlt"].trainer.engine, args.seed)
    if args.free_too:  # beside the arm's drafter, per row (as beside the drafter group's)
        from megatron_tlt.rollout.speculative.drafters import make_drafter

        eng = arms["tlt"].trainer.engine
        free = make_drafter(args.free_too, arch=eng.arch, dtype=eng.runner.dtype,
                            device=eng.device, sc=eng.config.speculative)
        eng.attach_drafters({**eng.drafters, free.name: free})
    start = max_param_delta(arms["tlt"].model, arms["off"].model)
    if start != 0.0:
        raise RuntimeError(f"the arms start from different weights (max |diff| {start})")
    for arm in arms.values():
        arm.warm_up(args.warmup_tokens)
    return arms


def run_step(args, mode: str, step: int, arms: dict, dp_group, log) -> dict:
    """One GRPO step of both arms (the first alternating from step to step): its row."""
    from megatron_tlt import collectives

    order = ARMS if step % 2 == 0 else ARMS[::-1]
    metrics, probes = {}, {}
    for name in order:
        arm = arms[name]
        probes[name] = arm.probe()
        metrics[name] = arm.trainer.train_step(step)
        log(f"[bench_e2e] {mode} step {step + 1}/{args.steps} {name}: rollout "
            f"{max(metrics[name]['timeline']['replica_finish']):.1f} s, step "
            f"{metrics[name]['timing']['step']:.1f} s, reward "
            f"{metrics[name]['reward/mean']:.3f}")
    # what crosses ranks: step times (max), weight difference and motion (max),
    # the responses (gathered over the replicas)
    moved = {n: float((arms[n].probe() - probes[n]).abs().max()) for n in ARMS}
    red = collectives.max_values([metrics["tlt"]["timing"]["step"],
                                  metrics["off"]["timing"]["step"],
                                  max_param_delta(arms["tlt"].model, arms["off"].model),
                                  moved["tlt"], moved["off"]])
    seen = {n: collectives.all_gather_object(arms[n].seen, dp_group) for n in ARMS}
    agree = compare_responses(seen["tlt"], seen["off"], step)
    agree["max_param_delta"] = float(red[2])
    numbers = {"tlt": arm_numbers(metrics["tlt"], float(red[0]), seen["tlt"]),
               "off": arm_numbers(metrics["off"], float(red[1]), seen["off"])}
    numbers["tlt"]["param_moved"], numbers["off"]["param_moved"] = float(red[3]), float(red[4])
    return step_row(step + 1, order[0], numbers, agree)


def run_mode(args, mode: str, session, first_model, log) -> dict:
    """Both arms through ``args.steps`` steps of one sampling mode: its summary."""
    from megatron_tlt import collectives
    from megatron_tlt.bench.common import cpu_description

    arms = build_arms(args, mode, session, first_model)
    rss_built = _rss_gb()
    dp_group = arms["off"].trainer.dp_group
    rows = [run_step(args, mode, step, arms, dp_group, log) for step in range(args.steps)]
    cpu = cpu_description(arms["tlt"].trainer.engine)
    mem = collectives.max_values([rss_built, _rss_gb(), _peak_rss_gb()])
    del arms
    gc.collect()
    out = summarize(rows)
    out["memory_gb"] = dict(zip(("rss_after_build", "rss_at_end", "peak_rss"),
                                mem), per="rank (the largest over ranks)")
    out["cpu"] = cpu
    return out


def _rss_gb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def result_record(args, session, modes: list[str], results: dict, t0: float) -> dict:
    """The JSON record: the run's configuration (the first mode's CPU record), one row
    per mode and step, each mode's summary."""
    import megatron.core
    import torch

    cpu = next(iter(results.values())).pop("cpu")
    for r in results.values():
        r.pop("cpu", None)
    from megatron_tlt.assets import weights_are_random
    from megatron_tlt.bench.common import timing_only
    from megatron_tlt.rollout.speculative.drafters import is_untrained

    cfg = make_config(args, modes[0])
    return {
        "benchmark": "bench_e2e",
        **timing_only(target_random=weights_are_random(session.source),
                      drafter_random=is_untrained(args.drafter)),
        "date": date.today().isoformat(),
        "config": dict(
            model=session.source.name, model_path=str(session.source),
            params=session.arch.num_parameters, dtype=cfg.model.dtype,
            recipe=str(args.config), overrides=list(args.overrides),
            task=cfg.data.task, task_params=cfg.data.task_params, steps=args.steps,
            prompts_per_step=args.prompts_per_step, group_size=args.group_size,
            max_new_tokens=args.max_new_tokens, temperature=cfg.grpo.temperature,
            seed=args.seed, sampling_modes=modes,
            drafter=None if args.drafter == "off" else str(args.drafter),
            aa_control=args.drafter == "off" or args.off_arm == "modelled" or (
                args.off_drafter == args.drafter and not (args.self_too or args.free_too)),
            off_arm=args.off_arm, off_drafter=args.off_drafter or None,
            self_too=args.self_too, free_too=args.free_too or None,
            costs=dict(tlt=cfg.rollout.speculative.costs,
                       off=None if args.off_arm == "off" else args.off_arm),
            speculative=dict(threshold=cfg.rollout.speculative.threshold,
                             policy=cfg.rollout.speculative.policy,
                             arms=cfg.rollout.speculative.arms,
                             break_even=cfg.rollout.speculative.break_even),
            dp=session.layout.dp_size, tp=session.layout.tp_size,
            threads_per_rank=torch.get_num_threads(), cpus=os.cpu_count(),
            warmup_tokens=args.warmup_tokens, torch=torch.__version__,
            megatron_core=megatron.core.__version__,
            device=(torch.cuda.get_device_name() if session.platform.device.type == "cuda"
                    else "cpu"), **cpu),
        "results": [dict(mode=m, **{k: v for k, v in row.items()})
                    for m, r in results.items() for row in r["steps"]],
        "modes": results,
        "wall_seconds": time.perf_counter() - t0,
    }


def failures(args, results: dict, log) -> list[str]:
    """What fails the run: coupled arms that differ (with --strict; a warning without),
    and an A/A run (--drafter off) whose arms differ at all."""
    failed = []
    for m, r in results.items():
        if m == "coupled" and r["coupled_identical"] != 1.0 and args.drafter != "off":
            msg = (f"coupled mode: {r['coupled_identical']:.1%} of responses identical "
                   f"across arms (expected all, up to floating-point near-ties)")
            log(f"[bench_e2e] warning: {msg}")
            if args.strict:
                failed.append(msg)
        if args.drafter == "off" and not (r["weights_identical"] and
                                          r["coupled_identical"] == 1.0):
            failed.append(f"{m}: A/A arms differ (max |dW| {r['max_param_delta']:.3g}, "
                          f"identical {r['coupled_identical']:.1%})")
    return failed


def write_result(args, result: dict) -> None:
    """The report on stdout, the record in --json."""
    from megatron_tlt.tracking import jsonable

    print(report(result), flush=True)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(jsonable(result), indent=1))
        print(f"[bench_e2e] wrote {args.json}", flush=True)


def worker(args) -> int:
    import torch.distributed as dist

    from megatron_tlt.launch import setup, shutdown
    from megatron_tlt.runtime_env import silence_expected_warnings

    silence_expected_warnings()
    modes = ["coupled", "standard"] if args.sampling_mode == "both" else [args.sampling_mode]
    t0 = time.perf_counter()
    session = setup(make_config(args, modes[0]))
    rank = dist.get_rank()

    def log(msg):
        if rank == 0:
            print(msg, flush=True)

    first_model = [session.model]
    session = replace(session, model=None)
    results = {}
    for mode in modes:
        t_mode = time.perf_counter()
        results[mode] = run_mode(args, mode, session, first_model, log)
        results[mode]["wall_seconds"] = time.perf_counter() - t_mode
        gc.collect()
    result = result_record(args, session, modes, results, t0)
    failed = failures(args, results, log)
    if rank == 0:
        write_result(args, result)
    shutdown()
    for msg in failed:
        log(f"[bench_e2e] FAILED: {msg}")
    return 1 if failed else 0


# --------------------------------------------------------------------------- the report
def _f(x, fmt="{:.2f}"):
    return "-" if x is None else fmt.format(x)


def report(result: dict) -> str:
    c = result["config"]
    lines = [f"bench_e2e: {c['model']} on {c['task']}, {c['dp']} replicas x "
             f"{c['threads_per_rank']} thread(s), {c['prompts_per_step']} prompts x "
             f"{c['group_size']} per step, cap {c['max_new_tokens']}, seed {c['seed']}; "
             f"drafter {c['drafter'] or 'off (A/A)'}; CPU {c.get('cpu')} "
             f"({' '.join(c.get('cpu_isa_flags') or [])})"]
    head = ("step first | rollout off  tlt     s | step off   tlt   x   |  f    Amdahl | "
            "tail off tlt | idle off tlt | accept | ident  max|dW|")
    for mode, r in result["modes"].items():
        mem = r.get("memory_gb", {})
        lines += ["", f"sampling mode {mode} ({r['wall_seconds'] / 60:.1f} min; per rank "
                  f"{_f(mem.get('rss_after_build'), '{:.1f}')} GB with both arms built, "
                  f"peak {_f(mem.get('peak_rss'), '{:.1f}')} GB)", head]
        for row in r["steps"]:
            a, b = row["arms"]["off"], row["arms"]["tlt"]
            lines.append(
                f"{row['step']:>4} {row['first']:>5} | {a['rollout']:>10.1f} "
                f"{b['rollout']:>5.1f} {row['rollout_speedup']:>5.2f} | "
                f"{a['step']:>7.1f} {b['step']:>5.1f} {row['step_speedup']:>5.2f} | "
                f"{row['rollout_fraction']:.2f} {row['amdahl_bound']:>6.2f} | "
                f"{a['tail']:>7.1f} {b['tail']:>4.1f} | "
                f"{a['idle_replica_seconds']:>7.1f} {b['idle_replica_seconds']:>4.1f} | "
                f"{_f(row['accept_len']):>6} | {row['identical']:>2}/{row['responses']:<3} "
                f"{row['max_param_delta']:.1e}")
        rd = r["reward_delta"]
        ci = rd["ci95"]
        lines += [
            f"rollout speedup s {_f(r['rollout_speedup'])} [{_f(r['rollout_speedup_min'])}, "
            f"{_f(r['rollout_speedup_max'])}] (total {_f(r['rollout_speedup_total'])}); "
            f"step speedup {_f(r['step_speedup'])} [{_f(r['step_speedup_min'])}, "
            f"{_f(r['step_speedup_max'])}] (total {_f(r['step_speedup_total'])})",
            f"rollout fraction f {_f(r['rollout_fraction'])} [{_f(r['rollout_fraction_min'])}"
            f", {_f(r['rollout_fraction_max'])}]; Amdahl bound 1/((1-f)+f/s) "
            f"{_f(r['amdahl_bound'])}",
            f"acceptance {_f(r['acceptance']['accept_len'])}, speculating in "
            f"{_f(r['acceptance']['on_fraction'], '{:.0%}')} of decode steps; responses "
            f"identical {_f(r['coupled_identical'], '{:.0%}')}, rewards equal "
            f"{_f(r['rewards_identical'], '{:.0%}')}, max |dW| {r['max_param_delta']:.2e} "
            f"(weights moved in {r['steps_with_update']}/{len(r['steps'])} steps)",
            f"reward tlt - off {_f(rd['mean'], '{:+.3f}')} (95 % CI "
            f"[{_f(ci[0], '{:+.3f}')}, {_f(ci[1], '{:+.3f}')}], {rd['pairs']} prompt pairs); "
            f"mean reward off {r['reward_mean']['off']:.3f} tlt {r['reward_mean']['tlt']:.3f}",
        ]
    return "\n".join(lines)


# --------------------------------------------------------------------------- launcher
def launch(args, argv: list[str]) -> int:
    from megatron_tlt.config import ConfigError

    t0 = time.perf_counter()
    try:  # recipe, flags and overrides checked before anything starts
        for mode in ("coupled", "standard"):
            make_config(args, mode)
        if args.task_params is not None and not isinstance(json.loads(args.task_params), dict):
            raise ConfigError("--task-params must be a JSON object")
    except (ConfigError, json.JSONDecodeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from megatron_tlt.rollout.speculative.drafters import is_untrained, names

    for flag, value in (("--drafter", args.drafter), ("--off-drafter", args.off_drafter)):
        if value not in (None, "off", "") and not (
                value in names() or is_untrained(value) or Path(value).is_file()):
            print(f"error: {flag}: no drafter checkpoint at {value} (or give one of "
                  f"{names()}, random, off)", file=sys.stderr)
            return 2
    from megatron_tlt.bench.launcher import torchrun
    from megatron_tlt.drafter_training.prepared import demo_drafter

    extra = ["--drafter", demo_drafter(RECIPE)] if args.drafter is None else []
    return torchrun("bench_e2e", args.nproc, Path(__file__).resolve(),
                    ["--worker", *extra, *argv], t0, cwd=REPO)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_intermixed_args(argv)
    resolve_sizes(args)
    if not args.worker:
        return launch(args, argv)
    if args.drafter is None:
        raise SystemExit("--worker needs --drafter PATH, random or off")
    return worker(args)


if __name__ == "__main__":
    sys.exit(main())
