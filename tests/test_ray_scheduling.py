"""The Ray driver's scheduling decisions (`mmtok.encode.ray_driver._Driver`), replayed on a simulated cluster:
workers of given speeds that run their calls one after another on a simulated clock, so that the tail, a death
and a cancelled call happen at exactly known moments. (tests/test_encode_ray.py runs the real thing on a local
Ray cluster; its faults come from outside and cannot place a worker's second call at will.)

What the simulation keeps of Ray: a call reaches its actor TRIP_S after the driver made it, and an actor runs
its calls in the order they were made; `cancel` of a call that has not begun drops it (its result is
`TaskCancelledError` once the actor comes to it, as Ray 2.60 was seen to do), of one that has begun does nothing
(`cancel_fails`: Ray runs it all the same); a killed actor's calls all fail with `RayActorError`; `wait`
returns the calls finished by the time it returns, else nothing after its timeout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mmtok.encode.ray_driver import DEPTH, RayRun, _Driver
from mmtok.workers import ItemDone

ITEM_S = 1.0  # simulated seconds of one item at speed 1
START_S = 3.0  # simulated seconds for a worker to load the codec
TRIP_S = 0.05  # from the driver's call to the worker receiving it (what a second call in flight hides)


class RayError(Exception):
    pass


class RayTaskError(RayError):
    pass


class RayActorError(RayError):
    pass


class TaskCancelledError(RayError):
    pass


class Call:
    def __init__(self, actor, kind: str, item: int | None = None):
        self.actor, self.kind, self.item = actor, kind, item
        self.begun = self.finished = None
        self.made = actor.sim.now
        self.cancelled = self.stalled = False
        self.result = None  # ("value", x) or ("error", exception)


class Actor:
    def __init__(self, sim, index: int):
        self.sim, self.index, self.calls, self.alive = sim, index, [], True
        self.speed = sim.speeds[index] if index < len(sim.speeds) else 1.0
        self.start = SimpleNamespace(remote=lambda: self._call("start"))
        self.encode = SimpleNamespace(remote=lambda item, lock_free: self._call("encode", item))

    def _call(self, kind: str, item: int | None = None) -> Call:
        call = Call(self, kind, item)
        self.calls.append(call)
        if kind == "encode":  # (whether every worker had started, this worker's calls not finished)
            started = all(a.calls[0].finished is not None for a in self.sim.actors)
            self.sim.depths.append((started, sum(c.finished is None for c in self.calls)))
        self.sim.begin_next(self)
        return call


class Sim:
    """The slice of the `ray` module the driver uses, on a simulated clock."""

    exceptions = SimpleNamespace(RayError=RayError, RayTaskError=RayTaskError, RayActorError=RayActorError,
                         TaskCancelledError=TaskCancelledError)

    def __init__(self, speeds=(), kill: tuple[int, float] | None = None, stall_backed_up: bool = False,
                 stall: frozenset = frozenset(), cancel_fails: bool = False):
        self.speeds, self.kill_at, self.stall_backed_up = list(speeds), kill, stall_backed_up
        self.stall, self.cancel_fails = stall, cancel_fails  # stall: (actor, item) calls that never finish
        self.now, self.actors, self.begun, self.published = 0.0, [], [], set()
        self.cancelled_items: list[int] = []
        self.cancel_requests: list[Call] = []
        self.depths: list[tuple[bool, int]] = []
        self.steps = 0

    def remote(self, **resources):
        return lambda cls: SimpleNamespace(remote=lambda *args: self._actor())

    def _actor(self) -> Actor:
        self.actors.append(Actor(self, len(self.actors)))
        return self.actors[-1]

    def begin_next(self, actor: Actor) -> None:
        """The actor's first call not finished begins now, if it has not (a cancelled one finishes at once)."""
        for call in actor.calls:
            if call.finished is not None:
                continue
            if call.begun is None:
                call.begun = max(self.now, call.made + TRIP_S)
                if call.cancelled:
                    self._finish(call, ("error", TaskCancelledError()))
                    continue
                if call.kind == "encode":
                    self.begun.append((actor.index, call.item))
                    # the first copy to begin of an item whose waiting call was cancelled: it never finishes
                    call.stalled = (actor.index, call.item) in self.stall or self.stall_backed_up and \
                        call.item in self.cancelled_items[:1] and sum(item == call.item for _, item in self.begun) == 1
            return

    def _due(self, call: Call) -> float:
        if call.kind == "start":
            return call.begun + START_S
        return float("inf") if call.stalled else call.begun + ITEM_S / call.actor.speed

    def _finish(self, call: Call, result) -> None:
        call.finished, call.result = self.now, result
        if result[0] == "value" or call.actor.alive:
            self.begin_next(call.actor)

    def _complete(self, call: Call) -> None:
        if call.kind == "start":
            self._finish(call, ("value", ("host", 1000 + call.actor.index)))
            return
        discarded = call.item in self.published  # a second copy: found identical and removed
        self.published.add(call.item)
        done = ItemDone(f"parts/part-{call.item:05d}", {"images_written": 1}, 1, discarded=discarded)
        self._finish(call, ("value", done))

    def wait(self, refs, num_returns=1, timeout=None):
        self.steps += 1
        assert self.steps < 10_000, "the driver does not finish"
        deadline = self.now + (timeout if timeout is not None else float("inf"))
        while True:
            done = [ref for ref in refs if ref.finished is not None]
            if len(done) >= num_returns:
                return done[:num_returns], [ref for ref in refs if ref not in done[:num_returns]]
            heads = [c for a in self.actors if a.alive for c in a.calls if c.begun is not None and c.finished is None]
            kill = self.kill_at[1] if self.kill_at and self.actors[self.kill_at[0]].alive else float("inf")
            when = min([self._due(c) for c in heads] + [kill])
            if when > deadline:
                self.now = deadline
                return [], list(refs)
            self.now = when
            if when == kill:
                self.kill(self.actors[self.kill_at[0]])
                continue
            self._complete(min(heads, key=self._due))

    def get(self, ref):
        kind, value = ref.result
        if kind == "error":
            raise value
        return value

    def cancel(self, ref) -> None:
        self.cancel_requests.append(ref)
        if ref.begun is None and not self.cancel_fails:
            ref.cancelled = True
            self.cancelled_items.append(ref.item)

    def kill(self, actor: Actor) -> None:
        actor.alive = False
        for call in actor.calls:
            if call.finished is None:
                self._finish(call, ("error", RayActorError()))


def drive(sim: Sim, items: int, workers: int, tmp_path) -> RayRun:
    run = RayRun(items=items, to_do=items)
    _Driver(sim, run, list(range(items)), ("plan", str(tmp_path), "codec", "ckpt", "cpu", {}), workers, False,
            False, None).run()
    assert sorted(run.finished) == list(range(items))  # every item once
    assert sim.published == set(range(items))
    return run


def test_each_worker_gets_a_second_call_once_all_have_started_and_never_more(tmp_path):
    sim = Sim()
    drive(sim, 40, 4, tmp_path)
    assert max(depth for started, depth in sim.depths if not started) == 1
    assert max(depth for started, depth in sim.depths if started) == DEPTH == 2
    for actor in sim.actors:  # items begin back to back on a worker: no driver round trip between them
        encodes = [c for c in actor.calls if c.kind == "encode"][:10]  # (then backups at the tail: idle time)
        assert all(b.begun == a.finished for a, b in zip(encodes, encodes[1:], strict=False))
    assert sim.now <= START_S + 40 * ITEM_S / 4 + 2 * TRIP_S  # the ideal, and the first call's trip


def test_the_slow_worker_s_waiting_item_is_backed_up_at_the_tail_and_cancelled_there(tmp_path):
    sim = Sim(speeds=[1.0, 1.0, 1.0, 0.25])
    run = drive(sim, 40, 4, tmp_path)
    slow = sim.actors[3]
    cancelled = [c for c in slow.calls if c.cancelled]
    assert cancelled and all(isinstance(c.result[1], TaskCancelledError) for c in cancelled)
    assert not any(c.item == cancelled[0].item for c in slow.calls if c.begun is not None and not c.cancelled)
    assert run.backups >= 1 and run.backups_won >= 1 and run.retries == 0  # the backup was the only copy to run
    assert sim.now <= START_S + 40 * ITEM_S / 3.25 + ITEM_S  # within one item of the ideal


def test_a_dead_worker_s_running_item_is_a_retry_and_its_waiting_item_goes_back(tmp_path):
    sim = Sim(kill=(1, START_S + 2.5))  # worker 1 dies inside its third item, one more waiting behind it
    run = drive(sim, 20, 3, tmp_path)
    dead = sim.actors[1]
    lost = [c for c in dead.calls if isinstance(c.result[1], RayActorError)]
    assert [c.begun is not None for c in lost] == [True, False]  # the one it ran, the one that waited
    assert run.workers_lost == 1 and run.retries == 1 and len(sim.actors) == 4  # one worker in its place
    assert {c.item for c in lost} <= {item for index, item in sim.begun if index != 1}  # both done elsewhere


def test_a_backup_whose_cancelled_original_left_it_alone_is_backed_up_again(tmp_path):
    """The item waiting on the slow worker is backed up and cancelled there; the backup stalls. It is the item's
    only copy now, so an idle worker backs it up again (without that, the job would never end)."""
    sim = Sim(speeds=[1.0, 1.0, 0.25], stall_backed_up=True)
    drive(sim, 20, 3, tmp_path)
    item = sim.cancelled_items[0]
    assert len([index for index, begun in sim.begun if begun == item]) == 2


@pytest.mark.parametrize("speeds", [[1.0, 0.5], [0.5, 1.0, 1.0, 1.0, 1.0], [1.0] * 7 + [0.5]])
def test_with_a_half_speed_worker_the_job_ends_within_an_item_of_the_ideal(tmp_path, speeds):
    sim = Sim(speeds=speeds)
    drive(sim, 30, len(speeds), tmp_path)
    assert sim.now <= START_S + 30 * ITEM_S / sum(speeds) + ITEM_S


def test_a_slow_worker_dying_while_its_cancelled_call_waits_leaves_the_backup_free_to_be_backed_up(tmp_path):
    """Item waiting on the slow worker: backed up, cancelled there; the backup stalls; then the slow worker dies
    before it came to the cancelled call. The stalled backup is the item's only copy: backed up again."""
    sim = Sim(speeds=[1.0, 1.0, 0.1], stall_backed_up=True, kill=(2, 12.5))
    run = drive(sim, 20, 3, tmp_path)
    assert run.workers_lost == 1 and run.backups >= 2


def test_a_worker_dying_inside_a_backup_still_leaves_every_item_finished_once(tmp_path):
    """Worker 0 dies inside the backup of the slow worker's waiting item (whose call there is cancelled): the
    item goes back to the queue; every copy of it worker 1 begins stalls. Copies elsewhere finish it."""
    sim = Sim(speeds=[1.0, 1.0, 0.1], stall=frozenset({(1, 5)}), kill=(0, 12.5))
    run = drive(sim, 20, 3, tmp_path)
    assert run.workers_lost == 1 and run.retries == 1


def test_a_cancel_ray_does_not_honour_runs_a_second_identical_copy(tmp_path):
    """(Its copy is found identical and removed, or stopped with the workers at the end: each item once.)"""
    sim = Sim(speeds=[1.0, 1.0, 1.0, 0.25], cancel_fails=True)
    run = drive(sim, 40, 4, tmp_path)
    assert run.backups >= 1 and any(call.begun is not None for call in sim.cancel_requests)
