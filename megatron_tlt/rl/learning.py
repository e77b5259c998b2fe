"""Two runs' learning compared: held-out accuracy and reward curves, the rollout's time
per step, and the final held-out difference with a paired test (``tools/learn.py``).

A run folder holds ``metrics.jsonl`` (a line per step, the evaluations' ``eval/*``
figures) and ``eval_prompts.jsonl`` (every held-out prompt's reward and correctness at
each evaluation, in the prompts' order). Both arms answer the same held-out prompts
greedily, so the final difference is paired: per prompt, correct in one arm and not
the other. The interval is the normal one over the per-prompt differences, and the
p-value is McNemar's exact test (a binomial test on the discordant prompts).

The arms' own rollout seconds cannot compare speed: independent policies drift to
different response lengths, and the arms run at different times. ``speed`` reads the
fair comparison instead: one final policy, both arms' rollouts interleaved step by step
with coupled sampling (the same responses token for token, so only the speed differs;
``tools/bench_e2e.py``), beside an A/A run of the same shape (the noise of the ratio).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
import statistics
from statistics import mean
from typing import Sequence

from ..bench.stats import median_min_max
from .evaluation import Z95, wilson_interval

__all__ = ["read_run", "paired_difference", "compare", "speed", "write_figure"]


def _lines(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        line = line.strip()
        if line:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a line cut by a kill: the rest stands
                continue
    return out


def read_run(run_dir: str | Path) -> dict:
    """One run's curves: ``steps`` (step, train reward, rollout / tail / step seconds)
    and ``evals`` (step, accuracy with its Wilson interval, reward, per-prompt
    correctness). A step recorded twice (a resumed run redoes it) keeps the last."""
    run_dir = Path(run_dir)
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for rec in _lines(run_dir / "metrics.jsonl"):
        s = int(rec.get("step", -1))
        if "eval/accuracy" in rec:
            evals.setdefault(s, {}).update(
                step=s, accuracy=rec["eval/accuracy"], lo=rec.get("eval/accuracy_lo"),
                hi=rec.get("eval/accuracy_hi"), reward=rec.get("eval/reward"))
        timing = rec.get("timing")
        if isinstance(timing, dict) and "rollout" in timing:
            steps[s] = {"step": s, "reward": rec.get("reward/mean"),
                        "rollout_s": timing.get("rollout"), "tail_s": timing.get("tail"),
                        "step_s": timing.get("step"), "load_1m": rec.get("load_1m"),
                        "tokens_per_s": rec.get("rollout_tokens_per_second"),
                        "response_len": rec.get("response_length/mean")}
    for rec in _lines(run_dir / "eval_prompts.jsonl"):
        s = int(rec["step"])
        evals.setdefault(s, {"step": s}).update(correct=rec["correct"],
                                                 rewards=rec["reward"])
    for e in evals.values():  # an interval missing from the metrics: from the prompts
        if e.get("lo") is None and e.get("correct"):
            c = e["correct"]
            e["accuracy"] = sum(c) / len(c)
            e["lo"], e["hi"] = wilson_interval(sum(c), len(c))
    return {"run_dir": str(run_dir), "steps": [steps[k] for k in sorted(steps)],
            "evals": [evals[k] for k in sorted(evals)]}


def paired_difference(a: Sequence[float], b: Sequence[float]) -> dict:
    """Accuracy of ``a`` minus ``b`` over the same prompts (0/1 each): the difference,
    its normal 95 % interval from the per-prompt differences, and McNemar's exact
    two-sided p-value."""
    if len(a) != len(b) or not a:
        raise ValueError(f"paired prompts differ in number: {len(a)} and {len(b)}")
    d = [float(x) - float(y) for x, y in zip(a, b)]
    n = len(d)
    m = sum(d) / n
    var = sum((x - m) ** 2 for x in d) / max(n - 1, 1)
    half = Z95 * math.sqrt(var / n)
    only_a = sum(1 for x in d if x > 0)
    only_b = sum(1 for x in d if x < 0)
    from scipy.stats import binomtest

    p = binomtest(only_a, only_a + only_b, 0.5).pvalue if only_a + only_b else 1.0
    return {"difference": m, "lo": m - half, "hi": m + half, "prompts": n,
            "only_first_correct": only_a, "only_second_correct": only_b,
            "mcnemar_p": float(p), "significant": bool(p < 0.05)}


def _rises(run: dict) -> dict:
    """Did held-out accuracy rise beyond the step-0 95 % interval (the best and the
    final evaluation)?"""
    ev = run["evals"]
    if not ev or ev[0]["step"] != 0:
        return {}
    lo0, hi0 = ev[0]["lo"], ev[0]["hi"]
    best = max(ev, key=lambda e: e["accuracy"])
    return {"step0": ev[0]["accuracy"], "step0_lo": lo0, "step0_hi": hi0,
            "final": ev[-1]["accuracy"], "final_step": ev[-1]["step"],
            "best": best["accuracy"], "best_step": best["step"],
            "final_beyond_step0_interval": ev[-1]["accuracy"] > hi0,
            "final_below_step0_interval": ev[-1]["accuracy"] < lo0,
            "best_beyond_step0_interval": best["accuracy"] > hi0}


def compare(runs: dict[str, dict], *, baseline: str = "off") -> dict:
    """The arms side by side: each arm's curves and rise, each other arm's rollout time
    per step against ``baseline``'s and its final held-out difference (paired)."""
    out = {"arms": {}, "against_" + baseline: {}}
    for arm, run in runs.items():
        roll = [s["rollout_s"] for s in run["steps"] if s.get("rollout_s") is not None]
        loads = [s["load_1m"] for s in run["steps"] if s.get("load_1m") is not None]
        lens = [s["response_len"] for s in run["steps"] if s.get("response_len") is not None]
        out["arms"][arm] = {**run, "rise": _rises(run),
                            "rollout_s_mean": mean(roll) if roll else None,
                            "load_1m_mean": mean(loads) if loads else None,
                            "response_len_mean": mean(lens) if lens else None,
                            "steps_done": len(run["steps"])}
    base = runs.get(baseline)
    for arm, run in runs.items():
        if arm == baseline or base is None:
            continue
        entry = {}
        rb, ra = out["arms"][baseline]["rollout_s_mean"], out["arms"][arm]["rollout_s_mean"]
        if rb and ra:
            entry["rollout_time_ratio"] = ra / rb  # < 1: this arm's rollouts are shorter
        common = sorted({e["step"] for e in run["evals"] if e.get("correct")}
                        & {e["step"] for e in base["evals"] if e.get("correct")})
        if common:
            last = common[-1]
            a = next(e for e in run["evals"] if e["step"] == last)["correct"]
            b = next(e for e in base["evals"] if e["step"] == last)["correct"]
            entry["final_step"] = last
            entry["held_out"] = paired_difference(a, b)
        out["against_" + baseline][arm] = entry
    return out


def _spread(xs: Sequence[float]) -> tuple:
    """(median, [min, max]) of ``xs``; (None, None) when empty."""
    m, lo, hi = median_min_max(xs)
    return m, (None if m is None else [lo, hi])


def speed(pair: dict, aa: dict | None = None, mode: str = "coupled") -> dict:
    """The TLT arm's rollout against the plain one's on the same responses, from
    ``bench_e2e`` results (``pair``: TLT against off; ``aa``: both arms plain): per step
    the rollout seconds of both arms, their ratio, where the time went (the replica that
    finished first and the last one: TLT shortens the tail, the last replica's long
    responses), the speculated tokens; the medians, and the A/A ratios beside them."""
    rows = []
    for r in pair["results"]:
        if r["mode"] != mode:
            continue
        off, tlt = r["arms"]["off"], r["arms"]["tlt"]
        rows.append({
            "step": r["step"], "identical": r["identical"], "responses": r["responses"],
            "off_rollout_s": off["rollout"], "tlt_rollout_s": tlt["rollout"],
            "rollout_speedup": off["rollout"] / tlt["rollout"],
            "off_first_replica_s": min(off["replica_finish"]),
            "tlt_first_replica_s": min(tlt["replica_finish"]),
            "off_tail_s": off["tail"], "tlt_tail_s": tlt["tail"],
            "response_len_mean": off["response_length_mean"],
            "response_len_max": off["response_length_max"],
            "spec_on_fraction": tlt.get("spec_on_fraction"),
            "accept_len": tlt.get("accept_len"),
            "spec_tokens_by_kind": tlt.get("spec_tokens_by_kind"),
            "generated_tokens": off["generated_tokens"]})
    med, spread = _spread([r["rollout_speedup"] for r in rows])
    out = {"mode": mode, "steps": rows,
           "identical_fraction": (sum(r["identical"] for r in rows)
                                  / max(1, sum(r["responses"] for r in rows))),
           "rollout_speedup_median": med, "rollout_speedup_range": spread,
           "rollout_speedup_total": (sum(r["off_rollout_s"] for r in rows)
                                     / max(1e-9, sum(r["tlt_rollout_s"] for r in rows))),
           "off_rollout_s_mean": mean(r["off_rollout_s"] for r in rows) if rows else None,
           "tlt_rollout_s_mean": mean(r["tlt_rollout_s"] for r in rows) if rows else None,
           "off_tail_s_mean": mean(r["off_tail_s"] for r in rows) if rows else None,
           "tlt_tail_s_mean": mean(r["tlt_tail_s"] for r in rows) if rows else None}
    if aa is not None:
        aa_rows = {r["step"]: r for r in aa["results"] if r["mode"] == mode}
        ratios = [r["arms"]["off"]["rollout"] / r["arms"]["tlt"]["rollout"]
                  for r in aa_rows.values()]
        out["aa_rollout_ratio_median"], out["aa_rollout_ratio_range"] = _spread(ratios)
        # coupled sampling: every arm of both runs rolls out the same responses at a
        # step, so TLT's time also compares with all three plain rollouts of them
        # (the pair's off arm and both A/A arms), not with its own pair's alone
        for row in rows:
            other = aa_rows.get(row["step"])
            if other is None:
                continue
            plain = [row["off_rollout_s"], other["arms"]["off"]["rollout"],
                     other["arms"]["tlt"]["rollout"]]
            row["plain_rollouts_s"] = plain
            row["speedup_vs_plain_median"] = statistics.median(plain) / row["tlt_rollout_s"]
        out["speedup_vs_plain_median"], out["speedup_vs_plain_range"] = _spread(
            [r["speedup_vs_plain_median"] for r in rows if "speedup_vs_plain_median" in r])
    return out


def write_figure(result: dict, path: str | Path) -> Path:
    """Held-out accuracy (with intervals), training reward and rollout seconds per
    step, every arm on the same axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for arm, run in result["arms"].items():
        ev = run["evals"]
        xs = [e["step"] for e in ev]
        line, = axes[0].plot(xs, [e["accuracy"] for e in ev], marker="o", label=arm)
        axes[0].fill_between(xs, [e["lo"] for e in ev], [e["hi"] for e in ev],
                             color=line.get_color(), alpha=0.15)
        st = run["steps"]
        axes[1].plot([s["step"] for s in st], _smooth([s["reward"] or 0.0 for s in st]),
                     label=arm, color=line.get_color())
        axes[2].plot([s["step"] for s in st], [s["rollout_s"] for s in st], label=arm,
                     color=line.get_color())
    axes[0].set_title("held-out accuracy (greedy, 95 % Wilson)")
    axes[1].set_title("training reward (mean of 5 steps)")
    axes[2].set_title("rollout seconds per step")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(xs: Sequence[float], k: int = 5) -> list[float]:
    return [mean(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]
