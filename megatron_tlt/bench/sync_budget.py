"""Count host synchronisations per decode step (tests and the bench tools).

On a GPU a host read of a device value stalls the launch queue until the device has
caught up, and breaks CUDA-graph capture. On CPU nothing stalls, so such reads go
unnoticed; this module counts them where they would happen:

    with HostSyncCounter() as c:
        with per_decode_step(engine) as steps:
            engine.generate(prompts, params)
    steps[i].count, steps[i].speculative, steps[i].where   # per decode step

What counts (a ``TorchFunctionMode`` sees every tensor method and torch function):

- reading a value: ``item``, ``tolist``, ``bool(t)`` / ``if t``, ``int(t)``,
  ``float(t)``, ``t.__index__`` (a tensor used as a Python index), ``repr``/``str``;
- copies to the host: ``t.cpu()``, ``t.numpy()``, ``t.to("cpu")`` (named as a string:
  on a CPU run ``t.to(self.device)`` cannot be told from a host copy, so only copies
  the code names as host copies count);
- data-dependent shapes: ``nonzero``, ``argwhere``, one-argument ``torch.where``,
  ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` with tensor repeats
  and no ``output_size``, boolean-mask indexing (``t[mask]``, ``t[mask] = v``);
- ``torch.equal`` / ``allclose`` (a Python bool from device values).

A host-to-device copy (``torch.tensor(list, device=...)``) does not count: it does not
wait for the device. Only the outermost call counts (a counted call's own internals
are not seen). A TorchFunctionMode slows eager code several times over, so counting
passes are run apart from timed ones.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
# value reads and host copies (tensor methods and their torch.* forms)
_READS = {_T.item, _T.tolist, _T.__bool__, _T.__int__, _T.__float__, _T.__index__,
          _T.__complex__, _T.__repr__, _T.__str__, _T.__format__, _T.cpu, _T.numpy,
          torch.equal, torch.allclose, _T.equal, _T.allclose}
# outputs whose shape depends on the values
_SHAPES = {torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.masked_select,
           _T.masked_select, torch.unique, _T.unique, torch.unique_consecutive,
           _T.unique_consecutive, torch.bincount, _T.bincount}
_PACKAGE = str(Path(__file__).resolve().parents[1])  # megatron_tlt/
_HERE = str(Path(__file__).resolve())


def _is_mask(index) -> bool:
    if isinstance(index, torch.Tensor):
        return index.dtype == torch.bool and index.dim() > 0
    if isinstance(index, (tuple, list)):
        return any(_is_mask(i) for i in index)
    return False


def _is_host_copy(args, kwargs) -> bool:
    dev = kwargs.get("device")
    if dev is None and len(args) > 1:
        dev = args[1]
    return isinstance(dev, str) and dev.split(":")[0] == "cpu"


def is_sync(func, args, kwargs) -> bool:
    """Whether this call would wait for the device on a GPU."""
    if func in _READS or func in _SHAPES:
        return True
    if func in (_T.__getitem__, _T.__setitem__):
        return len(args) > 1 and _is_mask(args[1])
    if func is _T.to:
        return _is_host_copy(args, kwargs)
    if func is torch.where:
        return len(args) + len(kwargs) == 1
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        reps = args[1] if len(args) > 1 else kwargs.get("repeats")
        return (isinstance(reps, torch.Tensor) and reps.numel() != 1
                and kwargs.get("output_size") is None)
    return False


def _caller() -> str:
    """file:line of the innermost frame in megatron_tlt (this module excluded)."""
    f = sys._getframe(2)
    first = None
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_PACKAGE) and name != _HERE:
            return f"{Path(name).relative_to(Path(_PACKAGE).parent)}:{f.f_lineno}"
        if first is None and "torch" not in name and name != _HERE:
            first = f"{name}:{f.f_lineno}"
        f = f.f_back
    return first or "?"


class HostSyncCounter(TorchFunctionMode):
    """Counts the calls that would synchronise with the device (module docstring),
    with where each happened (``where``: file:line -> count)."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if is_sync(func, args, kwargs):
            self.count += 1
            self.where[f"{_caller()} {getattr(func, '__name__', func)}"] += 1
        return func(*args, **kwargs)


@dataclass
class StepSyncs:
    """One decode step's host synchronisations."""

    speculative: bool
    rows: int
    count: int
    where: Counter = field(default_factory=Counter)


@contextlib.contextmanager
def per_decode_step(engine, counter: HostSyncCounter) -> Iterator[list[StepSyncs]]:
    """Attribute ``counter``'s syncs to ``engine``'s decode steps
    (``RolloutEngine._decode_step``: the plain or speculative step, its commit and the
    finished-rows check). Yields the list the steps are appended to."""
    steps: list[StepSyncs] = []
    inner: Callable = engine._decode_step

    def counted(*args, **kwargs):
        n0, w0 = counter.count, counter.where.copy()
        stats = engine.last_stats
        rows = len(args[1]) if len(args) > 1 else 0
        inner(*args, **kwargs)
        spec = bool(stats.step_speculative and stats.step_speculative[-1])
        steps.append(StepSyncs(spec, rows, counter.count - n0, counter.where - w0))
        return None

    engine._decode_step = counted
    try:
        yield steps
    finally:
        del engine._decode_step  # the class's method again


def measure(engine, prompts, params, **kwargs) -> list[StepSyncs]:
    """Run ``engine.generate(prompts, params, **kwargs)`` counting syncs per decode
    step."""
    with HostSyncCounter() as counter, per_decode_step(engine, counter) as steps:
        engine.generate(prompts, params, **kwargs)
    return steps


def summary(steps: list[StepSyncs]) -> dict:
    """The most syncs any plain / speculative step made (None: no such step) and
    where the syncs of those steps happened."""
    out: dict = {}
    for name, spec in (("plain", False), ("spec", True)):
        mine = [s for s in steps if s.speculative == spec]
        out[f"host_syncs_{name}_step"] = max((s.count for s in mine), default=None)
        where: Counter = Counter()
        for s in mine:
            where.update(s.where)
        out[f"host_syncs_{name}_where"] = {k: v / len(mine) for k, v in where.items()} \
            if mine else {}
    return out


def worst(steps: list[StepSyncs], speculative: bool) -> Optional[StepSyncs]:
    """The step of that kind with the most syncs."""
    mine = [s for s in steps if s.speculative == speculative]
    return max(mine, key=lambda s: s.count) if mine else None


def plain_and_spec_syncs(engine, drafter, prompts, params, strategy: str) -> dict:
    """The most syncs any plain step made and the most any speculative step of the fixed
    ``strategy`` made (``drafter``, speculating at every batch size), with where the
    speculative ones happen: counting passes of ``prompts`` (not timed). The engine's
    speculative config and tuner are restored, ``drafter`` attached again."""
    from ..config import SpeculativeConfig

    saved, tuner = engine.config.speculative, engine.tuner
    engine.detach_drafter()
    plain = summary(measure(engine, prompts, params))
    engine.config.speculative = SpeculativeConfig(policy="fixed", strategy=strategy,
                                                  threshold=1 << 30)
    engine.attach_drafter(drafter)
    spec = summary(measure(engine, prompts, params))
    engine.config.speculative = saved
    engine.detach_drafter()
    engine.attach_drafter(drafter, tuner)
    return {"host_syncs_plain_step": plain["host_syncs_plain_step"],
            "host_syncs_spec_step": spec["host_syncs_spec_step"],
            "host_syncs_spec_where": spec["host_syncs_spec_where"]}
