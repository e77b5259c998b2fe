"""Checkpoint folders on disk: atomic saves, ``latest``, keep-last-N, verified loads.

Layout of one checkpoint (``{save}/step_{N:07d}/``)::

    run.json                      step, layout, model metadata, LR schedule, drafter
                                  config, and the size of every file below (rank 0)
    policy/                       weights + optimizer: megatron-core dist_checkpointing
                                  (each shard written once, resharded on load)
    drafter.safetensors           the drafter's weights, unsharded (rank 0)
    rank_tp{t}_pp{p}_dp{d}.json   per rank: RNG streams, sampler, tuner, counters,
    rank_tp{t}_pp{p}_dp{d}.safetensors   drafter optimizer and buffered responses

Nothing is a pickle except the two files megatron-core writes in ``policy/``, which are
checked with an allow-list before megatron-core reads them (``safe_files``).

A save writes into ``.step_N.partial``; after every rank has written, the ranks
checksum the files (CRC-32, each rank a share of them), rank 0 records every file's
size and checksum in ``run.json``, renames the folder to ``step_N``
(``fileio.publish_dir``) and then points ``latest`` at it, so a kill at any moment
leaves the previous checkpoint loadable. Older checkpoints beyond ``keep_last`` are
removed afterwards. An asynchronous save (``background``) does the same, the publishing
step running once every rank's background writes have finished.

A load verifies the checkpoint first (``verify``: every file present, of its recorded
size and checksum, readable by the safe readers; each rank reads its share of the
files and the ranks agree on the verdict) and names the file that fails; with
``fallback_to_previous`` it then tries the next older complete checkpoint.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import zlib
from pathlib import Path
from typing import Callable, Optional

from .. import collectives
from ..fileio import publish_dir, write_text_atomic
from ..run_files import DRAFTER_FILE, POLICY_DIR, RUN_FILE, STEP_PREFIX, step_name
from .safe_files import CheckpointError, read_json, read_tree, write_tree
from .sharded import load_policy, save_policy, verify_policy
from .state import RunState

FORMAT_VERSION = 2
def rank_stem(tp: int, pp: int, dp: int) -> str:
    return f"rank_tp{tp}_pp{pp}_dp{dp}"


def _layout_dict(layout) -> dict:
    return {"tp": layout.tp_size, "pp": layout.pp_size, "dp": layout.dp_size}


def _rank() -> int:
    return collectives.rank()


def _world() -> int:
    return collectives.size()


def _barrier() -> None:
    collectives.barrier()


def _gather(obj) -> list:
    return collectives.all_gather_object(obj)


CHUNK = 16 << 20


def crc32(path: Path) -> int:
    """CRC-32 of a file's bytes, streamed."""
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            value = zlib.crc32(chunk, value)
    return value


def _share(names: list[str]) -> list[str]:
    """This rank's share of ``names`` (every rank sees the same sorted list)."""
    return names[_rank()::_world()]


# ------------------------------------------------------------------ save
def save(state: RunState, folder: str | Path, layout, *, keep_last: int = 0,
         published: Optional[Callable[[Path], None]] = None, background=None) -> Path:
    """Write ``state`` as ``folder/step_N`` and publish it through ``folder/latest``;
    every rank calls it. ``keep_last`` > 0 then removes all but the newest
    ``keep_last`` checkpoints; ``published(path)`` runs on every rank once it is
    published. Returns the path.

    ``background`` (a ``background.BackgroundSaves``): the policy's shards are written
    by a background process and the checkpoint is published when ``background``
    finalizes the save (the path returned is the one it will then have); the small
    files are written before this returns, and before the shards are scheduled, so the
    finalize step publishes a complete folder."""
    root = Path(folder)
    final = root / step_name(state.step)
    tmp = root / f".{final.name}.partial"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / POLICY_DIR).mkdir(parents=True)
    _barrier()
    # run.json's state is this moment's, whenever the checkpoint is published
    run = copy.deepcopy({"format_version": FORMAT_VERSION, "layout": _layout_dict(layout),
                         **state.global_state()})
    publish = functools.partial(_publish, tmp, final, run, keep_last, published)
    _write_small_files(state, tmp, layout)
    if state.policy is not None:  # publishes now, or when ``background`` finalizes
        save_policy(state.policy, tmp / POLICY_DIR, background=background, then=publish)
    else:
        publish()
    return final


def _write_small_files(state: RunState, tmp: Path, layout) -> None:
    """The drafter's weights (rank 0) and this rank's state."""
    drafter = state.drafter.own_state() if state.drafter is not None else None  # TP collective
    if _rank() == 0 and drafter is not None:
        from safetensors.torch import save_file

        save_file(drafter, str(tmp / DRAFTER_FILE))
    write_tree(tmp / rank_stem(layout.tp_rank, layout.pp_rank, layout.dp_rank),
               state.rank_state())


def _publish(tmp: Path, final: Path, run: dict, keep_last: int,
             published: Optional[Callable[[Path], None]]) -> None:
    """Once every rank's files are written (every rank calls it): checksum them, record
    them in ``run.json``, rename the folder to its final name, point ``latest`` at it,
    prune."""
    _barrier()
    names = sorted(str(f.relative_to(tmp)) for f in tmp.rglob("*") if f.is_file())
    sums = {k: v for part in _gather({n: crc32(tmp / n) for n in _share(names)})
            for k, v in part.items()}
    if _rank() == 0:
        files = {n: (tmp / n).stat().st_size for n in names}
        run = {**run, "files": files, "crc32": sums}
        (tmp / RUN_FILE).write_text(json.dumps(run, indent=1) + "\n")
        publish_dir(tmp, final)
        root = final.parent
        write_text_atomic(root / "latest", final.name + "\n")
        if keep_last > 0:
            prune(root, keep_last)
    _barrier()
    if published is not None:
        published(final)


def steps(folder: str | Path) -> list[Path]:
    """The published ``step_N`` folders under ``folder``, oldest first."""
    root = Path(folder)
    return sorted(p for p in root.glob(f"{STEP_PREFIX}*") if p.is_dir()
                  and p.name[len(STEP_PREFIX):].isdigit())


def prune(folder: str | Path, keep_last: int) -> list[Path]:
    """Remove all but the newest ``keep_last`` checkpoints (never the one ``latest``
    names) and stale ``.partial`` folders of killed saves. Returns what was removed."""
    root = Path(folder)
    marked = latest(root)
    removed = []
    for p in steps(root)[:-keep_last] if keep_last > 0 else []:
        if marked is not None and p.resolve() == marked.resolve():
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    for p in root.glob(f".{STEP_PREFIX}*.partial"):
        shutil.rmtree(p, ignore_errors=True)
    return removed


def latest(folder: str | Path) -> Optional[Path]:
    """The newest published checkpoint under ``folder`` (None if there is none):
    the one ``latest`` names, else the highest ``step_N``."""
    root = Path(folder)
    marker = root / "latest"
    if marker.is_file():
        path = root / marker.read_text().strip()
        if path.is_dir():
            return path
    found = steps(root)
    return found[-1] if found else None


# ------------------------------------------------------------------ verify / load
def verify(path: str | Path, *, collective: bool = False) -> dict:
    """Check a ``step_N`` folder before any of it is loaded; returns its ``run.json``.
    Raises ``CheckpointError`` naming the first missing, truncated, corrupt or unsafe
    file. ``collective``: every rank calls it and checksums only its share of the
    files, and all raise the same error (or none)."""
    path = Path(path)
    if not collective:
        return _verify(path, None)
    error = None
    try:
        run = _verify(path, _share)
    except CheckpointError as e:
        error = str(e)
    errors = [e for e in _gather(error) if e is not None]
    if errors:
        raise CheckpointError(errors[0])
    return run


def _verify(path: Path, share) -> dict:
    run = read_json(path / RUN_FILE)
    if not isinstance(run, dict) or run.get("format_version") != FORMAT_VERSION:
        got = run.get("format_version") if isinstance(run, dict) else None
        raise CheckpointError(f"{path / RUN_FILE}: format_version {got!r}, this version "
                              f"reads {FORMAT_VERSION}; resume it with the version that "
                              f"wrote it")
    for name, size in run.get("files", {}).items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{f}: missing (the checkpoint is incomplete)")
        if f.stat().st_size != size:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, saved with {size}; the "
                                  f"file is truncated or was changed")
    sums = run.get("crc32", {})  # (absent from checkpoints written before checksums)
    names = sorted(sums)
    for name in share(names) if share is not None else names:
        if crc32(path / name) != sums[name]:
            raise CheckpointError(f"{path / name}: its CRC-32 differs from the one saved; "
                                  f"the file is corrupt (changed after the save)")
    if (path / POLICY_DIR).is_dir():
        verify_policy(path / POLICY_DIR)
    return run


def _candidates(folder: Path) -> list[Path]:
    if folder.name.startswith(STEP_PREFIX) and folder.is_dir():
        return [folder]
    found = steps(folder)
    first = latest(folder)
    if first is None:
        return []
    return [first] + [p for p in reversed(found) if p.name < first.name]


def choose(folder: str | Path, *, fallback_to_previous: bool = False,
           notes: list | None = None) -> tuple[Path, dict]:
    """The checkpoint a resume from ``folder`` uses (``latest``, or ``folder`` itself
    when it is a ``step_N`` folder) and its ``run.json``, verified. With
    ``fallback_to_previous`` a failing one is skipped (and said in ``notes``) for the
    next older one. Every rank calls it (the checksums are shared out, see
    ``verify``), so all choose the same folder or all fail."""
    root = Path(folder)
    found = _candidates(root)
    if not found:
        raise CheckpointError(f"checkpoint.load={folder}: no checkpoint found (expected "
                              f"step_N folders written by checkpoint.save)")
    errors = []
    for path in found if fallback_to_previous else found[:1]:
        try:
            return path, verify(path, collective=True)
        except CheckpointError as e:
            errors.append(str(e))
            if notes is not None:
                notes.append(f"skipped {path.name}: {e}")
    hint = ("" if fallback_to_previous else
            "; set checkpoint.fallback_to_previous=true to resume from the previous "
            "complete checkpoint instead")
    raise CheckpointError(f"cannot resume from {folder}: {errors[-1]}{hint}")


def load(state: RunState, folder: str | Path, layout, *,
         fallback_to_previous: bool = False,
         chosen: Optional[tuple[Path, dict]] = None) -> Path:
    """Restore ``state`` from the newest checkpoint under ``folder`` (or ``folder``
    itself when it is a ``step_N`` folder), resharding the policy when this run's
    TP/PP/DP sizes differ from the saved ones. Every rank calls it; returns the path.
    ``chosen``: what ``choose`` returned (already verified: not verified again)."""
    notes: list[str] = []
    # every rank verifies, so all pick the same folder or all fail (no rank left
    # waiting in a collective)
    path, run = chosen if chosen is not None else choose(
        folder, fallback_to_previous=fallback_to_previous, notes=notes)
    saved, here = run.get("layout", {}), _layout_dict(layout)
    if state.policy is not None:
        load_policy(state.policy, path / POLICY_DIR)
    state.load_global_state(run)
    if state.drafter is not None and (path / DRAFTER_FILE).is_file():
        from safetensors.torch import load_file

        state.drafter.load_own_state(load_file(str(path / DRAFTER_FILE)))
    if saved == here:
        stem = rank_stem(layout.tp_rank, layout.pp_rank, layout.dp_rank)
    else:  # resharded: the per-rank part of the rank at the same place, else rank 0's
        def fit(i, n):
            return i if i < n else 0
        stem = rank_stem(fit(layout.tp_rank, saved["tp"]), fit(layout.pp_rank, saved["pp"]),
                         fit(layout.dp_rank, saved["dp"]))
        notes.append(f"saved at TP={saved['tp']} PP={saved['pp']} DP={saved['dp']}, "
                     f"resumed at TP={here['tp']} PP={here['pp']} DP={here['dp']}: model and "
                     f"optimizer resharded; RNG streams, tuner and drafter buffer taken "
                     f"from {stem}")
        if saved["dp"] > here["dp"]:
            notes.append(f"drafter buffers of data-parallel ranks >= {here['dp']} dropped")
    state.load_rank_state(read_tree(path / stem), same_tp=saved.get("tp") == here["tp"],
                          notes=notes)
    if notes and _rank() == 0:
        for n in notes:
            print(f"[checkpoint] {n}", flush=True)
    return path
