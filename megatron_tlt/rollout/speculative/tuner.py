"""Speculative-decoding strategy tuner (BEG-MAB): a bucketed bandit (``bandit.py``)
plus the break-even gate (``gate.py``).

The running batch size changes during a rollout (long-tail requests finish at
different times), and the best drafting strategy depends on it: deep trees pay off
at batch 1, short chains at larger batches. The tuner splits batch sizes into
buckets (``spec_strategy.parse_buckets``) and decides each decode step's strategy in
the batch's bucket: the bandit's arm (policies ``egreedy`` / ``ucb1``), or always one
strategy (``fixed``; rewards are still recorded for metrics). With the break-even gate
(``break_even=True``; not under ``fixed``) every bucket may decline to speculate.

The protocol is two calls per decode step, with no state carried between them:

    decision = tuner.decide(batch_size, pending)   # pending: drafter positions missed
    ... run decision.strategy (0_0_0: a plain step) ...
    tuner.record(decision, Outcome(batch_size, tokens, seconds, ...))

Buckets are ascending upper bounds: bucket ``i`` covers batch sizes
``(bound[i-1], bound[i]]``, and the last bucket also takes every larger batch. The
state (``state_dict``, ``save``) holds the bandit's RNG, so a saved and reloaded tuner
makes the same further choices.

Costs (``costs``): ``modelled`` (the default) charges every step its modelled cost
(``step_costs.KindCosts``: measured once, frozen, part of the state), so the decisions
follow the run's state and a seed reproduces them; ``measured`` charges the step's
wall-clock time (adapts to the machine as it runs, but two runs, or a run and its
resume, decide differently).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Union

from ...fileio import atomic_write
from ...spec_strategy import (OFF, POLICIES, Strategy, bucket_label, bucket_of,
                              check_unique, is_int, parse_arms, parse_buckets)
from .bandit import Bandit
from .decision import Decision, Outcome
from .gate import MIN_PLAIN, BreakEvenGate
from .step_costs import UNCALIBRATED, KindCosts

COSTS = ("modelled", "measured")

STATE_VERSION = 2  # 2: break-even gate state (version 1 states load with an empty gate)


class StrategyTuner:
    """Per-bucket bandit over drafting strategies, rewarded by accepted tokens per
    second (modelled or measured, ``costs``),
    with an optional break-even gate that declines speculation where it loses.

    Settings come validated from ``RolloutSpecConfig`` (``from_config``); a tuner built
    directly checks only what the config cannot: that ``arms`` fits ``buckets``."""

    def __init__(self, buckets: Union[str, list[int]], arms: dict[int, list[Strategy]], *,
                 policy: str = "egreedy", epsilon: float = 0.1, window: int = 50,
                 ucb_c: float = 1.0, fixed: Optional[Strategy] = None,
                 seed: int = 0, break_even: bool = False, probe_budget: float = 0.01,
                 gate_window: int = 12, budget_horizon: int = 200,
                 costs: str = "measured") -> None:
        self.buckets = parse_buckets(buckets)
        if costs not in COSTS:
            raise ValueError(f"costs must be one of {COSTS}, got {costs!r}")
        self.costs_mode = costs
        self.costs: Optional[KindCosts] = None  # the modelled costs (set before deciding)
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if policy == "fixed" and not isinstance(fixed, Strategy):
            raise ValueError(f"policy 'fixed' needs a fixed strategy (fixed=Strategy(...)), "
                             f"got {fixed!r}")
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
            check_unique(arm_list, f"bucket {self.bucket_label(i)}")
            self.arms[i] = arm_list
        self.policy = policy
        self.fixed = fixed
        self.seed = seed
        self.break_even = bool(break_even)
        self.bandit = Bandit(n, policy=policy, epsilon=epsilon, window=window, ucb_c=ucb_c,
                             seed=seed)
        self.gate = BreakEvenGate(self.buckets, probe_budget=probe_budget,
                                  window=gate_window, budget_horizon=budget_horizon)

    @classmethod
    def from_config(cls, sc) -> StrategyTuner:
        """The tuner ``rollout.speculative`` (a ``RolloutSpecConfig``) describes: loaded
        from ``tuner_state`` when that file exists, else fresh."""
        if sc.tuner_state and os.path.isfile(sc.tuner_state):
            return cls.load(sc.tuner_state)
        return cls(sc.buckets, parse_arms(sc.arms, sc.buckets), policy=sc.policy,
                   epsilon=sc.epsilon, window=sc.window, ucb_c=sc.ucb_c,
                   fixed=Strategy.parse(sc.strategy), seed=sc.seed,
                   break_even=sc.break_even, probe_budget=sc.probe_budget,
                   costs=sc.costs)

    # settings kept by the bandit and the gate, readable here
    epsilon = property(lambda self: self.bandit.epsilon)
    window = property(lambda self: self.bandit.window)
    ucb_c = property(lambda self: self.bandit.ucb_c)
    probe_budget = property(lambda self: self.gate.probe_budget)
    gate_window = property(lambda self: self.gate.window)
    budget_horizon = property(lambda self: self.gate.budget_horizon)

    # ----------------------------------------------------------------- buckets
    def bucket_of(self, batch_size: int) -> int:
        """Index of the bucket holding ``batch_size`` (larger than all bounds -> last)."""
        if not is_int(batch_size) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        return bucket_of(self.buckets, batch_size)

    def bucket_label(self, index: int) -> str:
        """``"1"``, ``"3-4"``, ...; the last bucket is ``"{lo}+"``."""
        if not is_int(index) or not 0 <= index < len(self.buckets):
            raise ValueError(f"bucket index must be in [0, {len(self.buckets) - 1}], "
                             f"got {index!r}")
        return bucket_label(self.buckets, index)

    def all_arms(self) -> list[Strategy]:
        """Every strategy this tuner may decide (the fixed one included)."""
        arms = [a for bucket in self.arms.values() for a in bucket]
        return arms + ([self.fixed] if self.fixed is not None else [])

    def _spec_arms(self, b: int) -> list[Strategy]:
        return [a for a in self.arms[b] if not a.is_off]

    def _gated(self, b: int) -> bool:
        return self.break_even and self.policy != "fixed" and bool(self._spec_arms(b))

    # --------------------------------------------------------------- deciding
    def decide(self, batch_size: int, pending: int = 0) -> Decision:
        """The strategy of the next decode step at this running batch size (``0_0_0``:
        a plain step). ``pending``: the drafter positions the rows missed (decoded
        plainly, or since their prefill), which a speculative step feeds first: a
        gate's probe whose catch-up would not fit its budget runs plain instead."""
        b = self.bucket_of(batch_size)
        if self.policy == "fixed":
            return Decision(b, self.fixed, False)  # type: ignore[arg-type]
        if not self._gated(b):
            arm = self.bandit.choose(b, self.arms[b])
            return Decision(b, arm, arm.is_off)
        spec = self._spec_arms(b)
        d = self.gate.decide(b, batch_size, spec, lambda best: self._paying_arm(b, spec, best))
        if d.probe and not d.strategy.is_off and not self.gate.affordable(b, batch_size,
                                                                          pending):
            return Decision(b, OFF, True)  # a probe whose catch-up exceeds the budget
        return d

    def _paying_arm(self, b: int, spec: list[Strategy], best: Strategy) -> Strategy:
        """The arm of a bucket where speculation pays. egreedy: an arm the gate has not
        measured yet that could still pay, else with probability ``epsilon`` a random
        arm, else the gate's best estimate: the acceptance profile is shared by the
        chains, so their estimates compare arms on the same text, where an arm's own
        tokens/s also reflects the stretch of text it happened to decode (an arm pulled
        on easy text keeps the lead). ucb1: the bandit over the spec arms."""
        if self.policy != "egreedy":
            return self.bandit.choose(b, spec)
        untried = self.gate.unmeasured(b, spec)
        if untried is not None:
            return untried
        if self.bandit.rng.random() < self.bandit.epsilon:
            return self.bandit.rng.choice(spec)
        return best

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
            best = self.gate.best_speedup(b, spec)
            if best is None or best[1] < 1.0:
                return OFF
            return self.bandit.greedy(b, spec)
        return self.bandit.greedy(b, self.arms[b])

    # what a step another kind's proposals replace asks (``multi.KindDecoder.alone``)
    def chain_arms(self, batch_size: int) -> list[Strategy]:
        """The bucket's speculative chain arms."""
        return [a for a in self._spec_arms(self.bucket_of(batch_size)) if a.is_chain]

    def has_reference(self, batch_size: int) -> bool:
        """Whether the bucket's plain reference is measured (the gate's first
        ``MIN_PLAIN`` plain steps there; always without the gate): a step it declines
        may then run as another kind's, and counts for it as a plain step of the
        reference's time."""
        b = self.bucket_of(batch_size)
        return not self._gated(b) or self.gate.plain_count(b) >= MIN_PLAIN

    def relative_cost(self, batch_size: int, arm: Strategy) -> float:
        """A step of ``arm`` over a plain step at ``batch_size``: the modelled costs
        (``costs=modelled``), else the gate's measured median in the bucket, else
        ``step_costs.UNCALIBRATED`` per verified token."""
        if self.costs is not None:
            return (self.costs.spec_seconds(batch_size, arm)
                    / self.costs.plain_seconds(batch_size))
        got = self.gate.relative(self.bucket_of(batch_size), arm)
        return got if got is not None else 1.0 + UNCALIBRATED * arm.verify_tokens

    # the gate's estimates, for reports and tests
    def plain_seconds(self, batch_size: int) -> Optional[float]:
        """Median plain step time at ``batch_size`` (``BreakEvenGate.plain_seconds``)."""
        return self.gate.plain_seconds(batch_size)

    def expected_tokens(self, arm: Strategy) -> Optional[float]:
        return self.gate.expected_tokens(arm)

    def acceptance_profile(self) -> list[float]:
        return self.gate.acceptance_profile()

    def record_acceptance(self, strategy: Strategy, accepted) -> None:
        """Per row, the drafts accepted of a step's chain proposals this kind made
        (several kinds in one step: ``multi.KindTuner``): its acceptance profile."""
        if strategy.is_chain and not strategy.is_off:
            self.gate.record_acceptance(strategy, accepted)

    # ---------------------------------------------------------------- recording
    @property
    def needs_costs(self) -> bool:
        """Whether this tuner charges modelled costs and has none yet (``calibrate``)."""
        return self.costs_mode == "modelled" and self.costs is None

    def _charged(self, decision: Decision, o: Outcome) -> Outcome:
        """``o`` with its modelled seconds (``costs=modelled``): the step's cost at its
        batch size and strategy, the catch-up's at its positions. Until costs are set
        (an engine nobody calibrated: ``calibrate.ensure_costs``) the measured ones."""
        c = self.costs
        if self.costs_mode != "modelled" or c is None:
            return o
        return Outcome(o.batch_size, o.tokens, c.spec_seconds(o.batch_size, decision.strategy),
                       o.accepted_drafts, c.catchup_seconds(o.switch_positions),
                       o.switch_positions)

    def record(self, decision: Decision, outcome: Outcome) -> None:
        """Record what the step ``decision`` decided measured: ``outcome.tokens /
        outcome.seconds`` rewards its strategy in its bucket, and the gate learns from
        the step (see ``Outcome``). The drafter's catch-up (``switch_seconds``) is not
        in ``seconds``: the gate charges it to a probe that finds speculation losing,
        and to nothing else. Steps with ``seconds <= 0`` (or a non-finite reward) are
        ignored entirely."""
        o, strategy = self._charged(decision, outcome), decision.strategy
        if isinstance(o.tokens, bool) or not isinstance(o.tokens, (int, float)) \
                or not o.tokens >= 0:
            raise ValueError(f"Outcome.tokens must be a number >= 0, got {o.tokens!r}")
        b = self.bucket_of(o.batch_size)
        if not o.seconds > 0:
            return
        reward = o.tokens / o.seconds
        if not math.isfinite(reward):
            return
        self.bandit.record(b, strategy, reward)
        self.gate.record_catchup(o.switch_seconds, o.switch_positions)
        if self._gated(b):
            if o.accepted_drafts is not None and strategy.is_chain and not strategy.is_off:
                self.gate.record_acceptance(strategy, o.accepted_drafts)
            self.gate.record(b, self._spec_arms(b), decision, o.batch_size, o.tokens,
                             o.seconds, max(0.0, float(o.switch_seconds)))

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        """A plain step the tuner did not decide (above the speculation threshold): its
        time is kept, as the break-even reference at that batch size, and counts in the
        decode time the probe budget is a share of."""
        if self.break_even:
            if self.costs_mode == "modelled" and self.costs is not None:
                seconds = self.costs.plain_seconds(batch_size)
            self.gate.observe_plain(batch_size, seconds)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        """JSON-able ``{"policy", "buckets": {label: {arm: {"pulls", "median_reward"}}}}``.

        Every listed arm appears (0 pulls if untried), plus any other recorded strategy.
        """
        buckets = {self.bucket_label(b): self.bandit.bucket_stats(b, [a.name for a in self.arms[b]])
                   for b in range(len(self.buckets))}
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
            got = self.gate.stats(b, self._spec_arms(b))
            if got is not None:
                out[self.bucket_label(b)] = got
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
            "costs": self.costs_mode,
        }

    def state_dict(self) -> dict:
        """JSON-able config, reward windows, pull counts, RNG state and gate state."""
        out = {"version": STATE_VERSION, "config": self._config(), **self.bandit.state(),
               "gate": self.gate.state()}
        if self.costs is not None:
            out["step_costs"] = self.costs.to_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        """Restore windows, pulls, RNG and break-even gate state from ``state_dict()``.

        Buckets and arms must match this tuner's; policy, epsilon, window, ucb_c and the
        gate's settings stay as configured here (a smaller window keeps the most recent
        rewards). A version-1 state (before the gate) loads with an empty gate. The
        modelled step costs it holds are restored (a resume charges what the
        uninterrupted run charged).
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
        bandit = Bandit(n, policy=self.policy, epsilon=self.epsilon, window=self.window,
                        ucb_c=self.ucb_c, seed=self.seed)
        bandit.load(windows, pulls, rng)
        gate = BreakEvenGate(self.buckets, probe_budget=self.probe_budget,
                             window=self.gate_window, budget_horizon=self.budget_horizon)
        if "gate" in state:
            gate.load(state["gate"])
        costs = (KindCosts.from_dict(state["step_costs"]) if "step_costs" in state
                 else self.costs)
        self.bandit, self.gate, self.costs = bandit, gate, costs

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
                budget_horizon=config.get("budget_horizon", 200),
                costs=config.get("costs", "measured"))
        except (KeyError, TypeError) as e:
            raise ValueError(f"tuner file {os.fspath(path)!r} has an invalid config: "
                             f"{e!r}") from None
        tuner.load_state_dict(state)
        return tuner
