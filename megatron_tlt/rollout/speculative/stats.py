"""What speculation did in one ``generate`` call (``GenerateStats.spec``): counts,
acceptance, times, chosen arms and, per batch-size bucket, the steps the tuner decided."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Sequence

from ...spec_strategy import Strategy


@dataclass
class Tally:
    """Sequence-steps and the tokens they emitted."""

    rows: int = 0
    emitted: int = 0

    def add(self, rows: int, emitted: int) -> None:
        self.rows += rows
        self.emitted += emitted

    @property
    def mean(self) -> float:
        return self.emitted / self.rows if self.rows else 0.0


@dataclass
class BucketSteps:
    """One bucket's decode steps where the tuner was asked (at or below the threshold)."""

    steps: int = 0
    declined: int = 0  # ran plain
    probes: int = 0
    spec_steps: int = 0
    spec_tokens_per_row: float = 0.0  # summed over speculative steps
    spec_seconds: float = 0.0
    plain_steps: int = 0
    plain_seconds: float = 0.0

    def summary(self) -> dict:
        spec_rate = (self.spec_tokens_per_row / self.spec_seconds
                     if self.spec_seconds > 0 else None)
        plain_rate = self.plain_steps / self.plain_seconds if self.plain_seconds > 0 else None
        return {"steps": self.steps, "declined": self.declined, "probes": self.probes,
                "spec_steps": self.spec_steps, "spec_tok_s": spec_rate,
                "plain_tok_s": plain_rate,
                "speedup": spec_rate / plain_rate if spec_rate and plain_rate else None}


@dataclass
class SpecStats:
    """Speculation in one ``generate`` call (``GenerateStats.spec``)."""

    steps: int = 0  # speculative steps (each drafts and verifies the whole batch)
    rows: int = 0  # sequence-steps (sum of batch sizes over speculative steps)
    emitted: int = 0  # tokens emitted by speculative steps (accepted drafts + bonus)
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    catchup_tokens: int = 0  # drafter positions recomputed from target features
    catchup_seconds: float = 0.0  # of them, fed apart before a step (SpeculativeDecoder.catch_up)
    drafted: int = 0  # draft tokens sent to verification
    accept_hist: dict[int, int] = field(default_factory=dict)  # accepted drafts -> rows
    by_bucket: dict[str, Tally] = field(default_factory=dict)  # bucket label -> tally
    by_depth: dict[int, Tally] = field(default_factory=dict)  # strategy depth -> tally
    # response-position bucket -> [rows, emitted] (rollout/position_accept.py)
    by_position: dict[str, list[int]] = field(default_factory=dict)
    arms: dict[str, int] = field(default_factory=dict)  # strategy name -> steps chosen
    # (including "0_0_0": plain steps the tuner chose below the threshold)
    declined: int = 0  # steps below the threshold that ran plain (break-even gate or 0_0_0)
    probes: int = 0  # steps taken against the gate's decision to re-measure the other side
    tuned: dict[str, BucketSteps] = field(default_factory=dict)  # bucket label -> its steps
    gate: dict = field(default_factory=dict)  # StrategyTuner.gate_stats() after the call
    # the self-drafter's re-quantizations at the start of the call (its weights changed)
    drafter_refreshes: int = 0
    drafter_refresh_seconds: float = 0.0

    def merged(self, other: "SpecStats") -> "SpecStats":
        """Both calls' counts summed (the pipeline ranks' shares of one call in
        ``rollout.pipeline_mode=gathered``); ``gate`` is this one's."""
        out = SpecStats(gate=dict(self.gate))
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "gate":
                continue
            if isinstance(a, (int, float)):
                setattr(out, f.name, a + b)
                continue
            merged = {}
            for k in list(a) + [k for k in b if k not in a]:
                merged[k] = _add(a.get(k), b.get(k))
            setattr(out, f.name, merged)
        return out

    @property
    def accept_len(self) -> float:
        """Mean tokens emitted per sequence per speculative step (accepted + 1)."""
        return self.emitted / self.rows if self.rows else 0.0

    def record(self, strategy: Strategy, bucket: str, accepted: Sequence[int],
               emitted: Sequence[int]) -> None:
        """One speculative step: per row, its accepted drafts and emitted tokens."""
        self.steps += 1
        self.rows += len(emitted)
        self.emitted += sum(emitted)
        self.arms[strategy.name] = self.arms.get(strategy.name, 0) + 1
        for a in accepted:
            self.accept_hist[a] = self.accept_hist.get(a, 0) + 1
        self.by_bucket.setdefault(bucket, Tally()).add(len(emitted), sum(emitted))
        self.by_depth.setdefault(strategy.depth, Tally()).add(len(emitted), sum(emitted))

    def record_tuned(self, bucket: str, *, declined: bool, probe: bool, rows: int,
                     tokens: int, seconds: float) -> None:
        """One decode step at or below the threshold (the tuner chose it): plain when
        ``declined``, else speculative; ``tokens`` emitted by the batch of ``rows``."""
        t = self.tuned.setdefault(bucket, BucketSteps())
        t.steps += 1
        t.declined += int(declined)
        t.probes += int(probe)
        if declined:
            t.plain_steps += 1
            t.plain_seconds += seconds
        else:
            t.spec_steps += 1
            t.spec_tokens_per_row += tokens / rows
            t.spec_seconds += seconds
        self.declined += int(declined)
        self.probes += int(probe)

    def summary(self) -> dict:
        """JSON-able: mean acceptance length overall, per bucket and per depth, the
        rate at which the j-th draft token was accepted, times and chosen arms; how
        often speculation was declined; per bucket (``buckets``) this call's tokens/s
        per sequence of speculative and of plain steps and, under ``tuner``, the
        break-even gate's estimates (best arm, its rate and speedup, plain's rate)."""
        tuned_steps = sum(t.steps for t in self.tuned.values())
        buckets = {}
        for label, t in self.tuned.items():
            buckets[label] = t.summary()
            if label in self.gate:
                buckets[label]["tuner"] = self.gate[label]
        n = self.rows
        reach = {}
        if n:
            top = max(self.accept_hist) if self.accept_hist else 0
            for j in range(1, top + 1):
                reach[j] = sum(c for a, c in self.accept_hist.items() if a >= j) / n
        return {
            "steps": self.steps, "rows": n, "emitted": self.emitted,
            "accept_len": self.accept_len,
            "accept_len_by_bucket": {k: v.mean for k, v in self.by_bucket.items()},
            "accept_len_by_depth": {str(k): v.mean for k, v in self.by_depth.items()},
            "accept_by_position": {k: list(v) for k, v in self.by_position.items()},
            "accept_rate_at_position": {str(k): v for k, v in reach.items()},
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "catchup_tokens": self.catchup_tokens, "catchup_seconds": self.catchup_seconds,
            "arms": dict(self.arms),
            "drafted_per_row": self.drafted / n if n else 0.0,
            "declined": self.declined,
            "declined_fraction": self.declined / tuned_steps if tuned_steps else 0.0,
            "probes": self.probes, "buckets": buckets,
            "drafter_refreshes": self.drafter_refreshes,
            "drafter_refresh_seconds": self.drafter_refresh_seconds,
        }


def _add(a, b):
    """Sum of two counters of one kind (a number, a list of numbers, a Tally, a
    BucketSteps), either of them possibly None."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, list):
        return [x + y for x, y in zip(a, b)]
    if isinstance(a, (Tally, BucketSteps)):
        return type(a)(**{f.name: getattr(a, f.name) + getattr(b, f.name)
                          for f in fields(a)})
    return a + b
