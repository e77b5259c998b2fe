"""A drafter micro-step in row chunks (the drafter group's finer stop checks): the same
update as the whole batch, and a stop between chunks steps on the chunks done."""

from __future__ import annotations

import torch

from megatron_tlt.config import ConfigError, DrafterGroupConfig, RolloutConfig
from megatron_tlt.drafter_training.trainer import DraftSample, DrafterTrainer, target_features
from megatron_tlt.models import load_model
from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter
from megatron_tlt.rollout import RolloutEngine, SamplingParams


def test_chunked_step_equals_whole_batch_and_stops_between_chunks(tiny_hf_dirs,
                                                                   single_process_parallel):
    import pytest

    from megatron_tlt.runtime_env import apply_cpu_redirection

    apply_cpu_redirection()
    model, arch = load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"),
                             dtype="float32")
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, arch.vocab_size, (n,), generator=g).tolist()
               for n in (3, 5, 4, 7)]
    seqs = [p + o.token_ids for p, o in zip(prompts, eng.generate(
        prompts, SamplingParams(temperature=1.0, max_new_tokens=(6), seed=1)))]
    batch = [DraftSample(s, len(p), f, h) for s, p, (f, h) in
             zip(seqs, prompts, target_features(eng.runner, seqs))]
    base = EagleDrafter(DrafterConfig.for_target(arch), arch)
    base.reset_parameters(seed=3)

    def run(chunks, stop=None):
        d = EagleDrafter(DrafterConfig.for_target(arch), arch)
        d.load_state_dict(base.state_dict())
        tr = DrafterTrainer(d, eng.runner, lr=1e-2, warmup_steps=0, grad_clip=0.0)
        parts = tr.step(batch, chunks=chunks, stop=stop)
        # the accumulated gradient (AdamW's first step is ~lr * sign(g): compare g)
        return torch.cat([p.grad.reshape(-1) for p in tr.params]), parts

    whole, pw = run(1)
    chunked, pc = run(2)
    assert pw["chunks"] == 1 and pc["chunks"] == 2 and pc["tokens"] == pw["tokens"]
    assert torch.allclose(whole, chunked, rtol=1e-4, atol=1e-7)
    assert pc["loss"] == pytest.approx(pw["loss"], rel=1e-5)
    asked = []
    stopped, ps = run(4, stop=lambda: asked.append(1) or True)
    assert ps["chunks"] == 1 and len(asked) == 1  # asked before the 2nd chunk, stopped
    assert ps["tokens"] < pw["tokens"]
    assert bool(stopped.abs().sum() > 0) and not torch.allclose(stopped, whole)
    with pytest.raises(ConfigError, match="stop_checks"):
        DrafterGroupConfig(stop_checks=0)
