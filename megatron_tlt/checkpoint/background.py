"""Asynchronous saves: the policy's shards written in the background, published later.

With ``checkpoint.async_save`` on (``auto``: when training on CUDA) a save returns as
soon as the policy's shards are snapshotted; a background process writes them while
training goes on. The small files (drafter, per-rank state) are written before the save
returns, a snapshot of the same moment. Publishing the checkpoint (checksums,
``run.json``, the rename to ``step_N``, ``latest``, keep-last-N: ``store``) is the
save's finalize step, which megatron-core runs on every rank only once all ranks agree
that their writes finished; a rank killed while they are in flight leaves the partial
folder unpublished and the previous checkpoint under ``latest`` (its writers die with
it: ``sharded.writers_die_with_rank``).

The shards go through megatron-core's own async path: ``dist_checkpointing.save(...,
async_sharded_save=True)`` returns an ``AsyncRequest``, scheduled here on an
``AsyncCallsQueue``. Its non-persistent caller (``TemporalAsyncCaller``) forks one
process per save, and a fork is a snapshot: the child's memory is a copy-on-write image
of the rank's at that moment, whatever the rank changes afterwards. On GPU megatron-core
first copies the shards to host memory (its preload; a host copy of the rank's shards
for the duration of the write). On CPU that copy is ``tensor.to("cpu")``, the tensor
itself, so the fork alone makes the snapshot; a tensor in shared memory, which a fork
does not copy, is cloned first. (The persistent caller would hand the tensors to a
long-lived worker through a queue, sharing their memory: not a snapshot on CPU, and not
used here.)

The caller decides when a save is finalized (``Saver``): without waiting at every step
boundary (a finished save is published promptly), waiting before the next save starts,
at the end of training and before a stop request's checkpoint, and on an error exit
(``Saver.close``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

import torch

from ..runtime_env import cuda_placements_on_cpu


def async_enabled(setting: str, device) -> bool:
    """``checkpoint.async_save`` for a run on ``device``: auto = on with CUDA."""
    return setting == "true" or (setting == "auto" and torch.device(device).type == "cuda")


def _unshared(preload: Callable) -> Callable:
    """megatron-core's preload, then a clone of each CPU tensor it left in shared
    memory (the forked writer would otherwise see later changes to it; on GPU the
    preload's host copies are fresh memory, cloned never)."""
    def preload_unshared():
        out = []
        for file_name, key, (byte_items, tensor_items) in preload():
            tensor_items = [(item, t.clone() if t.device.type == "cpu" and t.is_shared()
                             else t) for item, t in tensor_items]
            out.append((file_name, key, (byte_items, tensor_items)))
        return out
    return preload_unshared


class BackgroundSaves:
    """megatron-core's ``AsyncCallsQueue`` of this rank's in-flight saves (at most one:
    ``Saver`` waits for the previous save before starting the next)."""

    def __init__(self):
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self.calls = AsyncCallsQueue(persistent=False)  # a fork per save (see module doc)

    @property
    def in_flight(self) -> int:
        return self.calls.get_num_unfinalized_calls()

    def schedule(self, request, then: Optional[Callable[[], None]] = None) -> None:
        """Start ``request`` (every rank calls it); ``then`` runs on every rank when the
        save is finalized. Call inside ``sharded.writers_die_with_rank``."""
        if then is not None:
            request.add_finalize_fn(then)
        if request.preload_fn is not None:
            request = request._replace(preload_fn=_unshared(request.preload_fn))
        self.calls.schedule_async_request(request)

    def finalize(self, blocking: bool = False) -> int:
        """Finalize the saves whose writes finished on every rank (``blocking``: wait
        for them); every rank calls it at the same point (it all-reduces once a save is
        in flight). Returns how many were finalized."""
        if not self.in_flight:
            return 0
        with cuda_placements_on_cpu():
            return len(self.calls.maybe_finalize_async_calls(blocking=blocking))

    def abort(self) -> None:
        """Kill this rank's background writers without any collective, leaving their
        checkpoint unpublished (the next save removes its partial folder)."""
        for active in self.calls.async_calls:
            active.async_caller.close(abort=True)
        self.calls.async_calls.clear()


class Saver:
    """A run's checkpoint saves, synchronous or asynchronous, with what the metrics
    report about them: ``checkpoint/blocking_seconds`` (how long the save held the
    training loop) and ``checkpoint/publish_seconds`` (from its start until it was
    published; equal for a synchronous save)."""

    def __init__(self, asynchronous: bool):
        self.background = BackgroundSaves() if asynchronous else None
        self._metrics: dict[str, float] = {}

    def save(self, state, folder: str | Path, layout, *, keep_last: int = 0,
             published: Optional[Callable[[Path], None]] = None) -> Path:
        """``store.save`` after the previous save is published (every rank calls it).
        ``published(path)`` runs on every rank once this one is."""
        from .store import save

        self.finalize(blocking=True)
        t0 = time.perf_counter()

        def done(path: Path) -> None:
            self._metrics["checkpoint/publish_seconds"] = time.perf_counter() - t0
            if published is not None:
                published(path)

        path = save(state, folder, layout, keep_last=keep_last, published=done,
                    background=self.background)
        self._metrics["checkpoint/blocking_seconds"] = time.perf_counter() - t0
        return path

    @property
    def in_flight(self) -> int:
        return self.background.in_flight if self.background is not None else 0

    def finalize(self, blocking: bool = False) -> None:
        """Publish a save whose writes finished (``blocking``: wait for it first);
        every rank calls it at the same point."""
        if self.background is not None:
            self.background.finalize(blocking)

    def close(self, agreed: bool) -> None:
        """When the training loop leaves on an error with a save in flight. ``agreed``:
        every rank leaves at this same point (an error every rank raises together, or a
        one-rank run), so the save is finished and published. Otherwise the other ranks
        may be waiting in another collective, which a finalize would meet: this rank
        kills its writers instead and the checkpoint stays unpublished (``latest``
        keeps naming the previous one)."""
        if not self.in_flight:
            return
        if agreed:
            self.finalize(blocking=True)
        else:
            self.background.abort()

    def take_metrics(self) -> dict:
        """The timings recorded since the last call (then forgotten)."""
        out, self._metrics = self._metrics, {}
        return out
