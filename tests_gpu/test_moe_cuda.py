"""Qwen3 and Qwen3-MoE in the rollout engine on CUDA: greedy tokens equal transformers'
on the GPU (float32: the MoE step's masked per-expert path), CUDA graphs equal eager
decoding with the MoE step (bfloat16: ``torch._grouped_mm``) captured, routes included,
and the routing-replay forward takes the given experts. The same code runs on CPU in
tests/rollout/test_rollout_qwen3.py and tests/models/test_moe_replay.py."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.config import RolloutConfig
from megatron_tlt.models import MoeOptions, load_model, moe_replay
from megatron_tlt.models.inference import forward_local_logits
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from tiny_models import VOCAB, build_tiny_hf, save_tiny_hf

CUDA = torch.device("cuda", 0)
NEW = 10


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_cuda")
    return {n: save_tiny_hf(n, root / n) for n in ("qwen3_tied", "qwen3_moe")}


def _prompts(lengths=(5, 9, 3, 12, 5, 7)):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_moe"])
def test_cuda_engine_matches_transformers(parallel, dirs, name):
    model, arch = load_model(dirs[name], device=CUDA, dtype="float32")
    hf = build_tiny_hf(name).to(CUDA)
    eng = RolloutEngine(model, None, RolloutConfig(max_batch_size=3, attention="sdpa"),
                        arch=arch, eos_token_ids=[])
    outs = eng.generate(_prompts(), SamplingParams(temperature=0.0, max_new_tokens=NEW,
                                                   ignore_eos=True))
    for p, o in zip(_prompts(), outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p], device=CUDA), max_new_tokens=NEW,
                              min_new_tokens=NEW, do_sample=False)[0, len(p):].tolist()
        assert o.token_ids == ref
        assert (o.routes is not None) == arch.is_moe


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_moe"])
def test_cuda_graphs_match_eager_with_the_moe_step(parallel, dirs, name):
    model, arch = load_model(dirs[name], device=CUDA, dtype="bfloat16")
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=NEW, seed=3,
                            ignore_eos=True)
    runs = {}
    for graphs in ("false", "true"):
        eng = RolloutEngine(model, None, RolloutConfig(max_batch_size=4, attention="sdpa",
                                                       cuda_graphs=graphs),
                            arch=arch, eos_token_ids=[])
        runs[graphs] = eng.generate(_prompts((3, 9, 5, 1, 12, 7, 2)), params)
        if graphs == "true":
            assert eng._graphs is not None and eng._graphs.captured
    for a, b in zip(runs["true"], runs["false"]):
        assert a.token_ids == b.token_ids
        if arch.is_moe:
            assert torch.equal(a.routes, b.routes)


def test_replay_takes_the_given_experts_on_cuda(parallel, dirs):
    model, arch = load_model(dirs["qwen3_moe"], device=CUDA, dtype="bfloat16",
                             moe=MoeOptions(routing_replay=True))
    ids = torch.randint(0, VOCAB, (2, 11), device=CUDA)
    routes = torch.stack([torch.randperm(arch.num_experts)[:arch.moe_topk]
                          for _ in range(2 * 11 * len(arch.moe_layers))]).view(
                              2, 11, len(arch.moe_layers), arch.moe_topk)
    maps = []
    hooks = [r.register_forward_hook(lambda m, i, out: maps.append(out[1]))
             for _, r in moe_replay.routers(model)]
    with torch.no_grad():
        assert moe_replay.set_routes(model, routes.to(torch.int16), arch.moe_layers)
        forward_local_logits(model, ids)
        moe_replay.clear(model)
    for h in hooks:
        h.remove()
    for j, m in enumerate(maps):
        want = torch.zeros_like(m).scatter_(
            1, routes[:, :, j].transpose(0, 1).reshape(-1, arch.moe_topk).to(CUDA), True)
        assert torch.equal(m, want), j
