"""A trained run -> a Hugging Face folder, with its drafter as a standalone file.

Two ways in, one way out:

* ``export_run_checkpoint``: a run checkpoint on disk (``checkpoint.save``, any TP/PP
  layout, the newest step or a named one) -> an HF folder
  (``tools/convert_hf_checkpoint.py``). ``read_run_checkpoint`` is the only function
  that knows the run-checkpoint layout on disk.
* ``export_trained``: the live policy at the end of a run (``checkpoint.export_hf``);
  every rank calls it, the data-parallel-rank-0 shards meet on rank 0.

``write_hf_export`` writes what both produce: ``config.json`` + ``model.safetensors``
(+ the tokenizer files of the run's ``model.hf_path``), which transformers loads, and,
when the run had a drafter, ``drafter/drafter.safetensors`` (the engine's drafter
checkpoint format: ``rollout.speculative.drafter=<folder>/drafter``) with
``drafter/config.json`` naming the target it was trained for.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional

import torch

from .. import collectives
from ..fileio import atomic_dir
from ..models.gpt import DTYPES, ModelArch
from ..models.hf import copy_tokenizer_files, from_te_names, megatron_to_hf, save_hf_folder
from ..run_files import DRAFTER_FILE, POLICY_DIR, RUN_FILE
from . import store
from .safe_files import CheckpointError

DRAFTER_DIR = "drafter"


class ExportError(ValueError):
    """A run checkpoint that cannot be exported as asked (the message says why and how)."""


def run_meta(arch: ModelArch, source: str | Path) -> dict:
    """What a run checkpoint records for readers outside the run: the model's HF config
    and where its tokenizer lives."""
    return {"hf_config": dict(arch.hf_config), "model_source": str(Path(source).resolve())}


def local_model_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A GPTModel state dict (either layer spec, possibly wrapped) -> local-spec names,
    weights only, on the CPU."""
    out = {}
    for key, value in from_te_names(state).items():
        while key.startswith("module."):
            key = key[len("module."):]
        if isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu")
    return out


# -------------------------------------------------------------------------------------
# run checkpoints on disk
# -------------------------------------------------------------------------------------

@dataclass
class RunCheckpoint:
    """The whole model (as one TP = PP = 1 shard) and metadata of one saved step."""

    path: Path
    step: int
    shards: dict  # (tp_rank, pp_rank) -> local-spec state dict
    tp_size: int
    pp_size: int
    arch: ModelArch
    model_source: str
    drafter_state: Optional[dict] = None
    drafter_config: Optional[dict] = None


def step_folder(folder: str | Path, step: Optional[int] = None) -> Path:
    """The step folder of a run checkpoint: the newest (``latest``) or step ``step``."""

    root = Path(folder)
    if root.name.startswith("step_") and (root / RUN_FILE).is_file():
        if step is not None and int(root.name[len("step_"):]) != step:
            raise ExportError(f"{root} is step {int(root.name[5:])}, not {step}; give the "
                              f"checkpoint.save folder to choose a step")
        return root
    if step is None:
        path = store.latest(root)
        if path is None:
            raise ExportError(f"{root} holds no complete run checkpoint (step_N folders "
                              f"written by checkpoint.save)")
        return path
    path = root / f"step_{step:07d}"
    if not path.is_dir():
        have = sorted(int(p.name[5:]) for p in root.glob("step_*") if p.is_dir())
        raise ExportError(f"{root} has no checkpoint of step {step}; saved steps: {have}")
    return path


def _full_model_state(policy_dir: Path) -> dict[str, torch.Tensor]:
    """The whole model (TP = PP = 1, EP = 1, local-spec names) from a checkpoint's
    ``policy/`` folder (megatron-core dist_checkpointing): every model tensor read at its
    global shape, the per-layer tensors (stacked on a leading layer axis, or saved per
    layer where the layers' specs differ: QK norm, experts) split by layer, and a
    mixture-of-experts layer's experts (``mlp.experts.experts.*``, stacked on an expert
    axis) split into megatron-core's ``local_experts.{e}``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(policy_dir))
    meta = reader.read_metadata()  # checked by checkpoint.verify before
    want = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
            for k, m in meta.state_dict_metadata.items()
            if isinstance(m, TensorStorageMetadata) and not k.startswith("optimizer.")}
    dcp.load(want, storage_reader=reader, no_dist=True)
    out = {}
    for key, value in want.items():
        if key.startswith("decoder.layers.") and not key.split(".")[2].isdigit():
            rest = key[len("decoder.layers."):]
            for layer in range(value.shape[0]):
                out[f"decoder.layers.{layer}.{rest}"] = value[layer].clone()
        else:
            out[key] = value
    for key in [k for k in out if ".mlp.experts.experts." in k]:
        stacked = out.pop(key)
        for e in range(stacked.shape[0]):
            out[key.replace(".experts.experts.", f".experts.local_experts.{e}.")] = stacked[e]
    return local_model_state(out)


def read_run_checkpoint(folder: str | Path, step: Optional[int] = None) -> RunCheckpoint:
    """The whole model of one saved step (any TP/PP/DP layout: read at TP = PP = 1),
    the model's architecture and the drafter, if the run had one."""

    path = step_folder(folder, step)
    try:
        run = store.verify(path)
    except CheckpointError as e:
        raise ExportError(str(e)) from None
    meta = run.get("meta")
    if not meta or "hf_config" not in meta:
        raise ExportError(f"{path} does not record the model's configuration (saved by an "
                          f"older version); export it with the version that wrote it")
    drafter_state = None
    if (path / DRAFTER_FILE).is_file():
        from safetensors.torch import load_file

        drafter_state = load_file(str(path / DRAFTER_FILE))
    return RunCheckpoint(path=path, step=int(run["step"]),
                         shards={(0, 0): _full_model_state(path / POLICY_DIR)},
                         tp_size=1, pp_size=1, arch=ModelArch.from_hf_config(meta["hf_config"]),
                         model_source=meta.get("model_source", ""),
                         drafter_state=drafter_state, drafter_config=run.get("drafter_config"))


def export_run_checkpoint(folder: str | Path, out: str | Path, *, step: Optional[int] = None,
                          tokenizer_dir: str | Path | None = None,
                          dtype: str = "auto") -> Path:
    """A run checkpoint (newest step, or ``step``) -> an HF folder at ``out`` (which
    must not exist or be empty). The tokenizer comes from the run's ``model.hf_path``
    unless ``tokenizer_dir`` names another folder."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output folder")
    ckpt = read_run_checkpoint(folder, step)
    tok = Path(tokenizer_dir) if tokenizer_dir is not None else _tokenizer_of(ckpt.model_source)
    if tok is None or not tok.is_dir():
        raise ExportError(f"the run's model ({ckpt.model_source}) is no longer there to copy "
                          f"its tokenizer from; pass --tokenizer DIR (the folder of the model "
                          f"the run started from)")
    return write_hf_export(ckpt.shards, ckpt.arch, out, tp_size=ckpt.tp_size,
                           pp_size=ckpt.pp_size, tokenizer_dir=tok, dtype=dtype,
                           drafter_state=ckpt.drafter_state,
                           drafter_config=ckpt.drafter_config,
                           about={"step": ckpt.step, "run_checkpoint": str(ckpt.path.resolve()),
                                  "model_source": ckpt.model_source})


def _tokenizer_of(source: str) -> Optional[Path]:
    from ..models.megatron_weights import tokenizer_folder

    return tokenizer_folder(source) if source and Path(source).exists() else None


# -------------------------------------------------------------------------------------
# the live policy at the end of a run
# -------------------------------------------------------------------------------------

def export_trained(policy_module, drafter, layout, arch: ModelArch, source: str | Path,
                   out: str | Path, *, step: int) -> Path:
    """Write the trained policy (and ``drafter``, or None) as an HF folder at ``out``,
    replacing an earlier export there. Every rank calls it: each DP-rank-0 rank puts its
    shard in a scratch folder next to ``out``, rank 0 converts and writes."""
    out = Path(out)
    rank = collectives.rank()
    drafter_state = drafter.own_state() if drafter is not None else None  # TP collective
    parts = out.parent / f".{out.name}.parts"
    if rank == 0:
        shutil.rmtree(parts, ignore_errors=True)
        parts.mkdir(parents=True)
    _barrier()
    ep = layout.ep_size  # EP > 1: one rank per (TP, PP, EP) position writes (its experts)
    if (layout.dp_rank == 0) if ep == 1 else (_expert_data_parallel_rank() == 0):
        torch.save(local_model_state(policy_module.state_dict()),
                   parts / f"tp{layout.tp_rank}_pp{layout.pp_rank}_ep{layout.ep_rank}.pt")
    _barrier()
    if rank == 0:
        try:
            shards = {(t, p, e)[:3 if ep > 1 else 2]: torch.load(
                parts / f"tp{t}_pp{p}_ep{e}.pt", weights_only=True)
                for t in range(layout.tp_size) for p in range(layout.pp_size)
                for e in range(ep)}
            write_hf_export(shards, arch, out, tp_size=layout.tp_size, pp_size=layout.pp_size,
                            ep_size=ep,
                            tokenizer_dir=_tokenizer_of(str(source)),
                            drafter_state=drafter_state,
                            drafter_config=drafter.config.to_dict() if drafter else None,
                            about={"step": step, "model_source": str(source)}, replace=True)
        finally:
            shutil.rmtree(parts, ignore_errors=True)
    _barrier()
    return out


def _barrier() -> None:
    collectives.barrier()


def _expert_data_parallel_rank() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_expert_data_parallel_rank()


# -------------------------------------------------------------------------------------
# writing
# -------------------------------------------------------------------------------------

def write_hf_export(shards, arch: ModelArch, out: str | Path, *, tp_size: int, pp_size: int,
                    tokenizer_dir: str | Path | None, dtype: str = "auto",
                    drafter_state: Optional[dict] = None, drafter_config: Optional[dict] = None,
                    about: Optional[dict] = None, replace: bool = False,
                    ep_size: int = 1) -> Path:
    """Shards ``{(tp_rank, pp_rank): local-spec state}`` -> an HF folder at ``out``,
    written in a scratch folder and renamed into place (``replace``: an existing ``out``
    is replaced). ``dtype`` casts floating tensors (auto keeps them); ``about`` (step,
    source) goes into the drafter's config.json."""
    out = Path(out)
    state = megatron_to_hf(shards, arch, tp_size=tp_size, pp_size=pp_size, ep_size=ep_size)
    if dtype != "auto":
        state = {k: v.to(DTYPES[dtype]) if v.is_floating_point() else v
                 for k, v in state.items()}
    saved = next(v.dtype for v in state.values() if v.is_floating_point())
    hf_config = dict(arch.hf_config)
    hf_config["dtype"] = str(saved).removeprefix("torch.")  # what transformers loads as
    hf_config.pop("torch_dtype", None)
    if out.exists() and not replace and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new output folder")
    with atomic_dir(out) as tmp:  # complete, or not there: never a partial folder
        save_hf_folder(state, hf_config, tmp)
        if tokenizer_dir is not None:
            copy_tokenizer_files(tokenizer_dir, tmp)
        if drafter_state is not None:
            write_drafter_export(drafter_state, drafter_config, tmp / DRAFTER_DIR, arch,
                                 about or {})
        _readable(tmp)
    return out


def _readable(folder: Path) -> None:
    """Modes of a plain folder written with the user's umask (a scratch folder is
    private, 0700, and safetensors files 0600)."""
    mask = os.umask(0)
    os.umask(mask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


def write_drafter_export(state: dict, config: dict, folder: Path, arch: ModelArch,
                         about: dict) -> Path:
    """``folder/drafter.safetensors`` (loadable by ``load_drafter`` / the engine's
    ``rollout.speculative.drafter``) and ``folder/config.json``: the drafter's config and
    the target it was trained for (the policy exported beside it)."""
    from ..models.drafter import FORMAT_VERSION, write_drafter_file

    if config is None:
        raise ExportError("the run checkpoint holds a drafter but not its configuration")
    target = {"hf_folder": "..", "model_type": arch.model_type,
              "hidden_size": arch.hidden_size, "num_layers": arch.num_layers,
              "vocab_size": arch.vocab_size, **about}
    config = {**config, "extra": {**config.get("extra", {}), "target": target}}
    folder.mkdir(parents=True, exist_ok=True)
    path = write_drafter_file(state, config, folder / "drafter.safetensors")
    (folder / "config.json").write_text(json.dumps(
        {"format": FORMAT_VERSION, "drafter": config, "target": target}, indent=2,
        sort_keys=True) + "\n")
    return path
