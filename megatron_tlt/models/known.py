"""The architecture a config names, without loading weights: its config.json when the
folder is here, else the public config of a model the recipes name (so a cluster
recipe can be checked on a laptop). Used by the dry run and the TLT planner."""

from __future__ import annotations

from pathlib import Path

from ..config import Config, ConfigError

# Public config.json fields of models our recipes use (Hugging Face model cards).
KNOWN_ARCHITECTURES = {
    "Qwen2.5-7B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064,
        hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen2.5-32B-Instruct": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"], vocab_size=152064,
        hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=32768,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "Qwen3-8B": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=151936,
        hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, attention_bias=False,
        max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_word_embeddings=False),
    "Qwen3-30B-A3B": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], vocab_size=151936,
        hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        attention_bias=False, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
}


def architecture(cfg: Config):
    """(ModelArch, where it came from) for ``cfg.model.hf_path``: its config.json when
    it is here, else a known public architecture of that name."""
    from . import arch_from_source
    from .gpt import ModelArch

    name = str(cfg.model.hf_path or "")
    path = Path(name).expanduser()
    if name == "smollm2" or path.exists():
        from . import resolve_source

        return arch_from_source(resolve_source(name)), "config.json"
    key = path.name
    if key in KNOWN_ARCHITECTURES:
        return ModelArch.from_hf_config(KNOWN_ARCHITECTURES[key]), "built-in public config"
    raise ConfigError(
        f"model.hf_path={name!r} is not here and is not a known architecture "
        f"({', '.join(KNOWN_ARCHITECTURES)}); the dry run needs its config.json")
