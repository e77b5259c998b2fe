"""The RL step's ``spec`` metrics: every replica's ``SpecStats.summary()`` merged.

Per drafter kind (``spec/<kind>/...``, kinds "eagle" for the one-layer drafter and
"self" for the policy's int8 copy; ``spec/kinds`` lists them) the steps it was chosen,
speculated and declined, its acceptance overall and per batch-size bucket, its arms,
and the tokens of the rows it proposed for (``proposed_emitted``, their acceptance
``proposed_accept_len`` and share of the speculative steps' tokens ``proposed_share``:
free kinds propose per row whichever kind the step chose); per bucket
(``spec/chosen/<bucket>/<kind|plain>``) the steps each kind speculated and the plain
steps the chosen kind declined, and the most frequent choice
(``spec/bucket_choice/<bucket>``: "kind arm" or "plain", a string: JSONL and the
summary table only).
"""

from __future__ import annotations

from ..rollout.speculative import position_accept

__all__ = ["merge_spec", "merge_kinds"]

# per-kind counts that sum over replicas
_KIND_SUMS = ("chosen", "steps", "declined", "probes", "rows", "emitted", "catchup_tokens",
              "proposed_rows", "proposed_emitted")


def merge_spec(parts: list[dict], decode_steps: int) -> dict:
    """Replicas' speculation summaries -> acceptance length (weighted by rows), the
    fraction of decode steps that speculated, chosen arms, acceptance per batch-size
    bucket (mean of the replicas') and per response-position bucket (pooled counts),
    and the per-kind metrics (``merge_kinds``)."""
    rows = sum(p.get("rows", 0) for p in parts)
    accepted = sum(p.get("accept_len", 0.0) * p.get("rows", 0) for p in parts)
    steps = sum(p.get("steps", 0) for p in parts)
    arms: dict[str, int] = {}
    buckets: dict[str, list[float]] = {}
    for p in parts:
        for k, v in p.get("arms", {}).items():
            arms[k] = arms.get(k, 0) + v
        for k, v in p.get("accept_len_by_bucket", {}).items():
            buckets.setdefault(k, []).append(v)
    out = {"accept_len": accepted / rows if rows else 0.0,
           "on_fraction": steps / decode_steps if decode_steps else 0.0,
           "steps": steps, "arms": arms,
           "declined": sum(p.get("declined", 0) for p in parts),
           "accept_len_by_bucket": {k: sum(v) / len(v) for k, v in buckets.items()},
           "accept_len_by_position": position_accept.merge(parts),
           # the self-drafter's re-quantizations (each replica's, the slowest's time)
           "drafter_refreshes": max((p.get("drafter_refreshes", 0) for p in parts),
                                    default=0),
           "drafter_refresh_seconds": max((p.get("drafter_refresh_seconds", 0.0)
                                           for p in parts), default=0.0)}
    out.update(merge_kinds(parts, decode_steps))
    return out


def merge_kinds(parts: list[dict], decode_steps: int) -> dict:
    """The replicas' per-kind summaries (``SpecStats.summary()["kinds"]`` and
    ``["bucket_choice"]``) pooled: ``kinds`` (names, sorted), per kind a dict (counts
    summed; ``accept_len`` and ``drafted_per_row`` over the pooled rows; ``on_fraction``
    of all decode steps; ``accept_len_by_bucket`` and ``steps_by_bucket`` pooled;
    ``arms`` summed), ``chosen`` (bucket -> kind or "plain" -> steps) and
    ``bucket_choice`` (bucket -> the most frequent "kind arm" or "plain" over the
    replicas' steps). Empty where no replica reported kinds."""
    kinds: dict[str, dict] = {}
    chosen: dict[str, dict[str, int]] = {}
    pairs: dict[str, dict[str, int]] = {}
    for p in parts:
        for name, k in (p.get("kinds") or {}).items():
            m = kinds.setdefault(name, {"arms": {}, "_buckets": {}, "drafted": 0.0,
                                        **{f: 0 for f in _KIND_SUMS}})
            for f in _KIND_SUMS:
                m[f] += k.get(f, 0)
            m["drafted"] += k.get("drafted_per_row", 0.0) * k.get("rows", 0)
            for arm, n in k.get("arms", {}).items():
                m["arms"][arm] = m["arms"].get(arm, 0) + n
            for label, b in k.get("buckets", {}).items():
                t = m["_buckets"].setdefault(label, [0, 0, 0])
                t[0] += b.get("rows", 0)
                t[1] += b.get("emitted", 0)
                t[2] += b.get("steps", 0)
                c = chosen.setdefault(label, {})
                c[name] = c.get(name, 0) + b.get("steps", 0)
                c["plain"] = c.get("plain", 0) + b.get("declined", 0)
                pc = pairs.setdefault(label, {})
                for arm, n in b.get("arms", {}).items():
                    key = "plain" if arm == "0_0_0" else f"{name} {arm}"
                    pc[key] = pc.get(key, 0) + n
    if not kinds:
        return {}
    out: dict = {"kinds": sorted(kinds)}
    proposed = sum(m["proposed_emitted"] for m in kinds.values())
    for name, m in kinds.items():
        tb = m.pop("_buckets")
        drafted = m.pop("drafted")
        m["accept_len"] = m["emitted"] / m["rows"] if m["rows"] else 0.0
        # tokens by the kind that proposed each row (free kinds propose per row)
        m["proposed_accept_len"] = (m["proposed_emitted"] / m["proposed_rows"]
                                    if m["proposed_rows"] else 0.0)
        m["proposed_share"] = m["proposed_emitted"] / proposed if proposed else 0.0
        m["drafted_per_row"] = drafted / m["rows"] if m["rows"] else 0.0
        m["on_fraction"] = m["steps"] / decode_steps if decode_steps else 0.0
        m["accept_len_by_bucket"] = {k: e / r for k, (r, e, _) in tb.items() if r}
        m["steps_by_bucket"] = {k: s for k, (_, _, s) in tb.items()}
        out[name] = m
    out["chosen"] = chosen
    out["bucket_choice"] = {label: max(pc, key=lambda x: (pc[x], x))
                            for label, pc in pairs.items() if pc}
    return out
