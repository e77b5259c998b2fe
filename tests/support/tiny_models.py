"""Tiny random Hugging Face models for parity tests (built offline, seconds each).

Every parameter, biases and norms included, is randomised so a wrong layout cannot
hide behind zeros or ones. Sizes are chosen to exercise: GQA (4 heads, 2 KV groups),
a head_dim different from hidden/heads, llama3 RoPE scaling, Qwen2's QKV bias, tied and
untied embeddings, and a vocabulary (251) that TP=2 must pad.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 251

TINY_CONFIGS = {
    "llama_tied": dict(
        family="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-5,
        max_position_embeddings=256),
    "llama_untied": dict(
        family="llama", vocab_size=VOCAB, hidden_size=64, intermediate_size=80,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-6,
        max_position_embeddings=16384,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen2": dict(
        family="qwen2", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=256),
}


def build_tiny_hf(name: str, seed: int = 0, **overrides):
    """A transformers model of TINY_CONFIGS[name] (plus ``overrides``) with every
    parameter randomised."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    spec = {**TINY_CONFIGS[name], **overrides}
    family = spec.pop("family")
    cfg_cls, model_cls = ((LlamaConfig, LlamaForCausalLM) if family == "llama"
                          else (Qwen2Config, Qwen2ForCausalLM))
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**spec)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=gen))
    return model


def save_tiny_hf(name: str, folder: Path, seed: int = 0, **overrides) -> Path:
    folder = Path(folder)
    build_tiny_hf(name, seed, **overrides).save_pretrained(folder)
    return folder
