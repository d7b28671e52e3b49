"""Durable, atomic file writes: a crash never leaves a half-written file under its final name."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import IO, Iterator


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of `path`; on clean exit fsync it and rename it over `path`.

    On an exception the temporary file is removed and `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    handle = open(tmp, mode)
    try:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        handle.close()
        tmp.unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_writer(path, "wb") as handle:
        handle.write(data)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write `obj` as sorted, indented JSON (byte-stable for equal objects)."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
