"""Parquet and Arrow files, the table containers (`mmtok.formats.containers`): images and text for scan and
encode (e.g. a Hugging Face `datasets` export), audio rows for `audio convert`, conversation rows for sft.

An image column is either binary or a struct with a binary `bytes` field (the `datasets` Image
feature: `{bytes, path}`). Parquet is read by row group; Arrow IPC (file or stream format, as
`datasets.save_to_disk` writes) is memory-mapped, so neither is loaded whole into memory. Both
kinds are `container == "parquet"` in the manifest (a table file, `offset` = row index); the file
format is told from the first bytes wherever it matters (`containers.container_of`).
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Iterator

import pyarrow as pa
import pyarrow.compute as pc

from mmtok.errors import Skip
from mmtok.formats.containers import FROM_FIRST, PARQUET, Record, ShortRead, Start, container_of

KEY_COLUMNS = ("__key__", "key")  # a sample key column: WebDataset-to-Parquet exports; img2dataset's Parquet output
PREFERRED_IMAGE_COLUMN = "image"


class ColumnError(Skip):
    """The file has no usable image (or text) column; `reason` is the manifest reason."""


def _is_binary(kind: pa.DataType) -> bool:
    return pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind)


def _is_image_type(kind: pa.DataType) -> bool:
    if pa.types.is_struct(kind):
        index = kind.get_field_index("bytes")
        return index >= 0 and _is_binary(kind.field(index).type)
    return _is_binary(kind)


def choose_columns(schema: pa.Schema, image_column: str | None,
                   text_column: str | None) -> tuple[str, str | None, str | None]:
    """(image column, text column or None, key column or None); raises ColumnError."""
    names = schema.names
    if image_column is not None:
        if image_column not in names or not _is_image_type(schema.field(image_column).type):
            raise ColumnError("missing_column", f"no binary or {{bytes, path}} column {image_column!r} (columns: "
                              f"{names}){_image_lists(schema)}")
    else:
        candidates = [n for n in names if _is_image_type(schema.field(n).type)]
        if not candidates:
            raise ColumnError("no_image_column", f"no binary or {{bytes, path}} column among {names}"
                              f"{_image_lists(schema) or '; pass --image-column'}")
        image_column = PREFERRED_IMAGE_COLUMN if PREFERRED_IMAGE_COLUMN in candidates else candidates[0]
    if text_column is not None:
        kind = schema.field(text_column).type if text_column in names else None
        if kind is None or not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ColumnError("missing_column", f"no string column {text_column!r} (columns: {names})")
    key = next((k for k in KEY_COLUMNS if k in names and pa.types.is_string(schema.field(k).type)), None)
    return image_column, text_column, key


def _image_lists(schema: pa.Schema) -> str:
    """What to say about columns that hold a list of images per row (Hugging Face `Sequence(Image())`)."""
    lists = [n for n in schema.names if (pa.types.is_list(schema.field(n).type) or pa.types.is_large_list(
        schema.field(n).type)) and _is_image_type(schema.field(n).type.value_type)]
    if not lists:
        return ""
    return (f"; {', '.join(repr(n) for n in lists)} holds a list of images per row (Hugging Face Sequence(Image())), "
            "which mmtok does not read as one document: flatten it to one image per row, or write WebDataset tars "
            "whose samples hold the images as KEY.0.jpg, KEY.1.jpg, ... (one document each)")

def _read_arrow(path: str) -> pa.Table:
    source = pa.memory_map(path)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
        return pa.ipc.open_stream(source).read_all()


class TableFile:
    """A table file (`file_format` as `containers.container_of` says) opened once -- its footer parsed once, however
    many read units are read: its schema, the rows of each read unit (its Parquet row groups, or its Arrow record
    batches as written), one unit's columns, or every row's. A Parquet file is read, not mapped: one cut short while
    it is open is an error to report, where a map would end the process with SIGBUS. An Arrow file is
    memory-mapped (its stream format has no index to read one batch by), so one cut short mid-run still ends the
    process with SIGBUS."""

    def __init__(self, path: str, file_format: str):
        import pyarrow.parquet as pq

        self._parquet = pq.ParquetFile(path, memory_map=False) if file_format == PARQUET else None
        self._table = None if self._parquet else _read_arrow(path)
        # (once: listing the batches per read is quadratic in batches, 21 s for 4,000 of them)
        self._batches = None if self._parquet else self._table.to_batches()

    @property
    def schema(self) -> pa.Schema:
        return self._parquet.schema_arrow if self._parquet else self._table.schema

    def group_sizes(self) -> list[int]:
        if self._parquet:
            meta = self._parquet.metadata
            return [meta.row_group(group).num_rows for group in range(meta.num_row_groups)]
        return [batch.num_rows for batch in self._batches]

    def read_group(self, group: int, columns: list[str] | None) -> pa.Table:
        """Read unit `group`, `columns` only (None: every column)."""
        if self._parquet:
            return self._parquet.read_row_group(group, columns=columns)
        batch = self._batches[group]
        return pa.Table.from_batches([batch if columns is None else batch.select(columns)])

    def iter_batches(self, columns: list[str], batch_rows: int = 1024) -> Iterator[pa.RecordBatch]:
        """Every row in order, `columns` only, in batches of at most `batch_rows`."""
        if self._parquet:
            return self._parquet.iter_batches(batch_size=batch_rows, columns=columns)
        return iter(self._table.select(columns).to_batches(max_chunksize=batch_rows))

    def read_columns(self, columns: list[str]) -> pa.Table:
        """Every row, `columns` only (small metadata columns: the media stay on disk)."""
        if self._parquet:
            return self._parquet.read(columns=columns)
        return self._table.select(columns)


UNREADABLE_TABLE = "unreadable_table"  # a table file whose footer or schema does not parse
UNREADABLE_ROW_GROUP = "unreadable_row_group"  # a row group (an Arrow record batch) whose pages do not parse


MISSING_COLUMN = "missing_column"  # a column the reader was asked for that the table does not have


class TableRecords:
    """The `mmtok.formats.containers.Container` of Parquet and Arrow files: a record per row, its value {column:
    value} of `columns` (None: every column), `where` "row N"; read one row group (an Arrow file's record batch) at
    a time, and groups wholly before `start.record` not at all. `file_format` is PARQUET or ARROW when the file's
    name has said what it must be (None: told by its first bytes, `containers.container_of`).

    Skip UNREADABLE_TABLE when the file cannot be read or does not open as a table of its format, MISSING_COLUMN
    (before any record) when it lacks one of `columns` or `required` (which every record must hold, whatever it
    reads), UNREADABLE_ROW_GROUP for a group whose pages do not parse (the records before it were yielded)."""


    def __init__(self, file_format: str | None = None, columns: list[str] | None = None, required: tuple = ()):
        self.file_format, self.columns, self.required = file_format, columns, required

    def records(self, path: Path, start: Start = FROM_FIRST) -> Iterator[Record]:
        try:
            table = TableFile(str(path), self.file_format or container_of(str(path)))
            names, sizes = table.schema.names, table.group_sizes()
        except Exception as err:  # pyarrow raises several types (OSError among them) for damaged files
            raise Skip(UNREADABLE_TABLE, str(err)) from None
        missing = [column for column in (*(self.columns or ()), *self.required) if column not in names]
        if missing:
            raise Skip(MISSING_COLUMN, f"no `{missing[0]}` column (columns: {names})")
        row = 0
        for group, rows in enumerate(sizes):
            if row + rows <= start.record:
                row += rows
                continue
            try:
                values = table.read_group(group, self.columns).to_pylist()
            except Exception as err:  # pyarrow raises several types for damaged pages
                raise Skip(UNREADABLE_ROW_GROUP, f"row group {group} is unreadable ({err})") from None
            first = max(start.record, row)  # the first group read may begin before the start
            for number, value in enumerate(values[first - row:], first):
                yield Record(number, f"row {number}", value)
            row += rows


SAVED_STATE = "state.json"  # Hugging Face `Dataset.save_to_disk`: state.json + dataset_info.json + data-*.arrow


SAVED_SPLITS = "dataset_dict.json"  # `DatasetDict.save_to_disk`: {"splits": [...]} + one save_to_disk folder each


def saved_dataset_files(directory: Path) -> list[Path] | None:
    """The Arrow files of a `Dataset.save_to_disk` directory in its own order (state.json's `_data_files`), or of
    each split of a `DatasetDict.save_to_disk` directory in its `splits` order; None when `directory` is neither.
    A listed name that is not a plain name in its directory is an MmtokError (the state files are input too:
    they never point elsewhere)."""
    from mmtok.errors import MmtokError
    from mmtok.fsutil import read_json_object

    splits_file = directory / SAVED_SPLITS
    if splits_file.is_file():
        splits = (read_json_object(splits_file) or {}).get("splits")
        if not isinstance(splits, list) or not splits or not all(_plain_name(n) for n in splits):
            raise MmtokError(f"{splits_file}: no list of plain split names in `splits` (a damaged or foreign "
                             "DatasetDict.save_to_disk directory)")
        files = []
        for split in splits:
            found = saved_dataset_files(directory / split) if (directory / split / SAVED_STATE).is_file() else None
            if found is None:
                raise MmtokError(f"{directory / split}: split {split!r} of {splits_file} is no save_to_disk folder "
                                 f"(no {SAVED_STATE})")
            files += found
        return files
    state = directory / SAVED_STATE
    if not state.is_file() or not (directory / "dataset_info.json").is_file():
        return None
    listed = (read_json_object(state) or {}).get("_data_files")
    names = [entry.get("filename") for entry in listed] if isinstance(listed, list) and all(
        isinstance(entry, dict) for entry in listed) else None
    if not names or not all(_plain_name(n) for n in names):
        raise MmtokError(f"{state}: no list of plain data file names in `_data_files` (a damaged or foreign "
                         "save_to_disk directory)")
    return [directory / name for name in names]


def _plain_name(name) -> bool:
    return isinstance(name, str) and bool(name) and "/" not in name and "\0" not in name and name not in (".", "..")


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
    """Random access to image values by row index, one cached read unit (row group, record batch) per column; the
    file is a `TableFile` (a Parquet file is read, not mapped: one cut short mid-run is a short read, not SIGBUS)."""

    def __init__(self, path: str):
        self._file = TableFile(path, container_of(path))
        self._starts = [0]
        for size in self._file.group_sizes():
            self._starts.append(self._starts[-1] + size)
        self._cached: dict[str, tuple[int, pa.Table]] = {}  # column -> its last read unit read

    def image_bytes(self, column: str, row: int) -> bytes:
        value = image_values(self._cell(column, row))[0]
        if value is None:
            raise OSError(f"row {row} of column {column!r} holds no image")
        return value

    def text_bytes(self, column: str, row: int, limit: int) -> bytes:
        """The first `limit` UTF-8 bytes of the text at `row`, cut in Arrow: a caption of a gigabyte never
        becomes a Python string (only its row group is in memory, as for any cell)."""
        import pyarrow.compute as pc

        cell = self._cell(column, row)
        if cell.null_count:
            raise OSError(f"row {row} of column {column!r} holds no text")
        return pc.binary_slice(cell.cast(pa.large_binary()), 0, max(limit, 0))[0].as_py()

    def _cell(self, column: str, row: int) -> pa.Array:
        """A one-element array: `column` at `row`."""
        group = bisect.bisect_right(self._starts, row) - 1
        if not 0 <= group < len(self._starts) - 1:
            raise OSError(f"row {row} is past the end of the file")
        # one read unit per column: reading an image, then its caption, must not read either unit again
        if self._cached.get(column, (None,))[0] != group:
            self._cached[column] = (group, self._file.read_group(group, [column]))
        table, index = self._cached[column][1], row - self._starts[group]
        return table.column(column).slice(index, 1).combine_chunks()


class TableCells:
    """The `Fields` of table files (`mmtok.formats.containers`): an image is a cell of its column (`member`, at row
    `offset`), a caption a cell of the text column. Each thread keeps its own few `TableRows` (each caches a read
    unit), so threads never share a reader's state."""

    _PER_THREAD = 4

    def __init__(self):
        self._local = threading.local()

    def member(self, path: str, member: str, offset: int, size: int) -> bytes:
        table = self._rows(path)
        try:
            return table.image_bytes(member, offset)
        except (OSError, pa.ArrowException) as err:  # (ArrowInvalid: pages that no longer decode, changed in place)
            raise ShortRead(str(err)) from None

    def text(self, path: str, offset: int, size: int, column: str | None) -> bytes:
        if column is None:
            raise ShortRead(f"{path}: manifest.json names no text column for the captions of table files")
        table = self._rows(path)
        try:
            return table.text_bytes(column, offset, size)
        except (OSError, pa.ArrowException) as err:
            raise ShortRead(str(err)) from None

    def _rows(self, path: str) -> TableRows:
        """This thread's `TableRows` of `path`: FileNotFoundError when the file is gone, ShortRead when it does
        not open as a table."""
        tables = self._local.__dict__.setdefault("tables", OrderedDict())
        table = tables.pop(path, None)
        if table is None:
            try:
                table = TableRows(path)
            except FileNotFoundError:
                raise
            except (OSError, pa.ArrowException) as err:
                raise ShortRead(str(err)) from None
        tables[path] = table
        if len(tables) > self._PER_THREAD:
            tables.popitem(last=False)
        return table

    def close(self) -> None:
        """Nothing to close: a `TableRows` holds its file open until it is dropped."""
