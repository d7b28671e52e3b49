"""Parquet and Arrow files as image containers (e.g. a Hugging Face `datasets` export).

An image column is either binary or a struct with a binary `bytes` field (the `datasets` Image
feature: `{bytes, path}`). Parquet is read by row group; Arrow IPC (file or stream format, as
`datasets.save_to_disk` writes) is memory-mapped, so neither is loaded whole into memory. Both
kinds are `container == "parquet"` in the manifest (a table file, `offset` = row index); the file
format is sniffed from the first bytes wherever it matters.
"""

from __future__ import annotations

import bisect
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from mmtok.errors import Skip

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # continuation marker opening an IPC stream message
KEY_COLUMN = "__key__"  # WebDataset-to-Parquet exports keep the sample key here
PREFERRED_IMAGE_COLUMN = "image"


class ColumnError(Skip):
    """The file has no usable image (or text) column; `reason` is the manifest reason."""


def sniff_format(path: str) -> str:
    """"parquet", "arrow" or "tar" (the default) from the file's first bytes."""
    with open(path, "rb") as handle:
        magic = handle.read(8)
    if magic.startswith(PARQUET_MAGIC):
        return "parquet"
    if magic.startswith(ARROW_FILE_MAGIC) or magic.startswith(ARROW_STREAM_MAGIC):
        return "arrow"
    return "tar"


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)


def _is_image_type(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        return index >= 0 and _is_binary(kind.field(index).type)
    return _is_binary(kind)


def choose_columns(schema: pa.Schema, image_column: str | None, text_column: str | None) -> tuple[str, str | None, str | None]:
    """(image column, text column or None, key column or None); raises ColumnError."""
    names = schema.names
    if image_column is not None:
        if image_column not in names or not _is_image_type(schema.field(image_column).type):
            raise ColumnError("missing_column", f"no binary or {{bytes, path}} column {image_column!r} (columns: {names})")
    else:
        candidates = [n for n in names if _is_image_type(schema.field(n).type)]
        if not candidates:
            raise ColumnError("no_image_column", f"no binary or {{bytes, path}} column among {names}; pass --image-column")
        image_column = PREFERRED_IMAGE_COLUMN if PREFERRED_IMAGE_COLUMN in candidates else candidates[0]
    if text_column is not None:
        kind = schema.field(text_column).type if text_column in names else None
        if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ColumnError("missing_column", f"no string column {text_column!r} (columns: {names})")
    key = KEY_COLUMN if KEY_COLUMN in names and pa.types.is_string(schema.field(KEY_COLUMN).type) else None
    return image_column, text_column, key


def _read_arrow(path: str) -> pa.Table:
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


def read_schema(path: str, file_format: str) -> pa.Schema:
    import pyarrow.parquet as pq

    if file_format == "parquet":
        return pq.ParquetFile(path).schema_arrow
    return _read_arrow(path).schema


def iter_batches(path: str, file_format: str, columns: list[str], batch_rows: int = 1024) -> Iterator[pa.RecordBatch]:
    """The file's rows in order, `columns` only, in batches of at most `batch_rows`."""
    import pyarrow.parquet as pq

    if file_format == "parquet":
        yield from pq.ParquetFile(path, memory_map=True).iter_batches(batch_size=batch_rows, columns=columns)
    else:
        yield from _read_arrow(path).select(columns).to_batches(max_chunksize=batch_rows)


def image_values(array: pa.Array) -> list[bytes | None]:
    """Image bytes of a binary or {bytes, path} column (None where the value or its struct is null)."""
    if pa.types.is_struct(array.type):
        values = pc.struct_field(array, "bytes")
        array = pc.if_else(array.is_valid(), values, pa.nulls(len(array), values.type))
    return array.to_pylist()


def struct_paths(array: pa.Array) -> list[str | None] | None:
    """The `path` field of a {bytes, path} column, or None when the column has none."""
    kind = array.type
    if not pa.types.is_struct(kind) or kind.get_field_index("path") < 0:
        return None
    if not pa.types.is_string(kind.field(kind.get_field_index("path")).type):
        return None
    return pc.struct_field(array, "path").to_pylist()


class TableRows:
    """Random access to image values by row index (Parquet: one cached row group at a time)."""

    def __init__(self, path: str):
        import pyarrow.parquet as pq

        self._parquet = pq.ParquetFile(path, memory_map=True) if sniff_format(path) == "parquet" else None
        self._table = None if self._parquet else _read_arrow(path)
        if self._parquet is not None:
            meta = self._parquet.metadata
            self._starts = [0]
            for group in range(meta.num_row_groups):
                self._starts.append(self._starts[-1] + meta.row_group(group).num_rows)
        self._cached: tuple[tuple[int, str], pa.Table] | None = None

    def image_bytes(self, column: str, row: int) -> bytes:
        value = image_values(self._cell(column, row))[0]
        if value is None:
            raise OSError(f"row {row} of column {column!r} holds no image")
        return value

    def text(self, column: str, row: int) -> str:
        value = self._cell(column, row).to_pylist()[0]
        if value is None:
            raise OSError(f"row {row} of column {column!r} holds no text")
        return value

    def _cell(self, column: str, row: int) -> pa.Array:
        """A one-element array: `column` at `row`."""
        if self._parquet is None:
            table, index = self._table, row
        else:
            group = bisect.bisect_right(self._starts, row) - 1
            if not 0 <= group < len(self._starts) - 1:
                raise OSError(f"row {row} is past the end of the file")
            if self._cached is None or self._cached[0] != (group, column):
                self._cached = ((group, column), self._parquet.read_row_group(group, columns=[column]))
            table, index = self._cached[1], row - self._starts[group]
        return table.column(column).slice(index, 1).combine_chunks()
