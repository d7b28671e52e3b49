"""Loader threads: read, decode, resize into pinned buffers and tokenize text, ahead of the device.

A scheduler thread walks the rank's batches in order. For each it takes the batch's bytes from a
host ring of `prefetch` x the largest batch (the bound on what is loaded ahead), and submits one
task per image plus one text task to a pool of `threads` loader threads. An image task reads the
member's byte range, decodes it (PIL, EXIF orientation, one RGB conversion: mmtok.media.images) and writes
the bicubic resize straight into its slot of the batch buffer; the text task builds the templates
(tokenized text) of the documents the batch completes. PIL decoding/resizing and `pread` release
the GIL, so the threads run in parallel with each other and with the device.

The consumer receives batches strictly in order, each holding exactly the pixels and templates
that a single thread would have produced: output never depends on the number of threads or on
timing. The ring is pinned (page-locked) when the device is CUDA, so the host-to-device copy can be
asynchronous; a batch's region returns to the ring once the device is done with it.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import torch

from mmtok.documents import DocumentBuilder, DocumentError, Sidecars, Template
from mmtok.encode.work import ItemWork
from mmtok.errors import Skip
from mmtok.formats.items import media_digest
from mmtok.formats.manifest import MemberReader, ShortRead
from mmtok.media.images import ImageDecodeError, decode_rgb, resize_rgb


@dataclass
class PreparedBatch:
    """One batch ready for the device."""

    batch: int  # global batch id
    rows: slice  # its rows in the ItemWork arrays
    pixels: torch.Tensor  # uint8 [B, H, W, 3], a view of the loader's host ring
    failures: list[Skip | None]  # per image: why it was skipped, or None when decoded
    digests: list[str | None]  # per image: the digest of the bytes it was decoded from (None when unread)
    templates: dict[int, Template | DocumentError]  # per document whose first image is in the batch


class HostRing:
    """One host arena handed out to batches in order and released in the same order (a ring).

    Prefetch is bounded by bytes, not by a count of batches: after a run of small batches the
    loaders are not starved of space for a large one. Pinned (page-locked) once, when CUDA is the
    device, so every host-to-device copy can be asynchronous without per-batch pinning.
    """

    def __init__(self, nbytes: int, pin: bool):
        self._arena = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self._regions: deque[tuple[int, int]] = deque()  # (start, end) of regions in use, oldest first
        self._head = 0  # where the next region starts
        self._ready = threading.Condition()

    def _fit(self, nbytes: int) -> int | None:
        size = self._arena.numel()
        if not self._regions:
            return 0
        tail = self._regions[0][0]
        # Once wrapped, head stays strictly below tail, so head == tail always means "not wrapped".
        if self._head >= tail:  # free: [head, size) and [0, tail)
            if self._head + nbytes <= size:
                return self._head
            return 0 if nbytes < tail else None
        return self._head if self._head + nbytes < tail else None  # wrapped; free: [head, tail)

    def acquire(self, nbytes: int, stop: threading.Event) -> torch.Tensor | None:
        """A region of `nbytes`; blocks until the oldest regions are released (None once `stop` is set)."""
        with self._ready:
            while not stop.is_set():
                start = self._fit(nbytes)
                if start is not None:
                    self._regions.append((start, start + nbytes))
                    self._head = start + nbytes
                    return self._arena[start : start + nbytes]
                self._ready.wait(0.1)
            return None

    def release(self) -> None:
        """Release the oldest region in use."""
        with self._ready:
            self._regions.popleft()
            self._ready.notify()


class BatchLoader:
    """Iterate `PreparedBatch`es for global batches `batches` of `work`, loaded in the background."""

    def __init__(self, work: ItemWork, builder: DocumentBuilder, batches: range, *, threads: int = 4,
                 prefetch: int = 4, pin: bool = False):
        self.work = work
        self.builder = builder
        self.reader = MemberReader()
        self._batches = batches
        self._stop = threading.Event()
        largest = max((int(np.prod(self._shape(b))) for b in batches), default=1)
        self._ring = HostRing(max(2, prefetch) * largest, pin)
        self._executor = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="mmtok-loader")
        self._queue: queue.Queue = queue.Queue()
        self._scheduler = threading.Thread(target=self._schedule, name="mmtok-scheduler", daemon=True)
        self._scheduler.start()

    def _shape(self, batch: int) -> tuple[int, int, int, int]:
        rows = self.work.batch_rows(batch)
        first = rows.start
        return (rows.stop - rows.start, int(self.work.rows["target_height"][first]),
                int(self.work.rows["target_width"][first]), 3) if rows.stop > rows.start else (0, 0, 0, 3)

    # -- background side ----------------------------------------------------------------------------
    def _schedule(self) -> None:
        try:
            for batch in self._batches:
                shape = self._shape(batch)
                region = self._ring.acquire(int(np.prod(shape)), self._stop)
                if region is None:
                    return
                pixels = region.view(shape)
                target = pixels.numpy()
                rows = self.work.batch_rows(batch)
                images = [self._executor.submit(self._load_image, target, slot, row)
                          for slot, row in enumerate(range(rows.start, rows.stop))]
                texts = self._executor.submit(self._templates, batch)
                self._queue.put((batch, rows, pixels, images, texts))
        except RuntimeError:  # executor shut down while scheduling: the consumer is closing
            return
        finally:
            self._queue.put(None)

    def _load_image(self, target: np.ndarray, slot: int, row: int) -> tuple[Skip | None, str | None]:
        """Decode row `row` into `target[slot]`; returns (why it was skipped -- slot zeroed -- or None,
        the digest of the bytes read or None)."""
        r = self.work.rows
        digest = None
        try:
            stale = self.work.stale.get(r["tar"][row])
            if stale is not None:  # its offsets describe other bytes now: nothing of it is read
                raise Skip("stale_media", stale)
            data = self.reader.read_member(r["container"][row], r["tar"][row], r["member"][row],
                                           int(r["offset"][row]), int(r["size"][row]))
            digest = media_digest(data)
            image = decode_rgb(data)
            expected = (int(r["width"][row]), int(r["height"][row]))
            if all(expected) and image.size != expected:  # the scan's oriented size: orientation must agree
                raise ImageDecodeError("size_mismatch", f"decoded {image.size}, manifest {expected}")
            target[slot] = resize_rgb(image, target.shape[1], target.shape[2])
            return None, digest
        except Skip as err:  # ImageDecodeError included
            target[slot] = 0
            return err, digest
        except ShortRead as err:
            target[slot] = 0
            return Skip("short_read", str(err)), digest

    def _templates(self, batch: int) -> dict[int, Template | DocumentError]:
        out: dict[int, Template | DocumentError] = {}
        if not self.builder.makes_documents:
            return out
        rows = self.work.rows
        for row in self.work.template_rows(batch):
            document = int(rows["document"][row])
            try:
                out[document] = self.builder.template(int(rows["document_images"][row]), self._sidecars(int(row)))
            except DocumentError as err:
                out[document] = err
        return out

    def _sidecars(self, row: int) -> Sidecars:
        r = self.work.rows
        text = json = None
        try:
            if self.builder.needs_text and r["text_offset"][row] >= 0:
                text = self.reader.read_text(r["container"][row], r["tar"][row], int(r["text_offset"][row]),
                                             int(r["text_size"][row]), self.work.text_column)
            if self.builder.needs_json and r["json_offset"][row] >= 0:
                json = self.reader.read(r["tar"][row], int(r["json_offset"][row]), int(r["json_size"][row]))
        except ShortRead:
            raise DocumentError("sidecar_unreadable") from None
        return Sidecars(text=text, json=json)

    # -- consumer side ------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[PreparedBatch]:
        while (item := self._queue.get()) is not None:
            batch, rows, pixels, images, texts = item
            loaded = [f.result() for f in images]
            yield PreparedBatch(batch, rows, pixels, [failure for failure, _ in loaded],
                                [digest for _, digest in loaded], texts.result())

    def release(self, prepared: PreparedBatch) -> None:
        """Hand a batch's host memory back once the device no longer reads it (batches in order)."""
        self._ring.release()

    def close(self) -> None:
        self._stop.set()
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._scheduler.join()
        self.reader.close()
