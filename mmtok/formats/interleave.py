"""OUT/interleave.json: the summary `mmtok audio interleave` writes last (its presence means the run
completed), naming every dataset set it made and, for a set it did not write, why. Read by inspect and
`tokenizer check` for the layout and the reason."""

from __future__ import annotations

import os
from pathlib import Path

from mmtok.errors import MmtokError
from mmtok.fsutil import atomic_write_json, read_json

METADATA = "interleave.json"


def metadata_path(out: str | os.PathLike) -> Path:
    return Path(out) / METADATA


def remove_metadata(out: str | os.PathLike) -> None:
    """Until it is rewritten, OUT does not claim to be complete."""
    metadata_path(out).unlink(missing_ok=True)


def write_metadata(out: str | os.PathLike, metadata: dict) -> None:
    """Write OUT/interleave.json, last: from then on OUT is a finished interleave."""
    atomic_write_json(metadata_path(out), metadata)


def read_metadata(out: str | os.PathLike) -> dict | None:
    """OUT/interleave.json, or None when OUT holds no finished interleave; MmtokError naming it when damaged."""
    return read_json(metadata_path(out))


def not_written_reason(prefix: Path) -> str | None:
    """Why OUT/<set> has no dataset, when OUT/interleave.json records that set as not written."""
    try:
        entry = (read_metadata(prefix.parent) or {}).get("datasets", {}).get(prefix.name)
    except (OSError, MmtokError, AttributeError):  # absent or not ours: the caller reports the path as it is
        return None
    if not entry or entry.get("written", True):
        return None
    return f"{entry['reason']}, so `mmtok audio interleave` did not write it (see {metadata_path(prefix.parent)})"
