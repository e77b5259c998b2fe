"""Draft vocabularies chosen by the target's probability mass at the rollout's sampling
settings: a drafter limited to a vocabulary D accepts at most p̃(D) per token, so D is
the tokens carrying the most p̃ mass over response positions (not the most frequent
sampled tokens, which count a token once however much mass its neighbours held).

    mass = token_mass(runner, samples, temperature=1.0)     # [V] summed p̃
    ids = draft_vocabulary_by_mass(mass, 4096, always=eos_ids)
    coverage(mass, (1024, 4096, 0))                          # {size: share of the mass}
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..rollout.sampling import processed_logprobs

__all__ = ["token_mass", "draft_vocabulary_by_mass", "coverage"]


@torch.no_grad()
def token_mass(runner, samples: Sequence, *, temperature: float, top_k: int = 0,
               top_p: float = 1.0, chunk: int = 512) -> torch.Tensor:
    """p̃'s mass per target token [V] (float64), summed over every response position of
    ``samples`` (``DraftSample``: the target's final hidden states give p̃)."""
    vocab = runner.arch.vocab_size
    head = runner.output_w.detach()[:vocab]
    total = torch.zeros(vocab, dtype=torch.float64)
    key = (temperature or 1.0, top_k, top_p)
    for s in samples:
        h = s.final_hidden[max(s.prompt_len - 1, 1):]  # distributions of response tokens
        for i in range(0, h.shape[0], chunk):
            x = h[i: i + chunk].to(head.device, head.dtype)
            lp = processed_logprobs(x @ head.t(), *key)
            total += lp.exp().double().sum(0).cpu()
    return total


def draft_vocabulary_by_mass(mass: torch.Tensor, size: int,
                             always: Sequence[int] = ()) -> torch.Tensor:
    """The ``size`` tokens with the most mass (ties: lower id), ``always`` included
    (e.g. EOS, which ends every response), as a sorted d2t map."""
    if not 0 < size <= mass.numel():
        raise ValueError(f"draft vocabulary size must be in [1, {mass.numel()}], got {size}")
    score = mass.double().clone()
    for t in always:
        score[int(t)] = float("inf")
    order = torch.argsort(-score, stable=True)
    return torch.sort(order[:size]).values


def coverage(mass: torch.Tensor, sizes: Sequence[int]) -> dict[int, float]:
    """Share of the mass the best ``size`` tokens hold, per size (0 = full vocabulary)."""
    srt = torch.sort(mass.double(), descending=True).values
    total = float(srt.sum()) or 1.0
    return {int(n): float(srt[: n or srt.numel()].sum()) / total for n in sizes}
