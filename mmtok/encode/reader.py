"""Byte-range reads of tar members and sidecars (never iterating a tar), and the manifest rows a rank needs.

`MemberReader.read(path, offset, size)` is `pread` on a file descriptor shared by every loader
thread (pread has no file position, so threads never race; it releases the GIL), and at most
`max_open` descriptors stay open however many tars a rank walks through. (The scan's per-thread
`mmtok.formats.manifest.MemberReader` keeps every file it touched open, which a long rank with many
loader threads would run into the descriptor limit with.) Parquet/Arrow images and captions are read
through the scan's `mmtok.scan.tables.TableRows`, a few per loader thread.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.manifest import MANIFEST_FILE, read_manifest_metadata

MANIFEST_COLUMNS = ("key", "document", "image_index", "tar", "container", "member", "offset", "size", "width",
                    "height", "text_offset", "text_size", "json_offset", "json_size")


class ShortRead(OSError):
    """A member whose bytes end before its recorded size (a file truncated after the scan)."""


def missing_input(path: str) -> MmtokError:
    return MmtokError(f"{path}: input file listed in the manifest is missing; restore it (or re-run `mmtok scan` "
                      "and `mmtok plan` on the data as it is now)")


class MemberReader:
    """Thread-safe byte-range reader over many files."""

    def __init__(self, max_open: int = 256):
        self._fds: OrderedDict[str, int] = OrderedDict()
        self._local = threading.local()  # per-thread Parquet/Arrow readers (they cache a row group)
        self._lock = threading.Lock()
        self._max_open = max_open

    def _fd(self, path: str) -> int:
        with self._lock:
            fd = self._fds.pop(path, None)
            if fd is None:
                try:
                    fd = os.open(path, os.O_RDONLY)
                except FileNotFoundError:
                    raise missing_input(path) from None
                if len(self._fds) >= self._max_open:
                    os.close(self._fds.popitem(last=False)[1])
            self._fds[path] = fd
            return fd

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Exactly `size` bytes at `offset` of `path`; ShortRead when the file ends early."""
        data = os.pread(self._fd(path), size, offset)
        if len(data) != size:
            raise ShortRead(f"{path}: {len(data)} of {size} bytes at offset {offset}")
        return data

    def read_member(self, container: str, path: str, member: str, offset: int, size: int) -> bytes:
        """An image's bytes: a tar byte range, or a Parquet/Arrow cell (`member` = column, `offset` = row)."""
        if container == "tar":
            return self.read(path, offset, size)
        try:
            return self._table(path).image_bytes(member, offset)
        except OSError as err:
            raise ShortRead(str(err)) from None

    def read_text(self, container: str, path: str, offset: int, size: int, text_column: str | None) -> bytes:
        """A caption: a tar sidecar's byte range, or the scan's text column at row `offset` of a table."""
        if container == "tar":
            return self.read(path, offset, size)
        if text_column is None:
            raise ShortRead(f"{path}: manifest.json names no text column for the captions of table files")
        try:
            return self._table(path).text(text_column, offset).encode("utf-8")
        except OSError as err:
            raise ShortRead(str(err)) from None

    def _table(self, path: str):
        """This thread's reader of a Parquet/Arrow file (it caches a row group); a few kept per thread."""
        from mmtok.scan.tables import TableRows

        tables = self._local.__dict__.setdefault("tables", OrderedDict())
        table = tables.pop(path, None)
        if table is None:
            try:
                table = TableRows(path)
            except FileNotFoundError:
                raise missing_input(path) from None
        tables[path] = table
        if len(tables) > 4:
            tables.popitem(last=False)
        return table

    def close(self) -> None:
        with self._lock:
            while self._fds:
                os.close(self._fds.popitem()[1])


def read_manifest_rows(manifest_dir: str | os.PathLike, rows: np.ndarray,
                       columns: tuple[str, ...] = MANIFEST_COLUMNS) -> dict[str, np.ndarray]:
    """The given manifest rows (any order), reading only the row groups that hold them.

    Returns column name -> array aligned with `rows` (strings as object arrays).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    read_manifest_metadata(manifest_dir)  # a complete manifest, or an error naming the fix
    path = Path(manifest_dir) / MANIFEST_FILE
    rows = np.asarray(rows, np.int64)
    parquet = pq.ParquetFile(path)
    if not rows.size:
        return {c: np.zeros(0, object) for c in columns}
    starts = np.cumsum([0] + [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)])
    if rows.max() >= starts[-1]:
        raise MmtokError(f"{path}: the plan refers to row {rows.max()} but the manifest has {starts[-1]} rows; "
                         "the manifest changed since planning -- re-run `mmtok plan`")
    group_of_row = np.searchsorted(starts, rows, side="right") - 1
    groups = np.unique(group_of_row)
    table = pa.concat_tables([parquet.read_row_group(int(g), columns=list(columns)) for g in groups])
    group_base = np.concatenate([[0], np.cumsum(starts[groups + 1] - starts[groups])])
    local = group_base[np.searchsorted(groups, group_of_row)] + rows - starts[group_of_row]
    taken = table.take(pa.array(local))
    return {name: _numpy(taken.column(name)) for name in columns}


def _numpy(column) -> np.ndarray:
    """Numbers as NumPy arrays; strings as object arrays sharing one str per distinct value (a rank's
    millions of rows repeat a few hundred tar paths)."""
    import pyarrow as pa

    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        encoded = column.combine_chunks().dictionary_encode()
        values = np.asarray(encoded.dictionary.to_pylist() + [None], dtype=object)
        return values[encoded.indices.fill_null(len(values) - 1).to_numpy(zero_copy_only=False)]
    return column.to_numpy()
