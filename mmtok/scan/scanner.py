"""Scan containers (tar shards, Parquet/Arrow files) into manifest rows, one process per shard.

Per shard the result is a table of rows in container order with shard-local document ids; the process
that claims the shard (a worker, or a rank on any node: `scan_share`) commits it under `OUT/.scan-cache/`
(`mmtok.formats.scan_shards`, keyed by path, size, mtime and the options that change rows) as soon as the
shard is done, so a killed scan resumes without rescanning finished shards and two processes never scan
one shard. The manifest is then assembled in input order with global document ids: the bytes do not
depend on the number of workers or ranks, on the completion order, or on which shards came from the cache.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Iterator

from mmtok.errors import DamagedFile, brief
from mmtok.formats.chat import ConversationError, conversation_media
from mmtok.formats.containers import TAR, container_of, json_value, manifest_container
from mmtok.formats.manifest import CACHE_DIR, ManifestMetadata, ScannedInput, ScanOptions, container_identity
from mmtok.formats.manifest import STAGE as SCAN_STAGE
from mmtok.formats.scan_shards import discard_shard, read_commit, read_rows, remove_shards, write_shard_rows
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import (
    BAD_SIZE,
    BLOCK,
    CORRUPT_HEADER,
    KIND_REASONS,
    NON_UTF8_NAME,
    REGULAR,
    TRUNCATED,
    UNSUPPORTED,
    TarWalker,
    compressed_detail,
)
from mmtok.formats.webdataset import IMAGE_SUFFIXES
from mmtok.fsutil import (
    DUPLICATE_INPUT,
    LockHeld,
    WriterLock,
    required,
    required_count,
    required_counts,
    required_list,
    same_file_as,
    shown_path,
    within,
)
from mmtok.scan.imageheader import HEAD_BYTES, ProbeError, probe_at, sniff

# Bump when rows for the same input change; invalidates caches. 5: GNU sparse and multi-volume members
# are `unsupported_member` (pax sparse ones were rows of garbage bytes), a file given twice is `duplicate_input`.
# 6: a file too short for one tar header is `not_a_tar` saying what it is (was `truncated_tar`, no detail); an
# image cell holding only a path is `path_only_cell` (was `missing_image`).
# 7: a Parquet/Arrow `key` column (img2dataset's) is the sample key (was the row number).
SCAN_VERSION = 7
EXTRA_CAPTION = "(second caption of one sample)"  # an ignored_members entry: the command warns about it
PATH_ONLY_CELL = "path_only_cell"  # an image cell with a file path and no bytes (docs/scan.md says how to embed them)
NON_UTF8_PATH = "non_utf8_path"  # an input path that is not UTF-8 (the tar reader's non_utf8_name, for a file)
# One read at a sample's first header usually holds its small sidecars, the next image's header and
# that image's first HEAD_BYTES: ~1.1 reads and ~7 KB per image on WebDataset shards with captions
# (6 KiB windows needed 1.35 reads, 7 KiB read 7.6 KB; see benchmarks/bench_scan.py).
TAR_WINDOW = 13 * BLOCK
MAX_JSON_BYTES = 1 << 24  # a json sidecar larger than this is not parsed for image order

_IMAGE_SUFFIXES = frozenset(s.encode() for s in IMAGE_SUFFIXES)
_KNOWN_SUFFIXES = _IMAGE_SUFFIXES | {b"txt", b"json"}
_NO_SIDECAR = (-1, -1)

# Rows are tuples in this order inside a shard; `manifest_tables` adds `tar`/`container` and
# makes `document` global.
SHARD_COLUMNS = ("key", "document", "image_index", "member", "offset", "size", "width", "height", "format",
                 "orientation", "status", "reason", "text_offset", "text_size", "json_offset", "json_size")
_NO_SIDECARS = (-1, -1, -1, -1)
_INT32_MAX = (1 << 31) - 1


@dataclass(frozen=True)
class Source:
    """One input file as found before the scan."""

    path: str  # absolute
    size: int  # -1 when it cannot be stat'ed
    mtime_ns: int
    head: str = ""  # the fingerprint of its first bytes (`mmtok.formats.manifest.container_identity`)

    @property
    def identity(self) -> dict:
        """What encode, sft and merge check the file against before using its bytes."""
        return {"size": self.size, "mtime_ns": self.mtime_ns, "head": self.head}


@dataclass(frozen=True)
class ReadTotals:
    """Rows, reads and bytes requested over shards: what a scan costs the storage per image."""

    rows: int = 0
    reads: int = 0
    bytes_read: int = 0

    @classmethod
    def over(cls, stats: list[ShardStats]) -> ReadTotals:
        """The totals of shard statistics."""
        return cls(sum(st.rows for st in stats), sum(st.reads for st in stats), sum(st.bytes_read for st in stats))


@dataclass(frozen=True)
class ScanRun:
    """What one `run_scan` did: shards scanned now and found in the cache (a refused input is neither), the
    rows of the shards it scanned (error rows too), its seconds and workers, and what it read."""

    scanned_shards: int
    cached_shards: int
    rows_scanned: int
    seconds: float
    workers: int
    read: ReadTotals


@dataclass(frozen=True)
class Scanned:
    """What `run_scan` returns: the manifest's metadata (as manifest.json holds it; when nothing was written,
    what it would have said), whether this run wrote the manifest, what the run did, and the first
    shard-level error of each reason (what `no_image_message` shows; every error is in skipped.jsonl)."""

    meta: ManifestMetadata
    written: bool
    run: ScanRun
    first_errors: dict[str, SkipRecord]


@dataclass(frozen=True)
class ScanShare:
    """What one rank of a distributed scan did (`scan_share`): its share of the shards, the shards it scanned
    (its own and those `taken_over` from other ranks), the shards no process has committed yet (`left`), and
    the manifest when this rank wrote it."""

    rank: int
    world_size: int
    shards: int
    own_shards: int
    scanned_shards: int
    taken_over: int
    seconds: float
    workers: int
    read: ReadTotals
    left: int
    manifest: Scanned | None


def describe(path: str) -> Source:
    path = os.path.abspath(path)
    try:
        identity = container_identity(path)
        return Source(path, identity["size"], identity["mtime_ns"], identity["head"])
    except OSError:  # unreadable: its scan says why (`unreadable_shard`)
        pass
    try:
        st = os.stat(path)
        return Source(path, st.st_size, st.st_mtime_ns)
    except OSError:
        return Source(path, -1, 0)


@dataclass(frozen=True)
class ShardError:
    """Damage in an input that belongs to no image (a shard-level error row): its reason, where (the byte offset and
    the member, when there is one), and what the scan saw."""

    reason: str
    offset: int = 0
    member: str = ""
    detail: str = ""

    @classmethod
    def from_json(cls, value: dict, path: str) -> ShardError:
        return cls(required(value, "reason", str, path), required(value, "offset", int, path),
                   required(value, "member", str, path), required(value, "detail", str, path))


@dataclass(frozen=True)
class ShardStats:
    """One input's scan: what it was read as, its rows (ok images by format, error rows by reason), its documents,
    the members it ignored, its shard-level errors and what reading it cost. Committed with its rows in the cache
    (`to_json`, read back by `from_json`); the manifest's summary and document ids are made from these alone.
    `scanned` (this process scanned it now) and `table` (the rows of an input that is not cached, kept in memory
    for the assembly) belong to one run and are never written."""

    file_format: str
    container: str
    rows: int
    images_ok: int
    formats: dict[str, int]
    reasons: dict[str, int]
    documents: int
    ignored: dict[str, int]
    shard_errors: list[ShardError]
    reads: int
    bytes_read: int
    scanned: bool = False
    table: object = field(default=None, compare=False, repr=False)  # a pyarrow Table

    def to_json(self) -> dict:
        record = asdict(self)
        del record["scanned"], record["table"]
        return record

    @classmethod
    def from_json(cls, document: dict, path: Path) -> ShardStats:
        """The stats of a commit whose sha256 matched (this scan's own file): DamagedFile when it is not of this
        shape (a commit of another build of the same SCAN_VERSION), which the caller treats as not committed."""
        errors = [ShardError.from_json(entry, within(path, f"shard_errors[{i}]"))
                  for i, entry in enumerate(required_list(document, "shard_errors", dict, path))]
        return cls(file_format=required(document, "file_format", str, path),
                   container=required(document, "container", str, path), rows=required_count(document, "rows", path),
                   images_ok=required_count(document, "images_ok", path),
                   formats=required_counts(document, "formats", path),
                   reasons=required_counts(document, "reasons", path),
                   documents=required_count(document, "documents", path),
                   ignored=required_counts(document, "ignored", path), shard_errors=errors,
                   reads=required_count(document, "reads", path),
                   bytes_read=required_count(document, "bytes_read", path))


class ShardRows:
    """Rows of one shard under construction, plus what was skipped and why, and what reading it cost (`reads`,
    `bytes_read`; `cacheable` False for an input that could not be read, which every assembly scans again)."""

    def __init__(self) -> None:
        self.rows: list[tuple] = []
        self.documents = 0
        self.ignored: Counter[str] = Counter()
        self.shard_errors: list[ShardError] = []
        self.reads = self.bytes_read = 0
        self.cacheable = True

    def snapshot(self) -> tuple:
        return len(self.rows), self.documents, Counter(self.ignored), len(self.shard_errors)

    def restore(self, snap: tuple) -> None:
        del self.rows[snap[0]:]
        self.documents, self.ignored = snap[1], snap[2]
        del self.shard_errors[snap[3]:]

    def shard_error(self, reason: str, offset: int = 0, member: str = "", detail: str = "") -> None:
        """A row for damage that belongs to no image (its own document), and a note for manifest.json."""
        self.rows.append(("", self.documents, 0, member, offset, 0, 0, 0, "", 1, "error", reason) + _NO_SIDECARS)
        self.documents += 1
        self.shard_errors.append(ShardError(reason, offset, member, detail))


# ------------------------------------------------------------------------------------------ tar


def scan_image_tar(path: str) -> ShardRows:
    """Rows of one tar shard and what reading it cost. Never raises for bad content."""
    out = ShardRows()
    fd = os.open(path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        if file_size == 0:
            out.shard_error("empty_file")
            return out
        # Only headers and image heads are read: kernel read-ahead would fetch the pixels too.
        with contextlib.suppress(OSError):  # advisory; some file systems refuse it
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        walker = TarWalker(fd, file_size, TAR_WINDOW)
        start = 0
        while True:
            snap = out.snapshot()
            _walk(walker, out, start, None)
            if start == 0 and walker.end_reason and walker.end_offset == 0 and _compressed(walker, out, snap):
                break
            bad = walker.bad_offset
            if bad is None:
                if start == 0 and walker.end_offset == 0 and file_size < BLOCK:  # no room for one header
                    out.restore(snap)
                    out.shard_error("not_a_tar", detail=_not_a_tar(walker))
                elif walker.end_reason:
                    out.shard_error(walker.end_reason, walker.end_offset)
                break
            reason, member, detail = walker.end_reason, walker.bad_name, walker.bad_detail
            out.restore(snap)  # members past the bad header were parsed from an unchecked size
            _walk(walker, out, start, bad)
            start = walker.resync(bad)
            if reason == CORRUPT_HEADER and bad == 0 and start is None:
                reason, detail = "not_a_tar", _not_a_tar(walker)
            out.shard_error(reason, bad, member.decode("utf-8", "backslashreplace"), detail)
            if start is None:
                break
        out.reads, out.bytes_read = walker.reads, walker.bytes_read
        return out
    finally:
        os.close(fd)


def _not_a_tar(walker: TarWalker) -> str:
    """What a file without a single valid tar header is, as far as its first bytes tell."""
    head = walker.read(0, 64)
    fmt = sniff(head[:12])
    if fmt:
        return f"a {fmt} image, not a container: pack images into tar shards (WebDataset) and scan those"
    if head.startswith(b"PAR1"):
        return "a Parquet file (give Parquet inputs a .parquet name)"
    text = head.split(b"\n", 1)[0].decode("utf-8", "replace").strip()
    if text and text.isprintable():
        kind = "JSON" if text[:1] in "{[" else "text"
        return f"{kind}, not a tar (it begins {brief(repr(text), 60)}): a file a glob picked up beside the shards?"
    return "no valid tar header anywhere in the file"


def _compressed(walker: TarWalker, out: ShardRows, snap: tuple) -> bool:
    """When the first header is unusable because the file is a compressed stream: its row; True."""
    detail = compressed_detail(walker.read(0, 8))
    if detail is None:
        return False
    out.restore(snap)
    out.shard_error("compressed_tar", detail=f"{detail} and scan the .tar")
    return True


def _walk(walker: TarWalker, out: ShardRows, start: int, stop: int | None) -> None:
    """Group members into samples (consecutive members sharing a key) and append their rows.

    Names stay bytes until a row needs them: the key is the name up to the first dot of its last
    path component (WebDataset's rule), the extension the rest. This loop runs once per member:
    the common cases (an image member whose head lies in the read window, a one-image sample)
    take the shortest path, everything else goes through `_image_entry` and `_add_sample`.
    """
    rows, ignored = out.rows, out.ignored
    key = None
    images: list[tuple] = []
    text = json_sidecar = _NO_SIDECAR
    fetch = walker.read
    for raw, kind, offset, size, window, at in walker.members(start, stop):
        if b"/" in raw:
            dot = raw.find(b".", raw.rfind(b"/") + 1)
            sample, ext = (raw, b"") if dot < 0 else (raw[:dot], raw[dot + 1:])
        else:
            sample, _, ext = raw.partition(b".")
        if sample != key:
            if len(images) == 1:  # `_add_sample`'s first case, inline
                rows.append((key.decode("utf-8", "backslashreplace"), out.documents, 0)
                            + images[0] + text + json_sidecar)
                out.documents += 1
            elif images:
                _add_sample(walker, out, key, images, text, json_sidecar)
            elif key is not None:
                ignored["(sample without image)"] += 1
            key, images, text, json_sidecar = sample, [], _NO_SIDECAR, _NO_SIDECAR
        if ext in _IMAGE_SUFFIXES and kind == REGULAR and size:
            end = at + (size if size < HEAD_BYTES else HEAD_BYTES)
            if end <= len(window):
                images.append(_image_row(raw, offset, size, window, at, end, fetch))
                continue
        suffix = ext if ext in _KNOWN_SUFFIXES else ext[ext.rfind(b".") + 1:].lower()
        if suffix in _IMAGE_SUFFIXES:
            images.append(_image_entry(walker, raw, kind, offset, size))
        elif kind == TRUNCATED or kind == BAD_SIZE or kind == UNSUPPORTED:  # a sidecar too: never silently lost
            out.shard_error(KIND_REASONS[kind], offset, raw.decode("utf-8", "backslashreplace"))
        elif suffix == b"txt" and kind == REGULAR and text[0] < 0:
            text = (offset, size)
        elif suffix == b"txt" and kind == REGULAR:  # one sample, two captions: most often keys with dots
            ignored[EXTRA_CAPTION] += 1
        elif suffix == b"json" and kind == REGULAR and json_sidecar[0] < 0:
            json_sidecar = (offset, size)
        else:
            ignored[suffix.decode("utf-8", "backslashreplace") or "(no extension)"] += 1
    if images:
        _add_sample(walker, out, key, images, text, json_sidecar)
    elif key is not None:
        ignored["(sample without image)"] += 1


def _image_row(raw: bytes, offset: int, size: int, data: bytes, start: int, end: int, fetch) -> tuple:
    """The entry of a regular, non-empty image member whose head is data[start:end] (see _image_entry)."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), offset, size, 0, 0, "", 1, "error", NON_UTF8_NAME
    return _probed(name, offset, size, data, start, end, fetch)


def _probed(name: str, offset: int, size: int, data: bytes, start: int, end: int, fetch) -> tuple:
    """The entry of an image whose first bytes are data[start:end]; `fetch` reads more at `offset`."""
    try:
        fmt, width, height, orientation = probe_at(data, start, end, size, fetch, offset)
    except ProbeError as err:
        return (name, offset, size, min(err.width, _INT32_MAX), min(err.height, _INT32_MAX), err.format,
                err.orientation, "error", err.reason)
    return name, offset, size, width, height, fmt, orientation, "ok", ""


def _image_entry(walker: TarWalker, raw: bytes, kind: int, offset: int, size: int) -> tuple:
    """(member, offset, size, width, height, format, orientation, status, reason) of one image member."""
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("utf-8", "backslashreplace"), offset, size, 0, 0, "", 1, "error", NON_UTF8_NAME
    if kind != REGULAR:
        return name, offset, size, 0, 0, "", 1, "error", KIND_REASONS[kind]
    if size == 0:
        return name, offset, size, 0, 0, "", 1, "error", "zero_size"
    head = walker.head(offset, size if size < HEAD_BYTES else HEAD_BYTES)
    return _image_row(raw, offset, size, head, 0, len(head), walker.read)


def _add_sample(walker: TarWalker, out: ShardRows, raw_key: bytes, images: list[tuple],
                text: tuple[int, int], json_sidecar: tuple[int, int]) -> None:
    """Append a document's rows in container order, with image indices in document order."""
    key = raw_key.decode("utf-8", "backslashreplace")
    doc = out.documents
    out.documents += 1
    sidecars = text + json_sidecar
    if len(images) == 1:
        out.rows.append((key, doc, 0) + images[0] + sidecars)
        return
    names_json = None
    if 0 <= json_sidecar[1] <= MAX_JSON_BYTES:
        names_json = walker.read(json_sidecar[0], json_sidecar[1])
        if len(names_json) != json_sidecar[1]:  # the file ended inside it since its header was read: no order
            names_json = None
    order = document_order([entry[0] for entry in images], key, names_json, out.ignored)
    for entry, index in zip(images, order, strict=True):
        out.rows.append((key, doc, index) + entry + sidecars)


def document_order(members: list[str], key: str, json_bytes: bytes | None, ignored: Counter | None = None) -> list[int]:
    """Image index of each member (given in container order) within its document.

    Order: the position in the json sidecar's `images` list (OBELICS style, nulls skipped), else
    the slot of the image an SFT conversation's `messages` reference by name (content parts, see
    `conversation_media`); an entry names a member by full name, base name or the part after
    `key.`. Members no entry names follow in the numeric N of `key.N.ext`, then by member name;
    container order breaks ties.
    """
    named: dict[str, int] = {}
    if json_bytes is not None:
        sidecar, skip = json_value(json_bytes, "json")  # deep nesting too: one sample's, not the shard's failure
        listed = sidecar.get("images") if isinstance(sidecar, dict) else None
        if skip is not None or not isinstance(sidecar, dict):
            sidecar = None
            if ignored is not None:
                ignored["(unreadable json sidecar)"] += 1
        if isinstance(listed, list):
            entries = list(enumerate(listed))
        elif listed is None and isinstance(sidecar, dict) and "messages" in sidecar:
            entries = _conversation_images(sidecar)
        else:
            entries = []
        for rank, entry in entries:
            if isinstance(entry, str):
                named.setdefault(entry, rank)

    def sort_key(item: tuple[int, str]) -> tuple:
        position, member = item
        base = member[member.rfind("/") + 1:]
        suffix = member[len(key) + 1:] if member.startswith(key + ".") else base
        ranks = [named[n] for n in (member, base, suffix) if n in named]
        if ranks:
            return (0, min(ranks), position)
        number = suffix.split(".", 1)[0]
        if number.isdigit() and "." in suffix:
            return (1, int(number), position)
        return (2, member, position)

    ordered = sorted(enumerate(members), key=sort_key)
    index = [0] * len(members)
    for rank, (position, _member) in enumerate(ordered):
        index[position] = rank
    return index


def _conversation_images(sidecar: dict) -> list[tuple[int, object]]:
    """(slot, reference) of each image an SFT conversation's messages reference, in order; [] for a
    conversation that cannot be read (the document keeps the order without it)."""
    try:
        media = conversation_media(sidecar)
    except ConversationError:
        return []
    return [(ref.slot.index, ref.source) for ref in media if ref.slot.kind == "image"]


# --------------------------------------------------------------------------------- parquet/arrow


def scan_table(path: str, file_format: str, options: ScanOptions) -> ShardRows:
    """Rows of a Parquet/Arrow file: one document per row, `offset` = row index."""
    from mmtok.formats.tables import ColumnError, TableFile, choose_columns, image_values, struct_paths

    out = ShardRows()
    table = TableFile(path, file_format)
    try:
        image, text, key_column = choose_columns(table.schema, options.image_column, options.text_column)
    except ColumnError as err:
        out.shard_error(err.reason, detail=err.detail)
        return out
    columns = [image] + [c for c in (text, key_column) if c]
    row, read = 0, 0
    for batch in table.iter_batches(columns):
        values = image_values(batch.column(0))
        texts = batch.column(text).to_pylist() if text else None
        paths = struct_paths(batch.column(0))
        keys = batch.column(key_column).to_pylist() if key_column else paths
        for i, value in enumerate(values):
            key = keys[i] if keys is not None and keys[i] is not None else str(row)
            text_span = (row, len(texts[i].encode("utf-8"))) if texts is not None and texts[i] is not None else (-1, -1)
            entry = _value_entry(image, row, value, paths is not None and bool(paths[i]))
            read += entry[2]
            out.rows.append((key, out.documents, 0) + entry + text_span + (-1, -1))
            out.documents += 1
            row += 1
    out.reads, out.bytes_read = row, read
    return out


def _value_entry(column: str, row: int, value: bytes | None, has_path: bool = False) -> tuple:
    if value is None:  # a {bytes: null, path} cell: Hugging Face's Dataset.to_parquet() of images from local files
        return column, row, 0, 0, 0, "", 1, "error", PATH_ONLY_CELL if has_path else "missing_image"
    if not value:
        return column, row, 0, 0, 0, "", 1, "error", "zero_size"
    return _probed(column, row, len(value), value, 0, len(value), None)


# ------------------------------------------------------------------------------ one shard, cached


def scan_source(source: Source, options: ScanOptions) -> tuple[ShardRows, str]:
    """Rows of one input and what it was read as (`container_of`); unreadable inputs give a shard-level error row,
    damaged table files too."""
    from pyarrow.lib import ArrowException

    file_format = TAR
    try:
        file_format = container_of(source.path)
        with _gc_paused():
            if file_format == TAR:
                rows = scan_image_tar(source.path)
            else:
                rows = scan_table(source.path, file_format, options)
    except (OSError, ArrowException) as err:  # ArrowException: a table's footer or pages do not parse
        rows = ShardRows()
        rows.cacheable = False
        detail = f"{type(err).__name__}: {err}"
        if isinstance(err, IsADirectoryError):
            detail += f"; pass the shards inside it (e.g. '{source.path}/*.tar'), not the directory"
        rows.shard_error("unreadable_shard", detail=detail)
    return rows, file_format


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Rows are acyclic tuples: cyclic-GC passes over millions of them cost time and free nothing."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def shard_key(source: Source, options: ScanOptions) -> str:
    """The name of an input's result in the cache: what its rows depend on (path, size, mtime, options)."""
    ident = json.dumps([SCAN_VERSION, source.path, source.size, source.mtime_ns,
                        options.image_column, options.text_column])
    return hashlib.sha256(ident.encode()).hexdigest()[:32]


def rows_cache_path(out_dir: Path, source: Source, options: ScanOptions) -> Path:
    """The rows of an input's committed result (`mmtok.formats.scan_shards`)."""
    return out_dir / CACHE_DIR / (shard_key(source, options) + ".arrow")


def shard_table(rows: ShardRows):
    """ShardRows as an Arrow table (SHARD_COLUMNS), built column-wise from the row tuples."""
    import pyarrow as pa

    from mmtok.formats.manifest import SCHEMA

    columns = list(zip(*rows.rows, strict=True)) if rows.rows else [()] * len(SHARD_COLUMNS)
    return pa.table({name: pa.array(values, SCHEMA.field(name).type)
                     for name, values in zip(SHARD_COLUMNS, columns, strict=True)})


def scan_to_cache(source: Source, options: ScanOptions, out_dir: str) -> ShardStats:
    """Scan one input and commit its rows and statistics to the cache; return the statistics. An input that
    could not be read is committed marked `retry` (done for the ranks; every assembly scans it again) and
    keeps its rows as `table` too."""
    rows, file_format = scan_source(source, options)
    table = shard_table(rows)
    stats = shard_stats(rows, table, file_format)
    write_shard_rows(rows_cache_path(Path(out_dir), source, options), table, stats.to_json(), not rows.cacheable)
    return stats if rows.cacheable else replace(stats, table=table)


def shard_stats(rows: ShardRows, table, file_format: str) -> ShardStats:
    """The statistics of one input's rows (`table`, vectorized over it: ok images by format, error rows by
    reason) read as `file_format`."""
    import pyarrow.compute as pc

    ok = pc.equal(table.column("status"), "ok")
    formats = {d["values"]: d["counts"] for d in pc.value_counts(table.column("format").filter(ok)).to_pylist()}
    reasons = {d["values"]: d["counts"]
               for d in pc.value_counts(table.column("reason").filter(pc.invert(ok))).to_pylist()}
    return ShardStats(file_format=file_format, container=manifest_container(file_format), rows=table.num_rows,
                      images_ok=sum(formats.values()), formats=formats, reasons=reasons, documents=rows.documents,
                      ignored=dict(rows.ignored), shard_errors=list(rows.shard_errors), reads=rows.reads,
                      bytes_read=rows.bytes_read)


# ----------------------------------------------------------------------------------- the whole run
def split_sidecars(paths: list[str]) -> tuple[list[str], list[str]]:
    """(the inputs to scan, the producers' sidecar files among them, which are skipped and counted): what
    img2dataset writes beside each shard -- `NNNNN_stats.json`, and `NNNNN.parquet` (its samples' metadata,
    no image) beside `NNNNN.tar` -- which a shell glob such as `out/*` picks up."""
    tars = {os.path.splitext(path)[0] for path in paths if path.endswith(".tar")}
    sidecars = [path for path in paths if path.endswith("_stats.json")
                or (path.endswith(".parquet") and os.path.splitext(path)[0] in tars)]
    skipped = set(sidecars)
    return [path for path in paths if path not in skipped], sidecars




def run_scan(sources: list[Source], out_dir: Path, options: ScanOptions, workers: int,
             progress: bool = True) -> Scanned:
    """Scan every source not committed yet (waiting for shards that other processes are scanning) and write
    the manifest; return its metadata and what the run did.

    A scan that finds no usable image fails (the command says why); into an OUT that holds a complete
    manifest it writes nothing (`written` False in what it returns), so that manifest and its cache stay as
    they were; elsewhere it writes the manifest of error rows, to be looked at. One process at a time writes
    the manifest of an OUT (its `.lock`; another is refused with `LockHeld`)."""
    from mmtok.formats.manifest import check_output, has_manifest, write_manifest

    check_output(out_dir)
    (out_dir / CACHE_DIR).mkdir(parents=True, exist_ok=True)
    with WriterLock(out_dir, f"the manifest in {out_dir}"):
        sources, refused = _inputs(sources)
        stats: list[ShardStats | None] = [None] * len(sources)
        for i, source in enumerate(sources):
            if i not in refused:
                committed = _committed(rows_cache_path(out_dir, source, options), verify=True)
                stats[i] = None if committed is None or committed[1] else committed[0]
        todo = [i for i, s in enumerate(stats) if s is None and i not in refused]
        began = time.perf_counter()
        for i, result in _scan_all(todo, sources, options, out_dir, workers, True, progress, len(sources)):
            stats[i] = result
        scanned = [i for i in todo if stats[i].scanned]  # the others were committed by a rank meanwhile
        for i, (reason, detail, like) in refused.items():
            stats[i] = _error_stats(reason, detail, None if like is None else stats[like])
        run = ScanRun(scanned_shards=len(scanned), cached_shards=len(sources) - len(scanned) - len(refused),
                      rows_scanned=sum(stats[i].rows for i in scanned), seconds=time.perf_counter() - began,
                      workers=workers, read=ReadTotals.over(stats))
        summary, first = summarize(sources, stats, options), first_errors(sources, stats)
        if not summary.images_ok and has_manifest(out_dir):
            for i in scanned:  # the cache stays as it was too: no mark of a mistyped input is left
                if stats[i].table is not None:
                    discard_shard(rows_cache_path(out_dir, sources[i], options))
            return Scanned(summary, False, run, first)
        meta = write_manifest(out_dir, manifest_tables(sources, stats, out_dir, options), summary)
        remove_shards(out_dir / CACHE_DIR, {shard_key(s, options) for s in sources})
    return Scanned(meta, True, run, first)


def scan_share(sources: list[Source], out_dir: Path, options: ScanOptions, rank: int, world_size: int,
               workers: int, progress: bool = True) -> ScanShare:
    """Rank `rank` of `world_size`: scan this rank's share of the sources (`ranks.assign_shards` by bytes),
    then, from the far end, every source no other process has claimed yet (a slow or dead rank's); when
    every source is then committed, write the manifest (`run_scan`: the same bytes as one process's scan).
    Returns what this rank scanned and, under `manifest`, the manifest when it wrote it."""
    from mmtok.formats.manifest import check_output
    from mmtok.ranks import assign_shards

    check_output(out_dir)
    (out_dir / CACHE_DIR).mkdir(parents=True, exist_ok=True)
    shown, refused = _inputs(sources)
    eligible = [i for i in range(len(shown)) if i not in refused]
    own = [eligible[j] for j in assign_shards([max(shown[i].size, 0) for i in eligible], world_size)[rank]]
    mine = set(own)
    others = [i for i in reversed(eligible) if i not in mine]  # from the far end: their owners start at the front

    def committed(i: int) -> bool:
        return _committed(rows_cache_path(out_dir, shown[i], options), verify=False) is not None

    todo = [i for i in own + others if not committed(i)]
    began = time.perf_counter()
    scanned = {i: st for i, st in _scan_all(todo, shown, options, out_dir, workers, False, progress, len(todo))
               if st is not None and st.scanned}
    seconds = time.perf_counter() - began
    left = sum(not committed(i) for i in eligible)
    manifest = None
    if not left:
        try:
            manifest = run_scan(sources, out_dir, options, workers, progress=False)
        except LockHeld:  # the other rank that finished last writes the same bytes
            pass
    return ScanShare(rank=rank, world_size=world_size, shards=len(shown), own_shards=len(own),
                     scanned_shards=len(scanned), taken_over=len(scanned.keys() - mine),
                     seconds=seconds, workers=workers,
                     read=ReadTotals.over(list(scanned.values())), left=left, manifest=manifest)


def _inputs(sources: list[Source]) -> tuple[list[Source], dict[int, tuple[str, str, int | None]]]:
    """The sources as the manifest names them, and the refused ones (`_refused_inputs`)."""
    refused = _refused_inputs(sources)
    return [replace(s, path=shown_path(s.path)) for s in sources], refused


def _scan_all(todo: list[int], sources: list[Source], options: ScanOptions, out_dir: Path, workers: int,
              final: bool, progress: bool, total: int) -> Iterator[tuple[int, ShardStats | None]]:
    """`_run` behind a progress bar of `total` shards (those not in `todo` are done)."""
    from mmtok.progress import progress as progress_bar

    bar = progress_bar(total=total, initial=total - len(todo), unit="shard", desc="scan", enabled=progress)
    images = 0
    for i, result in _run(todo, sources, options, out_dir, workers, final):
        images += result.rows if result is not None else 0
        bar.update(1)
        bar.set_postfix(images=images, refresh=False)
        yield i, result
    bar.close()


def _refused_inputs(sources: list[Source]) -> dict[int, tuple[str, str, int | None]]:
    """The inputs that are not scanned, each one shard-level row: (reason, detail, the input whose container
    kind it has). A path that is not UTF-8 cannot be a manifest's `tar` (readers open that path); a file
    reached by a second path is read once."""
    refused: dict[int, tuple[str, str, int | None]] = {}
    for i, source in enumerate(sources):
        if shown_path(source.path) != source.path:
            refused[i] = (NON_UTF8_PATH, f"the path {shown_path(source.path)} is not UTF-8; the manifest names "
                          "inputs by UTF-8 paths: rename it (e.g. `convmv`)", None)
    earlier = same_file_as("" if i in refused else s.path for i, s in enumerate(sources))  # "": never a file
    for i, first in enumerate(earlier):
        if first is not None:
            refused[i] = (DUPLICATE_INPUT, f"the same file as {sources[first].path} (one device and inode: a "
                          "link or a mount); its rows are that input's", first)
    return dict(sorted(refused.items()))


def _run(todo: list[int], sources: list[Source], options: ScanOptions, out_dir: Path, workers: int,
         final: bool) -> Iterator[tuple[int, ShardStats | None]]:
    """Claim and scan the shards `todo` (`_claimed`), yielding (index, stats or None) as they finish; a
    crashed worker becomes an error row."""
    if workers <= 1 or len(todo) <= 1:
        for i in todo:
            yield i, _claimed(sources[i], options, str(out_dir), final)
        return
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(max_workers=min(workers, len(todo))) as pool:
        futures = {pool.submit(_claimed, sources[i], options, str(out_dir), final): i for i in todo}
        for future in as_completed(futures):
            try:
                result = future.result()
            except OSError:  # the output cannot be written (see _guarded): the queued shards would fail alike
                pool.shutdown(cancel_futures=True)
                raise
            except Exception as err:  # the worker process died (e.g. killed for memory)
                result = replace(_error_stats("scan_failed", f"{type(err).__name__}: {err}"), scanned=True)
            yield futures[future], result


def _claimed(source: Source, options: ScanOptions, out_dir: str, final: bool) -> ShardStats | None:
    """Scan one input under its claim and commit it (`scanned` True in the stats it returns); the committed
    stats (`scanned` False) when another process committed it first; None when another process holds the
    claim, unless `final`: the final assembly waits for it, checks the rows' sha256 and rescans an input
    that could not be read."""
    cache = Path(out_dir) / CACHE_DIR
    key = shard_key(source, options)
    try:
        # A POSIX record lock (`WriterLock`): the kernel, or a shared file system's lock manager, drops it
        # when its holder dies, SIGKILL included and on any host, so a killed rank's claim is free for the
        # rerun at once. Nothing probes a pid (a pid from another host means nothing here).
        claim = WriterLock(cache, f"shard {source.path}", name=key + ".lock", wait=final)
    except LockHeld:
        return None
    with claim:
        committed = _committed(rows_cache_path(Path(out_dir), source, options), verify=final)
        if committed is not None and not (final and committed[1]):
            return committed[0]
        for stale in cache.glob(f".{key}.*.tmp-*"):  # a killed holder's unfinished writes
            stale.unlink(missing_ok=True)
        return replace(_guarded(source, options, out_dir), scanned=True)


def _committed(rows_path: Path, verify: bool) -> tuple[ShardStats, bool] | None:
    """(stats, retry) of an input's commit in the cache (`read_commit`), or None when it is not committed --
    also when its stats are not of this build's shape: the input is then scanned again."""
    record = read_commit(rows_path, verify)
    if record is None:
        return None
    try:
        return ShardStats.from_json(record["stats"], rows_path), record["retry"] is True
    except DamagedFile:
        return None


def _guarded(source: Source, options: ScanOptions, out_dir: str) -> ShardStats:
    try:
        return scan_to_cache(source, options, out_dir)
    except OSError:  # input errors are rows already (scan_source): this one is the output's, e.g. a full disk
        raise
    except Exception as err:  # a bug must cost one shard, not the run; the row names it
        return _error_stats("scan_failed", f"{type(err).__name__}: {err}")


def _error_stats(reason: str, detail: str, like: ShardStats | None = None) -> ShardStats:
    """The statistics of an input that is one shard-level error row (not cached); its container and file
    format are those of `like` (the input it repeats), else a tar's."""
    rows = ShardRows()
    rows.shard_error(reason, detail=detail)
    table = shard_table(rows)
    return replace(shard_stats(rows, table, like.file_format if like else TAR), table=table)


def manifest_tables(sources: list[Source], stats: list[ShardStats], out_dir: Path, options: ScanOptions):
    """Shard tables in input order with `tar`, `container`, global document ids and the `detail` of each
    shard-level error row (`write_manifest` writes it into the row's skip record)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    first_document = 0
    for source, st in zip(sources, stats, strict=True):
        table = st.table
        if table is None:
            table = read_rows(rows_cache_path(out_dir, source, options))
        n = table.num_rows
        table = table.set_column(table.schema.get_field_index("document"), "document",
                                 pc.add(table.column("document"), pa.scalar(first_document, pa.int64())))
        table = table.append_column("tar", pa.array([source.path] * n, pa.string()))
        table = table.append_column("container", pa.array([st.container] * n, pa.string()))
        table = table.append_column("detail", _details(table, st.shard_errors))
        first_document += st.documents
        yield table.replace_schema_metadata(None)


def _details(table, shard_errors: list[ShardError]):
    """The detail of each row of one shard's table, a string column: that of its shard-level error
    (`ShardRows.shard_error`: a row with no key; they are in the order of `shard_errors`), null for every other
    row. Only rows without a key become Python values (a shard may hold 10^5 rows)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not shard_errors:
        return pa.nulls(table.num_rows, pa.string())
    keyless = pc.indices_nonzero(pc.equal(table.column("key"), ""))
    where = table.select(["member", "offset", "reason"]).take(keyless).to_pydict()
    details: list[str | None] = [None] * table.num_rows
    pending = iter(shard_errors)
    wanted = next(pending, None)
    for row, *found in zip(keyless.to_pylist(), where["member"], where["offset"], where["reason"], strict=True):
        if wanted is not None and tuple(found) == (wanted.member, wanted.offset, wanted.reason):
            details[row], wanted = wanted.detail, next(pending, None)
    return pa.array(details, pa.string())


def first_errors(sources: list[Source], stats: list[ShardStats]) -> dict[str, SkipRecord]:
    """The first shard-level error of each reason, as its skip record (no position: the manifest may not be
    written)."""
    first: dict[str, SkipRecord] = {}
    for source, st in zip(sources, stats, strict=True):
        for err in st.shard_errors:
            if err.reason not in first:
                first[err.reason] = SkipRecord(key="", source=source.path, container=st.container,
                                               member=err.member or None, reason=err.reason, detail=err.detail,
                                               stage=SCAN_STAGE)
    return first


def summarize(sources: list[Source], stats: list[ShardStats], options: ScanOptions) -> ManifestMetadata:
    """The deterministic part of manifest.json: inputs, counts by reason and format, skipped members."""
    reasons, formats, ignored = Counter(), Counter(), Counter()
    inputs = []
    for source, st in zip(sources, stats, strict=True):
        reasons.update(st.reasons)
        formats.update(st.formats)
        ignored.update(st.ignored)
        inputs.append(ScannedInput(path=source.path, size=source.size, mtime_ns=source.mtime_ns,
                                   container=st.container, file_format=st.file_format, rows=st.rows,
                                   identity=source.identity))
    return ManifestMetadata(
        inputs=inputs,
        shards=len(sources),
        documents=sum(st.documents for st in stats),
        images_ok=sum(st.images_ok for st in stats),
        errors=sum(reasons.values()),
        reasons=dict(sorted(reasons.items())),
        formats=dict(sorted(formats.items())),
        ignored_members=dict(sorted(ignored.items())),
        bytes_read=sum(st.bytes_read for st in stats),
        options=options,
        scan_version=SCAN_VERSION,
    )
