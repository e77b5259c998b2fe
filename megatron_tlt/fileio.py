"""Writing a file so that a crash mid-write leaves the previous version whole.

``atomic_write`` writes a temporary file beside the target (same folder, so the same
file system), flushes it to disk, then renames it over the target with ``os.replace``,
which is atomic: a reader, or the next run after a crash, sees either the old file or
the new one, never a torn one. A failed write removes its temporary file and leaves
the target untouched.

Folders (checkpoints) follow the same rule: written under a temporary sibling name,
flushed, then renamed (``publish_dir``; ``atomic_dir`` for a single writer).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import IO, Iterator, Union

PathLike = Union[str, os.PathLike]


@contextmanager
def atomic_write(path: PathLike, mode: str = "w", **open_kwargs) -> Iterator[IO]:
    """``with atomic_write(path) as f: f.write(...)``: ``path`` is replaced only once
    the block has finished without error. ``mode`` is ``"w"`` or ``"wb"``; the file
    gets the permissions a plain ``open`` would give it."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_write: mode must be 'w' or 'wb', got {mode!r}")
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, mode.replace("w", "x"), **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with suppress(OSError):
            os.unlink(tmp)
        raise


def write_text_atomic(path: PathLike, text: str) -> Path:
    """Replace ``path``'s content with ``text`` atomically (see ``atomic_write``)."""
    with atomic_write(path, "w", encoding="utf-8") as f:
        f.write(text)
    return Path(path)


def write_json(path: PathLike, obj, *, indent: int = 1) -> Path:
    """Write ``obj`` as JSON to ``path`` atomically, creating its folder (results files)."""
    import json

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(path, json.dumps(obj, indent=indent) + "\n")


def write_bytes_atomic(path: PathLike, data: bytes) -> Path:
    """Replace ``path``'s content with ``data`` atomically (see ``atomic_write``)."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)


def publish_dir(tmp: PathLike, final: PathLike) -> Path:
    """Give the finished folder ``tmp`` its final name ``final`` (same parent folder),
    replacing an earlier ``final``. Its files are flushed to disk first, so a crash
    after the rename never exposes a folder with torn files; a crash before it leaves
    ``final`` as it was (a crash between removing an old ``final`` and the rename leaves
    no ``final``, never a partial one)."""
    tmp, final = Path(tmp), Path(final)
    for f in tmp.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    if final.exists():
        old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.old")
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    return final


@contextmanager
def atomic_dir(path: PathLike) -> Iterator[Path]:
    """``with atomic_dir(out) as tmp: ...write into tmp...``: a temporary sibling folder
    that becomes ``out`` (``publish_dir``) once the block has finished without error;
    on an error it is removed and ``out`` is left untouched."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        publish_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
