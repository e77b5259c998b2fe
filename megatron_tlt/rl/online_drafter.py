"""The RL trainer's side of the drafter group (``drafter_group.enable=true``): a part
of the trainer with a no-op form, so the trainer never branches on it.

    online = online_drafter(cfg, engine, arch, layout, dp_group)  # or NoDrafterTraining()
    trainer.idle_window_hooks.append(online.hook)
    with online.rollout_guard(): ...          # speculation off once after a failure
    metrics.update(online.after_update(metrics))

Every form answers ``hidden`` (the rollout returns hidden states), ``group`` (the
``DrafterGroup`` a checkpoint saves, or None), ``hook``, ``rollout_guard``,
``after_update`` and ``settle`` (an averaging in flight finished before a snapshot is
restored).

The engine must hold a trainable drafter (``Drafter.trainable``): a configured one, or
an untrained one the trainer attaches for a cold start (``drafters.untrained``).

The rollout returns each response's decode-time hidden states (``Sample.extra``); the
idle-window hook buffers them and runs the group's window (``DrafterGroup``); after the
policy update the canary measures alpha on a few buffered responses with the updated
shared embedding and output layer, and one all-gather brings every replica's record to
the step's metrics. The canary's alpha (``alpha.measure_alpha`` at depth 1 and the
rollout's sampling settings: the exact per-token rate speculative sampling accepts)
is logged as ``drafter/alpha`` and ``spec/alpha``.
"""

from __future__ import annotations

import contextlib
import math
import warnings

from .. import collectives
from ..arrival import BOUND_FACTOR
from ..config import ConfigError
from ..drafter_training.buffer import BufferedResponse
from ..drafter_training.group import DrafterGroup
from ..drafter_training.sizing import resolve
from ..rollout.speculative import drafters
from .rollout import sampling_params


class NoDrafterTraining:
    """The no-op form (``drafter_group.enable=false``): nothing buffered, trained or
    reported."""

    hidden = False
    group = None

    def hook(self, step: int, roll) -> None:
        pass

    def rollout_guard(self):
        return contextlib.nullcontext()

    def after_update(self, metrics: dict) -> dict:
        return {}

    def settle(self) -> None:
        pass


def online_drafter(cfg, engine, arch, layout, dp_group):
    """The run's drafter-training part: ``OnlineDrafter`` with ``drafter_group.enable``
    (a cold start first attaches an untrained drafter, the same on every rank), else
    ``NoDrafterTraining``."""
    if not cfg.drafter_group.enable:
        return NoDrafterTraining()
    if all(d.free for d in engine.drafters.values()):  # a cold start: an untrained
        d = drafters.untrained(arch, dtype=engine.runner.dtype,  # drafter to train, the
                               device=engine.device)  # same on every rank (beside free
        engine.attach_drafters({**engine.drafters, d.name: d})  # kinds: per row over it)
    return OnlineDrafter(cfg, engine, layout, dp_group)


class OnlineDrafter:
    hidden = True  # the rollout returns each response's hidden states

    def __init__(self, cfg, engine, layout, dp_group):
        """``cfg``: the run's config; ``engine``: the replica's ``RolloutEngine`` (its
        trainable drafter is trained, its runner read); ``layout``: this rank's
        ``ParallelLayout``; ``dp_group``: the data-parallel group the drafters are
        averaged over."""
        from megatron.core import parallel_state as ps

        dg = cfg.drafter_group
        kind = drafters.trainable(engine.drafters)
        if kind is None:
            names = ", ".join(f"{d.label} ({n})" for n, d in engine.drafters.items())
            raise ConfigError(f"drafter_group.enable=true trains a drafter, and "
                              f"{names or 'no drafter'} needs no training: set "
                              "drafter_group.enable=false, or "
                              "give rollout.speculative.drafter a drafter checkpoint (or "
                              "leave it empty for a cold start)")
        if kind.feature_layers:
            raise ConfigError(
                "drafter_group.enable=true trains on the final hidden states the engine "
                "returns; this drafter reads EAGLE-3 feature layers "
                f"{list(kind.feature_layers)}. Use a drafter without "
                "feature_layers or drafter_group.enable=false")
        self.first = layout.dp_rank == 0 and layout.tp_rank == 0 and layout.pp_rank == 0
        if layout.dp_size == 1 and self.first:
            warnings.warn("drafter_group.enable=true with one data-parallel replica: no "
                          "replica is ever idle while another decodes, so the drafter "
                          "never trains; launch 2 or more replicas", RuntimeWarning,
                          stacklevel=2)
        drafter = kind.model
        dg = resolve(dg, drafter)  # sizes left to the device (0 = auto)
        self.engine = engine
        self.kind = kind.name  # its acceptance in the step's spec metrics: spec/<kind>
        self.cfg = dg
        self.dp_group = dp_group
        self.group = DrafterGroup(drafter, engine.runner, dg, dp_group=dp_group,
                                  mp_group=ps.get_model_parallel_group(),
                                  pp_group=ps.get_pipeline_model_parallel_group(),
                                  total_steps=cfg.train.steps * dg.max_steps_per_window,
                                  seed=cfg.platform.seed,
                                  sampling=sampling_params(cfg.grpo, cfg.platform.seed),
                                  overlap_sync=dg.overlap_sync,
                                  wait_bound_s=BOUND_FACTOR * cfg.parallel.collective_timeout_s)
        self.finished_at = 0.0

    def hook(self, step: int, roll) -> None:
        """The idle window: buffer this replica's responses, train, synchronise."""
        responses = [BufferedResponse(list(s.prompt_ids) + list(s.response_ids),
                                      len(s.prompt_ids), s.extra.pop("hidden_states"), step)
                     for s in roll.samples if "hidden_states" in s.extra]
        self.finished_at = roll.finished_at
        self.group.run_window(step, responses)

    def rollout_guard(self):
        return self.group.speculation_guard(self.engine)

    def settle(self) -> None:
        """The window's averaging, if still in flight, finished without a record."""
        self.group.finish_sync(record=False)

    def after_update(self, metrics: dict) -> dict:
        """The canary and the step's drafter metrics (every rank calls it). The window's
        averaging, launched at the step barrier, ran behind the policy update; its
        write-back and checksum happen here, before the canary reads the drafter."""
        self.group.finish_sync()
        alpha = self.group.canary_alpha()
        rec = dict(self.group.last, alpha=alpha, finished_at=self.finished_at)
        parts = collectives.all_gather_object(rec, group=self.dp_group)
        out = summarise(parts, metrics.get("idle_replica_seconds", 0.0))
        if "timeline" in metrics:
            metrics["timeline"]["drafter_train"] = out.pop("drafter/train_spans")
        else:
            out.pop("drafter/train_spans")
        low = canary_warnings(out.get("drafter/alpha"), self.cfg.canary_min_alpha,
                              metrics.get("spec") or {}, self.kind)
        if low and self.first:
            warnings.warn("drafter group: the drafter looks broken (" + "; ".join(low) +
                          "): speculation buys nothing; check the drafter's weights "
                          "after the policy update", RuntimeWarning, stacklevel=2)
        return out


CANARY_MIN_SPEC_STEPS = 32  # speculative steps the canary's acceptance check needs


def canary_warnings(alpha, min_alpha: float, spec: dict, kind: str) -> list[str]:
    """Why the trained drafter (of kind ``kind``) looks broken after an update, if it
    does: the canary's alpha below ``min_alpha``, or its measured acceptance about one
    token per step over enough speculative steps. With several drafter kinds
    (``spec/<kind>``) only its own steps count: another kind's acceptance says nothing
    about it."""
    low = [f"canary alpha {alpha:.3f} < drafter_group.canary_min_alpha={min_alpha}"] \
        if alpha is not None and alpha < min_alpha else []
    own = spec.get(kind) or spec
    # a handful of speculative steps says little: judge acceptance on enough of them
    if own.get("steps", 0) >= CANARY_MIN_SPEC_STEPS and own.get("accept_len", 2.0) <= 1.05:
        low.append(f"measured acceptance {own['accept_len']:.2f} tokens per step")
    return low


def summarise(parts: list[dict], idle_available: float) -> dict:
    """Every replica's window record -> the step's ``drafter/*`` metrics."""
    steps = [p["steps"] for p in parts]
    total = sum(steps)
    alphas = [p["alpha"] for p in parts if p.get("alpha") is not None]
    spans = [None if p["train"] is None else
             [p["finished_at"] + p["train"][0], p["finished_at"] + p["train"][1]]
             for p in parts]
    last_finish = max(p["finished_at"] for p in parts)
    # training inside the idle window (a micro-step running on past the last finish
    # is the preemption latency, reported on its own)
    used = sum(max(0.0, min(b, last_finish) - a) for a, b in filter(None, spans))
    last = [p["sync_wait"] for p in parts if p["last_finisher"]]
    sums = [p["checksum"] for p in parts]
    out = {
        "drafter/steps": total,
        "drafter/steps_per_replica": steps,
        "drafter/idle_used_fraction": used / idle_available if idle_available > 0 else 0.0,
        "drafter/train_seconds": sum(p["train_seconds"] for p in parts),
        "drafter/preempt_latency": max(last) if last else 0.0,
        "drafter/sync_seconds": max(p["sync_seconds"] for p in parts),
        "drafter/version": [p["version"] for p in parts],
        "drafter/identical": all(s == sums[0] for s in sums),
        "drafter/failures": sum(p["failure"] is not None for p in parts),
        "drafter/buffer_tokens": sum(p["buffer_tokens"] for p in parts),
        "drafter/train_spans": spans,
    }
    if total:
        out["drafter/loss"] = sum(p["loss_sum"] for p in parts) / total
    if alphas:
        out["drafter/alpha"] = out["spec/alpha"] = sum(alphas) / len(alphas)
    return {k: v for k, v in out.items() if not (isinstance(v, float) and math.isnan(v))}
