"""The policy's weights and optimizer state through megatron-core ``dist_checkpointing``.

The state dict is megatron-core's sharded one (``GPTModel.sharded_state_dict``): every
tensor is named by its global key with its slice of the global shape, and a tensor
replicated over data-parallel ranks is written by one of them only, so each shard is
on disk once whatever the DP size. Loading asks for the slices this rank's layout
needs, which reshards a checkpoint saved at another TP, PP or DP size.

Optimizer state follows the same keys: megatron-core's optimizer builds its sharded
state dict itself (``sharded_state_dict``); ``train.optimizer=torch`` (torch AdamW)
gets one here from megatron-core's own helpers (``optim_state_to_sharding_state``),
its moments keyed like the parameters they belong to. The per-parameter step and the
parameter groups are plain data (megatron-core's ``common.pt``, read back with
``weights_only=True``); the LR schedule is the caller's JSON.

``_extra_state`` entries (TransformerEngine FP8 metadata, pickled objects in
``dist_checkpointing``) are left out: no FP8 is trained here, and a checkpoint then
holds tensors and plain data only (``safe_files.check_dcp_metadata`` enforces it on
load).

A save starts no process that outlives its rank (``writers_die_with_rank``).

An asynchronous save (``save_policy(..., background=...)``) goes through megatron-core's
own async path: ``dist_checkpointing.save(..., async_sharded_save=True)`` plans the save
and returns an ``AsyncRequest``, which ``checkpoint.background.BackgroundSaves``
schedules on megatron-core's ``AsyncCallsQueue``. The queue's caller forks one process
that writes the shards (it forks the file writers in turn); the rank goes on at once.
What the fork writes is a snapshot of the moment it was scheduled: on GPU the shards are
first copied to host memory (megatron-core's preload), and on CPU, where that copy is
no copy at all, the fork itself is the snapshot, the child's memory being a
copy-on-write image of the rank's (a tensor in shared memory, which a fork does not
copy, is cloned first). See ``background``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import pickle
import queue
import shutil
import signal
import tempfile
from pathlib import Path

import torch

from ..fileio import write_bytes_atomic
from ..optim_state import allocate_adam_state
from ..runtime_env import cuda_placements_on_cpu
from .safe_files import CheckpointError, check_common_pt, check_dcp_metadata


def model_sharded_state_dict(module) -> dict:
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    return {k: v for k, v in module.sharded_state_dict().items()
            if not isinstance(v, ShardedObject) and not k.endswith("_extra_state")}


def _torch_optimizer_sharded(optimizer, model_sd: dict, is_loading: bool) -> dict:
    from megatron.core.dist_checkpointing.optimizer import (
        get_param_id_to_sharded_param_map, optim_state_to_sharding_state)

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if is_loading:  # the tensors to load into (the policy allocates them when built)
        allocate_adam_state(optimizer)
    state = optimizer.state_dict()
    steps = {float(s["step"]) for s in state["state"].values() if "step" in s}
    if len(steps) > 1:
        raise CheckpointError(f"optimizer steps differ per parameter ({sorted(steps)}); "
                              f"cannot store them as one")
    id_map = get_param_id_to_sharded_param_map(model_sd, params)
    optim_state_to_sharding_state(state, id_map, exclude_keys=("step",))
    if steps:
        state["state"]["common_step"] = steps.pop()
    return state


def _load_torch_optimizer(optimizer, state: dict) -> None:
    step = state["state"].pop("common_step", None)
    if step is not None:
        for s in state["state"].values():
            s["step"] = torch.tensor(float(step))
    optimizer.load_state_dict(state)


def policy_sharded_state_dict(policy, is_loading: bool = False) -> dict:
    if getattr(policy, "lent", False):  # rl/offload.py: the optimizer state is elsewhere
        raise CheckpointError("the policy's optimizer state is lent to the rollout "
                              "(train.offload_during_rollout): restore it before a save "
                              "or a load (UpdateMemory.restore)")
    model_sd = model_sharded_state_dict(policy.module)
    if policy.kind == "megatron":
        with cuda_placements_on_cpu():
            optim = policy.optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    else:
        optim = _torch_optimizer_sharded(policy.optimizer, model_sd, is_loading)
    return {"model": model_sd, "optimizer": optim}


def save_policy(policy, folder: Path, *, background=None, then=None) -> None:
    """Every rank calls it (a collective); ``folder`` must exist and be empty.

    ``background`` (a ``background.BackgroundSaves``): write the shards in a background
    process and return once they are snapshotted; ``then`` (no arguments) runs on every
    rank when ``background`` finalizes the save, after every rank's writes finished and
    megatron-core wrote its metadata. Without ``background`` the save is synchronous
    and ``then`` runs before it returns."""
    from megatron.core import dist_checkpointing

    if background is None:
        with cuda_placements_on_cpu(), writers_die_with_rank():
            dist_checkpointing.save(policy_sharded_state_dict(policy), str(folder))
        if then is not None:
            then()
        return
    results = ResultsFile()

    def finalized():
        results.remove()  # read by megatron-core's finalize step (absent: nothing written)
        if then is not None:
            then()

    with cuda_placements_on_cpu(), writers_die_with_rank(results):
        request = dist_checkpointing.save(policy_sharded_state_dict(policy), str(folder),
                                          async_sharded_save=True)
        background.schedule(request, finalized)


def verify_policy(folder: Path) -> None:
    """The checks a load makes before megatron-core opens any file (see module doc):
    safe metadata, every data file present and long enough, a safe ``common.pt``."""
    folder = Path(folder)
    for f, need in check_dcp_metadata(folder).items():
        path = folder / f
        if not path.is_file():
            raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
        if path.stat().st_size < need:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, its metadata "
                                  f"needs {need}; the file is truncated")
    check_common_pt(folder)


def load_policy(policy, folder: Path) -> None:
    """Load weights and optimizer state into ``policy``, resharding to this rank's
    layout. Every rank calls it."""
    from megatron.core import dist_checkpointing

    sd = policy_sharded_state_dict(policy, is_loading=True)
    with cuda_placements_on_cpu():
        loaded = dist_checkpointing.load(sd, str(folder))
    model = loaded["model"]
    own = policy.module.state_dict()
    for k, v in own.items():  # the left-out _extra_state entries keep their value
        if k not in model and k.endswith("_extra_state"):
            model[k] = v
    policy.module.load_state_dict(model, strict=True)
    if policy.kind == "megatron":
        policy.optimizer.load_state_dict(loaded["optimizer"])
    else:
        _load_torch_optimizer(policy.optimizer, loaded["optimizer"])


# ------------------------------------------------------------------ writer processes
_WRITER_PARENT = {"pid": None}  # set while a save runs: the rank its writers belong to


def _writer_dies_with_rank() -> None:
    """In a process forked during a save (megatron-core's writers): have the kernel
    SIGKILL it when the process that forked it dies (``prctl(PR_SET_PDEATHSIG)``,
    Linux), so a killed rank leaves no writer behind, however deep the forks go."""
    parent = _WRITER_PARENT["pid"]
    if parent is None:
        return
    _WRITER_PARENT["pid"] = os.getpid()  # and this child's own forks die with it
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (AttributeError, OSError):  # not Linux: nothing to set
        return
    if os.getppid() != parent:  # the rank died before the call above
        os._exit(1)


_HOOKED = []


class ResultsFile:
    """The results queue of an asynchronous save: what megatron-core's background
    writer process reports (its write results, or the exception it hit) travels to the
    rank through a file in a private temporary folder (mode 0700), read once by the
    finalize step and removed. It replaces megatron-core's ``multiprocessing`` manager
    queue (a process of its own that would outlive a killed rank) and a pipe (which
    would block the writer's exit on a large result until the rank reads it)."""

    def __init__(self):
        self.folder = Path(tempfile.mkdtemp(prefix="megatron_tlt_save_"))
        self.path = self.folder / "results"

    def put(self, obj) -> None:  # in the background writer
        write_bytes_atomic(self.path, pickle.dumps(obj))

    def get_nowait(self):  # in the rank, once every rank's writer has finished
        if not self.path.is_file():
            raise queue.Empty
        data = self.path.read_bytes()
        self.remove()
        return pickle.loads(data)  # noqa: S301 - written by this rank's own writer

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@contextlib.contextmanager
def writers_die_with_rank(results=None):
    """Around ``dist_checkpointing.save``: its writer processes die with this rank.

    megatron-core's torch_dist strategy forks one writer per file bucket and keeps its
    results queue in a ``multiprocessing`` manager process it spawns once per rank; a
    SIGKILLed rank would leave both running. Every process forked inside this context,
    and every process those fork in turn (an asynchronous save's background writer and
    its file writers), gets the parent-death signal (``_writer_dies_with_rank``); the
    results queue becomes ``results`` (a ``ResultsFile``, for an asynchronous save), or
    a plain in-process queue (a synchronous save fills and reads it in this process
    only), so no manager process is started at all."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not _HOOKED:
        os.register_at_fork(after_in_child=_writer_dies_with_rank)
        _HOOKED.append(True)
    swap = hasattr(filesystem_async, "_results_queue")
    previous = getattr(filesystem_async, "_results_queue", None)
    if swap:
        filesystem_async._results_queue = results if results is not None else queue.Queue()
    _WRITER_PARENT["pid"] = os.getpid()
    try:
        yield
    finally:
        _WRITER_PARENT["pid"] = None
        if swap:
            filesystem_async._results_queue = previous
