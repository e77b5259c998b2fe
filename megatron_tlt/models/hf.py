"""Hugging Face weights <-> megatron-core GPTModel weights (every family of
``models.families``).

Pure tensor bookkeeping, no process groups: ``hf_to_megatron`` produces the state
dict of one (tensor-parallel rank, pipeline stage, expert-parallel rank);
``megatron_to_hf`` gathers all ranks' state dicts back into one Hugging Face state
dict. Tensors keep their dtype, so HF -> megatron -> HF is bit-exact.

Layouts (megatron-core, local layer spec; the Transformer Engine spec differs only in
where the two RMSNorm weights live, see ``to_te_names``):
  * ``linear_qkv``: per query group, [q heads of the group; k; v] rows; TP ranks own
    contiguous groups.
  * ``linear_fc1``: per TP rank, [gate slice; up slice] rows (SwiGLU chunks in two).
  * ``linear_proj`` / ``linear_fc2``: row-parallel, sharded on the input dimension.
  * word embeddings / output layer: vocabulary padded to a multiple of TP, sharded
    on rows.
  * ``q_layernorm`` / ``k_layernorm`` (Qwen3's ``q_norm`` / ``k_norm``, one [head_dim]
    weight shared by every head): replicated.
  * mixture-of-experts layers: ``mlp.router.weight`` (HF ``mlp.gate.weight``, [experts,
    hidden]) replicated; expert e's ``gate/up/down_proj`` as a dense MLP's, under
    ``mlp.experts.local_experts.{j}`` on expert-parallel rank e // (experts / EP),
    j = e % (experts / EP) (sharded over TP like a dense MLP: the expert TP size is TP).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Iterable, Mapping

import torch

from .gpt import ModelArch

HF_WEIGHTS_NAME = "model.safetensors"
HF_INDEX_NAME = "model.safetensors.index.json"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt", "tokenizer.model", "generation_config.json", "chat_template.jinja",
    "added_tokens.json",
)


# -------------------------------------------------------------------------------------
# reading Hugging Face folders lazily
# -------------------------------------------------------------------------------------

class HFWeights(Mapping[str, torch.Tensor]):
    """Read-only, lazy view of a Hugging Face folder's safetensors (single or sharded).

    A pipeline stage reads only the tensors it owns.
    """

    def __init__(self, folder: str | Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        index = self.folder / HF_INDEX_NAME
        single = self.folder / HF_WEIGHTS_NAME
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
        elif single.is_file():
            with safe_open(single, framework="pt") as f:
                weight_map = {k: HF_WEIGHTS_NAME for k in f.keys()}
        else:
            raise FileNotFoundError(
                f"no {HF_WEIGHTS_NAME} or {HF_INDEX_NAME} in {self.folder}: expected a "
                "Hugging Face folder saved with safetensors (save_pretrained)"
            )
        self._weight_map: dict[str, str] = weight_map
        self._handles: dict[str, object] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        if key not in self._weight_map:
            raise KeyError(f"{key} not found in {self.folder}")
        fname = self._weight_map[key]
        if fname not in self._handles:
            self._handles[fname] = safe_open(self.folder / fname, framework="pt")
        return self._handles[fname].get_tensor(key)

    def __iter__(self):
        return iter(self._weight_map)

    def __len__(self) -> int:
        return len(self._weight_map)


# -------------------------------------------------------------------------------------
# layer ranges
# -------------------------------------------------------------------------------------

def stage_layers(arch: ModelArch, pp_size: int, pp_rank: int) -> range:
    """Global layer indices owned by pipeline stage ``pp_rank`` (even split)."""
    if arch.num_layers % pp_size:
        raise ValueError(
            f"num_hidden_layers {arch.num_layers} is not divisible by "
            f"pipeline_model_parallel_size {pp_size}"
        )
    per = arch.num_layers // pp_size
    return range(pp_rank * per, (pp_rank + 1) * per)


# -------------------------------------------------------------------------------------
# fused-tensor layouts
# -------------------------------------------------------------------------------------

def _qkv_fuse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, arch: ModelArch):
    g, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // g
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(g, per * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest)], dim=1
    )
    return fused.reshape(-1, *rest)


def _qkv_split(fused: torch.Tensor, arch: ModelArch):
    g, d = arch.num_query_groups, arch.kv_channels
    per = arch.num_attention_heads // g
    rest = fused.shape[1:]
    q, k, v = fused.reshape(g, (per + 2) * d, *rest).split([per * d, d, d], dim=1)
    return (q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest))


def _pad_vocab(weight: torch.Tensor, padded: int) -> torch.Tensor:
    if weight.shape[0] == padded:
        return weight
    pad = weight.new_zeros(padded - weight.shape[0], *weight.shape[1:])
    return torch.cat([weight, pad], dim=0)


def _shard(t: torch.Tensor, tp_size: int, tp_rank: int, dim: int) -> torch.Tensor:
    return t.chunk(tp_size, dim=dim)[tp_rank].clone().contiguous()


def local_experts(arch: ModelArch, ep_size: int, ep_rank: int) -> range:
    """Global indices of the experts expert-parallel rank ``ep_rank`` holds."""
    if arch.num_experts % ep_size:
        raise ValueError(f"num_experts {arch.num_experts} is not divisible by "
                         f"expert_model_parallel_size {ep_size}")
    per = arch.num_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def _mlp_to_megatron(hf: Mapping[str, torch.Tensor], src: str, dst: str, tp_size: int,
                     tp_rank: int) -> dict[str, torch.Tensor]:
    """A SwiGLU MLP (HF prefix ``src``: gate/up/down_proj) as megatron's fc1/fc2."""
    gate = _shard(hf[src + "gate_proj.weight"], tp_size, tp_rank, 0)
    up = _shard(hf[src + "up_proj.weight"], tp_size, tp_rank, 0)
    return {dst + "linear_fc1.weight": torch.cat([gate, up], dim=0),
            dst + "linear_fc2.weight": _shard(hf[src + "down_proj.weight"], tp_size,
                                              tp_rank, 1)}


def _mlp_to_hf(parts: list[Mapping[str, torch.Tensor]], src: str, dst: str
               ) -> dict[str, torch.Tensor]:
    """Inverse of ``_mlp_to_megatron`` from every TP rank's state dict (``parts``)."""
    halves = [p[src + "linear_fc1.weight"].chunk(2, dim=0) for p in parts]
    return {dst + "gate_proj.weight": torch.cat([h[0] for h in halves], dim=0),
            dst + "up_proj.weight": torch.cat([h[1] for h in halves], dim=0),
            dst + "down_proj.weight": torch.cat([p[src + "linear_fc2.weight"] for p in parts],
                                                dim=1)}


# -------------------------------------------------------------------------------------
# HF -> megatron
# -------------------------------------------------------------------------------------

def hf_to_megatron(hf: Mapping[str, torch.Tensor], arch: ModelArch, *, tp_size: int = 1,
                   tp_rank: int = 0, pp_size: int = 1, pp_rank: int = 0, ep_size: int = 1,
                   ep_rank: int = 0) -> dict[str, torch.Tensor]:
    """State dict (local-spec names) of one TP rank, pipeline stage and EP rank."""
    out: dict[str, torch.Tensor] = {}
    padded = arch.padded_vocab_size(tp_size)
    first, last = pp_rank == 0, pp_rank == pp_size - 1

    def vocab_rows(key: str) -> torch.Tensor:
        return _shard(_pad_vocab(hf[key], padded), tp_size, tp_rank, 0)

    if first:
        out["embedding.word_embeddings.weight"] = vocab_rows("model.embed_tokens.weight")
    for local, i in enumerate(stage_layers(arch, pp_size, pp_rank)):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{local}."
        att = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"].clone()
        qkv = _qkv_fuse(hf[att + "q_proj.weight"], hf[att + "k_proj.weight"],
                        hf[att + "v_proj.weight"], arch)
        out[dst + "self_attention.linear_qkv.weight"] = _shard(qkv, tp_size, tp_rank, 0)
        if arch.qkv_bias:
            qkv_b = _qkv_fuse(hf[att + "q_proj.bias"], hf[att + "k_proj.bias"],
                              hf[att + "v_proj.bias"], arch)
            out[dst + "self_attention.linear_qkv.bias"] = _shard(qkv_b, tp_size, tp_rank, 0)
        out[dst + "self_attention.linear_proj.weight"] = _shard(
            hf[att + "o_proj.weight"], tp_size, tp_rank, 1)
        if arch.qk_layernorm:
            for n in ("q", "k"):
                out[f"{dst}self_attention.{n}_layernorm.weight"] = hf[f"{att}{n}_norm.weight"].clone()
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"].clone()
        if not arch.is_moe_layer(i):
            out.update(_mlp_to_megatron(hf, src + "mlp.", dst + "mlp.", tp_size, tp_rank))
            continue
        out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"].clone()
        for j, e in enumerate(local_experts(arch, ep_size, ep_rank)):
            out.update(_mlp_to_megatron(hf, f"{src}mlp.experts.{e}.",
                                        f"{dst}mlp.experts.local_experts.{j}.", tp_size, tp_rank))
    if last:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"].clone()
        if not arch.tie_word_embeddings:
            out["output_layer.weight"] = vocab_rows("lm_head.weight")
        elif not first:
            # With pipeline parallelism the last stage keeps its own copy of the tied
            # embedding as the output layer (megatron-core keeps the two in sync).
            out["output_layer.weight"] = vocab_rows("model.embed_tokens.weight")
    return out


# -------------------------------------------------------------------------------------
# megatron -> HF
# -------------------------------------------------------------------------------------

def megatron_to_hf(shards: Mapping[tuple, Mapping[str, torch.Tensor]],
                   arch: ModelArch, *, tp_size: int, pp_size: int, ep_size: int = 1
                   ) -> dict[str, torch.Tensor]:
    """Gather ``shards[(tp_rank, pp_rank)]`` (or ``[(tp_rank, pp_rank, ep_rank)]`` at
    ``ep_size`` > 1; local-spec names) into one HF state dict."""
    if ep_size > 1:
        keys = [(t, p, e) for t in range(tp_size) for p in range(pp_size)
                for e in range(ep_size)]
        by_ep = {k: shards[k] for k in keys if k in shards}
        shards = {(t, p): shards.get((t, p, 0), {}) for t in range(tp_size)
                  for p in range(pp_size)}
    else:
        keys = [(t, p) for t in range(tp_size) for p in range(pp_size)]
        by_ep = {(t, p, 0): shards[(t, p)] for t, p in keys if (t, p) in shards}
    missing = [k for k in keys if (k if ep_size > 1 else k + (0,)) not in by_ep]
    if missing:
        raise ValueError(f"missing megatron shards for (tp_rank, pp_rank"
                         f"{', ep_rank' if ep_size > 1 else ''}) {missing}")
    out: dict[str, torch.Tensor] = {}

    def gather(pp_rank: int, key: str, dim: int) -> torch.Tensor:
        return torch.cat([shards[(t, pp_rank)][key] for t in range(tp_size)], dim=dim)

    def vocab(pp_rank: int, key: str) -> torch.Tensor:
        return gather(pp_rank, key, 0)[: arch.vocab_size].clone()

    out["model.embed_tokens.weight"] = vocab(0, "embedding.word_embeddings.weight")
    for pp_rank in range(pp_size):
        stage = shards[(0, pp_rank)]
        for local, i in enumerate(stage_layers(arch, pp_size, pp_rank)):
            src, dst = f"decoder.layers.{local}.", f"model.layers.{i}."
            att = dst + "self_attn."
            out[dst + "input_layernorm.weight"] = stage[src + "input_layernorm.weight"].clone()
            q, k, v = _qkv_split(gather(pp_rank, src + "self_attention.linear_qkv.weight", 0), arch)
            out[att + "q_proj.weight"], out[att + "k_proj.weight"], out[att + "v_proj.weight"] = (
                q.clone(), k.clone(), v.clone())
            if arch.qkv_bias:
                qb, kb, vb = _qkv_split(
                    gather(pp_rank, src + "self_attention.linear_qkv.bias", 0), arch)
                out[att + "q_proj.bias"], out[att + "k_proj.bias"], out[att + "v_proj.bias"] = (
                    qb.clone(), kb.clone(), vb.clone())
            out[att + "o_proj.weight"] = gather(pp_rank, src + "self_attention.linear_proj.weight", 1)
            if arch.qk_layernorm:
                for n in ("q", "k"):
                    out[f"{att}{n}_norm.weight"] = stage[f"{src}self_attention.{n}_layernorm.weight"].clone()
            out[dst + "post_attention_layernorm.weight"] = stage[src + "pre_mlp_layernorm.weight"].clone()
            if not arch.is_moe_layer(i):
                out.update(_mlp_to_hf([shards[(t, pp_rank)] for t in range(tp_size)],
                                      src + "mlp.", dst + "mlp."))
                continue
            out[dst + "mlp.gate.weight"] = stage[src + "mlp.router.weight"].clone()
            for r in range(ep_size):
                parts = [by_ep[(t, pp_rank, r)] for t in range(tp_size)]
                for j, e in enumerate(local_experts(arch, ep_size, r)):
                    out.update(_mlp_to_hf(parts, f"{src}mlp.experts.local_experts.{j}.",
                                          f"{dst}mlp.experts.{e}."))
    last = pp_size - 1
    out["model.norm.weight"] = shards[(0, last)]["decoder.final_layernorm.weight"].clone()
    if not arch.tie_word_embeddings:
        out["lm_head.weight"] = vocab(last, "output_layer.weight")
    return out


# -------------------------------------------------------------------------------------
# Transformer Engine naming
# -------------------------------------------------------------------------------------

_TE_RENAMES = (
    ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"),
    ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
)


def to_te_names(state: Mapping[str, torch.Tensor], names=None) -> dict[str, torch.Tensor]:
    """Local-spec names -> Transformer Engine spec names (norms fused into linears).
    With ``names`` (the model's keys), a norm is renamed only where the model has the
    fused name: a mixture-of-experts layer keeps its own ``pre_mlp_layernorm``."""
    out = {}
    for key, value in state.items():
        for local, te in _TE_RENAMES:
            if key.endswith(local) and key.startswith("decoder.layers."):
                fused = key[: -len(local)] + te
                if names is None or fused in names:
                    key = fused
        out[key] = value
    return out


def from_te_names(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Inverse of ``to_te_names``; drops Transformer Engine's ``_extra_state`` entries."""
    out = {}
    for key, value in state.items():
        if key.endswith("_extra_state"):
            continue
        for local, te in _TE_RENAMES:
            if key.endswith(te):
                key = key[: -len(te)] + local
        out[key] = value
    return out


# -------------------------------------------------------------------------------------
# writing Hugging Face folders
# -------------------------------------------------------------------------------------

def save_hf_folder(state: Mapping[str, torch.Tensor], hf_config: dict, out_dir: str | Path,
                   tokenizer_dir: str | Path | None = None) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files) that transformers loads."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in state.items()}
    save_file(tensors, str(out / HF_WEIGHTS_NAME), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if tokenizer_dir is not None:
        copy_tokenizer_files(tokenizer_dir, out)
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy whichever tokenizer / generation files exist in ``src``."""
    copied = []
    for name in TOKENIZER_FILES:
        path = Path(src) / name
        if path.is_file():
            shutil.copy2(path, Path(dst) / name)
            copied.append(name)
    return copied


def expected_hf_keys(arch: ModelArch) -> Iterable[str]:
    """Every key a complete HF state dict of ``arch`` has (used to check inputs)."""
    yield "model.embed_tokens.weight"
    for i in range(arch.num_layers):
        p = f"model.layers.{i}."
        yield from (p + "input_layernorm.weight", p + "post_attention_layernorm.weight")
        for n in ("q", "k", "v", "o"):
            yield f"{p}self_attn.{n}_proj.weight"
        if arch.qkv_bias:
            yield from (f"{p}self_attn.{n}_proj.bias" for n in ("q", "k", "v"))
        if arch.qk_layernorm:
            yield from (f"{p}self_attn.{n}_norm.weight" for n in ("q", "k"))
        if not arch.is_moe_layer(i):
            yield from (f"{p}mlp.{n}_proj.weight" for n in ("gate", "up", "down"))
            continue
        yield f"{p}mlp.gate.weight"
        for e in range(arch.num_experts):
            yield from (f"{p}mlp.experts.{e}.{n}_proj.weight" for n in ("gate", "up", "down"))
    yield "model.norm.weight"
    if not arch.tie_word_embeddings:
        yield "lm_head.weight"
