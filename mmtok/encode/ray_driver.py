"""`mmtok encode --executor ray`: one driver, long-lived workers that keep the codec loaded, retries and backups.

Ray is the engine for the dynamic part (placing workers on GPUs, noticing a dead one); the record stays where it
is for every other launcher: the parts and their commit logs under OUT. So:

* The driver lists the plan's work items whose part is not finished and hands them, one at a time, to its
  workers: Ray actors (`num_gpus=1` on CUDA), each of which loads the codec once and pins its device as a rank
  does (`mmtok.launch.resolve_device`: Ray shows an actor only its own GPU). One item in flight per worker: a
  slow worker holds back one item, never a queue of them.
* Parts are written by the lock-free protocol (`mmtok encode --lock-free`): each copy of an item is private
  until finished and published by one rename; when two copies finish, the second is checked byte-identical and
  discarded. An item a run with locks began (its part exists, unfinished) is resumed under its lock instead,
  and gets no backup. A job begun here can be finished by `mmtok encode --lock-free` ranks (SLURM, torchrun),
  and the reverse.
* A worker that dies (its process, its node) has its item handed to another worker, which resumes the dead
  copy from its commit log when it runs on the same host (`adopt_private_part`), and a new worker is started in
  its place. A driver that dies is simply started again: what is finished on disk is not done twice.
* Tail backups: Ray has no speculative execution, so the driver does it. When no item is left to hand out, an
  idle worker runs a backup of the item that has run longest (one backup per item); whichever copy finishes
  first is the part, the other is discarded. When every item is finished the workers are stopped, a losing
  copy still running included (its private directory is removed).
* Nothing depends on the order results come back in: merge reads the parts in item order.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mmtok.errors import MmtokError

MAX_TRIES = 3  # a worker dying under the same item this many times is a fault of the item, not of the workers
WAIT_S = 5.0  # the driver's tick: how often it looks for a long-running item to back up


def import_ray():
    """Ray, or one line saying how to install it (an optional extra: nothing else in mmtok imports it)."""
    try:
        import ray
    except ImportError:
        raise MmtokError("--executor ray needs Ray: pip install 'mmtok[ray]' (or pip install ray)") from None
    return ray


class _Worker:
    """What a Ray actor holds: one `ItemEncoder` (the codec loaded once)."""

    def __init__(self, plan_dir: str, out: str, codec: str, checkpoint: str, device: str | None, options: dict):
        from mmtok.codecs.registry import load_codec
        from mmtok.encode.runner import EncodeOptions, ItemEncoder
        from mmtok.launch import resolve_device

        device = resolve_device(device)
        self.encoder = ItemEncoder(plan_dir, out, load_codec(codec, checkpoint, device, modality="image"), device,
                                   EncodeOptions(**options, progress=False, take_over=False, lock_free=True))

    def where(self) -> tuple[str, int]:
        return socket.gethostname(), os.getpid()

    def encode(self, item: int, lock_free: bool) -> dict:
        return self.encoder.encode(item, lock_free=lock_free)


@dataclass
class _Copy:
    """One copy of an item in flight on a worker."""

    item: int
    worker: object
    started: float
    backup: bool


@dataclass
class RayRun:
    """What the driver did: every count adds up to the items it found unfinished."""

    items: int
    to_do: int
    finished: list[int] = field(default_factory=list)
    backups: int = 0  # backup copies started
    backups_won: int = 0  # items whose backup copy was published first
    discarded: int = 0  # finished copies found identical to a published part and removed
    retries: int = 0  # items handed out again after their worker died
    workers_lost: int = 0
    workers: int = 0
    seconds: float = 0.0
    counts: dict = field(default_factory=dict)


def encode_on_ray(plan_dir: str, out: str, codec: str, checkpoint: str, *, workers: int | None,
                  address: str | None, device: str | None, options: dict, progress: bool = True) -> RayRun:
    """Encode every unfinished work item of the plan into `out` on a Ray cluster (`address`; None: the one
    `RAY_ADDRESS` names, else a local one started here) with `workers` actors (None: one per GPU of the
    cluster, 1 without); returns what was done."""
    from mmtok.formats.commitlog import is_done, part_dir
    from mmtok.formats.plan import Plan

    ray = import_ray()
    count = len(Plan.open(plan_dir).work_items())
    to_do = [item for item in range(count) if not is_done(part_dir(out, item))]
    run = RayRun(items=count, to_do=len(to_do))
    if not to_do:
        return run
    began = time.monotonic()
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        workers = workers or int(ray.cluster_resources().get("GPU", 0)) or 1
        _Driver(ray, run, to_do, (plan_dir, out, codec, checkpoint, device, options), workers, progress).run()
    finally:
        if owned:
            ray.shutdown()
    run.seconds = time.monotonic() - began
    return run


class _Driver:
    def __init__(self, ray, run: RayRun, to_do: list[int], worker_args: tuple, workers: int, progress: bool):
        from mmtok.formats.commitlog import part_dir

        self.ray, self.run_record, self.worker_args = ray, run, worker_args
        out = worker_args[1]
        self.out = out
        # a part a run with locks began: resumed under its lock, never two copies of it
        self.locked = {item for item in to_do if part_dir(out, item).exists()}
        self.queue = deque(to_do)
        self.tries: dict[int, int] = {}
        self.running: dict = {}  # ObjectRef -> _Copy
        self.done: set[int] = set()
        self.backed_up: set[int] = set()
        self.where: dict = {}  # id(actor) -> ObjectRef of its (host, pid): whose private copies are whose
        gpus = 1 if (worker_args[4] or "cuda").startswith("cuda") and ray.cluster_resources().get("GPU") else 0
        self.actor = ray.remote(num_gpus=gpus, num_cpus=1, max_restarts=0)(_Worker)
        self.idle = [self._start() for _ in range(min(workers, len(to_do)))]
        run.workers = len(self.idle)
        from mmtok.progress import progress as progress_bar

        self.bar = progress_bar(total=len(to_do), unit="item", desc="encode (ray)", enabled=progress)

    def _start(self):
        worker = self.actor.remote(*self.worker_args)
        self.where[id(worker)] = worker.where.remote()  # answered before its first item: calls run in order
        return worker

    def run(self) -> None:
        with self.bar:
            while len(self.done) < self.run_record.to_do:
                self._hand_out()
                ready, _ = self.ray.wait(list(self.running), num_returns=1, timeout=WAIT_S)
                for ref in ready:
                    self._settle(ref)
        self._stop_workers()

    def _hand_out(self) -> None:
        while self.idle and self.queue:
            item = self.queue.popleft()
            if item not in self.done:
                self._submit(self.idle.pop(), item, backup=False)
        while self.idle and not self.queue:  # the tail: back up the copy that has run longest, once per item
            candidates = [c for c in self.running.values() if not c.backup and c.item not in self.backed_up
                          and c.item not in self.locked and c.item not in self.done]
            if not candidates:
                break
            oldest = min(candidates, key=lambda c: (c.started, c.item))
            self.backed_up.add(oldest.item)
            self.run_record.backups += 1
            self._submit(self.idle.pop(), oldest.item, backup=True)

    def _submit(self, worker, item: int, backup: bool) -> None:
        ref = worker.encode.remote(item, item not in self.locked)
        self.running[ref] = _Copy(item, worker, time.monotonic(), backup)

    def _settle(self, ref) -> None:
        copy = self.running.pop(ref)
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.RayActorError:  # the worker died (its process or its node): hand the item out again
            self._lost(copy)
            return
        except self.ray.exceptions.RayTaskError as err:  # the item itself failed: as it would under any launcher
            raise MmtokError(f"work item {copy.item}: {_cause(err)}") from None
        self.idle.append(copy.worker)
        if result.get("discarded"):
            self.run_record.discarded += 1
        if copy.item in self.done:
            return
        self.done.add(copy.item)
        self.run_record.finished.append(copy.item)
        self.run_record.backups_won += copy.backup
        for name, value in result.get("counts", {}).items():
            self.run_record.counts[name] = self.run_record.counts.get(name, 0) + value
        self.bar.update(1)
        self.bar.set_postfix(backups=self.run_record.backups, retries=self.run_record.retries, refresh=False)

    def _lost(self, copy: _Copy) -> None:
        self.run_record.workers_lost += 1
        self.idle.append(self._start())  # a new worker in its place (Ray places it on a live node)
        if copy.item in self.done or any(c.item == copy.item for c in self.running.values()):
            return  # its other copy goes on
        self.tries[copy.item] = self.tries.get(copy.item, 0) + 1
        if self.tries[copy.item] >= MAX_TRIES:
            raise MmtokError(f"work item {copy.item}: its worker died {MAX_TRIES} times; look for the cause in the "
                             "Ray logs (out of memory? a crash in the codec?) before running it again")
        self.run_record.retries += 1
        self.queue.appendleft(copy.item)

    def _stop_workers(self) -> None:
        """Stop every worker; the private copies of items finished meanwhile that a stopped worker was writing
        (a losing backup) are removed (they are this run's, and their item is published)."""
        from mmtok.formats.commitlog import PART_NAME, PRIVATE_DIR, parts_root

        losers = list(self.running.values())
        for worker in {id(w): w for w in [c.worker for c in losers] + self.idle}.values():
            self.ray.kill(worker)
        if self.running:  # a killed worker's call fails once its process is gone: then its copy can be removed
            self.ray.wait(list(self.running), num_returns=len(self.running), timeout=60)
        for copy in losers:  # its item is published: the copy it was writing is nobody's
            try:
                host, pid = self.ray.get(self.where[id(copy.worker)], timeout=10)
            except self.ray.exceptions.RayError:  # it died before it said where it runs: a rerun adopts its copy
                continue
            shutil.rmtree(Path(parts_root(self.out)) / PRIVATE_DIR / f"{PART_NAME}{copy.item:05d}.{host}.{pid}",
                          ignore_errors=True)


def _cause(err) -> str:
    """The worker's own error message (an MmtokError of the item), without Ray's traceback."""
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err).splitlines()[0]


def run_record(run: RayRun) -> dict:
    return asdict(run)
