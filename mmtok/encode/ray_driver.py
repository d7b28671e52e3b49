"""`mmtok encode --executor ray`: one driver, long-lived workers that keep the codec loaded, retries and backups.

Ray is the engine for the dynamic part (placing workers on GPUs, noticing a dead one); the record stays where it
is for every other launcher: the parts and their commit logs under OUT. So:

* The driver lists the plan's work items whose part is not finished and hands them, one at a time, to its
  workers: Ray actors (`num_gpus=1` on CUDA), each of which loads the codec once and pins its device as a rank
  does (`mmtok.launch.resolve_device`: Ray shows an actor only its own GPU). Two calls in flight per worker, one
  running and one waiting at the worker, so that the next item starts without a round trip through the driver;
  a slow worker holds back at most one item more, which an idle worker backs up at the tail (see below).
* Parts are written by the lock-free protocol (`mmtok encode --lock-free`): each copy of an item is private
  until finished and published by one rename; when two copies finish, the second is checked byte-identical and
  discarded. An item a run with locks began (its part exists, unfinished) is resumed under its lock instead,
  and gets no backup. A job begun here can be finished by `mmtok encode --lock-free` ranks (SLURM, torchrun),
  and the reverse.
* A worker that dies (its process, its node) has its item handed to another worker, which resumes the dead
  copy from its commit log when it runs on the same host (`adopt_private_part`), and a new worker is started in
  its place. A driver that dies is simply started again: what is finished on disk is not done twice.
* Tail backups: Ray has no speculative execution, so the driver does it. When no item is left to hand out, an
  idle worker runs a backup of an item still waiting behind another worker's call (that call is cancelled; Ray
  cancels a waiting actor call on a best-effort basis, so it may run all the same), else of the item that has
  run longest -- only ever of an item with one copy in flight (a backup whose original was cancelled, or died,
  is such a copy, and may be backed up in turn); whichever copy finishes first is the part, the other is
  discarded. When every item is finished the workers are stopped, a losing
  copy still running included (its private directory is removed).
* Nothing depends on the order results come back in: merge reads the parts in item order.
"""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections import Counter, deque
from dataclasses import asdict, dataclass, field

from mmtok.errors import MmtokError
from mmtok.formats.partdir import is_done, part_dir
from mmtok.formats.private_parts import private_copies, private_part_dir, process_alive
from mmtok.workers import ItemDone

MAX_TRIES = 3  # a worker dying under the same item this many times is a fault of the item, not of the workers
WAIT_S = 5.0  # the driver's tick: how often it looks for a long-running item to back up
START_TIMEOUT_S = 900.0  # no worker placed and started for this long: the cluster cannot run one (say so)
DEPTH = 2  # calls in flight per worker: one running, one waiting there (no driver round trip between items)
HELD_RETRY_S = 30.0  # an item another process holds the lock of is offered again after this long


def import_ray():
    """Ray, or one line saying how to install it (an optional extra: nothing else in mmtok imports it)."""
    try:
        import ray
    except ImportError:
        raise MmtokError("--executor ray needs Ray: pip install 'mmtok[ray]' (or pip install ray)") from None
    return ray


def check_device(device: str | None) -> bool:
    """Whether workers need a GPU: yes unless `--device cpu`. Ray shows a worker only its own GPU (cuda:0 inside
    it), so a device index other than 0 means nothing there and is refused."""
    if device in (None, "cuda", "cuda:0"):
        return True
    if device == "cpu":
        return False
    raise MmtokError(f"--executor ray: --device {device!r} does not apply (each worker sees only the GPU Ray gives "
                     "it); leave --device out, or pass cpu")


class _Worker:
    """What a Ray actor holds: one `ItemEncoder` (the codec loaded once, by `start`, so that a failure to load is
    an error of the call with its own message, not an actor that died)."""

    def __init__(self, *args):
        self.args, self.encoder = args, None

    def start(self) -> tuple[str, int]:
        from mmtok.codecs.registry import load_codec
        from mmtok.encode.runner import EncodeOptions, ItemEncoder
        from mmtok.launch import resolve_device

        plan_dir, out, codec, checkpoint, device, options = self.args
        device = resolve_device(device)
        self.encoder = ItemEncoder(plan_dir, out, load_codec(codec, checkpoint, device, modality="image"), device,
                                   EncodeOptions(**options, progress=False, take_over=False, lock_free=True))
        return socket.gethostname(), os.getpid()

    def encode(self, item: int, lock_free: bool) -> ItemDone | None:
        """The item's `ItemDone`; None while a run with locks still writes it (offered again later)."""
        from mmtok.fsutil import LockHeld

        try:
            return self.encoder.encode(item, lock_free=lock_free)
        except LockHeld:
            return None


@dataclass(eq=False)
class _Lane:
    """A started worker: its actor, where it runs (whose private copies are whose) and its calls in flight, in the
    order it runs them."""

    worker: object
    host: str
    pid: int
    calls: list = field(default_factory=list)


@dataclass
class _Copy:
    """One copy of an item in flight on a worker."""

    item: int
    lane: _Lane
    ref: object
    started: float | None  # None while it waits behind the worker's call before it
    backup: bool  # submitted as a backup (counted in `backups_won` when it is the copy published)
    cancelled: bool = False  # where it waited: an idle worker took the item (a backup) before it started


@dataclass
class RayRun:
    """What the driver did: every count adds up to the items it found unfinished."""

    items: int
    to_do: int
    finished: list[int] = field(default_factory=list)
    backups: int = 0  # backup copies started
    backups_won: int = 0  # items whose backup copy was published first
    discarded: int = 0  # finished copies found identical to a published part and removed
    retries: int = 0  # items handed out again after the worker writing them died
    workers_lost: int = 0
    workers: int = 0
    began_at: float = 0.0  # when the run began (seconds since the epoch)
    worker_starts: list[float] = field(default_factory=list)  # seconds from then until each worker was ready
    seconds: float = 0.0
    stopped: str | None = None  # the signal that stopped the driver (its workers were stopped, the items left)
    counts: dict = field(default_factory=dict)


def encode_on_ray(plan_dir: str, out: str, codec: str, checkpoint: str, *, workers: int | None,
                  address: str | None, device: str | None, options: dict, progress: bool = True,
                  stop=None) -> RayRun:
    """Encode every unfinished work item of the plan into `out` on a Ray cluster (`address`; None: the one
    `RAY_ADDRESS` names, else a local one started here) with `workers` actors (None: one per GPU of the
    cluster; with --device cpu, 1); returns what was done. `stop` (a `mmtok.launch.StopRequest`): once set, the
    workers are stopped and the run returns with `stopped` (their copies are resumed by the next run)."""
    from mmtok.formats.plan import Plan

    gpu = check_device(device)
    ray = import_ray()
    count = len(Plan.open(plan_dir).work_items())
    to_do = [item for item in range(count) if not is_done(part_dir(out, item))]
    run = RayRun(items=count, to_do=len(to_do))
    if not to_do:
        return run
    began, run.began_at = time.monotonic(), time.time()
    owned = not ray.is_initialized()
    if owned:
        ray.init(address=address, include_dashboard=False, log_to_driver=False)
    try:
        if workers is None:
            workers = int(ray.cluster_resources().get("GPU", 0)) if gpu else 1
            if not workers:
                raise MmtokError("the Ray cluster has no GPU (yet): give --ray-workers N (they wait for GPUs to "
                                 "join), or --device cpu")
        _Driver(ray, run, to_do, (plan_dir, out, codec, checkpoint, device, options), workers, gpu, progress,
                stop).run()
    except ray.exceptions.RayError as err:  # Ray's own failure (its raylet, the driver's connection): one line
        raise MmtokError(f"Ray failed: {str(err).splitlines()[0][:300]}; rerun the same command to continue "
                         "from the parts on disk") from None
    finally:
        if owned:
            ray.shutdown()
    run.seconds = time.monotonic() - began
    return run


class _Driver:
    def __init__(self, ray, run: RayRun, to_do: list[int], worker_args: tuple, workers: int, gpu: bool,
                 progress: bool, stop):
        from mmtok.progress import progress as progress_bar

        self.ray, self.run_record, self.worker_args, self.stop = ray, run, worker_args, stop
        self.out = worker_args[1]
        # a part a run with locks began: resumed under its lock, never two copies of it
        self.locked = {item for item in to_do if part_dir(self.out, item).exists()}
        self.queue = deque(to_do)  # (it may also hold items done since: skipped)
        self.held: dict[int, float] = {}  # item -> when to offer it again (another process holds its lock)
        self.tries: dict[int, int] = {}
        self.running: dict = {}  # ObjectRef -> _Copy: every call in flight (cancelled ones included)
        self.lanes: list[_Lane] = []  # the started workers alive
        self.done: set[int] = set()
        self.starting: dict = {}  # ObjectRef of a worker's `start` -> the worker
        self.all_started = False  # the first workers all started once (from then on: DEPTH calls each)
        self.live_since = time.monotonic()  # when a worker was last known placed and started (or the run began)
        self.copies: dict[int, set[str]] = {}  # item -> hosts of unfinished copies a killed writer left
        for item, host, _ in private_copies(self.out):
            self.copies.setdefault(item, set()).add(host)
        self.actor = ray.remote(num_gpus=1 if gpu else 0, num_cpus=1, max_restarts=0)(_Worker)
        for _ in range(min(workers, len(to_do))):
            self._start()
        run.workers = len(self.starting)
        self.bar = progress_bar(total=len(to_do), unit="item", desc="encode (ray)", enabled=progress)

    def _start(self) -> None:
        worker = self.actor.remote(*self.worker_args)
        self.starting[worker.start.remote()] = worker

    def run(self) -> None:
        try:
            with self.bar:
                while len(self.done) < self.run_record.to_do:
                    if self.stop is not None and self.stop.is_set():
                        self.run_record.stopped = self.stop.name
                        return
                    self._hand_out()
                    waiting = [*self.running, *self.starting]
                    if not waiting:  # every worker idle, the items left held by another process
                        time.sleep(WAIT_S)
                        continue
                    ready, _ = self.ray.wait(waiting, num_returns=1, timeout=WAIT_S)
                    for ref in ready:
                        if ref in self.starting:
                            self._started(ref)
                        elif ref in self.running:  # (not if its worker's death already settled it)
                            self._settle(ref)
                    self._check_alive()
        finally:
            self._stop_workers()

    def _started(self, ref) -> None:
        worker = self.starting.pop(ref)
        try:
            host, pid = self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as err:  # it could not load the codec: nothing will run
            raise MmtokError(f"a Ray worker could not start: {_cause(err)}") from None
        except self.ray.exceptions.RayActorError:  # its node went away before it started: another in its place
            self._count_lost()
            self._start()
            return
        self.lanes.append(_Lane(worker, host, pid))
        self.run_record.worker_starts.append(round(time.time() - self.run_record.began_at, 3))
        self.live_since = time.monotonic()

    def _check_alive(self) -> None:
        """A run with no worker started, and none for START_TIMEOUT_S, cannot go on: say why."""
        if self.lanes:
            self.live_since = time.monotonic()
        elif time.monotonic() - self.live_since > START_TIMEOUT_S:
            raise MmtokError(f"no Ray worker could be placed for {START_TIMEOUT_S:.0f} s ({len(self.starting)} "
                             "waiting): does the cluster have a free GPU per worker (`ray status`)? Rerun to continue")

    def _hand_out(self) -> None:
        """Items to workers with a free place, the least loaded first (DEPTH calls each once all have started:
        the next item waits at the worker, not a round trip through the driver); at the tail, an idle worker
        takes an item still waiting behind another worker's (cancelled there), else the copy that has run
        longest: a backup (of an item with one copy in flight)."""
        now = time.monotonic()
        for item, when in list(self.held.items()):
            if when <= now:
                del self.held[item]
                self.queue.append(item)
        # one call each until the first workers have all started: a late one would find the items all taken
        self.all_started = self.all_started or not self.starting
        depth = DEPTH if self.all_started else 1
        while self.queue:
            if self.queue[0] in self.done:
                self.queue.popleft()
                continue
            # on the host of a copy left unfinished, if a worker there is free: resumed
            lane = self._pick(depth - 1, prefer=self.copies.get(self.queue[0], ()))
            if lane is None:
                return
            self._submit(lane, self.queue.popleft(), backup=False)
        while self._pick(0) is not None:
            # an item with one copy in flight (none other running or waiting to be cancelled), not under a lock
            copies = Counter(c.item for c in self.running.values())
            alone = [c for c in self.running.values() if copies[c.item] == 1 and not c.cancelled
                     and c.item not in self.done and c.item not in self.locked]
            # an item waiting behind another worker's call first (its worker is busy for a whole item more), then
            # the copy that has run longest
            waiting = [c for c in alone if c.started is None]
            if waiting:
                chosen = min(waiting, key=lambda c: (self.running[c.lane.calls[0]].started, c.item))
                chosen.cancelled = True  # where it waits (if it starts all the same, the copies are identical)
                self.ray.cancel(chosen.ref)
            elif alone:
                chosen = min(alone, key=lambda c: (c.started, c.item))
            else:
                return
            self.run_record.backups += 1
            # on another host than the slow copy's, if one is idle (a backup there would share its trouble)
            self._submit(self._pick(0, avoid=chosen.lane.host), chosen.item, backup=True)

    def _pick(self, most: int, prefer=(), avoid: str = "") -> _Lane | None:
        """A worker with at most `most` calls in flight, the least loaded first, then one on a host in `prefer`
        (where a copy can be adopted and resumed), else one not on host `avoid`; None if none."""
        free = [lane for lane in self.lanes if len(lane.calls) <= most]
        if not free:
            return None
        least = min(len(lane.calls) for lane in free)
        free = [lane for lane in free if len(lane.calls) == least]
        for wanted in (lambda host: host in prefer, lambda host: host != avoid):
            for lane in free:
                if wanted(lane.host):
                    return lane
        return free[0]

    def _submit(self, lane: _Lane, item: int, backup: bool) -> None:
        ref = lane.worker.encode.remote(item, item not in self.locked)
        self.running[ref] = _Copy(item, lane, ref, None if lane.calls else time.monotonic(), backup)
        lane.calls.append(ref)

    def _free(self, ref) -> _Copy:
        """Take a settled call out of `running` and off its worker's lane; the call behind it starts now."""
        copy = self.running.pop(ref)
        calls = copy.lane.calls
        calls.remove(ref)
        if calls and self.running[calls[0]].started is None:
            self.running[calls[0]].started = time.monotonic()
        return copy

    def _settle(self, ref) -> None:
        copy = self.running[ref]
        try:
            result = self.ray.get(ref)
        except self.ray.exceptions.TaskCancelledError:  # backed up on an idle worker before it started
            self._free(ref)  # (its backup, alone now, may be backed up in turn)
            if self._unattended(copy.item):  # (its backup came back held, or died: offered again)
                self.queue.appendleft(copy.item)
            return
        except self.ray.exceptions.RayActorError:  # the worker died (its process or its node): hand its items out
            self._lost(copy.lane)
            return
        except self.ray.exceptions.RayTaskError as err:  # the item itself failed: as it would under any launcher
            self._free(ref)
            if copy.item in self.done and "differs" not in str(err):  # a losing copy's trouble: the part stands
                return
            raise MmtokError(f"work item {copy.item}: {_cause(err)}") from None
        self._free(ref)
        if result is None:  # held by a run with locks
            if self._unattended(copy.item):
                self.held[copy.item] = time.monotonic() + HELD_RETRY_S
            return
        if result.discarded:
            self.run_record.discarded += 1
        if copy.item in self.done:
            return
        self.done.add(copy.item)
        self.run_record.finished.append(copy.item)
        self.run_record.backups_won += copy.backup and not result.discarded and not result.already_done
        for name, value in result.counts.items():  # the part's own counters: the same for any copy
            self.run_record.counts[name] = self.run_record.counts.get(name, 0) + value
        self.bar.update(1)
        self.bar.set_postfix(backups=self.run_record.backups, retries=self.run_record.retries, refresh=False)

    def _unattended(self, item: int) -> bool:
        """Whether nothing will finish `item` as things stand: not done, not to be handed out, no live copy."""
        return item not in self.done and item not in self.held and item not in self.queue \
            and not any(c.item == item and not c.cancelled for c in self.running.values())

    def _count_lost(self) -> None:
        self.run_record.workers_lost += 1
        if self.run_record.workers_lost > MAX_TRIES * self.run_record.workers:
            raise MmtokError(f"{self.run_record.workers_lost} Ray workers died; look for the cause in the Ray logs "
                             "(out of memory? a node failing?) before running it again")

    def _lost(self, lane: _Lane) -> None:
        """A worker died: its calls are settled at once (the one it was running is retried; the ones waiting
        behind it go back to the queue's front) and a new worker is started in its place."""
        self._count_lost()
        self.lanes.remove(lane)
        self.ray.kill(lane.worker)  # (unavailable may not mean dead: make sure it holds no GPU and writes nothing)
        self._start()  # a new worker in its place (Ray places it on a live node)
        for position, ref in reversed(list(enumerate(lane.calls))):
            copy = self.running.pop(ref)
            if position == 0:  # the one it was writing: its copy may be resumed on its host
                self.copies.setdefault(copy.item, set()).add(lane.host)
            if not self._unattended(copy.item):
                continue  # finished, or its other copy goes on
            if position == 0:
                self.tries[copy.item] = self.tries.get(copy.item, 0) + 1
                if self.tries[copy.item] >= MAX_TRIES:
                    raise MmtokError(f"work item {copy.item}: its worker died {MAX_TRIES} times; look for the cause "
                                     "in the Ray logs (out of memory? a crash in the codec?) before running it again")
                self.run_record.retries += 1
            self.queue.appendleft(copy.item)

    def _stop_workers(self) -> None:
        """Stop every worker. A copy a stopped worker was writing of an item that is published (a losing backup)
        is removed once its call has come back failed (its process is gone); any other copy stays, for the next
        run to resume."""

        workers = [lane.worker for lane in self.lanes] + list(self.starting.values())
        for worker in workers:
            self.ray.kill(worker)
        gone, _ = self.ray.wait(list(self.running), num_returns=len(self.running), timeout=60) if self.running \
            else ([], [])
        for ref in gone:
            copy = self.running[ref]
            if copy.item in self.done:
                shutil.rmtree(private_part_dir(self.out, copy.item, copy.lane.pid, copy.lane.host), ignore_errors=True)
        # copies on this host of published items whose writer is dead (a worker killed in an earlier run): nobody's
        here = socket.gethostname()
        for item, host, pid in private_copies(self.out):
            if host == here and is_done(part_dir(self.out, item)) and not process_alive(pid):
                shutil.rmtree(private_part_dir(self.out, item, pid, host), ignore_errors=True)


def _cause(err) -> str:
    """The worker's own error message (an MmtokError of the item), without Ray's traceback."""
    cause = getattr(err, "cause", None)
    return str(cause) if cause is not None else str(err).splitlines()[0]


def run_record(run: RayRun) -> dict:
    return asdict(run)
