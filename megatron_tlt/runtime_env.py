"""Device, backend and distributed start-up: the one module that knows about hardware.

On a CUDA machine this module picks CUDA + NCCL and changes nothing in torch or
megatron-core. On a machine without CUDA it picks CPU + gloo and redirects the few
places where megatron-core assumes a CUDA device (see ``apply_cpu_redirection``), so
the real megatron-core model, parallel groups and pipeline schedules run on CPU.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import random
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

__all__ = [
    "Platform",
    "THREAD_VARS",
    "apply_cpu_redirection",
    "cap_threads",
    "cpu_redirection_applied",
    "choose_device",
    "cuda_placements_on_cpu",
    "init_distributed",
    "seed_everything",
    "silence_expected_warnings",
    "thread_budget",
    "thread_env",
    "threads_for",
]


@dataclass(frozen=True)
class Platform:
    """What this process runs on, as decided once at start-up."""

    device: torch.device
    backend: str
    rank: int
    world_size: int
    local_rank: int


def choose_device(device: str = "auto", backend: str = "auto") -> tuple[torch.device, str]:
    """Return (device type, process-group backend) for a request of "auto"/"cuda"/"cpu"."""
    if device not in ("auto", "cuda", "cpu"):
        raise ValueError(f"platform.device must be 'auto', 'cuda' or 'cpu', got {device!r}")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "platform.device='cuda' was requested but torch reports no CUDA device "
            f"(torch {torch.__version__}); use platform.device=auto or install a CUDA build"
        )
    if backend == "auto":
        backend = "nccl" if device == "cuda" else "gloo"
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"platform.backend must be 'auto', 'nccl' or 'gloo', got {backend!r}")
    if backend == "nccl" and device != "cuda":
        raise ValueError("platform.backend='nccl' needs CUDA; use 'gloo' on CPU")
    return torch.device(device), backend


def init_distributed(
    device: str = "auto", backend: str = "auto", timeout_minutes: float = 30.0
) -> Platform:
    """Initialise torch.distributed from torchrun's environment, or as a 1-process world.

    Idempotent: a second call returns the same description without re-initialising.
    """
    dev_type, backend = choose_device(device, backend)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if dev_type.type == "cuda":
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        apply_cpu_redirection()
        dev = torch.device("cpu")
    if not dist.is_initialized():
        timeout = datetime.timedelta(minutes=timeout_minutes)
        if "RANK" in os.environ:  # launched by torchrun / srun with a rendezvous
            dist.init_process_group(backend=backend, rank=rank, world_size=world_size,
                                    timeout=timeout)
        else:  # a plain `python ...` run: a 1-process world with an in-memory store
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0,
                                    world_size=1, timeout=timeout)
    return Platform(dev, backend, rank, world_size, local_rank)


# Warnings megatron-core prints on every import where apex / Transformer Engine are
# absent (apex is never installable from a registry; the fallbacks are what we use).
EXPECTED_WARNINGS = (
    r".*Apex is not installed.*",
    r".*Transformer Engine and Apex are not installed.*",
    r"full scope is deprecated.*",
    # megatron-core says this for every selective recomputation of core attention
    r"If you are using transformer_engine as the transformer implementation.*",
)


def silence_expected_warnings() -> None:
    """Entry points call this so users see their output, not known import noise."""
    import warnings

    for pattern in EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and, when present, every CUDA device).

    megatron-core's model-parallel RNG tracker is seeded separately, after the model
    parallel groups exist (``parallel.initialize_model_parallel``).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


# --------------------------------------------------------------------------------------
# CPU redirection for megatron-core
# --------------------------------------------------------------------------------------

_CPU = torch.device("cpu")
_APPLIED = False


def cpu_redirection_applied() -> bool:
    return _APPLIED


def _is_cuda_device(value) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    if isinstance(value, str):
        return value.startswith("cuda")
    return False


class _CudaToCpuMode(TorchFunctionMode):
    """Maps explicit CUDA placements (device="cuda", Tensor.cuda(), .to("cuda")) to CPU.

    megatron-core's pipeline schedules, DDP buffers and a few utilities create tensors
    on "cuda" directly. Used only while CUDA is absent. ``Tensor.type()`` (the query,
    no arguments) names a CPU tensor's CUDA type: megatron-core's mixed-precision
    optimizer sorts its parameters by "torch.cuda.BFloat16Tensor" and the like.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
        if _is_cuda_device(kwargs.get("device")):
            kwargs["device"] = _CPU
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


class _CpuRNGStatesTracker:
    """Drop-in for megatron-core's CudaRNGStatesTracker that keeps CPU generator states.

    megatron-core forks named RNG streams (data-parallel, tensor-parallel, expert) around
    dropout and initialisation; on CPU the streams are CPU generator states.
    """

    def __init__(self):
        self.reset()

    def is_initialized(self):
        return self._is_initialized

    def reset(self):
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self):
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states):
        self._is_initialized = True
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name, seed):
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        generator = torch.Generator().manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name="model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        original = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(original)


class _CpuStream:
    """Stands in for ``torch.cuda.Stream`` without CUDA: CPU work is in program order,
    so waiting, events and stream contexts have nothing to order. megatron-core's
    all-to-all token dispatcher (mixture-of-experts) copies its split sizes to the host
    on a side stream and synchronises on an event. Every instance is one object."""

    _one = None

    def __new__(cls, *args, **kwargs):
        if cls._one is None:
            cls._one = super().__new__(cls)
        return cls._one

    def wait_stream(self, stream) -> None:
        pass

    def record_event(self, event=None):
        return self

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True



def cuda_placements_on_cpu():
    """Context in which ``device="cuda"`` / ``.cuda()`` land on CPU; inert with CUDA."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    return _CudaToCpuMode()


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _cpu_sliding_window_causal_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(mu, diagonal=skv - sq + window_size[1])


def apply_cpu_redirection() -> bool:
    """Make megatron-core's CUDA assumptions land on CPU. Returns True if applied.

    Inert when ``torch.cuda.is_available()``: GPU runs never go through it. What it
    redirects (measured against megatron-core 0.16):
      1. ``torch.cuda.current_device()`` (RoPE buffers, global memory buffer, p2p
         buffers) returns the CPU device;
      2. the model-parallel RNG tracker keeps CPU generator states, and the "CUDA"
         generator state that activation recomputation saves and restores around a
         checkpointed region is empty (the CPU generator, which that code saves as
         well, is the only one);
      3. ``get_default_causal_mask`` / sliding-window masks build on CPU;
      4. ``torch.cuda.synchronize`` (dist_checkpointing, timers) is a no-op;
      5. ``torch.cuda.Stream`` / ``current_stream`` / ``stream`` are a stand-in whose
         waits and events do nothing (``_CpuStream``: the MoE all-to-all dispatcher);
      6. the MoE all-to-all dispatcher's host copies of its split sizes become NumPy
         arrays on CPU too (it converts only CUDA tensors, and
         ``all_to_all_single`` refuses a tensor of split sizes).
    Explicit ``device="cuda"`` / ``.cuda()`` placements (pipeline schedules, DDP) are
    redirected only inside ``cuda_placements_on_cpu()``: a TorchFunctionMode costs
    3-4x in a 135M-parameter forward pass, so it is never left on globally.
    """
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True

    torch.cuda.current_device = lambda: _CPU
    torch.cuda.synchronize = lambda device=None: None
    torch.cuda.Stream = _CpuStream
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()

    import megatron.core.tensor_parallel.random as mrandom
    import megatron.core.transformer.utils as mutils

    mrandom._CUDA_RNG_STATE_TRACKER = _CpuRNGStatesTracker()
    mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.empty(0, dtype=torch.uint8)
    mrandom._set_cuda_rng_state = lambda *args, **kwargs: None
    import megatron.core.transformer.moe.token_dispatcher as dispatcher

    to_host = dispatcher.maybe_move_tensor_to_cpu

    def _to_host(tensor, as_numpy=False, record_stream=False):
        if as_numpy and isinstance(tensor, torch.Tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_host(tensor, as_numpy=as_numpy, record_stream=record_stream)

    dispatcher.maybe_move_tensor_to_cpu = _to_host
    mutils.get_default_causal_mask = _cpu_causal_mask
    mutils.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    try:
        import megatron.core.fusions.fused_softmax as fsoftmax

        fsoftmax.get_default_causal_mask = _cpu_causal_mask
        fsoftmax.get_sliding_window_causal_mask = _cpu_sliding_window_causal_mask
    except ImportError:  # pragma: no cover - module layout differs across versions
        pass

    _APPLIED = True
    return True


# --------------------------------------------------------------------------------------
# Threads: how many each process runs, and what the processes it starts inherit
# --------------------------------------------------------------------------------------

# the thread pools a process may start: OpenMP (torch's intra-op pool), MKL, OpenBLAS
# (NumPy) and Rayon (Hugging Face tokenizers); each defaults to one thread per core
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS",
               "RAYON_NUM_THREADS")


def thread_budget(env=None) -> int:
    """The threads this process and the ones it starts may use together:
    ``OMP_NUM_THREADS`` in ``env`` (default ``os.environ``) when set, else its cores."""
    env = os.environ if env is None else env
    value = env.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))


def threads_for(processes: int, env=None) -> int:
    """Each of ``processes`` processes started together (torchrun's ranks): this
    process's budget divided among them, at least one thread."""
    return max(1, thread_budget(env) // max(1, processes))


def thread_env(threads: int, env=None) -> dict:
    """A copy of ``env`` (default ``os.environ``) for a process to start, in which every
    thread pool (``THREAD_VARS``) has ``threads`` threads. torchrun passes it on to its
    ranks as it is (it sets ``OMP_NUM_THREADS=1`` only when unset)."""
    out = dict(os.environ if env is None else env)
    out.update({name: str(threads) for name in THREAD_VARS})
    return out


def cap_threads(threads: int) -> None:
    """This process runs ``threads`` torch threads, and the processes it starts inherit
    ``threads`` in every thread pool (``THREAD_VARS`` in ``os.environ``)."""
    os.environ.update(thread_env(threads, {}))
    torch.set_num_threads(threads)
