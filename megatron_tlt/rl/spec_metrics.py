"""The RL step's ``spec`` metrics: every replica's ``SpecStats.summary()`` merged."""

from __future__ import annotations

from ..rollout import position_accept

__all__ = ["merge_spec"]


def merge_spec(parts: list[dict], decode_steps: int) -> dict:
    """Replicas' speculation summaries -> acceptance length (weighted by rows), the
    fraction of decode steps that speculated, chosen arms, acceptance per batch-size
    bucket (mean of the replicas') and per response-position bucket (pooled counts)."""
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
    return {"accept_len": accepted / rows if rows else 0.0,
            "on_fraction": steps / decode_steps if decode_steps else 0.0,
            "steps": steps, "arms": arms,
            "accept_len_by_bucket": {k: sum(v) / len(v) for k, v in buckets.items()},
            "accept_len_by_position": position_accept.merge(parts),
            # the self-drafter's re-quantizations (each replica's, the slowest's time)
            "drafter_refreshes": max((p.get("drafter_refreshes", 0) for p in parts),
                                     default=0),
            "drafter_refresh_seconds": max((p.get("drafter_refresh_seconds", 0.0)
                                            for p in parts), default=0.0)}
