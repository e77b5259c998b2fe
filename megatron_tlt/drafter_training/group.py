"""The drafter group: DP replicas that finish their rollout early train the drafter
through the tail, and every replica leaves the step with the same drafter.

Per RL step (a "window"), on every rank, between its replica's rollout finishing and
the step barrier (``Trainer.idle_window_hooks``):

1. The replica's finished responses (tokens + the features decoding saw) go into its
   ``DataBuffer`` (which also holds the previous step's).
2. The replica announces it finished: one ``add`` on the torch.distributed store
   (the rendezvous store: no extra sockets, no address discovery, any backend, any
   node). The replica's first rank announces and polls; its decision is broadcast
   over the replica's model-parallel group (its TP x PP ranks), so they act together.
3. Local training: while some replica is still decoding (the store's count is below
   DP) and at least ``min_idle_replicas`` have finished, the replica takes one drafter
   optimizer step (a micro-step; the ``cfg.loss`` preset of ``losses.py`` at the
   rollout's temperature / top-k / top-p) on its buffer, checking the store before
   each one and between its ``stop_checks`` row chunks (gradients accumulate; a stop
   mid-step applies the chunks done), so it stops within one chunk of the last
   replica finishing. The last replica to
   finish sees the count complete and trains nothing.
4. Synchronisation, a collective every replica calls once every replica has finished:
   a replica that stopped training before the last one finished (``max_steps_per_window``
   reached, its buffer exhausted, a failure) waits for the count to reach DP on the
   store (``arrival.py``), not inside the collective, so a tail longer than the process
   group's timeout never aborts the job. The replicas' step counts are then
   gathered; if nobody trained, nothing else happens. If one replica trained, its
   drafter parameters and AdamW moments are broadcast (a byte copy); otherwise they are
   averaged over DP weighted by the local step counts (a replica with 0 steps, or a
   failed one, weighs 0) in one all-reduce of one flat vector. The LR-schedule counter
   advances by the largest step count. The transfer is asynchronous: ``finish_sync``
   (at once, or after the policy update with ``overlap_sync``) writes it back and a
   checksum all-gather confirms every replica holds bit-identical state (else DP rank
   0's is broadcast).

Model parallelism: all ranks of a replica's model-parallel group (``mp_group``: its
TP x PP ranks) train together, on the same batches (chosen by DP rank) with the same
decisions (step 2's broadcast, also at every stop check); a failure on any of them is
the replica's (agreed over the group after every micro-step).

- Tensor parallelism: each TP rank holds its shards of the drafter layer's linears
  (megatron-core's column- and row-parallel layers, their collectives inside the
  forward and backward). The loss reads the target's embedding and output layer
  whole, all-gathered over TP once per training window and released after it
  (``target_view.WholeVocabTarget``); gradient clipping uses the norm over all shards
  (``DrafterTrainer``).
- Pipeline parallelism (``rollout.pipeline_mode=gathered`` only): every pipeline rank
  holds the whole model (the ``GatheredRunner``'s copies of the other stages' weights,
  the embedding and output layer included, kept between rollouts and re-sent at every
  generate) and all of the replica's responses and features (the rollout all-gathers
  them), and the drafter is replicated over PP. The pipeline ranks of a replica train
  redundantly: each runs every micro-step on the same batch. The window's compute is
  idle anyway (the replica would wait at the barrier), so this costs nothing on the
  critical path; splitting a batch over PP would shorten micro-steps (more of them per
  window) but needs an all-reduce of the rank's whole drafter gradient over the
  pipeline group, which often spans nodes, at every micro-step, and halves rows of
  micro-steps that are already small. Redundant steps communicate nothing beyond the
  decisions, and a micro-step (the preemption bound) costs what it costs at PP = 1, as
  does the drafter's memory. The target's copies are current in the idle window (the
  rollout's generate has just re-sent them); the canary, after the policy update,
  re-sends the vocabulary copies first (``whole_vocab(refresh=True)``). The group adds
  no memory for them.

The averaging runs per (TP, PP) position over its own DP group (each position averages
its shards with the same weights). ``finish_sync`` then makes the replica agree: the
replicated (not TP-sharded) parameters and moments over the whole model-parallel
group, the TP shards over the pipeline group (computed from the same inputs, they
agree: a checksum confirms it, and the group's first rank's bytes are broadcast where
they would not), and sums the checksum over the model-parallel group, so
``drafter/identical`` covers every shard and every pipeline copy.

A failure (non-finite loss or state, an exception) restores the replica's window-start drafter,
gives it weight 0 and turns speculation off for the next rollout on every replica
(``speculation_guard``); the RL step never waits on a drafter that failed.

No dynamic process groups: the DP group megatron-core made serves the averaging.
Growing ``new_group(..., use_local_synchronization=True)`` groups by finish order hangs
on gloo (docs/drafter-group.md), and local training keeps a replica's micro-steps free
of cross-replica communication.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from typing import Callable, Optional, Sequence

import torch

from .. import collectives
from ..arrival import DEFAULT_BOUND_S, Arrivals, default_store
from .alpha import measure_alpha
from .buffer import BufferedResponse, DataBuffer
from .losses import LossConfig
from .target_view import WholeVocabTarget
from .trainer import DrafterTrainer

__all__ = ["DrafterGroup", "StopSignal", "TRAIN", "WAIT", "STOP"]

TRAIN, WAIT, STOP = 0, 1, 2


class StopSignal:
    """Which replicas have finished this window: a counter per window on the store
    (``arrival.Arrivals``, in a namespace of this group's own)."""

    def __init__(self, store, prefix: str = "megatron_tlt/drafter_group",
                 bound_s: float = DEFAULT_BOUND_S):
        self.arrivals = Arrivals(store, prefix, bound_s=bound_s)

    def announce(self, window: int, replica: Optional[int] = None) -> int:
        """Count this replica as finished; returns how many have finished now."""
        return self.arrivals.arrive(f"{window}/finished", replica)

    def finished(self, window: int) -> int:
        return self.arrivals.count(f"{window}/finished")

    def wait_all(self, window: int, replicas: int) -> float:
        """Wait on the store until all ``replicas`` have finished ``window`` (bounded:
        ``arrival.Arrivals.wait``); returns the seconds waited."""
        return self.arrivals.wait(f"{window}/finished", replicas, who=range(replicas),
                                  what=f"the drafter group's window {window}")

    def forget(self, window: int, replica: Optional[int] = None) -> None:
        self.arrivals.forget(f"{window}/finished", replica)


class DrafterGroup:
    """One replica's member of the drafter group (see the module docstring).

    ``sampling`` (a ``SamplingParams`` or anything with ``temperature``, ``top_k`` and
    ``top_p``; None = temperature 1, no truncation) is the rollout's: the drafter loss
    (``cfg.loss``, a ``losses.LOSS_PRESETS`` name) and the canary's alpha use its
    processed distributions. ``loss_fn(batch) -> (loss, parts)`` replaces that loss
    when given (``parts`` needs a float ``"loss"``). ``dp_group``: this (TP, PP)
    position's data-parallel group; ``mp_group``: the replica's model-parallel group
    (TP x PP ranks) and ``pp_group`` its pipeline group, None at size 1.
    ``wait_bound_s``: how long a finished replica waits on the store for the others at
    most (``arrival.py``). ``cfg``'s sizes that are 0 ("auto") are derived from the
    drafter's device and size (``sizing.resolve``).
    """

    def __init__(self, drafter, runner, cfg, *, dp_group=None, mp_group=None,
                 pp_group=None, store=None,
                 total_steps: int = 1000, seed: int = 0, sampling=None,
                 loss_fn: Optional[Callable] = None, clock: Callable[[], float] = time.perf_counter,
                 overlap_sync: bool = False, wait_bound_s: float = DEFAULT_BOUND_S):
        from .sizing import resolve

        cfg = resolve(cfg, drafter)
        self.cfg = cfg
        self.drafter = drafter
        self.sampling = ((1.0, 0, 1.0) if sampling is None else
                         (float(sampling.temperature), int(sampling.top_k),
                          float(sampling.top_p)))
        # the loss reads the target's embedding and output layer whole: at TP > 1
        # gathered over the TP group for each window that trains (target_view.py)
        self.target = WholeVocabTarget(runner)
        self.trainer = DrafterTrainer(
            drafter, self.target, lr=cfg.lr, weight_decay=cfg.weight_decay,
            warmup_steps=cfg.lr_warmup_steps, total_steps=total_steps,
            min_lr_ratio=cfg.min_lr_ratio if cfg.lr_decay == "cosine" else 1.0,
            grad_clip=cfg.grad_clip, loss=LossConfig.for_sampling(cfg.loss, *self.sampling))
        self._custom_loss = loss_fn is not None
        if loss_fn is not None:
            self.trainer.loss = loss_fn
        self.buffer = DataBuffer(cfg.buffer_tokens)
        self.dp_group, self.mp_group, self.pp_group = dp_group, mp_group, pp_group
        self.dp_size = collectives.size(dp_group)
        self.dp_rank = collectives.rank(dp_group)
        self.mp_size = collectives.size(mp_group) if mp_group is not None else 1
        self.mp_rank = collectives.rank(mp_group) if mp_group is not None else 0
        self.pp_size = collectives.size(pp_group) if pp_group is not None else 1
        # the flat vectors and moments travel where they live: on the groups' device
        used = [dp_group] + [g for g in (mp_group, pp_group) if g is not None]
        wrong = {collectives.device_of(g).type for g in used} - {self.device.type}
        if wrong:
            raise ValueError(
                f"drafter group: the drafter lives on {self.device.type} but the process "
                f"groups' collectives take {sorted(wrong)} tensors; run the drafter on the "
                f"backend's device (nccl: cuda, gloo: cpu)")
        self.signal = StopSignal(store if store is not None else default_store(),
                                 bound_s=wait_bound_s)
        self.seed = int(seed)
        self.clock = clock
        self.window = 0          # windows run in this process (store keys)
        self.version = 0         # synchronised drafter updates (same on every replica)
        self.speculation_off = False  # for the next rollout, after a failure
        self.after_micro_step: Optional[Callable[[int], None]] = None  # tests: delays
        self.last: dict = {}     # this replica's record of the last window
        self._announced: Optional[int] = None
        self.overlap_sync = overlap_sync  # finish_sync later, after the policy update
        self._pending = None     # (work, flat, keep): an averaging not yet written back

    @property
    def device(self) -> torch.device:
        return self.trainer.params[0].device

    # ------------------------------------------------------------------ the window
    def announce(self) -> int:
        """Count this replica as finished for the coming window (``run_window`` does it
        when not done before); returns how many have finished."""
        n = self.signal.announce(self.window, self.dp_rank) if self.mp_rank == 0 else 0
        self._announced = self.window
        return self._replica_value(n)  # (the same answer on every rank of the replica)

    def _decide(self, steps: int) -> int:
        """TRAIN, WAIT or STOP for the next micro-step, the same on every rank of the
        replica."""
        code = STOP
        if self.mp_rank == 0:
            n = self.signal.finished(self.window)
            done = (n >= self.dp_size or steps >= self.cfg.max_steps_per_window
                    or not self.cfg.train)
            code = STOP if done else WAIT if n < self.cfg.min_idle_replicas else TRAIN
        return self._replica_value(code)

    def _replica_value(self, value: int) -> int:
        """The replica's first rank's ``value`` on all its model-parallel ranks."""
        if self.mp_size == 1:
            return value
        return collectives.broadcast_values([value], src=0, group=self.mp_group)[0]

    def run_window(self, step: int, responses: Sequence[BufferedResponse]) -> dict:
        """Buffer ``responses``, train until the last replica finishes, synchronise.
        Returns this replica's record (also kept as ``self.last``); times are seconds
        since the call started."""
        self.finish_sync()  # (normally done already, after the last policy update)
        t0 = self.clock()
        base = self.trainer.step_count
        self.buffer.add(step, responses)
        last_finisher = False
        if self._announced != self.window:
            last_finisher = self.announce() >= self.dp_size
        steps, losses, failure = 0, [], None
        snapshot, batches = None, None
        t_first = t_end = None
        whole = contextlib.ExitStack()  # the unsharded target while training (TP > 1)
        while True:
            code = self._decide(steps)
            if code == STOP:
                break
            if code == WAIT:
                time.sleep(self.cfg.poll_seconds)
                continue
            if batches is None:
                seed = (self.seed * 1_000_003 + step) * 1_009 + self.dp_rank
                batches = self.buffer.batches(self.cfg.batch_tokens, seed=seed)
                snapshot = self._flat(create=True).clone()
                if not self._custom_loss:
                    whole.enter_context(self.target.whole_vocab())
            batch = next(batches, None)
            if batch is None:
                break
            t_first = self.clock() if t_first is None else t_first
            try:
                parts = self.trainer.step(  # the stop flag read between row chunks
                    batch, chunks=self.cfg.stop_checks,
                    stop=lambda: self._decide(steps) == STOP)
                if not math.isfinite(float(parts["loss"])):
                    raise FloatingPointError(f"drafter loss is {parts['loss']}")
            except Exception as e:  # noqa: BLE001 - any drafter failure: RL continues
                failure = f"{type(e).__name__}: {e}"
            finally:
                t_end = self.clock()
            if self.mp_size > 1:  # the replica's ranks leave the loop together
                failure = self._agree_failure(failure)
            if failure is not None:
                break
            steps += 1
            losses.append(float(parts["loss"]))
            if self.after_micro_step is not None:
                self.after_micro_step(steps)
        whole.close()
        if failure is None and snapshot is not None and not all(
                bool(torch.isfinite(t).all()) for t in self._tensors()):
            failure = "FloatingPointError: non-finite drafter weights or moments"
        if self.mp_size > 1 and snapshot is not None:
            failure = self._agree_failure(failure)
        t_sync = self.clock()
        # a replica that stopped early (the step limit, an exhausted buffer, a failure)
        # waits for the last one on the store, not inside the collective below
        self.signal.wait_all(self.window, self.dp_size)
        t_arrived = self.clock()
        sync = self._synchronise(base, failure, snapshot)
        sync["wait"] += t_arrived - t_sync
        t_done = self.clock()
        self.signal.forget(self.window - 1, self.dp_rank if self.mp_rank == 0 else None)
        self.window += 1
        self._announced = None
        self.last = {
            "steps": steps, "loss_sum": sum(losses), "failure": failure,
            "last_finisher": last_finisher,
            "train": [t_first - t0, t_end - t0] if t_first is not None else None,
            "train_seconds": (t_end - t_first) if t_first is not None else 0.0,
            "window_seconds": t_done - t0, "sync_wait": sync["wait"],
            "sync_seconds": t_done - t_sync - sync["wait"], "version": self.version,
            "checksum": sync["checksum"], "healed": sync["healed"],
            "buffer_tokens": self.buffer.tokens, "buffer_steps": self.buffer.steps,
        }
        if failure is not None and self.mp_rank == 0:
            warnings.warn(f"drafter group: replica {self.dp_rank} failed to train the "
                          f"drafter ({failure}); its drafter is restored and speculation "
                          "is off for the next rollout", RuntimeWarning, stacklevel=2)
        return self.last

    # ------------------------------------------------------------------ synchronisation
    def _agree_failure(self, failure: Optional[str]) -> Optional[str]:
        """A failure on any model-parallel rank of the replica is the replica's (each
        rank checks only its own shards or copy): every rank restores and reports it
        alike."""
        flag = torch.tensor([0 if failure is None else 1], dtype=torch.int64,
                            device=collectives.device_of(self.mp_group))
        collectives.all_reduce(flag, "max", group=self.mp_group)
        if failure is None and int(flag[0]):
            failure = "failed on another model-parallel rank of this replica"
        return failure

    def _synchronise(self, base: int, failure: Optional[str], snapshot) -> dict:
        """Weighted average over DP (see the module docstring); ``base`` is the schedule
        counter at the window's start, ``snapshot`` the state there (None: untouched).
        The transfer is launched here; ``finish_sync`` completes it (at once unless
        ``overlap_sync``)."""
        t0 = self.clock()
        steps = self.trainer.step_count - base
        mine = torch.tensor([0.0 if failure else float(steps), 1.0 if failure else 0.0],
                            dtype=torch.float64, device=collectives.device_of(self.dp_group))
        parts = collectives.all_gather(mine, group=self.dp_group)
        wait = self.clock() - t0  # ends when the latest replica's first chunk ends
        good = [float(p[0]) for p in parts]
        failed = any(float(p[1]) > 0 for p in parts)
        self.speculation_off = failed
        if failure is not None and snapshot is not None:
            self._write_flat(snapshot)
            self.trainer.step_count = base
        total = sum(good)
        out = {"wait": wait, "checksum": None, "healed": False}
        if total == 0:
            return out
        self.trainer.step_count = base + int(max(good))
        self.version += 1
        trained = [k for k, g in enumerate(good) if g > 0]
        if len(trained) == 1:
            # one replica trained (weight 1, the others 0): its state, copied byte for
            # byte; no arithmetic, and the others need not flatten theirs
            src = trained[0]
            if self.dp_rank == src:
                flat = self._flat(create=True)
            else:
                n = sum(t.numel() for t in self._tensors(create=True))
                flat = torch.empty(n, dtype=torch.float32, device=self.device)
            work = collectives.broadcast(flat, src=src, group=self.dp_group, async_op=True)
            keep = self.dp_rank == src  # the source's state is already the result
        else:
            # every contribution was checked finite (a replica whose state was not
            # counts as failed, weight 0), so the average is finite
            flat = self._flat(create=True)
            flat.mul_(good[self.dp_rank] / total)
            work = collectives.all_reduce(flat, group=self.dp_group, async_op=True)
            keep = False
        self._pending = (work, flat, keep)
        if not self.overlap_sync:
            out.update(self.finish_sync(record=False))
        return out

    def finish_sync(self, *, record: bool = True) -> dict:
        """Complete the window's averaging: wait for the transfer, write the result into
        the drafter and its AdamW moments, and confirm over DP that every replica holds
        the same bytes (else DP rank 0's state is broadcast). Every replica calls it at
        the same point (a collective); a no-op when nothing is pending. Returns (and,
        with ``record``, adds to ``self.last``) the checksum and the seconds it took."""
        if self._pending is None:
            return {}
        t0 = self.clock()
        work, flat, keep = self._pending
        self._pending = None
        work.wait()
        if not keep:
            self._write_flat(flat)
        self._set_adam_step()
        # the replicas agree already (never expected otherwise; made certain)
        healed, cs = _agree(self._tensors(), self.dp_group, self.dp_size, flat=flat)
        if self.mp_size > 1:
            if self._agree_replica():
                healed = True
                cs = _word_sum(self._flat())
            collectives.all_reduce(cs, group=self.mp_group)  # the whole replica's fingerprint
        out = {"checksum": int(cs[0]), "healed": healed, "finish": self.clock() - t0}
        if record and self.last:
            self.last.update(checksum=out["checksum"], healed=healed,
                             sync_seconds=self.last["sync_seconds"] + out["finish"])
        return out

    def _agree_replica(self) -> bool:
        """Make the replica's ranks hold the same bytes where they hold the same tensors:
        the replicated (not TP-sharded) parameters and their moments over the whole
        model-parallel group, the TP shards and theirs over the pipeline group (the
        group's first rank's bytes). They were computed from the same inputs, so they
        agree already; a checksum all-gather confirms it and a broadcast repairs it
        otherwise. Returns whether it had to."""
        opt = self.trainer.opt

        def with_moments(params):
            return [t for p in params for t in [p.data] + [
                opt.state[p][k] for k in ("exp_avg", "exp_avg_sq") if k in opt.state[p]]]

        params = self.trainer.params
        shards = [p for p in params if getattr(p, "tensor_model_parallel", False)]
        replicated = [p for p in params if not getattr(p, "tensor_model_parallel", False)]
        healed = False
        for tensors, group, size in ((with_moments(replicated), self.mp_group, self.mp_size),
                                     (with_moments(shards), self.pp_group, self.pp_size)):
            if tensors and size > 1 and _agree(tensors, group, size)[0]:
                healed = True
        return healed

    def _tensors(self, create: bool = False) -> list[torch.Tensor]:
        """Parameters and AdamW moments, in a fixed order (moments made zero if absent)."""
        out = []
        opt = self.trainer.opt
        for p in self.trainer.params:
            st = opt.state[p]
            if create and "exp_avg" not in st:
                st["step"] = torch.tensor(float(self.trainer.step_count))
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            out.append(p.data)
            if "exp_avg" in st:
                out += [st["exp_avg"], st["exp_avg_sq"]]
        return out

    def _flat(self, create: bool = False) -> torch.Tensor:
        return _concat(self._tensors(create))

    def _write_flat(self, flat: torch.Tensor) -> None:
        _write_back(flat, self._tensors(create=True))

    def _set_adam_step(self) -> None:
        for p in self.trainer.params:
            st = self.trainer.opt.state[p]
            if "step" in st:
                st["step"] = torch.tensor(float(self.trainer.step_count))

    def checksum(self) -> torch.Tensor:
        """An int64 fingerprint of the drafter's parameters and AdamW moments (their
        bytes summed as int32 words; summed over the replica's model-parallel ranks, which
        all call it)."""
        words = {4: torch.int32, 2: torch.int16, 1: torch.uint8}
        s = torch.zeros(1, dtype=torch.int64, device=self.device)
        for t in self._tensors():
            w = words.get(t.element_size(), torch.uint8)
            flat = t.detach().contiguous().reshape(-1)
            s += (flat.view(w) if w != torch.uint8 else flat.view(torch.uint8)).sum(
                dtype=torch.int64)
        if self.mp_size > 1:  # (a collective over the replica's TP x PP ranks)
            collectives.all_reduce(s, group=self.mp_group)
        return s

    # ------------------------------------------------------------------ speculation
    @contextlib.contextmanager
    def speculation_guard(self, engine):
        """Speculation off for one rollout when the last window failed (an averaging
        still pending is completed first: the rollout drafts with the averaged drafter)."""
        self.finish_sync()
        if not self.speculation_off or engine is None:
            yield
            return
        sc = engine.config.speculative
        saved = sc.threshold
        sc.threshold = 0
        try:
            yield
        finally:
            sc.threshold = saved
            self.speculation_off = False

    # ------------------------------------------------------------------ canary
    def canary_alpha(self) -> Optional[float]:
        """The drafter's depth-1 alpha (``alpha.measure_alpha``: E[sum min(p~, q~)] at the
        rollout's sampling settings) over the ``cfg.canary_sequences`` newest buffered
        responses, p~ from their buffered final hidden states. None when the buffer is
        empty."""
        samples = [r.draft_sample() for r in self.buffer.sample(self.cfg.canary_sequences)]
        if not samples:
            return None
        t, k, p = self.sampling
        # after the policy update: copies of the vocabulary matrices (PP > 1) re-sent
        with self.target.whole_vocab(refresh=True):
            return measure_alpha(self.drafter, self.target, samples, temperature=t,
                                 top_k=k, top_p=p, depth=1).alpha[0]

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        return {"optimizer": self.trainer.opt.state_dict(),
                "step_count": self.trainer.step_count, "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.trainer.opt.load_state_dict(state["optimizer"])
        self.trainer.step_count = int(state["step_count"])
        self.version = int(state["version"])


def _concat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """``tensors`` as one float32 vector, in order."""
    return torch.cat([t.detach().float().reshape(-1) for t in tensors])


def _write_back(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """``_concat``'s inverse: ``flat``'s values into ``tensors``, in place."""
    i = 0
    for t in tensors:
        t.copy_(flat[i:i + t.numel()].view_as(t))
        i += t.numel()


def _word_sum(flat: torch.Tensor) -> torch.Tensor:
    """[1] int64: a float32 vector's bytes summed as int32 words (a bit-exact
    fingerprint, cheap to all-gather)."""
    return flat.view(torch.int32).sum(dtype=torch.int64).reshape(1)


def _agree(tensors: list[torch.Tensor], group, size: int,
           flat: Optional[torch.Tensor] = None) -> tuple[bool, torch.Tensor]:
    """``tensors`` the group's first rank's bytes on every rank of ``group`` (a
    collective; None: the default group). ``flat``: the float32 vector the caller has
    just written into them, compared instead of concatenating them again. Returns
    whether any rank held different ones, and the ``_word_sum`` of what the group now
    agrees on."""
    if flat is None:
        flat = _concat(tensors)
    cs = _word_sum(flat)
    sums = collectives.all_gather(cs, group=group)
    if all(torch.equal(x, sums[0]) for x in sums):
        return False, cs
    flat = _concat(tensors)
    collectives.broadcast(flat, src=0, group=group)
    _write_back(flat, tensors)
    return True, _word_sum(flat)
