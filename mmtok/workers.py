"""A worker of a job in work items (image encode, audio encode, sft): which items it takes, and what it did.

A job is cut into work items, one part each (`mmtok.formats.partdir`), whose number does not depend on the
number of workers (`mmtok.ranks`). Worker w of W does its own share first, then, with take-over, every item
nobody has finished or holds, from the far end down (`items_to_take`), so a slow or dead worker's items are
done by those that finished; `take_items` runs the worker's work over them until a stop request. What a worker
did is a typed result (`WorkerRun`, `TakeOver`; per item `ItemDone`, `ItemStop`) whose `to_json` is its
`--json` line. Shared by the stages that run in work items, so it lives below them; it reads only what the
part directories say: DONE (`mmtok.formats.partdir`) and who holds a part's lock (`mmtok.fsutil.WriterLock`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from mmtok.errors import MmtokError
from mmtok.formats import partdir
from mmtok.fsutil import LockHeld, WriterLock


def items_to_take(out: Path, count: int, own: range, take_over: bool, stopping: Callable[[], bool],
                  failed: dict[int, str]) -> Iterator[tuple[int, bool]]:
    """(item, whether it is the worker's own) in the order a worker of a job in `count` work items (one part
    each) takes them: its own items (`own`), then, with `take_over`, every item that is neither finished nor
    held by another process, from the far end down (where the other workers are furthest from), pass after
    pass until a pass finds none. An item killed half done is such an item: whoever takes it resumes its commit
    log. Two workers may still reach one item together: the part lock lets one write it, the other moves on
    (`LockHeld`). An item that `failed` for this worker (read as it grows), or whose part directory cannot be
    looked at, is not taken again. Items seen finished are not looked at again (DONE stays); `stopping()` ends
    the scan. Shared by the image encode (`mmtok.encode.runner`), the audio encode (`mmtok.encode.audio`, through
    `take_items`) and `mmtok sft` (`mmtok.sft.build`)."""
    yield from ((item, True) for item in own)
    finished: set[int] = set()
    while take_over:
        found = False
        for item in reversed(range(count)):
            if stopping():
                return
            if item in failed or item in finished:
                continue
            directory = partdir.part_dir(out, item)
            try:
                if partdir.is_done(directory):
                    finished.add(item)
                    continue
                if WriterLock.holder(directory) is not None:
                    continue
            except OSError as err:  # e.g. a file where the part's directory should be: its owner's error
                failed[item] = f"{directory}: {err.strerror or err}"
                continue
            found = True
            yield item, item in own
        if not found:
            return


class ItemOutcome(Protocol):
    """What `take_items` reads of a worker's result for one item."""

    stopped: bool  # a stop request ended the item: committed so far, not finished
    already_done: bool  # found finished: nothing was written


@dataclass(frozen=True)
class ItemDone:
    """A worker's result for one work item of a job in work items (image encode, sft): its part's counters as
    committed and where the part stands."""

    part_dir: str
    counts: dict[str, int]  # the part's counters (all its sessions)
    sequences: int  # sequences the part holds
    already_done: bool = False  # found finished: nothing was written
    stopped: bool = False  # a stop request ended it: committed up to `next_unit`, not finished
    next_unit: int = 0  # (stopped) the first unit (batch) not committed
    dataset: bool = False  # the part has a Megatron dataset (not one of items only, or empty)
    discarded: bool = False  # lock-free: another writer's identical copy was published first; this one is dropped
    planned: int = 0  # what the plan gives the item (images; 0 where there is no plan)
    fill_s: float = 0.0  # seconds before the device had its first batch, in this session


@dataclass(frozen=True)
class ItemStop:
    """Where a stop request ended a worker: the signal, the item, the next batch of it to encode (image encode)."""

    signal: str
    item: int
    next_batch: int | None = None

    def to_json(self) -> dict:
        return {"signal": self.signal, "item": self.item,
                **({} if self.next_batch is None else {"next_batch": self.next_batch})}


@dataclass(frozen=True)
class TakeOver:
    """What a worker did beyond its own share (`mmtok.commands.report.take_over_lines`)."""

    taken_over: list[int]  # other workers' items it finished
    held_by_others: list[int]  # own items another process held when it came to them, left to it
    failed: dict[int, str]  # others' items that failed here, and why
    unfinished_failed: list[int]  # of those, the ones nobody has finished since
    discarded_copies: list[int] | None = None  # lock-free image encode: items another writer published first

    def to_json(self) -> dict:
        return {"taken_over": self.taken_over, "held_by_others": self.held_by_others,
                "unfinished_failed": self.unfinished_failed, "take_over_failed": self.failed,
                **({} if self.discarded_copies is None else {"discarded_copies": self.discarded_copies})}


@dataclass
class ItemRun:
    """What one worker did with the work items `take_items` gave it."""

    done: list[ItemOutcome] = field(default_factory=list)  # the result of every item finished, stopped in or found done
    reached: list[int] = field(default_factory=list)  # those items, in the same order
    taken: list[int] = field(default_factory=list)  # other workers' items it finished
    held: list[int] = field(default_factory=list)  # own items another process held when it came to them
    failed: dict[int, str] = field(default_factory=dict)  # others' items that failed here, and why
    stopped: int | None = None  # the item a stop request ended the worker at (before it or inside it)

    def take_over(self, out: Path, discarded_copies: list[int] | None = None) -> TakeOver:
        """The take-over figures every worker's result reports."""
        unfinished = [item for item in self.failed if not partdir.is_done(partdir.part_dir(out, item))]
        return TakeOver(taken_over=self.taken, held_by_others=sorted(set(self.held) - set(self.reached)),
                        failed=self.failed, unfinished_failed=sorted(unfinished), discarded_copies=discarded_copies)


@dataclass(frozen=True)
class WorkerRun:
    """What one worker of a job in work items (image encode, sft) did: the items it finished, stopped in or found
    done, summed. `to_json` is its `--json` result (with the command's additions)."""

    items: range  # its own share
    num_items: int  # of the job
    counts: dict[str, int]  # the counters of the parts it reached, summed
    parts: list[str]  # those parts' directories, in the order reached
    sequences: int
    already_done: bool  # it reached items, all finished before it came
    stopped: ItemStop | None
    take_over: TakeOver

    @classmethod
    def of(cls, run: ItemRun, own: range, num_items: int, out: Path, stopped: ItemStop | None,
           discarded_copies: list[int] | None = None, **more):
        """What `run` did, summed; `more`: the fields a subclass adds (`mmtok.encode.runner.ImageWorkerRun`)."""
        counts: Counter = Counter()
        for done in run.done:
            counts.update(done.counts)
        return cls(items=own, num_items=num_items, counts=dict(counts), parts=[done.part_dir for done in run.done],
                   sequences=sum(done.sequences for done in run.done),
                   already_done=bool(run.done) and all(done.already_done for done in run.done), stopped=stopped,
                   take_over=run.take_over(out, discarded_copies), **more)

    def to_json(self) -> dict:
        return {"items": [self.items.start, self.items.stop], "num_items": self.num_items, "counts": self.counts,
                "parts": self.parts, "sequences": self.sequences, "already_done": self.already_done,
                "stopped": None if self.stopped is None else self.stopped.to_json(), **self.take_over.to_json()}


def take_items(out: Path, count: int, own: range, take_over: bool, stopping: Callable[[], bool],
               work: Callable[[int], ItemOutcome]) -> ItemRun:
    """Run `work(item)` (its result) over the items `items_to_take` gives, until a stop request: before an item,
    inside one (its result says `stopped`), or during the take-over scan (then `stopped` is the next unfinished item,
    None when none is left). An item another process holds (`LockHeld`) is left to it with
    `take_over`, else the error; an own item's MmtokError is the worker's, another's is recorded (`failed`) and
    the worker goes on."""
    run = ItemRun()
    for item, own_item in items_to_take(out, count, own, take_over, stopping, run.failed):
        if stopping():
            run.stopped = item
            break
        try:
            result = work(item)
        except LockHeld:  # another worker took it over (or took it first): theirs; without take-over, an error
            if not take_over:
                raise
            if own_item:  # (another's item taken first by a third worker is no news)
                run.held.append(item)
            continue
        except MmtokError as err:
            if own_item:
                raise
            run.failed[item] = str(err)
            continue
        run.done.append(result)
        run.reached.append(item)
        if result.stopped:
            run.stopped = item
            break
        if not own_item and not result.already_done:
            run.taken.append(item)
    if run.stopped is None and stopping():  # the stop ended the take-over scan: is anything left for a requeue?
        run.stopped = _next_unfinished(out, range(count) if take_over else own, run.failed)
    return run


def _next_unfinished(out: Path, items, failed: dict[int, str]) -> int | None:
    """The item a worker would have taken next (from the far end): one of `items` not finished and not failed."""
    return next((item for item in reversed(items) if item not in failed
                 and not partdir.is_done(partdir.part_dir(out, item))), None)
