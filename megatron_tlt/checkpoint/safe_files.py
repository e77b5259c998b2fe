"""Run state in formats that cannot execute code: JSON for plain data, safetensors for
tensors, and a checked read of the two pickles ``dist_checkpointing`` itself writes.

``write_tree(stem, tree)`` stores a nested structure of dicts, lists, tuples, numbers,
strings, tensors and numpy arrays as ``stem.json`` (the structure, each tensor named
by a ``{"__tensor__": key}`` stand-in) plus ``stem.safetensors`` (the tensors);
``read_tree(stem)`` rebuilds it. Dicts with non-string keys (optimizer states keyed by
parameter index) and tuples (RNG states) survive the round trip.

``check_dcp_metadata`` / ``check_common_pt`` read the ``.metadata`` pickle of a
``torch.distributed.checkpoint`` folder and megatron-core's ``common.pt`` with an
allow-list of classes (``weights_only=True`` for the latter) before megatron-core
opens them, so a crafted file is refused with its name instead of being run.
"""

from __future__ import annotations

import io
import json
import pickle
from pathlib import Path
from typing import Any

import numpy as np
import torch


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed here (missing, incomplete, corrupt, unsafe)."""


_TENSOR, _ARRAY, _TUPLE, _ITEMS = "__tensor__", "__ndarray__", "__tuple__", "__items__"


def encode(obj: Any, tensors: dict[str, torch.Tensor], path: str = "") -> Any:
    """``obj`` as JSON-able data; its tensors go into ``tensors`` under their path."""
    if isinstance(obj, torch.Tensor):
        key = path or "root"
        tensors[key] = obj.detach().to("cpu").contiguous().clone()
        return {_TENSOR: key}
    if isinstance(obj, np.ndarray):
        key = path or "root"
        tensors[key] = torch.from_numpy(np.ascontiguousarray(obj).astype(np.int64)
                                        if obj.dtype.kind in "ui" else obj.copy())
        return {_ARRAY: key, "dtype": str(obj.dtype)}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: encode(v, tensors, f"{path}.{k}" if path else k) for k, v in obj.items()}
        return {_ITEMS: [[encode(k, tensors, f"{path}.k{i}"), encode(v, tensors, f"{path}.{i}")]
                         for i, (k, v) in enumerate(obj.items())]}
    if isinstance(obj, tuple):
        return {_TUPLE: [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]}
    if isinstance(obj, list):
        return [encode(v, tensors, f"{path}.{i}") for i, v in enumerate(obj)]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    raise TypeError(f"run state at {path or 'the top'}: {type(obj).__name__} is not "
                    f"storable as JSON or safetensors")


def decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [decode(v, tensors) for v in obj]
    if not isinstance(obj, dict):
        return obj
    if _TENSOR in obj:
        return tensors[obj[_TENSOR]]
    if _ARRAY in obj:
        return tensors[obj[_ARRAY]].numpy().astype(np.dtype(obj["dtype"]))
    if _TUPLE in obj:
        return tuple(decode(v, tensors) for v in obj[_TUPLE])
    if _ITEMS in obj:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in obj[_ITEMS]}
    return {k: decode(v, tensors) for k, v in obj.items()}


def _hashable(key):
    return tuple(key) if isinstance(key, list) else key


def write_tree(stem: Path, tree: Any) -> list[Path]:
    """Write ``stem.json`` and ``stem.safetensors``; returns both paths."""
    from safetensors.torch import save_file

    stem = Path(stem)
    tensors: dict[str, torch.Tensor] = {}
    data = encode(tree, tensors)
    js, st = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    js.write_text(json.dumps(data) + "\n")
    save_file(tensors, str(st))
    return [js, st]


def read_tree(stem: Path) -> Any:
    """Read what ``write_tree`` wrote; a missing or unreadable file is a
    ``CheckpointError`` naming it."""
    from safetensors.torch import load_file

    stem = Path(stem)
    js, st = stem.with_suffix(".json"), stem.with_suffix(".safetensors")
    for f in (js, st):
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (the checkpoint is incomplete)")
    try:
        data = json.loads(js.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{js}: not valid JSON ({e}); the file is corrupt") from None
    try:
        tensors = load_file(str(st))
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise CheckpointError(f"{st}: not a readable safetensors file ({e}); the file is "
                              f"corrupt") from None
    try:
        return decode(data, tensors)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{js}: does not match {st.name} ({e!r}); the files are "
                              f"corrupt") from None


def read_json(path: Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the checkpoint is incomplete)")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e}); the file is corrupt") from None


# ------------------------------------------------------------------ dist_checkpointing

_DCP_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("collections", "OrderedDict"), ("pathlib", "PosixPath"), ("pathlib", "Path"),
}
_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        dtype = getattr(torch, name, None) if module == "torch" else None
        if (module, name) in _DCP_ALLOWED or module in _DCP_MODULES or \
                isinstance(dtype, torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def check_dcp_metadata(folder: Path) -> dict[str, int]:
    """Read ``folder/.metadata`` with an allow-list of classes (only the
    torch.distributed.checkpoint records, sizes and dtypes); refuse objects other than
    tensors (a checkpoint written here holds none, and torch loads objects with full
    pickle). Returns the bytes each data file must hold at least."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    f = Path(folder) / ".metadata"
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (the checkpoint is incomplete)")
    try:
        with open(f, "rb") as fh:
            meta = _MetadataUnpickler(fh).load()
    except Exception as e:  # noqa: BLE001 - any failure means: not a safe metadata file
        raise CheckpointError(f"{f}: not a torch.distributed.checkpoint metadata file this "
                              f"version reads safely ({e}); it is corrupt or was not "
                              f"written by megatron_tlt") from None
    objects = [k for k, v in getattr(meta, "state_dict_metadata", {}).items()
               if isinstance(v, BytesStorageMetadata)]
    if objects:
        raise CheckpointError(f"{f}: holds pickled objects {objects[:3]}, which a "
                              f"megatron_tlt checkpoint never does; refusing to load them")
    need: dict[str, int] = {}
    for info in (getattr(meta, "storage_data", None) or {}).values():
        end = int(info.offset) + int(info.length)
        need[info.relative_path] = max(need.get(info.relative_path, 0), end)
    return need


def check_common_pt(folder: Path) -> None:
    """megatron-core's ``common.pt`` loads only with ``weights_only=True`` (tensors and
    plain data), never as a full pickle."""
    f = Path(folder) / "common.pt"
    if not f.is_file():
        raise CheckpointError(f"{f}: missing (the checkpoint is incomplete)")
    try:
        torch.load(io.BytesIO(f.read_bytes()), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - UnpicklingError, zip errors, ...
        raise CheckpointError(f"{f}: refused by torch.load(weights_only=True) ({e}); it is "
                              f"corrupt or holds objects other than tensors and plain "
                              f"data") from None
