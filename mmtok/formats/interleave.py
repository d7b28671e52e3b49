"""OUT/interleave.json: the summary `mmtok audio interleave` writes last (its presence means the run
completed), naming every dataset set it made and, for a set it did not write, why. Read by inspect and
`tokenizer check` for the layout and the reason."""

from __future__ import annotations

import json
from pathlib import Path

METADATA = "interleave.json"


def not_written_reason(prefix: Path) -> str | None:
    """Why OUT/<set> has no dataset, when OUT/interleave.json records that set as not written."""
    metadata = prefix.parent / METADATA
    try:
        entry = json.loads(metadata.read_text("utf-8")).get("datasets", {}).get(prefix.name)
    except (OSError, ValueError):  # absent or not ours: the caller reports the path as it is
        return None
    if not entry or entry.get("written", True):
        return None
    return f"{entry['reason']}, so `mmtok audio interleave` did not write it (see {metadata})"
