"""The manifest rows a rank needs (only the row groups that hold them).

Member bytes are read with `mmtok.formats.manifest.MemberReader` (byte ranges, never iterating a tar).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.manifest import MANIFEST_FILE, read_manifest_metadata

MANIFEST_COLUMNS = ("key", "document", "image_index", "tar", "container", "member", "offset", "size", "width",
                    "height", "text_offset", "text_size", "json_offset", "json_size")


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
