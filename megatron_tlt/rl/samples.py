"""Rollout samples and the padded micro-batches the training forward consumes.

A ``Sample`` is one response to one prompt, with everything the loss needs. Training
runs on ``MicroBatch`` tensors: prompt + response right-padded to a common length, so
no attention mask is needed (causal attention never looks right), and per-position
tensors aligned with the model's next-token log-probs: position ``t`` predicts token
``t + 1``, so response token ``j`` of a sample with a ``p``-token prompt is scored at
position ``p - 1 + j``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from ..models import moe_replay


@dataclass
class Sample:
    """One response to one prompt (a member of a GRPO group)."""

    prompt_index: int             # index of the prompt within the step (its group)
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_logprobs: list[float]  # the engine's tempered log-probs (logits / T)
    finish_reason: str             # "stop" or "length"
    reward: float = 0.0
    score: float = 0.0
    correct: bool = False
    advantage: float = 0.0
    old_logprobs: Optional[torch.Tensor] = None  # [len(response)], pre-update policy
    ref_logprobs: Optional[torch.Tensor] = None  # [len(response)], frozen reference
    uid: str = ""
    # MoE policies: the rollout's experts per input position [length - 1, MoE layers, k]
    # (RolloutOutput.routes), replayed by the training forwards (grpo.routing_replay)
    routes: Optional[torch.Tensor] = None
    extra: dict = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class MicroBatch:
    """Padded tensors for one forward/backward; ``samples`` index into the step's list."""

    samples: list[int]
    input_ids: torch.Tensor      # [b, S] prompt + response, right-padded
    position_ids: torch.Tensor   # [b, S]
    targets: torch.Tensor        # [b, S] input shifted left by one (last column: pad)
    mask: torch.Tensor           # [b, S] float: 1 where the position predicts a response token
    advantages: torch.Tensor     # [b]
    old_logprobs: Optional[torch.Tensor] = None     # [b, S] aligned with mask
    ref_logprobs: Optional[torch.Tensor] = None
    rollout_logprobs: Optional[torch.Tensor] = None
    lengths: Optional[list[int]] = None  # each row's prompt + response length
    routes: Optional[torch.Tensor] = None  # [b, S, MoE layers, k] (models.moe_replay)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum().item())

    @property
    def is_filler(self) -> bool:
        """A micro-batch of no sample (``filler``)."""
        return not self.samples

    @classmethod
    def filler(cls, width: int, device: torch.device) -> "MicroBatch":
        """One row of ``width`` padding tokens that predicts nothing: the forward and
        backward a rank runs so that its expert-parallel peers' MoE collectives have a
        partner (``Policy``)."""
        z = torch.zeros(1, width, device=device)
        ids = torch.zeros(1, width, dtype=torch.long, device=device)
        return cls(samples=[], input_ids=ids, position_ids=torch.arange(width, device=device)
                   .unsqueeze(0), targets=ids.clone(), mask=z, advantages=torch.zeros(
                       1, device=device), old_logprobs=z.clone(), ref_logprobs=z.clone(),
                   rollout_logprobs=z.clone(), lengths=[width])

    def fitted(self, multiple: int = 1) -> "MicroBatch":
        """This micro-batch without padding beyond its own longest sample: rows past
        ``samples`` (filler rows) dropped, columns cut to the longest row's length
        rounded up to ``multiple`` (sequence parallelism needs a multiple of TP; the
        extra columns, zeros, predict nothing). Unchanged without ``lengths``."""
        b, width = self.input_ids.shape
        rows = len(self.samples) if 0 < len(self.samples) < b else b
        if self.lengths is None:
            longest = width
        else:
            longest = max(self.lengths[:rows])
        longest = -(-longest // multiple) * multiple
        if rows == b and longest == width:
            return self

        def fit(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None:
                return None
            t = t[:rows, :longest]
            if t.shape[1] < longest:
                t = torch.cat([t, t.new_zeros(rows, longest - t.shape[1])], dim=1)
            return t.contiguous()

        return MicroBatch(
            samples=self.samples, input_ids=fit(self.input_ids),
            position_ids=torch.arange(longest, device=self.position_ids.device)
            .unsqueeze(0).expand(rows, longest).contiguous(),
            targets=fit(self.targets), mask=fit(self.mask),
            advantages=self.advantages[:rows], old_logprobs=fit(self.old_logprobs),
            ref_logprobs=fit(self.ref_logprobs), rollout_logprobs=fit(self.rollout_logprobs),
            lengths=None if self.lengths is None else self.lengths[:rows],
            routes=None if self.routes is None else _fit_routes(self.routes, rows, longest))


def _fit_routes(routes: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """``routes`` [b, S, L, k] cut to ``rows`` rows and ``width`` positions (new
    positions unrecorded: ``moe_replay.FILLER``)."""
    out = routes[:rows, :width]
    if out.shape[1] < width:
        pad = out.new_full((rows, width - out.shape[1], *out.shape[2:]), moe_replay.FILLER)
        out = torch.cat([out, pad], dim=1)
    return out.contiguous()


def _aligned(samples: Sequence[Sample], width: int, values) -> torch.Tensor:
    out = torch.zeros(len(samples), width, dtype=torch.float32)
    for i, s in enumerate(samples):
        v = values(s)
        if v is None:
            continue
        p = len(s.prompt_ids)
        out[i, p - 1:p - 1 + len(s.response_ids)] = torch.as_tensor(v, dtype=torch.float32)
    return out


def collate(samples: Sequence[Sample], indices: Sequence[int], *, pad_id: int,
            width: Optional[int] = None, device: torch.device = torch.device("cpu"),
            loss_mask: Optional[Sequence[bool]] = None) -> MicroBatch:
    """One micro-batch of ``samples[i] for i in indices``, padded to ``width`` (default:
    the longest). ``loss_mask[i]`` False excludes sample i's tokens from the loss (e.g.
    masked overlong responses) while keeping it in the batch."""
    chosen = [samples[i] for i in indices]
    S = width or max(s.length for s in chosen)
    b = len(chosen)
    ids = torch.full((b, S), pad_id, dtype=torch.long)
    mask = torch.zeros(b, S, dtype=torch.float32)
    for r, s in enumerate(chosen):
        seq = s.prompt_ids + s.response_ids
        ids[r, :len(seq)] = torch.tensor(seq, dtype=torch.long)
        keep = loss_mask is None or loss_mask[indices[r]]
        if keep:
            p = len(s.prompt_ids)
            mask[r, p - 1:p - 1 + len(s.response_ids)] = 1.0
    targets = torch.full_like(ids, pad_id)
    targets[:, :-1] = ids[:, 1:]
    have_old = all(s.old_logprobs is not None for s in chosen)
    have_ref = all(s.ref_logprobs is not None for s in chosen)
    mb = MicroBatch(
        samples=list(indices),
        input_ids=ids.to(device),
        position_ids=torch.arange(S, device=device).unsqueeze(0).expand(b, S).contiguous(),
        targets=targets.to(device),
        mask=mask.to(device),
        advantages=torch.tensor([s.advantage for s in chosen], dtype=torch.float32,
                                device=device),
        old_logprobs=_aligned(chosen, S, lambda s: s.old_logprobs).to(device)
        if have_old else None,
        ref_logprobs=_aligned(chosen, S, lambda s: s.ref_logprobs).to(device)
        if have_ref else None,
        rollout_logprobs=_aligned(chosen, S, lambda s: s.rollout_logprobs).to(device),
        lengths=[s.length for s in chosen],
        routes=moe_replay.aligned(chosen, S),
    )
    return mb


def plan_micro_batches(samples: Sequence[Sample], indices: Sequence[int], *,
                       micro_batch_size: int, micro_batch_tokens: int = 0) -> list[list[int]]:
    """Split ``indices`` into micro-batches: sorted by length (least padding), at most
    ``micro_batch_size`` samples and, when set, ``micro_batch_tokens`` padded tokens
    each. A sample longer than the token budget gets a micro-batch of its own."""
    order = sorted(indices, key=lambda i: samples[i].length)
    plans: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        longest = max([samples[j].length for j in cur] + [samples[i].length])
        over_tokens = micro_batch_tokens and longest * (len(cur) + 1) > micro_batch_tokens
        if cur and (len(cur) >= micro_batch_size or over_tokens):
            plans.append(cur)
            cur = []
        cur.append(i)
    if cur:
        plans.append(cur)
    return plans
