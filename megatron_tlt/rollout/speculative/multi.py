"""Several drafter kinds in one engine, the kind chosen per batch-size bucket (e.g. the
one-layer drafter, the self-drafter, and plainly decoding).

``RolloutEngine.attach_drafters({name: drafter, ...})`` with several kinds gives the
engine a ``KindDecoder`` (one ``SpeculativeDecoder`` per kind, their per-row state kept
in step) and a ``KindTuner`` (one ``StrategyTuner``, with its own bandit and break-even
gate, per kind). The controller sees one decoder and one tuner:

- ``KindTuner.decide`` picks the kind for the step from the kinds' gates in the bucket:
  a kind whose gate has no speedup estimate yet is tried first; after that, the kind
  with the best estimate, another one with probability ``epsilon`` (so a loser's
  estimate is re-measured now and then, as the gates' probes do for speculation
  itself); then that kind's tuner decides the arm (0_0_0 where its gate declines: plain
  decoding is the third choice). Plain steps' times reach every kind's gate.
- ``KindDecoder`` routes the step to the chosen kind's decoder; the others follow the
  rows: prefill, plain steps and row moves reach all of them, and after a speculative
  step of one kind a feature-fed drafter stores the target's hidden states of the
  accepted nodes (the self-drafter's cache just stays valid up to what it was fed).

- Free kinds (``Drafter.free``: lookups) propose per row over the step's kind
  (``KindDecoder.propose``), and where the bucket's kind is declined they speculate
  alone on the rows whose match pays, the others decoding plainly in the same
  verification (``KindDecoder.alone``, ``KindTuner.alone_gain``;
  ``rollout.speculative.free_alone``).

Drafters with EAGLE-3 feature layers are not supported here (their features come from
the verify forward's capture of the kind that drafted).
"""

from __future__ import annotations

import dataclasses
import random
from typing import Optional, Sequence

import torch

from ...spec_strategy import OFF, Strategy
from .decision import Decision, Outcome
from .gate import PAYS_FROM
from ..sampling import CoupledNoise
from .decoder import SpeculativeDecoder
from .model_free import host_trees, one_hot_q
from .proposer import Proposal
from .tuner import StrategyTuner

# a kind's acceptance rate per draft position before it was measured
PRIOR = 0.5


class KindTuner:
    """One ``StrategyTuner`` per drafter kind and the choice of kind per step."""

    def __init__(self, tuners: dict[str, StrategyTuner], *, epsilon: float = 0.1,
                 seed: int = 0, free: Sequence[str] = (), alone: bool = True):
        if not tuners:
            raise ValueError("KindTuner needs at least one kind")
        self.tuners = dict(tuners)
        # kinds whose proposals cost nothing (``Drafter.free``): offered per row over
        # the bucket's kind, chosen per bucket only when no other kind is attached
        self.free = [k for k in self.tuners if k in set(free)]
        self.row_kinds: Optional[list[str]] = None  # the last step's kind per row
        # where the bucket's kind is declined, free kinds speculate alone on the rows
        # whose match pays (``KindDecoder.alone``; ``rollout.speculative.free_alone``)
        self.alone_on = bool(alone)
        self.declined: Optional[Decision] = None  # the decision an alone step replaced
        self.drafted: Optional[list[int]] = None  # an alone step's draft length per row
        self.alone_steps: dict[str, int] = {}  # bucket label -> alone steps
        self.declining: Optional[str] = None  # the kind whose decision it replaced
        first = next(iter(self.tuners.values()))
        self.buckets = first.buckets
        self.epsilon = epsilon
        self.rng = random.Random(seed)
        self.active: Optional[str] = None  # the kind of the step being decided
        self.chosen: dict[str, dict[str, int]] = {}  # bucket label -> kind -> steps

    # the StrategyTuner interface the controller uses
    break_even = property(lambda self: any(t.break_even for t in self.tuners.values()))

    def bucket_of(self, batch_size: int) -> int:
        return next(iter(self.tuners.values())).bucket_of(batch_size)

    def bucket_label(self, index: int) -> str:
        return next(iter(self.tuners.values())).bucket_label(index)

    def all_arms(self) -> list[Strategy]:
        return [a for t in self.tuners.values() for a in t.all_arms()]

    def estimate(self, kind: str, batch_size: int) -> Optional[float]:
        """The kind's gate's best speedup estimate in the bucket (None: none yet)."""
        t = self.tuners[kind]
        b = t.bucket_of(batch_size)
        best = t.gate.best_speedup(b, t._spec_arms(b))
        return None if best is None else best[1]

    def choose_kind(self, batch_size: int) -> str:
        kinds = [k for k in self.tuners if k not in self.free] or list(self.tuners)
        est = {k: self.estimate(k, batch_size) for k in kinds}
        untried = [k for k in kinds if est[k] is None]
        if untried:
            return untried[0]
        best = max(kinds, key=lambda k: est[k])
        if len(kinds) > 1 and self.rng.random() < self.epsilon:
            return self.rng.choice([k for k in kinds if k != best])
        return best

    def decide(self, batch_size: int, pending: int = 0) -> Decision:
        kind = self.choose_kind(batch_size)
        self.active = kind
        d = self.tuners[kind].decide(batch_size, pending)
        label = self.bucket_label(d.bucket)
        per = self.chosen.setdefault(label, {})
        per[kind] = per.get(kind, 0) + 1
        return d

    def expected(self, kind: str, drafts: int) -> float:
        """Tokens a row is expected to emit from ``drafts`` draft tokens of ``kind``:
        1 + its acceptance profile summed over them (positions past the profile take
        its last rate; ``PRIOR`` per position before any measurement)."""
        prof = self.tuners[kind].acceptance_profile() or [PRIOR]
        return 1.0 + sum(prof[min(j, len(prof) - 1)] for j in range(drafts))

    def alone_gain(self, kinds: Sequence[Optional[str]], chains: Sequence[list],
                   batch_size: int, lead: str) -> Optional[tuple[float, Strategy]]:
        """The best chain arm for an alone step (``KindDecoder.alone``) of rows
        proposed by ``kinds`` (None: no match, plain) with ``chains``, and its speedup
        estimate: the rows' expected tokens (``expected``; 1 for a plain row) at the
        arm's depth over the batch's, divided by the arm's relative step cost for
        ``lead``, the kind proposing most rows (``StrategyTuner.relative_cost``).
        None: no arm."""
        best = None
        for arm in self.tuners[lead].chain_arms(batch_size):
            tokens = sum(1.0 if k is None else self.expected(k, min(len(c), arm.depth))
                         for k, c in zip(kinds, chains))
            speed = tokens / (batch_size
                              * self.tuners[lead].relative_cost(batch_size, arm))
            if best is None or speed > best[0]:
                best = (speed, arm)
        return best

    def start_alone(self, declined: Decision, kind: str, drafted: list[int]) -> None:
        """The step ``declined`` declined runs as an alone step of ``kind`` (the kind
        proposing most of its rows) with ``drafted`` draft tokens per row."""
        self.declined, self.drafted = declined, drafted
        self.declining = self.active
        label = self.bucket_label(declined.bucket)
        self.alone_steps[label] = self.alone_steps.get(label, 0) + 1
        self.active = kind

    def _record_alone(self, decision: Decision, outcome: Outcome) -> None:
        """An alone step: each free kind's acceptance profile learns from the rows it
        drafted (at their own lengths), the step kind's tuner records the step (its
        gate's sample in the bucket), and the kind that declined records its plain
        step at its reference time (so its gate's accounts and probes go on)."""
        declined, drafted, kinds = self.declined, self.drafted, self.row_kinds
        self.declined = self.drafted = self.row_kinds = None
        acc = outcome.accepted_drafts
        if acc is not None and kinds is not None and drafted is not None:
            by_len: dict[tuple[str, int], list[int]] = {}  # (kind, draft length) -> rows
            for a, k, n in zip(acc, kinds, drafted):
                if n:
                    by_len.setdefault((k, n), []).append(a)
            for (k, n), got in sorted(by_len.items()):
                self.tuners[k].record_acceptance(Strategy(n, 1, n), got)
        b = outcome.batch_size
        self.tuners[self.active].record(decision, dataclasses.replace(
            outcome, accepted_drafts=None))
        t = self.tuners[self.declining]
        ref = t.plain_seconds(b)
        if self.declining != self.active and ref is not None:
            t.record(declined, Outcome(b, b, ref))

    def record(self, decision: Decision, outcome: Outcome) -> None:
        if self.declined is not None:
            self._record_alone(decision, outcome)
            return
        kinds, acc = self.row_kinds, outcome.accepted_drafts
        self.row_kinds = None
        if kinds is not None and acc is not None and not decision.strategy.is_off:
            # each kind's acceptance profile learns from the rows it proposed for
            mine = [a for a, k in zip(acc, kinds) if k == self.active]
            outcome = dataclasses.replace(outcome, accepted_drafts=mine)
            for k in self.free:
                rows = [a for a, kk in zip(acc, kinds) if kk == k]
                if rows and k != self.active:
                    self.tuners[k].record_acceptance(decision.strategy, rows)
            t = self.tuners[self.active]
            if mine and (t.policy == "fixed" or not t.break_even):  # (no gate learns it)
                t.record_acceptance(decision.strategy, mine)
        self.tuners[self.active].record(decision, outcome)
        if decision.strategy.is_off and outcome.seconds > 0:  # a plain step: every
            for k, t in self.tuners.items():  # kind's break-even reference
                if k != self.active:
                    t.observe_plain(outcome.batch_size, outcome.seconds)

    def observe_plain(self, batch_size: int, seconds: float) -> None:
        for t in self.tuners.values():
            t.observe_plain(batch_size, seconds)

    def gate_stats(self) -> dict:
        """Per bucket label: the kinds' gate states and how often each was chosen."""
        out: dict = {}
        for k, t in self.tuners.items():
            for label, st in t.gate_stats().items():
                out.setdefault(label, {"kinds": {}})["kinds"][k] = st
        for label, per in self.chosen.items():
            out.setdefault(label, {"kinds": {}})["chosen"] = dict(per)
        for label, n in self.alone_steps.items():
            out.setdefault(label, {"kinds": {}})["alone"] = n
        return out

    def state_dict(self) -> dict:
        return {"kinds": {k: t.state_dict() for k, t in self.tuners.items()}}

    def load_state_dict(self, state: dict) -> None:
        for k, s in state["kinds"].items():
            self.tuners[k].load_state_dict(s)

    def save(self, path) -> None:
        import json

        from ...fileio import atomic_write

        with atomic_write(path) as f:
            json.dump(self.state_dict(), f)


class KindDecoder(SpeculativeDecoder):
    """One proposer per kind; the step's proposals come from ``tuner.active``'s, and
    the one verifier (``SpeculativeDecoder.step``) verifies and commits them."""

    def __init__(self, decoders: dict[str, SpeculativeDecoder], tuner: KindTuner):
        for k, d in decoders.items():
            if d.feature_layers:
                raise ValueError(f"drafter kind {k!r} reads EAGLE-3 feature layers, which "
                                 "several drafter kinds do not support")
        first = next(iter(decoders.values()))
        self.target = first.target
        self.noise = CoupledNoise(self.target.arch.vocab_size, self.target.device)
        self.decoders = dict(decoders)
        for d in self.decoders.values():
            d.use_noise(self.noise)  # drafting and verification share the step's rows
        self.tuner = tuner
        self.row_kinds: Optional[list[str]] = None  # the last step's kind per row
        self._alone: Optional[tuple] = None  # an alone step's (drafts, kinds), to propose
        self.feature_layers = ()
        # the returned hidden states come from a kind's feature store where one keeps them
        self._store = next((d for d in self.decoders.values() if d.keeps_hidden), None)
        self.keeps_hidden = self._store is not None

    def _active(self) -> SpeculativeDecoder:
        return self.decoders[self.tuner.active or next(iter(self.decoders))]

    features = property(lambda self: None if self._store is None else self._store.features)
    cache = property(lambda self: self._active().cache)

    def each(self) -> list[SpeculativeDecoder]:
        return list(self.decoders.values())

    def active_kind(self) -> Optional[str]:
        """The kind of the step just decided (None before the first decision)."""
        return self.tuner.active

    def pack_weights(self) -> tuple[int, float]:
        """Every kind's weights packed or refreshed: (refreshes, their seconds)."""
        parts = [d.pack_weights() for d in self.decoders.values()]
        return sum(n for n, _ in parts), sum(t for _, t in parts)

    def wire_graphs(self, graphs) -> None:
        self.graphs = graphs
        for d in self.decoders.values():
            d.wire_graphs(graphs)

    def graph_decisions(self) -> dict[str, dict]:
        out: dict[str, dict] = {}
        for d in self.decoders.values():
            out.update(d.graph_decisions())
        return out

    @property
    def min_draft_prob(self) -> float:
        return next(iter(self.decoders.values())).min_draft_prob

    @min_draft_prob.setter
    def min_draft_prob(self, value: float) -> None:
        for d in self.decoders.values():
            d.min_draft_prob = value

    # ---------------------------------------------------------------- all kinds
    def begin(self, max_batch: int, capacity: int, slack: int, *,
              reach: Optional[int] = None, draft_rows: Optional[int] = None,
              paged=None) -> None:
        for d in self.decoders.values():
            d.begin(max_batch, capacity, slack, reach=reach, draft_rows=draft_rows,
                    paged=paged)

    def paged_features(self):
        return None if self._store is None else self._store.paged_features()

    def paged_kv_bytes(self, *sizes) -> int:
        return sum(d.paged_kv_bytes(*sizes) for d in self.decoders.values())

    def kv_bytes_in_use(self) -> int:
        return sum(d.kv_bytes_in_use() for d in self.decoders.values())

    def drop_row(self, row: int) -> None:
        for d in self.decoders.values():
            d.drop_row(row)

    def release(self) -> None:
        for d in self.decoders.values():
            d.release()

    def store(self, row: int, first_pos: int, feats: torch.Tensor) -> None:
        for d in self.decoders.values():
            d.store(row, first_pos, feats)

    def store_step(self, start: torch.Tensor, feats: torch.Tensor) -> None:
        for d in self.decoders.values():
            d.store_step(start, feats)

    def new_row(self, row: int) -> None:
        for d in self.decoders.values():
            d.new_row(row)

    def move_row(self, src: int, dst: int, length: int) -> None:
        for d in self.decoders.values():
            d.move_row(src, dst, length)

    def copy_prompt(self, src: int, dst: list[int], length: int) -> None:
        for d in self.decoders.values():
            d.copy_prompt(src, dst, length)

    def finished(self, row, prompt, tokens) -> None:
        for d in self.decoders.values():
            d.finished(row, prompt, tokens)

    def pending(self, rows: Sequence) -> int:
        return max(d.pending(rows) for d in self.decoders.values())

    # ---------------------------------------------------------------- free kinds alone
    def alone(self, rows: Sequence, decision: Decision, tuner) -> Optional[Decision]:
        """Where ``decision`` of the kinds' own ``tuner`` (not a calibration's
        schedule) declined speculation (not a probe re-measuring plain
        decoding, the declining kind's plain reference measured), the step as the free
        kinds' alone: each row's best free match (the deepest chain arm's lookups, the
        kind whose ``KindTuner.expected`` is highest), rows without one decoding
        plainly in the same verification; taken when ``KindTuner.alone_gain``'s best
        chain arm reaches the gate's ``PAYS_FROM``. Returns that arm's decision (the
        step then proposes these chains, ``propose``), or None: a plain step."""
        t, b = self.tuner, len(rows)
        if (tuner is not t or not (t.alone_on and t.free) or not decision.strategy.is_off
                or decision.probe
                or not t.tuners[t.active].has_reference(b)):
            return None
        kinds: list[Optional[str]] = [None] * b
        chains: list[list[int]] = [[] for _ in rows]
        gain = [1.0] * b  # a plain row's tokens
        for k in t.free:
            arms = t.tuners[k].chain_arms(b)
            if not arms:
                continue
            deep = max(arms, key=lambda a: a.depth)
            for i, p in enumerate(self.decoders[k].row_proposals(rows, deep)):
                e = t.expected(k, len(p)) if p else 0.0
                if e > gain[i]:
                    gain[i], kinds[i], chains[i] = e, k, list(p)
        if not any(kinds):
            return None
        lead = max(t.free, key=kinds.count)
        best = t.alone_gain(kinds, chains, b, lead)
        if best is None or best[0] < PAYS_FROM:
            return None
        arm = best[1]
        drafts = [c[: arm.depth] for c in chains]
        self._alone = (drafts, [k or lead for k in kinds])
        t.start_alone(decision, lead, [len(d) for d in drafts])
        return Decision(decision.bucket, arm, False)

    # ---------------------------------------------------------------- the active kind
    def reserve(self, rows: Sequence) -> None:
        self._active().reserve(rows)

    def feed(self, rows: Sequence, stats, target_cache=None) -> int:
        active = self._active()
        return active.feed(rows, stats, target_cache) if active.pending(rows) else 0

    def propose(self, rows: Sequence, strategy: Strategy, stats,
                target_cache=None) -> Proposal:
        """The active kind's proposal, and for each row where a free kind's match
        (``Drafter.free``: a lookup) is expected to emit at least as many tokens
        (``KindTuner.expected``: its length against the active kind's depth, each
        weighed by its kind's acceptance profile), that match instead: one batched
        verification whatever the rows' kinds."""
        name = self.tuner.active or next(iter(self.decoders))
        if self._alone is not None:  # an alone step (``alone``): its chains, q one-hot
            drafts, kinds = self._alone
            self._alone = None
            out = Proposal(drafts, one_hot_q(self.target, rows, drafts))
            out.mine = [k == name for k in kinds]
            self.tuner.row_kinds = self.row_kinds = kinds
            return out
        active = self.decoders[name]
        base = active.propose(rows, strategy, stats, target_cache)
        kinds = [name] * len(rows)
        free = [k for k in self.tuner.free if k != name]
        if free:
            bar = self.tuner.expected(name, strategy.depth)
            best = [bar] * len(rows)
            chosen: dict[int, object] = {}
            for k in free:
                for i, p in enumerate(self.decoders[k].row_proposals(rows, strategy)):
                    n = len(p) if strategy.is_chain else (max_depth(p) if p else 0)
                    e = self.tuner.expected(k, n) if n else 0.0
                    if e >= best[i] and n:
                        best[i], kinds[i], chosen[i] = e, k, p
            if chosen:
                base = mixed(self.target, rows, base, chosen, strategy)
        base.mine = [k == name for k in kinds]
        self.tuner.row_kinds = self.row_kinds = kinds
        return base

    def kinds_of_rows(self, n: int) -> list[str]:
        """The kind that proposed each row in the last step."""
        kinds = self.row_kinds or []
        return kinds if len(kinds) == n else [self.active_kind()] * n

    def committed(self, rows: Sequence, strategy: Strategy, emissions, feats: list,
                  mine=None) -> None:
        """The active kind is told; the other feature-fed kinds store the target's
        features of the accepted nodes at positions L.. (their features there)."""
        active = self._active()
        active.committed(rows, strategy, emissions, feats, mine)
        for d in self.decoders.values():
            if d is active or not d.keeps_hidden:
                continue
            for i, (r, e) in enumerate(zip(rows, emissions)):
                idx = torch.tensor(e.nodes, device=feats[i].device)
                d.store(i, r.length, feats[i].index_select(0, idx))


def several_kinds(engine, drafters: dict, tuners: Optional[dict] = None, *,
                  epsilon: float = 0.1) -> tuple[KindDecoder, KindTuner]:
    """The decoder and tuner that speculate in ``engine`` with each drafter of
    ``drafters`` (kind name -> ``Drafter``), the kind chosen per bucket; ``tuners``: a
    ``StrategyTuner`` per kind (default: one from each kind's ``tuner_config``)."""
    sc = engine.config.speculative
    decoders = {}
    for kind, drafter in drafters.items():
        drafter.check_target(engine.arch)
        decoders[kind] = drafter.make_decoder(engine.runner)
        decoders[kind].min_draft_prob = sc.min_draft_prob
    tuners = tuners or {k: StrategyTuner.from_config(d.tuner_config(sc))
                        for k, d in drafters.items()}
    tuner = KindTuner(tuners, epsilon=epsilon, seed=sc.seed,
                      free=[k for k, d in drafters.items() if d.free],
                      alone=sc.free_alone)
    return KindDecoder(decoders, tuner), tuner


def max_depth(tree) -> int:
    """The depth of a (tokens, parents) tree."""
    par = tree[1]
    depth = [0] * len(par)
    for j in range(1, len(par)):
        depth[j] = depth[par[j]] + 1
    return max(depth)


def mixed(target, rows: Sequence, base: Proposal, chosen: dict, strategy: Strategy
          ) -> Proposal:
    """``base`` with rows ``chosen`` (row -> a free kind's chain or (tokens, parents)
    tree) replaced: chains' q one-hot there (the others' q kept), trees padded to a
    common node count (``model_free.host_trees``)."""
    b = len(rows)
    if base.tree is None and strategy.is_chain:
        drafts = [list(chosen[i]) if i in chosen else list(d)
                  for i, d in enumerate(base.drafts)]
        q = None
        if base.q_lp is not None:
            bw = base.q_lp.shape[1]
            width = max([bw] + [len(d) for d in drafts])
            q = torch.full((b, width, base.q_lp.shape[-1]), float("-inf"),
                           device=base.q_lp.device)
            q[:, :bw] = base.q_lp
            own = one_hot_q(target, rows, [drafts[i] if i in chosen else []
                                           for i in range(b)])
            idx = torch.tensor(sorted(chosen), device=q.device)
            q[idx] = float("-inf")
            q[idx, : own.shape[1]] = own.index_select(0, idx)
        return Proposal(drafts, q)
    if base.tree is None:  # the active kind proposed no tree (nothing drafted)
        trees = [chosen.get(i) for i in range(b)]
    else:
        t = base.tree
        trees = []
        for i in range(b):
            if i in chosen:
                trees.append(chosen[i])
                continue
            par = [-1] * len(t.tokens[i])
            for node, kids in enumerate(t.children[i]):
                for c in kids:
                    par[c] = node
            trees.append((t.tokens[i], par, t.children[i]))
    return Proposal(tree=host_trees(target.device, rows, trees))


__all__ = ["KindTuner", "KindDecoder", "several_kinds", "OFF"]
