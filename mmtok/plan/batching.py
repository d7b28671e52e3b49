"""Stages 2 and 3 of the plan: windows, then shape-uniform batches inside each window.

Windows are consecutive manifest rows; each boundary k * window_rows moves forward to the next
document start, so a document never spans two windows. Inside a window the kept images are
stable-sorted by exact target shape and every run of one shape is cut into batches of at most
min(max_batch_images, token_budget // tokens) images (at least one: an image above the budget gets
a batch of its own). Batches are numbered in (window, height, width, manifest row) order.

Images of documents with several images are batched like any other image: their codes go to a
per-image store and merge assembles the documents (see mmtok.encode.runner), so batches stay full
and every batch boundary is a legal rank cut. A document whose image blocks alone exceed
`max_document_tokens` is dropped (`document_too_long`) rather than becoming one giant sequence.

`splits` (from `mmtok.ranks.balance_splits`, for the second planning pass of a small corpus) cut
chosen batches into two pieces of the same shape; image order, and so every document, is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmtok.formats.presets import PlanParameters
from mmtok.plan.captions import CaptionReader, count_captions
from mmtok.plan.rows import ManifestRows, Reasons, ShapeTable
from mmtok.text import TextTokenizer

GROUP_ROWS = 1 << 20  # windows are read and planned in groups of about this many rows: the plan's memory
# is about one group's; grouping never changes the plan
MAX_GROUP_WINDOWS = (1 << 16) - 1  # local window ids stay uint16 (radix sorts)


def window_groups(bounds: np.ndarray) -> np.ndarray:
    """Window indices where processing groups start, then the window count: about GROUP_ROWS rows
    and at most MAX_GROUP_WINDOWS windows per group."""
    n_windows = len(bounds) - 1
    if n_windows <= 0:
        return np.zeros(1, np.int64)
    by_rows = np.searchsorted(bounds[:-1], np.arange(0, bounds[-1], GROUP_ROWS), side="right") - 1
    by_count = np.arange(0, n_windows, MAX_GROUP_WINDOWS)
    return np.unique(np.concatenate([by_rows, by_count, [n_windows]]).astype(np.int64))


def _run_starts(values: np.ndarray) -> np.ndarray:
    """Start index of each run of equal consecutive values."""
    change = np.empty(len(values), bool)
    change[:1] = True
    np.not_equal(values[1:], values[:-1], out=change[1:])
    return np.flatnonzero(change)


def _run_lengths(starts: np.ndarray, total: int) -> np.ndarray:
    return np.diff(np.append(starts, total))


def stable_order(shape: np.ndarray, window: np.ndarray | None) -> np.ndarray:
    """Stable order by (window, shape): least significant key first, one stable sort per key.
    The keys are merged when their product fits 16 bits (NumPy's stable sort is a radix sort there)."""
    if window is None:
        return np.argsort(shape, kind="stable")
    span = int(shape.max()) + 1
    if span * (int(window.max()) + 1) < (1 << 16):
        return np.argsort(window.astype(np.uint16) * np.uint16(span) + shape.astype(np.uint16), kind="stable")
    order = np.argsort(shape, kind="stable")
    return order[np.argsort(window[order], kind="stable")]


@dataclass
class GroupPlan:
    """One group of windows, planned: the rows of every plan file it adds."""

    dropped_rows: np.ndarray
    dropped_codes: np.ndarray
    documents_total: int
    images: dict[str, np.ndarray] | None = None
    batches: dict[str, np.ndarray] | None = None
    documents: dict[str, np.ndarray] | None = None  # documents.parquet rows
    documents_kept: int = 0
    document_tokens: int = 0
    text_tokens: int = 0


@dataclass
class _Kept:
    """The kept rows of a group (indices local to the group, manifest order) and their structure."""

    rows: np.ndarray
    shape: np.ndarray  # shape index per kept row
    doc_start: np.ndarray | None  # run starts of documents over kept rows; None: every document is one image
    window: np.ndarray | None  # local window per kept row; None: one window
    window_start: np.ndarray  # first kept row of each local window


class GroupPlanner:
    """Plans one group of windows at a time, numbering batches and plan rows globally.

    `splits` maps a batch number of the unsplit plan to the image positions where it is cut
    (see the module docstring); the batches are then renumbered in order."""

    def __init__(self, params: PlanParameters, reasons: Reasons, tokenizer: TextTokenizer,
                 containers: list[tuple[str, str]] | None = None, text_column: str | None = None,
                 splits: dict[int, list[int]] | None = None):
        self.params, self.reasons, self.tokenizer = params, reasons, tokenizer
        self.shapes = ShapeTable.build(np.zeros(0, np.uint32), params, tokenizer)  # grows with the shapes seen
        self.captions = CaptionReader(containers, text_column) if params.counts_captions else None
        self.splits = splits or {}
        self.next_batch = 0
        self.next_unsplit_batch = 0
        self.next_plan_row = 0
        self.long_documents = 0  # dropped as document_too_long
        self.largest_document = 0  # image-block tokens (+ BOS/EOS) of the largest document seen, dropped or not

    def plan(self, rows: ManifestRows, window_starts: np.ndarray, first_window: int) -> GroupPlan:
        """Plan one group of manifest rows, whose windows start at `window_starts` (global rows)."""
        if len(rows.new_shapes):
            self.shapes = ShapeTable.build(np.union1d(self.shapes.packed, rows.new_shapes).astype(np.uint32),
                                           self.params, self.tokenizer)
        lo, reason = rows.start, rows.reason  # final reasons land in rows.reason
        doc_start = _run_starts(rows.document)
        one_image_documents = len(doc_start) == len(rows)
        if not one_image_documents:
            self._drop_whole_documents(reason, doc_start)
        self._drop_long_documents(rows, doc_start)
        text_tokens = self._count_captions(rows, doc_start) if self.captions else None
        keep = reason == 0
        dropped = np.flatnonzero(~keep)
        plan = GroupPlan(dropped_rows=lo + dropped, dropped_codes=reason[dropped], documents_total=len(doc_start))
        kept_rows = np.flatnonzero(keep)
        if len(kept_rows) == 0:
            return plan
        kept = self._structure(rows, kept_rows, window_starts - lo, one_image_documents)
        order = stable_order(kept.shape, kept.window)
        batch_shape = self._cut(plan, kept, order, first_window)
        batch = np.repeat(plan.batches["batch"], plan.batches["num_images"])
        self._fill_images(plan, rows, kept, order, batch, batch_shape)
        self._fill_documents(plan, rows, kept, order, batch, text_tokens)
        self.next_batch += len(batch_shape)
        self.next_plan_row += len(order)
        return plan

    # -- documents and captions ----------------------------------------------------------------------
    def _drop_whole_documents(self, reason: np.ndarray, doc_start: np.ndarray) -> None:
        """Every row of a document with a dropped member gets `document_member_dropped`."""
        bad_rows = np.flatnonzero(reason)
        if len(bad_rows):
            doc_code = np.zeros(len(doc_start), np.uint16)
            doc_code[np.searchsorted(doc_start, bad_rows, side="right") - 1] = self.reasons.code(
                "document_member_dropped")
            self._drop_documents(reason, doc_start, doc_code)

    def _drop_long_documents(self, rows: ManifestRows, doc_start: np.ndarray) -> None:
        """Documents whose image blocks + BOS/EOS exceed max_document_tokens get `document_too_long`."""
        reason = rows.reason
        alive = reason == 0
        if not alive.any():
            return
        row_tokens = np.zeros(len(reason), np.int64)
        row_tokens[alive] = self.shapes.tokens[self.shapes.index(rows.shape[alive])]
        tokens = np.add.reduceat(row_tokens, doc_start) + 2
        tokens[reason[doc_start] != 0] = 0
        self.largest_document = max(self.largest_document, int(tokens.max()))
        limit = self.params.max_document_tokens
        if limit and (long := tokens > limit).any():
            self.long_documents += int(long.sum())
            code = self.reasons.code("document_too_long")
            self._drop_documents(reason, doc_start, np.where(long, code, 0).astype(np.uint16))

    @staticmethod
    def _drop_documents(reason: np.ndarray, doc_start: np.ndarray, doc_code: np.ndarray) -> None:
        row_code = np.repeat(doc_code, _run_lengths(doc_start, len(reason)))
        hit = (row_code != 0) & (reason == 0)
        reason[hit] = row_code[hit]

    def _count_captions(self, rows: ManifestRows, doc_start: np.ndarray) -> np.ndarray:
        """Caption tokens of the group's surviving documents (in order); drops the unusable ones."""
        reason = rows.reason
        candidate = np.flatnonzero(reason[doc_start] == 0)
        first = doc_start[candidate]
        tokens, why = count_captions(self.captions, self.tokenizer, rows.container[first], rows.text_offset[first],
                                     rows.text_size[first])
        doc_code = np.zeros(len(doc_start), np.uint16)
        doc_code[candidate] = [0 if w is None else self.reasons.code(w) for w in why]
        self._drop_documents(reason, doc_start, doc_code)
        return tokens[tokens >= 0]

    # -- batches -------------------------------------------------------------------------------------
    def _structure(self, rows: ManifestRows, kept_rows: np.ndarray, window_starts: np.ndarray,
                   one_image_documents: bool) -> _Kept:
        """Shape index and window of every kept row, and where its documents start."""
        shape = self.shapes.index(rows.shape[kept_rows])
        doc_start = None
        if not one_image_documents:
            doc_start = _run_starts(rows.document[kept_rows])
            doc_start = None if len(doc_start) == len(kept_rows) else doc_start
        window_start = np.searchsorted(kept_rows, window_starts)
        window = None
        if len(window_starts) > 1:
            window = np.repeat(np.arange(len(window_starts), dtype=np.uint16),
                               _run_lengths(window_start, len(kept_rows)))
        return _Kept(rows=kept_rows, shape=shape, doc_start=doc_start, window=window, window_start=window_start)

    def _cut(self, plan: GroupPlan, kept: _Kept, order: np.ndarray, first_window: int) -> np.ndarray:
        """Cut the sorted rows into batches (runs of one shape and window, split at capacity and at
        `self.splits`). Fills plan.batches (numbered globally); returns each batch's shape index."""
        shapes, n = self.shapes, len(order)
        sorted_shape = kept.shape[order]
        change = np.empty(n, bool)
        change[:1] = True
        np.not_equal(sorted_shape[1:], sorted_shape[:-1], out=change[1:])
        if kept.window is not None:
            sorted_window = kept.window[order]
            change[1:] |= sorted_window[1:] != sorted_window[:-1]
        run_start = np.flatnonzero(change)
        run_len = _run_lengths(run_start, n)
        run_shape = sorted_shape[run_start]
        capacity = shapes.capacity[run_shape]
        run_batches = -(-run_len // capacity)
        batch_run = np.repeat(np.arange(len(run_start)), run_batches)
        nth = np.arange(len(batch_run)) - np.repeat(np.cumsum(run_batches) - run_batches, run_batches)
        start, batch_run = self._split(run_start[batch_run] + nth * capacity[batch_run], batch_run)
        count = np.diff(np.append(start, n))
        shape = run_shape[batch_run]
        window = (kept.window[order[start]] if kept.window is not None
                  else np.zeros(len(start), np.uint16)).astype(np.int64)
        plan.batches = {
            "batch": np.arange(self.next_batch, self.next_batch + len(count)),
            "plan_row": self.next_plan_row + start,
            "num_images": count.astype(np.int32),
            "target_height": shapes.height[shape],
            "target_width": shapes.width[shape],
            "tokens": count * shapes.tokens[shape],
            "cost": self.params.cost_model.batch_cost(shapes.height[shape], shapes.width[shape], count),
            "window": first_window + window,
            "full": count >= capacity[batch_run],
        }
        return shape

    def _split(self, start: np.ndarray, batch_run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Batch starts (and their runs) with this group's balance splits inserted."""
        first = self.next_unsplit_batch
        self.next_unsplit_batch += len(start)
        extra = [(int(start[b - first]) + at, int(batch_run[b - first]))
                 for b in range(first, first + len(start)) for at in self.splits.get(b, ())]
        if not extra:
            return start, batch_run
        added = np.array(extra, np.int64)
        starts = np.concatenate([start, added[:, 0]])
        order = np.argsort(starts, kind="stable")
        return starts[order], np.concatenate([batch_run, added[:, 1]])[order]

    def _fill_images(self, plan: GroupPlan, rows: ManifestRows, kept: _Kept, order: np.ndarray, batch: np.ndarray,
                     batch_shape: np.ndarray) -> None:
        b = plan.batches
        count = b["num_images"]
        source = kept.rows[order]
        if kept.doc_start is None:
            document_images = np.ones(len(order), np.int32)
        else:
            doc_len = _run_lengths(kept.doc_start, len(order))
            document_images = np.repeat(doc_len, doc_len).astype(np.int32)[order]
        plan.images = {
            "manifest_row": rows.start + source,
            "batch": batch,
            "target_height": np.repeat(b["target_height"], count),
            "target_width": np.repeat(b["target_width"], count),
            "tokens": np.repeat(self.shapes.tokens[batch_shape], count),
            "document": rows.document[source],
            "image_index": rows.image_index[source],
            "document_images": document_images,
        }

    def _fill_documents(self, plan: GroupPlan, rows: ManifestRows, kept: _Kept, order: np.ndarray, batch: np.ndarray,
                        text_tokens: np.ndarray | None) -> None:
        """Document totals and the documents.parquet rows (documents with several images, or with a
        counted caption)."""
        listed_all = text_tokens is not None  # caption modes list every document
        if kept.doc_start is None and not listed_all:  # one image per document: nothing to list
            plan.documents_kept = len(order)
            plan.document_tokens = int(plan.batches["tokens"].sum()) + 2 * len(order)
            return
        row_batch = np.empty(len(order), np.int64)
        row_batch[order] = batch  # back to manifest order, where documents are runs
        row_tokens = self.shapes.tokens[kept.shape].astype(np.int64)
        if kept.doc_start is None:
            start, first, last, image_tokens = np.arange(len(order)), row_batch, row_batch, row_tokens
        else:
            start = kept.doc_start
            first = np.minimum.reduceat(row_batch, start)
            last = np.maximum.reduceat(row_batch, start)
            image_tokens = np.add.reduceat(row_tokens, start)
        num_images = _run_lengths(start, len(order)).astype(np.int32)
        if text_tokens is None:
            text_tokens = np.full(len(start), 0 if self.params.document_totals_exact else -1, np.int32)
        tokens = image_tokens + 2 + np.maximum(text_tokens, 0)  # BOS + blocks (+ caption) + EOS
        plan.documents_kept, plan.document_tokens = len(start), int(tokens.sum())
        plan.text_tokens = int(np.maximum(text_tokens, 0).sum())
        listed = slice(None) if listed_all else np.flatnonzero(num_images > 1)
        plan.documents = {
            "document": rows.document[kept.rows[start[listed]]],
            "num_images": num_images[listed],
            "text_tokens": text_tokens[listed].astype(np.int32),
            "tokens": tokens[listed],
            "first_batch": first[listed],
            "last_batch": last[listed],
        }

    def close(self) -> None:
        if self.captions:
            self.captions.close()
