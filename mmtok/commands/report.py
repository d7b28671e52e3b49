"""How every command reports what it did: one shape, one stream.

A summary goes to stderr as `mmtok COMMAND: headline` and then its detail lines, each indented by two
spaces. stdout is left to what a user pipes: `inspect` output, `plan --explain`, `status`,
`inspect --megatron`, and the one JSON object of a `--json` flag (docs/development.md lists them).
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.formats import skips

if TYPE_CHECKING:
    from mmtok.workers import TakeOver, WorkerRun


def print_summary(command: str, lines: str | Sequence[str]) -> None:
    """Print a summary on stderr: the first line after `mmtok COMMAND: `, the others indented."""
    lines = [lines] if isinstance(lines, str) else list(lines)
    text = [f"mmtok {command}: {lines[0]}"] + [f"  {line}" for line in lines[1:]]
    print("\n".join(text), file=sys.stderr)  # sys.stderr looked up now: a caller (or a test) may replace it


def print_report(command: str, lines: str | Sequence[str], result: dict | None = None) -> None:
    """A command's summary on stderr and, when its --json flag asked for it (`result` given), its result on stdout."""
    print_summary(command, lines)
    if result is not None:
        print_json(result)


def print_json(result: dict) -> None:
    """Print a command's result as one JSON object on one stdout line (paths as strings)."""
    print(json.dumps(result, sort_keys=True, default=_plain))


def _plain(value):
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # a NumPy scalar
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def reasons(by_reason: dict[str, int]) -> str:
    """`decode_error 2, missing_caption 1`: counts by reason, in reason order, as every summary lists them."""
    return ", ".join(f"{reason} {count:,}" for reason, count in sorted(by_reason.items()))


def refuse_nothing_usable(what: str, written: int, counts: dict[str, int], listed: Path | str,
                          extra: dict[str, int] | None = None, *, rank_of: tuple[str, int] | None = None) -> None:
    """The rule of every stage: a non-empty input (something skipped) from which nothing usable was written
    exits 2 with the counts by reason, after the stage printed its summary and kept its files (MmtokError).
    `counts` holds the stage's skip counters; `extra` more {reason: count} (e.g. failed items). A rank of a job of
    several (`rank_of` = (command, world size > 1)) only warns: under torchrun or srun its exit would stop the
    other ranks, and the job's verdict is merge's, which exits 2 when no rank wrote anything."""
    from mmtok.errors import MmtokError

    lost = Counter(skips.by_reason(counts)) + Counter(extra or {})
    lost.update({f"{reason} (whole file)": n for reason, n in skips.files_by_reason(counts).items()})
    if written or not lost:
        return
    message = (f"{what}: nothing usable was written -- every input was skipped ({reasons(lost)}; each named in "
               f"{listed})")
    if rank_of is not None and rank_of[1] > 1:
        print_summary(rank_of[0], f"warning: {message}; the other ranks go on (`mmtok merge` exits 2 if none wrote "
                                  "anything)")
        return
    raise MmtokError(f"{message}: check the inputs and the options above")


def plural(count: int, noun: str, many: str | None = None) -> str:
    """`1 rank`, `2 ranks`, `1,024 images`: the count (thousands separated) and the noun it takes;
    `many` is the plural where it is not noun + s (`plural(n, "batch", "batches")`)."""
    return f"{count:,} {noun if count == 1 else many or noun + 's'}"


def files_skipped(counts: dict[str, int], listed: Path | str) -> str:
    """"; N input files skipped (reason n, ...; named in LISTED)" for the inputs skipped whole (they hold no
    input to count), else ""."""
    files = skips.files_by_reason(counts)
    if not files:
        return ""
    return f"; {plural(sum(files.values()), 'input file')} skipped ({reasons(files)}; named in {listed})"


def listed(numbers: list[int], shown: int = 8) -> str:
    """`3, 5, 9 and 12 more`: the first `shown` of `numbers`, then how many more there are."""
    text = ", ".join(map(str, numbers[:shown]))
    return text + (f" and {len(numbers) - shown:,} more" if len(numbers) > shown else "")


# -- a worker of a job in work items (image encode, sft) -----------------------------------------------
def listed_in(worker: WorkerRun, files: str) -> str:
    """Where a worker's `files` are: `DIR/part-{00003..00007}/FILES`, or `FILES of N parts under DIR`."""
    where = parts_named(worker)
    return f"{files} of {where}" if " parts under " in where else f"{where}/{files}"


def parts_named(worker: WorkerRun) -> str:
    """The worker's parts: one path, the first and last as `DIR/part-{00003..00007}` when they are consecutive,
    else `N parts under DIR` (taken over from elsewhere, or own items other workers held)."""
    parts = worker.parts
    if not parts:
        return "no part"
    if len(parts) == 1:
        return parts[0]
    first, last = Path(parts[0]), Path(parts[-1])
    numbers = [int(Path(part).name.rpartition("-")[2]) for part in parts]
    if numbers != list(range(numbers[0], numbers[0] + len(numbers))):
        return f"{len(parts):,} parts under {first.parent}"
    return f"{first.parent}/{{{first.name}..{last.name}}}"


def take_over_lines(take_over: TakeOver) -> list[str]:
    """What the worker did beyond its own share: items taken over, own items left to their holder."""
    lines = []
    if take_over.taken_over:
        lines.append(f"took over {plural(len(take_over.taken_over), 'item')} of other workers' shares (no process "
                     f"held them): {listed(take_over.taken_over, 10)}")
    for item, error in sorted(take_over.failed.items()):
        lines.append(f"warning: item {item} (another worker's, taken over) failed and is left unfinished for its "
                     f"owner or a rerun: {error}")
    if take_over.discarded_copies:
        lines.append(f"{plural(len(take_over.discarded_copies), 'item')} had been published by another writer "
                     "first: this worker's copies were identical and are discarded "
                     f"({listed(take_over.discarded_copies, 10)})")
    if take_over.held_by_others:
        lines.append(f"left {plural(len(take_over.held_by_others), 'own item')} to the workers holding them: "
                     f"{listed(take_over.held_by_others, 10)}")
    return lines


def idle_worker_line(head: str, worker: WorkerRun, verb: str) -> str | None:
    """The headline of a worker that did no new work: none was left for it (`verb`: what it would have done,
    "encoded"), or its own items were already finished; None when it did work."""
    if not worker.parts:
        return (f"{head}: {verb} nothing: every work item is finished or held by another worker"
                + (", or failed here (below)" if worker.take_over.failed else ""))
    if worker.already_done:
        return (f"{head}: {plural(len(worker.items), 'own work item')} of {worker.num_items:,}, "
                f"{parts_named(worker)}, already finished ({plural(worker.sequences, 'sequence')}); nothing to do")
    return None


def refuse_unfinished(take_over: TakeOver) -> None:
    """A worker that took over items that failed and are still unfinished: the job is not done, and its exit
    status says so too (a SLURM task FAILED), after everything else was done."""
    from mmtok.errors import MmtokError

    unfinished = take_over.unfinished_failed
    if unfinished:
        raise MmtokError(f"{plural(len(unfinished), 'item')} this worker took over failed and "
                         f"{'is' if len(unfinished) == 1 else 'are'} not finished: {listed(unfinished, 10)} (the "
                         "warnings above say why); fix the cause, then rerun")
