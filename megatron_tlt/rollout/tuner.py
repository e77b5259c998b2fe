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
import tempfile
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

POLICIES = ("egreedy", "ucb1", "fixed")
STATE_VERSION = 1


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
    """Per-bucket bandit over drafting strategies, rewarded by accepted tokens/second."""

    def __init__(self, buckets: Union[str, list[int]], arms: dict[int, list[Strategy]], *,
                 policy: str = "egreedy", epsilon: float = 0.1, window: int = 50,
                 ucb_c: float = 1.0, fixed: Optional[Strategy] = None,
                 seed: int = 0) -> None:
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
        self._rng = random.Random(seed)
        # Per bucket, keyed by strategy name: recent rewards and total update counts.
        self._windows: list[dict[str, deque[float]]] = [{} for _ in range(n)]
        self._pulls: list[dict[str, int]] = [{} for _ in range(n)]

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

    def _greedy(self, b: int) -> Strategy:
        best, best_median = self.arms[b][0], None
        for arm in self.arms[b]:
            m = self._median_of(b, arm)
            if m is not None and (best_median is None or m > best_median):
                best, best_median = arm, m
        return best

    def _untried(self, b: int) -> Optional[Strategy]:
        for arm in self.arms[b]:
            if self._pulls_of(b, arm) == 0:
                return arm
        return None

    def _ucb(self, b: int) -> Strategy:
        arms = self.arms[b]
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

    def choose(self, batch_size: int) -> Strategy:
        """Strategy for the next speculative step at this running batch size."""
        b = self.bucket_of(batch_size)
        if self.policy == "fixed":
            return self.fixed  # type: ignore[return-value]
        untried = self._untried(b)
        if untried is not None:
            return untried
        if self.policy == "ucb1":
            return self._ucb(b)
        if self._rng.random() < self.epsilon:
            return self._rng.choice(self.arms[b])
        return self._greedy(b)

    def best(self, batch_size: int) -> Strategy:
        """Arm with the highest median reward in the bucket, no exploration.

        Untried arms are skipped; with no data at all the first listed arm is returned.
        Under policy ``fixed`` this is the fixed strategy.
        """
        b = self.bucket_of(batch_size)
        if self.policy == "fixed":
            return self.fixed  # type: ignore[return-value]
        return self._greedy(b)

    # ---------------------------------------------------------------- updates
    def update(self, batch_size: int, strategy: Strategy, accepted_tokens: int,
               seconds: float) -> None:
        """Record ``accepted_tokens / seconds`` for ``strategy`` in the batch's bucket.

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
        return {"policy": self.policy, "buckets": buckets}

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
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore windows, pulls and RNG state from ``state_dict()``.

        Buckets and arms must match this tuner's; policy, epsilon, window and ucb_c stay
        as configured here (a smaller window keeps the most recent rewards).
        """
        if not isinstance(state, dict):
            raise ValueError(f"tuner state must be a dict, got {type(state).__name__}")
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported tuner state version {state.get('version')!r}, "
                             f"expected {STATE_VERSION}")
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
        self._windows = [{name: deque((float(r) for r in rewards), maxlen=self.window)
                          for name, rewards in per.items()} for per in windows]
        self._pulls = [{name: int(c) for name, c in per.items()} for per in pulls]
        self._rng = new_rng

    def save(self, path: Union[str, os.PathLike]) -> None:
        """Write ``state_dict()`` as JSON atomically (temporary file + ``os.replace``)."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        fd, tmp = tempfile.mkstemp(prefix=".tuner-", suffix=".json.tmp", dir=directory)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(self.state_dict(), f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise

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
                seed=config["seed"])
        except (KeyError, TypeError) as e:
            raise ValueError(f"tuner file {os.fspath(path)!r} has an invalid config: "
                             f"{e!r}") from None
        tuner.load_state_dict(state)
        return tuner
