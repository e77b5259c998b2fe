"""Speculative-decoding strategy tuner: a bucketed multi-armed bandit (BEG-MAB).

The running batch size changes during a rollout (long-tail requests finish at
different times), and the best drafting strategy depends on it: deep trees pay off
at batch 1, short chains at larger batches. The tuner splits batch sizes into
buckets and runs one bandit per bucket whose arms are ``Strategy`` values, rewarded
by measured accepted tokens per second of a speculative step.

- ``egreedy`` (bucketed epsilon-greedy): untried arms first, then with probability
  ``epsilon`` a uniformly random arm, else the arm with the highest median reward
  over its sliding window (the median shrugs off rare stalls and spikes; the window
  tracks drift as sequences grow);
- ``ucb1``: untried arms first, then ``median/scale + c*sqrt(2 ln N / n)``;
- ``fixed``: always one strategy; rewards are still recorded for metrics.

Break-even gate (``break_even=True``, the engine's default; not under ``fixed``):
speculation is a choice every bucket can decline, from this run's own measurements:

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

Buckets are ascending upper bounds: bucket ``i`` covers batch sizes
``(bound[i-1], bound[i]]``, and the last bucket also takes every larger batch.
Randomness comes from the tuner's own ``random.Random(seed)``, whose state is part
of ``state_dict`` so a saved and reloaded tuner makes the same further choices.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence, Union

from ..fileio import atomic_write

POLICIES = ("egreedy", "ucb1", "fixed")
STATE_VERSION = 2  # 2: break-even gate state (version 1 states load with an empty gate)
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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_digits(text: str) -> bool:
    return text.isascii() and text.isdigit()


@dataclass(frozen=True, order=True)
class Strategy:
    """One drafting strategy: draft ``depth`` tokens along a path, ``top_k`` branches
    per tree node (1 = chain), and send ``verify_tokens`` draft tokens to verification.
    ``0_0_0`` (``OFF``) is the arm "no speculation": a plain decode step, so a bucket's
    bandit can learn that speculating does not pay at that batch size."""

    depth: int
    top_k: int
    verify_tokens: int

    def __post_init__(self) -> None:
        for field in ("depth", "top_k", "verify_tokens"):
            value = getattr(self, field)
            if not _is_int(value):
                raise ValueError(f"Strategy.{field} must be an int, got {value!r}")
        if (self.depth, self.top_k, self.verify_tokens) == (0, 0, 0):
            return  # OFF
        if self.depth < 1:
            raise ValueError(f"Strategy.depth must be >= 1, got {self.depth}")
        if self.top_k < 1:
            raise ValueError(f"Strategy.top_k must be >= 1, got {self.top_k}")
        if self.top_k == 1:
            if self.verify_tokens != self.depth:
                raise ValueError(
                    f"chain strategy (top_k=1) must verify exactly depth={self.depth} "
                    f"tokens, got verify_tokens={self.verify_tokens}")
            return
        tree_size = sum(self.top_k ** i for i in range(1, self.depth + 1))
        if not self.depth <= self.verify_tokens <= tree_size:
            raise ValueError(
                f"tree strategy depth={self.depth} top_k={self.top_k} needs "
                f"{self.depth} <= verify_tokens <= {tree_size}, got {self.verify_tokens}")

    @property
    def is_chain(self) -> bool:
        """True for chain drafting (``top_k == 1``)."""
        return self.top_k == 1

    @property
    def is_off(self) -> bool:
        """True for the no-speculation arm ``0_0_0``."""
        return self.depth == 0

    @property
    def name(self) -> str:
        """``"{depth}_{top_k}_{verify_tokens}"``, e.g. ``"5_4_16"``."""
        return f"{self.depth}_{self.top_k}_{self.verify_tokens}"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """Inverse of ``name``: ``"6_1_6"`` -> ``Strategy(6, 1, 6)``."""
        if not isinstance(text, str):
            raise ValueError(f"strategy must be a string like '6_1_6', got {text!r}")
        parts = text.strip().split("_")
        if len(parts) != 3 or not all(_is_digits(p) for p in parts):
            raise ValueError(
                f"invalid strategy {text!r}: expected 'depth_topk_verify' with three "
                f"non-negative integers, e.g. '6_1_6' or '5_4_16'")
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        return self.name


OFF = Strategy(0, 0, 0)


@dataclass(frozen=True)
class Decision:
    """What ``choose`` decided for one step: the strategy, whether it runs plain below
    the threshold (``declined``), and whether it is a break-even probe (a step taken
    against the gate's current decision to re-measure the other side)."""

    bucket: int
    strategy: Strategy
    declined: bool
    probe: bool = False


class _Gate:
    """Break-even state of one bucket (see the module docstring)."""

    def __init__(self, window: int) -> None:
        # arm -> (tokens per sequence, time relative to plain, bucket step it was taken)
        self.samples: dict[str, deque] = {}
        self.window = window
        self.elapsed = 0.0  # decayed decode seconds of the bucket's tuned steps
        self.lost = 0.0  # decayed seconds speculative steps lost against plain steps
        self.since_plain = 0  # tuned steps since the bucket's last plain step
        self.backoff = 0  # probes in a row that found speculation losing (capped)
        self.paying = False  # the last decision's estimate: speculation pays
        self.refresh_left = 0  # plain steps still to take to re-measure the reference
        self.saved = 0.0  # probe allowance saved for a catch-up (seconds; see probe_affordable)
        self.steps = self.declined = self.probes = 0  # lifetime counts

    def speedup(self, name: str, tokens: Optional[float] = None) -> Optional[float]:
        """Expected tokens per sequence (``tokens``, else the arm's measured mean) over
        its median relative step time (vs plain)."""
        got = self.samples.get(name)
        if not got:
            return None
        if tokens is None:
            tokens = sum(x[0] for x in got) / len(got)
        return tokens / statistics.median(x[1] for x in got)

    def fresh(self, name: str) -> bool:
        """Whether the arm was measured within the last ``STALE_AFTER`` x window steps."""
        got = self.samples.get(name)
        return bool(got) and self.steps - got[-1][2] <= STALE_AFTER * self.window

    def state(self) -> dict:
        return {"samples": {n: [list(x) for x in d] for n, d in self.samples.items()},
                "elapsed": self.elapsed, "lost": self.lost, "since_plain": self.since_plain,
                "backoff": self.backoff, "paying": self.paying,
                "refresh_left": self.refresh_left, "saved": self.saved,
                "counts": [self.steps, self.declined, self.probes]}

    def load(self, state: dict) -> None:
        self.samples = {n: deque(((float(t), float(r), int(i)) for t, r, i in d),
                                 maxlen=self.window)
                        for n, d in state["samples"].items()}
        self.elapsed, self.lost = float(state["elapsed"]), float(state["lost"])
        self.since_plain, self.backoff = int(state["since_plain"]), int(state["backoff"])
        self.paying = bool(state["paying"])
        self.refresh_left = int(state["refresh_left"])
        self.saved = float(state.get("saved", 0.0))
        self.steps, self.declined, self.probes = (int(c) for c in state["counts"])


def parse_buckets(text_or_list: Union[str, Iterable[int]]) -> list[int]:
    """Bucket upper bounds from ``"1,2,4,8"`` or a list; positive and strictly increasing."""
    if isinstance(text_or_list, str):
        items = [p.strip() for p in text_or_list.split(",")]
        if not text_or_list.strip() or any(not p for p in items):
            raise ValueError(f"invalid buckets {text_or_list!r}: expected comma-separated "
                             f"positive integers, e.g. '1,2,4,8'")
        bounds = []
        for p in items:
            try:
                bounds.append(int(p))
            except ValueError:
                raise ValueError(f"invalid bucket bound {p!r} in {text_or_list!r}: "
                                 f"not an integer") from None
    else:
        bounds = list(text_or_list)
        for b in bounds:
            if not _is_int(b):
                raise ValueError(f"bucket bound must be an int, got {b!r}")
    if not bounds:
        raise ValueError("buckets must not be empty")
    for b in bounds:
        if b < 1:
            raise ValueError(f"bucket bound must be >= 1, got {b} in {bounds}")
    for prev, b in zip(bounds, bounds[1:]):
        if b <= prev:
            raise ValueError(f"bucket bounds must be strictly increasing, got {b} after "
                             f"{prev} in {bounds}")
    return bounds


def _label(buckets: list[int], index: int) -> str:
    lo = buckets[index - 1] + 1 if index > 0 else 1
    hi = buckets[index]
    if index == len(buckets) - 1:
        return f"{lo}+"
    return f"{hi}" if lo == hi else f"{lo}-{hi}"


def _parse_arm_list(text: str, entry: str) -> list[Strategy]:
    names = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not n for n in names):
        raise ValueError(f"empty strategy in arms entry {entry!r}")
    arms = [Strategy.parse(n) for n in names]
    _check_unique(arms, f"arms entry {entry!r}")
    return arms


def _check_unique(arms: list[Strategy], where: str) -> None:
    seen = set()
    for arm in arms:
        if arm in seen:
            raise ValueError(f"strategy {arm.name} listed twice in {where}")
        seen.add(arm)


def parse_arms(text: str, buckets: Union[str, Iterable[int]]) -> dict[int, list[Strategy]]:
    """Arms per bucket index from ``"1:6_1_6,5_4_16;2-4:6_1_6;*:4_1_4"``.

    A key is a bucket upper bound, a range ``lo-hi`` (every bucket whose upper bound is
    in ``[lo, hi]``), or ``*`` (every bucket not listed otherwise). Each bucket must get
    at least one arm and may be listed only once.
    """
    bounds = parse_buckets(buckets)
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"arms spec must be a non-empty string, got {text!r}")
    arms: dict[int, list[Strategy]] = {}
    default: Optional[list[Strategy]] = None
    for entry in (e.strip() for e in text.split(";")):
        if not entry:
            continue
        key, sep, rest = entry.partition(":")
        key = key.strip()
        if not sep:
            raise ValueError(f"invalid arms entry {entry!r}: expected 'bucket:strategy,...'")
        strategies = _parse_arm_list(rest, entry)
        if key == "*":
            if default is not None:
                raise ValueError(f"default '*' given twice in arms spec {text!r}")
            default = strategies
            continue
        lo_text, dash, hi_text = key.partition("-")
        if not _is_digits(lo_text.strip()) or (dash and not _is_digits(hi_text.strip())):
            raise ValueError(f"invalid bucket key {key!r} in arms entry {entry!r}: expected "
                             f"a bucket bound, a range 'lo-hi' or '*'")
        lo = int(lo_text)
        hi = int(hi_text) if dash else lo
        if dash:
            if lo > hi:
                raise ValueError(f"invalid bucket range {key!r}: {lo} > {hi}")
            indices = [i for i, b in enumerate(bounds) if lo <= b <= hi]
            if not indices:
                raise ValueError(f"bucket range {key!r} matches no bucket bound in {bounds}")
        else:
            if lo not in bounds:
                raise ValueError(f"bucket key {key!r} is not a bucket bound; bounds are {bounds}")
            indices = [bounds.index(lo)]
        for i in indices:
            if i in arms:
                raise ValueError(f"bucket {bounds[i]} ({_label(bounds, i)}) is given arms "
                                 f"twice in arms spec {text!r}")
            arms[i] = list(strategies)
    missing = [i for i in range(len(bounds)) if i not in arms]
    if missing and default is None:
        labels = ", ".join(_label(bounds, i) for i in missing)
        raise ValueError(f"no arms for bucket(s) {labels} (bounds {bounds}); list them "
                         f"or add a default '*:...' entry")
    for i in missing:
        arms[i] = list(default)
    return {i: arms[i] for i in range(len(bounds))}


def _median(window: Iterable[float]) -> Optional[float]:
    values = list(window)
    return statistics.median(values) if values else None


class StrategyTuner:
    """Per-bucket bandit over drafting strategies, rewarded by accepted tokens/second,
    with an optional break-even gate that declines speculation where it loses."""

    def __init__(self, buckets: Union[str, list[int]], arms: dict[int, list[Strategy]], *,
                 policy: str = "egreedy", epsilon: float = 0.1, window: int = 50,
                 ucb_c: float = 1.0, fixed: Optional[Strategy] = None,
                 seed: int = 0, break_even: bool = False, probe_budget: float = 0.01,
                 gate_window: int = 12, budget_horizon: int = 200) -> None:
        self.buckets = parse_buckets(buckets)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if isinstance(epsilon, bool) or not isinstance(epsilon, (int, float)) \
                or not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
        if not _is_int(window) or window < 1:
            raise ValueError(f"window must be an int >= 1, got {window!r}")
        if isinstance(ucb_c, bool) or not isinstance(ucb_c, (int, float)) \
                or not (math.isfinite(ucb_c) and ucb_c >= 0):
            raise ValueError(f"ucb_c must be a finite number >= 0, got {ucb_c!r}")
        if fixed is not None and not isinstance(fixed, Strategy):
            raise ValueError(f"fixed must be a Strategy or None, got {fixed!r}")
        if policy == "fixed" and fixed is None:
            raise ValueError("policy 'fixed' needs a fixed strategy (fixed=Strategy(...))")
        if not _is_int(seed):
            raise ValueError(f"seed must be an int, got {seed!r}")
        if not isinstance(break_even, bool):
            raise ValueError(f"break_even must be a bool, got {break_even!r}")
        if isinstance(probe_budget, bool) or not isinstance(probe_budget, (int, float)) \
                or not 0.0 <= probe_budget < 1.0:
            raise ValueError(f"probe_budget must be in [0, 1), got {probe_budget!r}")
        for name, value in (("gate_window", gate_window), ("budget_horizon", budget_horizon)):
            if not _is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        n = len(self.buckets)
        if not isinstance(arms, dict) or set(arms) != set(range(n)):
            got = sorted(arms) if isinstance(arms, dict) else arms
            raise ValueError(f"arms must map every bucket index 0..{n - 1} to a list of "
                             f"strategies, got keys {got!r}")
        self.arms: dict[int, list[Strategy]] = {}
        for i in range(n):
            arm_list = list(arms[i])
            if not arm_list:
                raise ValueError(f"bucket {self.bucket_label(i)} has no arms")
            for arm in arm_list:
                if not isinstance(arm, Strategy):
                    raise ValueError(f"arm {arm!r} of bucket {self.bucket_label(i)} is not "
                                     f"a Strategy")
            _check_unique(arm_list, f"bucket {self.bucket_label(i)}")
            self.arms[i] = arm_list
        self.policy = policy
        self.epsilon = float(epsilon)
        self.window = window
        self.ucb_c = float(ucb_c)
        self.fixed = fixed
        self.seed = seed
        self.break_even = break_even
        self.probe_budget = float(probe_budget)
        self.gate_window = gate_window
        self.budget_horizon = budget_horizon
        self._rng = random.Random(seed)
        # Per bucket, keyed by strategy name: recent rewards and total update counts.
        self._windows: list[dict[str, deque[float]]] = [{} for _ in range(n)]
        self._pulls: list[dict[str, int]] = [{} for _ in range(n)]
        # Break-even gate: plain step seconds per batch size, per-bucket state.
        self._plain: dict[int, deque[float]] = {}
        self._gates = [_Gate(gate_window) for _ in range(n)]
        self._reach: list[list[float]] = []  # per draft position j: [accepted, drafted]
        self._overall = [0.0, 0.0]  # decode seconds and lost seconds over all buckets
        self._catchup: Optional[float] = None  # drafter catch-up seconds per position
        self.last_decision: Optional[Decision] = None  # of the latest ``choose``

    # ----------------------------------------------------------------- buckets
    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket holding ``batch_size`` (larger than all bounds -> last)."""
        if not _is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        for i, bound in enumerate(self.buckets):
            if batch_size <= bound:
                return i
        return len(self.buckets) - 1

    def bucket_label(self, index: int) -> str:
        """``"1"``, ``"3-4"``, ...; the last bucket is ``"{lo}+"``."""
        if not _is_int(index) or not 0 <= index < len(self.buckets):
            raise ValueError(f"bucket index must be in [0, {len(self.buckets) - 1}], "
                             f"got {index!r}")
        return _label(self.buckets, index)

    # --------------------------------------------------------------- choosing
    def _pulls_of(self, b: int, arm: Strategy) -> int:
        return self._pulls[b].get(arm.name, 0)

    def _median_of(self, b: int, arm: Strategy) -> Optional[float]:
        return _median(self._windows[b].get(arm.name, ()))

    def _greedy(self, b: int, arms: Optional[list[Strategy]] = None) -> Strategy:
        arms = self.arms[b] if arms is None else arms
        best, best_median = arms[0], None
        for arm in arms:
            m = self._median_of(b, arm)
            if m is not None and (best_median is None or m > best_median):
                best, best_median = arm, m
        return best

    def _untried(self, b: int, arms: Optional[list[Strategy]] = None) -> Optional[Strategy]:
        for arm in self.arms[b] if arms is None else arms:
            if self._pulls_of(b, arm) == 0:
                return arm
        return None

    def _ucb(self, b: int, arms: Optional[list[Strategy]] = None) -> Strategy:
        arms = self.arms[b] if arms is None else arms
        medians = [self._median_of(b, a) or 0.0 for a in arms]
        scale = max(medians)
        total = sum(self._pulls_of(b, a) for a in arms)
        log_total = math.log(total) if total > 1 else 0.0
        best, best_value = arms[0], -math.inf
        for arm, m in zip(arms, medians):
            exploit = m / scale if scale > 0 else 0.0
            value = exploit + self.ucb_c * math.sqrt(2.0 * log_total / self._pulls_of(b, arm))
            if value > best_value:
                best, best_value = arm, value
        return best

    def _bandit(self, b: int, arms: list[Strategy]) -> Strategy:
        untried = self._untried(b, arms)
        if untried is not None:
            return untried
        if self.policy == "ucb1":
            return self._ucb(b, arms)
        if self._rng.random() < self.epsilon:
            return self._rng.choice(arms)
        return self._greedy(b, arms)

    def choose(self, batch_size: int) -> Strategy:
        """Strategy for the next decode step at this running batch size (``0_0_0``: a
        plain step). ``last_decision`` tells whether it was declined or a probe."""
        b = self.bucket_of(batch_size)
        if self.policy == "fixed":
            d = Decision(b, self.fixed, False)  # type: ignore[arg-type]
        elif not self._gated(b):
            arm = self._bandit(b, self.arms[b])
            d = Decision(b, arm, arm.is_off)
        else:
            d = self._gate_choose(b, batch_size)
        self.last_decision = d
        return d.strategy

    def best(self, batch_size: int) -> Strategy:
        """Arm with the highest median reward in the bucket, no exploration.

        Untried arms are skipped; with no data at all the first listed arm is returned.
        Under policy ``fixed`` this is the fixed strategy. With the break-even gate it
        is ``0_0_0`` while the gate declines speculation in the bucket.
        """
        b = self.bucket_of(batch_size)
        if self.policy == "fixed":
            return self.fixed  # type: ignore[return-value]
        if self._gated(b):
            spec = self._spec_arms(b)
            best = self._best_speedup(b)
            if best is None or best[1] < 1.0:
                return OFF
            return self._greedy(b, spec)
        return self._greedy(b)

    # ------------------------------------------------------------ break-even gate
    def _spec_arms(self, b: int) -> list[Strategy]:
        return [a for a in self.arms[b] if not a.is_off]

    def _gated(self, b: int) -> bool:
        return self.break_even and self.policy != "fixed" and bool(self._spec_arms(b))

    def plain_seconds(self, batch_size: int) -> Optional[float]:
        """Median plain step time at ``batch_size`` measured in this run, over at least
        ``MIN_PLAIN`` steps where the bucket has them: with fewer at that batch size,
        the nearest batch sizes of the same bucket add theirs (None: no plain data)."""
        b = self.bucket_of(batch_size)
        near = sorted((s for s in self._plain if self._plain[s] and self.bucket_of(s) == b),
                      key=lambda x: (abs(x - batch_size), x))
        times: list[float] = []
        for s in near:
            times.extend(self._plain[s])
            if len(times) >= MIN_PLAIN:
                break
        return statistics.median(times) if times else None

    def _plain_count(self, b: int) -> int:
        return sum(len(d) for s, d in self._plain.items() if self.bucket_of(s) == b)

    def expected_tokens(self, arm: Strategy) -> Optional[float]:
        """Tokens per sequence a step of chain ``arm`` is expected to emit: 1 + the
        acceptance profile summed over its depth (positions never drafted yet take the
        deepest measured rate: an upper bound). None for trees and without a profile."""
        if not arm.is_chain or not self._reach:
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
        for a, d in self._reach:
            if d > 0:
                rate = min(rate, a / d)
            out.append(rate)
        return out

    def _speedup(self, b: int, arm: Strategy) -> Optional[float]:
        return self._gates[b].speedup(arm.name, self.expected_tokens(arm))

    def _best_speedup(self, b: int) -> Optional[tuple[Strategy, float]]:
        """The spec arm with the highest speedup estimate in bucket ``b`` and it, among
        the arms measured recently when there are any (a drafter that went stale shows
        first in the arm speculating now; the others' older estimates would hide it)."""
        gate, best = self._gates[b], None
        arms = [a for a in self._spec_arms(b) if a.name in gate.samples]
        fresh = [a for a in arms if gate.fresh(a.name)]
        for arm in fresh or arms:
            s = self._speedup(b, arm)
            if s is not None and (best is None or s > best[1]):
                best = (arm, s)
        return best

    def _gate_choose(self, b: int, batch_size: int) -> Decision:
        gate = self._gates[b]
        if self._plain_count(b) < MIN_PLAIN:  # measure plain decoding here first
            return Decision(b, OFF, True)
        best = self._best_speedup(b)
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
        if not pays and self._overall[1] > self.probe_budget * max(
                self._overall[0], horizon) / 2 ** gate.backoff:
            # probes are also bounded over all buckets together: a long tail enters
            # bucket after bucket, and each would otherwise probe on its own allowance
            return Decision(b, OFF, True)
        spec = self._spec_arms(b)
        if pays:
            every = PLAIN_REFRESH * (1 if best[1] < REFRESH_BELOW else 4)
            if gate.refresh_left > 0 or gate.since_plain >= every:
                return Decision(b, OFF, True, probe=True)  # re-measure plain decoding
            return Decision(b, self._paying_arm(b, spec, best[0]), False)
        # a probe where speculation looks worse: an arm not measured yet that could
        # still pay, else the one the estimate says comes closest
        arm = self._unmeasured(b, spec) or (best[0] if best else spec[0])
        return Decision(b, arm, False, probe=True)

    def _paying_arm(self, b: int, spec: list[Strategy], best: Strategy) -> Strategy:
        """The arm of a bucket where speculation pays. egreedy: an arm the gate has not
        measured yet that could still pay, else with probability ``epsilon`` a random
        arm, else the gate's best estimate: the acceptance profile is shared by the
        chains, so their estimates compare arms on the same text, where an arm's own
        tokens/s also reflects the stretch of text it happened to decode (an arm pulled
        on easy text keeps the lead). ucb1: the bandit over the spec arms."""
        if self.policy != "egreedy":
            return self._bandit(b, spec)
        untried = self._unmeasured(b, spec)
        if untried is not None:
            return untried
        if self._rng.random() < self.epsilon:
            return self._rng.choice(spec)
        return best

    def _unmeasured(self, b: int, spec: list[Strategy]) -> Optional[Strategy]:
        """The first arm the gate has not measured in bucket ``b`` that could still pay."""
        gate = self._gates[b]
        return next((a for a in spec if a.name not in gate.samples
                     and self._could_pay(b, a)), None)

    def _could_pay(self, b: int, arm: Strategy) -> bool:
        """For an arm not measured in bucket ``b``: False when a measured shallower
        chain bounds it below break-even (a deeper chain costs at least as much, and
        the acceptance profile's expectation for it is an upper bound)."""
        tokens = self.expected_tokens(arm)
        if tokens is None:
            return True
        gate = self._gates[b]
        for other in self._spec_arms(b):
            got = gate.samples.get(other.name)
            if got and other.is_chain and other.depth <= arm.depth:
                if tokens / statistics.median(x[1] for x in got) < 1.0:
                    return False
        return True

    def probe_affordable(self, batch_size: int, positions: int) -> bool:
        """Whether the probe just chosen may pay the drafter's catch-up over
        ``positions`` missed positions: its estimated cost (seconds per position, as
        measured by earlier catch-ups; the tuner's first catch-up is let through to
        measure it) must fit in what is left of the bucket's probe allowance, or in what
        the bucket saved of it since its last probe. A probe late in long responses
        would otherwise cost far more than the budget (the whole history of every row
        goes through the drafter); one that costs more than a window's allowance waits
        until it is saved up (at the budget's rate, backed off like the allowance), so
        a drafter that lost once is still re-tried. Speculation that pays, and anything
        that is not a probe, is always affordable (its catch-up is an investment)."""
        d = self.last_decision
        if d is None or not d.probe or d.strategy.is_off or positions <= 0 \
                or not self._gated(d.bucket):
            return True
        if self._catchup is None:  # the tuner's first catch-up: it measures the next ones
            return True
        gate = self._gates[d.bucket]
        _, allowance = self._allowance(gate, batch_size, pays=False)
        return positions * self._catchup <= max(allowance - gate.lost, gate.saved)

    def _allowance(self, gate: _Gate, batch_size: int, pays: bool) -> tuple[float, float]:
        """(horizon, allowance): the bucket's recent decode time, at least MIN_HORIZON
        plain steps' worth, and the share of it speculation may lose (backing off while
        it does not pay)."""
        horizon = max(gate.elapsed, MIN_HORIZON * (self.plain_seconds(batch_size) or 0.0))
        return horizon, self.probe_budget * horizon / (1 if pays else 2 ** gate.backoff)

    def decline_probe(self) -> Strategy:
        """Turn the probe just chosen into a declined (plain) step; returns ``0_0_0``."""
        d = self.last_decision
        self.last_decision = Decision(d.bucket if d is not None else 0, OFF, True)
        return OFF

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """A plain step the tuner did not choose (above the speculation threshold): its
        time is kept, as the break-even reference at that batch size, and counts in the
        decode time the probe budget is a share of."""
        if self.break_even and seconds > 0 and math.isfinite(seconds):
            self._plain.setdefault(batch_size, deque(maxlen=PLAIN_KEEP)).append(float(seconds))
            self._tick(seconds)

    def _tick(self, seconds: float) -> None:
        decay = 1.0 - 1.0 / self.budget_horizon
        self._overall[0] = self._overall[0] * decay + seconds
        self._overall[1] *= decay

    def _charge(self, gate: _Gate, seconds: float) -> None:
        """Add ``seconds`` lost (negative: won) to the bucket's and the overall account,
        neither below zero."""
        gate.lost = max(0.0, gate.lost + seconds)
        self._overall[1] = max(0.0, self._overall[1] + seconds)

    def _record_acceptance(self, strategy: Strategy, accepted: Sequence[int]) -> None:
        decay = (1.0 - 1.0 / ACCEPT_HORIZON) ** len(accepted)
        for row in self._reach:
            row[0] *= decay
            row[1] *= decay
        while len(self._reach) < strategy.depth:
            self._reach.append([0.0, 0.0])
        for a in accepted:
            for j in range(strategy.depth):
                self._reach[j][1] += 1.0
                if a > j:
                    self._reach[j][0] += 1.0

    def _gate_update(self, batch_size: int, b: int, strategy: Strategy,
                     tokens: float, seconds: float, switch: float = 0.0) -> None:
        gate = self._gates[b]
        d = self.last_decision
        probe = d is not None and d.probe and d.bucket == b and d.strategy == strategy
        self.last_decision = None  # a decision is charged once
        ref = self.plain_seconds(batch_size)  # plain reference before this sample
        per_row = tokens / batch_size
        suspect = gate.refresh_left > 0  # re-measuring a reference found off
        if strategy.is_off:
            self._plain.setdefault(batch_size, deque(maxlen=PLAIN_KEEP)).append(float(seconds))
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
                    window = gate.samples[strategy.name] = deque(maxlen=self.gate_window)
                window.append((per_row, seconds / ref, gate.steps))
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
        best = self._best_speedup(b)
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
            tokens = per_row if expected is None else expected
            self._charge(gate, seconds - tokens * ref)
        if best is not None and best[1] >= 1.0:
            gate.backoff = 0  # (a catch-up before speculation that pays is an investment)
            return
        self._charge(gate, switch)  # a probe that found speculation losing: its catch-up
        if probe and best is not None and (
                best[1] < CLEAR_LOSS or len(gate.samples.get(best[0].name, ())) >= MIN_EVIDENCE):
            gate.backoff = min(gate.backoff + 1, MAX_BACKOFF)

    # ---------------------------------------------------------------- updates
    def update(self, batch_size: int, strategy: Strategy, accepted_tokens: int,
               seconds: float, accepted_drafts: Optional[Sequence[int]] = None,
               switch_seconds: float = 0.0, switch_positions: int = 0) -> None:
        """Record ``accepted_tokens / seconds`` for ``strategy`` in the batch's bucket.

        ``accepted_drafts``: per sequence, how many of its draft tokens were accepted (a
        chain step's; it feeds the break-even gate's acceptance profile).
        ``switch_seconds``: the drafter's catch-up before this step (positions it missed
        while the rows decoded plainly), not in ``seconds``: the gate charges it to a
        probe that finds speculation losing, and to nothing else; with
        ``switch_positions`` (the positions it fed) it also updates the per-position
        catch-up cost ``probe_affordable`` estimates with.

        Steps with ``seconds <= 0`` (or a non-finite reward) are ignored entirely.
        """
        if not isinstance(strategy, Strategy):
            raise ValueError(f"strategy must be a Strategy, got {strategy!r}")
        if isinstance(accepted_tokens, bool) or not isinstance(accepted_tokens, (int, float)) \
                or not accepted_tokens >= 0:
            raise ValueError(f"accepted_tokens must be a number >= 0, got {accepted_tokens!r}")
        b = self.bucket_of(batch_size)
        if not seconds > 0:
            return
        reward = accepted_tokens / seconds
        if not math.isfinite(reward):
            return
        name = strategy.name
        window = self._windows[b].get(name)
        if window is None:
            window = self._windows[b][name] = deque(maxlen=self.window)
        window.append(float(reward))
        self._pulls[b][name] = self._pulls[b].get(name, 0) + 1
        if switch_positions > 0 and switch_seconds > 0 and math.isfinite(switch_seconds):
            per = float(switch_seconds) / int(switch_positions)
            self._catchup = per if self._catchup is None else 0.7 * self._catchup + 0.3 * per
        if self._gated(b):
            if accepted_drafts is not None and strategy.is_chain and not strategy.is_off:
                self._record_acceptance(strategy, accepted_drafts)
            self._gate_update(batch_size, b, strategy, accepted_tokens, seconds,
                              max(0.0, float(switch_seconds)))

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """JSON-able ``{"policy", "buckets": {label: {arm: {"pulls", "median_reward"}}}}``.

        Every listed arm appears (0 pulls if untried), plus any other recorded strategy.
        """
        buckets = {}
        for b in range(len(self.buckets)):
            names = [a.name for a in self.arms[b]]
            names += sorted(n for n in self._pulls[b] if n not in names)
            buckets[self.bucket_label(b)] = {
                n: {"pulls": self._pulls[b].get(n, 0),
                    "median_reward": _median(self._windows[b].get(n, ()))}
                for n in names}
        out = {"policy": self.policy, "buckets": buckets}
        if self.break_even and self.policy != "fixed":
            out["gate"] = self.gate_stats()
        return out

    def gate_stats(self) -> dict:
        """The break-even gate per bucket that has data, JSON-able: ``plain_tok_s``
        (plain decoding, tokens/s per sequence, median step), the best arm, its speedup
        estimate over plain and its rate, every measured arm's estimate, whether the
        bucket speculates now, lifetime ``steps`` / ``declined`` / ``probes`` and
        ``probe_loss`` (the decayed share of decode time probes lost)."""
        out = {}
        for b in range(len(self.buckets)):
            gate = self._gates[b]
            times = [t for s, d in self._plain.items() if self.bucket_of(s) == b for t in d]
            if not gate.steps and not times:
                continue
            plain = 1.0 / statistics.median(times) if times else None
            best = self._best_speedup(b)
            out[self.bucket_label(b)] = {
                "steps": gate.steps, "declined": gate.declined, "probes": gate.probes,
                "plain_tok_s": plain,
                "arm": best[0].name if best else None,
                "arm_speedup": best[1] if best else None,
                "arm_tok_s": best[1] * plain if best and plain else None,
                "speculating": bool(best and best[1] >= 1.0),
                "probe_loss": gate.lost / gate.elapsed if gate.elapsed > 0 else 0.0,
                "arms": {a.name: self._speedup(b, a) for a in self._spec_arms(b)
                         if a.name in gate.samples},
            }
        return out

    # ------------------------------------------------------------------ state
    def _config(self) -> dict:
        return {
            "buckets": list(self.buckets),
            "arms": [[a.name for a in self.arms[b]] for b in range(len(self.buckets))],
            "policy": self.policy,
            "epsilon": self.epsilon,
            "window": self.window,
            "ucb_c": self.ucb_c,
            "fixed": self.fixed.name if self.fixed is not None else None,
            "seed": self.seed,
            "break_even": self.break_even,
            "probe_budget": self.probe_budget,
            "gate_window": self.gate_window,
            "budget_horizon": self.budget_horizon,
        }

    def state_dict(self) -> dict:
        """JSON-able config, reward windows, pull counts and RNG state."""
        version, internal, gauss_next = self._rng.getstate()
        return {
            "version": STATE_VERSION,
            "config": self._config(),
            "windows": [{n: list(w) for n, w in per.items()} for per in self._windows],
            "pulls": [dict(per) for per in self._pulls],
            "rng": [version, list(internal), gauss_next],
            "gate": {"plain": {str(s): list(d) for s, d in sorted(self._plain.items())},
                     "buckets": [g.state() for g in self._gates],
                     "reach": [list(r) for r in self._reach],
                     "overall": list(self._overall), "catchup": self._catchup},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore windows, pulls, RNG and break-even gate state from ``state_dict()``.

        Buckets and arms must match this tuner's; policy, epsilon, window, ucb_c and the
        gate's settings stay as configured here (a smaller window keeps the most recent
        rewards). A version-1 state (before the gate) loads with an empty gate.
        """
        if not isinstance(state, dict):
            raise ValueError(f"tuner state must be a dict, got {type(state).__name__}")
        if state.get("version") not in (1, STATE_VERSION):
            raise ValueError(f"unsupported tuner state version {state.get('version')!r}, "
                             f"expected {STATE_VERSION} (or 1)")
        try:
            config, windows, pulls, rng = (state["config"], state["windows"],
                                           state["pulls"], state["rng"])
        except KeyError as e:
            raise ValueError(f"tuner state is missing key {e.args[0]!r}") from None
        mine = self._config()
        if config.get("buckets") != mine["buckets"]:
            raise ValueError(f"tuner state has buckets {config.get('buckets')}, this tuner "
                             f"has {mine['buckets']}")
        if config.get("arms") != mine["arms"]:
            raise ValueError(f"tuner state has arms {config.get('arms')}, this tuner has "
                             f"{mine['arms']}")
        n = len(self.buckets)
        if len(windows) != n or len(pulls) != n:
            raise ValueError(f"tuner state has {len(windows)} windows and {len(pulls)} "
                             f"pull tables, expected {n} (one per bucket)")
        try:
            rng_state = (int(rng[0]), tuple(int(x) for x in rng[1]),
                         None if rng[2] is None else float(rng[2]))
            new_rng = random.Random()
            new_rng.setstate(rng_state)
        except (TypeError, ValueError, IndexError) as e:
            raise ValueError(f"tuner state has an invalid RNG state: {e}") from None
        plain: dict[int, deque[float]] = {}
        gates = [_Gate(self.gate_window) for _ in range(n)]
        reach: list[list[float]] = []
        overall = [0.0, 0.0]
        catchup = None
        if "gate" in state:
            try:
                g = state["gate"]
                plain = {int(s): deque((float(t) for t in d), maxlen=PLAIN_KEEP)
                         for s, d in g["plain"].items()}
                reach = [[float(a), float(d)] for a, d in g["reach"]]
                overall = [float(x) for x in g["overall"]]
                catchup = None if g.get("catchup") is None else float(g["catchup"])
                if len(g["buckets"]) != n:
                    raise ValueError(f"{len(g['buckets'])} buckets, expected {n}")
                for gate, gs in zip(gates, g["buckets"]):
                    gate.load(gs)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"tuner state has an invalid gate state: {e!r}") from None
        self._windows = [{name: deque((float(r) for r in rewards), maxlen=self.window)
                          for name, rewards in per.items()} for per in windows]
        self._pulls = [{name: int(c) for name, c in per.items()} for per in pulls]
        self._rng = new_rng
        self._plain, self._gates, self._reach, self._overall = plain, gates, reach, overall
        self._catchup = catchup
        self.last_decision = None

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write ``state_dict()`` as JSON atomically (``fileio.atomic_write``)."""
        with atomic_write(path) as f:
            json.dump(self.state_dict(), f)

    @classmethod
    def load(cls, path: Union[str, os.PathLike]) -> StrategyTuner:
        """Build a tuner from a file written by ``save`` and restore its state."""
        with open(path) as f:
            state = json.load(f)
        try:
            config = state["config"]
            tuner = cls(
                config["buckets"],
                {i: [Strategy.parse(n) for n in names]
                 for i, names in enumerate(config["arms"])},
                policy=config["policy"], epsilon=config["epsilon"],
                window=config["window"], ucb_c=config["ucb_c"],
                fixed=Strategy.parse(config["fixed"]) if config["fixed"] else None,
                seed=config["seed"], break_even=config.get("break_even", False),
                probe_budget=config.get("probe_budget", 0.01),
                gate_window=config.get("gate_window", 12),
                budget_horizon=config.get("budget_horizon", 200))
        except (KeyError, TypeError) as e:
            raise ValueError(f"tuner file {os.fspath(path)!r} has an invalid config: "
                             f"{e!r}") from None
        tuner.load_state_dict(state)
        return tuner
