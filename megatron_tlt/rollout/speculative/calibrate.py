"""The step-cost table of ``rollout.speculative.costs=modelled``, measured once.

``calibrate(engine)`` times decode steps on synthetic prompts (greedy, EOS ignored: no
random stream is read, so the run's sampling is untouched) through the engine's own
``generate``, with a scheduling tuner in place of the real one: at each calibrated
batch size (each bucket's upper bound up to the speculation threshold and the
engine's rows) and for each of the bucket's speculative arms of each drafter kind,
plain and speculative steps alternate (every speculative step then catches the
drafter up on the plain step's positions, timed apart); what the kinds draft from
(``Drafter.drafting_state``: group_history's responses) is put back as it was, so the
synthetic responses never reach a run's drafts. The medians give
``step_costs.KindCosts`` per kind; the ranks that decode together agree on their rank
0's (``engine.tp_times``, the same schedule on every rank gives the same shape).

``ensure_costs(engine)`` gives every kind's tuner its costs before the first call:
from the table file (``rollout.speculative.step_costs``), else calibrated and written
there (``auto``: calibrated, kept in memory). The RL trainer does this over all ranks
(``rl/spec_costs.py``; there ``auto`` is one file per model, drafter kinds, arms and
machine in the asset cache), so every replica charges rank 0's table. An engine
nobody calibrated charges measured times (``StrategyTuner._charged``).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch

from ... import collectives
from ...assets import default_cache_dir
from ...spec_strategy import OFF, Strategy, bucket_of
from ..sampling import SamplingParams
from .decision import Decision, Outcome
from .step_costs import KindCosts, StepCosts

PROMPT_TOKENS = 8  # synthetic prompt length
MAX_NEW = 24  # tokens per calibration request at most (the engine's memory may allow less)
REPEATS = 3  # speculative steps per (batch size, arm) wanted
MAX_CALLS = 4  # calls per (batch size, arm) at most (rows finish as drafts are accepted)


def kind_tuners(tuner) -> dict:
    """The ``StrategyTuner`` of each drafter kind (a ``KindTuner``'s, or the one)."""
    if tuner is None:
        return {}
    return dict(getattr(tuner, "tuners", None) or {"": tuner})


def needs_costs(tuner) -> bool:
    return any(t.needs_costs for t in kind_tuners(tuner).values())


class _Schedule:
    """The tuner interface the controller drives, deciding a fixed schedule: plain and
    ``arm`` alternately (plain only for ``arm`` None), recording the measured times."""

    break_even = False

    def __init__(self, real, arm: Optional[Strategy], samples: dict, engine_tuner) -> None:
        self.real, self.arm, self.samples = real, arm, samples
        self.engine_tuner = engine_tuner  # every kind's arms: the caches' draft slack
        self.plain_next = True

    def bucket_label(self, index: int) -> str:
        return self.real.bucket_label(index)

    def all_arms(self) -> list[Strategy]:
        return self.engine_tuner.all_arms()

    def decide(self, batch_size: int, pending: int = 0) -> Decision:
        s = OFF if self.plain_next or self.arm is None else self.arm
        self.plain_next = not self.plain_next
        return Decision(bucket_of(self.real.buckets, batch_size), s, s.is_off)

    def record(self, decision: Decision, o: Outcome) -> None:
        if decision.strategy.is_off:
            self.samples["plain"][o.batch_size].append(o.seconds)
            return
        self.samples[decision.strategy.name][o.batch_size].append(o.seconds)
        if o.switch_positions > 0 and o.switch_seconds > 0:
            self.samples["catchup"][0].append(o.switch_seconds / o.switch_positions)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        self.samples["plain"][batch_size].append(seconds)

    def gate_stats(self) -> dict:
        return {}

    def save(self, path) -> None:
        pass


def _sizes(engine, tuner) -> list[int]:
    """Batch sizes calibrated: each bucket's upper bound capped by the speculation
    threshold and the engine's rows (distinct, ascending)."""
    cap = min(engine.config.speculative.threshold, engine.config.max_batch_size)
    if getattr(engine.memory, "fixed", False):
        cap = min(cap, engine.memory.rows)
    return sorted({min(b, cap) for b in tuner.buckets})


def _prompts(n: int, vocab: int) -> list[list[int]]:
    return [[(97 * i + 31 * j + 11) % vocab for j in range(PROMPT_TOKENS)] for i in range(n)]


def _fit(samples: dict) -> KindCosts:
    plain = {b: statistics.median(v) for b, v in samples["plain"].items() if v}
    base = KindCosts(plain)
    relative = {}
    for name, per in samples.items():
        if name in ("plain", "catchup"):
            continue
        relative[name] = {b: statistics.median(v) / base.plain_seconds(b)
                          for b, v in per.items() if v}
    catch = samples["catchup"][0]
    return KindCosts(plain, relative, statistics.median(catch) if catch else 0.0)


def calibrate(engine) -> StepCosts:
    """Measure every drafter kind's step costs on ``engine`` (see the module docstring);
    every rank that decodes with this one must call it too."""
    real = engine.tuner
    tuners = kind_tuners(real)
    vocab = int(engine.arch.vocab_size)
    mem = engine.memory
    new = min(MAX_NEW, mem.max_new_tokens) if getattr(mem, "fixed", False) else MAX_NEW
    plen = min(PROMPT_TOKENS, mem.max_prompt_tokens) if getattr(mem, "fixed", False) \
        else PROMPT_TOKENS
    ep = engine.runner.ep_group
    lead = ep is None or collectives.rank(ep) == 0  # the EP group decodes one union
    kinds = {}
    drafting = {name: s for name, d in engine.drafters.items()
                if (s := d.drafting_state()) is not None}
    try:
        with torch.random.fork_rng(devices=[]):
            for kind, tuner in tuners.items():
                if kind:
                    real.active = kind  # the kind decoder steps with this kind
                samples = defaultdict(lambda: defaultdict(list))
                for size in _sizes(engine, tuner):
                    b = tuner.bucket_of(size)
                    arms = [a for a in tuner.arms[b] if not a.is_off] or [None]
                    for arm in arms:
                        name = arm.name if arm is not None else "plain"
                        for _ in range(MAX_CALLS):
                            if len(samples[name][size]) >= REPEATS:
                                break
                            engine.tuner = _Schedule(tuner, arm, samples, real)
                            prompts = [p[:plen] for p in _prompts(size, vocab)] if lead else []
                            engine.generate(prompts, SamplingParams(
                                temperature=0.0, max_new_tokens=new, ignore_eos=True))
                costs = _fit(samples)
                kinds[kind or engine.spec.active_kind()] = costs.from_flat(
                    engine.tp_times(*costs.flat()))
    finally:
        engine.tuner = real
        if hasattr(real, "active"):
            real.active = None
        for name, s in drafting.items():
            engine.drafters[name].load_drafting_state(s)
    return StepCosts(kinds, source=f"calibrated on {machine()}", key=costs_key(engine))


def machine() -> str:
    """The accelerator (CUDA) or CPU model and the torch threads: what a table is for."""
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} x1"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads"


def costs_key(engine) -> str:
    """A short hash of what the table depends on: the model's shape, the drafter kinds
    and their arms, the threshold, the layout's decode group and the machine."""
    sc = engine.config.speculative
    tuners = kind_tuners(engine.tuner)
    what = {"arch": repr(engine.arch), "kinds": sorted(engine.drafters),
            "arms": {k: t._config()["arms"] for k, t in tuners.items()},
            "buckets": sc.buckets, "threshold": sc.threshold,
            "max_batch": engine.config.max_batch_size, "dtype": str(engine.runner.dtype),
            "cpu_kernels": str(getattr(engine.config, "cpu_kernels", "")),
            "runner": type(engine.runner).__name__, "machine": machine()}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def table_path(engine, cache: bool = True) -> Optional[Path]:
    """``rollout.speculative.step_costs`` (``auto``: the asset cache's file for this
    engine's key with ``cache``, else None)."""
    given = engine.config.speculative.step_costs
    if given and given != "auto":
        return Path(given).expanduser()
    return default_cache_dir() / "step_costs" / f"{costs_key(engine)}.json" if cache \
        else None


def apply(engine, table: StepCosts) -> None:
    """Give every kind's tuner its costs from ``table``."""
    tuners = kind_tuners(engine.tuner)
    kinds = table.kinds
    for kind, tuner in tuners.items():
        name = kind or engine.spec.active_kind()
        if name not in kinds:
            raise ValueError(f"the step-cost table ({table.source}) has no costs for drafter "
                             f"kind {name!r} (it has {sorted(kinds)}); point "
                             "rollout.speculative.step_costs at another file, or delete it "
                             "to calibrate again")
        tuner.costs = kinds[name]


def ensure_costs(engine) -> Optional[StepCosts]:
    """Every kind's tuner given its costs, from the table file or calibrated (and
    written there, by global rank 0); None when none needed them."""
    if not needs_costs(engine.tuner):
        return None
    path = table_path(engine, cache=False)
    exists = path is not None and engine.tp_times(float(path.is_file()))[0] > 0
    if exists:  # (the decode group's rank 0 decides)
        table = StepCosts.load(path)
    else:
        table = calibrate(engine)
        if path is not None and collectives.rank() == 0:
            table.save(path)
    apply(engine, table)
    return table


__all__ = ["calibrate", "ensure_costs", "apply", "needs_costs", "kind_tuners",
           "table_path", "costs_key", "machine"]
