"""The CPU inputs of the validation: our 2-core machine's step tables, as measured.

The runs we validate against (``tools/bench_e2e.py``, the demo recipe) run two DP
replicas as two 1-thread processes on the 2 cores, while ``tools/bench_rollout.py``
measures one engine with 2 threads. The conversion is measured too: the PP = 2
gathered rollout of ``bench_rollout_pp2_quiet_cpu.json`` is exactly two 1-thread
engines side by side on the same cores, against a 2-thread PP = 1 engine in the same
run. Every number below names the JSON it comes from; the ones that no JSON holds
are marked ``modelled``.
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Optional

import numpy as np

from .inputs import (NOISY_STEP_OVER_FLOOR, Acceptance, StepCost, TrainCost, _interp_log,
                     cpu_of, has_calibration, load_table, spec_slopes)

DECODE_TABLE = "bench_rollout_amd_epyc_avx512_full.json"  # AVX-512, 2 threads
DECODE_TABLE_AVX2 = "bench_rollout_quick_amd_epyc_avx2_cpu.json"  # AVX2, 2 threads
CORUN = "bench_rollout_pp2_quiet_cpu.json"  # AVX2: 2 x 1-thread engines vs 1 x 2 threads
# AVX-512: each PP = 2 rank's own decode steps at its share of the batch, beside the
# other rank (two 1-thread engines side by side: exactly a bench_e2e replica's
# situation), measured just before and just after the validated runs (E2E_RUNS and the
# demo run, one measurement window): the tables are their mean
CORUN_MEASURED = {"avx512": ("bench_rollout_pp2_corun_avx512_cpu.json",
                             "bench_rollout_pp2_corun_avx512_after_cpu.json")}
CORUN_PROMPT_TOKENS = 58.0  # the bench's reasoning-gym prompts: 48-68 tokens
SPEC_TABLE = "bench_spec_1k_drafter_cpu.json"  # AVX-512, 2 threads, fixed arms
DEMO_ALPHA = "bench_spec_T1_demo_drafter_cpu.json"  # the demo drafter's alpha at T = 1
# bench_e2e runs (2 x 1-thread replicas) between the two co-run tables
# (CORUN_MEASURED), each command run twice with the same code: the repeat measures how
# much this machine's speed moves between runs of the same work
E2E_RUNS = {
    "quick": ("bench_e2e_quick_avx512_cpu.json", "bench_e2e_quick_avx512_repeat_cpu.json"),
    "g8": ("bench_e2e_g8_avx512_cpu.json", "bench_e2e_g8_avx512_repeat_cpu.json"),
}
E2E_FILES = tuple(f for runs in E2E_RUNS.values() for f in runs)
PROMPT_TOKENS = 66.0  # a chain_sum prompt with the chat template and the recipe's
# instruction: the mean over 16 prompts counted with the SmolLM2 tokenizer (the JSONs
# do not record prompt lengths)
PREFILL_2T = 2.5 / 2176  # seconds per prompt token, one 2-thread engine: 32 prompts
# (2,176 tokens) in 2.5 s, docs/benchmarks.md ("Rollout engine vs transformers"); no
# JSON times the prefill alone. A 1-thread replica beside another pays the largest
# batch's co-run factor on it (a prefill is compute-bound like a large decode batch).


def _steps_ms(doc: dict) -> dict[int, float]:
    return {int(r["batch"]): float(r["engine_step_ms"]) for r in doc["results"]
            if r.get("step_over_floor", 1.0) <= NOISY_STEP_OVER_FLOOR}


def corun_factors() -> tuple[tuple, tuple, str]:
    """Per running batch of ONE engine, (1-thread engine beside another) / (one 2-thread
    engine at that batch), from the PP = 2 gathered run (each rank decodes half the
    prompts with 1 thread) and the AVX2 2-thread table of the same machine."""
    co = load_table(CORUN)
    two = _steps_ms(load_table(DECODE_TABLE_AVX2))
    bs, ts = sorted(two), [two[b] for b in sorted(two)]
    out_b, out_f = [], []
    # batch 1: the per-token times at 256 tokens (the other rank has no prompt)
    length = co["length"]["256"]
    out_b.append(1)
    out_f.append(length["pp2_ms_per_token"] / length["pp1_ms_per_token"])
    for r in co["results"]:
        case = r["case"]
        if not case.startswith("batch ") or case == "batch 1":
            continue
        total = int(case.split()[1])
        per_rank = total // 2
        ms = 1000.0 * total / r["pp2_tok_s"]  # one step of both ranks, each at total/2
        out_b.append(per_rank)
        out_f.append(ms / _interp_log(per_rank, bs, ts))
    return tuple(out_b), tuple(out_f), f"co-run factors from {CORUN} and {DECODE_TABLE_AVX2}"


def measured_corun_table(name: str) -> StepCost:
    """Decode steps of one 1-thread engine beside another, as measured: each PP = 2
    rank's median step at its share of the batch (``pp2_step_ms``), the resident
    context's cost from the batch-1 length scaling, prefill per prompt token as the
    ranks measured it side by side."""
    doc = load_table(name)
    pts = sorted((int(r["pp2_rows_per_rank"]), float(r["pp2_step_ms"]) / 1000)
                 for r in doc["results"] if r.get("pp2_step_ms") and r["case"].startswith("batch"))
    length = doc["length"]
    lo, hi = min(length, key=int), max(length, key=int)
    kv = ((length[hi]["pp2_ms_per_token"] - length[lo]["pp2_ms_per_token"]) / 1000
          / (int(hi) - int(lo)))
    pre = [r["pp2_prefill_ms_per_token"] for r in doc["results"]
           if r.get("pp2_prefill_ms_per_token")]
    sb, ss = spec_slopes(load_table(SPEC_TABLE))
    # each row holds its prompt and on average half the new tokens during the run
    ref = CORUN_PROMPT_TOKENS + doc["config"]["new_tokens"] / 2
    return StepCost(tuple(b for b, _ in pts), tuple(t for _, t in pts), ref_ctx=ref,
                    kv_seconds_per_token=max(kv, 0.0), spec_batches=sb, spec_slope=ss,
                    prefill_seconds_per_token=float(np.max(pre)) / 1000 if pre else 0.0,
                    source=(f"{name} ({cpu_of(doc)}, {doc['date']}): two 1-thread engines "
                            f"side by side, each rank's median decode step at rows "
                            f"{[b for b, _ in pts]}; speculative step costs from "
                            f"{SPEC_TABLE}"))


def measured_alone_table(name: str) -> Optional[StepCost]:
    """Decode steps of one 1-thread engine with the machine to itself: the same run's
    PP = 1 engine when it ran with one thread (``pp1_step_ms``, from 2 rows; the other
    rank waits). None when that run's PP = 1 engine had more threads."""
    doc = load_table(name)
    if doc["config"].get("pp1_threads") != 1:
        return None
    pts = {int(r["case"].split()[1]): float(r["pp1_step_ms"]) / 1000
           for r in doc["results"] if r.get("pp1_step_ms") and r["case"].startswith("batch")}
    co = measured_corun_table(name)
    bs = sorted(pts)
    return replace(co, batches=tuple(bs), seconds=tuple(pts[b] for b in bs),
                   source=f"{name}: one 1-thread engine alone, rows {bs}")


def mean_table(tables: list[StepCost]) -> StepCost:
    """The mean of step tables measured at the same rows (the same command run before
    and after the runs it predicts: this machine's speed moves over minutes)."""
    if len(tables) == 1:
        return tables[0]
    first = tables[0]
    if any(t.batches != first.batches for t in tables):
        raise ValueError("step tables to average must be measured at the same rows")
    return replace(first, seconds=tuple(float(np.mean(x)) for x in
                                        zip(*(t.seconds for t in tables))),
                   kv_seconds_per_token=float(np.mean([t.kv_seconds_per_token
                                                       for t in tables])),
                   prefill_seconds_per_token=float(np.mean([t.prefill_seconds_per_token
                                                            for t in tables])),
                   source=f"the mean of {len(tables)} runs: " + "; ".join(
                       t.source for t in tables))


def _measured(avx: str) -> tuple:
    names = CORUN_MEASURED.get(avx, ())
    return names if names and all(has_calibration(n) for n in names) else ()


def cpu_1t_alone_table(avx: str = "avx512") -> Optional[StepCost]:
    """The 1-thread replica's steps once the other replica finished (None: not
    measured for this ISA)."""
    tables = [measured_alone_table(n) for n in _measured(avx)]
    return mean_table(tables) if tables and all(tables) else None


def cpu_1t_corun_table(avx: str = "avx512") -> StepCost:
    """Decode steps of one 1-thread replica beside another on the 2-core machine: the
    measured co-run table where there is one for this ISA, else the 2-thread table
    converted by the co-run factors."""
    names = _measured(avx)
    if names:
        return mean_table([measured_corun_table(n) for n in names])
    doc = load_table(DECODE_TABLE if avx == "avx512" else DECODE_TABLE_AVX2)
    two = _steps_ms(doc)
    fb, ff, fsrc = corun_factors()
    bs = sorted(two)
    grid = sorted(set(bs) | set(fb))
    secs = [_interp_log(b, bs, [two[x] for x in bs]) / 1000 * _interp_log(b, fb, ff)
            for b in grid]
    co = load_table(CORUN)["length"]
    # resident-context cost: batch-1 per-token time at 64 and 1024 tokens, 2 threads
    kv = (co["1024"]["pp1_ms_per_token"] - co["64"]["pp1_ms_per_token"]) / 1000 / 960 * ff[0]
    sb, ss = spec_slopes(load_table(SPEC_TABLE))
    prefill = PREFILL_2T * ff[-1]
    dropped = sorted(set(int(r["batch"]) for r in doc["results"]) - set(two))
    return StepCost(tuple(grid), tuple(secs), ref_ctx=96.0, kv_seconds_per_token=kv,
                    spec_batches=sb, spec_slope=ss, prefill_seconds_per_token=prefill,
                    source=(f"{DECODE_TABLE if avx == 'avx512' else DECODE_TABLE_AVX2} "
                            f"({cpu_of(doc)}, 2 threads"
                            + (f"; batch {dropped} dropped as noisy" if dropped else "")
                            + f") x {fsrc} (AVX2); speculative step costs from "
                            f"{SPEC_TABLE}; prefill {PREFILL_2T * 1e3:.2f} ms per prompt token at "
                            f"2 threads (docs/benchmarks.md) x {ff[-1]:.2f}"))


def demo_drafter_alpha() -> Acceptance:
    doc = load_table(DEMO_ALPHA)
    return Acceptance.constant(doc["alpha"]["alpha"],
                               source=f"{DEMO_ALPHA}: the demo drafter's alpha at T=1")


def summary_lengths(n: int, total: float, longest: float, at_cap: int, replicas: int,
                    deal_seed: int = -1) -> list[np.ndarray]:
    """Per-replica response lengths consistent with a step's recorded summary (count,
    total, longest, number truncated): ``at_cap`` responses at the longest (at least
    one), the rest log-normal quantiles (sigma 1) scaled to the remaining total and
    kept below the longest. Only the summary is recorded, so which replica holds what
    is modelled: dealt at random (a generator seeded by ``deal_seed``) in equal
    shares, or, with ``deal_seed`` < 0, longest first in snake order."""
    from statistics import NormalDist

    k = max(1, at_cap)
    rest_n = n - k
    rest_total = max(total - k * longest, rest_n)
    if rest_n > 0:
        q = (np.arange(rest_n) + 0.5) / rest_n
        shape = np.exp(np.array([NormalDist().inv_cdf(float(x)) for x in q]))
        rest = np.minimum(shape / shape.sum() * rest_total, longest - 1)
    else:
        rest = np.zeros(0)
    lens = np.maximum(1.0, np.round(np.sort(np.concatenate(
        [np.full(k, float(longest)), rest]))[::-1]))
    if deal_seed >= 0:
        perm = np.random.default_rng(deal_seed).permutation(len(lens))
        return [lens[perm[r::replicas]] for r in range(replicas)]
    out: list[list[float]] = [[] for _ in range(replicas)]
    for i, x in enumerate(lens):
        rnd, pos = divmod(i, replicas)
        out[pos if rnd % 2 == 0 else replicas - 1 - pos].append(float(x))
    return [np.asarray(o) for o in out]


# ---------------------------------------------------------------------- the update phase
def mark_first_backward(records: list[dict]) -> None:
    """Flag, per replica, the record of its process's first backward
    (``work["first_backward"]``), ``records`` in the order they ran. That backward
    measured 3-5 s longer than the same work later (bench_e2e g8, coupled step 1:
    1,712 tokens in 24.0 s for the arm that ran first, 19.6 s for the other): its
    activations are the process's first touch of that much memory."""
    seen: set[int] = set()
    for r in records:
        w = r.get("work")
        if not w:
            continue
        flags = []
        for i, b in enumerate(w["backward_tokens"]):
            flags.append(bool(b) and i not in seen)
            if b:
                seen.add(i)
        r["work"] = dict(w, first_backward=flags)


def e2e_records(doc: dict) -> list[dict]:
    """One record per (mode, step, arm) of a bench_e2e JSON: its workload and times
    (each step's arms ran one after the other, ``first`` first, in one process per
    replica)."""
    c = doc["config"]
    out = []
    for r in doc["results"]:
        order = sorted(r["arms"], key=lambda a: a != r.get("first"))
        for arm in order:
            v = r["arms"][arm]
            n = c["prompts_per_step"] * c["group_size"]
            out.append({
                "mode": r["mode"], "step": r["step"], "arm": arm, "group_size": c["group_size"],
                "prompts": c["prompts_per_step"], "dp": c["dp"], "responses": n,
                "tokens": v["generated_tokens"], "longest": v["response_length_max"],
                "at_cap": round(v["truncated_fraction"] * n),
                "accept_len": v.get("accept_len"),
                "work": v.get("update_work"),
                "measured": {"rollout": v["rollout"], "tail": v["tail"], "update": v["update"],
                             "step": v["step"], "rollout_fraction": v["rollout"] / v["step"]},
                "threshold": c["speculative"]["threshold"],
            })
    mark_first_backward(out)
    return out


def _fit_part(rows: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Seconds per padded token and per attention cell of one part (with a backward,
    or forward only) from (tokens, cells, seconds) per (step, replica): non-negative
    least squares on both when the records hold cells (a micro-batch of r rows padded
    to T: r*T tokens, r*T^2 cells), else the median seconds per token."""
    rows = [r for r in rows if r[0] > 0]
    if not rows:
        return 0.0, 0.0
    if any(r[1] <= 0 for r in rows) or len(rows) < 3:
        return median(r[2] / r[0] for r in rows), 0.0
    from scipy.optimize import nnls

    x = np.array([[r[0], r[1]] for r in rows], dtype=float)
    y = np.array([r[2] for r in rows], dtype=float)
    scale = x.max(axis=0)
    # relative residuals: every (step, replica) weighs the same, long or short
    w = 1.0 / y
    coef, _ = nnls(x / scale * w[:, None], y * w)
    coef = coef / scale
    return float(coef[0]), float(coef[1])


def fit_update(records: list[dict]) -> dict:
    """The update phase's costs from ``records`` whose steps recorded each replica's
    work (``update_work``: padded tokens and attention cells with a backward and
    forward only, and the seconds of each part):

    - seconds per padded token and per attention cell, with a backward (forward +
      backward) and forward only: fitted over every (step, replica) that ran that part
      (``_fit_part``);
    - the gradient reduction + optimizer step: per step the smallest over the replicas
      (the slowest replica's, without waiting for another), median over steps, the
      first step of a run apart;
    - the rest (collation, the loss denominators' and metrics' collectives): the
      measured update less the slowest replica's parts, median over steps."""
    back, fwd, step_s, first_s, rest, first_back = [], [], [], [], [], []
    used = [r for r in records if r.get("work")]
    for r in used:
        w = r["work"]
        nb = len(w["backward_tokens"])
        cb = w.get("backward_cells", [0] * nb)
        cf = w.get("forward_cells", [0] * nb)
        fb = w.get("first_backward", [False] * nb)
        for i in range(nb):
            row = (w["backward_tokens"][i], cb[i], w["backward_seconds"][i])
            (first_back if fb[i] else back).append(row)
            fwd.append((w["forward_tokens"][i], cf[i], w["forward_seconds"][i]))
        st = min(w["step_seconds"])
        (first_s if r["step"] == 1 else step_s).append(st)
        compute = max(bs + fs for bs, fs in zip(w["backward_seconds"], w["forward_seconds"]))
        rest.append(r["measured"]["update"] - compute - st)
    step = median(step_s) if step_s else (median(first_s) if first_s else 0.0)
    b_tok, b_cell = _fit_part(back)
    f_tok, f_cell = _fit_part(fwd)
    extra = [sec - b_tok * t - b_cell * c for t, c, sec in first_back if t > 0]
    return {"backward_s_per_token": b_tok, "backward_s_per_cell": b_cell,
            "forward_s_per_token": f_tok, "forward_s_per_cell": f_cell,
            "first_backward_extra_s": max(median(extra), 0.0) if extra else 0.0,
            "step_s": step,
            "first_step_extra_s": max(median(first_s) - step, 0.0) if first_s else 0.0,
            "other_s": median(rest) if rest else 0.0,
            "from_records": len(used)}


def predict_update(rec: dict, upd: dict) -> float:
    """A step's update from its replicas' recorded work and ``fit_update``'s costs: the
    slowest replica's forwards and backwards, then the reduction + optimizer step."""
    w = rec["work"]
    n = len(w["backward_tokens"])
    cb, cf = w.get("backward_cells", [0] * n), w.get("forward_cells", [0] * n)
    fb = w.get("first_backward", [False] * n)
    compute = max(upd["backward_s_per_token"] * w["backward_tokens"][i]
                  + upd.get("backward_s_per_cell", 0.0) * cb[i]
                  + upd.get("first_backward_extra_s", 0.0) * fb[i]
                  + upd["forward_s_per_token"] * w["forward_tokens"][i]
                  + upd.get("forward_s_per_cell", 0.0) * cf[i] for i in range(n))
    return compute + upd["step_s"] + upd["other_s"] + \
        (upd["first_step_extra_s"] if rec["step"] == 1 else 0.0)


def cpu_train_cost(files=E2E_FILES) -> TrainCost:
    """The update phase of the 2-core machine from bench_e2e's recorded update work:
    seconds per padded token and per attention cell with a backward, and per
    optimizer step (reduction + step + the rest; the first step's extra apart)."""
    upd = fit_update([r for f in files for r in e2e_records(load_table(f))])
    fixed = upd["step_s"] + upd["other_s"]
    per_cell = upd.get("backward_s_per_cell", 0.0)
    first = upd["first_step_extra_s"] + upd.get("first_backward_extra_s", 0.0)
    return TrainCost(update_per_token=upd["backward_s_per_token"], update_per_cell=per_cell,
                     update_fixed=fixed, first_step_extra=first,
                     source=f"update: {1e3 * upd['backward_s_per_token']:.1f} ms per padded "
                     f"token + {1e6 * per_cell:.2f} us per attention cell (forward + "
                     f"backward) + {fixed:.1f} s per optimizer step "
                     f"(+{first:.1f} s the first), every response "
                     f"trained (fitted on {', '.join(files)})")
