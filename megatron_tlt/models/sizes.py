"""Parameter counts of the models megatron_tlt builds, per tensor-parallel (and
expert-parallel) rank: pure arithmetic on a ``ModelArch``, shared by the dry run's
memory model, the planner and the drafter kinds' memory terms.

A mixture-of-experts layer (``arch.moe_layers``) holds its attention, a router
[num_experts, hidden] (replicated) and ``num_experts / EP`` experts of
3 x hidden x ``moe_ffn_hidden_size`` each (sharded over TP like a dense MLP); the other
layers a dense SwiGLU MLP of ``ffn_hidden_size``. A token's forward multiplies by the
router and its ``moe_topk`` experts only (``active_params``)."""

from __future__ import annotations


def attention_params(arch, tp: int) -> float:
    """One layer's attention on one TP rank: QKV (with its bias), the output projection,
    and Qwen3's per-head query / key norms (replicated)."""
    h, q = arch.hidden_size, arch.num_attention_heads * arch.kv_channels
    kvw = arch.num_query_groups * arch.kv_channels
    bias = (q + 2 * kvw) if arch.qkv_bias else 0
    qk = 2 * arch.kv_channels if arch.qk_layernorm else 0
    return (h * (q + 2 * kvw) + bias + q * h) / tp + qk


def layer_params(arch, tp: int) -> float:
    """One dense decoder layer's parameters on one TP rank (norms replicated): the
    attention, SwiGLU's fc1 (gate and up) and fc2 of ``ffn_hidden_size``, two norms.
    (An MoE model's sparse layers: ``moe_layer_params``.)"""
    h = arch.hidden_size
    return attention_params(arch, tp) + 3 * h * arch.ffn_hidden_size / tp + 2 * h


def expert_params(arch) -> float:
    """One expert's parameters (unsharded): fc1 (gate and up) and fc2."""
    return 3.0 * arch.hidden_size * arch.moe_ffn_hidden_size


def moe_layer_params(arch, tp: int, ep: int = 1) -> float:
    """One mixture-of-experts layer on one TP x EP rank: the attention, the router,
    ``num_experts / ep`` experts sharded over TP, two norms."""
    h = arch.hidden_size
    return attention_params(arch, tp) + arch.num_experts * h \
        + (arch.num_experts // ep) * expert_params(arch) / tp + 2 * h


def params_of_layer(arch, i: int, tp: int, ep: int = 1) -> float:
    """Global layer ``i`` on one TP x EP rank."""
    return moe_layer_params(arch, tp, ep) if arch.is_moe_layer(i) else layer_params(arch, tp)


def stage_layers(arch, pp: int, stage: int) -> range:
    """The global indices of pipeline stage ``stage``'s layers (an even split)."""
    n = arch.num_layers // pp
    return range(stage * n, (stage + 1) * n)


def stage_params(arch, tp: int, pp: int, stage: int, ep: int = 1) -> float:
    """Parameters of pipeline stage ``stage`` on one TP (x EP) rank: its layers and the
    vocabulary matrices it owns (the embedding on the first, the output layer on the
    last, one shared matrix at PP = 1 with tied embeddings)."""
    v = arch.padded_vocab_size(tp) // tp
    first, last = stage == 0, stage == pp - 1
    mats = int(first) + int(last and (pp > 1 or not arch.tie_word_embeddings))
    layers = sum(params_of_layer(arch, i, tp, ep) for i in stage_layers(arch, pp, stage))
    return layers + mats * v * arch.hidden_size + (arch.hidden_size if last else 0)


def stage_expert_params(arch, tp: int, pp: int, stage: int, ep: int = 1) -> float:
    """Of ``stage_params``, the experts (this rank's ``num_experts / ep`` per MoE layer
    of the stage, sharded over TP); 0 for a dense model."""
    moe = sum(1 for i in stage_layers(arch, pp, stage) if arch.is_moe_layer(i))
    return moe * (arch.num_experts // ep) * expert_params(arch) / tp


def active_params(arch) -> float:
    """Parameters one token's forward multiplies by (all of a dense model's; an MoE
    model's without the experts its router did not choose): ``num_parameters`` less
    (num_experts - moe_topk) experts per MoE layer."""
    idle = len(arch.moe_layers) * (arch.num_experts - arch.moe_topk) * expert_params(arch)
    return float(arch.num_parameters) - idle
