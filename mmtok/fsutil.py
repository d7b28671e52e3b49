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


def copy_file_into(source: str | os.PathLike, handle: IO) -> None:
    """Append the bytes of file `source` to the open binary file `handle`.

    Uses copy_file_range (an in-kernel copy: no trip through user space, a reflink on filesystems
    that share extents), falling back to a buffered copy where the kernel or filesystem cannot.
    """
    import errno
    import shutil

    handle.flush()
    with open(source, "rb") as src:
        size, copied = os.fstat(src.fileno()).st_size, 0
        try:
            while copied < size:
                step = os.copy_file_range(src.fileno(), handle.fileno(), size - copied)
                if step == 0:  # the source shrank while copying
                    break
                copied += step
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            src.seek(copied)
            handle.seek(0, os.SEEK_END)
            shutil.copyfileobj(src, handle, 1 << 24)
    handle.seek(0, os.SEEK_END)  # the kernel moved the descriptor's offset; resync the buffered writer


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
