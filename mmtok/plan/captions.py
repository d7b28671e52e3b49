"""Caption sidecars in the caption modes: read by byte range, normalised once, counted exactly.

`mmtok.text.caption_text` is THE normalisation: the encoder must build caption documents from the same string,
or the planned document totals would not match the written ones.
"""

from __future__ import annotations

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.manifest import MemberReader
from mmtok.text import TextTokenizer, caption_text

CAPTION_REASONS = ("missing_caption", "empty_caption", "caption_not_utf8", "caption_unreadable")
_OPEN_FILES = 16
_ENCODE_CHUNK = 4096


class CaptionReader:
    """Reads the caption of a manifest row by container index: a tar sidecar's byte range, or for a
    Parquet/Arrow container the scan's text column at row `offset` (through the manifest's reader)."""

    def __init__(self, containers: list[tuple[str, str]], text_column: str | None = None):
        self._containers = containers
        self._text_column = text_column
        self._reader = MemberReader(max_open=_OPEN_FILES)

    def read(self, container: int, offset: int, size: int) -> bytes:
        """The caption bytes; OSError when they cannot be read (a missing file included: for the plan
        that is a counted reason per document, not a stop)."""
        path, kind = self._containers[container]
        try:
            return self._reader.read_text(kind, path, offset, size, self._text_column)
        except MmtokError as err:
            raise OSError(str(err)) from None

    def close(self) -> None:
        self._reader.close()


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
