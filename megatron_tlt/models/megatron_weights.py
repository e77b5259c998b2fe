"""Megatron-format model weights (converted from HF) and loading them into a GPTModel.

These are the weights a run starts from (``tools/convert_hf_checkpoint.py``); a run's
own checkpoints (model, optimizer, run state) are ``megatron_tlt.checkpoint``.

Layout (the Megatron-LM convention, so its tools recognise it)::

    <dir>/latest_checkpointed_iteration.txt      "release"
    <dir>/release/mp_rank_{tp:02d}[_{pp:03d}][_{ep:03d}]/model_optim_rng.pt  {"model": ...}
    <dir>/megatron_tlt.json                      arch (HF config), tp, pp, ep, format version
    <dir>/hf/                                    tokenizer files of the source model

The ``_{pp:03d}`` part is there at PP > 1 and ``_{ep:03d}`` (the expert-parallel rank)
at EP > 1, as Megatron-LM names them. A checkpoint written at one TP/PP/EP loads at any
other: the shards are gathered to a Hugging Face state dict and re-split for the
loading rank.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Mapping

import torch

from ..fileio import atomic_dir
from .gpt import ModelArch
from .hf import HFWeights, copy_tokenizer_files, hf_to_megatron, megatron_to_hf, to_te_names

FORMAT_VERSION = 1
META_NAME = "megatron_tlt.json"
TOKENIZER_DIR = "hf"


def rank_dir_name(tp_rank: int, pp_rank: int, pp_size: int, ep_rank: int = 0,
                  ep_size: int = 1) -> str:
    name = f"mp_rank_{tp_rank:02d}" if pp_size == 1 else f"mp_rank_{tp_rank:02d}_{pp_rank:03d}"
    return name if ep_size == 1 else f"{name}_{ep_rank:03d}"


def _ranks(key: tuple) -> tuple[int, int, int]:
    """(tp, pp, ep) of a shard key (tp, pp) or (tp, pp, ep)."""
    return (*key, 0)[:3] if len(key) == 2 else tuple(key)


def is_megatron_checkpoint(path: str | Path) -> bool:
    return (Path(path) / META_NAME).is_file()


def tokenizer_folder(source: str | Path) -> Path:
    """Where the tokenizer of an HF folder or a converted checkpoint lives."""
    source = Path(source)
    return source / TOKENIZER_DIR if is_megatron_checkpoint(source) else source


def read_meta(path: str | Path) -> dict:
    meta_file = Path(path) / META_NAME
    if not meta_file.is_file():
        raise FileNotFoundError(
            f"{meta_file} not found: {path} is not a megatron_tlt checkpoint "
            "(write one with tools/convert_hf_checkpoint.py)"
        )
    meta = json.loads(meta_file.read_text())
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{meta_file}: unsupported format_version {meta.get('format_version')}")
    return meta


def save_megatron_checkpoint(out_dir: str | Path, shards: Mapping[tuple, Mapping],
                             arch: ModelArch, *, tp_size: int, pp_size: int,
                             tokenizer_dir: str | Path | None = None,
                             ep_size: int = 1) -> Path:
    """Write all ranks' shards (keyed (tp, pp), or (tp, pp, ep) at ``ep_size`` > 1)
    atomically (a temporary sibling folder renamed at the end)."""
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output folder")
    if out.exists():
        out.rmdir()
    with atomic_dir(out) as tmp:
        for key, state in shards.items():
            tp_rank, pp_rank, ep_rank = _ranks(key)
            rank_dir = tmp / "release" / rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank,
                                                       ep_size)
            rank_dir.mkdir(parents=True)
            torch.save({"model": dict(state), "checkpoint_version": 3.0, "iteration": 0},
                       rank_dir / "model_optim_rng.pt")
        (tmp / "latest_checkpointed_iteration.txt").write_text("release")
        meta = {"format_version": FORMAT_VERSION, "tensor_model_parallel_size": tp_size,
                "pipeline_model_parallel_size": pp_size, "hf_config": arch.hf_config}
        if ep_size > 1:
            meta["expert_model_parallel_size"] = ep_size
        (tmp / META_NAME).write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
        if tokenizer_dir is not None:
            (tmp / TOKENIZER_DIR).mkdir()
            copy_tokenizer_files(tokenizer_dir, tmp / TOKENIZER_DIR)
    return out


def load_megatron_shards(path: str | Path) -> tuple[dict[tuple, dict], ModelArch, dict]:
    """All shards of a checkpoint, keyed by (tp_rank, pp_rank) (by (tp_rank, pp_rank,
    ep_rank) when it was written at EP > 1), plus its arch and meta."""
    path = Path(path)
    meta = read_meta(path)
    arch = ModelArch.from_hf_config(meta["hf_config"])
    tp, pp = meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"]
    ep = meta.get("expert_model_parallel_size", 1)
    shards = {}
    for t in range(tp):
        for p in range(pp):
            for e in range(ep):
                f = path / "release" / rank_dir_name(t, p, pp, e, ep) / "model_optim_rng.pt"
                if not f.is_file():
                    raise FileNotFoundError(f"checkpoint shard missing: {f}")
                key = (t, p) if ep == 1 else (t, p, e)
                shards[key] = torch.load(f, map_location="cpu", weights_only=True)["model"]
    return shards, arch, meta


def shard_for_rank(source: str | Path, arch: ModelArch, *, tp_size: int, tp_rank: int,
                   pp_size: int, pp_rank: int, ep_size: int = 1, ep_rank: int = 0
                   ) -> dict[str, torch.Tensor]:
    """This rank's state dict from an HF folder or a megatron checkpoint at any
    TP/PP/EP."""
    if is_megatron_checkpoint(source):
        meta = read_meta(source)
        saved_ep = meta.get("expert_model_parallel_size", 1)
        if (meta["tensor_model_parallel_size"], meta["pipeline_model_parallel_size"],
                saved_ep) == (tp_size, pp_size, ep_size):
            f = Path(source) / "release" / rank_dir_name(tp_rank, pp_rank, pp_size, ep_rank,
                                                         ep_size) / "model_optim_rng.pt"
            return torch.load(f, map_location="cpu", weights_only=True)["model"]
        shards, _, meta = load_megatron_shards(source)
        hf = megatron_to_hf(shards, arch, tp_size=meta["tensor_model_parallel_size"],
                            pp_size=meta["pipeline_model_parallel_size"], ep_size=saved_ep)
    else:
        hf = HFWeights(source)
    return hf_to_megatron(hf, arch, tp_size=tp_size, tp_rank=tp_rank, pp_size=pp_size,
                          pp_rank=pp_rank, ep_size=ep_size, ep_rank=ep_rank)


def load_into_model(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Copy a local-spec state dict into ``model`` (either layer spec), checking every key."""
    own = model.state_dict()
    uses_te = any(k.endswith("layer_norm_weight") for k in own)
    if uses_te:
        state = to_te_names(state, own)
    expected = {k for k in own if not k.endswith("_extra_state")}
    missing = sorted(expected - set(state))
    unexpected = sorted(set(state) - expected)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint does not match the model: missing {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}"
            f"{'...' if len(unexpected) > 5 else ''}"
        )
    with torch.no_grad():
        for key, value in state.items():
            target = own[key]
            if target.shape != value.shape:
                raise ValueError(
                    f"{key}: checkpoint shape {tuple(value.shape)} != model shape "
                    f"{tuple(target.shape)} (was it converted for another TP size?)"
                )
            target.copy_(value.to(dtype=target.dtype, device=target.device))
