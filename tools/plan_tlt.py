#!/usr/bin/env python
"""Predict a recipe's RL step time with and without TLT, or validate the predictor.

    python tools/plan_tlt.py --config examples/rl/qwen2.5_32b_grpo.yaml --world-size 64
    python tools/plan_tlt.py --config examples/rl/qwen2.5_7b_grpo.yaml --world-size 8 \
        --hardware h200 --lengths runs/qwen/metrics.jsonl --json /tmp/plan.json
    python tools/plan_tlt.py --validate --json docs/results/planner_validation.json
    python tools/plan_tlt.py --config examples/rl/qwen3_8b_grpo.yaml --world-size 8 --recommend

The prediction is a model (megatron_tlt.planner): a discrete-event simulation of the
step over the layout's replicas, with step costs from a roofline (GPU, modelled) or
this project's CPU measurements. It prints what it assumed. ``--lengths`` takes a
run's metrics.jsonl or a ``tools/workload_lengths.py --json`` file; ``--drift`` a
``tools/bench_drift.py --json`` file (per-step acceptance of an online and a frozen
drafter), which replaces the alpha-against-tokens curve. The measured tables ship with
the package (megatron_tlt/planner/data/); ``--calibration DIR`` reads tables of the same
names from DIR first. ``--validate`` predicts the repository's own runs in
docs/results/, so it runs from a clone. ``--recommend`` searches the layout, the paged
KV budget, the speculation threshold and the drafter kind under the dry run's memory
bound (megatron_tlt.rl.recommend). docs/planning.md explains the model and its
validation.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # a clone's docs/results/ for --validate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", action="append", default=[], help="recipe YAML (repeatable)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--hardware", choices=("h100", "h200", "cpu"), default=None,
                   help="default: h100, or cpu for a CPU recipe")
    p.add_argument("--lengths", type=Path, default=None,
                   help="metrics.jsonl of a run, or tools/workload_lengths.py --json output")
    p.add_argument("--drift", type=Path, default=None,
                   help="tools/bench_drift.py --json output (per-step acceptance, two arms)")
    p.add_argument("--table", type=Path, default=None,
                   help="a tools/bench_rollout.py --json file measured on the target "
                   "hardware: its decode steps replace the roofline's")
    p.add_argument("--spec-table", type=Path, default=None,
                   help="with --table: a tools/bench_spec.py --json file of the same hardware "
                   "(speculative step costs only: a timing-only one, measured on random "
                   "weights, serves; acceptance comes from the CPU measurements or "
                   "--accept-by-bucket)")
    p.add_argument("--accept-by-bucket", type=Path, default=None,
                   help="a tools/bench_spec.py --json file: acceptance by batch size, as "
                   "factors on the assumed acceptance")
    p.add_argument("--calibration", type=Path, default=None,
                   help="a folder of measured tables named as in megatron_tlt/planner/data/ "
                   "(e.g. the CPU benchmarks re-run on your machine), read before the "
                   "shipped ones")
    p.add_argument("--steps", type=int, default=4, help="RL steps simulated per arm")
    p.add_argument("--validate", action="store_true",
                   help="run the validation (CPU runs and published points)")
    p.add_argument("--recommend", action="store_true",
                   help="search the layout (TP, PP, EP, DP), the paged KV budget, the "
                   "speculation threshold and the drafter kind under the dry run's memory "
                   "bound; print the fastest few with their overrides and why each wins")
    p.add_argument("--top", type=int, default=3, help="with --recommend: how many to print")
    p.add_argument("--results", type=Path, default=REPO / "docs" / "results",
                   help="--validate: the folder of measured runs it predicts (default: "
                   "this clone's docs/results/; the shipped tables are read from the "
                   "package)")
    p.add_argument("--json", type=Path, default=None, help="write the result as JSON")
    p.add_argument("overrides", nargs="*", help="section.field=value")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from megatron_tlt.planner.inputs import use_calibration

    if args.calibration is not None:
        if args.validate:
            print("--calibration does not apply to --validate: the validation predicts "
                  "the repository's runs from the tables measured beside them",
                  file=sys.stderr)
            return 2
        try:
            names = use_calibration(args.calibration)
        except ValueError as e:
            print(f"--calibration: {e}", file=sys.stderr)
            return 2
        print(f"calibration: {', '.join(names)} from {args.calibration}; the other "
              "tables shipped")
    try:
        return run(args)
    finally:
        use_calibration(None)


def run(args) -> int:
    t0 = time.perf_counter()
    if args.validate:
        from megatron_tlt.planner.validate import check_sources, summary_lines, validate_all

        try:
            check_sources(args.results)
        except FileNotFoundError as e:
            print(f"--validate: {e}", file=sys.stderr)
            return 2
        out = validate_all(args.results)
        print("\n".join(summary_lines(out)))
    else:
        from megatron_tlt.config import load_config
        from megatron_tlt.planner import predict_for_config
        from megatron_tlt.planner.inputs import (bucket_factors_from_bench_spec,
                                                 drift_from_json, lengths_from_metrics,
                                                 lengths_from_workload, load_json,
                                                 table_from_bench_rollout)
        from megatron_tlt.planner.recipe import default_acceptance

        if not args.config:
            print("--config is required (or --validate)", file=sys.stderr)
            return 2
        cfg = load_config(args.config, args.overrides)
        from megatron_tlt.config import ConfigError
        from megatron_tlt.models.known import architecture
        from megatron_tlt.validation import validate

        try:  # the rules the launch and the dry run apply: no prediction for a refused recipe
            validate(cfg, architecture(cfg)[0], args.world_size)
        except ConfigError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        lengths = None
        if args.lengths is not None:
            lengths = (lengths_from_metrics(args.lengths) if args.lengths.suffix == ".jsonl"
                       else lengths_from_workload(args.lengths))
        if args.recommend:
            from megatron_tlt.config import ConfigError
            from megatron_tlt.rl.recommend import lines, recommend

            try:
                out = recommend(args.config, args.overrides, args.world_size, top=args.top,
                                steps=min(args.steps, 2), hardware=args.hardware,
                                lengths=lengths)
            except ConfigError as e:
                print(f"--recommend: {e}", file=sys.stderr)
                return 2
            out.pop("_candidates")
            print("\n".join(lines(out)))
            return _write(args, out, t0)
        acc = None
        if args.drift is not None:
            online, frozen = drift_from_json(json.loads(args.drift.read_text()))
            acc = replace(default_acceptance(cfg, args.hardware), drift_online=online,
                          drift_frozen=frozen,
                          source=f"drift run {args.drift.name} (per-step acceptance of "
                          "both arms)")
        if args.accept_by_bucket is not None:
            doc = load_json(args.accept_by_bucket)
            if doc.get("timing_only"):  # random weights: its acceptance means nothing
                print(f"--accept-by-bucket: {args.accept_by_bucket} is timing only "
                      f"({doc.get('timing_only_reason')}); give a bench_spec JSON measured "
                      "on trained weights (e.g. on CPU), and this one as --spec-table",
                      file=sys.stderr)
                return 2
            acc = acc or default_acceptance(cfg, args.hardware)
            factors = bucket_factors_from_bench_spec(doc)
            acc = replace(acc, bucket_factors=factors, source=acc.source + "; by batch x "
                          + ", ".join(f"{f:.2f} (<= {b})" for b, f in factors)
                          + f" from {args.accept_by_bucket.name}")
        cost = None
        if args.table is not None:
            cost = table_from_bench_rollout(
                load_json(args.table),
                spec_doc=load_json(args.spec_table) if args.spec_table else None)
        pred = predict_for_config(cfg, args.world_size, hardware=args.hardware,
                                  lengths=lengths, acceptance=acc, steps=args.steps,
                                  cost=cost)
        print("\n".join(pred.lines()))
        out = pred.to_dict()
    return _write(args, out, t0)


def _write(args, out: dict, t0: float) -> int:
    out["planner_seconds"] = time.perf_counter() - t0
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, default=float) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
