"""Parquet files whose bytes depend only on their rows: fixed row groups.

pyarrow cuts row groups where the caller's tables end, so the same rows written in different pieces
would give different files (and fingerprints). `FixedRowGroups` buffers tables and writes row
groups of exactly `rows_per_group` rows (the last one shorter); the manifest and the plan use it.
`write_with_skips` writes one with the skip records of the same rows beside it (the manifest, the hash table);
`read_recorded` reads such a file back only when its bytes are the ones its stage recorded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import pyarrow as pa
import pyarrow.parquet as pq

from mmtok.errors import MmtokError
from mmtok.formats import skips
from mmtok.fsutil import atomic_writer, check_recorded, sha256_file


class FixedRowGroups:
    """Feed tables of `schema` to `writer` in row groups of exactly `rows_per_group` rows."""

    def __init__(self, writer: pq.ParquetWriter, schema: pa.Schema, rows_per_group: int):
        self.writer, self.schema, self.size = writer, schema, rows_per_group
        self.rows = 0  # written so far, buffered rows included
        self._pending: list[pa.Table] = []
        self._pending_rows = 0

    def write(self, table: pa.Table) -> None:
        self._pending.append(table)
        self._pending_rows += table.num_rows
        self.rows += table.num_rows
        if self._pending_rows >= self.size:
            merged = pa.concat_tables(self._pending)
            full = merged.num_rows - merged.num_rows % self.size
            for start in range(0, full, self.size):
                self.writer.write_table(merged.slice(start, self.size), row_group_size=self.size)
            rest = merged.slice(full)
            self._pending, self._pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def finish(self, empty_group: bool = False) -> int:
        """Write the last, shorter group (or, with `empty_group`, an empty one when nothing was written);
        returns the number of rows. The caller closes the writer."""
        if self._pending_rows or (empty_group and not self.rows):
            table = pa.concat_tables(self._pending) if self._pending else self.schema.empty_table()
            self.writer.write_table(table, row_group_size=self.size)
        self._pending, self._pending_rows = [], 0
        return self.rows


def write_with_skips(path: Path, skipped_path: Path, schema: pa.Schema, rows_per_group: int,
                     pieces: Iterable[tuple[pa.Table, list[skips.SkipRecord]]]) -> tuple[int, int, str, str]:
    """Write `path` (zstd, fixed row groups) and the skip file `skipped_path` from `pieces`, each a table of `schema`
    and the skip records of its rows; both replace the old files by rename only once complete. Returns (rows,
    records, sha256 of `path`, sha256 of `skipped_path`), what the stage's metadata records."""
    with atomic_writer(path) as handle, atomic_writer(skipped_path) as skipped:
        writer = pq.ParquetWriter(handle, schema, compression="zstd")
        groups = FixedRowGroups(writer, schema, rows_per_group)
        records = 0
        for table, found in pieces:
            groups.write(table)
            skips.append(skipped, found)
            records += len(found)
        rows = groups.finish(empty_group=True)
        writer.close()
        for out in (handle, skipped):
            out.flush()
        return rows, records, sha256_file(handle.name), sha256_file(skipped.name)


def read_recorded(path: Path, recorded_sha256: str, schema: pa.Schema, what: str, rerun: str) -> pa.Table:
    """The Parquet file a stage wrote, after checking its bytes against the sha256 the stage recorded and its
    columns against `schema`: one MmtokError line naming the file, `what` it should be and the command to
    `rerun` when it is unreadable, changed since or of other columns."""
    check_recorded(path, recorded_sha256, rerun)
    table = pq.read_table(path)
    if table.schema.remove_metadata() != schema:
        raise MmtokError(f"{path}: columns {table.schema.names} of types {[str(t) for t in table.schema.types]} "
                         f"are not {what}'s; rerun `{rerun}`")
    return table
