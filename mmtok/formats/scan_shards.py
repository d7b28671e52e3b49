"""The scan's per-shard results: `OUT/.scan-cache/<key>.arrow` (one input's rows) + `<key>.json` (its commit).

`mmtok scan` scans each input once, in whichever process claims it (a worker, a rank on another node),
and commits the result here; the manifest is assembled from these files alone, so its bytes do not
depend on who scanned what. A result is written once, in two atomic steps:

  <key>.arrow   the shard's rows (Arrow IPC file, the scanner's shard columns, no metadata)
  <key>.json    the commit, written after the rows are durable: {"rows_bytes", "rows_sha256", "stats",
                "retry", "sha256"}; `stats` are the shard's counts (rows, documents, reads, bytes read,
                reasons...), `retry` marks an input that could not be read (the final assembly scans it
                again), `sha256` is that of the other four (`_digest`): the stats number the manifest's
                documents, so they are checked like the rows

`mmtok hash` commits its chunks of hashes the same way (`mmtok.formats.hashes`).

A result without its commit, whose commit does not match its sha256, or whose rows do not match the
commit's size (cheap check) or sha256 (the check before assembly), is not committed: whoever claims the
shard next scans it again.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa

from mmtok.errors import DamagedFile
from mmtok.fsutil import atomic_write_bytes, atomic_write_json, read_json, sha256_file

COMMIT_KEYS = ("rows_bytes", "rows_sha256", "stats", "retry")


def commit_path(rows_path: Path) -> Path:
    return rows_path.with_suffix(".json")


def write_shard_rows(rows_path: Path, table: pa.Table, stats: dict, retry: bool) -> None:
    """Make the rows durable, then commit them with their checksum and `stats` (JSON values)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    atomic_write_bytes(rows_path, data)
    record = {"rows_bytes": len(data), "rows_sha256": hashlib.sha256(data).hexdigest(), "stats": stats, "retry": retry}
    atomic_write_json(commit_path(rows_path), {**record, "sha256": _digest(record)})


def read_commit(rows_path: Path, verify: bool) -> dict | None:
    """The commit of a shard's rows (its `stats` and `retry`), or None when the shard is not committed: no
    commit, no rows, rows of another size, or (`verify`) rows whose sha256 is not the committed one."""
    try:
        record = read_json(commit_path(rows_path))
        size = os.stat(rows_path).st_size
    except (DamagedFile, FileNotFoundError):
        return None
    if not isinstance(record, dict) or record.get("sha256") != _digest({key: record.get(key) for key in COMMIT_KEYS}):
        return None  # not a commit, or one edited since it was written
    if not (type(record.get("rows_bytes")) is int and isinstance(record.get("rows_sha256"), str)
            and type(record.get("retry")) is bool):
        return None  # whole, but not of this shape (the digest covers absent keys as null)
    if size != record["rows_bytes"] or (verify and sha256_file(rows_path) != record["rows_sha256"]):
        return None
    return record


def _digest(record: dict) -> str:
    """The sha256 of a commit's fields (JSON with sorted keys: the same after a write and read back)."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode("utf-8")).hexdigest()


def read_rows(rows_path: Path) -> pa.Table:
    """The committed rows of a shard, memory-mapped."""
    return pa.ipc.open_file(pa.memory_map(str(rows_path))).read_all()


def discard_shard(rows_path: Path) -> None:
    """Drop one shard's result (its commit first: rows without a commit are not committed)."""
    commit_path(rows_path).unlink(missing_ok=True)
    rows_path.unlink(missing_ok=True)


def remove_shards(cache: Path, keep: set[str]) -> None:
    """Drop the results (rows, commit, claim lock) of every key not in `keep`: inputs no longer scanned here."""
    for path in cache.iterdir():
        if not path.name.startswith(".") and path.name.split(".", 1)[0] not in keep:
            path.unlink(missing_ok=True)
