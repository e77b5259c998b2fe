"""The synthetic long-tail workload and response-length statistics of the benchmarks.

RL rollouts for reasoning models are slow because of their length distribution:
most responses stop early, a few run to the token cap, and a synchronous batch
waits for the slowest one. The benchmarks (rollout engine, speculative decoding,
RL step) need that shape reproducibly:

* real prompts come from ``megatron_tlt.tasks.reasoning_gym_prompts`` (driving
  SmolLM2-135M-Instruct with them gives a real long tail; docs/benchmarks.md, "The
  long-tail workload", has the measurements);
* ``synthetic_workload`` -- random prompt ids plus a target response length drawn
  from a log-normal distribution. Generating exactly ``target_len`` tokens per
  request (EOS ignored) reproduces a long tail with any model, even a random one,
  which is what unit tests and model-free benchmarks want.

``length_stats`` summarises a list of response lengths the same way for both, and
``format_length_stats`` prints it on one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

__all__ = ["WorkloadError", "SyntheticRequest", "synthetic_workload", "length_stats",
           "format_length_stats"]


class WorkloadError(ValueError):
    """Bad workload arguments (bad size, lengths or statistics input); says what is valid."""


@dataclass(frozen=True)
class SyntheticRequest:
    """A model-free request: random prompt ids and the response length to generate.

    Drive an engine with ``max_new_tokens=target_len`` and EOS ignored.
    """

    token_ids: list[int]
    target_len: int


def synthetic_workload(
    n: int,
    *,
    vocab_size: int,
    prompt_len: tuple[int, int] = (4, 16),
    median_len: float = 32,
    sigma: float = 1.0,
    max_len: int = 256,
    seed: int = 0,
    exclude_ids: Iterable[int] = (),
) -> list[SyntheticRequest]:
    """``n`` requests with log-normal target lengths, deterministic per ``seed``.

    Target lengths are ``round(median_len * exp(sigma * z))`` with standard normal
    ``z``, clipped to ``[1, max_len]``: the median is ``median_len`` and the tail
    grows with ``sigma`` (1.0 puts about 10 % of requests above 3.6x the median).
    Prompt lengths are uniform in ``prompt_len`` (inclusive); prompt ids are
    uniform over ``[1, vocab_size)`` minus ``exclude_ids`` (id 0 is never used:
    it is padding or a special token in most vocabularies; pass BOS/EOS/pad ids
    to ``exclude_ids``).

    Lengths and prompts come from separate random streams, so changing the
    prompt settings does not change the target lengths, and vice versa.

    Raises:
        WorkloadError (a ValueError) on out-of-range arguments.
    """
    _check_int("n", n, minimum=1)
    _check_int("vocab_size", vocab_size, minimum=2)
    _check_int("max_len", max_len, minimum=1)
    _check_int("seed", seed, minimum=0)
    if len(prompt_len) != 2:
        raise WorkloadError(f"prompt_len must be a (min, max) pair, got {prompt_len!r}")
    lo, hi = prompt_len
    _check_int("prompt_len[0]", lo, minimum=1)
    _check_int("prompt_len[1]", hi, minimum=lo)
    if not median_len > 0 or median_len > max_len:
        raise WorkloadError(f"median_len must be in (0, max_len={max_len}], got {median_len!r}")
    if not sigma >= 0:
        raise WorkloadError(f"sigma must be >= 0, got {sigma!r}")
    excluded = np.asarray(sorted(set(int(i) for i in exclude_ids)), dtype=np.int64)
    allowed = np.setdiff1d(np.arange(1, vocab_size, dtype=np.int64), excluded)
    if allowed.size == 0:
        raise WorkloadError(f"no token ids left in [1, {vocab_size}) after excluding {excluded.tolist()}")

    length_seq, prompt_seq = np.random.SeedSequence(seed).spawn(2)
    z = np.random.default_rng(length_seq).standard_normal(n)
    targets = np.clip(np.rint(median_len * np.exp(sigma * z)), 1, max_len).astype(np.int64)

    prompt_rng = np.random.default_rng(prompt_seq)
    prompt_lens = prompt_rng.integers(lo, hi + 1, size=n)
    return [
        SyntheticRequest(
            token_ids=allowed[prompt_rng.integers(0, allowed.size, size=int(length))].tolist(),
            target_len=int(target),
        )
        for length, target in zip(prompt_lens, targets)
    ]


def _check_int(name: str, value: Any, minimum: int) -> None:
    """Raise WorkloadError unless ``value`` is an int (not bool) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise WorkloadError(f"{name} must be an integer >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------- statistics


def length_stats(lengths: Sequence[int], cap: int | None = None) -> dict[str, float | int | None]:
    """Summary of response lengths.

    Returns a dict with ``n``, ``min``, ``mean``, ``median``, ``p90`` (linear
    interpolation between order statistics, numpy's default), ``max``,
    ``max_over_median`` (the tail ratio: how much longer the slowest request of a
    synchronous batch is than the typical one) and ``frac_at_cap`` (share of
    lengths ``>= cap``, i.e. truncated; None when ``cap`` is None).

    Raises:
        WorkloadError (a ValueError): empty input, negative lengths, ``cap < 1``.
    """
    values = np.asarray(list(lengths), dtype=np.float64)
    if values.size == 0:
        raise WorkloadError("length_stats needs at least one length")
    if values.ndim != 1 or (values < 0).any():
        raise WorkloadError("lengths must be a flat sequence of non-negative numbers")
    if cap is not None and cap < 1:
        raise WorkloadError(f"cap must be >= 1 or None, got {cap!r}")
    median = float(np.median(values))
    maximum = float(values.max())
    return {
        "n": int(values.size),
        "min": float(values.min()),
        "mean": float(values.mean()),
        "median": median,
        "p90": float(np.percentile(values, 90)),
        "max": maximum,
        "max_over_median": maximum / median if median > 0 else float("inf"),
        "frac_at_cap": None if cap is None else float((values >= cap).mean()),
    }


def format_length_stats(stats: dict[str, float | int | None], cap: int | None = None) -> str:
    """One line for logs: ``n=16  min 35  median 94  p90 256  max 256 ...``."""
    line = (
        f"n={stats['n']}  min {stats['min']:g}  median {stats['median']:g}  "
        f"p90 {stats['p90']:g}  max {stats['max']:g}  mean {stats['mean']:.1f}  "
        f"max/median {stats['max_over_median']:.2f}"
    )
    if stats.get("frac_at_cap") is not None:
        at_cap = round(stats["frac_at_cap"] * stats["n"])
        line += f"  at cap{f' {cap}' if cap else ''}: {at_cap}/{stats['n']} ({stats['frac_at_cap']:.0%})"
    return line
