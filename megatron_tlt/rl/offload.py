"""Lend the rollout the memory only the update needs (``train.offload_during_rollout``).

Between two updates the policy's gradient buffers and its optimizer state (Adam's
moments, and the fp32 main copies of 16-bit weights where the optimizer keeps them)
are dead weight: the rollout reads the weights alone. ``UpdateMemory.lend()`` frees
them before the rollout and ``restore()`` brings them back, bit for bit, before the
log-prob passes and the update:

- the gradient buffers (megatron-core DDP's ``grad_data``) are released, not copied:
  the next update zeroes them first anyway. megatron-core's own
  ``DistributedDataParallel.offload_grad_buffers`` / ``restore_grad_buffers`` do it
  (the buffer's storage resized to 0 and back, every ``main_grad`` view kept);
- the optimizer state and the main parameters are copied to host memory (one pinned
  buffer on CUDA, kept for the run and reused at every lend) and their device storage
  resized to 0; ``restore`` resizes it back and copies the bytes in. Every tensor
  object stays the same (the optimizer's param groups, its state keyed by parameter,
  megatron-core's main-parameter groups and their ``.grad`` views), so nothing has to
  be re-wired. On CPU there is no device memory to lend: the bytes go to an unlinked
  temporary file instead (truncated again at ``restore``), so the process's resident
  memory drops by the same amount (tools/measure_memory.py ``--offload``).

The weights are never touched (a parameter whose storage is a model parameter's, as
with an fp32 model's optimizer, stays). A checkpoint must never see the lent state:
``checkpoint.sharded`` refuses to save or load a policy while ``policy.lent`` is set,
and the trainer restores before any point that may save (docs/trainer.md).

megatron-core's ``MegatronOptimizer.offload_to_cpu`` is not used: it moves every
param-group parameter (an fp32 model's weights and the distributed optimizer's fp32
shards are views of the weights), into unpinned memory, with new tensors, and does
nothing on CPU.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import tempfile
import time
import warnings
from typing import Callable, Optional

import torch

from ..optim_state import torch_optimizers


def update_only_tensors(policy) -> list[torch.Tensor]:
    """The tensors of ``policy``'s optimizer that only the update reads: every state
    tensor (not 0-d step counters) and every param-group parameter that is not a model
    weight (the main parameters), one per storage."""
    weights = {p.untyped_storage().data_ptr() for p in policy.module.parameters()}
    seen: set[int] = set()
    out = []

    def add(t) -> None:
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            return
        ptr = t.untyped_storage().data_ptr()
        if ptr == 0 or ptr in weights or ptr in seen:
            return
        seen.add(ptr)
        out.append(t)

    for _, opt in torch_optimizers(policy.optimizer):
        for group in opt.param_groups:
            for p in group["params"]:
                add(p)
                for v in opt.state.get(p, {}).values():
                    add(v)
    return out


def grad_buffer_bytes(ddp) -> int:
    """Bytes of megatron-core DDP's gradient buffers (dense and expert)."""
    return sum(b.grad_data.numel() * b.grad_data.element_size()
               for b in ddp.buffers + ddp.expert_parallel_buffers if b.grad_data is not None)


class UpdateMemory:
    """The policy's update-only memory, lent to the rollout between updates (see the
    module docstring). Disabled, every call is a no-op."""

    def __init__(self, policy, enabled: bool):
        self.policy = policy
        self.enabled = bool(enabled)
        self.on_cuda = policy.device.type == "cuda"
        self._lent: list[tuple[torch.UntypedStorage, int, int]] = []  # storage, offset, bytes
        self._host: Optional[torch.Tensor] = None  # pinned, CUDA
        self._file = None  # CPU
        self.bytes_lent = 0  # the last lend's: optimizer state + main params + grads
        self.seconds = {"offload": 0.0, "reload": 0.0}
        policy.lent = False

    @property
    def is_lent(self) -> bool:
        return self.policy.lent

    def lend(self) -> None:
        """Free the update-only memory (no-op when disabled or already lent)."""
        if not self.enabled or self.is_lent:
            return
        t0 = time.perf_counter()
        tensors = update_only_tensors(self.policy)
        storages = [t.untyped_storage() for t in tensors]
        sizes = [s.nbytes() for s in storages]
        total = sum(sizes)
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        if self.on_cuda:
            if self._host is None or self._host.numel() != total:
                self._host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            for s, off, n in zip(storages, offsets, sizes):
                self._host[off:off + n].copy_(_bytes_of(s), non_blocking=True)
            torch.cuda.current_stream().synchronize()  # the host copy before the free
        else:
            if self._file is None:
                self._file = tempfile.TemporaryFile()
            fd = self._file.fileno()
            for s, off, n in zip(storages, offsets, sizes):
                _write_all(fd, _host_bytes(s), off)
        for s in storages:
            s.resize_(0)
        grads = grad_buffer_bytes(self.policy.ddp)
        with _typed_storage_quiet():
            self.policy.ddp.offload_grad_buffers(synchronize=self.on_cuda,
                                                 empty_cache=False)
        if self.on_cuda:
            torch.cuda.empty_cache()  # the freed segments to the driver: the rollout's
            # allocations are of other sizes
        self._lent = list(zip(storages, offsets, sizes))
        self.bytes_lent = total + grads
        self.policy.lent = True
        self.seconds["offload"] = time.perf_counter() - t0

    def restore(self) -> dict:
        """Bring the update-only memory back (no-op unless lent); returns the last
        lend's and this restore's seconds ({} when disabled), for the step's timings."""
        if not self.enabled:
            return {}
        if not self.is_lent:
            return dict(self.seconds)
        t0 = time.perf_counter()
        with _typed_storage_quiet():
            self.policy.ddp.restore_grad_buffers(synchronize=False)  # zeroed
        fd = None if self.on_cuda else self._file.fileno()
        for s, off, n in self._lent:
            s.resize_(n)
            if self.on_cuda:
                _bytes_of(s).copy_(self._host[off:off + n], non_blocking=True)
            else:
                _read_all(fd, _host_bytes(s), off)
        if self.on_cuda:
            torch.cuda.current_stream().synchronize()
        else:
            self._file.truncate(0)  # no page cache or disk held through the update
        self._lent = []
        self.policy.lent = False
        self.seconds["reload"] = time.perf_counter() - t0
        return dict(self.seconds)

    @contextlib.contextmanager
    def lent(self, before_restore: Optional[Callable[[], None]] = None):
        """Lent inside the block (when not already); ``before_restore`` runs first on the
        way out (the rollout engine's ``release_memory``: its caches go before the
        update's state comes back)."""
        was = self.is_lent
        self.lend()
        try:
            yield
        finally:
            if not was and self.is_lent:
                if before_restore is not None:
                    before_restore()
                self.restore()


@contextlib.contextmanager
def _typed_storage_quiet():
    """megatron-core's buffer helpers resize through ``Tensor.storage()``, which warns
    that TypedStorage is deprecated."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        yield


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
        storage, 0, (storage.nbytes(),), (1,))


def _host_bytes(storage: torch.UntypedStorage) -> memoryview:
    """The bytes of a CPU ``storage`` as a writable memoryview (not through
    ``Tensor.numpy()``, which marks the storage as never resizable again)."""
    return memoryview((ctypes.c_ubyte * storage.nbytes()).from_address(
        storage.data_ptr())).cast("B")


def _write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _read_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            raise IOError(f"the update's lent state file ended early ({done} of "
                          f"{len(view)} bytes at offset {offset})")
        done += got
