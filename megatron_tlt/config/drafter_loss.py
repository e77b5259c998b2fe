"""The drafter's loss: the weights of its terms and the sampling settings the target's
p̃ and the drafter's q̃ are processed at (``LossConfig``), and the named presets
(``drafter_group.loss``, ``tools/warmup_drafter.py --loss``). Data only; the loss
itself is ``drafter_training.losses``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class LossConfig:
    """Weights of the drafter's loss terms and the sampling settings p̃ and q̃ use."""

    kl: float = 1.0
    tv: float = 0.0
    log_accept: float = 0.0
    hidden: float = 0.0
    temperature: float = 1.0  # 0 (greedy rollouts): the raw softmax, as at T=1
    top_k: int = 0
    top_p: float = 1.0
    unroll: int = 1
    # p~ and q~ at the rollout's sampling settings (``for_sampling``); False: at the
    # preset's own (the EAGLE recipe's soft CE against the T=1 softmax)
    follows_sampling: bool = True

    def __post_init__(self):
        for name in ("kl", "tv", "log_accept", "hidden"):
            if getattr(self, name) < 0:
                raise ValueError(f"drafter loss weight {name} must be >= 0, "
                                 f"got {getattr(self, name)}")
        if not (self.kl or self.tv or self.log_accept or self.hidden):
            raise ValueError("drafter loss: every weight is 0 (kl, tv, log_accept, hidden); "
                             "give at least one term a positive weight")
        if self.unroll < 1:
            raise ValueError(f"unroll must be >= 1, got {self.unroll}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError("drafter loss sampling settings: temperature >= 0, "
                             "0 < top_p <= 1, top_k >= 0")

    @classmethod
    def preset(cls, name: str, **overrides) -> "LossConfig":
        """A named loss (``LOSS_PRESETS``) with field overrides (e.g. temperature)."""
        if name not in LOSS_PRESETS:
            raise ValueError(f"unknown drafter loss {name!r}; choose one of "
                             f"{sorted(LOSS_PRESETS)}")
        return dataclasses.replace(LOSS_PRESETS[name], **overrides)

    @classmethod
    def for_sampling(cls, name: str, temperature: float, top_k: int = 0, top_p: float = 1.0,
                     **overrides) -> "LossConfig":
        """Preset ``name`` at a rollout's sampling settings (temperature 0 = greedy). A
        preset that does not follow them (``eagle``: its soft CE against the T=1
        softmax) keeps its own whatever the rollout samples at."""
        base = cls.preset(name, **overrides)
        if not base.follows_sampling:
            return base
        return dataclasses.replace(base, temperature=temperature, top_k=top_k, top_p=top_p)

    def processing(self) -> tuple[float, int, float]:
        """(temperature, top_k, top_p) for ``processed_logprobs``; greedy as T=1."""
        return (self.temperature or 1.0, self.top_k, self.top_p)


LOSS_PRESETS = {
    # the EAGLE recipe: next-hidden-state regression + 0.1 x soft CE at T=1 (CE and KL
    # differ by p's entropy, a constant: same gradients)
    "eagle": LossConfig(kl=0.1, hidden=1.0, temperature=1.0, follows_sampling=False),
    "kl": LossConfig(kl=1.0),
    "tv": LossConfig(kl=0.0, tv=1.0),
    "log_accept": LossConfig(kl=0.0, log_accept=1.0),
    "kl+tv": LossConfig(kl=1.0, tv=1.0),
    # kl+tv plus the next-hidden-state regression: the best α at 39k+ training tokens
    # (docs/benchmarks.md, α against training tokens), worse on small warm-ups
    "kl+tv+hidden": LossConfig(kl=1.0, tv=1.0, hidden=1.0),
}
