"""The drafter group's sizes when the config leaves them to the device (0 = auto).

Three sizes decide how much of an idle window the drafter group can use:
``batch_tokens`` (padded tokens per micro-step), ``max_steps_per_window`` and
``buffer_tokens`` (feature rows kept per replica). ``derive`` is the one place they are
computed from the device and the drafter; ``resolve`` fills a config's zeros with them.

- CPU: the values the project has always used (the demo and the tests depend on them):
  512 tokens per micro-step, at most 32 micro-steps per window, a 65,536-row buffer.
- CUDA (docs/running_at_scale.md, "The drafter group's sizes", has the reasoning and
  the numbers for the recipes):

  * a micro-step costs about ``6 x (P + V x h)`` FLOPs per token (P the drafter
    layer's parameters on this rank, fc included; V x h the target's output layer that
    the drafter's logits go through and p~ is computed with: forward 2, backward 4),
    run at ``ACHIEVED_FRACTION`` of the device's dense bf16 peak. ``batch_tokens`` is
    what takes ``MICRO_STEP_S`` (the preemption bound is one of its ``stop_checks``
    chunks), capped so one chunk's vocabulary-wide loss temporaries (about
    ``LOSS_ROWS`` fp32 rows of V per token) stay within ``LOSS_MEMORY_FRACTION`` of
    the device's memory, rounded down to a multiple of 1,024 within [2,048, 16,384];
  * ``max_steps_per_window``: the micro-steps that fill a ``WINDOW_S`` idle window
    (a bound, not a target: the window ends when the last replica finishes);
  * ``buffer_tokens``: ``BUFFER_BYTES`` of host memory (rows x hidden x the feature
    dtype's bytes), a multiple of 65,536 rows.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
import torch

CPU_SIZES = {"batch_tokens": 512, "max_steps_per_window": 32, "buffer_tokens": 65536}

MICRO_STEP_S = 0.25           # one micro-step at the achieved throughput
ACHIEVED_FRACTION = 0.35      # of the dense bf16 peak, for one small layer + a vocab GEMM
LOSS_ROWS = 8                 # fp32 [tokens, V] temporaries of the loss, per chunk
LOSS_MEMORY_FRACTION = 0.10   # of device memory for one chunk's loss temporaries
WINDOW_S = 300.0              # the longest idle window the step limit should not cut
BUFFER_BYTES = 8 << 30        # host memory for the feature rows, per replica rank
TOKENS_MIN, TOKENS_MAX, TOKENS_STEP = 2048, 16384, 1024
STEPS_MIN, STEPS_MAX = 32, 4096
BUFFER_STEP = 65536

# dense bf16 peak FLOP/s by CUDA compute capability (major, minor); (major, None) for
# the whole generation; anything else: DEFAULT_PEAK
PEAK_FLOPS = {(7, None): 125e12, (8, 0): 312e12, (8, None): 150e12, (9, None): 989e12,
              (10, None): 2250e12, (12, None): 400e12}
DEFAULT_PEAK = 100e12


@dataclass(frozen=True)
class DeviceInfo:
    """What the sizes depend on: the device type, its memory (bytes) and, on CUDA, its
    compute capability."""

    type: str
    total_memory: int = 0
    capability: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, device: torch.device) -> "DeviceInfo":
        device = torch.device(device)
        if device.type != "cuda":
            return cls(device.type)
        props = torch.cuda.get_device_properties(
            device.index if device.index is not None else torch.cuda.current_device())
        return cls("cuda", int(props.total_memory), (int(props.major), int(props.minor)))

    @property
    def peak_flops(self) -> float:
        major, minor = self.capability
        return PEAK_FLOPS.get((major, minor), PEAK_FLOPS.get((major, None), DEFAULT_PEAK))


@dataclass(frozen=True)
class DrafterCost:
    """The drafter's shape as the sizes see it."""

    hidden: int                 # feature row width (the target's hidden size)
    vocab: int                  # the target's vocabulary (p~ and the drafter's logits)
    layer_params: int           # the drafter's trainable parameters on this rank
    feature_bytes: int = 2      # bytes per buffered feature value

    @property
    def flops_per_token(self) -> float:
        return 6.0 * (self.layer_params + self.vocab * self.hidden)

    @classmethod
    def of(cls, drafter) -> "DrafterCost":
        p = next(drafter.parameters())
        return cls(hidden=drafter.config.hidden_size, vocab=drafter.config.vocab_size,
                   layer_params=sum(x.numel() for x in drafter.parameters()
                                    if x.requires_grad),
                   feature_bytes=p.element_size())


def derive(device: DeviceInfo, cost: DrafterCost, stop_checks: int = 4) -> dict:
    """``batch_tokens``, ``max_steps_per_window`` and ``buffer_tokens`` for ``device``
    (see the module docstring), with ``micro_step_s``: the micro-step's modelled time
    (None on CPU, whose sizes are fixed)."""
    if device.type != "cuda":
        return dict(CPU_SIZES, micro_step_s=None)
    speed = ACHIEVED_FRACTION * device.peak_flops
    by_time = MICRO_STEP_S * speed / cost.flops_per_token
    by_memory = stop_checks * LOSS_MEMORY_FRACTION * device.total_memory / (
        LOSS_ROWS * 4 * cost.vocab)
    tokens = int(min(by_time, by_memory)) // TOKENS_STEP * TOKENS_STEP
    tokens = min(max(tokens, TOKENS_MIN), TOKENS_MAX)
    step_s = tokens * cost.flops_per_token / speed
    steps = min(max(math.ceil(WINDOW_S / step_s), STEPS_MIN), STEPS_MAX)
    rows = BUFFER_BYTES // (cost.hidden * cost.feature_bytes)
    buffer = max(rows // BUFFER_STEP, 1) * BUFFER_STEP
    return {"batch_tokens": tokens, "max_steps_per_window": steps, "buffer_tokens": buffer,
            "micro_step_s": step_s}


def resolve(cfg, drafter):
    """``cfg`` (a ``DrafterGroupConfig``) with its 0 ("auto") sizes derived for
    ``drafter``'s device and shape; ``cfg`` itself when none is 0."""
    auto = [k for k in CPU_SIZES if getattr(cfg, k) == 0]
    if not auto:
        return cfg
    device = DeviceInfo.of(next(drafter.parameters()).device)
    sizes = derive(device, DrafterCost.of(drafter), cfg.stop_checks)
    return dataclasses.replace(cfg, **{k: sizes[k] for k in auto})
