"""Caption sidecars in the caption modes: read by byte range, normalised once, counted exactly.

`caption_text` is THE normalisation: the encoder must build caption documents from the same string,
or the planned document totals would not match the written ones.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import BinaryIO

import numpy as np

from mmtok.text import TextTokenizer

CAPTION_REASONS = ("missing_caption", "empty_caption", "caption_not_utf8", "caption_unreadable")
_OPEN_FILES = 16
_ENCODE_CHUNK = 4096


def caption_text(raw: bytes) -> str:
    """The caption string of a txt sidecar: UTF-8 (strict), surrounding whitespace removed.

    Raises UnicodeDecodeError for bytes that are not UTF-8.
    """
    return raw.decode("utf-8").strip()


class CaptionReader:
    """Reads caption sidecars: byte ranges of tars (`seek(offset); read(size)`, a few files kept open);
    for Parquet/Arrow containers the scan's text column at row `offset`."""

    def __init__(self, containers: list[tuple[str, str]], text_column: str | None = None):
        self._containers = containers
        self._text_column = text_column
        self._files: OrderedDict[int, BinaryIO] = OrderedDict()
        self._tables: dict[int, object] = {}

    def read(self, container: int, offset: int, size: int) -> bytes:
        path, kind = self._containers[container]
        if kind != "tar":
            return self._table_text(container, path, kind, offset)
        handle = self._files.pop(container, None)
        if handle is None:
            handle = open(path, "rb")
            if len(self._files) >= _OPEN_FILES:
                self._files.popitem(last=False)[1].close()
        self._files[container] = handle
        handle.seek(offset)
        data = handle.read(size)
        if len(data) != size:
            raise OSError(f"{path}: short read at offset {offset} ({len(data)} of {size} bytes)")
        return data

    def _table_text(self, container: int, path: str, kind: str, row: int) -> bytes:
        import pyarrow as pa

        from mmtok.scan.tables import iter_batches

        if self._text_column is None:
            raise OSError(f"{path}: the manifest names no text column for {kind} captions")
        column = self._tables.get(container)
        if column is None:
            try:
                chunks = [b.column(0) for b in iter_batches(path, kind, [self._text_column], batch_rows=1 << 16)]
            except (pa.ArrowException, KeyError, ValueError) as err:
                raise OSError(f"{path}: cannot read text column {self._text_column!r}: {err}") from None
            column = self._tables[container] = pa.chunked_array(chunks, pa.string() if not chunks else None)
            if len(self._tables) > _OPEN_FILES:
                self._tables.pop(next(iter(self._tables)))
        if not 0 <= row < len(column) or not column[row].is_valid:
            raise OSError(f"{path}: no text at row {row}")
        value = column[row].as_py()
        return value.encode("utf-8") if isinstance(value, str) else bytes(value)

    def close(self) -> None:
        while self._files:
            self._files.popitem()[1].close()
        self._tables.clear()


def count_captions(reader: CaptionReader, tokenizer: TextTokenizer, container: np.ndarray, offset: np.ndarray,
                   size: np.ndarray) -> tuple[np.ndarray, list[str | None]]:
    """Exact caption token counts for one sidecar per document.

    Returns (tokens int64, -1 where unusable; reason per document, None where usable). Reads in
    (container, offset) order so each file is read front to back.
    """
    n = len(offset)
    tokens = np.full(n, -1, np.int64)
    reasons: list[str | None] = [None] * n
    texts: dict[int, str] = {}
    for i in np.lexsort((offset, container)).tolist():  # one read per document: I/O, not per-row arithmetic
        if offset[i] < 0 or size[i] < 0:
            reasons[i] = "missing_caption"
            continue
        try:
            text = caption_text(reader.read(int(container[i]), int(offset[i]), int(size[i])))
        except UnicodeDecodeError:
            reasons[i] = "caption_not_utf8"
            continue
        except OSError:
            reasons[i] = "caption_unreadable"
            continue
        if text:
            texts[i] = text
        else:
            reasons[i] = "empty_caption"
    ids = sorted(texts)
    for start in range(0, len(ids), _ENCODE_CHUNK):
        chunk = ids[start:start + _ENCODE_CHUNK]
        encoded = tokenizer.encode_many([texts[i] for i in chunk])
        tokens[chunk] = [len(e) for e in encoded]
    return tokens, reasons
