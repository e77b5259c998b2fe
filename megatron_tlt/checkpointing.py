"""A run's whole state in one place, saved and restored exactly.

``RunState`` gathers what a resumed run needs to continue as if it had never stopped:
the step counter, the policy (model shard, optimizer, LR schedule), the prompt
sampler's position, every RNG stream, the speculative-strategy tuner and the drafter
(with its online optimizer state when the drafter group trains it).
Each rank writes its own file (its TP/PP shard and its RNG), into
``{save}/step_{N:07d}/``; the folder becomes visible under its final name only once
every rank has written (a temporary name, then a rename by rank 0 after a barrier),
and ``{save}/latest`` names the newest complete one. A crash mid-save leaves the
previous checkpoint intact.
"""

from __future__ import annotations

import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed here (missing, incomplete, other layout)."""


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        from megatron.core import tensor_parallel

        state["megatron"] = tensor_parallel.get_cuda_rng_tracker().get_states()
    except Exception:  # noqa: BLE001 - tracker absent before model-parallel init
        pass
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
    if "megatron" in state:
        from megatron.core import tensor_parallel

        tensor_parallel.get_cuda_rng_tracker().set_states(state["megatron"])


@dataclass
class RunState:
    """Everything a run carries from step to step (see the module docstring)."""

    step: int = 0                      # completed RL steps
    policy: Any = None                 # rl.policy.Policy (state_dict / load_state_dict)
    sampler: Any = None                # rl.data.PromptSampler
    tuner: Any = None                  # rollout.speculative.tuner.StrategyTuner or None
    drafter: Any = None                # models.drafter.EagleDrafter or None
    drafter_group: Any = None          # drafter_training.group.DrafterGroup or None
    extra: dict = field(default_factory=dict)  # small JSON-able counters
    # for readers outside the run (models.export): the model's HF config and source
    meta: dict = field(default_factory=dict)

    def state_dict(self) -> dict:
        out = {"step": self.step, "policy": self.policy.state_dict(),
               "sampler": self.sampler.state_dict() if self.sampler is not None else None,
               "rng": rng_state(), "extra": dict(self.extra), "meta": dict(self.meta)}
        if self.tuner is not None:
            out["tuner"] = self.tuner.state_dict()
        if self.drafter is not None:
            out["drafter"] = self.drafter.own_state()
            out["drafter_config"] = self.drafter.config.to_dict()
        if self.drafter_group is not None:  # the drafter's optimizer and schedule
            out["drafter_group"] = self.drafter_group.state_dict()
        return out

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.policy.load_state_dict(state["policy"])
        if self.sampler is not None and state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self.tuner is not None and "tuner" in state:
            self.tuner.load_state_dict(state["tuner"])
        if self.drafter is not None and "drafter" in state:
            self.drafter.load_own_state(state["drafter"])
        if self.drafter_group is not None and "drafter_group" in state:
            self.drafter_group.load_state_dict(state["drafter_group"])
        self.extra = dict(state.get("extra", {}))
        set_rng_state(state["rng"])


def _rank_file(layout) -> str:
    return f"rank_tp{layout.tp_rank}_pp{layout.pp_rank}_dp{layout.dp_rank}.pt"


def save(state: RunState, folder: str | Path, layout) -> Path:
    """Write ``state`` as ``folder/step_N``; every rank calls it. Returns the path."""
    root = Path(folder)
    final = root / f"step_{state.step:07d}"
    tmp = root / f".step_{state.step:07d}.partial"
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True, exist_ok=True)
    _barrier()
    payload = state.state_dict()
    payload["layout"] = {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size}
    torch.save(payload, tmp / _rank_file(layout))
    _barrier()
    if rank == 0:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = root / ".latest.tmp"
        latest_tmp.write_text(final.name + "\n")
        os.replace(latest_tmp, root / "latest")
    _barrier()
    return final


def latest(folder: str | Path) -> Optional[Path]:
    """The newest complete checkpoint under ``folder`` (None if there is none)."""
    root = Path(folder)
    marker = root / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if path.is_dir():
            return path
    steps = sorted(p for p in root.glob("step_*") if p.is_dir())
    return steps[-1] if steps else None


def load(state: RunState, folder: str | Path, layout) -> Path:
    """Restore ``state`` from the newest checkpoint under ``folder`` (or ``folder``
    itself when it is a ``step_N`` folder)."""
    root = Path(folder)
    path = root if root.name.startswith("step_") else latest(root)
    if path is None or not path.is_dir():
        raise CheckpointError(f"checkpoint.load={folder}: no checkpoint found (expected "
                              f"step_N folders written by checkpoint.save)")
    f = path / _rank_file(layout)
    if not f.is_file():
        have = sorted(p.name for p in path.glob("rank_*.pt"))
        raise CheckpointError(
            f"{path} has no file for this rank ({f.name}); it holds {have}. Resume with "
            f"the parallel layout it was saved with (TP, PP and DP sizes)")
    payload = torch.load(f, map_location="cpu", weights_only=False)
    saved = payload.get("layout", {})
    here = {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size}
    if saved and saved != here:
        raise CheckpointError(f"{path} was saved with layout {saved}, this run is {here}")
    state.load_state_dict(payload)
    return path


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
