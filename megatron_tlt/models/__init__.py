"""Models: megatron-core GPT from Hugging Face configs, weight conversion, drafter."""

from __future__ import annotations

from pathlib import Path

import torch

from .megatron_weights import (is_megatron_checkpoint, load_into_model, read_meta,
                               shard_for_rank, tokenizer_folder)
from .gpt import (NO_MEMORY_CONTROLS, MemoryControls, ModelArch, build_gpt_model, resolve_dtype,
                  resolve_impl)
from . import moe_replay
from .moe import NO_MOE_OPTIONS, MoeOptions

__all__ = ["MemoryControls", "ModelArch", "MoeOptions", "arch_from_source", "build_gpt_model", "load_model",
           "load_tokenizer", "resolve_source"]

# Names that stand for a prepared real-model asset instead of a path.
ASSET_ALIASES = ("smollm2",)


def resolve_source(name: str | Path | None) -> Path:
    """model.hf_path -> a folder: a path, or an asset alias ('smollm2') resolved."""
    if name is None:
        from ..config import ConfigError

        raise ConfigError("model.hf_path is not set: give a Hugging Face folder, a converted "
                          "checkpoint, or 'smollm2' (e.g. model.hf_path=smollm2)")
    if str(name) == "smollm2":
        from ..assets import require_smollm2

        return require_smollm2()
    path = Path(name).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model.hf_path={str(name)!r} does not exist; give a Hugging Face folder, a "
            f"converted checkpoint, or one of {', '.join(ASSET_ALIASES)}")
    return path


def arch_from_source(source: str | Path) -> ModelArch:
    """Architecture of an HF folder or a megatron_tlt checkpoint folder."""
    if is_megatron_checkpoint(source):
        return ModelArch.from_hf_config(read_meta(source)["hf_config"])
    from ..run_files import is_run_checkpoint

    if not (Path(source) / "config.json").is_file() and is_run_checkpoint(source):
        from ..config import ConfigError

        raise ConfigError(
            f"model.hf_path={source} is a run checkpoint (checkpoint.save): resume the run "
            f"with checkpoint.load={source}, or export it (python "
            f"tools/convert_hf_checkpoint.py --out DIR model.hf_path={source}) and start "
            f"from model.hf_path=DIR")
    return ModelArch.from_hf_folder(source)


def load_tokenizer(source: str | Path):
    """The tokenizer stored with an HF folder or a converted megatron checkpoint."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_folder(source)))


def load_model(source: str | Path, *, device: torch.device, dtype: str = "auto",
               impl: str = "auto", memory: MemoryControls = NO_MEMORY_CONTROLS,
               moe: MoeOptions = NO_MOE_OPTIONS):
    """Build this rank's GPTModel stage and load its weights from ``source``.

    ``memory``: megatron-core's recomputation / sequence parallelism for a model that
    is trained (the policy); forward-only models keep the default (none). ``moe``: the
    experts' options (auxiliary loss, routing replay; ``models.moe``); the layout's
    expert-parallel rank loads its share of every MoE layer's experts.

    ``source`` is a Hugging Face folder or a checkpoint from
    ``tools/convert_hf_checkpoint.py`` (any TP/PP; resharded on load). Model parallel
    groups must exist (``parallel.initialize_model_parallel``).
    """
    from ..parallel import layout

    lay = layout()
    arch = arch_from_source(source)
    model = build_gpt_model(
        arch, dtype=resolve_dtype(dtype, device), device=device, impl=resolve_impl(impl),
        tp=lay.tp_size, pp=lay.pp_size,
        pre_process=lay.is_first_stage, post_process=lay.is_last_stage, memory=memory,
        ep=lay.ep_size, moe=moe,
    )
    state = shard_for_rank(source, arch, tp_size=lay.tp_size, tp_rank=lay.tp_rank,
                           pp_size=lay.pp_size, pp_rank=lay.pp_rank, ep_size=lay.ep_size,
                           ep_rank=lay.ep_rank)
    load_into_model(model, state)
    model.eval()
    return model, arch
