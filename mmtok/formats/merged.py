"""The names of a merge output (`mmtok merge` writes them, inspect/tokenizer/status read them).

OUT/merged.bin/.idx            the joined Megatron dataset (absent when no part has a token)
OUT/merged.provenance.jsonl    one line per sequence: where it came from
OUT/merged.skipped.jsonl       the parts' skip lists, joined
OUT/merged.json                the summary, written last: its presence means the merge completed
OUT/merged_no_reasoning.*      the copy without reasoning spans (`--strip-reasoning`)
"""

from __future__ import annotations

import json
from pathlib import Path

MERGED = "merged"
NO_REASONING = "merged_no_reasoning"
PROVENANCE_SUFFIX = ".provenance.jsonl"
SKIPPED_SUFFIX = ".skipped.jsonl"
SUMMARY = f"{MERGED}.json"


def not_written_reason(prefix: Path) -> str | None:
    """Why a merge output has no dataset at `prefix`, when OUT/merged.json records it as not written."""
    try:
        summary = json.loads((prefix.parent / SUMMARY).read_text("utf-8"))
    except (OSError, ValueError):
        return None
    entry = {MERGED: summary, NO_REASONING: summary.get("strip_reasoning") or {}}.get(prefix.name, {})
    if entry.get("dataset", True):
        return None
    return (f"no sequence has a token (every input was skipped: see {prefix.parent / summary['skipped_file']}), "
            "so `mmtok merge` wrote no dataset")
