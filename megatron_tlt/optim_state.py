"""The policy optimizer's Adam moments, allocated when the policy is built.

torch's Adam and AdamW create a parameter's moments on the first ``step()`` that sees
its gradient. In an RL run that is after the first rollout, which on a large recipe
is tens of minutes in: an optimizer state that does not fit would fail only then, and
the first optimizer step would carry the allocation (the moments of SmolLM2-135M are
1.1 GB of fresh pages: 0.4-2.5 s on the 2-core CPU machine, see docs/planning.md).
Allocating them with the model makes the resident memory what the dry run's memory
model says from the start (``rl/memory_model.py``: "optimizer", resident) and makes
the first step cost what every later one does.

The state made here is the one the optimizer would make itself (same keys, dtypes,
devices and values), so the steps that follow are bit-identical (tested).
"""
from __future__ import annotations

import torch


def torch_optimizers(optimizer) -> list[tuple[object, torch.optim.Optimizer]]:
    """The torch optimizers inside ``optimizer`` (a torch optimizer, a megatron-core
    optimizer, or megatron-core's chained optimizer), each with its megatron-core
    wrapper (or None)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [(None, optimizer)]
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:
        return [pair for c in chained for pair in torch_optimizers(c)]
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return [(optimizer, inner)]
    return []


def _step_tensor(group: dict, device: torch.device) -> torch.Tensor:
    # torch's rule (torch/optim/adam.py, _init_group): a 0-d float step on the
    # parameter's device when fused or capturable, else on the CPU at the scalar dtype
    if group.get("fused") or group.get("capturable"):
        return torch.zeros((), dtype=torch.float32, device=device)
    dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    return torch.tensor(0.0, dtype=dtype)


def allocate_adam_state(optimizer) -> int:
    """Create every parameter's Adam moments now (those without state); returns the
    bytes allocated. torch Adam/AdamW get exactly their own lazily made state; another
    optimizer inside a megatron-core wrapper (a fused Adam on GPU) gets the wrapper's
    ``init_state_fn``, the one megatron-core uses before loading a checkpoint."""
    before = 0
    after = 0
    for wrapper, opt in torch_optimizers(optimizer):
        before += _state_bytes(opt)
        if type(opt) in (torch.optim.Adam, torch.optim.AdamW):
            for group in opt.param_groups:
                for p in group["params"]:
                    st = opt.state[p]
                    if st:
                        continue
                    st["step"] = _step_tensor(group, p.device)
                    st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if group.get("amsgrad"):
                        st["max_exp_avg_sq"] = torch.zeros_like(
                            p, memory_format=torch.preserve_format)
        elif wrapper is not None and getattr(wrapper, "init_state_fn", None) is not None:
            wrapper.init_state_fn(opt, getattr(wrapper, "config", None))
        after += _state_bytes(opt)
    return after - before


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.numel() * v.element_size() for st in opt.state.values()
               for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
