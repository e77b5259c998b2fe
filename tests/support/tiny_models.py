"""Tiny random Hugging Face models for parity tests (built offline, seconds each).

Every parameter, biases and norms included, is randomised so a wrong layout cannot
hide behind zeros or ones. Sizes are chosen to exercise: GQA (4 heads, 2 KV groups),
a head_dim different from hidden/heads, llama3 RoPE scaling, Qwen2's QKV bias, tied and
untied embeddings, and a vocabulary (251) that TP=2 must pad.

``QWEN3_CONFIGS``: Qwen3 dense (QK norm, head_dim 24 != 64 / 4, tied and untied) and
Qwen3-MoE (8 experts, top-2, ``norm_topk_prob`` true, one dense layer through
``mlp_only_layers``; and a variant with ``norm_topk_prob`` false and every layer
sparse), made by transformers' own Qwen3 / Qwen3-MoE classes. They are kept apart from
``TINY_CONFIGS`` (whose models every drafter test also runs).
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


QWEN3_CONFIGS = {
    "qwen3_tied": dict(
        family="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=256),
    "qwen3_untied": dict(
        family="qwen3", vocab_size=VOCAB, hidden_size=64, intermediate_size=80,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6,
        max_position_embeddings=256),
    "qwen3_moe": dict(
        family="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        tie_word_embeddings=False, rope_theta=1000000.0, rms_norm_eps=1e-6,
        max_position_embeddings=256),
    "qwen3_moe_unnormed": dict(
        family="qwen3_moe", vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
        moe_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256),
}
ALL_CONFIGS = {**TINY_CONFIGS, **QWEN3_CONFIGS}


def _classes(family: str):
    import transformers as tf

    return {"llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
            "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
            "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
            "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM)}[family]


def build_tiny_hf(name: str, seed: int = 0, **overrides):
    """A transformers model of TINY_CONFIGS[name] or QWEN3_CONFIGS[name] (plus
    ``overrides``) with every parameter randomised."""
    spec = {**ALL_CONFIGS[name], **overrides}
    family = spec.pop("family")
    cfg_cls, model_cls = _classes(family)
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


def sampling_modes(max_new_tokens: int) -> dict:
    """Greedy, standard and coupled sampling settings (temperature 0.9, top-p 0.95,
    seed 3, EOS ignored), for tests that run every mode."""
    from megatron_tlt.rollout import SamplingParams

    sampled = dict(temperature=0.9, top_p=0.95, max_new_tokens=max_new_tokens, seed=3,
                   ignore_eos=True)
    return {"greedy": SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens,
                                     ignore_eos=True),
            "standard": SamplingParams(**sampled), "coupled": SamplingParams(**sampled)}


def tiny_model_and_own_layer_drafter(folder: Path, device) -> tuple:
    """A tiny two-layer llama_tied model (seed 5) saved in ``folder`` and loaded on
    ``device`` in float32, and an EAGLE drafter that is the model's own first layer
    (fc passes the embedding through): its drafts are often accepted, so acceptance
    and commit run over several tokens. Returns (model, arch, drafter)."""
    from megatron_tlt.models import load_model
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter

    save_tiny_hf("llama_tied", folder, seed=5, num_hidden_layers=2)
    m, arch = load_model(folder, device=torch.device(device), dtype="float32", impl="local")
    d = EagleDrafter(DrafterConfig.for_target(arch), arch, dtype=torch.float32, device=device)
    with torch.no_grad():
        d.layer.load_state_dict(m.decoder.layers[0].state_dict())
        h = arch.hidden_size
        d.fc.weight.copy_(torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1).to(device))
        d.norm.copy_(m.decoder.final_layernorm.weight)
    return m, arch, d


def random_eagle(arch, seed: int = 1):
    """A one-layer EAGLE drafter for ``arch`` with seeded random weights."""
    from megatron_tlt.models.drafter import DrafterConfig, EagleDrafter

    d = EagleDrafter(DrafterConfig.for_target(arch), arch)
    d.reset_parameters(seed=seed)
    return d
