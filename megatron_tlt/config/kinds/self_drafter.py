"""The self-drafter's settings (``rollout.speculative.kinds.self``): the policy's
quantized copy (rollout/speculative/self_drafter.py)."""

from __future__ import annotations

from dataclasses import dataclass

from ...spec_strategy import parse_arms
from ..base import ConfigError, _choice, _help
from .section import KindSection

KEY = "rollout.speculative.kinds.self"
# its tuner's arms with arms=auto while rollout.speculative.arms is the default: deeper
# chains than the one-layer drafter's (the copy accepts far more)
SELF_ARMS = ("1:6_1_6,7_1_7,8_1_8;2:4_1_4,5_1_5,6_1_6;3-4:3_1_3,4_1_4,5_1_5;"
             "5-8:3_1_3,4_1_4,5_1_5;*:0_0_0,2_1_2,3_1_3,4_1_4")


@dataclass
class SelfSettings(KindSection):
    """The self-drafter (rollout.speculative.drafter=self, or `also` beside a drafter
    checkpoint): the policy's own quantized copy, re-quantized after every update."""

    renamed = {"self_group": "group", "self_format": "format",
               "self_act_block": "act_block", "self_too": "also", "self_arms": "arms"}

    group: int = _help(
        "Inputs per int8 scale of the copy's matrices (0 = one scale per output channel; "
        "e.g. 128 for groups of 128, a little closer to the policy).", 0)
    format: str = _help(
        "The copy's number format. int8 (int8 weights, activations as act_block says; "
        "the CPU kernels' int8 GEMMs on CPU), fp8 (E4M3 weights, one scale per output "
        "channel, and E4M3 activations scaled per row at every call, act_block unused; "
        "multiplied by torch._scaled_mm on CUDA GPUs of compute capability >= 8.9; "
        "emulated elsewhere), or auto (fp8 where the GPU runs it natively and group is "
        "0, else int8).", "auto")
    act_block: int = _help(
        "Inputs per scale of the copy's dynamically quantized int8 activations (per row, "
        "per block: the CPU kernels' int8 dot products; SmolLM2 at T=1, drafting over "
        "the policy's keys and values: α 0.969 at 32, 0.977 with float activations); "
        "0 = float activations (weight-only int8). A multiple of 4 dividing group.", 32)
    also: bool = _help(
        "With a drafter checkpoint in rollout.speculative.drafter: also the self-drafter, "
        "the kind (one-layer drafter, int8 copy, or plain decoding) chosen per "
        "batch-size bucket by each kind's own tuner and break-even gate "
        "(rollout/speculative/multi.py).", False)
    arms: str = _help(
        "Arms per bucket of the self-drafter's tuner, same form as "
        "rollout.speculative.arms; auto = rollout.speculative.arms when it is set, else "
        "deeper chains than the one-layer drafter's (the policy's int8 copy accepts far "
        "more: on 2 CPU cores a depth-4 chain gave 1.36x at batch 8 and 1.11x at 16, "
        "bench_spec): " + SELF_ARMS.replace("*", "(rest)") + "; empty = "
        "rollout.speculative.arms.", "auto")

    def __post_init__(self):
        if self.group < 0:
            raise ConfigError(f"{KEY}.group must be >= 0 (0 = one scale per output "
                              f"channel), got {self.group}")
        _choice(KEY, "format", self.format, ("auto", "int8", "fp8"))
        if self.format == "fp8" and self.group:
            raise ConfigError(f"{KEY}.format=fp8 has one scale per output channel; set "
                              f"{KEY}.group=0 (got {self.group}) or {KEY}.format=int8 "
                              "for grouped scales")
        if self.act_block < 0 or self.act_block % 4 or (
                self.act_block and self.group % self.act_block):
            raise ConfigError(f"{KEY}.act_block must be 0 (float activations) or a "
                              f"positive multiple of 4 that divides {KEY}.group, got "
                              f"{self.act_block} (group {self.group})")

    def check(self, sc) -> None:
        if self.arms not in ("", "auto"):
            try:
                parse_arms(self.arms, sc.buckets)
            except ValueError as e:
                raise ConfigError(f"{KEY}.arms: {e}") from None
