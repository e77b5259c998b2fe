"""Writing a file so that a crash mid-write leaves the previous version whole.

``atomic_write`` writes a temporary file beside the target (same folder, so the same
file system), flushes it to disk, then renames it over the target with ``os.replace``,
which is atomic: a reader, or the next run after a crash, sees either the old file or
the new one, never a torn one. A failed write removes its temporary file and leaves
the target untouched.
"""

from __future__ import annotations

import os
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


def write_bytes_atomic(path: PathLike, data: bytes) -> Path:
    """Replace ``path``'s content with ``data`` atomically (see ``atomic_write``)."""
    with atomic_write(path, "wb") as f:
        f.write(data)
    return Path(path)
