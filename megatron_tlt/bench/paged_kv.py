"""Paged KV cache against fixed slots at an equal KV budget (``tools/bench_paged.py``).

The long-tail workload (``bench.workload.synthetic_workload``: log-normal response
lengths, exactly ``target_len`` tokens each, EOS ignored) in GRPO groups (``group``
responses per prompt, each with its own length). The fixed-slot engine runs
``slot_rows`` rows (``rollout.max_batch_size``) of full length; the paged engine gets
the same bytes (``rollout.kv_cache_gib`` = the slot cache's size) and up to every
request in flight (``rollout.max_batch_size`` = the requests). Runs alternate
slots, paged, slots (the A/A control: the second slot run against the first) per
round; each round gives the ratios and the result is their median. Outputs are
compared (coupled sampling: the same responses whatever the cache)."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

from ..config import RolloutConfig
from ..rollout import RolloutEngine, SamplingParams
from .workload import length_stats, synthetic_workload


def workload(vocab_size: int, *, prompts: int, group: int, prompt_len: tuple[int, int],
             median_len: float, max_len: int, seed: int = 0):
    """(prompt token lists, SamplingParams) of ``prompts`` x ``group`` requests."""
    reqs = synthetic_workload(prompts * group, vocab_size=vocab_size, prompt_len=prompt_len,
                              median_len=median_len, max_len=max_len, seed=seed)
    ids = [reqs[(i // group) * group].token_ids for i in range(len(reqs))]
    params = [SamplingParams(temperature=1.0, max_new_tokens=r.target_len, ignore_eos=True,
                             seed=seed) for r in reqs]
    return ids, params


def run_once(engine: RolloutEngine, prompts, params) -> dict:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = engine.last_stats
    steps = max(len(s.batch_sizes), 1)
    return {"wall_seconds": wall, "decode_steps": s.decode_steps,
            "rows_in_flight_mean": sum(s.batch_sizes) / steps,
            "rows_in_flight_peak": max(s.batch_sizes, default=0),
            "kv_cache_bytes": s.kv_cache_bytes, "kv_bytes_peak": s.kv_bytes_peak,
            "preemptions": s.preemptions, "generated_tokens": s.generated_tokens,
            "prefill_tokens": s.prefill_tokens,
            "tokens": [o.token_ids for o in outs]}


def compare(model, tokenizer, arch, base: RolloutConfig, *, slot_rows: int, prompts,
            params, rounds: int) -> dict:
    """Slots (``slot_rows`` rows) vs paged at the slot cache's bytes, with an A/A control."""
    slots = RolloutEngine(model, tokenizer, replace(base, kv_cache="slots",
                                                    max_batch_size=slot_rows), arch=arch,
                          eos_token_ids=[])
    first = run_once(slots, prompts, params)  # warm-up; sizes the budget
    gib = first["kv_cache_bytes"] / 2**30
    paged = RolloutEngine(model, tokenizer, replace(base, kv_cache="paged",
                                                    max_batch_size=len(prompts),
                                                    kv_cache_gib=gib), arch=arch,
                          eos_token_ids=[])
    run_once(paged, prompts, params)  # warm-up
    runs: dict[str, list] = {"slots": [], "paged": [], "slots_aa": []}
    for _ in range(rounds):
        runs["slots"].append(run_once(slots, prompts, params))
        runs["paged"].append(run_once(paged, prompts, params))
        runs["slots_aa"].append(run_once(slots, prompts, params))
    same = all(r["tokens"] == first["tokens"] for rs in runs.values() for r in rs)
    ratio = [s["wall_seconds"] / p["wall_seconds"] for s, p in zip(runs["slots"], runs["paged"])]
    aa = [s["wall_seconds"] / a["wall_seconds"]
          for s, a in zip(runs["slots"], runs["slots_aa"])]
    rows = [p["rows_in_flight_mean"] / s["rows_in_flight_mean"]
            for s, p in zip(runs["slots"], runs["paged"])]

    def digest(rs):
        keep = {k: v for k, v in rs[0].items() if k != "tokens"}
        keep["wall_seconds"] = [r["wall_seconds"] for r in rs]
        return keep

    return {
        "kv_budget_bytes": first["kv_cache_bytes"], "kv_cache_gib": gib,
        "slot_rows": slot_rows, "requests": len(prompts),
        "response_lengths": length_stats([p.max_new_tokens for p in params]),
        "outputs_identical": same,
        "speedup_wall_median": statistics.median(ratio),
        "aa_ratio_median": statistics.median(aa),
        "rows_in_flight_mean_ratio": statistics.median(rows),
        "rows_in_flight_peak": {"slots": runs["slots"][0]["rows_in_flight_peak"],
                                "paged": runs["paged"][0]["rows_in_flight_peak"]},
        "slots": digest(runs["slots"]), "paged": digest(runs["paged"]),
        "slots_aa": digest(runs["slots_aa"]),
    }


def attend_layouts(kernels, *, groups: int, heads_per_group: int, head_dim: int,
                   block_size: int, cases=((8, 128), (64, 96), (64, 200)), reps: int = 30,
                   seed: int = 0) -> list[dict]:
    """One layer's fused RoPE + KV write + attention (``cpu_kernels.rope_attend``) on a
    paged cache, per (rows, position) case: read in place through a shuffled block table
    ("paged"), gathered into a contiguous copy first and the new keys written back
    ("gathered"), and the same data as contiguous rows ("contiguous"). Best of two
    alternating passes of ``reps`` calls each; the three outputs are checked equal."""
    import torch

    g, hpg, d, bs = groups, heads_per_group, head_dim, block_size
    gen = torch.Generator().manual_seed(seed)
    out = []
    for rows, length in cases:
        width = -(-(length + 1) // bs)
        kp = torch.randn(rows * width + 1, g, bs, d, generator=gen)
        vp = torch.randn(rows * width + 1, g, bs, d, generator=gen)
        table = (torch.randperm(rows * width, generator=gen) + 1).view(rows, width)
        pos = torch.full((rows,), length)
        qkv = torch.randn(rows, g * (hpg + 2) * d, generator=gen)
        ang = torch.randn(rows, d // 2, generator=gen)
        cos = torch.cat([ang.cos(), ang.cos()], -1)
        sin = torch.cat([-ang.sin(), ang.sin()], -1)
        kc = kp[table].transpose(1, 2).reshape(rows, g, width * bs, d).contiguous()
        vc = vp[table].transpose(1, 2).reshape(rows, g, width * bs, d).contiguous()
        at = (table[torch.arange(rows), pos // bs], pos % bs)

        def paged():
            return kernels.rope_attend(qkv, cos, sin, kp, vp, pos, g, hpg, d, 0.125, None,
                                       table)

        def gathered():
            k = kp[table].transpose(1, 2).reshape(rows, g, width * bs, d)
            v = vp[table].transpose(1, 2).reshape(rows, g, width * bs, d)
            o = kernels.rope_attend(qkv, cos, sin, k, v, pos, g, hpg, d, 0.125)
            kp[at[0], :, at[1]] = k[torch.arange(rows), :, pos]
            vp[at[0], :, at[1]] = v[torch.arange(rows), :, pos]
            return o

        def contiguous():
            return kernels.rope_attend(qkv, cos, sin, kc, vc, pos, g, hpg, d, 0.125)

        fns = {"paged": paged, "gathered": gathered, "contiguous": contiguous}
        ref = contiguous()
        assert torch.equal(paged(), ref) and torch.equal(gathered(), ref)
        best = {k: float("inf") for k in fns}
        for _ in range(2):
            for name, f in fns.items():
                f()
                t0 = time.perf_counter()
                for _ in range(reps):
                    f()
                best[name] = min(best[name], (time.perf_counter() - t0) / reps * 1e3)
        out.append({"rows": rows, "position": length,
                    **{f"{k}_ms": round(v, 4) for k, v in best.items()},
                    "gathered_over_paged": round(best["gathered"] / best["paged"], 2),
                    "paged_over_contiguous": round(best["paged"] / best["contiguous"], 3)})
    return out
