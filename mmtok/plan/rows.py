"""Stage 1 of the plan: read the manifest columns it needs, filter rows, compute target shapes.

The manifest is read twice: once for the window bounds (the document column), then group by group
(`read_groups`), so only about one group of rows is in memory. Per row of a group the plan keeps a
drop-reason code (0 = kept) and the packed target shape
`(h/f) << SHAPE_BITS | (w/f)` from `mmtok.media.resize.target_shapes`, the one resize rule. The packed
value sorts like (height, width) and indexes a lookup table, so later stages never search per row.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa

from mmtok.errors import MmtokError
from mmtok.formats.manifest import Manifest
from mmtok.formats.plan import SCAN_REASON
from mmtok.formats.presets import PlanParameters
from mmtok.media.resize import target_shapes
from mmtok.plan.captions import CAPTION_REASONS
from mmtok.text import TextTokenizer, load_text_tokenizer
from mmtok.vocab import VocabLayout

BASE_COLUMNS = ("document", "image_index", "width", "height", "status", "reason")
CAPTION_COLUMNS = ("tar", "container", "text_offset", "text_size")
READ_ROWS = 1 << 18
FILTER_ROWS = 1 << 16  # the filter's temporaries stay in cache (fresh large arrays cost page faults)
SHAPE_BITS = 12  # target sides up to 4,095 codes (65,520 px at factor 16); beyond: `target_too_large`


DUPLICATE = "duplicate"  # a row a duplicate list (`mmtok dedup`, `plan --exclude`) drops: its keeper is kept
CONTAMINATED = "contaminated"  # a row the list drops as a benchmark image's match (`mmtok dedup --against`)
CAPTION_FLAGGED = "caption_flagged"  # a row the list drops for its caption (`mmtok.curate.captions`)
EXCLUDED = (DUPLICATE, CONTAMINATED, CAPTION_FLAGGED)  # the reason of a listed row, by its kind (0, 1, 2)


class Reasons:
    """Drop-reason names <-> codes (0 = kept). Scan failures appear as `scan:<reason>`."""

    FIXED = ("", "document_member_dropped", "unknown_dimensions", "too_few_pixels", "too_many_pixels",
             "aspect_ratio", "target_too_large", *CAPTION_REASONS)

    def __init__(self) -> None:
        self.names: list[str] = list(self.FIXED)
        self._codes = {name: i for i, name in enumerate(self.names)}

    def registered(self, *names: str) -> list[int]:
        """The codes of those of `names` that rows were dropped for (registering none: the codes of a plan depend
        only on the reasons it met)."""
        return [self._codes[name] for name in names if name in self._codes]

    def code(self, name: str) -> int:
        if name not in self._codes:
            if len(self.names) > np.iinfo(np.uint16).max:
                raise MmtokError(f"more than {len(self.names)} distinct drop reasons in the manifest")
            self._codes[name] = len(self.names)
            self.names.append(name)
        return self._codes[name]


@dataclass
class ManifestRows:
    """The per-row arrays of one processing group: 18 bytes a row (38 in caption modes). Row 0 is manifest
    row `start`; the plan holds one group at a time, so its memory does not grow with the manifest."""

    start: int
    document: np.ndarray  # int64
    image_index: np.ndarray  # int32
    reason: np.ndarray  # uint16 drop-reason code, 0 = kept so far
    shape: np.ndarray  # uint32 packed target shape, 0 where dropped
    new_shapes: np.ndarray  # sorted packed shapes of kept rows first seen in this group (the shape table grows)
    container: np.ndarray | None = None  # int32 index into `containers` (caption modes only)
    containers: list[tuple[str, str]] | None = None  # (path, container kind); grows as groups are read
    text_offset: np.ndarray | None = None
    text_size: np.ndarray | None = None

    ARRAYS = ("document", "image_index", "reason", "shape", "container", "text_offset", "text_size")

    def __len__(self) -> int:
        return len(self.document)

    @classmethod
    def concat(cls, pieces: list["ManifestRows"]) -> "ManifestRows":
        if len(pieces) == 1:
            return pieces[0]
        joined = {k: None if getattr(pieces[0], k) is None else np.concatenate([getattr(p, k) for p in pieces])
                  for k in cls.ARRAYS}
        return cls(start=pieces[0].start, new_shapes=np.zeros(0, np.uint32), containers=pieces[0].containers,
                   **joined)

    def head(self, n: int, new_shapes: np.ndarray) -> tuple["ManifestRows", "ManifestRows"]:
        """(the first n rows, with `new_shapes`; the rest)."""
        def part(cut: slice, start: int, shapes: np.ndarray) -> ManifestRows:
            arrays = {k: None if getattr(self, k) is None else getattr(self, k)[cut] for k in self.ARRAYS}
            return ManifestRows(start=start, new_shapes=shapes, containers=self.containers, **arrays)
        return part(slice(0, n), self.start, new_shapes), part(slice(n, None), self.start + n, np.zeros(0, np.uint32))


@dataclass(frozen=True)
class ShapeTable:
    """Per unique target shape, sorted by (height, width): exact block tokens, batch capacity, cost."""

    packed: np.ndarray
    height: np.ndarray  # int32 pixels
    width: np.ndarray
    tokens: np.ndarray  # int32 exact image-block length
    capacity: np.ndarray  # int64 images per batch
    image_cost: np.ndarray
    lookup: np.ndarray  # packed shape -> index; zero-filled lazily, only used entries are touched

    @classmethod
    def build(cls, packed: np.ndarray, params: PlanParameters, tokenizer: TextTokenizer) -> "ShapeTable":
        hc, wc = unpack(packed)
        # The dimension digits "H*W" are text tokens: tokenised once per unique shape.
        dims = tokenizer.encode_many([f"{h}*{w}" for h, w in zip(hc.tolist(), wc.tolist(), strict=True)])
        tokens = VocabLayout.image_block_length(hc, wc, np.array([len(d) for d in dims], np.int64))
        height, width = hc * params.factor, wc * params.factor
        lookup = np.zeros(1 << (2 * SHAPE_BITS), np.uint16 if len(packed) <= (1 << 16) else np.uint32)
        lookup[packed] = np.arange(len(packed))
        return cls(packed=packed, height=height.astype(np.int32), width=width.astype(np.int32),
                   tokens=tokens.astype(np.int32), lookup=lookup,
                   capacity=np.clip(params.token_budget // np.maximum(tokens, 1), 1, params.max_batch_images),
                   image_cost=params.cost_model.image_cost(height, width))

    def index(self, packed: np.ndarray) -> np.ndarray:
        """Shape index of packed shapes (uint16 when there are at most 65,536 shapes: radix sorts)."""
        return self.lookup[packed]


def unpack(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(height, width) in codes of packed shapes."""
    packed = packed.astype(np.int64)
    return packed >> SHAPE_BITS, packed & ((1 << SHAPE_BITS) - 1)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec: str, stamp: tuple | None) -> TextTokenizer:
    return load_text_tokenizer(spec)


def text_tokenizer(spec: str) -> TextTokenizer:
    """The tokenizer for `spec`, loaded once per process (re-loaded when its file changes)."""
    path = Path(spec)
    stamp = (path.stat().st_mtime_ns, path.stat().st_size) if path.exists() else None
    return _cached_tokenizer(spec, stamp)


def _column(batch: pa.RecordBatch, name: str, dtype, path: Path, row0: int) -> np.ndarray:
    column = batch.column(name)
    if column.null_count:
        raise MmtokError(f"{path}: column {name!r} has nulls in rows {row0}..{row0 + batch.num_rows - 1}; "
                         "the manifest contract has none (re-run `mmtok scan`)")
    return column.to_numpy(zero_copy_only=False).astype(dtype, copy=False)


def _labels(batch: pa.RecordBatch, name: str) -> tuple[np.ndarray, list[str]]:
    """(codes, labels) of a string column, read dictionary-encoded."""
    column = batch.column(name)
    if not pa.types.is_dictionary(column.type):
        column = column.dictionary_encode()
    return column.indices.to_numpy(zero_copy_only=False).astype(np.int32, copy=False), column.dictionary.to_pylist()


def _scan_codes(batch: pa.RecordBatch, reasons: Reasons) -> np.ndarray:
    """0 for status 'ok', else the code of `scan:<reason>`."""
    status, status_labels = _labels(batch, "status")
    if status_labels == ["ok"]:
        return np.zeros(batch.num_rows, np.uint16)
    reason, reason_labels = _labels(batch, "reason")
    ok = np.array([label == "ok" for label in status_labels], bool)
    scan = np.array([reasons.code(f"{SCAN_REASON}{label or 'error'}") for label in reason_labels], np.uint16)
    return np.where(ok[status], np.uint16(0), scan[reason] if len(scan) else np.uint16(0)).astype(np.uint16)


def filter_rows(width: np.ndarray, height: np.ndarray, scan_code: np.ndarray, params: PlanParameters,
                reasons: Reasons) -> tuple[np.ndarray, np.ndarray]:
    """Row-level filters and target shapes -> (reason uint16, packed target shape uint32).

    A row failing several filters gets the first reason of: scan error, unknown_dimensions,
    too_few_pixels, too_many_pixels, aspect_ratio (assigned in reverse, so the first one wins).
    """
    W, H = width.astype(np.int64), height.astype(np.int64)
    pixels = W * H
    reason = np.zeros(len(W), np.uint16)
    if params.max_aspect_ratio is not None:
        reason[np.maximum(W, H) > params.max_aspect_ratio * np.minimum(W, H)] = reasons.code("aspect_ratio")
    reason[pixels > params.max_source_pixels] = reasons.code("too_many_pixels")
    reason[pixels < params.min_source_pixels] = reasons.code("too_few_pixels")
    reason[(W <= 0) | (H <= 0)] = reasons.code("unknown_dimensions")
    reason = np.where(scan_code != 0, scan_code, reason)
    kept = np.flatnonzero(reason == 0)
    h, w = target_shapes(H[kept], W[kept], min_pixels=params.min_pixels, max_pixels=params.max_pixels,
                         factor=params.factor)
    hc, wc = h // params.factor, w // params.factor
    too_large = (hc >> SHAPE_BITS) | (wc >> SHAPE_BITS) != 0
    shape = np.zeros(len(reason), np.uint32)
    shape[kept] = (hc << SHAPE_BITS | wc).astype(np.uint32)
    if too_large.any():
        reason[kept[too_large]] = reasons.code("target_too_large")
        shape[kept[too_large]] = 0
    return reason, shape


class _Containers:
    """(path, kind) of caption containers <-> dense codes, across record batches."""

    def __init__(self) -> None:
        self.codes: dict[tuple[str, str], int] = {}
        self.names: list[tuple[str, str]] = []  # by code; shared with every ManifestRows read

    def encode(self, batch: pa.RecordBatch) -> np.ndarray:
        paths, path_labels = _labels(batch, "tar")
        kinds, kind_labels = _labels(batch, "container")
        n_kinds = max(len(kind_labels), 1)
        unique, inverse = np.unique(paths.astype(np.int64) * n_kinds + kinds, return_inverse=True)  # caption modes only
        codes = [self._code((path_labels[p // n_kinds], kind_labels[p % n_kinds])) for p in unique.tolist()]
        return np.asarray(codes, np.int32)[inverse.ravel()] if codes else np.zeros(0, np.int32)

    def _code(self, name: tuple[str, str]) -> int:
        if name not in self.codes:
            self.codes[name] = len(self.names)
            self.names.append(name)
        return self.codes[name]


def window_bounds(manifest: Manifest, window_rows: int, progress: bool = True) -> np.ndarray:
    """Window start rows, then the row count: multiples of window_rows moved forward to the next document
    start, duplicates merged (a document longer than a window makes one longer window). One pass over the
    document column, READ_ROWS rows at a time, which also checks the document order."""
    from mmtok.progress import progress as progress_bar

    n, path = manifest.num_rows, manifest.path
    candidates = np.arange(window_rows, n, window_rows, dtype=np.int64)
    found = np.full(len(candidates), n, np.int64)  # the first document start at or after each candidate
    start, previous, todo = 0, None, 0  # candidates[todo:] are not found yet
    with progress_bar(total=n, desc="plan: windows", unit="row", unit_scale=True, enabled=progress) as bar:
        for batch in manifest.batches(["document"], READ_ROWS):
            document = _column(batch, "document", np.int64, path, start)
            _check_document_order(document, previous, path, start)
            change = np.empty(len(document), bool)
            change[:1] = previous is None or (len(document) > 0 and document[0] != previous)
            np.not_equal(document[1:], document[:-1], out=change[1:])
            doc_starts = start + np.flatnonzero(change)
            at = np.searchsorted(doc_starts, candidates[todo:])
            hit = at < len(doc_starts)  # a candidate's start is in this batch or a later one: hits are a prefix
            found[todo:todo + int(hit.sum())] = doc_starts[at[hit]]
            todo += int(hit.sum())
            previous = document[-1] if len(document) else previous
            start += batch.num_rows
            bar.update(batch.num_rows)
    return np.unique(np.concatenate([[0], found, [n]]).astype(np.int64)) if n else np.zeros(1, np.int64)


def read_groups(manifest: Manifest, params: PlanParameters, reasons: Reasons,
                cuts: np.ndarray, excluded: tuple[np.ndarray, np.ndarray] | None = None) -> Iterator[ManifestRows]:
    """Stage 1 over the manifest, READ_ROWS rows at a time: the filtered rows of each group
    [cuts[i], cuts[i + 1]), in order; only the rows of about one group are held at a time. The sorted manifest
    rows `excluded` (a duplicate list's: rows, and aligned the kind of each, an index into EXCLUDED) are dropped
    as DUPLICATE, CONTAMINATED or CAPTION_FLAGGED, whatever else holds for them."""
    path = manifest.path
    columns = list(BASE_COLUMNS) + (list(CAPTION_COLUMNS) if params.counts_captions else [])
    batches = manifest.batches(columns, READ_ROWS, dictionary=[c for c in ("status", "reason", "tar", "container")
                                                               if c in columns])
    containers = _Containers()
    seen = np.zeros(1 << (2 * SHAPE_BITS), bool)
    pending: list[ManifestRows] = []  # read, not yet yielded
    have, g = 0, 0
    for batch in batches:
        pending.append(_filter_batch(batch, cuts[g] + have, params, reasons, containers, path, excluded))
        have += batch.num_rows
        while g + 1 < len(cuts) and cuts[g + 1] - cuts[g] <= have:
            size = int(cuts[g + 1] - cuts[g])
            rows = ManifestRows.concat(pending)
            kept_shapes = rows.shape[:size][rows.reason[:size] == 0]
            new = np.unique(kept_shapes[~seen[kept_shapes]])
            seen[new] = True
            group, rest = rows.head(size, new)
            yield group
            pending, have, g = ([rest] if len(rest) else []), have - size, g + 1


def _filter_batch(batch: pa.RecordBatch, start: int, params: PlanParameters, reasons: Reasons,
                  containers: "_Containers", path: Path, excluded: tuple[np.ndarray, np.ndarray] | None
                  ) -> ManifestRows:
    """One record batch (manifest rows from `start`) read and filtered."""
    n = batch.num_rows
    rows = ManifestRows(start=start, document=_column(batch, "document", np.int64, path, start),
                        image_index=_column(batch, "image_index", np.int32, path, start),
                        reason=np.empty(n, np.uint16), shape=np.empty(n, np.uint32),
                        new_shapes=np.zeros(0, np.uint32), containers=containers.names)
    width = _column(batch, "width", np.int32, path, start)
    height = _column(batch, "height", np.int32, path, start)
    scan = _scan_codes(batch, reasons)
    for a in range(0, n, FILTER_ROWS):
        b = min(a + FILTER_ROWS, n)
        rows.reason[a:b], rows.shape[a:b] = filter_rows(width[a:b], height[a:b], scan[a:b], params, reasons)
    if excluded is not None:
        listed, kinds = excluded
        first, last = np.searchsorted(listed, start), np.searchsorted(listed, start + n)
        mine, kind = listed[first:last] - start, kinds[first:last]
        rows.reason[mine[kind == 0]] = reasons.code(DUPLICATE)  # (registered as before other kinds existed)
        for k in range(1, len(EXCLUDED)):
            if (kind == k).any():  # registered only where present: a plan without them is as before
                rows.reason[mine[kind == k]] = reasons.code(EXCLUDED[k])
        rows.shape[mine] = 0
    if params.counts_captions:
        rows.container = containers.encode(batch)
        rows.text_offset = _column(batch, "text_offset", np.int64, path, start)
        rows.text_size = _column(batch, "text_size", np.int64, path, start)
    return rows


def _check_document_order(document: np.ndarray, previous, path: Path, row0: int) -> None:
    head = document if previous is None else np.concatenate([[previous], document])
    first_row = row0 if previous is None else row0 - 1
    bad = np.flatnonzero(head[1:] < head[:-1])
    if len(bad):
        raise MmtokError(f"manifest {path}: document id decreases at row {first_row + int(bad[0]) + 1}; "
                         "the contract requires non-decreasing ids (re-run `mmtok scan`)")
