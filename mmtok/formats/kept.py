"""Kept arrays: an index one rank of `mmtok sft` builds from another stage's output and keeps in its own OUT, so
that the other ranks memory-map it instead of building it again (writer and reader side by side).

```
OUT/<name>/<array>.npy     one NumPy array each (np.save, no pickle)
OUT/<name>/index.json      format, `made_of` (what the index was built from: paths, sizes, mtimes, inodes), the
                           caller's own fields, and each array file's identity as written; written last
```

A kept index is a cache, the other stage's files stay the record: it is used only when it was made of exactly the
same files (`made_of` equal) and every array file is the one its writer recorded (path, size, mtime, inode);
anything else -- another format, a changed or replaced file, a missing array -- makes the caller build the index
again (and keep it again). The arrays are checked by identity, not hashed: hashing them would make every rank read
the whole index (O(corpus), from a shared file system), where memory-mapping reads only the pages a rank looks up.
Writes are atomic (arrays first, the JSON naming them last), so ranks may race to keep one; a JSON that names
arrays another rank replaced since only makes the next reader build it again.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.fsutil import atomic_write_bytes, atomic_write_json, random_access, read_json_object

META = "index.json"


def files_of(paths: list[Path]) -> list[dict]:
    """What identifies files: real path, size, mtime and inode of each (size None: not there)."""
    described = []
    for path in paths:
        try:
            stat = os.stat(path)
            described.append({"path": os.path.realpath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
                              "inode": stat.st_ino})
        except FileNotFoundError:
            described.append({"path": os.path.realpath(path), "size": None})
    return described


def keep(folder: Path, made_of: list[dict], arrays: dict[str, np.ndarray], fields: dict, fmt: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, values in arrays.items():
        buffer = io.BytesIO()
        np.save(buffer, np.ascontiguousarray(values), allow_pickle=False)
        atomic_write_bytes(folder / f"{name}.npy", buffer.getvalue())
    written = dict(zip(arrays, files_of([folder / f"{name}.npy" for name in arrays]), strict=True))
    atomic_write_json(folder / META, {"format": fmt, "made_of": made_of, **fields, "array_files": written})


def load(folder: Path, made_of: list[dict], fmt: str) -> tuple[dict[str, np.ndarray], dict] | None:
    """(the arrays, memory-mapped, and the JSON's fields) of the index kept in `folder` for exactly `made_of`;
    None when there is none, or it is of another format, other files, or an array file is not the one written."""
    try:
        meta = read_json_object(folder / META)
    except MmtokError:
        return None
    if meta is None or meta.get("format") != fmt or meta.get("made_of") != made_of:
        return None
    recorded = meta.get("array_files")
    if not isinstance(recorded, dict):
        return None
    arrays = {}
    for name, identity in recorded.items():
        path = folder / f"{name}.npy"
        if files_of([path]) != [identity]:
            return None
        try:
            arrays[name] = random_access(np.load(path, mmap_mode="r", allow_pickle=False))
        except (OSError, ValueError):
            return None
    return arrays, meta


def load_or_keep(folder: Path, inputs: list[Path], fmt: str, check: Callable[[], None],
                 build: Callable[[], tuple[dict[str, np.ndarray], dict]]) -> tuple[dict[str, np.ndarray], dict]:
    """(arrays, fields) of the index of `inputs` kept in `folder`; when there is none for exactly these files,
    `check()` (the inputs against their checksums), then `build()`, kept for the other ranks. The index records
    the inputs as they were before the check, so a rank that finds it relies on that check: an input changed
    during or after it makes the next rank check and build again."""
    made_of = files_of(inputs)
    found = load(folder, made_of, fmt)
    if found is not None:
        return found
    check()
    arrays, fields = build()
    keep(folder, made_of, arrays, fields, fmt)
    return arrays, fields
