"""Hand-made manifests: rows the tests write themselves (corner cases a scan of real shards would not give),
with the manifest.json a scan of them would have written beside them."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa

from mmtok.formats.manifest import ManifestMetadata, ScanOptions, write_manifest


def summary_of(table: pa.Table | None = None) -> ManifestMetadata:
    """The scan's summary of `table`'s rows (no input file: the tests' rows point at tars that need not exist)."""
    rows = table.select(["document", "status", "reason", "format"]).to_pylist() if table is not None else []
    reasons = Counter(r["reason"] for r in rows if r["status"] != "ok")
    formats = Counter(r["format"] for r in rows if r["status"] == "ok")
    return ManifestMetadata(inputs=[], shards=0, documents=len({r["document"] for r in rows}),
                            images_ok=sum(formats.values()), errors=sum(reasons.values()),
                            reasons=dict(sorted(reasons.items())), formats=dict(sorted(formats.items())),
                            ignored_members={}, bytes_read=0, options=ScanOptions(), scan_version=0)


def write_rows(directory: Path, table: pa.Table) -> Path:
    """`table` (manifest columns) written as a complete manifest in `directory`."""
    write_manifest(directory, [table], summary_of(table))
    return directory
