"""The rank loop every modality runs: loaders ahead of the device, the device, a committer behind it.

  loader     (the modality's: image loader threads, audio DataLoader workers)  yields batches in order
  device     (this thread, `run_device`)   encodes batch b
  committer  (one thread, CommitThread)    turns batch b-1 into durable part commits (PartWriter.commit)
so the device waits for neither decoding nor fsync. A modality plugs in three functions: what to
iterate (its loader), how to encode one loaded batch, and how to commit one encoded batch. Everything
a commit holds is a function of the batch alone, so resumed and uninterrupted runs write the same
bytes. The `Meter` times all three for the progress line and each part's counters; `timing_stats`
turns those counters into the stats every part records.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Iterable, TypeVar

import numpy as np

Batch = TypeVar("Batch")
UNIFORM_CODES = "flagged:uniform_codes"  # the count of batches whose every code was one value
Result = TypeVar("Result")


class Meter:
    """Throughput and device-busy figures. The device loop adds busy time and loader waits, the
    committer takes per-commit increments; both under one lock."""

    def __init__(self, bar, done: int = 0, item: str = "item"):
        self._lock = threading.Lock()
        self.bar, self.item = bar, item
        self.started = time.perf_counter()
        self.last_commit = self.started
        self.first_batch: float | None = None  # when the device got its first batch (pipeline fill)
        self.busy = self.busy_since_commit = self.waited = 0.0
        self.items = self.tokens = 0
        bar.update(done)

    def device(self, started: float, finished: float) -> None:
        with self._lock:
            if self.first_batch is None:
                self.first_batch = started
            self.busy += finished - started
            self.busy_since_commit += finished - started

    @property
    def fill_seconds(self) -> float:
        """Seconds this session's device waited for its first batch (loaders warming up)."""
        return (self.first_batch or time.perf_counter()) - self.started

    def committed(self, items: int, tokens: int) -> dict[str, int]:
        """Account one commit; returns its timing increments (milliseconds) for the part's counters."""
        now = time.perf_counter()
        with self._lock:
            busy, self.busy_since_commit = self.busy_since_commit, 0.0
            total_busy = self.busy
        increments = {"wall_ms": round((now - self.last_commit) * 1000), "device_busy_ms": round(busy * 1000)}
        self.last_commit = now
        self.items += items
        self.tokens += tokens
        elapsed = max(now - self.started, 1e-9)
        self.bar.set_postfix_str(f"{self.items / elapsed:.1f} {self.item}/s, {self.tokens / elapsed:,.0f} tok/s, "
                                 f"device busy {100 * total_busy / elapsed:.1f}%", refresh=False)
        self.bar.update(items)
        return increments


def run_device(batches: Iterable[Batch], encode: Callable[[Batch], Result], commit: Callable[[Batch, Result], None],
               meter: Meter, *, release: Callable[[Batch], None] | None = None, depth: int = 2,
               stop: Callable[[], bool] | None = None) -> None:
    """Encode every batch on this thread and commit it on a committer thread, in order.

    `release(batch)` runs right after encoding (host memory back to the loader). `stop()` is asked before
    each batch is taken and again once it arrives: once it says True no further batch is encoded (a stop
    request: the batches already encoded are still committed). Returns once every commit is durable. The
    first error wins: a committer failing after the device loop did does not replace the device loop's
    exception.
    """
    import torch

    committer = CommitThread(depth)
    try:
        with torch.inference_mode():
            iterator = iter(batches)
            while stop is None or not stop():
                waited = time.perf_counter()
                batch = next(iterator, _END)
                started = time.perf_counter()
                meter.waited += started - waited
                if batch is _END:
                    break
                if stop is not None and stop():  # it came while the loader worked: this batch is not encoded
                    if release is not None:
                        release(batch)
                    break
                result = encode(batch)
                meter.device(started, time.perf_counter())
                if release is not None:
                    release(batch)
                committer.submit(lambda b=batch, r=result: commit(b, r))
    except BaseException:
        committer.close(reraise=False)
        raise
    committer.close()


_END = object()


def uniform_codes(codes: Iterable[np.ndarray | None]) -> dict[str, int]:
    """{UNIFORM_CODES: 1} when a batch's codes (two or more, of one item or several) are all one value, else {}:
    the sign of a checkpoint that maps everything to one code (damaged weights that load) or of blank inputs --
    flagged, not refused, since black frames or silences are legitimate. The count reaches the part, the rank's
    summary (a warning line) and merged.json."""
    items = [c.ravel() for c in codes if c is not None and c.size]
    if sum(item.size for item in items) < 2 or any((item != items[0][0]).any() for item in items):
        return {}
    return {UNIFORM_CODES: 1}


class CommitThread:
    """Runs commit jobs on one background thread, in submission order, so the device never waits for fsync.

    `submit` blocks once `depth` jobs are queued (the producer cannot run far ahead of durability);
    the first job error is re-raised in the producer by `submit`/`check`/`close`, and later jobs
    are dropped (a commit after a failed one would leave a gap).
    """

    def __init__(self, depth: int = 2):
        self._jobs: queue.Queue = queue.Queue(depth)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mmtok-commit", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as err:  # re-raised in the producer thread
                    self.error = err

    def submit(self, job) -> None:
        self.check()
        self._jobs.put(job)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self, reraise: bool = True) -> None:
        """Wait for every submitted job; re-raise the first error (unless `reraise` is False: the
        caller is already handling an error of its own, which must not be replaced)."""
        self._jobs.put(None)
        self._thread.join()
        if reraise:
            self.check()
