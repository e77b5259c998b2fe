"""The break-even gate: speculation is a choice every bucket can decline, from this
run's own measurements (``rollout.speculative.break_even``, the engine's default).

- plain decoding's step time at each batch size (median of its last steps; a bucket
  measures ``MIN_PLAIN`` plain steps before it first speculates);
- per bucket and arm, recent speculative steps' time relative to plain decoding's at
  the same batch size (median; the drafter's catch-up after plain steps is passed
  apart, ``switch_seconds``);
- the drafter's acceptance profile, over all buckets: the decayed rate at which the
  j-th draft token is accepted, from the sequences' accepted counts.

An arm's speedup estimate is its expected tokens per sequence (1 + the profile summed
to its depth for chains, so a drafter going stale shows in every chain arm at once;
its own recent mean for trees) over its relative step time. Speculative steps are
charged what they lose against plain steps for the same expected tokens (never below
zero, decayed over ``budget_horizon`` steps); while that exceeds ``probe_budget`` of
the bucket's recent decode time the bucket decodes plainly ("declined"). Where the
best estimate reaches ``PAYS_FROM`` (1.05; then as long as it stays at least 1) the
bandit picks the arm; otherwise each speculative step is a probe (an arm not measured
yet, else the closest one), its allowance halving after each probe that confirms the
loss (down to ``2**-MAX_BACKOFF``), and a losing probe is charged its catch-up too. A
probe whose drafter catch-up (the positions the drafter missed, at the measured cost
per position) does not fit in what is left of the allowance runs plainly until the
bucket has saved that much allowance since its last probe, so a probe late in long
responses is rare but never ruled out. A winning probe costs nothing, so a retrained
drafter is picked up at the next probe; a weak one costs at most the budget. While
speculating near break-even a plain step now and then refreshes the reference.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Callable, NamedTuple, Optional, Sequence

from ...spec_strategy import OFF, Strategy, bucket_of
from .decision import Decision

PLAIN_KEEP = 5  # plain step times kept per batch size (their median is the reference)
MIN_PLAIN = 3  # plain steps a bucket measures before it speculates (one may be an outlier)
PLAIN_REFRESH = 32  # steps between plain re-measurements while speculating near break-even
REFRESH_BELOW = 1.5  # ... i.e. while the best arm's speedup estimate is below this (4x
# as many steps above it)
STALE_AFTER = 4  # an arm last measured more than this many gate windows of the bucket's
# steps ago does not keep speculation on while another arm has newer measurements
STALE_BELOW = 0.9  # a speculating bucket whose estimate falls below this went stale
MAX_BACKOFF = 3  # probes of a losing drafter get down to 1/8 of the budget ...
MIN_EVIDENCE = 4  # ... once its best arm was measured this many times, or at once
CLEAR_LOSS = 0.75  # when even the best arm's estimate is below this
PAYS_FROM = 1.05  # a bucket starts speculating when the best estimate reaches this, and
# keeps on while it stays at or above 1 (hysteresis: near break-even the estimate's
# noise and the catch-ups of switching back and forth would lose more than it gains)
MIN_HORIZON = 100  # plain steps: the least decode time the budget is a share of
SAVE_WINDOWS = 20  # a bucket saves its probe allowance for catch-ups over at most this
# many budget horizons (a probe whose catch-up is larger waits until it is saved up)
ACCEPT_HORIZON = 16  # sequence-steps over which the acceptance profile is averaged


class Sample(NamedTuple):
    """One speculative step of an arm, as the gate keeps it."""

    tokens: float  # tokens emitted per sequence
    relative: float  # step time over plain decoding's at the same batch size
    step: int  # the bucket's step count when it was taken


@dataclass
class Reach:
    """Decayed counts of one draft position: drafted, and accepted there."""

    accepted: float = 0.0
    drafted: float = 0.0


@dataclass
class Account:
    """Decayed decode seconds and seconds speculation lost, over all buckets."""

    elapsed: float = 0.0
    lost: float = 0.0


class BucketGate:
    """Break-even state of one bucket."""

    def __init__(self, window: int) -> None:
        self.samples: dict[str, deque[Sample]] = {}  # per arm, its recent steps
        self.window = window
        self.elapsed = 0.0  # decayed decode seconds of the bucket's tuned steps
        self.lost = 0.0  # decayed seconds speculative steps lost against plain steps
        self.since_plain = 0  # tuned steps since the bucket's last plain step
        self.backoff = 0  # probes in a row that found speculation losing (capped)
        self.paying = False  # the last decision's estimate: speculation pays
        self.refresh_left = 0  # plain steps still to take to re-measure the reference
        self.saved = 0.0  # probe allowance saved for a catch-up (seconds; see affordable)
        self.steps = self.declined = self.probes = 0  # lifetime counts

    def relative(self, name: str) -> Optional[float]:
        """The arm's median step time relative to plain decoding's (None: unmeasured)."""
        got = self.samples.get(name)
        return statistics.median(x.relative for x in got) if got else None

    def speedup(self, name: str, tokens: Optional[float] = None) -> Optional[float]:
        """Expected tokens per sequence (``tokens``, else the arm's measured mean) over
        its median relative step time (vs plain)."""
        got = self.samples.get(name)
        if not got:
            return None
        if tokens is None:
            tokens = sum(x.tokens for x in got) / len(got)
        return tokens / self.relative(name)

    def fresh(self, name: str) -> bool:
        """Whether the arm was measured within the last ``STALE_AFTER`` x window steps."""
        got = self.samples.get(name)
        return bool(got) and self.steps - got[-1].step <= STALE_AFTER * self.window

    def state(self) -> dict:
        return {"samples": {n: [list(x) for x in d] for n, d in self.samples.items()},
                "elapsed": self.elapsed, "lost": self.lost, "since_plain": self.since_plain,
                "backoff": self.backoff, "paying": self.paying,
                "refresh_left": self.refresh_left, "saved": self.saved,
                "counts": [self.steps, self.declined, self.probes]}

    def load(self, state: dict) -> None:
        self.samples = {n: deque((Sample(float(t), float(r), int(i)) for t, r, i in d),
                                 maxlen=self.window)
                        for n, d in state["samples"].items()}
        self.elapsed, self.lost = float(state["elapsed"]), float(state["lost"])
        self.since_plain, self.backoff = int(state["since_plain"]), int(state["backoff"])
        self.paying = bool(state["paying"])
        self.refresh_left = int(state["refresh_left"])
        self.saved = float(state.get("saved", 0.0))
        self.steps, self.declined, self.probes = (int(c) for c in state["counts"])


class BreakEvenGate:
    """The gate over every bucket of ``buckets`` (ascending upper bounds)."""

    def __init__(self, buckets: list[int], *, probe_budget: float, window: int,
                 budget_horizon: int) -> None:
        self.buckets = buckets
        self.probe_budget = float(probe_budget)
        self.window = window
        self.budget_horizon = budget_horizon
        self.plain: dict[int, deque[float]] = {}  # plain step seconds per batch size
        self.gates = [BucketGate(window) for _ in buckets]
        self.reach: list[Reach] = []  # per draft position j
        self.overall = Account()
        self.catchup: Optional[float] = None  # drafter catch-up seconds per position

    # ------------------------------------------------------------ estimates
    def _bucket(self, batch_size: int) -> int:
        return bucket_of(self.buckets, batch_size)

    def plain_seconds(self, batch_size: int) -> Optional[float]:
        """Median plain step time at ``batch_size`` measured in this run, over at least
        ``MIN_PLAIN`` steps where the bucket has them: with fewer at that batch size,
        the nearest batch sizes of the same bucket add theirs (None: no plain data)."""
        b = self._bucket(batch_size)
        near = sorted((s for s in self.plain if self.plain[s] and self._bucket(s) == b),
                      key=lambda x: (abs(x - batch_size), x))
        times: list[float] = []
        for s in near:
            times.extend(self.plain[s])
            if len(times) >= MIN_PLAIN:
                break
        return statistics.median(times) if times else None

    def plain_count(self, b: int) -> int:
        return sum(len(d) for s, d in self.plain.items() if self._bucket(s) == b)

    def bucket_plain_times(self, b: int) -> list[float]:
        return [t for s, d in self.plain.items() if self._bucket(s) == b for t in d]

    def expected_tokens(self, arm: Strategy) -> Optional[float]:
        """Tokens per sequence a step of chain ``arm`` is expected to emit: 1 + the
        acceptance profile summed over its depth (positions never drafted yet take the
        deepest measured rate: an upper bound). None for trees and without a profile."""
        if not arm.is_chain or not self.reach:
            return None
        profile = self.acceptance_profile()
        return 1.0 + sum(profile[min(j, len(profile) - 1)] for j in range(arm.depth))

    def acceptance_profile(self) -> list[float]:
        """Decayed rate at which the j-th draft token (j = 1, 2, ...) was accepted, made
        non-increasing in j: a sequence that accepted j+1 drafts accepted j, but each
        position is measured on the steps of the chains that reach it (a deep arm's
        steps alone at its deepest positions, maybe on easier text), so a measured rate
        above a shallower one is capped at it. A position no step measured yet takes
        the rate before it."""
        out, rate = [], 1.0
        for r in self.reach:
            if r.drafted > 0:
                rate = min(rate, r.accepted / r.drafted)
            out.append(rate)
        return out

    def speedup(self, b: int, arm: Strategy) -> Optional[float]:
        return self.gates[b].speedup(arm.name, self.expected_tokens(arm))

    def relative(self, b: int, arm: Strategy) -> Optional[float]:
        """``arm``'s median step time over plain decoding's in bucket ``b`` (None:
        unmeasured there)."""
        return self.gates[b].relative(arm.name)

    def best_speedup(self, b: int, spec: list[Strategy]
                     ) -> Optional[tuple[Strategy, float]]:
        """The arm of ``spec`` with the highest speedup estimate in bucket ``b`` and it,
        among the arms measured recently when there are any (a drafter that went stale
        shows first in the arm speculating now; the others' older estimates would hide
        it)."""
        gate, best = self.gates[b], None
        arms = [a for a in spec if a.name in gate.samples]
        fresh = [a for a in arms if gate.fresh(a.name)]
        for arm in fresh or arms:
            s = self.speedup(b, arm)
            if s is not None and (best is None or s > best[1]):
                best = (arm, s)
        return best

    # ------------------------------------------------------------ deciding
    def decide(self, b: int, batch_size: int, spec: list[Strategy],
               paying_arm: Callable[[Strategy], Strategy]) -> Decision:
        """The gate's decision in bucket ``b`` over its speculative arms ``spec``;
        ``paying_arm(best)`` picks the arm where speculation pays."""
        gate = self.gates[b]
        if self.plain_count(b) < MIN_PLAIN:  # measure plain decoding here first
            return Decision(b, OFF, True)
        best = self.best_speedup(b, spec)
        pays = best is not None and best[1] >= (1.0 if gate.paying else PAYS_FROM)
        if gate.paying and best is not None and best[1] < STALE_BELOW:
            # the drafter went stale (not just a dip near break-even): probes start
            # over from the least allowance, as on a bucket's first probe
            gate.elapsed = 0.0
        gate.paying = pays
        # what speculating may have lost (net, against plain steps) in this bucket's
        # recent decode time (at least MIN_HORIZON plain steps' worth, so one unlucky
        # step of a good drafter does not stop it); while the estimate says it loses,
        # probes back off
        horizon, allowance = self._allowance(gate, batch_size, pays)
        if gate.lost > allowance:
            return Decision(b, OFF, True)  # declined
        if not pays and self.overall.lost > self.probe_budget * max(
                self.overall.elapsed, horizon) / 2 ** gate.backoff:
            # probes are also bounded over all buckets together: a long tail enters
            # bucket after bucket, and each would otherwise probe on its own allowance
            return Decision(b, OFF, True)
        if pays:
            every = PLAIN_REFRESH * (1 if best[1] < REFRESH_BELOW else 4)
            if gate.refresh_left > 0 or gate.since_plain >= every:
                return Decision(b, OFF, True, probe=True)  # re-measure plain decoding
            return Decision(b, paying_arm(best[0]), False)
        # a probe where speculation looks worse: an arm not measured yet that could
        # still pay, else the one the estimate says comes closest
        arm = self.unmeasured(b, spec) or (best[0] if best else spec[0])
        return Decision(b, arm, False, probe=True)

    def unmeasured(self, b: int, spec: list[Strategy]) -> Optional[Strategy]:
        """The first arm the gate has not measured in bucket ``b`` that could still pay."""
        gate = self.gates[b]
        return next((a for a in spec if a.name not in gate.samples
                     and self._could_pay(b, a, spec)), None)

    def _could_pay(self, b: int, arm: Strategy, spec: list[Strategy]) -> bool:
        """For an arm not measured in bucket ``b``: False when a measured shallower
        chain bounds it below break-even (a deeper chain costs at least as much, and
        the acceptance profile's expectation for it is an upper bound)."""
        tokens = self.expected_tokens(arm)
        if tokens is None:
            return True
        gate = self.gates[b]
        for other in spec:
            rel = gate.relative(other.name)
            if rel is not None and other.is_chain and other.depth <= arm.depth:
                if tokens / rel < 1.0:
                    return False
        return True

    def affordable(self, b: int, batch_size: int, positions: int) -> bool:
        """Whether a probe in bucket ``b`` may pay the drafter's catch-up over
        ``positions`` missed positions: its estimated cost (seconds per position, as
        measured by earlier catch-ups; the first catch-up is let through to measure it)
        must fit in what is left of the bucket's probe allowance, or in what the bucket
        saved of it since its last probe. A probe late in long responses would otherwise
        cost far more than the budget (the whole history of every row goes through the
        drafter); one that costs more than a window's allowance waits until it is saved
        up (at the budget's rate, backed off like the allowance), so a drafter that lost
        once is still re-tried."""
        if positions <= 0 or self.catchup is None:
            return True
        gate = self.gates[b]
        _, allowance = self._allowance(gate, batch_size, pays=False)
        return positions * self.catchup <= max(allowance - gate.lost, gate.saved)

    def _allowance(self, gate: BucketGate, batch_size: int, pays: bool
                   ) -> tuple[float, float]:
        """(horizon, allowance): the bucket's recent decode time, at least MIN_HORIZON
        plain steps' worth, and the share of it speculation may lose (backing off while
        it does not pay)."""
        horizon = max(gate.elapsed, MIN_HORIZON * (self.plain_seconds(batch_size) or 0.0))
        return horizon, self.probe_budget * horizon / (1 if pays else 2 ** gate.backoff)

    # ------------------------------------------------------------ recording
    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """A plain step above the speculation threshold: the break-even reference at
        that batch size, and decode time the probe budget is a share of."""
        if seconds > 0 and math.isfinite(seconds):
            self.plain.setdefault(batch_size, deque(maxlen=PLAIN_KEEP)).append(float(seconds))
            self._tick(seconds)

    def record_catchup(self, seconds: float, positions: int) -> None:
        """A drafter catch-up over ``positions`` positions took ``seconds``."""
        if positions > 0 and seconds > 0 and math.isfinite(seconds):
            per = float(seconds) / int(positions)
            self.catchup = per if self.catchup is None else 0.7 * self.catchup + 0.3 * per

    def _tick(self, seconds: float) -> None:
        decay = 1.0 - 1.0 / self.budget_horizon
        self.overall.elapsed = self.overall.elapsed * decay + seconds
        self.overall.lost *= decay

    def _charge(self, gate: BucketGate, seconds: float) -> None:
        """Add ``seconds`` lost (negative: won) to the bucket's and the overall account,
        neither below zero."""
        gate.lost = max(0.0, gate.lost + seconds)
        self.overall.lost = max(0.0, self.overall.lost + seconds)

    def record_acceptance(self, strategy: Strategy, accepted: Sequence[int]) -> None:
        decay = (1.0 - 1.0 / ACCEPT_HORIZON) ** len(accepted)
        for r in self.reach:
            r.accepted *= decay
            r.drafted *= decay
        while len(self.reach) < strategy.depth:
            self.reach.append(Reach())
        for a in accepted:
            for j in range(strategy.depth):
                self.reach[j].drafted += 1.0
                if a > j:
                    self.reach[j].accepted += 1.0

    def record(self, b: int, spec: list[Strategy], decision: Decision, batch_size: int,
               tokens: float, seconds: float, switch: float = 0.0) -> None:
        """A step of ``decision`` in bucket ``b`` (arms ``spec``) emitted ``tokens`` in
        ``seconds`` after a catch-up of ``switch`` seconds."""
        gate = self.gates[b]
        strategy, probe = decision.strategy, decision.probe
        ref = self.plain_seconds(batch_size)  # plain reference before this sample
        per_row = tokens / batch_size
        suspect = gate.refresh_left > 0  # re-measuring a reference found off
        if strategy.is_off:
            self.plain.setdefault(batch_size, deque(maxlen=PLAIN_KEEP)).append(float(seconds))
            gate.since_plain = 0
            gate.declined += 1
            gate.refresh_left = max(0, gate.refresh_left - 1)
            if probe and ref is not None and not 0.8 < seconds / ref < 1.25:
                # the reference was off (measured while the machine was busier or
                # quieter): re-measure until the median is made of new steps
                gate.refresh_left = MIN_PLAIN - 1
        else:
            gate.since_plain += 1
            if ref is not None and seconds < 0.8 * ref:
                # a speculative step (a verification forward and drafting) faster than
                # a plain step: the reference was measured while the machine was busier
                gate.refresh_left = MIN_PLAIN
            if ref is not None:
                window = gate.samples.get(strategy.name)
                if window is None:
                    window = gate.samples[strategy.name] = deque(maxlen=self.window)
                window.append(Sample(per_row, seconds / ref, gate.steps))
        decay = 1.0 - 1.0 / self.budget_horizon
        gate.elapsed = gate.elapsed * decay + seconds + switch
        gate.lost *= decay
        horizon, _ = self._allowance(gate, batch_size, pays=False)
        saved = gate.saved - switch * int(probe) + self.probe_budget * (
            seconds + switch) / 2 ** gate.backoff  # a probe spends its catch-up
        gate.saved = min(max(0.0, saved), SAVE_WINDOWS * self.probe_budget * horizon)
        self._tick(seconds + switch)
        gate.steps += 1
        gate.probes += int(probe)
        best = self.best_speedup(b, spec)
        if strategy.is_off:
            if probe and not suspect:  # time lost against speculating at the estimate
                speed = best[1] if best is not None else 1.0
                self._charge(gate, seconds * (1.0 - 1.0 / max(speed, 1.0)))
            return
        if ref is not None:  # every speculative step: time lost (or won, down to no loss)
            # against plain steps for its tokens per sequence: the acceptance profile's
            # expectation for chains (it includes this step; a single step's count is
            # too noisy at small batches), else the step's own
            expected = self.expected_tokens(strategy)
            per_seq = per_row if expected is None else expected
            self._charge(gate, seconds - per_seq * ref)
        if best is not None and best[1] >= 1.0:
            gate.backoff = 0  # (a catch-up before speculation that pays is an investment)
            return
        self._charge(gate, switch)  # a probe that found speculation losing: its catch-up
        if probe and best is not None and (
                best[1] < CLEAR_LOSS or len(gate.samples.get(best[0].name, ())) >= MIN_EVIDENCE):
            gate.backoff = min(gate.backoff + 1, MAX_BACKOFF)

    # ------------------------------------------------------------ stats and state
    def stats(self, b: int, spec: list[Strategy]) -> Optional[dict]:
        """Bucket ``b``'s gate, JSON-able (None when it has no data yet)."""
        gate = self.gates[b]
        times = self.bucket_plain_times(b)
        if not gate.steps and not times:
            return None
        plain = 1.0 / statistics.median(times) if times else None
        best = self.best_speedup(b, spec)
        return {
            "steps": gate.steps, "declined": gate.declined, "probes": gate.probes,
            "plain_tok_s": plain,
            "arm": best[0].name if best else None,
            "arm_speedup": best[1] if best else None,
            "arm_tok_s": best[1] * plain if best and plain else None,
            "speculating": bool(best and best[1] >= 1.0),
            "probe_loss": gate.lost / gate.elapsed if gate.elapsed > 0 else 0.0,
            "arms": {a.name: self.speedup(b, a) for a in spec if a.name in gate.samples},
        }

    def state(self) -> dict:
        return {"plain": {str(s): list(d) for s, d in sorted(self.plain.items())},
                "buckets": [g.state() for g in self.gates],
                "reach": [[r.accepted, r.drafted] for r in self.reach],
                "overall": [self.overall.elapsed, self.overall.lost],
                "catchup": self.catchup}

    def load(self, g: dict) -> None:
        """Restore ``state()``; raises ValueError naming what is wrong, changing nothing."""
        try:
            plain = {int(s): deque((float(t) for t in d), maxlen=PLAIN_KEEP)
                     for s, d in g["plain"].items()}
            reach = [Reach(float(a), float(d)) for a, d in g["reach"]]
            elapsed, lost = (float(x) for x in g["overall"])
            catchup = None if g.get("catchup") is None else float(g["catchup"])
            if len(g["buckets"]) != len(self.buckets):
                raise ValueError(f"{len(g['buckets'])} buckets, expected {len(self.buckets)}")
            gates = [BucketGate(self.window) for _ in self.buckets]
            for gate, gs in zip(gates, g["buckets"]):
                gate.load(gs)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"tuner state has an invalid gate state: {e!r}") from None
        self.plain, self.reach, self.gates = plain, reach, gates
        self.overall, self.catchup = Account(elapsed, lost), catchup
