"""The rollout engine on Qwen3 (QK norm) and Qwen3-MoE (routed experts): greedy tokens
equal transformers' ``generate`` on the eager and the fused-kernel paths, with refill
and shared prefill; each position's recorded experts equal the experts transformers'
router picks for it; the fixed-shape steps CUDA graphs capture decode like the eager
path and read nothing from the device; a plain step keeps its one host read."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.bench.sync_budget import HostSyncCounter, measure
from megatron_tlt.config import RolloutConfig
from megatron_tlt.models import load_model
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from megatron_tlt.rollout.cuda_graphs import _Step
from tiny_models import QWEN3_CONFIGS, VOCAB, build_tiny_hf

NEW = 10
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def models(qwen3_hf_dirs, single_process_parallel):
    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    return {name: (build_tiny_hf(name),
                   *load_model(qwen3_hf_dirs[name], device=torch.device("cpu"),
                               dtype="float32"))
            for name in QWEN3_CONFIGS}


def _prompts(lengths=(5, 9, 3, 12, 5, 7)):
    g = torch.Generator().manual_seed(1)
    out = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]
    out[4] = list(out[0])  # a prompt twice: shared prefill copies it
    return out


def _engine(model, arch, **cfg):
    return RolloutEngine(model, None, RolloutConfig(**cfg), arch=arch, eos_token_ids=[])


_REFERENCE: dict = {}


def _reference(hf, name: str, prompts) -> list[list[int]]:
    """transformers' greedy tokens for each prompt (once per model)."""
    if name not in _REFERENCE:
        with torch.no_grad():
            _REFERENCE[name] = [hf.generate(torch.tensor([p]), max_new_tokens=NEW,
                                            min_new_tokens=NEW, do_sample=False
                                            )[0, len(p):].tolist() for p in prompts]
    return _REFERENCE[name]


def _hf_routes(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), MoE layers, k]: the experts transformers' routers pick per position."""
    picked = []
    hooks = [layer.mlp.gate.register_forward_hook(
        lambda mod, inp, out: picked.append(out[2])) for layer in hf.model.layers
        if hasattr(layer.mlp, "gate")]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(picked, dim=1)


@pytest.mark.parametrize("kernels", ["false", "true"])
@pytest.mark.parametrize("name", sorted(QWEN3_CONFIGS))
def test_greedy_tokens_and_routes_match_transformers(models, name, kernels):
    hf, model, arch = models[name]
    prompts = _prompts()
    # 3 rows for 6 prompts: finished rows are refilled (cache rows move)
    outs = _engine(model, arch, cpu_kernels=kernels, max_batch_size=3,
                   share_prefill=True).generate(prompts, GREEDY)
    for p, o, ref in zip(prompts, outs, _reference(hf, name, prompts)):
        assert o.token_ids == ref
        if not arch.is_moe:
            assert o.routes is None
            continue
        seq = p + o.token_ids[:-1]  # every position the engine ran
        assert o.routes.dtype == torch.int16
        assert o.routes.shape == (len(seq), len(arch.moe_layers), arch.moe_topk)
        assert torch.equal(o.routes.long(), _hf_routes(hf, seq))


@pytest.mark.parametrize("name", ["qwen3_tied", "qwen3_moe"])
def test_static_steps_decode_like_the_eager_path_and_read_nothing(models, name,
                                                                  monkeypatch):
    """The fixed-shape steps CUDA graphs capture (``GraphedDecoder(capture=False)``),
    with MoE routing in them: same tokens, log-probs and routes as the eager path, no
    device read inside the step, one host read per plain step."""
    _, model, arch = models[name]
    prompts = _prompts((3, 9, 5, 1, 12, 7, 2))
    params = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=NEW, seed=3,
                            ignore_eos=True)
    eager = _engine(model, arch, cpu_kernels="false", max_batch_size=4)
    want = eager.generate(prompts, params)
    static = _engine(model, arch, cpu_kernels="false", max_batch_size=4)
    static.enable_graphs(capture=False)
    inside = HostSyncCounter()
    replay = _Step.replay

    def counted(self):
        with inside:
            return replay(self)

    monkeypatch.setattr(_Step, "replay", counted)
    got = static.generate(prompts, params)
    assert inside.count == 0, inside.where
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
        assert (a.routes is None) == (not arch.is_moe)
        if arch.is_moe:
            assert torch.equal(a.routes, b.routes)
    for kernels in ("false", "true"):
        steps = measure(_engine(model, arch, cpu_kernels=kernels), prompts[:3], params)
        assert len(steps) >= NEW - 1 and max(s.count for s in steps) <= 1


def test_masked_per_expert_path_decodes_alike(models, monkeypatch):
    """Where ``torch._grouped_mm`` does not run (float32 on CUDA), each expert's GEMM
    over every row, masked to its own (``experts._grouped``): the same tokens, log-probs
    and routes as the grouped GEMM."""
    from megatron_tlt.rollout import experts

    _, model, arch = models["qwen3_moe"]
    prompts = _prompts()[:3]
    want = _engine(model, arch, cpu_kernels="false").generate(prompts, GREEDY)
    monkeypatch.setitem(experts._GROUPED_OK, ("cpu", torch.float32), False)
    got = _engine(model, arch, cpu_kernels="false").generate(prompts, GREEDY)
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and torch.equal(a.routes, b.routes)
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) <= 1e-5
