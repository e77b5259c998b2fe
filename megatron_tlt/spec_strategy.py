"""Speculative-decoding strategies and the grammar of the ``rollout.speculative``
settings: a strategy ``depth_topk_verify`` (``Strategy``), batch-size bucket bounds
(``parse_buckets``), arms per bucket (``parse_arms``) and the tuner policies.

A neutral module: ``config/`` validates the settings with it and the rollout
package's speculation (``rollout/speculative/``) builds its tuner from it, so the
grammar is declared once and imports nothing of either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Optional, Union

POLICIES = ("egreedy", "ucb1", "fixed")  # rollout.speculative.policy


def is_int(value: Any) -> bool:
    """An int that is not a bool."""
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
            if not is_int(value):
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
            if not is_int(b):
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


def bucket_label(buckets: list[int], index: int) -> str:
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
    check_unique(arms, f"arms entry {entry!r}")
    return arms


def check_unique(arms: list[Strategy], where: str) -> None:
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
                raise ValueError(f"bucket {bounds[i]} ({bucket_label(bounds, i)}) is given arms "
                                 f"twice in arms spec {text!r}")
            arms[i] = list(strategies)
    missing = [i for i in range(len(bounds)) if i not in arms]
    if missing and default is None:
        labels = ", ".join(bucket_label(bounds, i) for i in missing)
        raise ValueError(f"no arms for bucket(s) {labels} (bounds {bounds}); list them "
                         f"or add a default '*:...' entry")
    for i in missing:
        arms[i] = list(default)
    return {i: arms[i] for i in range(len(bounds))}



def bucket_of(buckets: list[int], batch_size: int) -> int:
    """Index of the bucket of ``buckets`` (ascending upper bounds) holding
    ``batch_size``; a batch larger than every bound goes to the last bucket."""
    for i, bound in enumerate(buckets):
        if batch_size <= bound:
            return i
    return len(buckets) - 1
