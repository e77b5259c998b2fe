"""What the model-free drafter kinds accept and cost on GRPO rollouts
(``tools/bench_free_kinds.py``).

``measure(engine, kind, prompts, group, sp, strategy=..., threshold=..., calls=...)``
attaches a fresh drafter of ``kind`` (``prompt_lookup``, ``group_history``) with one
fixed strategy, then generates ``calls`` GRPO rollouts of the same prompts (``group``
responses each, in one call, as the trainer's rollout; the second call drafts from the
first's responses too, as an epoch's second pass would): decode steps at or below
``threshold`` running rows (the tail) speculate. Per call: the acceptance length
(tokens emitted per row per speculative step), tokens per speculative step, the share
of rows that had a draft at all, and the proposer's host time (its lookups and index
updates: ``row_proposals`` and ``finished``, timed around the calls) per speculative
step and per row, next to the median speculative step time.
"""

from __future__ import annotations

import statistics
import time
from typing import Sequence

from ..config import SpeculativeConfig
from ..rollout.sampling import SamplingParams
from ..rollout.speculative.drafters import make_drafter

__all__ = ["measure", "measure_beside"]


def _timed(obj, name: str, into: list) -> None:
    """Wrap ``obj.name`` so its host seconds add to ``into[0]``."""
    inner = getattr(obj, name)

    def call(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            into[0] += time.perf_counter() - t0
    setattr(obj, name, call)


def measure(engine, kind: str, prompts: Sequence[list[int]], group: int,
            sp: SamplingParams, *, strategy: str, threshold: int, calls: int = 2) -> dict:
    """The acceptance and host cost of ``kind`` (module docstring); ``engine`` is left
    without a drafter."""
    sc = SpeculativeConfig(policy="fixed", strategy=strategy, threshold=threshold)
    old = engine.config.speculative
    engine.config.speculative = sc
    drafter = make_drafter(kind, arch=engine.arch, dtype=engine.runner.dtype,
                           device=engine.device, sc=sc)
    engine.attach_drafter(drafter)
    host, had = [0.0], [0, 0]  # seconds; rows with a proposal, rows
    _timed(engine.spec, "finished", host)
    inner = engine.spec.row_proposals

    def row_proposals(rows, strategy):
        t0 = time.perf_counter()
        out = inner(rows, strategy)
        host[0] += time.perf_counter() - t0
        had[0] += sum(1 for p in out if p)
        had[1] += len(out)
        return out
    engine.spec.row_proposals = row_proposals
    reqs = [p for p in prompts for _ in range(group)]
    out = []
    try:
        for c in range(calls):
            host[0], had[:] = 0.0, [0, 0]
            t0 = time.perf_counter()
            engine.generate(reqs, SamplingParams(**{**sp.__dict__, "seed": sp.seed + c}))
            wall = time.perf_counter() - t0
            st = engine.last_stats
            s = st.spec.summary()
            spec_steps = [t for t, on in zip(st.step_seconds, st.step_speculative) if on]
            steps, rows = s["steps"], s["rows"]
            out.append({
                "call": c, "wall_seconds": wall, "decode_steps": len(st.step_seconds),
                "spec_steps": steps, "spec_rows": rows, "emitted": s["emitted"],
                "accept_len": s["accept_len"],
                "tokens_per_spec_step": s["emitted"] / steps if steps else 0.0,
                "rows_with_draft": had[0] / had[1] if had[1] else 0.0,
                "host_ms_per_spec_step": 1e3 * host[0] / steps if steps else 0.0,
                "host_us_per_row": 1e6 * host[0] / rows if rows else 0.0,
                "spec_step_ms_median": 1e3 * statistics.median(spec_steps)
                if spec_steps else 0.0,
            })
    finally:
        engine.detach_drafter()
        engine.config.speculative = old
    return {"kind": kind, "strategy": strategy, "threshold": threshold, "calls": out}


def measure_beside(engine, drafter: str, free: Sequence[str], prompts: Sequence[list[int]],
                   group: int, sp: SamplingParams, *, threshold: int, alone: bool,
                   calls: int = 2, costs=None) -> dict:
    """The free kinds ``free`` beside the model kind ``drafter`` (a config value: the
    demo's drafter checkpoint, ``random``, ``self``) as a run configures them
    (``rollout.speculative.free_too``; the break-even gate, modelled costs calibrated
    or read from the machine's table), with ``free_alone`` = ``alone``: per call the
    tail's decode steps (``threshold`` running rows or fewer), how many speculated and
    how many as free kinds alone, and the tail's tokens by proposing kind ("plain": the
    rows of its plain steps) and per tail step. ``costs``: a step-cost table
    (``StepCosts``) to charge instead of calibrating (side-by-side arms share one, so
    their gates decide from the same costs: the counts are then a function of the
    seeds); the result's ``step_costs`` holds the one used. ``engine`` is left without
    a drafter."""
    import dataclasses

    from ..rollout.speculative import calibrate, drafters

    sc = dataclasses.replace(SpeculativeConfig(), drafter=drafter, free_too=",".join(free),
                             threshold=threshold, free_alone=alone)
    old = engine.config.speculative
    engine.config.speculative = sc
    engine.attach_drafters(drafters.configured(sc, arch=engine.arch,
                                               dtype=engine.runner.dtype,
                                               device=engine.device))
    if costs is None:
        costs = calibrate.calibrate(engine)
    calibrate.apply(engine, costs)
    reqs = [p for p in prompts for _ in range(group)]
    # the kinds' tuner's alone steps so far (a single kind's tuner takes none)
    alone_steps = lambda: sum(getattr(engine.tuner, "alone_steps", {}).values())  # noqa: E731
    out = []
    try:
        for c in range(calls):
            alone_before = alone_steps()
            engine.generate(reqs, SamplingParams(**{**sp.__dict__, "seed": sp.seed + c}))
            st = engine.last_stats
            s = st.spec.summary()
            tail = [(b, on) for b, on in zip(st.batch_sizes, st.step_speculative)
                    if b <= threshold]
            by_kind = {k: v["proposed_emitted"] for k, v in s["kinds"].items()
                       if v["proposed_emitted"]}
            by_kind["plain"] = sum(b for b, on in tail if not on)
            n = len(tail)
            out.append({
                "call": c, "tail_steps": n, "spec_steps": s["steps"],
                "alone_steps": alone_steps() - alone_before,
                "tail_tokens_by_kind": by_kind,
                "tokens_per_tail_step": sum(by_kind.values()) / n if n else 0.0,
                "tokens_per_tail_step_by_kind": {k: v / n for k, v in by_kind.items()}
                if n else {},
                "accept_len": s["accept_len"], "decode_seconds": st.decode_seconds,
                "tail_seconds": sum(t for b, t in zip(st.batch_sizes, st.step_seconds)
                                    if b <= threshold),
            })
    finally:
        engine.detach_drafter()
        engine.config.speculative = old
    return {"drafter": drafter, "free": list(free), "alone": alone,
            "threshold": threshold, "calls": out, "step_costs": costs.to_dict()}
