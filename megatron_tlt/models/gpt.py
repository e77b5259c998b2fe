"""Build a megatron-core GPTModel from a Hugging Face config (the families of
``models.families``: Llama, Qwen2/2.5, Qwen3, Qwen3-MoE).

``ModelArch`` is the architecture as megatron needs it, read from a Hugging Face
``config.json`` (either the transformers 4.x layout with ``rope_theta`` /
``rope_scaling`` or the 5.x layout with ``rope_parameters``); the family of its
``model_type`` sets the features (QKV bias, QK norm, experts). ``build_gpt_model``
turns it into a real megatron-core ``GPTModel`` for the current parallel rank, with
the local layer spec on CPU and the Transformer Engine spec when TE and CUDA exist.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F

from ..runtime_env import cuda_placements_on_cpu
from .families import FAMILIES, UnsupportedModelError, family_of
from .moe import NO_MOE_OPTIONS, MoeOptions
from . import moe as moe_specs

SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# megatron-core's Llama-3 RoPE scaling hard-codes these (Llama 3.1/3.2 values).
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192}


@dataclass(frozen=True)
class ModelArch:
    """Architecture of a decoder-only model of one of the families, in megatron terms.

    Mixture-of-experts fields (``num_experts`` > 0): ``moe_topk`` experts per token,
    each an MLP of ``moe_ffn_hidden_size``; ``moe_layers``: the global indices of the
    sparse layers (the others have a dense MLP of ``ffn_hidden_size``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    rotary_base: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    rope_scaling: Optional[dict] = None
    hf_config: dict = field(default_factory=dict, compare=False, repr=False)
    qk_layernorm: bool = False
    num_experts: int = 0
    moe_topk: int = 0
    moe_ffn_hidden_size: int = 0
    moe_norm_topk_prob: bool = True
    moe_layers: tuple = ()

    # ---------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> "ModelArch":
        features = family_of(config).read(config)  # checks; raises UnsupportedModelError
        heads = int(config["num_attention_heads"])
        groups = int(config.get("num_key_value_heads") or heads)
        if groups <= 0 or heads % groups:  # (before any weight is read or written)
            raise UnsupportedModelError(
                f"config.json: num_attention_heads={heads} is not a multiple of "
                f"num_key_value_heads={groups}: every key/value head serves the same number "
                "of query heads; use a config whose num_key_value_heads divides "
                "num_attention_heads")
        hidden = int(config["hidden_size"])
        rope_theta, rope_scaling = _read_rope(config)
        return cls(
            model_type=config["model_type"],
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            ffn_hidden_size=int(config["intermediate_size"]),
            num_layers=int(config["num_hidden_layers"]),
            num_attention_heads=heads,
            num_query_groups=int(config.get("num_key_value_heads") or heads),
            kv_channels=int(config.get("head_dim") or hidden // heads),
            norm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
            rotary_base=rope_theta,
            max_position_embeddings=int(config.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            rope_scaling=rope_scaling,
            hf_config=dict(config),
            **features,
        )

    @classmethod
    def from_hf_folder(cls, path: str | Path) -> "ModelArch":
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(
                f"{cfg_file} not found: model.hf_path must be a Hugging Face model folder "
                "(config.json + *.safetensors)"
            )
        return cls.from_hf_config(json.loads(cfg_file.read_text()))

    # ---------------------------------------------------------------- derived sizes
    def padded_vocab_size(self, tp: int) -> int:
        """Vocabulary rounded up so every tensor-parallel rank holds an equal slice."""
        return int(math.ceil(self.vocab_size / tp) * tp)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether global layer ``i`` has a mixture-of-experts MLP."""
        return i in self.moe_layers

    @property
    def num_parameters(self) -> int:
        h, f, v = self.hidden_size, self.ffn_hidden_size, self.vocab_size
        q = self.num_attention_heads * self.kv_channels
        kv = self.num_query_groups * self.kv_channels
        attn = h * (q + 2 * kv) + q * h + 2 * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.qk_layernorm:
            attn += 2 * self.kv_channels
        sparse = len(self.moe_layers)
        experts = self.num_experts * 3 * h * self.moe_ffn_hidden_size + self.num_experts * h
        mlps = (self.num_layers - sparse) * 3 * h * f + sparse * experts
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * attn + mlps + emb + h


def _read_rope(config: dict) -> tuple[float, Optional[dict]]:
    """(theta, scaling) from either config layout; scaling None means plain RoPE."""
    params = config.get("rope_parameters")
    if isinstance(params, dict):
        theta = params.get("rope_theta", config.get("rope_theta", 10000.0))
        scaling = dict(params)
    else:
        theta = config.get("rope_theta", 10000.0)
        scaling = dict(config.get("rope_scaling") or {})
    scaling.pop("rope_theta", None)
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), {"rope_type": "linear", "factor": float(scaling["factor"])}
    if rope_type == "llama3":
        for key, expected in _MEGATRON_LLAMA3_ROPE.items():
            if float(scaling.get(key, expected)) != expected:
                raise UnsupportedModelError(
                    f"llama3 RoPE scaling with {key}={scaling.get(key)} is not supported: "
                    f"megatron-core implements {key}={expected}"
                )
        return float(theta), {"rope_type": "llama3", "factor": float(scaling["factor"])}
    raise UnsupportedModelError(
        f"RoPE scaling type {rope_type!r} is not supported (supported: default, linear, llama3)"
    )


# -------------------------------------------------------------------------------------
# megatron-core objects
# -------------------------------------------------------------------------------------

def te_available() -> bool:
    """Transformer Engine is usable: installed and CUDA present."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def resolve_impl(impl: str) -> str:
    """'auto' -> 'transformer_engine' when TE and CUDA exist, else 'local'."""
    if impl == "auto":
        return "transformer_engine" if te_available() else "local"
    if impl == "transformer_engine" and not te_available():
        raise RuntimeError(
            "model.transformer_impl='transformer_engine' needs CUDA and the "
            "transformer-engine package (pip install -e .[gpu]); use 'local' or 'auto'"
        )
    if impl not in ("local", "transformer_engine"):
        raise ValueError(f"model.transformer_impl must be auto/local/transformer_engine: {impl!r}")
    return impl


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, float32 on CPU."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be auto/float32/bfloat16/float16, got {dtype!r}")
    return DTYPES[dtype]


@dataclass(frozen=True)
class MemoryControls:
    """megatron-core's activation-memory controls for the trained model.

    recompute_granularity: "none", "selective" (core attention recomputed in backward:
        drops the s^2 attention terms) or "full" (whole layers recomputed: only each
        checkpointed chunk's input is kept);
    recompute_method / recompute_num_layers: for "full", which layers (megatron-core's
        "uniform": chunks of ``recompute_num_layers`` layers, every chunk checkpointed;
        "block": the first ``recompute_num_layers`` layers of each stage);
    sequence_parallel: shard the activations outside attention/MLP along the sequence
        over the TP group (TP > 1 only). Sequences must then be a multiple of TP long.
    """

    recompute_granularity: str = "none"
    recompute_method: str = "uniform"
    recompute_num_layers: int = 1
    sequence_parallel: bool = False

    def transformer_kwargs(self) -> dict:
        if self.recompute_granularity == "none":
            out: dict[str, Any] = {}
        elif self.recompute_granularity == "selective":
            out = dict(recompute_granularity="selective")
        elif self.recompute_granularity == "full":
            out = dict(recompute_granularity="full", recompute_method=self.recompute_method,
                       recompute_num_layers=self.recompute_num_layers)
        else:
            raise ValueError(f"recompute_granularity must be none/selective/full, got "
                             f"{self.recompute_granularity!r}")
        out["sequence_parallel"] = self.sequence_parallel
        return out


NO_MEMORY_CONTROLS = MemoryControls()


def transformer_config(arch: ModelArch, *, dtype: torch.dtype, device: torch.device,
                       tp: int = 1, pp: int = 1, impl: str = "local",
                       memory: MemoryControls = NO_MEMORY_CONTROLS, ep: int = 1,
                       moe: MoeOptions = NO_MOE_OPTIONS):
    """megatron-core TransformerConfig for ``arch``.

    On CPU every fused kernel is switched off (they are CUDA-only) and weights are
    created on CPU; on CUDA megatron-core's defaults apply. ``memory`` sets
    megatron-core's recomputation and sequence parallelism (they change activations
    only, never the parameters' shapes or values). ``ep`` and ``moe``: the experts'
    parallel size and options (``models.moe``).
    """
    if memory.sequence_parallel and tp == 1:
        memory = dataclasses.replace(memory, sequence_parallel=False)
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    on_cpu = device.type != "cuda"
    kwargs = dict(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        ffn_hidden_size=arch.ffn_hidden_size,
        num_attention_heads=arch.num_attention_heads,
        num_query_groups=arch.num_query_groups,
        kv_channels=arch.kv_channels,
        layernorm_epsilon=arch.norm_epsilon,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True,
        apply_query_key_layer_scaling=False,
        use_cpu_initialization=on_cpu,
        perform_initialization=False,  # weights always come from a checkpoint or caller
        qk_layernorm=arch.qk_layernorm,
        **memory.transformer_kwargs(),
        **moe_specs.transformer_kwargs(arch, moe, ep),
    )
    if on_cpu or impl == "local":
        kwargs.update(
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
            apply_rope_fusion=False,
            attention_backend=AttnBackend.local if on_cpu else AttnBackend.auto,
        )
    else:
        kwargs.update(bias_activation_fusion=True, gradient_accumulation_fusion=False)
    return TransformerConfig(**kwargs)


def layer_spec(impl: str):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if impl == "transformer_engine":
        return specs.get_gpt_layer_with_transformer_engine_spec()
    return specs.get_gpt_layer_local_spec(normalization="RMSNorm")


class SequenceParallelTorchRMSNorm(torch.nn.RMSNorm):
    """torch's RMSNorm, the norm megatron-core's local spec builds without apex
    (``WrappedTorchNorm``), made usable under sequence parallelism, which
    ``WrappedTorchNorm`` refuses.

    Under SP a rank normalises only its shard of the sequence, so its weight gradient is
    a partial sum; tagged ``sequence_parallel`` (as apex's FusedLayerNorm and Transformer
    Engine tag theirs), megatron-core's ``finalize_model_grads`` sums it over the TP
    group. Same parameter name and values as the plain norm.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_unused):
        super().__init__(hidden_size, eps=eps)
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))


def _block_spec(impl: str, config, arch: ModelArch):
    """The stage's transformer block spec: ``layer_spec(impl)`` for every layer of a
    family without QK norm or experts, else each layer's own (``models.moe``), with norms
    that support sequence parallelism where megatron-core's torch fallback does not
    (local spec)."""
    from megatron.core.transformer.transformer_block import (LayerNormImpl,
                                                             TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    per_layer = arch.qk_layernorm or arch.is_moe
    sp = impl != "transformer_engine" and config.sequence_parallel
    if not per_layer and not sp:
        return layer_spec(impl)
    specs = (moe_specs.stage_layer_specs(arch, impl, config) if per_layer
             else [layer_spec(impl)] * get_num_layers_to_build(config))
    final = LayerNormImpl
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        final = TENorm
    if sp:
        specs = [dataclasses.replace(s, submodules=dataclasses.replace(
            s.submodules, input_layernorm=SequenceParallelTorchRMSNorm,
            pre_mlp_layernorm=SequenceParallelTorchRMSNorm)) for s in specs]
        final = SequenceParallelTorchRMSNorm
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=final)


def build_gpt_model(arch: ModelArch, *, dtype: torch.dtype, device: torch.device,
                    impl: str = "local", tp: int = 1, pp: int = 1,
                    pre_process: bool = True, post_process: bool = True,
                    memory: MemoryControls = NO_MEMORY_CONTROLS, ep: int = 1,
                    moe: MoeOptions = NO_MOE_OPTIONS):
    """A megatron-core GPTModel for this rank's pipeline stage (weights uninitialised).

    Call after ``parallel.initialize_model_parallel``. The vocabulary is padded to a
    multiple of ``tp``; ``logits`` helpers in ``models.inference`` slice it back. ``ep``
    and ``moe``: expert parallelism and the experts' options (``models.moe``).
    """
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(arch, dtype=dtype, device=device, tp=tp, pp=pp, impl=impl,
                                memory=memory, ep=ep, moe=moe)
    rope_kwargs: dict[str, Any] = {}
    if arch.rope_scaling and arch.rope_scaling["rope_type"] == "llama3":
        rope_kwargs = dict(rope_scaling=True, rope_scaling_factor=arch.rope_scaling["factor"])
    elif arch.rope_scaling and arch.rope_scaling["rope_type"] == "linear":
        rope_kwargs = dict(seq_len_interpolation_factor=arch.rope_scaling["factor"])
    with cuda_placements_on_cpu():  # tied embeddings under PP sync via .cuda() tensors
        model = GPTModel(
            config=config,
            transformer_layer_spec=_block_spec(impl, config, arch),
            vocab_size=arch.padded_vocab_size(tp),
            max_sequence_length=arch.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=arch.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=arch.rotary_base,
            parallel_output=True,
            **rope_kwargs,
        )
    mark_tensor_parallel_params(model)
    # megatron-core builds its torch-norm fallback on the CPU (Megatron-LM moves the
    # model with .cuda() afterwards), and its local-spec norms in fp32; like
    # Megatron-LM's Float16Module, the whole model runs in the low-precision dtype.
    return model.to(device=device, dtype=dtype)


def mark_tensor_parallel_params(model) -> None:
    """Tag TP-sharded parameters as megatron-core's initialisers would.

    megatron-core sets ``tensor_model_parallel`` / ``partition_dim`` only inside its
    weight initialisers, which ``perform_initialization=False`` skips (our weights come
    from checkpoints). Without the tags its gradient-norm and checkpoint code takes every
    shard for a TP duplicate: at TP=2 the clipping norm silently counted one shard.
    """
    from megatron.core import tensor_parallel as tpl

    for module in model.modules():
        if isinstance(module, (tpl.ColumnParallelLinear, tpl.VocabParallelEmbedding)):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, tpl.RowParallelLinear):
            dims = {"weight": 1}  # its bias is added after the all-reduce: replicated
        else:
            continue
        for name, dim in dims.items():
            p = getattr(module, name, None)
            if isinstance(p, torch.nn.Parameter) and not getattr(p, "tensor_model_parallel",
                                                                 False):
                tpl.set_tensor_model_parallel_attributes(p, True, dim, 1)


def memory_controls(train_cfg, parallel_cfg) -> MemoryControls:
    """The ``MemoryControls`` a run's config asks for (``train.recompute_*``,
    ``parallel.sequence_parallel``: auto = on at TP > 1; gloo runs its reduce-scatter and
    all-gather, so the backend does not matter)."""
    tp = parallel_cfg.tensor_model_parallel_size
    sp = parallel_cfg.sequence_parallel
    return MemoryControls(
        recompute_granularity=train_cfg.recompute_granularity,
        recompute_method=train_cfg.recompute_method,
        recompute_num_layers=train_cfg.recompute_num_layers,
        sequence_parallel=tp > 1 and sp in ("auto", "on"))
