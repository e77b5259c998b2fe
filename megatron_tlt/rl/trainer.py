"""The RL step loop: GRPO on megatron-core with TLT rollouts.

``Trainer.train_step`` is one synchronous, on-policy step, top to bottom:

    prompts -> rollout (each DP replica its share, on the trained weights)
            -> rewards -> [idle window until the last replica finishes: a finished
               replica waits on the rendezvous store, not in a collective (arrival.py)]
            -> advantages (per group) -> old / reference log-probs
            -> update (ppo_epochs x mini-batches x micro-batches) -> metrics

Layout: world = TP x PP x DP. Prompts are dealt to replicas whole (a GRPO group never
spans replicas), so rewards and advantages are local; only scalars cross replicas
(loss denominators, metrics, finish times). A prompt's mini-batch is fixed by its
index (``p % mini_batches``) and its replica by ``(p // mini_batches) % DP``, so a
mini-batch holds the same samples whatever the DP size: DP=2 computes exactly what DP=1
computes on the same global batch.

Everything a resumed run needs lives in ``self.state`` (``checkpoint.RunState``).
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .. import checkpoint as checkpointing
from .. import collectives
from ..arrival import BOUND_FACTOR, StepPoints
from ..checkpoint.export import run_meta
from ..config import Config, mini_batch_count
from ..rollout.engine import GenerationInterrupted
from ..rollout.speculative import drafters
from ..tracking import Tracker
from . import grpo, nonfinite, preflight
from .evaluation import eval_metrics
from .offload import UpdateMemory
from .policy import Policy
from .rollout import ReplicaRollout, rollout_replica, sampling_params
from .safe_point import SafePoints
from .spec_costs import ensure_run_costs
from .samples import Sample, collate, plan_micro_batches
from .step_metrics import add_round, reduce_update, step_metrics


class Trainer:
    """Owns the run's components; ``train()`` runs the loop, ``train_step`` one step."""

    def __init__(self, cfg: Config, session, *, stop=None, verifier=None, online=None):
        """``session``: ``launch.setup``'s (model, tokenizer, layout, platform);
        ``stop``: the run's ``preemption.StopRequest`` (None: no stop requests).

        Parts a test or tool may give instead of the ones built from ``cfg``:
        ``verifier`` (``score_many(prompts, texts)``, as ``rewards.Verifier``) and
        ``online`` (the drafter-training part, as ``online_drafter.online_drafter``'s).
        After construction ``generate`` (the rollout's generation, the engine's
        ``generate``), ``idle_window_hooks`` and ``phase_hooks`` are the seams."""
        from megatron.core import parallel_state as ps

        from ..rollout import RolloutEngine
        from .data import PromptSampler, build_prompt_sets
        from .online_drafter import online_drafter
        from .rewards import Verifier

        self.cfg = cfg
        self.session = session
        self.layout = session.layout
        self.arch = session.arch
        self.tokenizer = session.tokenizer
        self.stop = stop
        self.rank = collectives.rank()
        self.dp_group = ps.get_data_parallel_group()
        self.pp_group = ps.get_pipeline_model_parallel_group()
        self.mini_batches = mini_batch_count(cfg)
        self.train_prompts, self.eval_prompts = build_prompt_sets(cfg.data, self.tokenizer)
        self.last_eval: dict = {}  # the last evaluate()'s result per held-out prompt
        preflight.check_prompts(self.train_prompts, self.eval_prompts, cfg, self.arch)
        self.verifier = verifier if verifier is not None else Verifier(cfg.reward, cfg.data)
        total_opt_steps = cfg.train.steps * cfg.grpo.ppo_epochs * self.mini_batches
        self.policy = Policy(session.model, self.arch, cfg.train,
                             total_optimizer_steps=total_opt_steps)
        # train.offload_during_rollout: the update-only memory lent to the rollout
        self.update_memory = UpdateMemory(self.policy, cfg.train.offload_during_rollout)
        self.ref_model = self._reference_model() if cfg.grpo.kl_beta > 0 else None
        # this replica's stages decode together at PP > 1 (each its own layers' KV cache)
        self.engine = RolloutEngine(  # its memory sized once for the run (rollout.memory)
            self.policy.module, self.tokenizer, cfg.rollout, arch=self.arch,
            max_prompt_tokens=cfg.data.max_prompt_tokens, max_new_tokens=cfg.grpo.max_new_tokens,
            max_rows=len(self.replica_prompts(cfg.grpo.prompts_per_step)) * cfg.grpo.group_size)
        # the drafter group's side (drafter_group.enable), or its no-op form
        self.online = online if online is not None else online_drafter(
            cfg, self.engine, self.arch, self.layout, self.dp_group)
        self.generate = self.engine.generate  # the rollout's generation (a seam)
        self.pad_id = (self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None
                       else self.tokenizer.eos_token_id or 0)
        saved = drafters.trainable(self.engine.drafters)  # (a quantized copy has no
        self.state = checkpointing.RunState(  # weights of its own to save)
            policy=self.policy, sampler=PromptSampler(self.train_prompts, cfg.data.seed),
            tuner=self.engine.tuner,
            drafter=saved.model if saved is not None and saved.saveable else None,
            drafter_group=self.online.group, drafters=self.engine.drafters,
            meta=run_meta(self.arch, session.source))
        self.saver = checkpointing.Saver(checkpointing.async_enabled(
            cfg.checkpoint.async_save, session.platform.device))
        self.safe = SafePoints(
            self.state, self.saver, cfg.checkpoint, self.layout, last_step=cfg.train.steps,
            stop=stop, settle=lambda: self.online.settle())
        self.tracker = None  # the run's Tracker while ``train`` runs
        # Called on every rank between this replica's rollout finishing and the step
        # barrier, with (step, this replica's ReplicaRollout). The drafter group trains
        # here; the callback must return before the barrier can complete.
        self.idle_window_hooks: list[Callable[[int, ReplicaRollout], None]] = [
            lambda step, roll: self.online.hook(step, roll)]
        # Called with (phase, "start" | "end") around the step's "log-probs" and "update"
        # phases on every rank (a tool's memory marks and profiler labels)
        self.phase_hooks: list[Callable[[str, str], None]] = []
        self._reward_seconds = 0.0
        # a replica that finished early waits for the others on the store, then enters
        # the collective (arrival.py): a tail longer than the process group's timeout
        self.points = StepPoints(collectives.size(), self.rank,
                                 bound_s=BOUND_FACTOR * cfg.parallel.collective_timeout_s)

    # ------------------------------------------------------------------ set-up helpers
    def _reference_model(self):
        """The frozen initial policy for the KL term (a second model instance)."""
        from ..models import load_model

        ref, _ = load_model(self.session.source, device=self.session.platform.device,
                            dtype=self.cfg.model.dtype, impl=self.cfg.model.transformer_impl)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref.eval()

    def replica_prompts(self, n_prompts: int) -> list[int]:
        """Indices (into a step's prompt list) this DP replica generates for."""
        m, dp = self.mini_batches, self.layout.dp_size
        return [p for p in range(n_prompts) if (p // m) % dp == self.layout.dp_rank]

    def _rollout(self, prompts, indices, seed: int, t_step: float) -> ReplicaRollout:
        params = sampling_params(self.cfg.grpo, seed, hidden=self.online.hidden)
        try:
            return rollout_replica(self.generate, [prompts[i] for i in indices],
                                   indices, self.cfg.grpo.group_size, params, t_step,
                                   lambda: self.engine.last_stats.summary())
        except GenerationInterrupted:  # a stop request: the step is abandoned after the
            # barrier; the rest of the step's collectives still run, on no samples
            return ReplicaRollout([], 0.0, time.perf_counter() - t_step, 0)

    def _interrupt(self) -> Optional[Callable[[], bool]]:
        """This rank's stop flag, where a replica may cut work short on its own (TP = PP
        = 1: its decode and micro-batch loops run no collective); else None."""
        lay = self.layout  # (EP > 1: the expert-parallel replicas decode and train together)
        if self.stop is None or lay.tp_size * lay.pp_size * lay.ep_size > 1:
            return None
        return self.stop.pending

    @contextlib.contextmanager
    def _interruptible_rollout(self):
        self.engine.interrupt = self._interrupt()
        try:
            yield
        finally:
            self.engine.interrupt = None

    def _score(self, samples: Sequence[Sample], prompts) -> None:
        t0 = time.perf_counter()
        g = self.cfg.grpo
        by_uid = {p.uid: p for p in prompts}
        texts = [self.tokenizer.decode(s.response_ids, skip_special_tokens=True)
                 for s in samples]
        results = self.verifier.score_many([by_uid[s.uid] for s in samples], texts)
        for s, r in zip(samples, results):
            s.score, s.correct, s.reward = float(r.score), bool(r.correct), float(r.reward)
        if g.overlong == "penalty" and samples:
            lengths = torch.tensor([len(s.response_ids) for s in samples])
            pen = grpo.overlong_penalty(lengths, g.max_new_tokens, g.overlong_buffer,
                                        g.overlong_penalty)
            for s, v in zip(samples, pen.tolist()):
                s.reward += v
        self._reward_seconds += time.perf_counter() - t0

    def _dp_all_gather(self, obj):
        return collectives.all_gather_object(obj, group=self.dp_group)

    def _dp_sum(self, values: Sequence[float]) -> list[float]:
        return collectives.sum_values(values, group=self.dp_group)

    # ------------------------------------------------------------------ the step
    def train_step(self, step: int) -> dict:
        cfg, g = self.cfg, self.cfg.grpo
        t_step = time.perf_counter()
        timing: dict[str, float] = {}
        self._reward_seconds = 0.0

        # what the step changes before its first optimizer step, for a stop request
        snap = self.safe.step_start()

        # 1. prompts: the same list on every rank (the sampler is deterministic)
        prompts = self.state.sampler.next_batch(g.prompts_per_step)
        mine = self.replica_prompts(len(prompts))

        # 2. rollout on the trained weights; 3. rewards
        seed = cfg.platform.seed * 1_000_003 + step
        self.update_memory.lend()  # restored below, before anything may save
        with self._phase(f"step {step + 1}: rollout"), self.online.rollout_guard(), \
                self._interruptible_rollout():
            roll = self._rollout(prompts, mine, seed, t_step)
            self._score(roll.samples, prompts)
            rounds, replaced = self._dynamic_sampling(roll, step, t_step)
        roll.finished_at = time.perf_counter() - t_step
        timing["rollout"] = roll.finished_at  # generation + scoring, this replica
        timing["reward"] = self._reward_seconds

        # The window between this replica's finish and the step barrier (drafter group):
        # the store counts this rank as arrived; the barrier's collective is entered
        # once every rank has (a drafter group's window already ends there)
        t_idle = time.perf_counter()
        barrier = self.points.arrive(step, "barrier")
        for hook in self.idle_window_hooks:
            hook(step, roll)
        self.points.wait(barrier)
        finish_times = self._dp_all_gather(roll.finished_at)  # the step barrier
        window = time.perf_counter() - t_idle
        timing["barrier_wait"] = window
        if cfg.rollout.release_memory:  # the update runs without the rollout's caches
            self.engine.release_memory()
        timing.update(self.update_memory.restore())  # the caches first, then the state
        self.safe.abandon_if_agreed(snap)  # a stop request: raises Stopped

        # 4. advantages per group (groups are local to the replica)
        samples = roll.samples
        rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
        adv = grpo.group_advantages(rewards, g.group_size, g.norm_adv_by_std) \
            if samples else rewards
        for s, a in zip(samples, adv.tolist()):
            s.advantage = a
        zero_std = int(grpo.zero_std_groups(rewards, g.group_size).sum()) if samples else 0
        loss_mask = [not (g.overlong == "mask" and s.truncated) for s in samples]
        skip = self._dp_sum([nonfinite.bad_rewards(samples)])[0] > 0  # NaN/inf: no update

        # 5. old and reference log-probs
        self._mark("log-probs", "start")
        t0 = time.perf_counter()
        fused_old = (not g.use_rollout_logprobs and g.ppo_epochs == 1
                     and self.mini_batches == 1)
        if g.use_rollout_logprobs:
            for s in samples:
                s.old_logprobs = torch.tensor(s.rollout_logprobs)
        elif not fused_old:
            self._fill_logprobs(samples, self.policy, "old_logprobs")
        timing["old_logprob"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.ref_model is not None:
            self._fill_logprobs(samples, self.ref_model, "ref_logprobs")
        timing["ref_logprob"] = time.perf_counter() - t0
        self._mark("log-probs", "end")

        # 6. update: ppo_epochs x mini-batches, micro-batches accumulate
        self._mark("update", "start")
        t0 = time.perf_counter()
        with self._phase(f"step {step + 1}: update", g.ppo_epochs * self.mini_batches) as tick:
            update = nonfinite.skipped_update(g.ppo_epochs * self.mini_batches, self.policy.lr) \
                if skip else self._update(samples, loss_mask, fused_old, tick, snap)
        timing["update"] = time.perf_counter() - t0
        self._mark("update", "end")
        timing["step"] = time.perf_counter() - t_step

        # 7. metrics
        metrics = step_metrics(samples, roll, finish_times, timing, update, zero_std,
                               rounds, replaced, dp_group=self.dp_group, lr=self.policy.lr,
                               tis=g.tis_cap > 0, pp_group=self.pp_group,
                               pp_size=self.layout.pp_size)
        metrics.update(self.policy.moe_metrics())  # MoE: expert load (models.moe_load)
        # the canary after the policy update, drafter metrics (the drafter group's)
        metrics.update(self.online.after_update(metrics))
        self.state.step = step + 1
        return metrics

    # ------------------------------------------------------------------ step parts
    def _dynamic_sampling(self, roll: ReplicaRollout, step: int, t_step: float):
        """DAPO dynamic sampling: groups whose rewards are all equal are replaced by
        groups of fresh prompts (drawn identically on every rank, dealt in rank order)
        that do have reward variance, for at most ``dynamic_sampling_rounds`` rounds."""
        g = self.cfg.grpo
        if not g.dynamic_sampling:
            return 0, 0
        replaced = 0
        for rnd in range(1, g.dynamic_sampling_rounds + 1):
            groups = _groups(roll.samples, g.group_size)
            flat = [gi for gi, grp in enumerate(groups)
                    if len({s.reward for s in grp}) == 1]
            self.points.meet(step, f"sampling{rnd}")  # the round's rollout: a tail
            counts = self._dp_all_gather(len(flat))
            total = sum(counts)
            if total == 0:
                return rnd - 1, replaced
            fresh = self.state.sampler.next_batch(total)
            lo = sum(counts[: self.layout.dp_rank])
            mine = fresh[lo: lo + len(flat)]
            seed = (self.cfg.platform.seed * 1_000_003 + step) * 101 + rnd
            extra = self._rollout(mine, list(range(len(mine))), seed, t_step)
            self._score(extra.samples, mine)
            new_groups = _groups(extra.samples, g.group_size)
            for gi, new in zip(flat, new_groups):
                if len({s.reward for s in new}) > 1:
                    idx = groups[gi][0].prompt_index
                    for s in new:
                        s.prompt_index = idx
                    start = gi * g.group_size
                    roll.samples[start:start + g.group_size] = new
                    replaced += 1
            roll.generated_tokens += extra.generated_tokens
            add_round(roll.stats, extra.stats)
        return g.dynamic_sampling_rounds, replaced

    def _micro_batches(self, samples, indices, loss_mask, *, for_loss: bool):
        t = self.cfg.train
        plans = plan_micro_batches(samples, indices, micro_batch_size=t.micro_batch_size,
                                   micro_batch_tokens=t.micro_batch_tokens)
        device = self.policy.device
        # each micro-batch at its own shape, at any PP (variable_seq_lengths)
        return [collate(samples, p, pad_id=self.pad_id, device=device,
                        loss_mask=loss_mask if for_loss else None) for p in plans]

    @torch.no_grad()
    def _fill_logprobs(self, samples: Sequence[Sample], model, attr: str) -> None:
        """Forward-only log-probs of each response under ``model`` (the policy or the
        frozen reference) at the sampling temperature, stored per sample on the last
        pipeline stage."""
        if not samples:
            return
        temperature = self.cfg.grpo.temperature
        mbs = self._micro_batches(samples, range(len(samples)), None, for_loss=False)
        if isinstance(model, Policy):
            outs = model.logprobs(mbs, temperature)
        else:
            from ..models.inference import forward_local_logits, token_logprobs

            outs = []
            for mb in mbs:
                local = forward_local_logits(model, mb.input_ids)
                outs.append(token_logprobs(local, mb.targets, self.arch, temperature)
                            if local is not None else None)
            outs = outs if self.policy.is_last_stage else None
        if outs is None:
            return
        for mb, lp in zip(mbs, outs):
            for r, i in enumerate(mb.samples):
                s = samples[i]
                p = len(s.prompt_ids)
                setattr(s, attr, lp[r, p - 1:p - 1 + len(s.response_ids)].float().cpu())

    def _mark(self, phase: str, when: str) -> None:
        for hook in self.phase_hooks:
            hook(phase, when)

    def _phase(self, name: str, total: Optional[int] = None):
        """A progress line on rank 0's terminal while a phase runs."""
        if self.tracker is None:
            return contextlib.nullcontext(None)
        return self.tracker.phase(name, total)

    def _skips_zero_advantage(self) -> bool:
        """Whether zero-advantage samples skip the backward: their loss is then exactly
        zero (no KL or entropy term; at PP = 1, where micro-batch shapes may vary)."""
        g = self.cfg.grpo
        return (g.kl_beta == 0 and g.entropy_coef == 0 and self.layout.pp_size == 1
                and self.layout.ep_size == 1)  # (EP > 1: the ranks' forwards pair up)

    def _update(self, samples: list[Sample], loss_mask: list[bool], fused_old: bool,
                tick: Optional[Callable] = None, snap: Optional[dict] = None) -> dict:
        g = self.cfg.grpo
        arch = self.arch
        sums: dict[str, float] = {}
        maxes: dict[str, float] = {}
        norms, lrs, skipped, loss_scale = [], [], 0, 1.0
        # what this replica's update processes: padded tokens, attention cells (rows x
        # length^2: attention's cost grows with the length) and micro-batches with a
        # backward, and forward-only (zero-advantage samples); the planner's update model
        work = {"backward_tokens": 0, "backward_cells": 0, "backward_micro_batches": 0,
                "forward_tokens": 0, "forward_cells": 0, "forward_micro_batches": 0,
                "backward_seconds": 0.0, "forward_seconds": 0.0, "step_seconds": 0.0}
        for _epoch in range(g.ppo_epochs):
            for m in range(self.mini_batches):
                idx = [i for i, s in enumerate(samples) if s.prompt_index % self.mini_batches == m]
                # loss tokens; sequences with >= 1 of them (an empty response adds nothing)
                kept = [len(samples[i].response_ids) for i in idx if loss_mask[i]]
                tokens, seqs = self._dp_sum([sum(kept), sum(1 for n in kept if n)])
                denoms = grpo.LossDenominators(tokens=max(tokens, 1.0),
                                               sequences=max(seqs, 1.0),
                                               max_len=float(g.max_new_tokens))
                idle = []
                if self._skips_zero_advantage():
                    # a zero-advantage sample's loss and gradient are exactly zero: skip
                    # its backward (the denominators above still count it); a forward
                    # without gradients still gives its metrics, so they do not depend
                    # on the skipping
                    idle = [i for i in idx if samples[i].advantage == 0.0]
                    idx = [i for i in idx if samples[i].advantage != 0.0]
                mbs = self._micro_batches(samples, idx, loss_mask, for_loss=True)

                def loss_fn(mb, local_logits, denoms=denoms):
                    # only response positions carry loss: log-probs and entropies there
                    # alone, in chunks of train.loss_chunk_tokens positions
                    return grpo.micro_batch_loss(
                        mb, local_logits, g, denoms, vocab_size=arch.vocab_size,
                        chunk_tokens=self.cfg.train.loss_chunk_tokens, fused_old=fused_old)

                per_mb, idle_mbs = [], []
                if idle:
                    idle_mbs = self._micro_batches(samples, idle, loss_mask, for_loss=True)
                    t0 = self.policy.clock()
                    per_mb = self.policy.loss_metrics(idle_mbs, loss_fn)
                    work["forward_seconds"] += self.policy.clock() - t0
                for kind, batch in (("backward", mbs), ("forward", idle_mbs)):
                    shapes = [tuple(mb.input_ids.shape) for mb in batch]  # (rows, length)
                    work[f"{kind}_tokens"] += sum(r * t for r, t in shapes)
                    work[f"{kind}_cells"] += sum(r * t * t for r, t in shapes)
                    work[f"{kind}_micro_batches"] += len(batch)
                first = _epoch == 0 and m == 0  # no optimizer step yet: may be abandoned
                result, trained = self.policy.train_step(
                    mbs, loss_fn, interrupt=self._interrupt() if first else None,
                    before_step=(lambda: self.safe.abandon_if_agreed(snap))
                    if first and snap is not None else None)
                per_mb += trained
                work["backward_seconds"] += result.compute_seconds
                work["step_seconds"] += result.step_seconds
                for met in per_mb:
                    for k, v in met.items():
                        v = float(v)
                        if k in grpo.MAX_METRICS:
                            maxes[k] = max(maxes.get(k, -math.inf), v)
                        else:
                            sums[k] = sums.get(k, 0.0) + v
                if result.updated:  # a skipped step's norm is not finite
                    norms.append(result.grad_norm)
                lrs.append(result.lr)
                skipped += 0 if result.updated else 1
                loss_scale = result.loss_scale
                if tick is not None:
                    tick(1, f"loss {sum(float(m.get('loss', 0.0)) for m in per_mb):+.4f}")
        totals, maxes = reduce_update(sums, maxes, self.dp_group)
        return {"sums": totals, "maxes": maxes, "grad_norm": norms, "lr": lrs,
                "skipped": skipped, "updates": g.ppo_epochs * self.mini_batches,
                "loss_scale": loss_scale, "work": work}

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Mean reward and accuracy (with 95 % intervals) on the held-out prompts, one
        sample each."""
        prompts = self.eval_prompts
        if not prompts:
            return {}
        dp, r = self.layout.dp_size, self.layout.dp_rank
        mine = list(range(r, len(prompts), dp))
        from ..rollout import SamplingParams

        t = self.cfg.train.eval_temperature
        params = SamplingParams(temperature=t, max_new_tokens=self.cfg.grpo.max_new_tokens,
                                top_p=self.cfg.grpo.top_p if t else 1.0,
                                seed=self.cfg.platform.seed if t else None)
        # (called without prompts too: at EP > 1 the group's replicas decode together)
        with self.update_memory.lent(self.engine.release_memory  # (rl/offload.py)
                                     if self.cfg.rollout.release_memory else None):
            outs = self.engine.generate([prompts[i].token_ids for i in mine], params)
        texts = [self.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
        res = self.verifier.score_many([prompts[i] for i in mine], texts)
        per = [(i, float(x.reward), float(x.correct)) for i, x in zip(mine, res)]
        self.points.meet(self.state.step, "eval")  # the replicas' generation: a tail
        rows = sorted(x for part in self._dp_all_gather(per) for x in part)
        # per held-out prompt, in the prompts' order: what a paired comparison of two
        # runs reads (eval_prompts.jsonl; tools/learn.py)
        self.last_eval = {"reward": [r for _, r, _ in rows], "correct": [c for _, _, c in rows]}
        return eval_metrics([(r, c) for _, r, c in rows])

    # ------------------------------------------------------------------ the loop
    def train(self, tracker: Optional[Tracker] = None) -> list[dict]:
        """Run the steps left (``train.steps``), reporting to ``tracker`` (metrics,
        progress, the phase lines); returns each step's metrics."""
        cfg = self.cfg
        self.tracker = tracker
        history = []
        if tracker is not None:
            tracker.start_progress(cfg.train.steps, self.state.step)
        # costs=modelled: rank 0's step costs on every rank, before the first rollout
        ensure_run_costs(self.engine, tracker.run_dir if tracker is not None else None)
        interval = cfg.train.eval_interval
        if interval and self.state.step == 0:
            ev = self.evaluate()
            if tracker is not None and ev:
                tracker.log(0, {**ev, "phase": "eval"})
                tracker.append("eval_prompts.jsonl", {"step": 0, **self.last_eval})
            history.append({"step": 0, **ev})
        try:
            while self.state.step < cfg.train.steps:
                step = self.state.step
                metrics = self.train_step(step)
                done = self.state.step
                if interval and (done % interval == 0 or done == cfg.train.steps):
                    metrics.update(self.evaluate())
                    if tracker is not None and self.eval_prompts:
                        tracker.append("eval_prompts.jsonl", {"step": done, **self.last_eval})
                nonfinite.after_step(done, metrics, self.state.extra, cfg.train.max_nonfinite_steps)
                metrics.update(self.safe.step_boundary())  # checkpoint/* timings
                if tracker is not None:
                    tracker.log(done, metrics)
                    tracker.step_done(f"reward {metrics['reward/mean']:.3f} "
                                      f"acc {metrics['accuracy']:.2f} "
                                      f"{metrics['timing']['step']:.0f}s")
                history.append({"step": done, **metrics})
                every = cfg.checkpoint.save_interval
                self.safe.end_of_step(done, bool(every and done % every == 0)
                                       or done == cfg.train.steps)  # may raise Stopped
        except BaseException as e:
            self.safe.on_error(e)  # a save in flight: published or abandoned
            raise
        finally:
            if tracker is not None:
                tracker.close()
            self.tracker = None
        return history

    def resume(self, folder: str | Path) -> Path:
        return self.safe.resume(folder)


# ---------------------------------------------------------------------------------------

def _groups(samples: Sequence[Sample], size: int) -> list[list[Sample]]:
    return [list(samples[i:i + size]) for i in range(0, len(samples), size)]


def config_dict(cfg: Config) -> dict:
    return asdict(cfg)
