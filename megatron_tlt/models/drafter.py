"""EAGLE-style one-layer drafter for speculative decoding.

At position t the drafter reads the next token and the target's hidden state:

    x_t = fc(concat(embed(tok_{t+1}), h_t))  ->  one decoder layer  ->  RMSNorm  ->  ĥ_{t+1}
    q(tok_{t+2}) = softmax(output_layer(ĥ_{t+1}))

``h_t`` is the target's final hidden state *after* its final norm (the LM head's
input; the same tensor ``RolloutOutput.hidden_states`` returns), and the drafter's
output ĥ is trained to predict h_{t+1} in that same space, so when drafting several
tokens ahead the drafter feeds its own ĥ back in place of h. The embedding and the
output layer are the target's own (frozen, shared, vocab-parallel under TP); the
drafter owns only ``fc``, the decoder layer (a megatron-core ``TransformerLayer`` of the
target's width and attention, dense: its shape is the target family's answer,
``Family.drafter_layer``, e.g. Qwen3's QK norm and a dense MLP for a Qwen3-MoE target)
and its final norm, and optionally:

- EAGLE-3 features: h_t is the concatenation of three target layers' outputs
  (``feature_layers``), reduced by ``feature_fc`` (3H -> H) before ``fc``;
- a pruned draft vocabulary: the ``draft_vocab_size`` most frequent tokens; ``d2t``
  maps draft ids to target ids and the draft head is the target output layer's rows
  for those tokens (re-gathered on ``refresh``, never stored);
- FP8 linear layers through Transformer Engine (CUDA + TE only).

The checkpoint (``save_drafter``/``load_drafter``) is one safetensors file holding
only drafter-owned tensors (unsharded) plus the config as metadata; loading checks the
drafter was made for a target of the same width and vocabulary.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from ..fileio import write_bytes_atomic
from . import moe as moe_specs
from .families import FAMILIES
from .gpt import ModelArch, mark_tensor_parallel_params, te_available, transformer_config

CHECKPOINT_KEY = "megatron_tlt_drafter"
FORMAT_VERSION = 1


class DrafterMismatchError(ValueError):
    """A drafter checkpoint does not fit the target model it is loaded for."""


@dataclass
class DrafterConfig:
    """Shape of a drafter; everything but the options comes from the target."""

    hidden_size: int
    vocab_size: int  # the target's (unpadded) vocabulary
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    norm_epsilon: float
    qkv_bias: bool
    target_model_type: str = ""
    target_num_layers: int = 0
    feature_layers: tuple[int, ...] = ()  # EAGLE-3: three target layer indices
    draft_vocab_size: int = 0  # 0 = the full vocabulary
    fp8: bool = False
    extra: dict = field(default_factory=dict)
    qk_layernorm: bool = False  # per-head query / key RMSNorm (Qwen3 targets)

    def __post_init__(self):
        self.feature_layers = tuple(int(i) for i in self.feature_layers)
        if self.feature_layers and len(self.feature_layers) != 3:
            raise ValueError(f"feature_layers takes three target layer indices (EAGLE-3), "
                             f"got {list(self.feature_layers)}")
        if self.target_num_layers and any(not 0 <= i < self.target_num_layers
                                          for i in self.feature_layers):
            raise ValueError(f"feature_layers {list(self.feature_layers)} must be in "
                             f"[0, {self.target_num_layers})")
        if not 0 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [0, {self.vocab_size}] "
                             f"(0 = full vocabulary), got {self.draft_vocab_size}")

    @classmethod
    def for_target(cls, arch: ModelArch, *, feature_layers=(), draft_vocab_size: int = 0,
                   fp8: bool = False) -> "DrafterConfig":
        if feature_layers == "auto":
            n = arch.num_layers
            feature_layers = (min(1, n - 1), n // 2, n - 1)
        layer = drafter_layer_arch(arch)
        return cls(hidden_size=arch.hidden_size, vocab_size=arch.vocab_size,
                   ffn_hidden_size=layer.ffn_hidden_size, qk_layernorm=layer.qk_layernorm,
                   num_attention_heads=arch.num_attention_heads,
                   num_query_groups=arch.num_query_groups, kv_channels=arch.kv_channels,
                   norm_epsilon=arch.norm_epsilon, qkv_bias=arch.qkv_bias,
                   target_model_type=arch.model_type, target_num_layers=arch.num_layers,
                   feature_layers=tuple(feature_layers), draft_vocab_size=draft_vocab_size,
                   fp8=fp8)

    @property
    def feature_width(self) -> int:
        """Width of h_t as the target provides it (H, or 3H with EAGLE-3 features)."""
        return self.hidden_size * (len(self.feature_layers) or 1)

    def layer_arch(self, target: ModelArch) -> ModelArch:
        """The drafter's decoder layer as a one-layer dense ``ModelArch``."""
        return dataclasses.replace(drafter_layer_arch(target),
                                   ffn_hidden_size=self.ffn_hidden_size,
                                   qk_layernorm=self.qk_layernorm)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["feature_layers"] = list(self.feature_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "DrafterConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown drafter config keys {unknown}")
        return cls(**d)

    def check_target(self, arch: ModelArch) -> None:
        """Raise DrafterMismatchError unless this drafter fits ``arch`` (its layer is
        the one ``arch``'s family asks for, ``drafter_layer_arch``)."""
        problems = []
        layer = drafter_layer_arch(arch)
        for name, mine, theirs in (
                ("hidden_size", self.hidden_size, arch.hidden_size),
                ("vocab_size", self.vocab_size, arch.vocab_size),
                ("num_attention_heads", self.num_attention_heads, arch.num_attention_heads),
                ("num_query_groups", self.num_query_groups, arch.num_query_groups),
                ("kv_channels", self.kv_channels, arch.kv_channels),
                ("ffn_hidden_size", self.ffn_hidden_size, layer.ffn_hidden_size),
                ("qk_layernorm", self.qk_layernorm, layer.qk_layernorm)):
            if mine != theirs:
                problems.append(f"{name}: drafter {mine} vs target {theirs}")
        if self.feature_layers and max(self.feature_layers) >= arch.num_layers:
            problems.append(f"feature_layers {list(self.feature_layers)} vs a target with "
                            f"{arch.num_layers} layers")
        if problems:
            raise DrafterMismatchError(
                "the drafter was made for a different target model: " + "; ".join(problems)
                + ". Warm up a drafter for this model with tools/warmup_drafter.py")


def drafter_layer_arch(target: ModelArch) -> ModelArch:
    """The one-layer drafter's decoder layer for ``target``: one layer of the target's
    width and attention, dense, with the fields its family sets
    (``Family.drafter_layer``)."""
    fam = FAMILIES.get(target.model_type)
    fields = fam.drafter_layer(target) if fam is not None else {}
    return dataclasses.replace(target, num_layers=1, **fields)


class EagleDrafter(torch.nn.Module):
    """The drafter's own weights; the target supplies embedding, output layer and RoPE.

    ``forward`` is the training path (megatron-core layer, autograd); decoding runs the
    same math incrementally through ``rollout.speculative.draft_runner.DraftRunner``.
    """

    def __init__(self, config: DrafterConfig, target_arch: ModelArch, *,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                 impl: str = "local"):
        super().__init__()
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.spec_utils import build_module

        config.check_target(target_arch)
        device = torch.device(device)
        self.tp_size = ps.get_tensor_model_parallel_world_size()
        if config.fp8:
            if not (device.type == "cuda" and te_available()):
                raise ValueError("drafter fp8=true needs CUDA and Transformer Engine "
                                 "(pip install -e .[gpu]); use fp8=false on this machine")
            if self.tp_size > 1:
                raise ValueError("drafter fp8=true supports tensor parallel size 1 only")
        self.config = config
        self.impl = impl
        h = config.hidden_size
        layer_arch = config.layer_arch(target_arch)
        tcfg = transformer_config(layer_arch, dtype=dtype, device=device,
                                  tp=self.tp_size, pp=1, impl=impl)
        spec = (fp8_layer_spec(moe_specs.layer_spec(layer_arch, "local", 0)) if config.fp8
                else moe_specs.layer_spec(layer_arch, impl, 0))
        self.layer = build_module(spec, config=tcfg, layer_number=1)
        mark_tensor_parallel_params(self.layer)  # (clipping sums the shards' norms over TP)
        kw = dict(dtype=dtype, device=device)
        self.fc = torch.nn.Linear(2 * h, h, bias=False, **kw)
        self.feature_fc = (torch.nn.Linear(config.feature_width, h, bias=False, **kw)
                           if config.feature_layers else None)
        self.norm = torch.nn.Parameter(torch.ones(h, **kw))
        if config.draft_vocab_size:
            self.register_buffer("d2t", torch.arange(config.draft_vocab_size, device=device))
        else:
            self.d2t = None
        self.layer.to(device=device, dtype=dtype)  # torch-norm fallbacks start on the CPU
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self, seed: int = 0) -> None:
        """Small random init (std 0.02, norms 1; fc starts as the mean of its halves
        so the layer first sees something close to the target's own features). Under
        TP the unsharded matrices are drawn and each rank keeps its shards: the same
        drafter at any TP size (not TP copies of one shard)."""
        g = torch.Generator().manual_seed(seed)
        full = {}
        for name, p in self.named_parameters():
            shape = list(p.shape)
            if self.tp_size > 1 and name in _COLUMN + (_FC1,):
                shape[0] *= self.tp_size
            elif self.tp_size > 1 and name in _ROW:
                shape[1] *= self.tp_size
            full[name] = (torch.ones(shape) if p.dim() == 1 else
                          torch.randn(shape, generator=g) * 0.02)
        if self.tp_size > 1:
            from megatron.core import parallel_state as ps

            full = _shard_layer(full, self.tp_size, ps.get_tensor_model_parallel_rank())
        for name, p in self.named_parameters():
            p.copy_(full[name])
        h = self.config.hidden_size
        eye = torch.eye(h)
        self.fc.weight.add_(torch.cat([0.5 * eye, 0.5 * eye], dim=1).to(self.fc.weight))
        if self.feature_fc is not None:
            n = len(self.config.feature_layers)
            self.feature_fc.weight.add_(torch.cat([eye / n] * n, dim=1).to(self.feature_fc.weight))

    @torch.no_grad()
    def set_draft_vocabulary(self, ids: Optional[torch.Tensor]) -> None:
        """Draft over target tokens ``ids`` (distinct, any order; stored sorted) or, with
        None, the full vocabulary. The drafter's head is the target's output layer (rows
        ``ids`` of it), so this changes no trained weight: it only decides which tokens
        can be drafted and how many logits a draft step computes. A runner made from
        this drafter must be rebuilt or ``refresh``-ed afterwards."""
        if ids is None:
            self.d2t = None
            self.config.draft_vocab_size = 0
            return
        ids = torch.as_tensor(ids, dtype=torch.long).flatten()
        if (ids.numel() == 0 or ids.unique().numel() != ids.numel() or int(ids.min()) < 0
                or int(ids.max()) >= self.config.vocab_size):
            raise ValueError("a draft vocabulary is one or more distinct target token ids "
                             f"in [0, {self.config.vocab_size})")
        device = self.fc.weight.device
        if "d2t" in self._buffers:
            del self._buffers["d2t"]
        else:
            self.__dict__.pop("d2t", None)
        self.register_buffer("d2t", torch.sort(ids).values.to(device))
        self.config.draft_vocab_size = ids.numel()

    # ---------------------------------------------------------------- features
    def reduce_features(self, feats: torch.Tensor) -> torch.Tensor:
        """Target features [..., feature_width] -> h [..., H]."""
        return self.feature_fc(feats) if self.feature_fc is not None else feats

    # ---------------------------------------------------------------- training path
    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rotary_pos_emb: torch.Tensor,
                attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Drafter output ĥ [B, T, H] for inputs embed(tok_{t+1}) [B, T, H] and h_t
        [B, T, H] (already reduced), causal over T, positions 0..T-1 (``rotary_pos_emb``
        from the target's ``rotary_pos_emb(T)``). ``attention_mask`` [T, T] bool (True =
        masked) replaces the causal mask (unrolled training: several drafting depths in
        one sequence, ``drafter_training.losses.chain_mask``), with ``rotary_pos_emb``
        then giving each of the T inputs its own position."""
        x = self.fc(torch.cat([embeds, hidden], dim=-1))
        t = x.shape[1]
        pad = (-t) % 8 if self.config.fp8 else 0
        if pad:  # FP8 GEMMs need B*T % 8 == 0: extra positions at the end, which the
            # causal layer keeps out of the real ones, cut off again below
            x = F.pad(x, (0, 0, 0, pad))
            rotary_pos_emb = torch.cat([rotary_pos_emb, rotary_pos_emb[-1:].expand(
                pad, *rotary_pos_emb.shape[1:])], dim=0)
            if attention_mask is not None:  # padded queries see only themselves
                attention_mask = F.pad(attention_mask, (0, pad, 0, pad), value=True)
                attention_mask[t:, t:].fill_diagonal_(False)
        if attention_mask is not None:
            attention_mask = attention_mask[None, None]
        with fp8_context(self.config.fp8):
            out, _ = self.layer(hidden_states=x.transpose(0, 1).contiguous(),
                                attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb)
        out = out.transpose(0, 1)[:, :t]
        return F.rms_norm(out, (out.shape[-1],), self.norm, self.config.norm_epsilon)

    # ---------------------------------------------------------------- state
    def own_state(self) -> dict[str, torch.Tensor]:
        """Unsharded drafter-owned tensors (gathered over TP), on CPU."""
        state = {}
        for k, v in self.state_dict().items():
            if k.endswith("_extra_state"):
                continue
            state[k] = v.detach()
        if self.impl == "transformer_engine":
            from .hf import from_te_names

            state = from_te_names(state)
        if self.tp_size > 1:
            state = _unshard_layer(state, self.tp_size)
        return {k: v.to("cpu").contiguous() for k, v in state.items()}

    def load_own_state(self, state: dict[str, torch.Tensor]) -> None:
        """Load unsharded tensors (as ``own_state`` returns them), sharding for TP."""
        from megatron.core import parallel_state as ps

        from .megatron_weights import load_into_model

        d2t = state.get("d2t")
        if d2t is not None:
            if (d2t.numel() != self.config.draft_vocab_size or d2t.unique().numel() != d2t.numel()
                    or int(d2t.min()) < 0 or int(d2t.max()) >= self.config.vocab_size):
                raise ValueError("drafter d2t must hold draft_vocab_size distinct target "
                                 f"token ids in [0, {self.config.vocab_size})")
        if self.tp_size > 1:
            state = _shard_layer(state, self.tp_size, ps.get_tensor_model_parallel_rank())
        load_into_model(self, state)


# -------------------------------------------------------------------------------------
# FP8 (Transformer Engine, CUDA only)
# -------------------------------------------------------------------------------------

def fp8_layer_spec(local=None):
    """The local layer spec (``local``: one of its variants, e.g. with QK norm) with
    Transformer Engine norms, linears and attention, the norms kept separate from the
    linears so the state dict has the local spec's names (checkpoints are
    interchangeable with fp8=false) and the incremental decoder can call each linear on
    its own (a QK norm stays torch's)."""
    import copy

    from megatron.core.extensions.transformer_engine import (TEColumnParallelLinear,
                                                             TEDotProductAttention, TENorm,
                                                             TERowParallelLinear)

    from .gpt import layer_spec

    spec = copy.deepcopy(local if local is not None else layer_spec("local"))
    sub = spec.submodules
    sub.input_layernorm = sub.pre_mlp_layernorm = TENorm
    att = sub.self_attention.submodules
    att.linear_qkv, att.linear_proj = TEColumnParallelLinear, TERowParallelLinear
    att.core_attention = TEDotProductAttention
    # megatron-core 0.19 wraps the MLP spec in functools.partial(..., submodules=...)
    mlp = getattr(sub.mlp, "submodules", None) or sub.mlp.keywords["submodules"]
    mlp.linear_fc1, mlp.linear_fc2 = TEColumnParallelLinear, TERowParallelLinear
    return spec


def fp8_context(enabled: bool):
    """``transformer_engine.pytorch.fp8_autocast`` (delayed scaling, E4M3 forward /
    E5M2 backward) when enabled, else a no-op context."""
    import contextlib

    global _FP8_RECIPE
    if not enabled:
        return contextlib.nullcontext()
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import DelayedScaling, Format

    if _FP8_RECIPE is None:  # one recipe for every call: its amax history carries over
        _FP8_RECIPE = DelayedScaling(fp8_format=Format.HYBRID)
    return te.fp8_autocast(enabled=True, fp8_recipe=_FP8_RECIPE)


_FP8_RECIPE = None


# -------------------------------------------------------------------------------------
# TP sharding of the decoder layer (local-spec names, layouts as in models.hf)
# -------------------------------------------------------------------------------------

_COLUMN = ("layer.self_attention.linear_qkv.weight", "layer.self_attention.linear_qkv.bias")
_ROW = ("layer.self_attention.linear_proj.weight", "layer.mlp.linear_fc2.weight")
_FC1 = "layer.mlp.linear_fc1.weight"


def _shard_layer(state, tp: int, rank: int) -> dict:
    out = dict(state)
    for k in _COLUMN:
        if k in out:
            out[k] = out[k].chunk(tp, dim=0)[rank].contiguous()
    for k in _ROW:
        out[k] = out[k].chunk(tp, dim=1)[rank].contiguous()
    gate, up = out[_FC1].chunk(2, dim=0)
    out[_FC1] = torch.cat([gate.chunk(tp, 0)[rank], up.chunk(tp, 0)[rank]], dim=0)
    return out


def _unshard_layer(state, tp: int) -> dict:
    from megatron.core import parallel_state as ps

    from .. import collectives

    group = ps.get_tensor_model_parallel_group()

    def gather(t: torch.Tensor) -> list[torch.Tensor]:
        return collectives.all_gather(t, group)

    out = dict(state)
    for k in _COLUMN:
        if k in out:
            out[k] = torch.cat(gather(out[k]), dim=0)
    for k in _ROW:
        out[k] = torch.cat(gather(out[k]), dim=1)
    halves = [p.chunk(2, dim=0) for p in gather(out[_FC1])]
    out[_FC1] = torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return out


# -------------------------------------------------------------------------------------
# checkpoint
# -------------------------------------------------------------------------------------

def save_drafter(drafter: EagleDrafter, path: str | Path, *, extra: Optional[dict] = None
                 ) -> Path:
    """Write the drafter (own tensors + config) to ``path`` (a .safetensors file, or a
    folder that gets ``drafter.safetensors``), atomically. Under TP every rank must call
    it (tensors are gathered); TP rank 0 writes."""
    from megatron.core import parallel_state as ps

    path = Path(path)
    if path.suffix != ".safetensors":
        path = path / "drafter.safetensors"
    state = drafter.own_state()
    if ps.get_tensor_model_parallel_rank() != 0:
        return path
    cfg = drafter.config.to_dict()
    if extra:
        cfg["extra"] = {**cfg.get("extra", {}), **extra}
    return write_drafter_file(state, cfg, path)


def write_drafter_file(state: dict[str, torch.Tensor], config: dict, path: str | Path) -> Path:
    """Unsharded drafter tensors + a ``DrafterConfig`` dict -> the checkpoint file
    ``path`` (.safetensors), atomically."""
    from safetensors.torch import save

    path = Path(path)
    meta = {CHECKPOINT_KEY: json.dumps({"format": FORMAT_VERSION, "config": config})}
    path.parent.mkdir(parents=True, exist_ok=True)
    return write_bytes_atomic(path, save({k: v.contiguous() for k, v in state.items()},
                                         metadata=meta))


def read_drafter_config(path: str | Path) -> tuple[Path, DrafterConfig]:
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        path = path / "drafter.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"no drafter checkpoint at {path} (make one with "
                                f"tools/warmup_drafter.py)")
    with safe_open(str(path), "pt") as f:
        meta = f.metadata() or {}
    if CHECKPOINT_KEY not in meta:
        raise ValueError(f"{path} is a safetensors file but not a megatron_tlt drafter "
                         f"checkpoint (no {CHECKPOINT_KEY!r} metadata)")
    info = json.loads(meta[CHECKPOINT_KEY])
    if info.get("format") != FORMAT_VERSION:
        raise ValueError(f"{path}: drafter checkpoint format {info.get('format')} is not "
                         f"supported (expected {FORMAT_VERSION})")
    return path, DrafterConfig.from_dict(info["config"])


def load_drafter(path: str | Path, target_arch: ModelArch, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", fp8: Optional[bool] = None) -> EagleDrafter:
    """Build a drafter for ``target_arch`` from a checkpoint (checked against it)."""
    from safetensors.torch import load_file

    path, cfg = read_drafter_config(path)
    cfg.check_target(target_arch)
    if fp8 is not None:
        cfg.fp8 = fp8
    drafter = EagleDrafter(cfg, target_arch, dtype=dtype, device=device)
    drafter.load_own_state(load_file(str(path)))
    drafter.eval()
    return drafter
