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

import numpy as np

from .inputs import (Acceptance, StepCost, _interp_log, cpu_of, load_json, spec_slopes)

DECODE_TABLE = "bench_rollout_amd_epyc_avx512_full.json"  # AVX-512, 2 threads
DECODE_TABLE_AVX2 = "bench_rollout_quick_amd_epyc_avx2_cpu.json"  # AVX2, 2 threads
CORUN = "bench_rollout_pp2_quiet_cpu.json"  # AVX2: 2 x 1-thread engines vs 1 x 2 threads
SPEC_TABLE = "bench_spec_1k_drafter_cpu.json"  # AVX-512, 2 threads, fixed arms
DEMO_ALPHA = "bench_spec_T1_demo_drafter_cpu.json"  # the demo drafter's alpha at T = 1
NOISY_STEP_OVER_FLOOR = 2.0  # a table row whose median step is > 2x its floor is noise
PROMPT_TOKENS = 66.0  # a chain_sum prompt with the chat template and the recipe's
# instruction: the mean over 16 prompts counted with the SmolLM2 tokenizer (the JSONs
# do not record prompt lengths)
PREFILL_PER_ROW = 0.5  # modelled: a prompt token costs half a decode row of the largest
# measured batch (no LM head, larger GEMMs); no JSON times the prefill alone


def _steps_ms(doc: dict) -> dict[int, float]:
    return {int(r["batch"]): float(r["engine_step_ms"]) for r in doc["results"]
            if r.get("step_over_floor", 1.0) <= NOISY_STEP_OVER_FLOOR}


def corun_factors() -> tuple[tuple, tuple, str]:
    """Per running batch of ONE engine, (1-thread engine beside another) / (one 2-thread
    engine at that batch), from the PP = 2 gathered run (each rank decodes half the
    prompts with 1 thread) and the AVX2 2-thread table of the same machine."""
    co = load_json(CORUN)
    two = _steps_ms(load_json(DECODE_TABLE_AVX2))
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


def cpu_1t_corun_table(avx: str = "avx512") -> StepCost:
    """Decode steps of one 1-thread replica beside another on the 2-core machine."""
    doc = load_json(DECODE_TABLE if avx == "avx512" else DECODE_TABLE_AVX2)
    two = _steps_ms(doc)
    fb, ff, fsrc = corun_factors()
    bs = sorted(two)
    grid = sorted(set(bs) | set(fb))
    secs = [_interp_log(b, bs, [two[x] for x in bs]) / 1000 * _interp_log(b, fb, ff)
            for b in grid]
    co = load_json(CORUN)["length"]
    # resident-context cost: batch-1 per-token time at 64 and 1024 tokens, 2 threads
    kv = (co["1024"]["pp1_ms_per_token"] - co["64"]["pp1_ms_per_token"]) / 1000 / 960 * ff[0]
    sb, ss = spec_slopes(load_json(SPEC_TABLE))
    big = max(grid)
    prefill = PREFILL_PER_ROW * secs[-1] / big
    dropped = sorted(set(int(r["batch"]) for r in doc["results"]) - set(two))
    return StepCost(tuple(grid), tuple(secs), ref_ctx=96.0, kv_seconds_per_token=kv,
                    spec_batches=sb, spec_slope=ss, prefill_seconds_per_token=prefill,
                    source=(f"{DECODE_TABLE if avx == 'avx512' else DECODE_TABLE_AVX2} "
                            f"({cpu_of(doc)}, 2 threads"
                            + (f"; batch {dropped} dropped as noisy" if dropped else "")
                            + f") x {fsrc} (AVX2); speculative step costs from "
                            f"{SPEC_TABLE}; prefill per token = {PREFILL_PER_ROW} x the "
                            "largest batch's decode cost per row (modelled)"))


def demo_drafter_alpha() -> Acceptance:
    doc = load_json(DEMO_ALPHA)
    return Acceptance.constant(doc["alpha"]["alpha"],
                               source=f"{DEMO_ALPHA}: the demo drafter's alpha at T=1")


def summary_lengths(n: int, total: float, longest: float, at_cap: int, replicas: int
                    ) -> list[np.ndarray]:
    """Per-replica response lengths consistent with a step's recorded summary (count,
    total, longest, number truncated): ``at_cap`` responses at the longest (at least
    one), the rest log-normal quantiles (sigma 1) scaled to the remaining total and
    kept below the longest; dealt longest first in snake order over the replicas.
    Only the summary is recorded, so which replica holds what is modelled."""
    k = max(1, at_cap)
    rest_n = n - k
    rest_total = max(total - k * longest, rest_n)
    if rest_n > 0:
        q = (np.arange(rest_n) + 0.5) / rest_n
        from statistics import NormalDist

        z = np.array([NormalDist().inv_cdf(float(x)) for x in q])
        shape = np.exp(z)
        rest = np.minimum(shape / shape.sum() * rest_total, longest - 1)
    else:
        rest = np.zeros(0)
    lens = np.sort(np.concatenate([np.full(k, float(longest)), rest]))[::-1]
    out: list[list[float]] = [[] for _ in range(replicas)]
    for i, x in enumerate(lens):
        rnd, pos = divmod(i, replicas)
        out[pos if rnd % 2 == 0 else replicas - 1 - pos].append(float(max(1.0, round(x))))
    return [np.asarray(o) for o in out]
