"""Parameter counts of the models megatron_tlt builds, per tensor-parallel rank: pure
arithmetic on a ``ModelArch``, shared by the dry run's memory model, the planner and
the drafter kinds' memory terms."""

from __future__ import annotations


def layer_params(arch, tp: int) -> float:
    """One decoder layer's parameters on one TP rank (norms replicated): QKV (with its
    bias), the output projection, SwiGLU's fc1 (gate and up) and fc2, two norms."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    bias = (q + 2 * kvw) if arch.qkv_bias else 0
    return (h * (q + 2 * kvw) + bias + q * h + 3 * h * arch.ffn_hidden_size) / tp + 2 * h


def stage_params(arch, tp: int, pp: int, stage: int) -> float:
    """Parameters of pipeline stage ``stage`` on one TP rank: its layers and the
    vocabulary matrices it owns (the embedding on the first, the output layer on the
    last, one shared matrix at PP = 1 with tied embeddings)."""
    v = arch.padded_vocab_size(tp) // tp
    first, last = stage == 0, stage == pp - 1
    mats = int(first) + int(last and (pp > 1 or not arch.tie_word_embeddings))
    return (arch.num_layers // pp) * layer_params(arch, tp) + mats * v * arch.hidden_size \
        + (arch.hidden_size if last else 0)
