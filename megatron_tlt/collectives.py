"""The package's one door to torch.distributed's collectives.

Every collective in megatron_tlt goes through this module
(``tests/infra/test_collectives.py`` fails on a direct call anywhere else). It owns two
rules that a CPU suite on gloo cannot see being broken:

- **Tensors live on the group's device.** NCCL refuses CPU tensors ("No backend type
  associated with device type cpu") and gloo refuses CUDA ones for most ops. The value
  helpers (``sum_values``, ``max_values``, ...) take and return Python numbers and
  allocate on ``device_of(group)``; the tensor helpers (``all_reduce``, ``broadcast``,
  ...) check that the caller's tensor is already there and name the fix when it is not,
  on CPU too, so a mistake fails the CPU suite rather than the first GPU step.
- **Objects never carry tensors.** ``all_gather_object`` / ``broadcast_object`` pickle
  through a device tensor; a tensor inside the object would be a multi-GB pickle on NCCL
  (and a device round trip). They refuse any object holding a tensor.

At world size 1 the helpers still run the collective (a one-GPU run exercises every
collective's device and dtype); without an initialised process group they are the
identity (one process, no torch.distributed at all).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
_DEVICE_BY_BACKEND: dict[str, str] = {"nccl": "cuda", "gloo": "cpu", "mpi": "cpu"}


def active() -> bool:
    """Whether a default process group exists (else every helper is the identity)."""
    return dist.is_available() and dist.is_initialized()


def size(group=None) -> int:
    """Ranks in ``group`` (None: the default group); 1 without a process group."""
    return dist.get_world_size(group) if active() else 1


def rank(group=None) -> int:
    """This process's rank in ``group``; 0 without a process group."""
    return dist.get_rank(group) if active() else 0


def global_rank(group, k: int) -> int:
    """The global rank of ``group``'s rank ``k`` (None: the default group)."""
    return k if group is None or not active() else dist.get_global_rank(group, k)


def group_ranks(group) -> list[int]:
    """The global ranks of ``group``, in group order."""
    return dist.get_process_group_ranks(group) if active() else [0]


def device_of(group=None) -> torch.device:
    """The device a tensor handed to a collective over ``group`` must live on: the
    current CUDA device for NCCL, the CPU for gloo (and without a process group)."""
    if not active():
        return torch.device("cpu")
    backend = str(dist.get_backend(group)).lower()
    kind = _DEVICE_BY_BACKEND.get(backend, "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def _checked(t: torch.Tensor, group, what: str) -> torch.Tensor:
    want = device_of(group)
    if t.device.type != want.type:
        raise ValueError(
            f"collectives.{what}: a {t.device.type} tensor handed to a collective over a "
            f"{dist.get_backend(group)} group, whose tensors live on {want.type}: allocate "
            f"it on collectives.device_of(group), or pass Python values to the value "
            f"helpers (sum_values, max_values, all_gather_object)")
    return t


# ---------------------------------------------------------------- tensors, in place
def all_reduce(t: torch.Tensor, op: str = "sum", group=None, async_op: bool = False):
    """In-place all-reduce of ``t`` (on the group's device) over ``group``; returns the
    work handle with ``async_op``."""
    if not active():
        return _Done() if async_op else None
    return dist.all_reduce(_checked(t, group, "all_reduce"), op=_OPS[op], group=group,
                           async_op=async_op)


def broadcast(t: torch.Tensor, src: int = 0, group=None, async_op: bool = False):
    """In-place broadcast of ``t`` from ``group``'s rank ``src`` (a group rank, not a
    global one)."""
    if not active():
        return _Done() if async_op else None
    return dist.broadcast(_checked(t, group, "broadcast"), global_rank(group, src),
                          group=group, async_op=async_op)


def all_gather(t: torch.Tensor, group=None) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape and dtype everywhere), in group order."""
    if not active():
        return [t]
    t = _checked(t, group, "all_gather").contiguous()
    parts = [torch.empty_like(t) for _ in range(size(group))]
    dist.all_gather(parts, t, group=group)
    return parts


def send(t: torch.Tensor, dst: int, group=None) -> None:
    """Point-to-point send to global rank ``dst``."""
    dist.send(_checked(t, group, "send").contiguous(), dst, group=group)


def recv(t: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Point-to-point receive into ``t`` from global rank ``src``."""
    dist.recv(_checked(t, group, "recv"), src, group=group)
    return t


def barrier(group=None) -> None:
    """Every rank of ``group`` reaches this point (run at world size 1 too)."""
    if active():
        dist.barrier(group=group)


# ---------------------------------------------------------------- Python values
def reduce_values(values: Sequence[float], op: str = "sum", group=None,
                  dtype: torch.dtype = torch.float64) -> list[float]:
    """``values`` reduced element-wise over ``group`` (allocated on its device)."""
    t = torch.tensor([float(v) for v in values], dtype=dtype, device=device_of(group))
    if active() and t.numel():
        dist.all_reduce(t, op=_OPS[op], group=group)
    return t.tolist()


def sum_values(values: Sequence[float], group=None) -> list[float]:
    """Element-wise float64 sum of ``values`` over ``group``."""
    return reduce_values(values, "sum", group)


def max_values(values: Sequence[float], group=None) -> list[float]:
    """Element-wise maximum of ``values`` over ``group``."""
    return reduce_values(values, "max", group)


def broadcast_values(values: Sequence[int], src: int = 0, group=None) -> list[int]:
    """Group rank ``src``'s int64 ``values`` on every rank of ``group`` (every rank
    passes a sequence of the same length)."""
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=device_of(group))
    if active() and t.numel():
        dist.broadcast(t, global_rank(group, src), group=group)
    return t.tolist()


def all_gather_object(obj: Any, group=None) -> list:
    """Every rank's ``obj`` (picklable, holding no tensor), in group order."""
    _no_tensors(obj, "all_gather_object")
    if not active():
        return [obj]
    out: list = [None] * size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj: Any, src: int = 0, group=None) -> Any:
    """Group rank ``src``'s ``obj`` (picklable, holding no tensor) on every rank."""
    if rank(group) == src:
        _no_tensors(obj, "broadcast_object")
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=global_rank(group, src), group=group)
    return box[0]


def _no_tensors(obj: Any, what: str, depth: int = 0) -> None:
    if isinstance(obj, torch.Tensor):
        raise TypeError(f"collectives.{what}: the object holds a tensor; objects are "
                        "pickled through the group's device, so send tensors with the "
                        "tensor helpers (all_gather, broadcast) instead")
    if depth > 4:
        return
    if isinstance(obj, dict):
        for v in obj.values():
            _no_tensors(v, what, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for v in obj:
            _no_tensors(v, what, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            _no_tensors(v, what, depth + 1)


class _Done:
    """The work handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

