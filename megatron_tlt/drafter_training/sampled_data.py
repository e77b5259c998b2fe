"""Drafter training data straight from sampled rollouts, with no forward of its own.

Generating with ``return_hidden_states=True`` gives the target's final hidden state at
every position from the last prompt token on: the features decoding itself feeds the
drafter. The prompt's earlier positions come from one prefill per distinct prompt
(GRPO's group of responses shares it), so a data set of G responses per prompt costs
its generation plus 1/G of a prompt forward per response, instead of a second forward
over every prompt + response (``trainer.target_features``).

A sample ends one token before its response does: the hidden state after the last
token is never computed (generation stops there), so the last prediction is dropped.
Only final-hidden-state features (not EAGLE-3 layer concatenations).

    samples = sampled_samples(engine, prompts, SamplingParams(temperature=1.0, ...),
                              per_prompt=8)
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional, Sequence

import torch

from .trainer import DraftSample, target_features

__all__ = ["sampled_samples"]


@torch.no_grad()
def sampled_samples(engine, prompts: Sequence[Sequence[int]], sampling, *,
                    per_prompt: int = 1, chunk: int = 64,
                    progress: Optional[Callable[[list[DraftSample]], None]] = None
                    ) -> list[DraftSample]:
    """``per_prompt`` responses of ``engine``'s target to each prompt, sampled with
    ``sampling`` (a ``SamplingParams``), as ``DraftSample``s with the target's features.
    ``chunk`` requests go to the engine per call; ``progress(samples_so_far)`` after
    each call (e.g. to save them)."""
    if per_prompt < 1 or chunk < 1:
        raise ValueError("sampled_samples needs per_prompt >= 1 and chunk >= 1")
    sp = dataclasses.replace(sampling, return_hidden_states=True)
    reqs = [list(map(int, p)) for p in prompts for _ in range(per_prompt)]
    prefix: dict[tuple, torch.Tensor] = {}
    out: list[DraftSample] = []
    for c in range(0, len(reqs), chunk):
        part = reqs[c: c + chunk]
        todo = [p for p in dict.fromkeys(tuple(p) for p in part) if p not in prefix]
        for p, (_, h) in zip(todo, target_features(engine.runner, [list(p) for p in todo])):
            prefix[p] = h[: len(p) - 1]  # positions 0..P-2; P-1 comes with the response
        for p, o in zip(part, engine.generate(part, sp)):
            if not o.token_ids:
                continue
            feats = torch.cat([prefix[tuple(p)], o.hidden_states.to(prefix[tuple(p)].dtype)])
            out.append(DraftSample(p + list(o.token_ids[:-1]), len(p), feats, feats))
        if progress is not None:
            progress(out)
    return out
