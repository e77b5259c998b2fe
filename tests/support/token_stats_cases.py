"""The test logits of tests/rl/test_token_stats.py, shared with its TP=2 worker."""

from __future__ import annotations

import torch

VOCAB = 37  # of 40 columns: the last 3 are padding, as a TP-padded vocabulary's


def case(seed: int = 0, dtype=torch.float32):
    """(logits [2, 9, 40], targets, mask, weights of logp and entropy) of a test loss."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(2, 9, 40, generator=gen)).to(dtype)
    targets = torch.randint(0, VOCAB, (2, 9), generator=gen)
    mask = torch.zeros(2, 9)
    mask[0, 2:8] = 1
    mask[1, 4:6] = 1
    w_logp = torch.randn(2, 9, generator=gen)
    w_ent = torch.randn(2, 9, generator=gen)
    return logits, targets, mask, w_logp, w_ent
