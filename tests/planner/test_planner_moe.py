"""The planner's roofline for a mixture-of-experts model (planner/experts.py,
planner/inputs.py): the experts a forward touches, the weights it streams, and a step
that costs less than a dense model of the same total size at small batches."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.planner.experts import distinct_experts
from megatron_tlt.planner.inputs import HARDWARE, ModelShape, RooflineCost

# Qwen3-30B-A3B's shape: 48 layers, 128 experts, top-8, 3 x 2048 x 768 per expert
EXPERT = 3 * 2048 * 768 * 48
MOE = ModelShape(30.5e9, 48, 2048, 4 * 128, 151936, experts=128, topk=8,
                 expert_params=EXPERT)
DENSE = ModelShape(30.5e9, 48, 2048, 4 * 128, 151936)


@pytest.mark.parametrize("experts,topk", [(8, 2), (128, 8), (64, 1)])
def test_distinct_experts_is_what_uniform_top_k_choices_touch(experts, topk):
    """n tokens each choosing top-k distinct experts of E uniformly: the mean number of
    experts chosen at least once, against a Monte-Carlo estimate of 4,000 draws."""
    gen = torch.Generator().manual_seed(0)
    draws = 4000
    for n in (1, 3, 16, 64):
        picks = torch.rand(draws, n, experts, generator=gen).topk(topk, dim=-1).indices
        hit = torch.zeros(draws, experts, dtype=torch.bool)
        hit.scatter_(1, picks.reshape(draws, -1), True)
        simulated = hit.sum(1).double().mean().item()
        assert distinct_experts(experts, topk, n) == pytest.approx(simulated, rel=0.03), n
    assert distinct_experts(experts, topk, 1) == pytest.approx(topk)
    assert distinct_experts(experts, topk, 0) == 0.0


def test_streamed_weights_grow_with_tokens_to_every_expert_of_the_rank():
    assert MOE.dense_params == pytest.approx(30.5e9 - 128 * EXPERT)
    assert MOE.active_params == pytest.approx(MOE.dense_params + 8 * EXPERT)
    for ep in (1, 2, 8):
        seen = [MOE.streamed(n, ep) for n in (1, 2, 4, 16, 64, 256, 1024, 8192)]
        assert all(a < b for a, b in zip(seen[:6], seen[1:6])), ep
        assert all(a <= b for a, b in zip(seen, seen[1:])), ep  # saturated at the end
        assert seen[0] == pytest.approx(MOE.dense_params + 8 / ep * EXPERT)
        assert seen[-1] == pytest.approx(MOE.dense_params + 128 / ep * EXPERT)
    assert MOE.streamed(8192, 1) == pytest.approx(MOE.params)
    for n in (1, 64, 8192):
        assert DENSE.streamed(n) == DENSE.params == DENSE.active_params


def test_an_moe_forward_costs_less_than_a_dense_one_of_the_same_size_at_small_batch():
    def cost(model, ep=1):
        return RooflineCost(batches=(1,), seconds=(0.0,), hw=HARDWARE["h100"], model=model,
                            ep=ep)

    for rows in (1, 4, 16):
        moe, dense = cost(MOE).forward(rows, 1, 1024.0), cost(DENSE).forward(rows, 1, 1024.0)
        assert moe < dense, rows
    # more rows touch more experts: the MoE step grows with the batch, the dense one
    # (bandwidth-bound) about stays
    small, large = cost(MOE).forward(1, 1, 0.0), cost(MOE).forward(64, 1, 0.0)
    assert large > 2 * small
    # a drafter's forward (a dense fraction of the weights) streams no experts
    assert cost(MOE).forward(1, 1, 0.0, weights_frac=0.05, layers=1) == \
        cost(DENSE).forward(1, 1, 0.0, weights_frac=0.05, layers=1)
