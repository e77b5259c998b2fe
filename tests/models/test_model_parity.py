"""megatron-core GPTModel built by megatron_tlt vs transformers, single process (TP=PP=1)."""

from __future__ import annotations

import pytest
import torch

from megatron_tlt.models import load_model
from megatron_tlt.models.inference import forward_local_logits, gather_logits, token_logprobs
from tiny_models import TINY_CONFIGS, VOCAB, build_tiny_hf

TOL = 1e-4


def _inputs(seed: int = 0, batch: int = 3, seq: int = 17) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_logits_and_logprobs_match_transformers(name, tiny_hf_dirs, single_process_parallel):
    hf = build_tiny_hf(name)
    model, arch = load_model(tiny_hf_dirs[name], device=torch.device("cpu"), dtype="float32")
    ids = _inputs()
    targets = torch.roll(ids, -1, dims=1)
    with torch.no_grad():
        ref = hf(ids).logits
        local = forward_local_logits(model, ids)
        logits = gather_logits(local, arch)
        logprobs = token_logprobs(local, targets, arch)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= TOL
    ref_lp = torch.log_softmax(ref.double(), -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    assert (logprobs.double() - ref_lp).abs().max().item() <= TOL
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_logprobs_are_differentiable(tiny_hf_dirs, single_process_parallel):
    """The policy loss will backpropagate through token_logprobs."""
    model, arch = load_model(tiny_hf_dirs["llama_tied"], device=torch.device("cpu"))
    ids = _inputs(batch=2, seq=9)
    lp = token_logprobs(forward_local_logits(model, ids), torch.roll(ids, -1, 1), arch)
    lp.sum().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)


def test_logprobs_leave_the_logits_untouched(tiny_hf_dirs, single_process_parallel):
    """megatron-core's cross-entropy works in place; callers' logits must survive it."""
    model, arch = load_model(tiny_hf_dirs["qwen2"], device=torch.device("cpu"))
    ids = _inputs(batch=1, seq=7)  # batch 1: a transpose is already contiguous
    with torch.no_grad():
        local = forward_local_logits(model, ids)
        before = local.clone()
        token_logprobs(local, torch.roll(ids, -1, 1), arch)
    assert torch.equal(local, before)


def test_vocab_padding_is_masked_in_logprobs(single_process_parallel):
    """Padding rows of a padded vocabulary must not take probability mass."""
    from megatron_tlt.models.gpt import ModelArch

    arch = ModelArch.from_hf_config(dict(
        model_type="llama", vocab_size=5, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=1))
    logits = torch.zeros(1, 1, 8)  # 3 padding columns with logit 0
    lp = token_logprobs(logits, torch.tensor([[2]]), arch)
    assert torch.allclose(lp, torch.log(torch.tensor([[1 / 5]])))


def test_unsupported_configs_are_rejected():
    from megatron_tlt.models.gpt import ModelArch, UnsupportedModelError

    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=1)
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        ModelArch.from_hf_config({**base, "model_type": "gpt2"})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        ModelArch.from_hf_config({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(UnsupportedModelError, match="high_freq_factor"):
        ModelArch.from_hf_config({**base, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}})


def test_both_hf_config_layouts_read_the_same_rope():
    """transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters) layouts."""
    from megatron_tlt.models.gpt import ModelArch

    base = dict(model_type="llama", vocab_size=8, hidden_size=8, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=1)
    old = ModelArch.from_hf_config({**base, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0}})
    new = ModelArch.from_hf_config({**base, "rope_parameters": {
        "rope_type": "llama3", "factor": 32.0, "rope_theta": 5e5}})
    assert old.rotary_base == new.rotary_base == 5e5
    assert old.rope_scaling == new.rope_scaling == {"rope_type": "llama3", "factor": 32.0}


def test_bfloat16_model_tracks_fp32(tiny_hf_dirs, single_process_parallel):
    """model.dtype=bfloat16 builds bf16 weights whose logits stay near the fp32 ones.

    A loose bound: bf16 keeps 8 mantissa bits; this checks the dtype plumbing (weights
    cast on load, RoPE and softmax still sane), not bit-level numerics.
    """
    fp32, arch = load_model(tiny_hf_dirs["qwen2"], device=torch.device("cpu"), dtype="float32")
    bf16, _ = load_model(tiny_hf_dirs["qwen2"], device=torch.device("cpu"), dtype="bfloat16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    ids = _inputs(batch=2, seq=12)
    with torch.no_grad():
        ref = gather_logits(forward_local_logits(fp32, ids), arch)
        low = gather_logits(forward_local_logits(bf16, ids), arch).float()
    scale = ref.abs().max().item()
    assert (low - ref).abs().max().item() <= 0.05 * scale
    assert (low.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.9
