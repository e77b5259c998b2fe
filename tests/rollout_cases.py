"""Prompts and sampling settings shared by the TP=2 rollout test and its worker."""

from __future__ import annotations

import torch

from megatron_tlt.rollout import SamplingParams
from tiny_models import VOCAB

CASES = {
    "greedy": SamplingParams(temperature=0.0, max_new_tokens=10, return_hidden_states=True),
    "sampled": SamplingParams(temperature=0.9, top_k=50, top_p=0.9, max_new_tokens=10,
                              seed=5),
}


def case_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 13, 1, 8, 6)]
