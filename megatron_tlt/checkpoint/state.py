"""``RunState``: everything a resumed run needs to continue as if it had never stopped.

The step counter, the policy (weights, optimizer, LR schedule), the prompt sampler's
position, every RNG stream, the speculative-strategy tuner, the drafter (weights, and
its optimizer when the drafter group trains it), the drafter group's data buffer and
what the drafter kinds draft from (``Drafter.drafting_state``: group_history's index).
``store.save`` writes it; this module splits it into its parts:

* ``global_state``: the same on every rank (step, model metadata, drafter config);
* ``rank_state``: what differs per rank (RNG streams, the replica's tuner, the drafter
  optimizer, the replica's buffered responses, the kinds' drafting state, the sampler
  and small counters);
* the policy and the drafter weights, written by ``sharded`` / the store.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch


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


def buffer_state(buffer) -> dict:
    """A drafter-group ``DataBuffer`` as tensors and numbers (its responses with their
    feature rows, the token count and the eviction counter)."""
    return {"budget": buffer.budget, "keep_steps": buffer.keep_steps,
            "tokens": buffer.tokens, "dropped": buffer.dropped,
            "records": [{"tokens": torch.tensor(r.tokens, dtype=torch.int64),
                         "prompt_len": r.prompt_len, "step": r.step, "features": r.features}
                        for r in buffer]}


def load_buffer_state(buffer, state: dict) -> None:
    from ..drafter_training.buffer import BufferedResponse

    buffer._items.clear()
    for r in state["records"]:
        buffer._items.append(BufferedResponse(r["tokens"].tolist(), int(r["prompt_len"]),
                                              r["features"], int(r["step"])))
    buffer.tokens = int(state["tokens"])
    buffer.dropped = int(state["dropped"])


@dataclass
class RunState:
    """Everything a run carries from step to step (see the module docstring)."""

    step: int = 0                      # completed RL steps
    policy: Any = None                 # rl.policy.Policy
    sampler: Any = None                # rl.data.PromptSampler
    tuner: Any = None                  # rollout.tuner.StrategyTuner or None
    drafter: Any = None                # models.drafter.EagleDrafter or None
    drafter_group: Any = None          # drafter_training.group.DrafterGroup or None
    drafters: dict = field(default_factory=dict)  # kind name -> the engine's Drafter
    extra: dict = field(default_factory=dict)  # small JSON-able counters
    # for readers outside the run (checkpoint.export): the model's HF config and source
    meta: dict = field(default_factory=dict)

    def global_state(self) -> dict:
        out = {"step": self.step, "meta": dict(self.meta)}
        if self.policy is not None:
            out["scheduler"] = self.policy.scheduler.state_dict()
        if self.drafter is not None:
            out["drafter_config"] = self.drafter.config.to_dict()
        return out

    def rank_state(self) -> dict:
        out = {"rng": rng_state(), "extra": dict(self.extra),
               "sampler": self.sampler.state_dict() if self.sampler is not None else None}
        if self.tuner is not None:
            out["tuner"] = self.tuner.state_dict()
        if self.drafter_group is not None:
            out["drafter_group"] = self.drafter_group.state_dict()
            out["drafter_buffer"] = buffer_state(self.drafter_group.buffer)
        drafting = {name: s for name, d in self.drafters.items()
                    if (s := d.drafting_state()) is not None}
        if drafting:
            out["drafting"] = drafting
        return out

    def load_global_state(self, state: dict) -> None:
        self.step = int(state["step"])
        if self.policy is not None and "scheduler" in state:
            self.policy.scheduler.load_state_dict(state["scheduler"])

    def load_rank_state(self, state: dict, *, same_tp: bool = True,
                        notes: list | None = None) -> None:
        """Restore this rank's part. ``same_tp`` False (a TP-resharded resume) skips
        the drafter optimizer state, whose tensors are TP shards; ``notes`` collects
        what was not restored."""
        notes = notes if notes is not None else []
        if self.sampler is not None and state.get("sampler") is not None:
            self.sampler.load_state_dict(state["sampler"])
        if self.tuner is not None and "tuner" in state:
            self.tuner.load_state_dict(state["tuner"])
        if self.drafter_group is not None and "drafter_group" in state:
            if same_tp:
                self.drafter_group.load_state_dict(state["drafter_group"])
            else:
                notes.append("drafter optimizer state not restored (TP size changed)")
            if "drafter_buffer" in state:
                load_buffer_state(self.drafter_group.buffer, state["drafter_buffer"])
        for name, s in state.get("drafting", {}).items():
            if name in self.drafters:
                self.drafters[name].load_drafting_state(s)
            else:
                notes.append(f"the {name} drafter's state not restored (not configured)")
        self.extra = dict(state.get("extra", {}))
        set_rng_state(state["rng"])
