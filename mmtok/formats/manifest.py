"""The image manifest: `DIR/manifest.parquet` (one row per image) + `DIR/manifest.json` (scan metadata).

This module is the only one that knows the layout. Row order is input order, then container order;
`document` is a global id, non-decreasing in row order (one WebDataset sample key = one document);
`image_index` orders the images inside a document. Error rows (`status == "error"`) keep their
place and name the problem in `reason`; a shard-level problem (e.g. `truncated_tar`) is a row with
an empty key and its own document id. `skipped.jsonl` holds one skip record (`mmtok.formats.skips`,
stage "scan", `position` = the manifest row) per error row, in row order, with the detail of a shard-level
problem. `manifest.json` is written last, so its presence means both files are complete; its `fingerprint`
is the sha256 of manifest.parquet and `skipped_sha256` that of skipped.jsonl.

Reading a member: for `container == "tar"`, its byte range; for `container == "parquet"` (a Parquet or Arrow IPC
table file), `offset` is the row index and `member` the column name (a binary column or a struct with a `bytes`
field). `MemberReader` reads both, through each container's `Fields` (`mmtok.formats.containers`).

manifest.json is a `ManifestMetadata`: the scan makes its summary (`inputs`, counts, options), `write_manifest`
completes it with what the files give and writes it, and `Manifest.open` reads it back with every key's type
checked (plan, hash and encode take manifests from anyone).

Writing is `write_manifest`; every reader opens the directory with `Manifest.open`, which validates
it and serves the metadata, the fingerprint, the text column, the rows (whole, a batch at a time, or
given rows reading only their row groups) and the skip records.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import pyarrow as pa

from mmtok import __version__
from mmtok.errors import MmtokError
from mmtok.formats import skips
from mmtok.formats.containers import TABLE, TAR, Fields, ShortRead
from mmtok.formats.parquet import write_with_skips
from mmtok.formats.tar import TarRanges
from mmtok.fsutil import (
    atomic_write_json,
    fsync_dir,
    refuse_foreign_output,
    required,
    required_count,
    required_counts,
    required_list,
    sha256_file,
    within,
)

MANIFEST_FILE = "manifest.parquet"
SKIPPED_FILE = "skipped.jsonl"
METADATA_FILE = "manifest.json"
CACHE_DIR = ".scan-cache"  # `mmtok scan`'s cache of scanned shards: only a scan leaves it beside a manifest
FORMAT = "mmtok.manifest"
# 2: each input of manifest.json records its identity (see `container_identity`); 3: skipped.jsonl, in place
# of manifest.json's `shard_errors`. A version-2 manifest is still read (its rows are the same bytes).
FORMAT_VERSION = 3
READ_VERSIONS = (2, 3)
STAGE = "scan"  # the stage of its skip records
IDENTITY_HEAD_BYTES = 8192  # the bytes of a container's identity fingerprint: its first headers (and data)
ROW_GROUP_ROWS = 1 << 18  # fixed, so the file bytes depend only on the rows

SCHEMA = pa.schema([
    ("key", pa.string()),           # sample key (WebDataset: member name up to the first dot)
    ("document", pa.int64()),       # global document id, non-decreasing in row order
    ("image_index", pa.int32()),    # position of the image in its document
    ("tar", pa.string()),           # absolute path of the container file
    ("container", pa.string()),     # "tar", or "parquet" for a table file (Parquet or Arrow IPC)
    ("member", pa.string()),        # member name in the tar; image column name for a table file
    ("offset", pa.int64()),         # byte offset of the member data; row index for a table file
    ("size", pa.int64()),           # bytes
    ("width", pa.int32()),          # as displayed (after EXIF orientation); 0 when unknown
    ("height", pa.int32()),
    ("format", pa.string()),        # jpeg png webp gif bmp tiff; "" when unknown
    ("orientation", pa.int8()),     # EXIF orientation 1-8 (1 when absent); 5-8 swap the sides
    ("text_offset", pa.int64()),    # txt sidecar of the sample (parquet: row index); -1 if none
    ("text_size", pa.int64()),
    ("json_offset", pa.int64()),    # json sidecar of the sample; -1 if none
    ("json_size", pa.int64()),
    ("status", pa.string()),        # "ok" or "error"
    ("reason", pa.string()),        # "" when ok, else a snake_case reason
])
COLUMNS = tuple(SCHEMA.names)


# -- manifest.json ----------------------------------------------------------------------------------------------
# Written by `write_manifest` (`ManifestMetadata.to_json`), read back by `Manifest.open` (`from_json`). Every key
# has been written since version 2 began (da470fa), but version 3's `skipped` and `skipped_sha256` (its
# skipped.jsonl), which replaced version 2's `shard_errors`.
@dataclass(frozen=True)
class ScannedInput:
    """One input file of the scan: as found (`size` -1 when it could not be stat'ed), what it was read as
    (`container`, the manifest's; `file_format`, what `container_of` said), its manifest rows, and its
    `container_identity`, which encode, hash and the curation report check its bytes against."""

    path: str
    size: int
    mtime_ns: int
    container: str
    file_format: str
    rows: int
    identity: dict  # {"size", "mtime_ns", "head"}: the shape `container_identity` returns and `identity_change` takes


@dataclass(frozen=True)
class ScanOptions:
    """The options of a scan that change its rows (part of its cache key): the columns of Parquet/Arrow inputs
    it reads (None: the default)."""

    image_column: str | None = None
    text_column: str | None = None


@dataclass(frozen=True)
class ManifestMetadata:
    """manifest.json. The scan makes the summary (its inputs, counts by reason and format, members it ignored, bytes
    read, options, version); `write_manifest` adds what the files give (rows, sha256s, skip records) and writes it."""

    inputs: list[ScannedInput]
    shards: int
    documents: int
    images_ok: int
    errors: int
    reasons: dict[str, int]
    formats: dict[str, int]
    ignored_members: dict[str, int]
    bytes_read: int
    options: ScanOptions
    scan_version: int
    rows: int = 0
    fingerprint: str = ""  # manifest.parquet's sha256
    skipped: int = 0  # records in skipped.jsonl
    skipped_sha256: str | None = None  # its sha256; None in a version-2 manifest (no skipped.jsonl)
    shard_errors: list | None = None  # a version-2 manifest's shard-level errors (`Manifest.skip_records` reads them)
    format_version: int = FORMAT_VERSION
    tool: str = f"mmtok {__version__}"

    def to_json(self) -> dict:
        record = {**asdict(self), "format": FORMAT}
        if self.shard_errors is None:
            del record["shard_errors"]
        if self.skipped_sha256 is None:
            del record["skipped"], record["skipped_sha256"]
        return record

    @classmethod
    def from_json(cls, document: dict, path: Path) -> ManifestMetadata:
        """The record of a manifest.json whose `format` and `format_version` were checked (`Manifest.open`)."""
        version = required(document, "format_version", int, path)
        options, at_options = required(document, "options", dict, path), within(path, "options")
        return cls(
            inputs=[_scanned_input(entry, within(path, f"inputs[{i}]"))
                    for i, entry in enumerate(required_list(document, "inputs", dict, path))],
            shards=required_count(document, "shards", path), documents=required_count(document, "documents", path),
            images_ok=required_count(document, "images_ok", path), errors=required_count(document, "errors", path),
            reasons=required_counts(document, "reasons", path), formats=required_counts(document, "formats", path),
            ignored_members=required_counts(document, "ignored_members", path),
            bytes_read=required_count(document, "bytes_read", path),
            options=ScanOptions(required(options, "image_column", (str, type(None)), at_options),
                                required(options, "text_column", (str, type(None)), at_options)),
            scan_version=required(document, "scan_version", int, path),
            rows=required_count(document, "rows", path), fingerprint=required(document, "fingerprint", str, path),
            skipped=0 if version == 2 else required_count(document, "skipped", path),
            skipped_sha256=None if version == 2 else required(document, "skipped_sha256", str, path),
            shard_errors=required(document, "shard_errors", list, path) if version == 2 else None,
            format_version=version, tool=required(document, "tool", str, path))


def _scanned_input(entry: dict, path: Path) -> ScannedInput:
    identity = required(entry, "identity", dict, path)
    for key, kind in (("size", int), ("mtime_ns", int), ("head", str)):
        required(identity, key, kind, within(path, "identity"))
    return ScannedInput(path=required(entry, "path", str, path), size=required(entry, "size", int, path),
                        mtime_ns=required(entry, "mtime_ns", int, path),
                        container=required(entry, "container", str, path),
                        file_format=required(entry, "file_format", str, path),
                        rows=required_count(entry, "rows", path), identity=identity)


def has_manifest(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a complete manifest (its manifest.json, written last)."""
    return (Path(directory) / METADATA_FILE).is_file()


def check_output(directory: str | os.PathLike) -> None:
    """Refuse, before anything is written, a directory holding files of the manifest's names that `mmtok scan`
    did not write."""
    refuse_foreign_output(Path(directory), (MANIFEST_FILE, SKIPPED_FILE, METADATA_FILE), (CACHE_DIR,),
                          "mmtok scan", (METADATA_FILE, FORMAT, FORMAT_VERSION, "manifest"))


def write_manifest(directory: str | os.PathLike, tables: Iterable[pa.Table],
                   summary: ManifestMetadata) -> ManifestMetadata:
    """Write the tables (in row order, columns as SCHEMA, plus an optional `detail` column: what went wrong
    in an error row), the skip records of their error rows and manifest.json (`summary` completed with the rows,
    the fingerprint and the skip records' count and sha256); return the metadata written.

    Atomic: the old manifest.json is removed first, manifest.parquet and skipped.jsonl are replaced by
    rename, then manifest.json is written. Row groups hold exactly ROW_GROUP_ROWS rows, so equal rows give equal
    bytes however the tables were cut.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METADATA_FILE).unlink(missing_ok=True)

    def pieces():
        first = 0
        for table in tables:
            yield table.select(COLUMNS).cast(SCHEMA), list(_skip_records(table, first))
            first += table.num_rows

    rows, records, fingerprint, skipped_sha256 = write_with_skips(
        directory / MANIFEST_FILE, directory / SKIPPED_FILE, SCHEMA, ROW_GROUP_ROWS, pieces())
    meta = replace(summary, rows=rows, fingerprint=fingerprint, skipped=records, skipped_sha256=skipped_sha256,
                   shard_errors=None, format_version=FORMAT_VERSION, tool=f"mmtok {__version__}")
    atomic_write_json(directory / METADATA_FILE, meta.to_json())
    fsync_dir(directory)
    return meta


def _skip_records(table: pa.Table, first_row: int) -> Iterator[skips.SkipRecord]:
    """The skip records of the error rows of `table`, whose first row is manifest row `first_row`."""
    import pyarrow.compute as pc

    error = pc.equal(table.column("status"), "error")
    if not pc.any(error).as_py():
        return
    positions = pc.indices_nonzero(error)
    names = ["key", "tar", "container", "member", "reason"] + (["detail"] if "detail" in table.column_names else [])
    picked = table.select(names).take(positions).to_pydict()
    details = picked.get("detail") or [""] * len(positions)
    for index, key, tar, container, member, reason, detail in zip(
            positions.to_pylist(), picked["key"], picked["tar"], picked["container"], picked["member"],
            picked["reason"], details, strict=True):
        yield skips.SkipRecord(key=key, source=tar, container=container, member=member or None,
                               position=first_row + index, reason=reason or "error", detail=detail or "",
                               stage=STAGE)


def _shard_error(entry) -> bool:
    """Whether `entry` of a version-2 manifest.json's `shard_errors` has the fields and types the scan wrote."""
    types = {"path": str, "member": str, "offset": int, "reason": str, "detail": str}
    return isinstance(entry, dict) and all(type(entry.get(name)) is kind for name, kind in types.items())


class Manifest:
    """A complete manifest directory, opened once: its metadata, fingerprint, text column and rows.

    `Manifest.open` is the one place a manifest is validated; every reader (plan, encode, bench,
    inspect) goes through it, so they all refuse the same incomplete or foreign directories.
    """

    def __init__(self, directory: Path, metadata: ManifestMetadata):
        self.directory = directory
        self.metadata = metadata

    @classmethod
    def open(cls, directory: str | os.PathLike) -> Manifest:
        """The manifest in `directory`; MmtokError naming the fix when it is absent, incomplete
        (no manifest.json: the scan did not finish) or not an mmtok manifest of this version."""
        directory = Path(directory)
        path = directory / METADATA_FILE
        try:
            meta = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise MmtokError(f"cannot read manifest {directory}: {METADATA_FILE} not found, so it holds no complete "
                             f"manifest; run `mmtok scan ... --out {directory}`") from None
        except (OSError, ValueError, RecursionError) as err:  # RecursionError: absurdly deep nesting
            what = "nested too deep to parse" if isinstance(err, RecursionError) else err
            raise MmtokError(f"cannot read {path}: {what}; rerun `mmtok scan` into {directory}") from None
        if not isinstance(meta, dict):  # DamagedFile naming the file
            required(meta, "format", str, path)
        if meta.get("format") != FORMAT or meta.get("format_version") not in READ_VERSIONS:
            raise MmtokError(f"{path} is not an mmtok manifest of version {READ_VERSIONS[0]} to {FORMAT_VERSION} "
                             f"(format={meta.get('format')!r}, version={meta.get('format_version')!r}); "
                             "rerun `mmtok scan`")
        if not (directory / MANIFEST_FILE).is_file():
            raise MmtokError(f"cannot read manifest {directory / MANIFEST_FILE}: no such file (though {METADATA_FILE} "
                             f"is there); rerun `mmtok scan` into {directory}")
        return cls(directory, ManifestMetadata.from_json(meta, path))

    @property
    def path(self) -> Path:
        """manifest.parquet."""
        return self.directory / MANIFEST_FILE

    @property
    def fingerprint(self) -> str:
        """The sha256 of manifest.parquet as recorded at scan time (see `verify`)."""
        return self.metadata.fingerprint

    def verify(self) -> str:
        """The fingerprint, after hashing the file: MmtokError when the Parquet changed after the scan."""
        actual = sha256_file(self.path)
        if actual != self.fingerprint:
            raise MmtokError(f"{self.path} changed after the scan (sha256 {actual[:12]}... != recorded "
                             f"{self.fingerprint[:12]}...); rerun `mmtok scan` into {self.directory}")
        return actual

    def identities(self, paths: Iterable[str]) -> dict[str, dict]:
        """The identity the scan recorded (`container_identity`) of each of `paths`, an input of the manifest."""
        recorded = {entry.path: entry.identity for entry in self.metadata.inputs}
        out = {}
        for path in paths:
            if recorded.get(path) is None:
                raise MmtokError(f"{self.directory / METADATA_FILE} records no identity of input {path}; "
                                 f"rerun `mmtok scan` into {self.directory}")
            out[path] = recorded[path]
        return out

    def skip_records(self) -> Iterator[skips.SkipRecord]:
        """One skip record per error row, in row order (stage "scan", `position` the row): skipped.jsonl, after
        checking its bytes against the sha256 manifest.json records; for a version-2 manifest, made from its
        error rows and manifest.json's `shard_errors`."""
        if self.metadata.skipped_sha256 is None:
            return self._version_2_skips()
        return skips.read_recorded(self.directory / SKIPPED_FILE, self.metadata.skipped_sha256,
                                   f"mmtok scan ... --out {self.directory}")

    def _version_2_skips(self) -> Iterator[skips.SkipRecord]:
        import pyarrow.compute as pc

        details = {(e["path"], e["member"], e["offset"], e["reason"]): e["detail"] for e in
                   self.metadata.shard_errors or () if _shard_error(e)}  # others add no detail
        first = 0
        for batch in self.batches(["key", "tar", "container", "member", "offset", "status", "reason"]):
            table = pa.Table.from_batches([batch])
            errors = pc.indices_nonzero(pc.and_(pc.equal(table.column("status"), "error"),
                                                pc.equal(table.column("key"), "")))
            if not len(errors):  # no shard-level row: the records need no detail
                yield from _skip_records(table, first)
                first += table.num_rows
                continue
            found = table.select(["tar", "member", "offset", "reason"]).take(errors).to_pydict()
            detail: list[str | None] = [None] * table.num_rows
            for row, *where in zip(errors.to_pylist(), found["tar"], found["member"], found["offset"],
                                   found["reason"], strict=True):
                detail[row] = details.get(tuple(where), "")
            yield from _skip_records(table.append_column("detail", pa.array(detail, pa.string())), first)
            first += table.num_rows

    @property
    def text_column(self) -> str | None:
        """The caption column of Parquet/Arrow inputs, as the scan recorded it (tars use txt sidecars)."""
        return self.metadata.options.text_column

    @property
    def num_rows(self) -> int:
        """Rows in manifest.parquet."""
        return self._parquet().metadata.num_rows

    def read(self, columns: list[str] | None = None) -> pa.Table:
        """All rows (all columns, or `columns` in that order), memory-mapped."""
        return self._parquet(columns, memory_map=True).read(columns=columns)

    def batches(self, columns: list[str], batch_size: int = ROW_GROUP_ROWS,
                dictionary: Iterable[str] = ()) -> Iterator[pa.RecordBatch]:
        """Every row in row order, `batch_size` rows at a time (by default one row group at a time);
        the `dictionary` columns dictionary-encoded."""
        parquet = self._parquet(columns, read_dictionary=list(dictionary))
        return parquet.iter_batches(batch_size=batch_size, columns=columns)

    def merged_by_dots(self) -> tuple[int, str | None, list[str]]:
        """(documents, first one's key, its first members) of tar samples that hold several images whose names
        continue past the key's first dot (`laion.v2.000001.jpg` + `laion.v2.000002.jpg` = sample `laion`,
        WebDataset's key rule): most often separate samples a producer named with dots. `KEY.jpg` and
        `KEY.N.jpg` (a multi-image document's own naming) are not counted."""
        import pyarrow.compute as pc

        documents: set[int] = set()
        first: tuple[str | None, list[str]] = (None, [])
        for batch in self.batches(["container", "key", "member", "image_index", "document"]):
            later = pc.and_(pc.equal(batch.column("container"), TAR), pc.greater(batch.column("image_index"), 0))
            plain = pc.match_substring_regex(batch.column("member"), r"(^|/)[^/.]*\.([0-9]+\.)?[^/.]*$")
            picked = batch.filter(pc.and_(later, pc.invert(plain)))
            if picked.num_rows and first[0] is None:
                doc = picked.column("document")[0]
                same = batch.filter(pc.equal(batch.column("document"), doc))
                first = (picked.column("key")[0].as_py(), same.column("member").to_pylist()[:4])
            documents.update(picked.column("document").to_pylist())
        return len(documents), first[0], first[1]

    def read_rows(self, rows: np.ndarray, columns: Iterable[str]) -> dict[str, np.ndarray]:
        """The given rows (any order), reading only the row groups that hold them.

        Returns column name -> array aligned with `rows` (strings as object arrays sharing one str
        per distinct value: a rank's millions of rows repeat a few hundred tar paths).
        """
        columns = list(columns)
        rows = np.asarray(rows, np.int64)
        parquet = self._parquet(columns)
        if not rows.size:
            return {c: np.zeros(0, object) for c in columns}
        starts = np.cumsum([0] + [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)])
        if rows.max() >= starts[-1]:
            raise MmtokError(f"{self.path}: row {rows.max()} is asked for but the manifest has {starts[-1]} rows; "
                             "the manifest changed since planning -- re-run `mmtok plan`")
        group_of_row = np.searchsorted(starts, rows, side="right") - 1
        groups = np.unique(group_of_row)
        table = pa.concat_tables([parquet.read_row_group(int(g), columns=columns) for g in groups])
        group_base = np.concatenate([[0], np.cumsum(starts[groups + 1] - starts[groups])])
        local = group_base[np.searchsorted(groups, group_of_row)] + rows - starts[group_of_row]
        taken = table.take(pa.array(local))
        return {name: _numpy(taken.column(name)) for name in columns}

    def _parquet(self, columns: Iterable[str] | None = None, **options):
        """manifest.parquet opened, after checking that it has `columns`."""
        import pyarrow.parquet as pq

        unknown = sorted(set(columns or ()) - set(COLUMNS))
        if unknown:
            raise MmtokError(f"unknown manifest column(s) {unknown}; the manifest has {list(COLUMNS)}")
        try:
            parquet = pq.ParquetFile(self.path)
            missing = [c for c in columns or () if c not in parquet.schema_arrow.names]
            if missing:
                raise MmtokError(f"manifest {self.path} lacks column(s) {missing}; it was not written by `mmtok scan` "
                                 f"(rerun `mmtok scan` into {self.directory})")
            return pq.ParquetFile(self.path, **options) if options else parquet
        except (OSError, pa.ArrowException) as err:
            raise MmtokError(f"cannot read manifest {self.path}: {err}; rerun `mmtok scan` into "
                             f"{self.directory}") from None


def _numpy(column) -> np.ndarray:
    """Numbers as NumPy arrays; strings as object arrays sharing one str per distinct value."""
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
        encoded = column.combine_chunks().dictionary_encode()
        values = np.asarray(encoded.dictionary.to_pylist() + [None], dtype=object)
        return values[encoded.indices.fill_null(len(values) - 1).to_numpy(zero_copy_only=False)]
    return column.to_numpy()


def container_identity(path: str | os.PathLike) -> dict:
    """What the scan saw of an input file, checked again before its bytes are used (encode, sft, merge):
    its size, mtime and the blake2b of its first IDENTITY_HEAD_BYTES (a tar's first headers). A file that was
    re-packed, truncated or replaced has another identity; the scan stays header-only (one small read)."""
    import hashlib
    import stat as stat_mode

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO or device must not block here (nor be read)
    try:
        stat = os.fstat(fd)
        head = os.pread(fd, IDENTITY_HEAD_BYTES, 0) if stat_mode.S_ISREG(stat.st_mode) else b""
    finally:
        os.close(fd)
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "head": hashlib.blake2b(head, digest_size=16).hexdigest()}


def identity_change(path: str, recorded: dict) -> str | None:
    """How the file at `path` differs from its `recorded` identity ("size 10240 -> 20480"), or None; None also
    for a file that is gone (its readers name that: `missing_input`)."""
    try:
        now = container_identity(path)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"unreadable ({err.strerror or err})"
    changed = [f"{key} {recorded.get(key)} -> {now[key]}" for key in now if recorded.get(key) != now[key]]
    return ", ".join(changed) or None


def stale_detail(path: str, change: str) -> str:
    """The detail of a `stale_media` skip (or refusal) of a container: which file, what changed, the fix."""
    return (f"{path} changed since its scan ({change}); its tokens would belong to other bytes -- "
            "re-run `mmtok scan`, `mmtok plan` and `mmtok encode` on it as it is now")


def missing_input(path: str) -> MmtokError:
    return MmtokError(f"{path}: input file listed in the manifest is missing; restore it (or re-run `mmtok scan` "
                      "and `mmtok plan` on the data as it is now)")


class MemberReader:
    """Reads the bytes of manifest rows -- an image, its caption, a tar sample's json sidecar -- through the `Fields`
    of the row's container (`mmtok.formats.containers`): `TarRanges` for tars (one descriptor per file shared by
    every thread, at most `max_open` idle ones open), `TableCells` for table files (a few per thread). Thread-safe.
    A file that is gone is `missing_input`; one that no longer holds the scan's bytes, ShortRead."""

    def __init__(self, max_open: int = 256):
        self._tars = TarRanges(max_open)
        self._fields: dict[str, Fields] = {TAR: self._tars}  # a table file's made when one is first read

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Exactly `size` bytes at `offset` of the tar at `path` (a json sidecar); ShortRead when the file ends
        early."""
        try:
            return self._tars.read(path, offset, size)
        except FileNotFoundError:
            raise missing_input(path) from None

    def read_member(self, container: str, path: str, member: str, offset: int, size: int) -> bytes:
        """An image's bytes: a tar byte range, or a table cell (`member` = column, `offset` = row)."""
        try:
            return self._of(container, path).member(path, member, offset, size)
        except FileNotFoundError:
            raise missing_input(path) from None

    def read_text(self, container: str, path: str, offset: int, size: int, text_column: str | None) -> bytes:
        """A caption's UTF-8 bytes, at most `size` of them: a tar sidecar's byte range, or a table's text column
        at row `offset` (the column is `options.text_column` in manifest.json)."""
        try:
            return self._of(container, path).text(path, offset, size, text_column)
        except FileNotFoundError:
            raise missing_input(path) from None

    def _of(self, container: str, path: str) -> Fields:
        fields = self._fields.get(container)
        if fields is not None:
            return fields
        if container != TABLE:  # (manifest.parquet from a stranger: the scan writes only these two)
            raise ShortRead(f"{path}: container {container!r} in the manifest is none the scan writes "
                            f"({TAR}, {TABLE})")
        from mmtok.formats.tables import TableCells  # (pyarrow's compute: ~40 ms, not paid by a job of tars alone)

        return self._fields.setdefault(TABLE, TableCells())  # (atomic: threads racing here keep one)

    def close(self) -> None:
        """Close every file; one still in use by a read is closed when that read ends."""
        for fields in list(self._fields.values()):  # (a first table read may add one meanwhile)
            fields.close()
