"""The statistics of ``tools/bench_e2e.py``'s two arms (``tlt`` and ``off``, whole GRPO
steps interleaved from the same weights): one step's numbers per arm from the trainer's
metrics (``arm_numbers``), the arms' responses paired (``compare_responses``) and their
weights compared (``max_param_delta``), a step's row of ratios (``step_row``) and a
sampling mode's summary over its steps (``summarize``: medians of per-step ratios with
min and max, totals, the Amdahl bound, agreement and acceptance)."""

from __future__ import annotations

import statistics

from .stats import amdahl, mean_ci95, median_min_max

__all__ = ["ARMS", "step_row", "summarize", "max_param_delta", "compare_responses",
           "arm_numbers"]

ARMS = ("tlt", "off")

def step_row(step: int, first: str, arms: dict, agree: dict) -> dict:
    """One step of one mode: both arms' numbers and the ratios between them."""
    off, tlt = arms["off"], arms["tlt"]
    f = off["rollout"] / off["step"]
    s = off["rollout"] / tlt["rollout"]
    return dict(step=step, first=first, arms=arms, rollout_fraction=f, rollout_speedup=s,
                step_speedup=off["step"] / tlt["step"], amdahl_bound=amdahl(f, s),
                accept_len=tlt.get("accept_len"), **agree)


def summarize(rows: list[dict]) -> dict:
    """A mode's summary from its step rows (medians of per-step ratios)."""
    out = {}
    for key in ("rollout_speedup", "step_speedup", "rollout_fraction"):
        m, lo, hi = median_min_max([r[key] for r in rows])
        out[key], out[key + "_min"], out[key + "_max"] = m, lo, hi
    tot = {a: {k: sum(r["arms"][a][k] for r in rows) for k in ("rollout", "step")}
           for a in ARMS}
    out["rollout_speedup_total"] = tot["off"]["rollout"] / tot["tlt"]["rollout"]
    out["step_speedup_total"] = tot["off"]["step"] / tot["tlt"]["step"]
    out["amdahl_bound"] = amdahl(out["rollout_fraction"], out["rollout_speedup"])
    n = sum(r["responses"] for r in rows)
    out["coupled_identical"] = sum(r["identical"] for r in rows) / n if n else None
    out["rewards_identical"] = sum(r["rewards_equal"] for r in rows) / n if n else None
    out["reward_delta"] = mean_ci95([d for r in rows for d in r["reward_deltas"]])
    out["max_param_delta"] = max(r["max_param_delta"] for r in rows)
    out["weights_identical"] = out["max_param_delta"] == 0.0
    # steps whose update moved both arms' weights (all groups with equal rewards: no
    # gradient, and equal weights say nothing)
    out["steps_with_update"] = sum(all(r["arms"][a]["param_moved"] > 0 for a in ARMS)
                                   for r in rows)
    acc = [r["accept_len"] for r in rows if r["accept_len"] is not None]
    on = [r["arms"]["tlt"].get("spec_on_fraction") for r in rows]
    out["acceptance"] = dict(
        accept_len=statistics.mean(acc) if acc else None,
        on_fraction=statistics.mean(x for x in on if x is not None)
        if any(x is not None for x in on) else None,
        per_step=acc)
    for key in ("tail", "idle_replica_seconds", "rollout", "step", "generated_tokens"):
        out[key] = {a: statistics.mean(r["arms"][a][key] for r in rows) for a in ARMS}
    out["reward_mean"] = {a: statistics.mean(r["arms"][a]["reward"] for r in rows)
                          for a in ARMS}
    out["steps"] = rows
    return out


def max_param_delta(model_a, model_b) -> float:
    """max |a - b| over every parameter of two models of the same structure (which
    must not share storage: that would make the comparison vacuous)."""
    import torch

    worst = 0.0
    pa, pb = list(model_a.parameters()), list(model_b.parameters())
    if len(pa) != len(pb):
        raise RuntimeError("the two arms' models differ in structure")
    with torch.no_grad():
        for a, b in zip(pa, pb):
            if a.data_ptr() == b.data_ptr():
                raise RuntimeError("the two arms share a parameter tensor")
            worst = max(worst, float((a - b).abs().max()))
    return worst


def compare_responses(parts_tlt: list, parts_off: list, step: int) -> dict:
    """Pair the arms' samples by (prompt, place in its group) over all replicas."""
    a = {(p, j): (r, w) for part in parts_tlt for p, j, r, w in part}
    b = {(p, j): (r, w) for part in parts_off for p, j, r, w in part}
    if set(a) != set(b):
        raise RuntimeError(f"step {step}: the arms generated for different prompts")
    keys = sorted(a)
    identical = sum(a[k][0] == b[k][0] for k in keys)
    rewards_equal = sum(a[k][1] == b[k][1] for k in keys)
    per_prompt: dict[int, list[float]] = {}
    for k in keys:
        per_prompt.setdefault(k[0], []).append(a[k][1] - b[k][1])
    deltas = [sum(v) / len(v) for _, v in sorted(per_prompt.items())]
    first_split = None
    for k in keys:
        ra, rb = a[k][0], b[k][0]
        if ra != rb:
            pos = next((i for i, (x, y) in enumerate(zip(ra, rb)) if x != y),
                       min(len(ra), len(rb)))
            first_split = dict(prompt=k[0], sample=k[1], position=pos)
            break
    return dict(responses=len(keys), identical=identical, rewards_equal=rewards_equal,
                reward_deltas=deltas, first_split=first_split)


def arm_numbers(metrics: dict, step_time: float, seen_parts: list) -> dict:
    t = metrics["timing"]
    finish = metrics["timeline"]["replica_finish"]
    spec = metrics.get("spec")
    return dict(
        rollout=max(finish), step=step_time, tail=t["tail"],
        idle_replica_seconds=metrics["idle_replica_seconds"],
        replica_finish=finish, update=t["update"], old_logprob=t["old_logprob"],
        reward_seconds=t["reward"],
        generated_tokens=sum(len(r) for part in seen_parts for _, _, r, _ in part),
        reward=metrics["reward/mean"], accuracy=metrics["accuracy"],
        response_length_mean=metrics["response_length/mean"],
        response_length_max=metrics["response_length/max"],
        truncated_fraction=metrics["truncated_fraction"],
        groups_zero_std=metrics["groups_zero_std"], grad_norm=metrics["grad_norm"],
        updates_skipped=metrics["updates_skipped"],
        rollout_tokens_per_second=metrics["rollout_tokens_per_second"],
        accept_len=spec["accept_len"] if spec and spec["steps"] else None,
        spec_on_fraction=spec["on_fraction"] if spec else None,
        spec_steps=spec["steps"] if spec else None,
        spec_arms=spec["arms"] if spec else None,
        # tokens by the kind that proposed each row (a model-free kind per row)
        spec_tokens_by_kind={k: spec[k]["proposed_emitted"] for k in spec.get("kinds", [])}
        if spec else None,
        update_work=metrics["timeline"].get("update_work"))
