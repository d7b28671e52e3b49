"""A merge output: its names, and OUT/merged.json's writer and readers (`mmtok merge` writes, inspect and
`tokenizer check` read).

OUT/merged.bin/.idx            the joined Megatron dataset (absent when no part has a token)
OUT/merged.provenance.jsonl    one line per sequence: where it came from
OUT/merged.skipped.jsonl       the parts' skip lists, joined
OUT/merged.json                the summary, written last: its presence means the merge completed
OUT/merged_no_reasoning.*      the copy without reasoning spans (`--strip-reasoning`)
"""

from __future__ import annotations

from pathlib import Path

from mmtok.errors import MmtokError
from mmtok.fsutil import SummaryFile

MERGED = "merged"
NO_REASONING = "merged_no_reasoning"
PROVENANCE_SUFFIX = ".provenance.jsonl"
SKIPPED_SUFFIX = ".skipped.jsonl"
SUMMARY = f"{MERGED}.json"
SUMMARY_FILE = SummaryFile(SUMMARY)


def not_written_reason(prefix: Path) -> str | None:
    """Why a merge output has no dataset at `prefix`, when OUT/merged.json records it as not written."""
    try:
        summary = SUMMARY_FILE.read(prefix.parent)
    except (OSError, MmtokError):
        return None
    if summary is None:
        return None
    entry = {MERGED: summary, NO_REASONING: summary.get("strip_reasoning") or {}}.get(prefix.name, {})
    if entry.get("dataset", True):
        return None
    return (f"no sequence has a token (every input was skipped: see {prefix.parent / summary['skipped_file']}), "
            "so `mmtok merge` wrote no dataset")
