"""An RL step's metrics: the update's loss sums reduced over DP, and the step's record.

Only scalars and short lists cross replicas (``collectives``' value and object helpers,
on the group's device): reward and length sums, every response's length (for the
percentiles), the speculative-decoding summaries, the paged KV cache's counts and the
update's loss sums. The loss metrics live on the last pipeline stage and are broadcast
to the others.
"""

from __future__ import annotations

import math
from typing import Sequence

from .. import collectives
from .spec_metrics import merge_spec


def reduce_update(sums: dict, maxes: dict, dp_group) -> tuple[dict, dict]:
    """The update's per-replica metric sums and maxima over DP. A replica may have run
    no micro-batch (every sample's advantage was zero): the replicas agree on the metric
    names first, so every rank reduces the same vector."""
    names = collectives.all_gather_object((sorted(sums), sorted(maxes)), group=dp_group)
    keys = sorted({k for ks, _ in names for k in ks})
    mk = sorted({k for _, ms in names for k in ms})
    totals = dict(zip(keys, collectives.sum_values([sums.get(k, 0.0) for k in keys],
                                                   group=dp_group)))
    if mk:
        maxes = dict(zip(mk, collectives.max_values([maxes.get(k, -math.inf) for k in mk],
                                                    group=dp_group)))
    return totals, maxes


# the engine's summary keys (``GenerateStats.summary``) a step adds over its rollout
# rounds (dynamic sampling): counts summed, the paged cache's peaks the largest
_ROUND_SUMS = ("prefill_tokens", "prefill_seconds", "prefill_shared_rows", "preemptions")
_ROUND_MAXES = ("rows_peak", "kv_blocks", "kv_blocks_peak", "kv_bytes_peak")


def add_round(stats: dict, extra: dict) -> None:
    """Fold a further rollout round's engine summary ``extra`` into the step's ``stats``
    (in place): prefill counts and preemptions summed, the paged cache's peaks maxed."""
    for k in _ROUND_SUMS:
        stats[k] = stats.get(k, 0) + extra.get(k, 0)
    for k in _ROUND_MAXES:
        if k in extra:
            stats[k] = max(stats.get(k, 0), extra[k])


def _paged(st: dict):
    """This replica's paged-cache figures (preemptions, rows in flight at the peak, KV
    bytes per GPU at the peak), or None with fixed slots (``rollout.kv_cache=slots``)."""
    if not st.get("kv_blocks"):
        return None
    return st.get("preemptions", 0), st.get("rows_peak", 0), st.get("kv_bytes_peak", 0)


def step_metrics(samples, roll, finish_times, timing, update, zero_std, rounds, replaced,
                 *, dp_group, lr: float, tis: bool, pp_group=None, pp_size: int = 1) -> dict:
    """The step's metrics (every rank computes the same): ``roll`` is this replica's
    rollout, ``finish_times`` every replica's, ``update`` this rank's ``_update``
    result (the loss sums, complete on the last pipeline stage, brought to the others
    over ``pp_group``); ``lr``: the learning rate reported when no optimizer step ran;
    ``tis``: truncated importance sampling is on (its mean weight is reported)."""
    dp = dp_group
    n = len(samples)
    lengths = [len(s.response_ids) for s in samples]
    rewards = [s.reward for s in samples]
    st = roll.stats or {}
    local = [n, sum(rewards), sum(r * r for r in rewards), sum(s.correct for s in samples),
             sum(lengths), sum(s.truncated for s in samples), zero_std,
             roll.generated_tokens, replaced, st.get("prefill_tokens", 0),
             st.get("prefill_seconds", 0.0), st.get("prefill_shared_rows", 0)]
    (N, rsum, rsq, correct, lsum, trunc, zstd, gen_tokens, repl, pre_tokens, pre_seconds,
     pre_shared) = collectives.sum_values(local, group=dp)
    all_lengths = sorted(x for part in collectives.all_gather_object(lengths, group=dp)
                         for x in part)
    # each replica's speculation summary and when its generate call started
    gathered = collectives.all_gather_object(
        (roll.stats.get("spec") if roll.stats else None, roll.started_at), group=dp)
    spec = [s for s, _ in gathered]
    # each replica's decode steps, update work (padded tokens, micro-batches) and paged
    # KV cache figures
    per_replica = collectives.all_gather_object(
        (st.get("decode_steps", 0), update.get("work"), _paged(st)), group=dp)
    decode = [d for d, _, _ in per_replica]
    paged = [p for _, _, p in per_replica if p is not None]
    # loss metrics live on the last pipeline stage: bring them to rank 0's stage
    upd = update
    if pp_size > 1:
        upd = collectives.broadcast_object(update, src=pp_size - 1, group=pp_group)
    s, mx = upd["sums"], upd["maxes"]
    tok = max(s.get("tokens", 0.0), 1.0)
    mean_r = rsum / max(N, 1)
    first, last = min(finish_times), max(finish_times)
    out = {
        "reward/mean": mean_r,
        "reward/std": math.sqrt(max(rsq / max(N, 1) - mean_r ** 2, 0.0)),
        "accuracy": correct / max(N, 1),
        "groups_zero_std": zstd,
        "dynamic_sampling/rounds": rounds, "dynamic_sampling/replaced": repl,
        "response_length/mean": lsum / max(N, 1),
        "response_length/p50": _percentile(all_lengths, 50),
        "response_length/p99": _percentile(all_lengths, 99),
        "response_length/max": all_lengths[-1] if all_lengths else 0,
        "truncated_fraction": trunc / max(N, 1),
        "loss/total": s.get("loss", 0.0) / max(upd["updates"], 1),
        "loss/policy": s.get("pg_loss_sum", 0.0) / tok,
        "loss/kl": s.get("kl_sum", 0.0) / tok,
        "loss/entropy": s.get("entropy_sum", 0.0) / tok,
        "clip_fraction/low": s.get("clip_low_count", 0.0) / tok,
        "clip_fraction/high": s.get("clip_high_count", 0.0) / tok,
        "clip_fraction/dual": s.get("dual_clip_count", 0.0) / tok,
        "ratio/mean": s.get("ratio_sum", 0.0) / tok,
        "ratio/max": mx.get("ratio_max", float("nan")),
        "mismatch/logprob_abs_diff": s.get("rollout_logp_abs_diff_sum", 0.0) / tok,
        "mismatch/prob_ratio_err": s.get("mismatch_ratio_err_sum", 0.0) / tok,
        "grad_norm": (sum(upd["grad_norm"]) / len(upd["grad_norm"])
                      if upd["grad_norm"] else float("nan")),
        "lr": upd["lr"][-1] if upd["lr"] else lr,
        "updates_skipped": upd["skipped"],
        "loss_scale": upd["loss_scale"],
        "timing": dict(timing, tail=last - first),
        "idle_replica_seconds": sum(last - f for f in finish_times),
        "rollout_tokens_per_second": gen_tokens / max(last, 1e-9),
        # the rollout's prefill over the replicas (rollout.share_prefill: each distinct
        # prompt once per replica; the other requests copy it)
        "rollout/prefill_tokens": pre_tokens,
        "rollout/prefill_seconds": pre_seconds,
        "rollout/prefill_shared_rows": pre_shared,
        "timeline": {"replica_finish": finish_times, "update_end": timing["step"]},
    }
    if paged:  # rollout.kv_cache=paged: preemptions over the replicas; a replica's
        # most rows in flight and a GPU's most KV bytes, the largest replica's
        out["rollout/preemptions"] = sum(p[0] for p in paged)
        out["rollout/rows_peak"] = max(p[1] for p in paged)
        out["rollout/kv_bytes_peak"] = max(p[2] for p in paged)
    if all(w is not None for _, w, _ in per_replica):  # wall-clock: under the timeline
        out["timeline"]["update_work"] = {k: [w[k] for _, w, _ in per_replica]
                                          for k in per_replica[0][1]}
    if st.get("graphs"):  # rollout.cuda_graphs=auto's choice per key (this replica's)
        out["graphs"] = st["graphs"]
    if tis:
        out["tis/weight_mean"] = s.get("tis_weight_sum", 0.0) / tok
    if any(x is not None for x in spec):
        out["spec"] = merge_spec([x for x in spec if x is not None], sum(decode))
        kinds = replica_kinds(gathered)
        if kinds is not None:
            out["timeline"]["replica_kinds"] = kinds
        tokens = replica_kinds(gathered, "kind_tokens")
        if tokens is not None:
            out["timeline"]["replica_kind_tokens"] = tokens
    return out


def replica_kinds(gathered, key: str = "segments") -> list | None:
    """Per replica, its rollout's kind timeline (``SpecStats.segments``: [start, end,
    kind or "plain"]; ``key="kind_tokens"``: [start, end, {kind: tokens}], the tokens
    by the kind that proposed each row) in seconds since the step started; None when
    no replica has one."""
    out = []
    for spec, started in gathered:
        segs = (spec or {}).get(key) or []
        out.append([[round(started + a, 4), round(started + b, 4), w] for a, b, w in segs])
    return out if any(out) else None


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, math.ceil(q / 100 * len(sorted_values)) - 1))
    return float(sorted_values[k])

