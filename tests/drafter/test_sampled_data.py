"""Drafter training data from the generation's own hidden states: the same features a
separate forward over prompt + response computes, one prefill per distinct prompt."""

from __future__ import annotations

import torch

from megatron_tlt.config import RolloutConfig
from megatron_tlt.drafter_training import sampled_data
from megatron_tlt.drafter_training.sampled_data import sampled_samples
from megatron_tlt.drafter_training.trainer import target_features
from megatron_tlt.rollout import RolloutEngine, SamplingParams
from tiny_models import VOCAB


def test_sampled_samples_match_a_separate_forward(tiny_llama, monkeypatch):
    model, arch = tiny_llama
    eng = RolloutEngine(model, None, RolloutConfig(), arch=arch, eos_token_ids=[])
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, VOCAB, (3 + i,), generator=g).tolist() for i in range(3)]
    prefills = []
    real = sampled_data.target_features
    monkeypatch.setattr(sampled_data, "target_features",
                        lambda runner, seqs: prefills.extend(seqs) or real(runner, seqs))
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=1, ignore_eos=True)
    samples = sampled_samples(eng, prompts, sp, per_prompt=2, chunk=4)
    assert len(samples) == 6 and sorted(map(tuple, prefills)) == sorted(map(tuple, prompts))
    for i, s in enumerate(samples):
        p = prompts[i // 2]
        assert s.prompt_len == len(p) and s.tokens[: len(p)] == p
        assert len(s.tokens) == len(p) + 5  # the last response token has no state after it
        assert s.features.shape == (len(s.tokens), arch.hidden_size)
        _, want = target_features(eng.runner, [s.tokens])[0]
        assert torch.allclose(s.features, want, atol=1e-4), i
    assert samples[0].tokens != samples[1].tokens  # two samples of one prompt
