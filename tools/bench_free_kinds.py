#!/usr/bin/env python
"""Acceptance and host cost of the model-free drafter kinds on GRPO rollouts.

    python tools/bench_free_kinds.py --quick --json docs/results/free_kinds.json
    python tools/bench_free_kinds.py --tasks chain_sum --temperatures 1.0 --strategies 4_1_4

For each reasoning-gym task (the demo recipe's, ``--config``, and ``--tasks`` more), each
temperature (0 = greedy) and each model-free kind (``prompt_lookup``, ``group_history``)
and strategy, ``megatron_tlt.bench.free_kinds.measure`` generates ``--calls`` GRPO
rollouts of the same ``--prompts`` prompts x ``--group`` responses (the recipe's top-p /
top-k at its temperature, 1.0 / 0 otherwise) with speculation in the tail
(``--threshold`` running rows or fewer). Per call: tokens emitted per row per
speculative step (acceptance length), per speculative step, the share of rows that had
a draft, and the proposer's host time (lookups and index updates) per step and per row
beside the median speculative step. Acceptance is a count, not a timing; the host
times are wall-clock (the JSON records the CPU, the date and the load average).

``--beside D`` (a model kind's config value; ``demo``: the demo's cached drafter)
instead measures the free kinds beside D as a run configures them (the break-even
gate, modelled costs), with ``free_alone`` off and on side by side
(``bench.free_kinds.measure_beside``; one step-cost table, calibrated once, for
every arm): the tail's decode steps, the steps that
speculated and those the free kinds took alone, and the tail's tokens per decode step
by proposing kind.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from megatron_tlt.runtime_env import silence_expected_warnings

RECIPE = "examples/rl/smollm2_cpu.yaml"
RECIPE_SEED_OFFSET = 7919  # as bench_spec: prompts unrelated to the recipe's warm-up


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    a = ap.add_argument
    a("--config", default=RECIPE, help="RL recipe: model, task, prompt format, top-p/k")
    a("--tasks", default="basic_arithmetic",
      help="reasoning-gym tasks besides the recipe's, comma-separated ('' = none)")
    a("--temperatures", default="1.0,0.7,0", help="comma-separated; 0 = greedy")
    a("--kinds", default="", help="model-free kinds (default: every registered one)")
    a("--strategies", default="4_1_4,4_2_6", help="fixed strategies, comma-separated")
    a("--prompts", type=int, default=4)
    a("--group", type=int, default=8, help="responses per prompt (grpo.group_size)")
    a("--max-new-tokens", type=int, default=256)
    a("--threshold", type=int, default=8, help="speculate at or below this many rows")
    a("--calls", type=int, default=2, help="rollouts of the same prompts per setting")
    a("--seed", type=int, default=1)
    a("--sampling-mode", default="standard", choices=("standard", "coupled"),
      help="rollout.sampling_mode (coupled: both --beside arms emit the same tokens)")
    a("--beside", default="", help="a model kind's value (demo: the demo's drafter): "
      "free kinds beside it, free_alone off and on")
    a("--quick", action="store_true",
      help="2 prompts x 8, 160 tokens, strategy 4_1_4 (explicit flags win)")
    a("--json", default=None)
    args = ap.parse_args(argv)
    if args.quick:
        given = set(a for a in (argv if argv is not None else sys.argv[1:]))
        if "--prompts" not in given:
            args.prompts = 2
        if "--max-new-tokens" not in given:
            args.max_new_tokens = 160
        if "--strategies" not in given:
            args.strategies = "4_1_4"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    silence_expected_warnings()
    import torch

    from megatron_tlt.bench.common import cpu_description
    from megatron_tlt.bench.free_kinds import measure, measure_beside
    from megatron_tlt.rollout.speculative.step_costs import StepCosts
    from megatron_tlt.config import RolloutConfig
    from megatron_tlt.drafter_training.warmup import WarmupConfig, recipe_prompts
    from megatron_tlt.rollout import RolloutEngine, SamplingParams
    from megatron_tlt.rollout.speculative import drafters

    rc = WarmupConfig.from_recipe(args.config)
    engine = RolloutEngine.from_pretrained(rc.model, RolloutConfig(
        max_batch_size=args.prompts * args.group, sampling_mode=args.sampling_mode))
    beside = args.beside
    if beside == "demo":
        from megatron_tlt.drafter_training.prepared import demo_drafter

        beside = str(demo_drafter(Path(args.config)))
    kinds = ([k for k in args.kinds.split(",") if k] or
             [k.name for k in drafters.KINDS if k.free])
    tasks = [(rc.task, rc)] + [(t, dataclasses.replace(rc, task=t, task_params={}))
                               for t in args.tasks.split(",") if t]
    load = os.getloadavg()
    t_start = time.perf_counter()
    rows, costs = [], None
    for task, cfg in tasks:
        prompts = recipe_prompts(cfg, engine.tokenizer, args.prompts,
                                 seed=rc.seed + RECIPE_SEED_OFFSET + args.seed)
        for temp in [float(t) for t in args.temperatures.split(",")]:
            sp = SamplingParams(temperature=temp,
                                top_p=rc.top_p if temp == rc.temperature else 1.0,
                                top_k=rc.top_k if temp == rc.temperature else 0,
                                max_new_tokens=args.max_new_tokens, seed=args.seed)
            if args.beside:
                for alone in (False, True):
                    r = measure_beside(engine, beside, kinds, prompts, args.group, sp,
                                       threshold=args.threshold, alone=alone,
                                       calls=args.calls, costs=costs)
                    costs = StepCosts.from_dict(r["step_costs"])  # one table: every arm
                    r.update(task=task, temperature=temp, top_p=sp.top_p, top_k=sp.top_k)
                    rows.append(r)
                    for c in r["calls"]:
                        per = ", ".join(f"{k} {v:.2f}" for k, v in
                                        c["tokens_per_tail_step_by_kind"].items())
                        print(f"{task:17s} T={temp:<4g} alone={alone!s:5s} call {c['call']}: "
                              f"{c['tail_steps']} tail steps, {c['spec_steps']} speculative "
                              f"({c['alone_steps']} alone), {c['tokens_per_tail_step']:.2f} "
                              f"tok/step ({per})", flush=True)
                continue
            for kind in kinds:
                for strategy in args.strategies.split(","):
                    r = measure(engine, kind, prompts, args.group, sp, strategy=strategy,
                                threshold=args.threshold, calls=args.calls)
                    r.update(task=task, temperature=temp, top_p=sp.top_p, top_k=sp.top_k)
                    rows.append(r)
                    for c in r["calls"]:
                        print(f"{task:17s} T={temp:<4g} {kind:14s} {strategy:6s} "
                              f"call {c['call']}: accept {c['accept_len']:.2f} tok/row-step, "
                              f"{c['tokens_per_spec_step']:.2f} tok/step, drafts "
                              f"{c['rows_with_draft']:.0%} of rows, host "
                              f"{c['host_ms_per_spec_step']:.3f} ms/step "
                              f"({c['host_us_per_row']:.0f} us/row) vs step "
                              f"{c['spec_step_ms_median']:.1f} ms", flush=True)
    if args.json:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        out = {"benchmark": "bench_free_kinds",
               "command": "python tools/bench_free_kinds.py " + " ".join(
                   argv if argv is not None else sys.argv[1:]),
               "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "commit": rev, "model": str(rc.model), "recipe": args.config,
               "prompts": args.prompts, "group": args.group,
               "max_new_tokens": args.max_new_tokens, "threshold": args.threshold,
               "calls": args.calls, "seed": args.seed, "beside": beside,
               "sampling_mode": args.sampling_mode, "threads": torch.get_num_threads(),
               "load_average_start": load, "load_average_end": os.getloadavg(),
               "wall_seconds": time.perf_counter() - t_start,
               **cpu_description(engine), "results": rows}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
