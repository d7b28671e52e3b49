"""OUT/interleave.json: the summary `mmtok audio interleave` writes last (its presence means the run
completed), naming every dataset set it made and, for a set it did not write, why. Read by inspect and
`tokenizer check` for the layout and the reason."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from mmtok.errors import MmtokError
from mmtok.fsutil import SummaryFile

METADATA = "interleave.json"
STAGE_MAX_TOKENS = 8192  # default longest sequence of the stage set
LONG_MAX_TOKENS = 262_144  # default longest sequence of the long-context set
METADATA_FILE = SummaryFile(METADATA)


@dataclass(frozen=True)
class DatasetEntry:
    """interleave.json's `datasets[name]`: whether OUT/name.bin/.idx was written, its size, or why not."""

    written: bool
    sequences: int
    tokens: int
    reason: str | None = None  # only for a set not written


@dataclass(frozen=True)
class InterleaveSummary:
    """What `mmtok audio interleave` did, as OUT/interleave.json holds it (`to_json`): the tool, its input cache
    (each part's recorded sha256), parameters, vocabulary, text tokenizer and codec, the sequence layout, each
    set's entry, and the counts."""

    tool: str
    input: str
    cache: list[dict]
    parameters: dict
    vocab: dict
    text_tokenizer: dict
    codec: dict
    sequences: dict
    datasets: dict[str, DatasetEntry]
    counts: dict[str, int]

    def to_json(self) -> dict:
        record = asdict(self)
        for entry in record["datasets"].values():
            if entry["reason"] is None:
                del entry["reason"]
        return record


def not_written_reason(prefix: Path) -> str | None:
    """Why OUT/<set> has no dataset, when OUT/interleave.json records that set as not written."""
    try:
        datasets = (METADATA_FILE.read(prefix.parent) or {}).get("datasets")
    except (OSError, MmtokError):  # absent or damaged: the caller reports the path as it is
        return None
    entry = datasets.get(prefix.name) if isinstance(datasets, dict) else None
    if not isinstance(entry, dict) or entry.get("written", True) is not False:
        return None
    reason = entry.get("reason") or "recorded as not written"
    return f"{reason}, so `mmtok audio interleave` did not write it (see {METADATA_FILE.path(prefix.parent)})"
