"""Helpers shared by the benchmarks (tools/bench_*.py): output checks and the CPU record.

``check_ties`` compares two decoders' outputs that must be identical, forgiving only
floating-point near-ties (``check_against_engine``: the ties judged on the engine's own
logits); ``cpu_description`` records the CPU, its instruction sets and the engine's
CPU-kernel build next to a benchmark's numbers; ``timing_only`` labels a result measured
with random weights, whose acceptance and speedups mean nothing for TLT.
"""

from __future__ import annotations

import os
import platform
from typing import Callable, Sequence

import torch

__all__ = ["check_ties", "check_against_engine", "cpu_description", "timing_only",
           "ISA_FLAGS"]


def check_ties(prompts: Sequence[list[int]], ours: Sequence[list[int]],
               ref: Sequence[list[int]], next_logits: Callable[[list[int]], torch.Tensor],
               tie_margin: float, names: tuple[str, str]) -> dict:
    """Outputs that must be identical: count identical sequences and those that part
    only where ``next_logits(prefix)`` (the reference's logits after the common prefix)
    has the two candidate tokens tied within ``tie_margin``; anything else ends the
    benchmark with a message naming the prompt, the position and the gap."""
    identical, tie_splits, worst = 0, 0, 0.0
    for p, a, b in zip(prompts, ours, ref):
        if a == b:
            identical += 1
            continue
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            raise SystemExit(f"{names[0]} and {names[1]} outputs differ in length "
                             f"({len(a)} vs {len(b)}) without a differing token")
        with torch.no_grad():
            logits = next_logits(p + b[:k]).float()
        gap = abs(logits[a[k]] - logits[b[k]]).item()
        worst = max(worst, gap)
        if gap > tie_margin:
            raise SystemExit(f"outputs differ beyond a tie: prompt of {len(p)} tokens, "
                             f"position {k}: {names[0]} {a[k]} vs {names[1]} {b[k]}, "
                             f"logit gap {gap:.2e} > {tie_margin:.0e}")
        tie_splits += 1
    return dict(identical=identical, tie_splits=tie_splits, worst_tie_gap=worst)


def check_against_engine(engine, prompts, ours, ref, tie_margin: float,
                         names: tuple[str, str] = ("speculative", "plain")) -> dict:
    """``check_ties`` of ``ours`` against ``ref`` (the engine's plain decoding), the
    ties judged on the engine model's own next-token logits (a full forward)."""
    from ..models.inference import forward_local_logits, gather_logits

    def next_logits(ids):
        local = forward_local_logits(engine.runner.model,
                                     torch.tensor([ids], device=engine.device))
        return gather_logits(local, engine.arch)[0, -1]

    return check_ties(prompts, ours, ref, next_logits, tie_margin, names)


# vector instruction-set flags worth recording (/proc/cpuinfo names)
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl",
             "avx512_vnni", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_description(engine) -> dict:
    """CPU model, its instruction-set flags, and the engine's CPU-kernel build and policy."""
    from ..rollout import cpu_kernels

    model, flags = cpu_kernels.cpu_info()
    kern = engine.runner.kernels
    policy = getattr(kern, "policy", None)
    env = {k: os.environ[k] for k in ("MEGATRON_TLT_CPU_ISA", "MEGATRON_TLT_NO_CPU_KERNELS",
                                      "ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS",
                                      "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS")
           if k in os.environ}
    return dict(cpu=model, arch=platform.machine(),
                cpu_isa_flags=[f for f in ISA_FLAGS if f in flags],
                cpu_best_isa=cpu_kernels.detect_isa(),
                torch_cpu_capability=torch.backends.cpu.get_cpu_capability(), env=env,
                cpu_kernels=engine.config.cpu_kernels,
                kernel_isa=getattr(kern, "ISA", None),
                kernel_panel=getattr(kern, "PANEL", None),
                kernel_policy=policy.describe() if policy is not None else "eager torch ops",
                kernel_policy_source=getattr(policy, "source", None))


def timing_only(*, target_random: bool, drafter_random: bool = False) -> dict:
    """The label a benchmark's JSON carries: ``timing_only`` is true when the target's
    weights are random (the GPU check's stand-in, ``assets.weights_are_random``) or the
    drafter is untrained. Then acceptance, accept lengths and speedups describe random
    logits, not TLT; only the step times hold, to be combined with acceptance measured
    on trained weights (``tools/plan_tlt.py --table/--spec-table``)."""
    why = (["the target's weights are random"] if target_random else []) + (
        ["the drafter is untrained (random)"] if drafter_random else [])
    return {"timing_only": bool(why),
            "timing_only_reason": ("; ".join(why) + ": acceptance, accept lengths and "
                                   "speedups mean nothing for TLT, only the step times do")
            if why else None}
