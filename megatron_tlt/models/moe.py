"""Mixture-of-experts on megatron-core: the transformer-config fields and layer specs of
the sparse families (Qwen3-MoE), and the trainer-facing options.

megatron-core's ``MoELayer`` does the work: ``TopKRouter`` (softmax scores, top-k,
``moe_router_pre_softmax`` False = the k chosen logits softmaxed = transformers'
``norm_topk_prob=True``; True = softmax over every expert, then top-k, no
renormalisation), a token dispatcher, and ``SequentialMLP`` experts (one megatron-core
``MLP`` per local expert: ``mlp.experts.local_experts.{e}.linear_fc1/fc2``), which run on
CPU and GPU alike; the grouped-GEMM experts need the ``grouped_gemm`` package or
Transformer Engine and are not used here.

Expert parallelism (``parallel.expert_model_parallel_size`` = EP): each rank holds
``num_experts / EP`` experts; the expert-parallel groups come from megatron-core's
``parallel_state`` (``parallel.initialize_model_parallel``). The expert tensor-parallel
size is the TP size (megatron-core's default), so an expert's matrices are sharded over
TP exactly as a dense MLP's.

Dispatcher: ``alltoall`` (megatron-core's choice for EP, and what Megatron-LM's MoE
recipes use). It exchanges token counts, then the tokens, with ``all_to_all_single``
over the EP group, so the ranks of an EP group may hold different numbers of tokens
(RL micro-batches are cut to their own longest sample, so their shapes differ between
data-parallel ranks). gloo runs ``all_to_all_single`` with uneven splits (torch >= 2.x);
the ``allgather`` dispatcher also runs on gloo but gathers equal shapes over the TP x EP
group, which uneven micro-batches violate.

Router precision: logits and scores in float32 (``moe_router_dtype='fp32'``), whatever
the model dtype, as the rollout engine computes them, so the two route alike except
where bf16 hidden states differ.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

DISPATCHER = "alltoall"


@dataclass(frozen=True)
class MoeOptions:
    """What a run sets about its experts (the architecture is ``ModelArch``'s).

    aux_loss_coef: megatron-core's switch load-balancing loss coefficient
        (``train.moe_aux_loss_coef``; 0 = off);
    routing_replay: build the routers with megatron-core's ``RouterReplay``, so a forward
        can be told each token's experts (``grpo.routing_replay``; ``moe_replay``).
    """

    aux_loss_coef: float = 0.0
    routing_replay: bool = False


NO_MOE_OPTIONS = MoeOptions()


def moe_options(train_cfg, grpo_cfg) -> MoeOptions:
    """A run's ``MoeOptions``: ``train.moe_aux_loss_coef`` and ``grpo.routing_replay``
    (both inert for a dense model)."""
    return MoeOptions(aux_loss_coef=train_cfg.moe_aux_loss_coef,
                      routing_replay=grpo_cfg.routing_replay)


def patch_missing_te_names() -> None:
    """megatron-core 0.16's router gating reads ``moe_utils.te_general_gemm``, a name that
    module defines only when Transformer Engine imports: without TE every router forward
    fails with a NameError. The name is set to None there (its own "no TE" value), so
    the router's torch matmul runs; nothing changes where TE is installed."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def transformer_kwargs(arch, options: MoeOptions, ep: int) -> dict:
    """megatron-core TransformerConfig fields of ``arch``'s experts (empty for a dense
    model): counts, top-k, expert width, the sparse-layer pattern, the router's score
    function and precision, the dispatcher, the auxiliary loss and routing replay."""
    if not arch.num_experts:
        return {}
    patch_missing_te_names()
    coef = float(options.aux_loss_coef)
    return dict(
        num_moe_experts=arch.num_experts,
        moe_router_topk=arch.moe_topk,
        moe_ffn_hidden_size=arch.moe_ffn_hidden_size,
        moe_router_pre_softmax=not arch.moe_norm_topk_prob,
        moe_router_score_function="softmax",
        moe_router_dtype="fp32",
        moe_layer_freq=[1 if arch.is_moe_layer(i) else 0 for i in range(arch.num_layers)],
        moe_token_dispatcher_type=DISPATCHER,
        moe_router_load_balancing_type="aux_loss" if coef > 0 else "none",
        moe_aux_loss_coeff=coef,
        moe_enable_routing_replay=bool(options.routing_replay),
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep,
    )


class TorchRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm with megatron-core's norm constructor arguments: the per-head
    query / key norm (``qk_layernorm``). megatron-core's torch fallback
    (``WrappedTorchNorm``) builds the same module but refuses a config with sequence
    parallelism, which never shards these (they see whole sequences after the QKV
    projection); megatron-core all-reduces their gradients over TP by name
    (``finalize_model_grads``), as each TP rank normalises its own heads."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)


def layer_spec(arch, impl: str, layer: int):
    """megatron-core's layer spec for global layer ``layer`` of ``arch``: its MLP dense or
    sparse, with or without the query / key norm."""
    from megatron.core.models.gpt import gpt_layer_specs as specs

    experts = arch.num_experts if arch.is_moe_layer(layer) else None
    if impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=experts, moe_grouped_gemm=False, qk_layernorm=arch.qk_layernorm)
    spec = specs.get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False,
                                          qk_layernorm=arch.qk_layernorm,
                                          normalization="RMSNorm")
    if arch.qk_layernorm:
        att = spec.submodules.self_attention
        att = dataclasses.replace(att, submodules=dataclasses.replace(
            att.submodules, q_layernorm=TorchRMSNorm, k_layernorm=TorchRMSNorm))
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=att))
    return spec


def stage_layer_specs(arch, impl: str, config) -> list:
    """The layer specs of this pipeline stage's layers, in order."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    offset = get_transformer_layer_offset(config)
    return [layer_spec(arch, impl, i)
            for i in range(offset, offset + get_num_layers_to_build(config))]
