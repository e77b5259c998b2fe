"""Acceptance by response position: how many tokens a speculative step emitted per
sequence, grouped by where in its response the sequence stood when the step began.

A drafter trained on early-finishing (short) responses may accept well near a
response's start and poorly deep into the long tail, which is where speculation pays;
the tail buckets show whether online training keeps up there.

The engine records ``[rows, emitted]`` per bucket (``record``) into
``SpecStats.by_position``; ``SpecStats.summary()`` reports them as
``accept_by_position`` (raw counts, so replicas merge exactly) and the RL step logs the
merged means as ``spec/accept_len_by_position/<bucket>`` (``merge``).
"""

from __future__ import annotations

from typing import Sequence

# response-token positions where a bucket starts: 0-127, 128-511, 512+
POSITION_EDGES = (0, 128, 512)

__all__ = ["POSITION_EDGES", "label_of", "record", "merge", "labels"]


def labels(edges: Sequence[int] = POSITION_EDGES) -> list[str]:
    out = [f"{lo}-{hi - 1}" for lo, hi in zip(edges, edges[1:])]
    return out + [f"{edges[-1]}+"]


_LABELS = labels()


def label_of(position: int, edges: Sequence[int] = POSITION_EDGES) -> str:
    """The bucket of a step that starts at response token ``position`` (0-based)."""
    k = sum(position >= e for e in edges[1:])
    return (_LABELS if tuple(edges) == POSITION_EDGES else labels(edges))[k]


def record(table: dict[str, list[int]], positions: Sequence[int],
           emitted: Sequence[int]) -> None:
    """Add one speculative step: row i began at response token ``positions[i]`` and
    emitted ``emitted[i]`` tokens."""
    for pos, m in zip(positions, emitted):
        row = table.setdefault(label_of(pos), [0, 0])
        row[0] += 1
        row[1] += int(m)


def merge(parts: Sequence[dict]) -> dict[str, float]:
    """Replicas' ``accept_by_position`` counts -> mean tokens per sequence per
    speculative step for each bucket, in position order (buckets no row reached are
    left out)."""
    tot: dict[str, list[int]] = {}
    for p in parts:
        for k, (rows, emitted) in (p.get("accept_by_position") or {}).items():
            t = tot.setdefault(k, [0, 0])
            t[0] += rows
            t[1] += emitted
    order = sorted(tot, key=lambda k: int(k.split("-")[0].rstrip("+")))
    return {k: tot[k][1] / tot[k][0] for k in order if tot[k][0]}
