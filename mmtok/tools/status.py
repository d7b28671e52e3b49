"""A read-only view of an encode output while it runs or after it finished: `job_status(out, plan)`.

Every part under `OUT/parts/` is read through `mmtok.formats.partdir` (identity, DONE) and
`mmtok.formats.commitlog` (commit records), and nothing is written, locked or created: status is safe beside
running ranks. A part is

  done      DONE is present (the part is finished)
  running   another process holds the part's writer lock (seen with F_GETLK, which takes no lock)
  stopped   it has an identity or commits, no DONE, and no writer: killed or failed; rerunning the
            same encode command resumes it
  missing   an expected part (0 .. num_parts-1 of the identities) without a directory, or with a
            directory whose encode never got as far as writing the identity
  damaged   its identity or commit log cannot be read (the reason is the one-line error), or its
            identity is from another encode run than the first readable part's (the same keys
            `mmtok merge` compares, `mmtok.formats.parts.shared_identity`; the reason names the first that differs)

Tokens are the committed sequences' plus the part's `item_tokens` counter (the image blocks and
template ids of documents of several images, which merge assembles). Times are the parts' own
counters (`wall_ms`, `device_busy_ms`, summed over every session that wrote the part; model loading
and the gaps between sessions are not in them). The measured imbalance
(images, once every part is done) is max/mean - 1 of the parts' wall seconds, idle parts included,
the same formula as the plan's modeled imbalance (`mmtok.ranks.imbalance` over rank costs).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Iterator

import numpy as np

from mmtok.errors import DamagedFile, MmtokError
from mmtok.formats import commitlog, partdir, skips
from mmtok.formats.parts import shared_identity, timing_stats
from mmtok.fsutil import WriterLock
from mmtok.ranks import imbalance, rank_costs

STATES = ("done", "running", "stopped", "missing", "damaged")
INPUT_STAGES = ("scan", "plan", "encode")  # the stages of `input_table` that drop rows, by reason
RESUME_HINT = "rerun the same {command} command to resume"
SLOWEST = 5
SLOW_SPEED = 0.75  # a part progressing below this share of the median pace is worth moving to another node
STALL_UNITS, STALL_S = 10, 600  # a running part silent for this many of its units (and seconds) may hang


def stage_command(modality: str | None) -> str:
    """The command that writes (and resumes) a job's parts."""
    return "mmtok sft" if modality == "sft" else "mmtok encode"


# -- the result ----------------------------------------------------------------------------------------
# `mmtok status --json` prints a JobStatus as `to_json()` gives it: the fields of each class, in their order.


@dataclass(frozen=True)
class PartStatus:
    """One part: its state, what it committed and its figures (see the module docstring)."""

    part: int
    state: str
    detail: str | None
    directory: str
    units_done: int  # commit records
    tokens: int  # committed sequences' tokens plus the part's item tokens
    silent_s: float | None  # seconds since its writer last showed life; None unless another process holds it
    holder: str | None  # the writer lock's holder line
    last_commit_at: str | None  # local ISO 8601 time of the last commit
    units_planned: int | None  # its planned units (batches); audio: known once done
    written: int  # inputs turned into tokens (`_written`)
    skipped: int
    wall_s: float
    device_busy_s: float
    device_busy_fraction: float
    tokens_per_s: float
    per_s: float  # inputs written per wall second
    eta_s: float | None  # 0 once done; None when unknown
    projected_s: float  # wall seconds so far plus the ETA
    progress: float | None  # share of its work done
    pace_s: float | None  # wall seconds per unit of work
    work_done: float  # plan cost with a plan, else units
    work_planned: float | None
    wall_share: float | None = None  # of the parts' summed wall seconds
    modeled_share: float | None = None  # of the plan's modeled rank costs
    speed: float | None = None  # the median pace over its own (0.5: half as fast)
    expected_s: float | None = None  # its planned work at the median pace


@dataclass(frozen=True)
class Curation:
    """What the plan's duplicate list (`plan --exclude`) dropped of its source."""

    source: str
    list: str
    rows: int
    by_reason: dict[str, int]


@dataclass(frozen=True)
class Totals:
    units_done: int
    units_planned: int | None
    written: int
    skipped: int
    tokens: int
    wall_s: float
    device_busy_s: float
    device_busy_fraction: float


@dataclass(frozen=True)
class Imbalance:
    """max/mean - 1: `measured` of the parts' wall seconds once every part is done (images), `modeled` by the
    plan's cost model for `world_size` ranks (or items); None where not known."""

    measured: float | None
    modeled: float | None
    world_size: int
    plan_world_size: int | None


@dataclass(frozen=True)
class Stalled:
    """A running part silent for longer than `limit_s`: its node may hang."""

    action: str = field(default="stalled", init=False)
    part: int
    silent_s: float
    unit_s: float  # seconds per unit: its own, or the others' before its first commit
    first: bool  # it has committed nothing yet
    limit_s: float
    expected_s: float | None  # a work item's expected duration (None for a rank's part)


@dataclass(frozen=True)
class Slow:
    """A running part below SLOW_SPEED of the median pace."""

    action: str = field(default="slow", init=False)
    part: int
    speed: float


@dataclass(frozen=True)
class Waiting:
    """Parts that do not finish by themselves: `resume` (stopped) or `not_started` (missing)."""

    action: str
    parts: list[int]


@dataclass(frozen=True)
class Tail:
    """The end of the job: the running parts, slowest to finish first, and what to do about the tail."""

    running: list[int]
    median_pace_s: float | None
    actions: list[Stalled | Slow | Waiting]


@dataclass
class InputRow:
    """Where the manifest rows of one input went (`input_table`): rows = scan + plan + encode + written +
    pending, each of the first three by reason."""

    input: str
    rows: int = 0
    scan: dict[str, int] = field(default_factory=dict)
    plan: dict[str, int] = field(default_factory=dict)
    encode: dict[str, int] = field(default_factory=dict)
    written: int = 0
    pending: int = 0

    def stages(self) -> dict[str, dict[str, int]]:
        """The rows each of INPUT_STAGES dropped, by reason."""
        return {"scan": self.scan, "plan": self.plan, "encode": self.encode}

    def dropped(self, stage: str, reason: str) -> None:
        """One more row `stage` dropped for `reason` (while `input_table` counts)."""
        reasons = self.stages()[stage]
        reasons[reason] = reasons.get(reason, 0) + 1

    def add(self, done: bool, rows: int) -> None:
        """`rows` more written (a finished part's) or pending (an unfinished part's)."""
        if done:
            self.written += rows
        else:
            self.pending += rows


@dataclass(frozen=True)
class JobStatus:
    """`job_status`'s result."""

    out: str
    modality: str | None
    item: str  # what a part's inputs are: image, clip, conversation
    work_items: bool  # the parts are the plan's work items (image encode), not rank ranges
    takes_over: bool  # running workers take pending items over (a shard: audio)
    curation: Curation | None
    num_parts: int
    states: dict[str, int]  # parts per state (STATES)
    totals: Totals
    eta_s: float | None
    slowest: list[int]
    imbalance: Imbalance
    tail: Tail
    warnings: list[str]
    parts: list[PartStatus]
    inputs: list[InputRow] | None = None  # `--inputs`: `input_table`

    def to_json(self) -> dict:
        """The JSON object `mmtok status --json` prints (no `inputs` key unless they were added)."""
        document = dataclasses.asdict(self)
        if self.inputs is None:
            del document["inputs"]
        return document


def job_status(out: str | os.PathLike, plan: str | os.PathLike | None = None) -> JobStatus:
    """The state and figures of every part of encode output `out`, the job totals, the slowest parts,
    the ETA and the balance (measured, and modeled from `plan` when given). Reads only.

    Raises MmtokError when `out` has no parts directory, or when `plan` is not the plan the parts
    were encoded from. A damaged part is reported (state "damaged"), never raised.
    """
    out = Path(out)
    if not partdir.parts_root(out).is_dir():
        raise MmtokError(f"{out}: no parts directory ({partdir.parts_root(out)}); run `mmtok encode --out {out}` "
                         "(or `mmtok sft`) first")
    found = {number: _read_part(number, directory) for number, directory in partdir.part_directories(out)}
    identities, warnings = _one_run(found)
    modality = identities[0].get("modality") if identities else None
    if plan is not None and modality == "audio":
        raise MmtokError(f"{out}: an audio output has no plan (its parts are Shar shards); drop --plan")
    opened = _open_plan(plan) if plan is not None else None
    num_parts = _num_parts(identities, found, opened)
    model = _plan_model(opened, identities, num_parts) if opened is not None and num_parts else None
    read = [found.get(n) or _missing(n, partdir.part_dir(out, n), span=_sft_units(n, identities))
            for n in range(num_parts)]
    read += [p for n, p in sorted(found.items()) if n >= num_parts]
    items = _items(identities)
    parts, median = _judged(_shared([_figures(p, model) for p in read], model))
    item = {"audio": "clip", "sft": "conversation"}.get(modality, "image")
    return JobStatus(out=str(out), modality=modality, item=item, work_items=items,
                     takes_over=items or modality == "audio",
                     curation=_curation(opened) if opened is not None else None, num_parts=num_parts,
                     states={s: sum(p.state == s for p in parts) for s in STATES}, totals=_totals(parts, model),
                     eta_s=_job_eta(parts),
                     slowest=[p.part for p in sorted(parts, key=lambda p: -p.projected_s)[:SLOWEST] if p.wall_s],
                     imbalance=_imbalance(parts, modality, model, num_parts), tail=_tail(parts, median, items),
                     warnings=warnings, parts=parts)


# -- reading one part --------------------------------------------------------------------------------
@dataclass(frozen=True)
class _PartFiles:
    """What a part's directory says (before any figure): its state, identity and last commit record."""

    part: int
    state: str
    detail: str | None
    directory: str
    units_done: int = 0
    tokens: int = 0
    silent_s: float | None = None
    holder: str | None = None
    last_commit_at: str | None = None
    counts: dict = field(default_factory=dict)  # the last commit record's counters
    span: list[int] | None = None  # [start, end) units planned: its identity's `part_batches` (sft: `part_units`)
    identity: dict | None = None


def _missing(number: int, directory: Path, detail: str = "not started: no part directory", span=None) -> _PartFiles:
    return _PartFiles(number, "missing", detail, str(directory), span=span)


def _sft_units(number: int, identities: list[dict]) -> list[int] | None:
    """[start, end) units of `mmtok sft` work item `number` (`mmtok.sft.build.work_items`: UNITS_PER_ITEM each, the
    last fewer), from what the run's parts record; None for other jobs (an image part's batches are the plan's)."""
    items = identities[0].get("work_items") if identities and identities[0].get("modality") == "sft" else None
    if not isinstance(items, dict) or not {"units_per_item", "units"} <= items.keys():
        return None
    start = number * items["units_per_item"]
    return [start, min(start + items["units_per_item"], items["units"])]


def _damaged(number: int, directory: Path, detail: str) -> _PartFiles:
    return _PartFiles(number, "damaged", detail, str(directory))


def _read_part(number: int, directory: Path) -> _PartFiles:
    """State, identity, counters and progress of one part directory, from its files alone."""
    holder = WriterLock.holder(directory)
    if not (directory / partdir.IDENTITY).is_file():
        if holder:
            return replace(_missing(number, directory, f"starting (no identity yet); holder: {holder}"),
                           state="running")
        if any(p.name != WriterLock.NAME for p in directory.iterdir()):
            return _damaged(number, directory, f"{directory}: files but no {partdir.IDENTITY} (damaged, or not an "
                            "mmtok part); delete the directory and rerun its encode command")
        return _missing(number, directory, "not started: the encode stopped before it wrote the part's identity")
    try:
        identity = partdir.read_identity(directory)
    except DamagedFile as err:  # names the file and the key
        return _damaged(number, directory, f"{err}; or delete the directory and rerun its encode command")
    except (ValueError, OSError) as err:
        return _damaged(number, directory, f"{directory / partdir.IDENTITY}: unreadable ({err}); delete the "
                        "directory and rerun its encode command")
    try:
        records, _ = commitlog.read_commits(directory)
    except MmtokError as err:
        return _damaged(number, directory, str(err))
    if partdir.is_done(directory):
        state, detail = "done", None
    elif holder:
        state, detail = "running", f"holder: {holder}"
    else:
        state, detail = "stopped", RESUME_HINT.format(command=stage_command(identity.get("modality")))
    counts = dict(records[-1]["counts"]) if records else {}
    return _PartFiles(number, state, detail, str(directory), units_done=len(records),
                      tokens=sum(n for record in records for n in record["lengths"]) + counts.get("item_tokens", 0),
                      silent_s=_silent_s(directory) if holder else None, holder=holder,
                      last_commit_at=_last_commit_at(directory) if records else None, counts=counts,
                      span=identity.get("part_batches", identity.get("part_units")),  # sft: its units
                      identity=identity)


def _silent_s(directory: Path) -> float:
    """Seconds since the part's writer last showed life: its last commit (the commit log's mtime) or its
    session start (the lock file's mtime: the holder line is written when the lock is taken)."""
    touched = [(directory / name).stat().st_mtime for name in (partdir.COMMITS, WriterLock.NAME)
               if (directory / name).is_file()]
    return max(0.0, time.time() - max(touched)) if touched else 0.0


def _last_commit_at(directory: Path) -> str:
    """When the part's last commit was made (the commit log's mtime), as local ISO 8601 time with its offset."""
    mtime = (directory / partdir.COMMITS).stat().st_mtime
    return datetime.fromtimestamp(mtime).astimezone().isoformat(timespec="seconds")


def _one_run(found: dict[int, _PartFiles]) -> tuple[list[dict], list[str]]:
    """The identities of the parts of one encode run (the first readable part's), and a warning naming
    the parts of another run, which become "damaged" in `found` with the first identity key that differs."""
    identities, foreign, reference = [], [], None
    for number, part in list(found.items()):
        if part.identity is None:
            continue
        if reference is None:
            reference = number, shared_identity(part.identity)
        difference = partdir.identity_difference(reference[1], shared_identity(part.identity))
        if difference is None:
            identities.append(part.identity)
            continue
        foreign.append(number)
        found[number] = _damaged(number, Path(part.directory),
                                 f"{part.directory}: from another encode run than part {reference[0]}, "
                                 f"{difference}; delete it or give each run its own --out")
    warnings = [f"not from the encode run of part {reference[0]}: part(s) {', '.join(map(str, foreign))}; use one "
                "--out per run"] if foreign else []
    return identities, warnings


def _num_parts(identities: list[dict], found: dict[int, _PartFiles], plan) -> int:
    """How many parts the job has: its identities' `num_parts` (one run's, so they agree); without one,
    the plan's world size or the highest part directory."""
    if identities and "num_parts" in identities[0]:
        return int(identities[0]["num_parts"])
    return max(plan.world_size if plan is not None else 0, max(found, default=-1) + 1)


# -- the plan's cost model ---------------------------------------------------------------------------
def _curation(plan) -> Curation | None:
    """What the plan's duplicate list (`plan --exclude`) dropped of its source, by reason; None without one."""
    exclude = plan.meta.exclude
    if not exclude:
        return None
    by_reason = plan.meta.dropped_by_reason
    listed = {reason: by_reason[reason] for reason in ("duplicate", "contaminated", "caption_flagged")
              if by_reason.get(reason)}
    return Curation(source=exclude.source, list=exclude.directory, rows=exclude.rows, by_reason=listed)


def _open_plan(directory: str | os.PathLike):
    """`Plan.open(directory)`; pyarrow is imported only when a plan is asked for."""
    from mmtok.formats.plan import Plan

    return Plan.open(directory)


@dataclass(frozen=True)
class _PlanModel:
    """The plan's batch costs as the parts share them."""

    prefix: np.ndarray  # cumulative batch cost, 0 first: the cost of batches [a, b) is prefix[b] - prefix[a]
    ranges: np.ndarray  # [start, end) batches of each part
    per_rank: np.ndarray  # modeled cost of each part
    num_batches: int
    imbalance: float
    plan_world_size: int


def _plan_model(plan, identities: list[dict], num_parts: int) -> _PlanModel:
    """Batch costs, rank ranges and modeled imbalance of `plan` for `num_parts` ranks (the plan's
    own figure when that is its world size, else re-derived as encode re-derives the ranges)."""
    from mmtok.formats.plan import BATCHES_FILE

    recorded = {i.get("plan_fingerprint") for i in identities} - {None}
    if recorded and recorded != {plan.meta.fingerprint}:
        raise MmtokError(f"{plan.directory}: not the plan these parts were encoded from (fingerprint "
                         f"{plan.meta.fingerprint[:12]}..., parts {sorted(f[:12] for f in recorded)}); pass the "
                         "--plan given to `mmtok encode`")
    costs = plan.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
    ranges = part_ranges(plan, _items(identities), num_parts)
    per_rank = rank_costs(costs, ranges)
    same = num_parts == plan.world_size and not _items(identities)
    return _PlanModel(prefix=np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)]), ranges=ranges,
                      per_rank=per_rank, num_batches=plan.meta.num_batches,
                      imbalance=float(plan.meta.imbalance) if same else imbalance(per_rank),
                      plan_world_size=plan.world_size)


def part_ranges(plan, items: bool, num_parts: int) -> np.ndarray:
    """[start, end) batches of each part: the plan's work items for parts that are items (image encode), else
    the rank ranges of `num_parts` ranks (`mmtok sft`, and parts written before work items)."""
    return plan.work_items() if items else plan.ranges(num_parts)


def _items(identities: list[dict]) -> bool:
    """Whether the parts are the plan's work items (image encode), not rank ranges."""
    return any("work_items" in identity for identity in identities)


# -- figures -----------------------------------------------------------------------------------------
def _figures(files: _PartFiles, model: _PlanModel | None) -> PartStatus:
    """Progress, throughput and ETA of one part (see the module docstring for what each means)."""
    written = _written(files.counts)
    timing = timing_stats({**files.counts, "tokens": files.tokens, "item_tokens": 0})  # part tokens include items
    wall = timing["wall_s"]
    span = _planned_range(files.part, files.span, model)
    done = files.state == "done"
    if span is not None:
        planned = span[1] - span[0]
    else:
        planned = files.units_done if done else None  # audio: known once done
    work_done, work_planned = _work(files.units_done, planned, span, model)
    eta = 0.0 if done else _eta(files.units_done, wall, span, model)
    return PartStatus(part=files.part, state=files.state, detail=files.detail, directory=files.directory,
                      units_done=files.units_done, tokens=files.tokens, silent_s=files.silent_s, holder=files.holder,
                      last_commit_at=files.last_commit_at, units_planned=planned, written=written,
                      skipped=skips.total(files.counts, failed_items=True), **timing,
                      per_s=written / wall if wall else 0.0, eta_s=eta, projected_s=wall + (eta or 0.0),
                      progress=1.0 if done else (work_done / work_planned if work_planned else None),
                      pace_s=_pace(wall, work_done), work_done=work_done, work_planned=work_planned)


def _written(counts: dict) -> int:
    """Inputs a part turned into tokens: images written as documents or handed on as items
    (`images_deferred`); audio: clips encoded (known once assembled); sft: conversations written."""
    if "encoded" in counts:
        return counts["encoded"]
    if "conversations" in counts:  # mmtok sft: conversations written
        return counts.get("documents_written", 0)
    return counts.get("images_written", 0) + counts.get("images_deferred", 0)


def _planned_range(number: int, identity_range, model: _PlanModel | None) -> tuple[int, int] | None:
    """[start, end) global batches of an image part: its identity's, else (a missing part) the plan's."""
    if identity_range:
        return tuple(identity_range)
    if model is not None and number < len(model.ranges):
        return tuple(int(x) for x in model.ranges[number])
    return None


def _eta(units_done: int, wall_s: float, span: tuple[int, int] | None, model: _PlanModel | None) -> float | None:
    """Seconds the part still needs at its pace so far: the remaining share of its plan cost (with a
    plan), else its remaining batches x its mean seconds per batch; None when unknown."""
    if span is None or not units_done or not wall_s:
        return None
    start, end = span
    reached = start + units_done
    if model is not None:
        done_cost = model.prefix[reached] - model.prefix[start]
        if done_cost > 0:
            return float(wall_s * (model.prefix[end] - model.prefix[reached]) / done_cost)
    return wall_s * (end - reached) / units_done


def _work(units_done: int, units_planned: int | None, span: tuple[int, int] | None,
          model: _PlanModel | None) -> tuple[float, float | None]:
    """(work done, work planned) of a part: plan cost with a plan, else batches (audio: units)."""
    if span is None:
        return float(units_done), units_planned
    start, end = span
    if model is not None:
        prefix = model.prefix
        return float(prefix[start + units_done] - prefix[start]), float(prefix[end] - prefix[start])
    return float(units_done), float(end - start)


def _pace(wall_s: float, done: float) -> float | None:
    """Wall seconds per unit of work (None before the first commit): what `_tail` compares between parts."""
    return wall_s / done if wall_s and done else None


def _shared(parts: list[PartStatus], model: _PlanModel | None) -> list[PartStatus]:
    """The parts with their share of the summed wall seconds, and (with a plan) of the modeled rank cost."""
    wall = sum(p.wall_s for p in parts)
    cost = float(model.per_rank.sum()) if model is not None else 0.0

    def modeled(part: PartStatus) -> float | None:
        known = model is not None and cost > 0 and part.part < len(model.per_rank)
        return float(model.per_rank[part.part]) / cost if known else None

    return [replace(p, wall_share=p.wall_s / wall if wall else None, modeled_share=modeled(p)) for p in parts]


def _judged(parts: list[PartStatus]) -> tuple[list[PartStatus], float | None]:
    """The parts with their speed (the median pace of the parts that made progress over its own, so 0.5 = half
    as fast) and expected duration (its planned work at the median pace); and that median pace."""
    paces = [p.pace_s for p in parts if p.pace_s]
    median = float(np.median(paces)) if paces else None
    return [replace(p, speed=median / p.pace_s if median and p.pace_s else None,
                    expected_s=p.work_planned * median if median and p.work_planned else None)
            for p in parts], median


def _tail(parts: list[PartStatus], median: float | None, items: bool = False) -> Tail:
    """The end of the job: the running parts slowest-to-finish first, and what to do about the tail: move slow or
    silent running parts to another node, resume stopped ones, and parts not started (in a SLURM array they start
    as slots free up). A running work item (`items`) is silent too long once its last sign of life is older than
    the whole item should take; a rank's part (written before work items; much longer) once it is older than
    STALL_UNITS of its batches."""
    running = sorted((p for p in parts if p.state == "running"),
                     key=lambda p: -(p.eta_s if p.eta_s is not None else np.inf))
    units = [p.wall_s / p.units_done for p in parts if p.units_done and p.wall_s]
    typical = float(np.median(units)) if units else None  # for a part that has committed nothing yet
    actions: list[Stalled | Slow | Waiting] = []
    for part in running:
        own = part.wall_s / part.units_done if part.units_done else None
        per_unit = own or typical  # a part that hangs before its first commit is judged by the others' pace
        silent = part.silent_s  # None where this process holds the part's lock itself
        limit = _silence_limit(part, per_unit, items)
        if limit is not None and silent is not None and silent > limit:
            actions.append(Stalled(part=part.part, silent_s=silent, unit_s=per_unit, first=not part.units_done,
                                   limit_s=limit, expected_s=part.expected_s if items else None))
        elif part.speed is not None and part.speed < SLOW_SPEED:
            actions.append(Slow(part=part.part, speed=part.speed))
    for state, action in (("stopped", "resume"), ("missing", "not_started")):
        numbers = [p.part for p in parts if p.state == state]
        if numbers:
            actions.append(Waiting(action=action, parts=numbers))
    return Tail(running=[p.part for p in running], median_pace_s=median, actions=actions)


def _silence_limit(part: PartStatus, per_unit: float | None, items: bool) -> float | None:
    """Seconds without a sign of life after which a running part may hang: a work item's expected duration
    (it should have finished by then), at least STALL_UNITS batches; a rank's part, STALL_UNITS batches and
    STALL_S. None before any part has committed (model loading may be slow)."""
    if not per_unit:
        return None
    if items and part.expected_s:
        return max(part.expected_s, STALL_UNITS * per_unit)
    return max(STALL_S, STALL_UNITS * per_unit)


def _totals(parts: list[PartStatus], model: _PlanModel | None) -> Totals:
    planned = [p.units_planned for p in parts]
    wall, busy = sum(p.wall_s for p in parts), sum(p.device_busy_s for p in parts)
    return Totals(units_done=sum(p.units_done for p in parts),
                  units_planned=model.num_batches if model else (None if None in planned else sum(planned)),
                  written=sum(p.written for p in parts), skipped=sum(p.skipped for p in parts),
                  tokens=sum(p.tokens for p in parts), wall_s=wall, device_busy_s=busy,
                  device_busy_fraction=busy / wall if wall else 0.0)


def _job_eta(parts: list[PartStatus]) -> float | None:
    """0 when every part is done; else the largest ETA of the running parts (None when one of them
    has none yet, or none runs: stopped and missing parts do not finish by themselves)."""
    if parts and all(p.state == "done" for p in parts):
        return 0.0
    running = [p.eta_s for p in parts if p.state == "running"]
    return None if not running or None in running else max(running)


def _imbalance(parts: list[PartStatus], modality: str | None, model: _PlanModel | None, num_parts: int) -> Imbalance:
    """Measured (images, every part done: max/mean - 1 of the wall seconds, idle parts included) and
    modeled (the plan's cost model for `num_parts` ranks) imbalance; None where not known."""
    finished = bool(parts) and all(p.state == "done" for p in parts)
    measured = imbalance(np.array([p.wall_s for p in parts])) if finished and modality != "audio" else None
    return Imbalance(measured=measured, modeled=model.imbalance if model else None, world_size=num_parts,
                     plan_world_size=model.plan_world_size if model else None)


# -- per input: where every manifest row went --------------------------------------------------------
def input_table(status: JobStatus, plan: str | os.PathLike) -> list[InputRow]:
    """One row per input of the plan's manifest (input order): the manifest rows it gave and where each
    went, so that `rows = scan + plan + encode + written + pending` holds for every input:

      scan     rows the scan recorded as errors (plan's dropped.parquet, reasons `scan:<reason>`: SCAN_REASON)
      plan     rows the plan dropped for its own reasons (dropped.parquet)
      encode   kept rows the encode skipped (the parts' skip records: `position` is the manifest row)
      written  kept rows of finished parts that were not skipped
      pending  kept rows of unfinished parts not skipped so far

    Each of scan/plan/encode is a {reason: count} mapping; `status` is `job_status(out, plan)`'s result (its
    parts' states and count). Reads only."""
    from mmtok.formats.plan import BATCHES_FILE, DROPPED_FILE, IMAGES_FILE, SCAN_REASON

    opened = _open_plan(plan)
    tars = opened.manifest().read(["tar"]).column(0).combine_chunks().dictionary_encode()
    codes, names = tars.indices.to_numpy(zero_copy_only=False), tars.dictionary.to_pylist()
    table = [InputRow(name) for name in names]
    for index, count in enumerate(np.bincount(codes, minlength=len(names))):
        table[index].rows = int(count)
    dropped = opened.table(DROPPED_FILE, ["manifest_row", "reason"]).to_pydict()
    for row, reason in zip(dropped["manifest_row"], dropped["reason"], strict=True):
        scan = reason.startswith(SCAN_REASON)
        table[codes[row]].dropped(*(("scan", reason[len(SCAN_REASON):]) if scan else ("plan", reason)))
    kept = opened.table(IMAGES_FILE, ["manifest_row"]).column(0).to_numpy()
    plan_row = opened.table(BATCHES_FILE, ["plan_row"]).column(0).to_numpy()
    bounds = np.append(plan_row, len(kept))
    out = Path(status.out)
    ranges = part_ranges(opened, status.work_items, status.num_parts)
    for part, (start, end) in zip(status.parts, ranges, strict=True):
        rows = kept[bounds[start]:bounds[end]]
        skipped = [r for r in commitlog.read_skipped(partdir.part_dir(out, part.part))
                   if r.position is not None and 0 <= r.position < len(codes)]
        done = part.state == "done"
        for index, count in enumerate(np.bincount(codes[rows], minlength=len(names))):
            table[index].add(done, int(count))
        for record in skipped:
            table[codes[record.position]].dropped("encode", record.reason)
            table[codes[record.position]].add(done, -1)
    for record in _merge_skips(out, len(codes)):  # good images of documents merge dropped for a failed one
        table[codes[record.position]].dropped("encode", record.reason)
        table[codes[record.position]].written -= 1
    return table


def skip_records(status: JobStatus, plan: str | os.PathLike | None) -> Iterator[skips.SkipRecord]:
    """Every input of the job that did not become tokens, one skip record each, stage by stage: with `plan`, the
    manifest rows it dropped (the scan's error rows and the plan's own drops, in manifest-row order), then each
    part's skips (encode, sft) in part order, then those merge added once `OUT/merged.skipped.jsonl` exists.
    `status` is `job_status(out, plan)`'s result. Reads only."""
    if plan is not None:
        yield from _open_plan(plan).skip_records()
    out = Path(status.out)
    for part in status.parts:
        yield from commitlog.read_skipped(partdir.part_dir(out, part.part))
    yield from _merge_skips(out)


def _merge_skips(out: Path, rows: int | None = None) -> list:
    """The skip records merge added (`document_image_failed`: an image of a document another image of which
    failed), once `OUT/merged.skipped.jsonl` exists; the parts' own records are in it too and not taken again.
    With `rows`, only those naming a manifest row below it."""
    from mmtok.formats.merged import MERGED, SKIPPED_SUFFIX

    path = out / (MERGED + SKIPPED_SUFFIX)
    if not path.is_file():
        return []
    return [r for r in skips.read(path) if r.stage == "merge"
            and (rows is None or r.position is not None and 0 <= r.position < rows)]
