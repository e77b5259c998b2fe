"""What speculation did in one ``generate`` call (``GenerateStats.spec``): counts,
acceptance, times, chosen arms and, per batch-size bucket, the steps the tuner decided;
per drafter kind (``KindSteps``: the one-layer drafter "eagle", the self-drafter
"self") the same for the steps that kind was chosen, and the call's timeline of kinds
(``segments``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from ...spec_strategy import OFF, Strategy


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


# the costs a decoder adds to ``SpecStats`` during a step, attributed to its kind
COSTS = ("draft_seconds", "verify_seconds", "catchup_tokens", "catchup_seconds", "drafted")
# a call's kind timeline is reported in at most this many segments (``segments_summary``)
MAX_SEGMENTS = 48


@dataclass
class KindSteps:
    """The decode steps at or below the threshold where one drafter kind was chosen
    (with several kinds: ``KindTuner``'s choice; with one: every such step)."""

    chosen: int = 0
    steps: int = 0  # of them speculative
    declined: int = 0  # of them plain (the kind's gate declined, or its 0_0_0 arm)
    probes: int = 0
    rows: int = 0  # sequence-steps of its speculative steps
    emitted: int = 0  # tokens they emitted
    drafted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    catchup_tokens: int = 0
    catchup_seconds: float = 0.0
    spec_seconds: float = 0.0  # its speculative steps' time
    spec_tokens_per_row: float = 0.0  # summed over them
    arms: dict[str, int] = field(default_factory=dict)  # strategy name -> steps (0_0_0 too)
    by_bucket: dict[str, Tally] = field(default_factory=dict)  # speculative steps' tally
    bucket_arms: dict[str, dict[str, int]] = field(default_factory=dict)  # label -> arms
    # the speculative steps' rows whose drafts this kind proposed (whichever kind the
    # step chose: free kinds propose per row) and the tokens those rows emitted
    proposed_rows: int = 0
    proposed_emitted: int = 0

    @property
    def accept_len(self) -> float:
        return self.emitted / self.rows if self.rows else 0.0

    def summary(self) -> dict:
        buckets = {}
        for label, arms in self.bucket_arms.items():
            t = self.by_bucket.get(label, Tally())
            n = sum(arms.values())
            off = arms.get(OFF.name, 0)
            buckets[label] = {"chosen": n, "steps": n - off, "declined": off,
                              "rows": t.rows, "emitted": t.emitted, "accept_len": t.mean,
                              "arms": dict(arms)}
        return {
            "chosen": self.chosen, "steps": self.steps, "declined": self.declined,
            "probes": self.probes, "rows": self.rows, "emitted": self.emitted,
            "accept_len": self.accept_len,
            "drafted_per_row": self.drafted / self.rows if self.rows else 0.0,
            "draft_seconds": self.draft_seconds, "verify_seconds": self.verify_seconds,
            "catchup_tokens": self.catchup_tokens, "catchup_seconds": self.catchup_seconds,
            "spec_seconds": self.spec_seconds,
            "spec_tok_s": (self.spec_tokens_per_row / self.spec_seconds
                           if self.spec_seconds > 0 else None),
            "arms": dict(self.arms), "buckets": buckets,
            "proposed_rows": self.proposed_rows, "proposed_emitted": self.proposed_emitted,
            "proposed_accept_len": (self.proposed_emitted / self.proposed_rows
                                    if self.proposed_rows else 0.0),
        }


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
    # response-position bucket -> [rows, emitted] (rollout/speculative/position_accept.py)
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
    kinds: dict[str, KindSteps] = field(default_factory=dict)  # drafter kind -> its steps
    # the call's kind timeline: [start, end, what] in seconds since ``begin`` (what: the
    # kind that speculated, or "plain" where the chosen kind declined), consecutive
    # steps of one kind merged; steps above the threshold end a segment
    segments: list[list] = field(default_factory=list)
    _open: bool = field(default=False, repr=False)  # the last segment may still grow
    # the call's tokens by proposing kind: [start, end, {kind: tokens}] per speculative
    # step (``record_rows``' counts, placed by the step's ``mark``)
    token_steps: list[list] = field(default_factory=list)
    _step_tokens: dict = field(default_factory=dict, repr=False)

    def merged(self, other: "SpecStats") -> "SpecStats":
        """Both calls' counts summed (the pipeline ranks' shares of one call in
        ``rollout.pipeline_mode=gathered``); ``gate`` is this one's."""
        out = SpecStats(gate=dict(self.gate), segments=[list(x) for x in self.segments],
                        token_steps=[list(x) for x in self.token_steps])
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name in ("gate", "segments", "_open", "token_steps", "_step_tokens"):
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

    def costs(self) -> tuple:
        """The decoder-recorded costs so far (``COSTS``), for ``record_kind``."""
        return tuple(getattr(self, c) for c in COSTS)

    def record_kind(self, kind: str, bucket: str, strategy: Strategy, *, probe: bool,
                    rows: int, emitted: int, seconds: float,
                    costs_before: tuple = ()) -> None:
        """One decode step at or below the threshold where ``kind`` was chosen: plain
        when ``strategy`` is 0_0_0 (declined), else speculative, ``emitted`` tokens by
        ``rows`` rows in ``seconds``; the decoder's costs since ``costs_before``
        (``costs()`` before the step) are that kind's."""
        k = self.kinds.setdefault(kind, KindSteps())
        k.chosen += 1
        k.probes += int(probe)
        k.arms[strategy.name] = k.arms.get(strategy.name, 0) + 1
        arms = k.bucket_arms.setdefault(bucket, {})
        arms[strategy.name] = arms.get(strategy.name, 0) + 1
        if strategy.is_off:
            k.declined += 1
            return
        k.steps += 1
        k.rows += rows
        k.emitted += emitted
        k.spec_seconds += seconds
        k.spec_tokens_per_row += emitted / rows
        k.by_bucket.setdefault(bucket, Tally()).add(rows, emitted)
        for name, before in zip(COSTS, costs_before):
            setattr(k, name, getattr(k, name) + getattr(self, name) - before)

    def record_rows(self, kinds: Sequence[str], emitted: Sequence[int]) -> None:
        """A speculative step's rows by the kind that proposed each (``kinds``) and the
        tokens each emitted: tokens by kind (``KindSteps.proposed_*``; the step's
        ``mark`` places them in the call's timeline, ``token_steps``)."""
        step = self._step_tokens = {}
        for kind, n in zip(kinds, emitted):
            k = self.kinds.setdefault(kind, KindSteps())
            k.proposed_rows += 1
            k.proposed_emitted += n
            step[kind] = step.get(kind, 0) + n

    def mark(self, start: float, end: float, what: Optional[str]) -> None:
        """The timeline: a decode step from ``start`` to ``end`` (seconds since the
        call began) that ``what`` (a kind, "plain") decided; None: above the
        threshold (it closes the open segment)."""
        if self._step_tokens:  # a speculative step's tokens by proposing kind
            self.token_steps.append([start, end, self._step_tokens])
            self._step_tokens = {}
        if what is None:
            self._open = False
            return
        last = self.segments[-1] if self.segments else None
        if self._open and last is not None and last[2] == what:
            last[1] = end
        else:
            self.segments.append([start, end, what])
        self._open = True

    def segments_summary(self, limit: int = MAX_SEGMENTS) -> list[list]:
        """``segments`` in at most ``limit`` pieces: where there are more, the call's
        span is cut into ``limit`` equal bins, each labelled with what took most of
        its time, and equal neighbours joined (a long tail that switches kinds often
        still draws as a few bands)."""
        segs = self.segments
        if len(segs) <= limit:
            return [[round(a, 4), round(b, 4), w] for a, b, w in segs]
        lo, hi = segs[0][0], max(b for _, b, _ in segs)
        width = (hi - lo) / limit or 1.0
        bins: list[dict] = [{} for _ in range(limit)]
        for a, b, w in segs:
            for i in range(int((a - lo) / width), min(int((b - lo) / width), limit - 1) + 1):
                x0, x1 = lo + i * width, lo + (i + 1) * width
                t = min(b, x1) - max(a, x0)
                if t > 0 or a == b:
                    bins[i][w] = bins[i].get(w, 0.0) + max(t, 0.0)
        out: list[list] = []
        for i, time_by in enumerate(bins):
            if not time_by:
                continue
            w = max(time_by, key=time_by.get)
            x0, x1 = lo + i * width, lo + (i + 1) * width
            if out and out[-1][2] == w and abs(out[-1][1] - x0) < 1e-9:
                out[-1][1] = x1
            else:
                out.append([x0, x1, w])
        return [[round(a, 4), round(b, 4), w] for a, b, w in out]

    def tokens_summary(self, limit: int = MAX_SEGMENTS) -> list[list]:
        """``token_steps`` in at most ``limit`` pieces: where there are more, the
        call's span cut into ``limit`` equal bins, each step's tokens in the bin of its
        midpoint (the kinds' totals kept), empty bins left out."""
        steps = self.token_steps
        if len(steps) <= limit:
            return [[round(a, 4), round(b, 4), dict(t)] for a, b, t in steps]
        lo, hi = steps[0][0], max(b for _, b, _ in steps)
        width = (hi - lo) / limit or 1.0
        bins: list[dict] = [{} for _ in range(limit)]
        for a, b, t in steps:
            into = bins[min(int(((a + b) / 2 - lo) / width), limit - 1)]
            for kind, n in t.items():
                into[kind] = into.get(kind, 0) + n
        return [[round(lo + i * width, 4), round(lo + (i + 1) * width, 4), t]
                for i, t in enumerate(bins) if t]

    def bucket_choice(self) -> dict:
        """Per bucket: the steps each kind speculated (``kinds``), the plain steps its
        chosen kind declined (``plain``), and the most frequent choice (``choice``:
        "kind arm", or "plain") with its share of the bucket's steps."""
        out: dict = {}
        for kind, k in self.kinds.items():
            for label, arms in k.bucket_arms.items():
                b = out.setdefault(label, {"kinds": {}, "plain": 0, "_pairs": {}})
                off = arms.get(OFF.name, 0)
                b["kinds"][kind] = b["kinds"].get(kind, 0) + sum(arms.values()) - off
                b["plain"] += off
                for arm, n in arms.items():
                    key = "plain" if arm == OFF.name else f"{kind} {arm}"
                    b["_pairs"][key] = b["_pairs"].get(key, 0) + n
        for b in out.values():
            pairs = b.pop("_pairs")
            best = max(pairs, key=lambda x: (pairs[x], x))
            b["choice"] = best
            b["share"] = pairs[best] / sum(pairs.values())
        return out

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
            # per drafter kind, per bucket the kinds' steps, the call's kind timeline
            "kinds": {k: v.summary() for k, v in self.kinds.items()},
            "bucket_choice": self.bucket_choice(),
            "segments": self.segments_summary(),
            "kind_tokens": self.tokens_summary(),  # the timeline of tokens by kind
        }


def _add(a, b):
    """Sum of two counters of one kind (a number, a list of numbers, a dict of
    counters, a Tally, a BucketSteps, a KindSteps), either of them possibly None."""
    if a is None or b is None:
        return a if b is None else b
    if isinstance(a, list):
        return [x + y for x, y in zip(a, b)]
    if isinstance(a, dict):
        return {k: _add(a.get(k), b.get(k)) for k in list(a) + [k for k in b if k not in a]}
    if isinstance(a, (Tally, BucketSteps, KindSteps)):
        return type(a)(**{f.name: _add(getattr(a, f.name), getattr(b, f.name))
                          for f in fields(a)})
    return a + b
