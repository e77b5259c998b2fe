"""Routing replay (models/moe_replay.py): a training forward routes every token to the
experts it is given (the rollout's), with the router's own weights for them; samples
carry the rollout's experts into micro-batches aligned with their input positions."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.models import MoeOptions, load_model, moe_replay
from megatron_tlt.models.inference import forward_local_logits, gather_logits
from megatron_tlt.rl.samples import Sample, collate
from tiny_models import VOCAB, build_tiny_hf

TOL = 1e-4


@pytest.fixture(scope="module")
def replaying_model(qwen3_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    model, arch = load_model(qwen3_hf_dirs["qwen3_moe"], device=torch.device("cpu"),
                             dtype="float32", moe=MoeOptions(routing_replay=True))
    return model, arch, build_tiny_hf("qwen3_moe")


def _forced(hf, routes: torch.Tensor):
    """transformers' model with every router returning ``routes`` [1, S, layers, k]
    (weights: the softmax of the chosen experts' logits, as norm_topk_prob does)."""
    gates = [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "gate")]
    saved = [g.forward for g in gates]
    for j, g in enumerate(gates):
        def fwd(h, g=g, j=j):
            logits = torch.nn.functional.linear(h.reshape(-1, g.hidden_dim), g.weight)
            idx = routes[0, :, j].long()
            return logits, torch.softmax(logits.gather(-1, idx), -1), idx
        g.forward = fwd
    return gates, saved


def _map_of(model) -> list:
    """Hooks that keep each router's routing map [tokens, experts] of the next forward."""
    maps = []
    hooks = [r.register_forward_hook(lambda m, i, out: maps.append(out[1].clone()))
             for _, r in moe_replay.routers(model)]
    return maps, hooks


def test_replay_routes_every_token_to_the_given_experts(replaying_model):
    model, arch, hf = replaying_model
    assert moe_replay.enabled(model)
    assert [layer for layer, _ in moe_replay.routers(model)] == list(arch.moe_layers)
    ids = torch.randint(0, VOCAB, (1, 15), generator=torch.Generator().manual_seed(2))
    g = torch.Generator().manual_seed(3)
    # experts the routers would not all pick themselves: k distinct at random
    routes = torch.stack([torch.randperm(arch.num_experts, generator=g)[:arch.moe_topk]
                          for _ in range(15 * len(arch.moe_layers))]).view(
                              1, 15, len(arch.moe_layers), arch.moe_topk).to(torch.int16)
    maps, hooks = _map_of(model)
    with torch.no_grad():
        assert moe_replay.set_routes(model, routes, arch.moe_layers)
        replayed = gather_logits(forward_local_logits(model, ids), arch)
        moe_replay.clear(model)
        own = gather_logits(forward_local_logits(model, ids), arch)
        gates, saved = _forced(hf, routes)
        try:
            forced = hf(ids).logits
        finally:
            for gate, fwd in zip(gates, saved):
                gate.forward = fwd
        natural = hf(ids).logits
    for h in hooks:
        h.remove()
    # the routers used exactly the given experts, for every token of every MoE layer
    for j, m in enumerate(maps[: len(arch.moe_layers)]):
        want = torch.zeros_like(m).scatter_(1, routes[0, :, j].long(), True)
        assert torch.equal(m, want), j
    assert (replayed - forced).abs().max().item() <= TOL
    assert (own - natural).abs().max().item() <= TOL
    assert (replayed - own).abs().max().item() > 0.01  # the replay changed the routing


def test_samples_carry_routes_into_micro_batches():
    """Positions 0..len-2 of each sample hold its recorded experts; the last position and
    padding are FILLER; a micro-batch fitted to its longest row keeps them aligned."""
    a = Sample(0, [1, 2, 3], [4, 5], [-1.0, -1.0], "stop",
               routes=torch.full((4, 3, 2), 7, dtype=torch.int16))
    b = Sample(0, [1, 2], [4, 5, 6, 7, 8], [-1.0] * 5, "stop",
               routes=torch.arange(6 * 3 * 2, dtype=torch.int16).view(6, 3, 2))
    mb = collate([a, b], [0, 1], pad_id=0, width=10)
    assert mb.routes.shape == (2, 10, 3, 2)
    assert (mb.routes[0, :4] == 7).all() and (mb.routes[0, 4:] == moe_replay.FILLER).all()
    assert torch.equal(mb.routes[1, :6], b.routes)
    fitted = mb.fitted(multiple=4)  # longest row 7, padded to 8
    assert fitted.routes.shape == (2, 8, 3, 2)
    assert torch.equal(fitted.routes, mb.routes[:, :8])
    assert collate([a, Sample(0, [1], [2], [-1.0], "stop")], [0, 1], pad_id=0).routes is None


def test_filler_positions_route_somewhere_valid(replaying_model):
    """Unrecorded positions get experts 0..k-1; the forward runs and the recorded
    positions' logits do not depend on them (causal attention)."""
    model, arch, _ = replaying_model
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(5))
    routes = torch.full((2, 9, len(arch.moe_layers), arch.moe_topk), moe_replay.FILLER,
                        dtype=torch.int16)
    with torch.no_grad():
        moe_replay.clear(model)
        own = gather_logits(forward_local_logits(model, ids), arch)
        maps, hooks = _map_of(model)
        assert moe_replay.set_routes(model, routes, arch.moe_layers)
        filled = gather_logits(forward_local_logits(model, ids), arch)
        moe_replay.clear(model)
    for h in hooks:
        h.remove()
    assert all(m[:, : arch.moe_topk].all() for m in maps)
    assert torch.isfinite(filled).all() and not torch.equal(filled, own)
