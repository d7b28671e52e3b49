"""A merge output: its names, and OUT/merged.json's writer and readers (`mmtok merge` writes, inspect and
`tokenizer check` read).

OUT/merged.bin/.idx            the joined Megatron dataset (absent when no part has a token)
OUT/merged.provenance.jsonl    one line per sequence: where it came from
OUT/merged.skipped.jsonl       the parts' skip lists, joined
OUT/merged.json                the summary, written last: its presence means the merge completed
OUT/merged_no_reasoning.*      the copy without reasoning spans (`--strip-reasoning`)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from mmtok.errors import MmtokError
from mmtok.fsutil import SummaryFile

MERGED = "merged"
NO_REASONING = "merged_no_reasoning"
PROVENANCE_SUFFIX = ".provenance.jsonl"
SKIPPED_SUFFIX = ".skipped.jsonl"
SUMMARY = f"{MERGED}.json"
SUMMARY_FILE = SummaryFile(SUMMARY)


@dataclass(frozen=True)
class AssembledFigures:
    """The documents of several images the merge assembled from the parts' items, and their tokens."""

    documents: int
    documents_skipped: int
    tokens: int


@dataclass(frozen=True)
class MergeSummary:
    """What `mmtok merge` did, as OUT/merged.json holds it (`to_json`): the parts' shared identity, the summed
    counts (the assembly's folded in) and tokens, per-part figures, the merged dataset (`dataset` False: none
    written, no sequence had a token) and the reader that verified it, and the `--strip-reasoning` copy."""

    identity: dict
    num_parts: int
    tokens: int
    counts: dict[str, int]
    parts: list[dict]  # per part: part, sequences, tokens, dataset, and wall_s / device_busy_s where recorded
    assembled: AssembledFigures
    skipped_file: str
    sequences: int
    dataset: bool
    verified_with: str | None  # None when no dataset was written
    strip_reasoning: dict | None = None  # what `--strip-reasoning` removed; absent from merged.json without it

    def to_json(self) -> dict:
        record = asdict(self)
        if self.strip_reasoning is None:
            del record["strip_reasoning"]
        return record


def not_written_reason(prefix: Path) -> str | None:
    """Why a merge output has no dataset at `prefix`, when OUT/merged.json records it as not written."""
    try:
        summary = SUMMARY_FILE.read(prefix.parent)
    except (OSError, MmtokError):
        return None
    if summary is None:
        return None
    entry = {MERGED: summary, NO_REASONING: summary.get("strip_reasoning")}.get(prefix.name)
    if not isinstance(entry, dict) or entry.get("dataset", True) is not False:
        return None  # written, or a summary that does not say: the caller reports the path as it is
    listed = prefix.parent / str(summary.get("skipped_file") or MERGED + SKIPPED_SUFFIX)
    return f"no sequence has a token (every input was skipped: see {listed}), so `mmtok merge` wrote no dataset"
