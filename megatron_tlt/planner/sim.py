"""A discrete-event simulator of synchronous RL steps (GRPO with TLT rollouts).

One step: every rollout engine decodes its share of the step's responses with
continuous batching (up to ``max_batch_size`` rows; a finished row's place goes to the
next queued prompt, as ``RolloutEngine._run`` does), scores them, and waits at the step
barrier for the slowest; then the log-prob forwards and the update run on every DP
replica together. With TLT, each decode step at a running batch of at most
``threshold`` rows speculates with the arm of its bucket that the break-even gate
would pick: the arm with the best expected tokens per sequence over relative step
time, speculating only where that reaches ``PAYS_FROM`` (the gate's rule in
``rollout/speculative/gate.py``), else decoding plainly and charging at most
``probe_budget`` of the bucket's decode time to probes. Idle DP replicas train the
drafter (the drafter group): the tokens they train on move the acceptance along the
measured alpha-against-tokens curve for the next step.

Events are the rows' finishes. All rows of an engine advance together (one token per
plain step, the expected accept length per speculative step), so an engine's state is
one progress counter and a heap of finish points: a step of a 64-GPU layout takes
milliseconds. Lengths are drawn from a generator seeded by (seed, step): the same
inputs give the same prediction, and the arms compared (no TLT, TLT, frozen drafter)
see the same responses.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace
from typing import Optional

import numpy as np

from .inputs import (Acceptance, DrafterGroup, LengthModel, StepCost, TrainCost,
                     accept_length)

PAYS_FROM = 1.05  # rollout/speculative/gate.py: a bucket starts speculating here


@dataclass(frozen=True)
class Layout:
    """TP x PP x DP. With the gathered PP rollout (``rollout.pipeline_mode=gathered``)
    each pipeline rank of a replica decodes a share of the replica's prompts on a
    gathered copy of the whole model, so a replica is ``pp`` engines of ``tp`` GPUs."""

    tp: int = 1
    pp: int = 1
    dp: int = 1
    gathered: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def engines_per_replica(self) -> int:
        return self.pp if (self.gathered and self.pp > 1) else 1


@dataclass(frozen=True)
class EngineSettings:
    """The rollout engine's scheduling and the speculation settings that matter here."""

    max_batch_size: int = 64
    threshold: int = 16
    buckets: tuple = (1, 2, 4, 8, 16, 32)
    arms: tuple = ((1, (6, 7, 8)), (2, (4, 5, 6)), (4, (3, 4, 5)), (8, (2, 3, 4)),
                   (10 ** 9, (1, 2)))  # (upper bound of the batch sizes, chain depths)
    probe_budget: float = 0.01
    share_prefill: bool = True  # rollout.share_prefill: a GRPO group's prompt once
    # rollout.kv_cache=paged: the engine's KV budget in positions (0: slots, every row
    # reserves its capacity and max_batch_size alone bounds the rows); a row is
    # admitted while the tokens held (a group's prompt once, each row's written
    # tokens, half a block of rounding) leave room for it (planner/paged.py)
    kv_tokens: float = 0.0
    kv_block: int = 16

    def depths(self, b: int) -> tuple:
        for bound, depths in self.arms:
            if b <= bound:
                return depths
        return ()

    def per_rank(self, ep: int) -> "EngineSettings":
        """At expert parallelism ``ep`` the EP group decodes its ``ep`` ranks' requests
        as one batch (``rollout/expert_call.py``): in rows of one rank (the simulator's
        engine), the batch bound, the threshold and the buckets' bounds are the group's
        divided by ``ep``."""
        if ep <= 1:
            return self
        per = lambda n: n if n >= 10 ** 9 else max(1, n // ep)  # noqa: E731
        return replace(self, max_batch_size=per(self.max_batch_size),
                       threshold=per(self.threshold), kv_tokens=self.kv_tokens / ep,
                       buckets=tuple(per(b) for b in self.buckets),
                       arms=tuple((per(bound), d) for bound, d in self.arms))

    @classmethod
    def from_config(cls, rollout) -> "EngineSettings":
        """From a ``RolloutConfig`` (tree arms count by their depth)."""
        from ..spec_strategy import parse_arms

        s = rollout.speculative
        table = parse_arms(s.arms, s.buckets)
        bounds = [int(b) for b in str(s.buckets).split(",")]
        arms = tuple((bound, tuple(sorted({a.depth for a in table.get(i, []) if a.depth})))
                     for i, bound in enumerate(bounds))
        return cls(rollout.max_batch_size, s.threshold, tuple(bounds), arms,
                   s.probe_budget, bool(rollout.share_prefill),
                   kv_block=int(getattr(rollout, "kv_block_size", 16)))


@dataclass
class Scenario:
    """Everything one prediction needs."""

    layout: Layout
    prompts_per_step: int
    group_size: int
    prompt_tokens: float
    lengths: LengthModel
    cost: StepCost
    train: TrainCost
    engine: EngineSettings = field(default_factory=EngineSettings)
    acceptance: Optional[Acceptance] = None  # None: no drafter, no speculation
    drafter: DrafterGroup = field(default_factory=DrafterGroup)
    steps: int = 4
    seed: int = 0
    minibatches: int = 1


@dataclass
class EngineRun:
    finish: float = 0.0
    decode: float = 0.0
    spec_seconds: float = 0.0
    probe_seconds: float = 0.0
    tokens: float = 0.0
    spec_tokens: float = 0.0
    steps: float = 0.0
    spec_steps: float = 0.0
    accepted: float = 0.0  # tokens per sequence-step summed over speculative steps


def _decide(cost: StepCost, eng: EngineSettings, alpha: Optional[list], b: int,
            ctx: float, acc: Optional[Acceptance] = None) -> tuple[int, float, float]:
    """(depth, tokens per row per step, step time relative to a plain step) the gate
    settles on at batch ``b``; depth 0 = plain. Where speculation does not pay the
    relative time includes the probe allowance (the gate's bound on what probing may
    lose)."""
    if alpha is None or b > eng.threshold:
        return 0, 1.0, 1.0
    if acc is not None:
        alpha = acc.for_batch(alpha, b)  # acceptance by bucket
    plain = cost.plain(b, ctx)
    best = (0, 1.0, 1.0, 0.0)
    for k in eng.depths(b):
        tok = accept_length(alpha, k)
        rel = cost.spec(b, k, ctx) / plain
        if tok / rel > best[3]:
            best = (k, tok, rel, tok / rel)
    if best[0] and best[3] >= PAYS_FROM:
        return best[0], best[1], best[2]
    return 0, 1.0, 1.0 + eng.probe_budget


def run_engine(lengths: np.ndarray, prompt_tokens: float, cost: StepCost,
               eng: EngineSettings, alpha: Optional[list],
               decisions: Optional[dict] = None,
               acc: Optional[Acceptance] = None, alone: Optional[StepCost] = None,
               alone_after: float = math.inf, group: int = 1) -> EngineRun:
    """Continuous batching of ``lengths`` (in queue order) on one engine;
    ``decisions`` caches the gate's choices for this cost and alpha; ``acc`` adds its
    acceptance-by-bucket factors. ``alone``: the plain step costs once the engine has
    the machine to itself, from time ``alone_after`` on (replicas sharing a machine:
    the others finished; the gate's decisions stay those of ``cost``). ``group``:
    consecutive requests sharing a prompt (a GRPO group); with
    ``eng.share_prefill`` a prompt is prefilled once while any of its rows runs, as
    the engine does, else every request is."""
    out = EngineRun()
    queue = list(lengths)
    qi, progress, t = 0, 0.0, 0.0
    # (progress at which the row ends, at entry, its prompt)
    heap: list[tuple[float, float, int]] = []
    running: dict[int, int] = {}  # prompt -> its running rows
    entered = 0.0  # sum over running rows of the progress at their entry
    decisions = {} if decisions is None else decisions
    share = eng.share_prefill and group > 1
    while qi < len(queue) or heap:
        if qi < len(queue) and len(heap) < eng.max_batch_size:
            n = min(eng.max_batch_size - len(heap), len(queue) - qi)
            if eng.kv_tokens > 0:
                n = _paged_admits(eng, running, len(heap) * progress - entered, len(heap),
                                  qi, n, group if share else 1, prompt_tokens)
            prompts = [i // group if share else i for i in range(qi, qi + n)]
            fresh = len({p for p in prompts if not running.get(p)})
            t += cost.prefill(fresh * prompt_tokens)
            # the prefill samples each row's first token
            for length, p in zip(queue[qi:qi + n], prompts):
                heapq.heappush(heap, (progress + float(length) - 1.0, progress, p))
                running[p] = running.get(p, 0) + 1
                entered += progress
            out.tokens += n
            qi += n
        b = len(heap)
        target = heap[0][0]
        delta = target - progress
        if delta > 0:
            # resident context at mid-segment: prompts + tokens generated so far
            ctx_mid = b * (prompt_tokens + progress + delta / 2) - entered
            key = (b, int(ctx_mid / b) // 256)  # decisions move slowly with context
            dec = decisions.get(key)
            if dec is None:
                dec = decisions[key] = _decide(cost, eng, alpha, b, ctx_mid, acc)
            k, tok, rel = dec
            steps = delta / tok
            dt = steps * rel * cost.plain(b, ctx_mid)
            if alone is not None and t + dt > alone_after:
                # the part of the segment after the others finished runs alone
                before = max(0.0, alone_after - t)
                dt = before + (dt - before) * alone.plain(b, ctx_mid) / cost.plain(b, ctx_mid)
            t += dt
            out.decode += dt
            out.steps += steps
            out.tokens += delta * b
            if k:
                out.spec_seconds += dt
                out.spec_tokens += delta * b
                out.spec_steps += steps
                out.accepted += steps * tok
            elif alpha is not None and b <= eng.threshold:
                out.probe_seconds += dt * eng.probe_budget / (1 + eng.probe_budget)
            progress = target
        while heap and heap[0][0] <= progress + 1e-9:
            _, at, p = heapq.heappop(heap)
            entered -= at
            running[p] -= 1
    out.finish = t
    return out


def _paged_admits(eng: EngineSettings, running: dict, written: float, rows: int,
                  qi: int, n: int, group: int, prompt_tokens: float) -> int:
    """How many of the next ``n`` queued requests (from ``qi``) a paged engine admits:
    while the tokens held (each running prompt once, the rows' ``written`` tokens,
    half a block per row) leave room for the request's prompt (when not running yet)
    and a block; at least one when nothing runs."""
    live = {p for p, c in running.items() if c}
    held = written + len(live) * prompt_tokens + rows * eng.kv_block / 2
    k = 0
    while k < n:
        p = (qi + k) // group
        need = (0.0 if p in live else prompt_tokens) + eng.kv_block
        if held + need > eng.kv_tokens and (rows + k) > 0:
            break
        held += need - eng.kv_block / 2
        live.add(p)
        k += 1
    return k


@dataclass
class StepResult:
    step: float
    rollout: float
    logprob: float
    update: float
    replica_finish: list
    idle_replica_seconds: float
    idle_gpu_seconds: float
    decode_tokens: float
    spec_tokens: float
    spec_seconds: float
    decode_seconds: float
    accept_len: Optional[float]
    drafter_tokens: float
    alpha: Optional[list]


def simulate_step(sc: Scenario, step: int, alpha: Optional[list],
                  lengths: np.ndarray, decisions: Optional[dict] = None) -> StepResult:
    """One synchronous RL step with acceptance ``alpha`` (None: no speculation) on the
    response lengths ``lengths`` (prompt-major: prompt p's group is
    lengths[p*G:(p+1)*G])."""
    lay, g = sc.layout, sc.group_size
    p_total = sc.prompts_per_step
    # prompt p -> mini-batch p % M, replica (p // M) % DP (docs/trainer.md, Layout)
    per_replica: list[list[int]] = [[] for _ in range(lay.dp)]
    for p in range(p_total):
        per_replica[(p // sc.minibatches) % lay.dp].append(p)
    decisions = {} if decisions is None else decisions
    finishes, runs, tokens_rep, cells_rep, generated = [], [], [], [], []
    for prompts in per_replica:
        eng_prompts = [prompts[i::lay.engines_per_replica]
                       for i in range(lay.engines_per_replica)]
        fin, toks, cells = 0.0, 0.0, 0.0
        for ep in eng_prompts:
            lens = np.concatenate([lengths[p * g:(p + 1) * g] for p in ep]) if ep else \
                np.zeros(0)
            r = run_engine(lens, sc.prompt_tokens, sc.cost, sc.engine, alpha, decisions,
                           sc.acceptance, group=g)
            r.finish += sc.train.reward_per_sample * len(lens)
            runs.append(r)
            fin = max(fin, r.finish)
            toks += float(lens.sum()) + len(lens) * sc.prompt_tokens
            cells += float(((lens + sc.prompt_tokens) ** 2).sum())
        finishes.append(fin)
        tokens_rep.append(toks)
        cells_rep.append(cells)
        generated.append(float(sum(lengths[p * g:(p + 1) * g].sum() for p in prompts)))
    rollout = max(finishes)
    idle = [rollout - f for f in finishes]
    tr = sc.train
    logprob = max(tokens_rep) * tr.logprob_per_token
    update = sc.minibatches * tr.update_fixed + max(
        t * tr.update_per_token + c * tr.update_per_cell for t, c in zip(tokens_rep, cells_rep)) \
        + (tr.first_step_extra if step == 0 else 0.0)
    trained = 0.0
    if alpha is not None and sc.drafter.enable and lay.dp > 1:
        # the curve counts distinct tokens: a replica adds at most its own new responses
        trained = sum(min(i * sc.drafter.tokens_per_second, sc.drafter.max_tokens_per_window,
                          new) for i, new in zip(idle, generated))
    spec_tok = sum(r.spec_tokens for r in runs)
    spec_steps = sum(r.spec_steps for r in runs)
    return StepResult(
        step=rollout + logprob + update, rollout=rollout, logprob=logprob, update=update,
        replica_finish=finishes, idle_replica_seconds=sum(idle),
        idle_gpu_seconds=sum(idle) * lay.tp * lay.pp,
        decode_tokens=sum(r.tokens for r in runs), spec_tokens=spec_tok,
        spec_seconds=sum(r.spec_seconds for r in runs),
        decode_seconds=sum(r.decode for r in runs),
        accept_len=(sum(r.accepted for r in runs) / spec_steps) if spec_steps else None,
        drafter_tokens=trained, alpha=alpha)


def draw_lengths(sc: Scenario, step: int) -> np.ndarray:
    rng = np.random.default_rng([sc.seed, step])
    return sc.lengths.draw(sc.prompts_per_step * sc.group_size, rng)


@dataclass
class ArmResult:
    """An arm (no TLT / TLT / frozen drafter) over ``steps`` steps."""

    steps: list

    def mean(self, name: str) -> float:
        vals = [getattr(s, name) for s in self.steps]
        vals = [v for v in vals if v is not None]
        return float(np.mean(vals)) if vals else float("nan")

    @property
    def step(self) -> float:
        return self.mean("step")

    @property
    def rollout_fraction(self) -> float:
        return float(np.mean([s.rollout / s.step for s in self.steps]))

    @property
    def spec_share(self) -> float:
        tok = sum(s.decode_tokens for s in self.steps)
        return sum(s.spec_tokens for s in self.steps) / tok if tok else 0.0


def simulate_arm(sc: Scenario, arm: str) -> ArmResult:
    """``arm``: "off" (no speculation), "tlt" (speculation + the drafter group moving
    the acceptance along its curve), "frozen" (speculation, the drafter never trained
    after its warm-up)."""
    out = []
    trained = sc.drafter.tokens_trained0
    caches: dict = {}  # per alpha vector, the gate's decisions
    for step in range(sc.steps):
        lengths = draw_lengths(sc, step)
        alpha = None
        if arm != "off" and sc.acceptance is not None:
            alpha = sc.acceptance.at(trained, step, frozen=(arm == "frozen"))
        key = None if alpha is None else tuple(round(a, 4) for a in alpha)
        res = simulate_step(sc, step, alpha, lengths, caches.setdefault(key, {}))
        if arm == "tlt" and not (sc.acceptance and sc.acceptance.drift_online):
            trained += res.drafter_tokens  # (measured drift data replaces the curve)
        out.append(res)
    return ArmResult(out)


def with_sensitivity(sc: Scenario, accept: float = 1.0, bandwidth: float = 1.0) -> Scenario:
    """``accept`` multiplies every alpha; ``bandwidth`` divides the decode step times
    (on a memory-bound step, time ~ 1 / bandwidth)."""
    acc = sc.acceptance.scaled(accept) if sc.acceptance is not None else None
    return replace(sc, acceptance=acc, cost=sc.cost.scaled(1.0 / bandwidth))
