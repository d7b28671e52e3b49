"""The input containers mmtok reads, which one a file is, the interface of their readers, and the JSON Lines one.

  container  files                                   read by
  tar        WebDataset tar shards                   `mmtok.formats.tar` (members by byte range)
  parquet    Parquet tables                          `mmtok.formats.tables` (by row group)
  arrow      Arrow IPC files (`save_to_disk`)        `mmtok.formats.tables` (by record batch)
  jsonl      JSON Lines, `.jsonl` or `.jsonl.gz`     `json_lines` here (Lhotse manifests are JSON Lines too)

Every stage asks here what a file is: scan and the audio Parquet reader by content (`container_of`: a name may lie,
and the manifest then records what was read), the conversation readers and `audio convert` by name before
they open anything (`container_named`). In the manifest every table file, Parquet or Arrow, is container `parquet`
(`offset` = row index): `manifest_container`.

Every container is read through one interface, `Container.records(path, start)`: its records in order, each
a `Record` (its number in the file, where it is for people, and its value), from a `Start` where a resumed
reader goes on. One implementation per container, by its reader:

  container   implementation                        a record's value
  tar         `mmtok.formats.webdataset.TarSamples`  a WebDataset sample (`Sample`: members by byte range)
  table       `mmtok.formats.tables.TableRecords`    a row: {column: value} of the columns it was made for
  jsonl       `JsonLines` here                      a line's JSON value (or the `invalid_json` Skip)

A manifest row locates an image (and its caption) in a tar or a table file; those are read back at random, by
`Fields` (an image's bytes, a caption's), again one implementation per container, the manifest's `MemberReader`
choosing by the row's container:

  container   implementation                        an image is                   a caption is
  tar         `mmtok.formats.tar.TarRanges`          a byte range                  a sidecar's byte range
  table       `mmtok.formats.tables.TableCells`      a cell of the image column    a cell of the text column

`mmtok.formats.readers.reader(name)` gives the one for a container name; a Lhotse manifest is JSON Lines. The
scan walks a tar with `mmtok.formats.tar.TarWalker` itself (its per-member hot loop parses image heads from the
walk's read window) and reads a table's image column in Arrow batches (`TableFile.iter_batches`), not as rows.

A JSON value from a stranger (a line, a cell, a tar member) is parsed by `json_value` alone, so every reader
refuses the same things: what is not JSON, nesting too deep for the parser, and lone surrogates.
"""

from __future__ import annotations

import gzip
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol

from mmtok.errors import Skip

TAR, PARQUET, ARROW, JSONL = "tar", "parquet", "arrow", "jsonl"
TABLE = PARQUET  # the manifest's container of a table file, Parquet or Arrow

PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MAGIC = b"\xff\xff\xff\xff"  # continuation marker opening an IPC stream message
SUFFIXES = ((".tar", TAR), (".parquet", PARQUET), (".arrow", ARROW), (".jsonl", JSONL), (".jsonl.gz", JSONL))


def container_of(path: str) -> str:
    """PARQUET, ARROW or TAR (the default: the tar reader names what else it finds) from the first bytes."""
    with open(path, "rb") as handle:
        magic = handle.read(8)
    if magic.startswith(PARQUET_MAGIC):
        return PARQUET
    if magic.startswith(ARROW_FILE_MAGIC) or magic.startswith(ARROW_STREAM_MAGIC):
        return ARROW
    return TAR


def container_named(path: Path) -> str | None:
    """The container a file's name says (case-insensitive suffix), or None."""
    name = path.name.lower()
    return next((kind for suffix, kind in SUFFIXES if name.endswith(suffix)), None)


def is_compressed(path: Path) -> bool:
    """True for a gzip-compressed JSON Lines file (`.jsonl.gz`)."""
    return path.name.lower().endswith(".gz")


def manifest_container(file_format: str) -> str:
    """The manifest's `container` of a file read as `file_format` (what `container_of` said)."""
    return TAR if file_format == TAR else TABLE


@dataclass(frozen=True)
class Start:
    """Where a reader starts in one input: record number `record` (records before it are not yielded); in a JSON
    Lines file also the byte offset of that record's line and the lines before it (`Record.seek`), so the
    lines before it are not read again."""

    record: int = 0
    offset: int = -1
    line: int = 0


FROM_FIRST = Start()  # the first record of a file

@dataclass(frozen=True)
class Record:
    """One record of an input container, in the container's order."""

    number: int  # its place among the file's records, from 0 (what `Start.record` names)
    where: str  # for people, after the file's path: "KEY" (a tar sample), "row 3", "line 12"
    value: Any  # what the container holds there: see `Container`
    error: Skip | None = None  # why the value cannot be used (JSON Lines: `invalid_json`); value is then None
    seek: tuple[int, int] = (-1, 0)  # JSON Lines: (byte offset of its line, lines before it), for `Start`


class Container(Protocol):
    """An input container's one reader of records (module docstring: one implementation per container)."""

    def records(self, path: Path, start: Start = FROM_FIRST) -> Iterator[Record]:
        """The records of the file at `path` from `start`, in the file's order. OSError when the file cannot be
        read; see each implementation for damage (what a reader is asked for, such as a table's columns, is
        given when it is made)."""


class ShortRead(OSError):
    """What a manifest row locates is no longer all there, or no longer decodes: its file changed after the scan."""


class Fields(Protocol):
    """Random access to what a manifest row locates in a container (module docstring): thread-safe, each file opened
    once however often it is read. FileNotFoundError when the file is gone, ShortRead when it no longer holds the
    bytes the scan found."""

    def member(self, path: str, member: str, offset: int, size: int) -> bytes:
        """An image's bytes: the manifest row's `member`, `offset` and `size`."""

    def text(self, path: str, offset: int, size: int, column: str | None) -> bytes:
        """A caption's UTF-8 bytes, at most `size` of them (`column`: a table's text column)."""

    def close(self) -> None:
        """Close what is open; a read still running closes its file when it ends."""


class JsonLines:
    """The `Container` of JSON Lines files (`.jsonl`, `.jsonl.gz`; Lhotse manifests): a record per non-blank line,
    its value the line's JSON value (`json_value`), else its `error`. OSError when the
    file cannot be read, EOFError when a gzip stream ends early."""


    def records(self, path: Path, start: Start = FROM_FIRST) -> Iterator[Record]:
        lines = json_lines(path, max(start.offset, 0), start.line + 1 if start.offset >= 0 else 1)
        for number, (line_number, at, raw) in enumerate(lines, start.record if start.offset >= 0 else 0):
            if start.offset < 0 and number < start.record:
                continue
            value, error = json_value(raw, f"line {line_number}")
            yield Record(number, f"line {line_number}", value, error, (at, line_number - 1))


def json_lines(path: Path, offset: int = 0, first_line: int = 1) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, raw bytes) of every non-blank line of a JSON Lines file, from byte `offset`
    (the start of line `first_line`); a `.jsonl.gz` file is decompressed, its offsets those of the text.

    OSError when the file cannot be read, EOFError when a gzip stream ends early. No line is parsed here:
    `json_value` does that, so each reader names a bad line its own way.
    """
    with (gzip.open if is_compressed(path) else open)(path, "rb") as handle:
        if offset:
            handle.seek(offset)
        for number, raw in enumerate(handle, first_line):
            at, offset = offset, offset + len(raw)
            if raw.strip():  # a blank line holds no record
                yield number, at, raw


# A lone surrogate, escaped (`\ud800`) or as raw bytes (ED A0..BF xx, which `json.loads` lets through on bytes);
# two patterns, so that each keeps re's fast search for its literal first byte (one alternation is ~8x slower)
_ESCAPED_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]")
_RAW_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")


def json_value(data: bytes | str, what: str) -> tuple[Any, Skip | None]:
    """The json value of one untrusted cell, line or member, or the `invalid_json` Skip naming `what`:
    what is not json, nesting too deep for the parser, or a lone surrogate (no text a tokenizer takes)."""
    try:
        encoding = json.detect_encoding(data) if isinstance(data, bytes) else None
        if encoding not in (None, "utf-8"):  # UTF-16/32 JSON, which json.loads takes too: check its text as UTF-8
            data = data.decode(encoding, "surrogatepass")
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError) as err:  # RecursionError: absurdly deep nesting
        return None, Skip("invalid_json", f"{what}: {type(err).__name__ if isinstance(err, RecursionError) else err}")
    raw = data if isinstance(data, bytes) else data.encode("utf-8", "surrogatepass")
    # only then is the value's text checked: the common case pays two scans for a literal byte
    if _ESCAPED_SURROGATE.search(raw) or (b"\xed" in raw and _RAW_SURROGATE.search(raw)):
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            return None, Skip("invalid_json", f"{what}: a lone surrogate (not Unicode text)")
    return value, None
