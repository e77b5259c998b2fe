"""The planner against measurements: our own CPU runs, and published GPU figures.

CPU (``validate_cpu``): each step of ``tools/bench_e2e.py`` (both arms, both sampling
modes) and of the demo recipe's 30-step run is predicted from tables measured on the
same machine (``cpu_inputs``) and the step's recorded workload (responses, total and
longest length, truncated share, groups with zero reward variance); the update phase,
for which no benchmark measures a training throughput, from the other bench_e2e file's
updates (cross-fitted: the file predicted never fits its own numbers). Errors are
reported per phase: rollout (slowest replica), tail (first to last replica), update,
step and rollout fraction.

Published (``validate_published``): the figures quoted as inputs, the rest from the
roofline (modelled), and how far off each prediction is.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Optional

import numpy as np

from .cpu_inputs import (E2E_FILES, E2E_RUNS, PROMPT_TOKENS, cpu_1t_alone_table,
                         cpu_1t_corun_table, demo_drafter_alpha, e2e_records, fit_update,
                         mark_first_backward, predict_update, summary_lengths)
from .inputs import (Acceptance, DrafterGroup, LengthModel, ModelShape, accept_length,
                     results_file, roofline)
from .sim import EngineSettings, Layout, Scenario, run_engine, simulate_arm

# the demo recipe (examples/rl/smollm2_cpu.yaml: 4 prompts x 8, cap 256, 2 replicas)
# with TLT off, on a quiet machine: torchrun ... train.steps=8 (docs/benchmarks.md,
# "The planner against these measurements")
DEMO_RUN = "rl_smollm2_demo_recipe_8steps_cpu.jsonl"
DEMO_RESPONSES, DEMO_GROUP = 32, 8
PHASES = ("rollout", "tail", "update", "step", "rollout_fraction")


# ---------------------------------------------------------------------- CPU: bench_e2e
DEALS = 32  # random deals of the responses over the replicas averaged per step


def predict_record(rec: dict, table, alpha: Optional[list], upd: dict,
                   alone=None) -> dict:
    """A bench_e2e-shaped step: each replica decodes its share of the responses; the
    lengths come from the record's summary, and since which replica held which is not
    recorded, the times are the mean over ``DEALS`` seeded random deals. ``alone``: the
    step costs of a replica once the others finished (they share the machine's cores
    and memory bandwidth until then); the last replica to finish runs alone after the
    one before it finished."""
    eng = EngineSettings(max_batch_size=32, threshold=rec["threshold"])
    rollouts, tails, spec_tok, tok = [], [], 0.0, 0.0
    for seed in range(DEALS):
        per_rep = summary_lengths(rec["responses"], rec["tokens"], rec["longest"],
                                  rec["at_cap"], rec["dp"], deal_seed=seed)
        g = rec["group_size"]
        runs = [run_engine(lens, PROMPT_TOKENS, table, eng, alpha, group=g)
                for lens in per_rep]
        if alone is not None and len(runs) > 1:
            last = max(range(len(runs)), key=lambda i: runs[i].finish)
            others = max(r.finish for i, r in enumerate(runs) if i != last)
            runs[last] = run_engine(per_rep[last], PROMPT_TOKENS, table, eng, alpha,
                                    alone=alone, alone_after=others, group=g)
        fin = [r.finish for r in runs]
        rollouts.append(max(fin))
        tails.append(max(fin) - min(fin))
        spec_tok += sum(r.spec_tokens for r in runs)
        tok += sum(r.tokens for r in runs)
    update = predict_update(rec, upd)
    rollout = float(np.mean(rollouts))
    return {"rollout": rollout, "tail": float(np.mean(tails)), "update": update,
            "step": rollout + update, "rollout_fraction": rollout / (rollout + update),
            "speculation_share": spec_tok / max(tok, 1.0)}


def _measured_run(name: str, results: Path) -> dict:
    """A measured run the validation predicts, from the folder ``results`` or the
    planner's shipped tables (``inputs.results_file``)."""
    return json.loads(results_file(name, results).read_text())


def check_sources(results: Path) -> None:
    """Raise FileNotFoundError, saying what to do, unless every measured run the
    validation predicts is at hand (in ``results``, a clone's docs/results/, or shipped)."""
    for name in (*E2E_FILES, DEMO_RUN):
        results_file(name, results)


def _err(pred: float, meas: float) -> Optional[float]:
    return None if not meas else pred / meas - 1.0


def _phase_errors(rows: list[dict]) -> dict:
    """Per phase: the error of the mean over the rows (what a planner is asked for: a
    typical step) and the median absolute error of single steps."""
    out = {}
    for ph in PHASES:
        p = [r["predicted"][ph] for r in rows]
        m = [r["measured"][ph] for r in rows]
        single = [abs(a / b - 1.0) for a, b in zip(p, m) if b]
        out[ph] = {"predicted_mean": float(np.mean(p)), "measured_mean": float(np.mean(m)),
                   "error_of_mean": _err(float(np.mean(p)), float(np.mean(m))),
                   "median_abs_error_per_step": float(median(single)) if single else None}
    return out


def validate_e2e(results: Path) -> dict:
    """Each bench_e2e command's steps (all its runs pooled) predicted from the co-run
    and alone tables and each step's recorded workload; the update fitted on the other
    command's runs. Per run as well: the spread between runs of the same work is this
    machine's, not the model's."""
    table, alone = cpu_1t_corun_table(), cpu_1t_alone_table()
    alpha = demo_drafter_alpha().at(0)
    docs = {f: _measured_run(f, results) for f in E2E_FILES}
    recs = {f: e2e_records(d) for f, d in docs.items()}
    out = {"table": table.source, "alone_table": alone.source if alone else None,
           "alpha": alpha, "commands": {}}
    for name, files in E2E_RUNS.items():
        fitted_on = [g for other, fs in E2E_RUNS.items() if other != name for g in fs]
        upd = fit_update([r for g in fitted_on for r in recs[g]])
        rows, runs = [], {}
        for f in files:
            mine = []
            for rec in recs[f]:
                pred = predict_record(rec, table, alpha if rec["arm"] == "tlt" else None,
                                      upd, alone)
                mine.append({k: rec[k] for k in ("mode", "step", "arm")} |
                            {"run": f, "predicted": pred, "measured": rec["measured"]})
            c = docs[f]["config"]
            runs[f] = {"cpu": f"{c.get('cpu')} ({c.get('cpu_best_isa')}), "
                              f"{docs[f].get('date')}",
                       "phases": _phase_errors(mine)}
            rows += mine
        out["commands"][name] = {
            "runs": runs,
            "update_model": upd | {"fitted_on": fitted_on},
            "phases": _phase_errors(rows),
            "run_to_run": _run_spread(rows),
            "step_speedup": {"predicted": _mean_ratio(rows, "off", "tlt", "predicted"),
                             "measured": _mean_ratio(rows, "off", "tlt", "measured")},
            "steps": rows,
        }
    return out


def _run_spread(rows: list[dict]) -> dict:
    """Per phase, the largest |run / mean of runs - 1| of a (mode, step, arm) measured
    in every run: how far the machine alone moves the same work (coupled mode: the
    same responses in every run)."""
    by_key: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["mode"] == "coupled":
            by_key.setdefault((r["step"], r["arm"]), []).append(r["measured"])
    out = {}
    for ph in ("rollout", "update", "step"):
        dev = [abs(m[ph] / float(np.mean([x[ph] for x in ms])) - 1.0)
               for ms in by_key.values() if len(ms) > 1 for m in ms]
        out[ph] = max(dev) if dev else None
    return out


def _mean_ratio(rows: list[dict], a: str, b: str, key: str) -> float:
    """Mean step of arm ``a`` over mean step of arm ``b`` (coupled mode: the arms
    decode the same responses, so the ratio is the TLT effect)."""
    sa = [r[key]["step"] for r in rows if r["arm"] == a and r["mode"] == "coupled"]
    sb = [r[key]["step"] for r in rows if r["arm"] == b and r["mode"] == "coupled"]
    return float(np.mean(sa) / np.mean(sb)) if sa and sb else float("nan")


# ---------------------------------------------------------------------- CPU: the demo run
def demo_records(path) -> list[dict]:
    """One record per step of a demo-recipe run's metrics.jsonl (TLT off): its workload
    (responses, lengths, each replica's update work) and its measured phases."""
    out = []
    for line in Path(path).read_text().splitlines():
        m = json.loads(line)
        if "timing" not in m or "update_work" not in m.get("timeline", {}):
            continue
        n = DEMO_RESPONSES
        t, rollout = m["timing"], max(m["timeline"]["replica_finish"])
        out.append({"step": m["step"], "responses": n, "group_size": DEMO_GROUP,
                    "tokens": m["response_length/mean"] * n,
                    "longest": m["response_length/max"],
                    "at_cap": round(m["truncated_fraction"] * n),
                    "dp": len(m["timeline"]["replica_finish"]), "threshold": 8,
                    "work": m["timeline"]["update_work"],
                    "measured": {"rollout": rollout, "tail": t["tail"],
                                 "update": t["update"], "step": t["step"],
                                 "rollout_fraction": rollout / t["step"]}})
    mark_first_backward(out)  # one process per replica, the steps in order
    return out


def validate_demo(results: Path, upd: Optional[dict] = None) -> dict:
    """The demo recipe run with TLT off (``DEMO_RUN``: 4 prompts x 8, 2 replicas, cap
    256), each step predicted from its own workload; the update fitted on both
    bench_e2e files."""
    table, alone = cpu_1t_corun_table(), cpu_1t_alone_table()
    if upd is None:
        upd = fit_update([r for f in E2E_FILES
                          for r in e2e_records(_measured_run(f, results))])
    rows = [{"step": rec["step"], "predicted": predict_record(rec, table, None, upd, alone),
             "measured": rec["measured"]} for rec in demo_records(
                 results_file(DEMO_RUN, results))]
    return {"run": DEMO_RUN, "update_model": upd | {"fitted_on": list(E2E_FILES)},
            "phases": _phase_errors(rows), "steps": rows}


def validate_cpu(results: Path) -> dict:
    """The CPU runs in the folder ``results`` (a clone's docs/results/) predicted."""
    e2e = validate_e2e(results)
    demo = validate_demo(results)
    headline = {}
    for ph in PHASES:
        errs = [abs(v["phases"][ph]["error_of_mean"]) for v in
                [*e2e["commands"].values(), demo] if v["phases"][ph]["error_of_mean"] is not None]
        headline[ph] = max(errs) if errs else None
    return {"bench_e2e": e2e, "demo": demo,
            "cpu_validation_error": headline | {
                "definition": "per phase, the largest over the three workloads (the two "
                              "bench_e2e commands, each over its runs pooled, and the "
                              "demo recipe's run) of |mean predicted / mean measured - 1| "
                              "over the steps (bench_e2e: both arms, both sampling "
                              "modes); single runs under bench_e2e.commands.*.runs"}}


# ---------------------------------------------------------------------- published points
QWEN25_7B = ModelShape(7.62e9, 28, 3584, 4 * 128, 152064)
QWEN25_32B = ModelShape(32.8e9, 64, 5120, 8 * 128, 152064)
QWEN3_8B = ModelShape(8.19e9, 36, 4096, 8 * 128, 151936)


def gpu_scenario(model: ModelShape, layout: Layout, *, prompts: int, group: int,
                 cap: int, acceptance: Acceptance, hw: str = "h100",
                 max_batch: int = 64, threshold: int = 32, arms: Optional[tuple] = None,
                 drafter_tokens0: float = 0.0, drafter: bool = True,
                 median_fraction: float = 0.2, steps: int = 4,
                 minibatches: int = 4) -> Scenario:
    """A GPU scenario with every cost from the roofline (modelled)."""
    from ..config import DrafterGroupConfig
    from .recipe import drafter_throughput, gpu_train_cost

    cost = roofline(hw, model, layout.tp)
    lengths = LengthModel(cap=cap, median=median_fraction * cap, sigma=0.8,
                          cap_fraction=0.03, source=f"log-normal, median "
                          f"{median_fraction:.0%} of {cap}, sigma 0.8, 3 % at the cap (assumed)")
    eng = EngineSettings(max_batch, threshold, arms=arms or EngineSettings().arms)
    dg = drafter_throughput(cost, layout, DrafterGroupConfig()) if drafter \
        else DrafterGroup(False)
    dg.tokens_trained0 = drafter_tokens0
    return Scenario(layout, prompts, group, 256.0, lengths, cost,
                    gpu_train_cost(cost, layout, logprob_passes=1.0), eng, acceptance, dg,
                    steps=steps, seed=0, minibatches=minibatches)


GPU_ARMS = ((1, (6, 7, 8)), (2, (4, 5, 6)), (4, (3, 4, 5)), (8, (2, 3, 4)),
            (32, (1, 2, 3)), (10 ** 9, (1, 2)))


def tlt_scaling() -> dict:
    """TLT's Qwen2.5-7B end-to-end speedup at 1 / 2 / 4 / 8 nodes of 8 H100 (quoted:
    1.21 / 1.45 / 1.62 / 1.76x) against the planner on the same step (the 7B recipe's
    128 prompts x 8, cap 8192) spread over more replicas (TP 2)."""
    from .recipe import DEFAULT_TOKENS_SCALE, scaled_curve

    published = {1: 1.21, 2: 1.45, 4: 1.62, 8: 1.76}
    acc = scaled_curve(0.7, tokens_scale=DEFAULT_TOKENS_SCALE)
    rows = {}
    for nodes, pub in published.items():
        lay = Layout(2, 1, nodes * 8 // 2)
        sc = gpu_scenario(QWEN25_7B, lay, prompts=128, group=8, cap=8192, acceptance=acc,
                          arms=GPU_ARMS, drafter_tokens0=acc.tokens[len(acc.tokens) // 2])
        off, tlt = simulate_arm(sc, "off"), simulate_arm(sc, "tlt")
        pred = off.step / tlt.step
        rows[str(nodes)] = {"published": pub, "predicted": pred, "error": pred / pub - 1,
                            "rollout_fraction_without_tlt": off.rollout_fraction,
                            "accept_len": tlt.mean("accept_len"),
                            "speculation_share": tlt.spec_share,
                            "alpha_to_match": _alpha_to_match(sc, off.step, pub)}
    return {"what": "end-to-end RL step speedup, TLT vs no TLT, Qwen2.5-7B, H100",
            "inputs_quoted": "the four published speedups; 8 H100 per node",
            "inputs_assumed": ["TP 2, DP = GPUs / 2 (the 7B recipe's layout)",
                               "the 7B recipe's step: 128 prompts x 8, cap 8192, 4 "
                               "mini-batches; lengths log-normal (median 20 % of the cap, "
                               "3 % at the cap)",
                               f"acceptance: {acc.source}; drafter starts mid-curve",
                               "roofline costs (modelled)"],
            "points": rows}


def _alpha_to_match(sc: Scenario, off_step: float, speedup: float) -> Optional[float]:
    """The constant per-token alpha (every depth, no drafter training) at which the
    scenario's predicted speedup equals ``speedup`` (None: not reachable below 0.95)."""
    def gain(a: float) -> float:
        s2 = replace(sc, acceptance=Acceptance.constant([a]),
                     drafter=DrafterGroup(False))
        return off_step / simulate_arm(s2, "tlt").step

    lo, hi = 0.05, 0.95
    if gain(hi) < speedup:
        return None
    for _ in range(10):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if gain(mid) < speedup else (lo, mid)
    return round((lo + hi) / 2, 3)


def tlt_32b_batch_gains() -> dict:
    """Speculative decoding's gain on Qwen2.5-32B at TP 4 (one H100 node, half of it)
    at running batch 1 and 32: the planner's decode-step rate ratio with the best arm
    of the bucket. TLT's own figures for these points are not in our notes
    (docs: /work/shared/design/TLT.md), so the comparison is open."""
    cost = roofline("h100", QWEN25_32B, 4)
    out = {}
    for b, depths in ((1, (6, 7, 8)), (32, (1, 2, 3))):
        for alpha in (0.6, 0.7, 0.8):
            ctx = b * 4096
            best = max((accept_length([alpha], k) * cost.plain(b, ctx) / cost.spec(b, k, ctx), k)
                       for k in depths)
            out[f"batch {b}, alpha {alpha}"] = {"gain": best[0], "depth": best[1]}
    return {"what": "decode speedup from speculation, Qwen2.5-32B TP 4, H100, 4k context",
            "published": None,
            "missing_input": "TLT's batch-1 and batch-32 figures (not in TLT.md or the "
                             "issue text) and the acceptance they ran at",
            "predicted": out}


def nemo_rl_qwen3_8b() -> dict:
    """NeMo-RL's Qwen3-8B generation time 100 -> 56.6 s (1.77x) with an EAGLE-3
    drafter at draft depth 3 (quoted); acceptance not quoted with it: Marin's frozen
    EAGLE-3 2.53-2.56 (TLT.md) stands in, and the depth-3 alpha that gives 2.55."""
    published = 100.0 / 56.6
    acc = Acceptance.from_accept_length(2.55, 3, "accept length 2.55 at depth 3 "
                                        "(Marin's EAGLE-3, TLT.md)")
    arms = ((10 ** 9, (3,)),)
    rows = {}
    for name, thr in (("gated (break-even)", 10 ** 6), ("threshold 32", 32)):
        sc = gpu_scenario(QWEN3_8B, Layout(1, 1, 8), prompts=64, group=16, cap=16384,
                          acceptance=acc, arms=arms, threshold=thr, max_batch=64,
                          drafter=False, median_fraction=0.25)
        off, on = simulate_arm(sc, "off"), simulate_arm(sc, "frozen")
        pred = off.mean("rollout") / on.mean("rollout")
        rows[name] = {"predicted": pred, "error": pred / published - 1,
                      "generation_s": {"off": off.mean("rollout"), "on": on.mean("rollout")},
                      "speculation_share": on.spec_share}
    return {"what": "generation (rollout) speedup, Qwen3-8B, draft depth 3",
            "published": published,
            "inputs_assumed": ["8 H100, TP 1, DP 8; 64 prompts x 16, cap 16384, median "
                               "25 % of the cap, 64 rows per engine (NeMo-RL's workload and "
                               "vLLM's batch are not quoted)",
                               acc.source, "roofline costs (modelled)"],
            "points": rows}


def validate_published() -> dict:
    return {"tlt_qwen25_7b_scaling": tlt_scaling(),
            "tlt_qwen25_32b_tp4_batch_gains": tlt_32b_batch_gains(),
            "nemo_rl_qwen3_8b_generation": nemo_rl_qwen3_8b()}


def validate_all(results: Path) -> dict:
    """The whole validation, JSON-able (``tools/plan_tlt.py --validate --json``): the
    measured runs in the folder ``results`` (a clone's docs/results/) predicted."""
    check_sources(results)
    from .cpu_inputs import (CORUN, CORUN_MEASURED, DECODE_TABLE, DECODE_TABLE_AVX2,
                             DEMO_ALPHA, SPEC_TABLE)
    from .recipe import DEFAULT_ALPHA_GPU

    cpu, pub = validate_cpu(results), validate_published()
    scaling = pub["tlt_qwen25_7b_scaling"]["points"]
    nemo = pub["nemo_rl_qwen3_8b_generation"]["points"]
    return {
        "benchmark": "planner_validation",
        "config": {"measured_inputs": [*(n for names in CORUN_MEASURED.values()
                                          for n in names), DECODE_TABLE,
                                       DECODE_TABLE_AVX2, CORUN, SPEC_TABLE,
                                       DEMO_ALPHA, *E2E_FILES, DEMO_RUN,
                                       "drafter_alpha_curves_t1_cpu.json"],
                   "measured_in_docs": "CPU prefill: docs/benchmarks.md (no JSON)",
                   "modelled": "H100/H200 roofline (planner/inputs.py HARDWARE), GPU "
                               "lengths and acceptance (docs/planning.md)",
                   "gpu_alpha": DEFAULT_ALPHA_GPU, "deals_per_step": DEALS},
        "cpu_validation_error": cpu["cpu_validation_error"],
        "published_error": {
            **{f"tlt_7b_{n}_nodes": r["error"] for n, r in scaling.items()},
            **{f"nemo_rl_qwen3_8b_{k.split()[0]}": r["error"] for k, r in nemo.items()},
            "tlt_32b_tp4_batch_gains": None},
        "cpu": cpu, "published": pub,
    }


def summary_lines(v: dict) -> list[str]:
    """The validation as a readable table."""
    out = ["CPU: bench_e2e (predicted / measured, mean over the command's steps in all "
           "its runs; error; each run's error)"]
    for name, x in v["cpu"]["bench_e2e"]["commands"].items():
        out.append(f"  {name}: {', '.join(x['runs'])}:")
        for ph, e in x["phases"].items():
            each = ", ".join(f"{r['phases'][ph]['error_of_mean']:+.0%}"
                             for r in x["runs"].values())
            out.append(f"    {ph:17s} {e['predicted_mean']:8.3f} / {e['measured_mean']:8.3f}"
                       f"  {e['error_of_mean']:+.1%}  (runs: {each}; single steps: median "
                       f"|error| {e['median_abs_error_per_step']:.0%})")
        spread = x["run_to_run"]
        out.append("    the same work between runs (coupled): up to " + ", ".join(
            f"{k} {val:.0%}" for k, val in spread.items() if val is not None))
    d = v["cpu"]["demo"]
    out.append(f"  {d['run']} (the demo recipe, TLT off):")
    for ph, e in d["phases"].items():
        out.append(f"    {ph:17s} {e['predicted_mean']:8.3f} / {e['measured_mean']:8.3f}"
                   f"  {e['error_of_mean']:+.1%}  (single steps: median |error| "
                   f"{e['median_abs_error_per_step']:.0%})")
    head = v["cpu"]["cpu_validation_error"]
    out.append("  cpu_validation_error: " + ", ".join(
        f"{k} {val:.1%}" for k, val in head.items() if isinstance(val, float)))
    p = v["published"]
    out.append("published points (predicted vs published):")
    for n, r in p["tlt_qwen25_7b_scaling"]["points"].items():
        out.append(f"  TLT Qwen2.5-7B, {n} node(s): {r['predicted']:.2f}x vs "
                   f"{r['published']:.2f}x ({r['error']:+.0%}); alpha to match: "
                   f"{r['alpha_to_match']}")
    for n, r in p["nemo_rl_qwen3_8b_generation"]["points"].items():
        out.append(f"  NeMo-RL Qwen3-8B generation, {n}: {r['predicted']:.2f}x vs "
                   f"{p['nemo_rl_qwen3_8b_generation']['published']:.2f}x ({r['error']:+.0%})")
    g = p["tlt_qwen25_32b_tp4_batch_gains"]
    out.append("  TLT Qwen2.5-32B TP 4 speculation gain (published figure not available): "
               + ", ".join(f"{k} {r['gain']:.2f}x" for k, r in g["predicted"].items()))
    return out
