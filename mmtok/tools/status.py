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

import os
import time
from collections import Counter
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
RESUME_HINT = "rerun the same {command} command to resume"


def stage_command(modality: str | None) -> str:
    """The command that writes (and resumes) a job's parts."""
    return "mmtok sft" if modality == "sft" else "mmtok encode"
SLOWEST = 5
SLOW_SPEED = 0.75  # a part progressing below this share of the median pace is worth moving to another node
STALL_UNITS, STALL_S = 10, 600  # a running part silent for this many of its units (and seconds) may hang


def job_status(out: str | os.PathLike, plan: str | os.PathLike | None = None) -> dict:
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
    parts = [found.get(n) or _missing(n, partdir.part_dir(out, n), units=_sft_units(n, identities))
             for n in range(num_parts)]
    parts += [p for n, p in sorted(found.items()) if n >= num_parts]
    for part in parts:
        _add_figures(part, model)
    _add_shares(parts, model)
    item = {"audio": "clip", "sft": "conversation"}.get(modality, "image")
    items = _items(identities)
    return {"out": str(out), "modality": modality, "item": item, "work_items": items,
            "takes_over": items or modality == "audio",  # running workers take pending items over (a shard: audio)
            "curation": _curation(opened) if opened is not None else None,
            "num_parts": num_parts, "states": {s: sum(p["state"] == s for p in parts) for s in STATES},
            "totals": _totals(parts, model), "eta_s": _job_eta(parts),
            "slowest": [p["part"] for p in sorted(parts, key=lambda p: -p["projected_s"])[:SLOWEST] if p["wall_s"]],
            "imbalance": _imbalance(parts, modality, model, num_parts), "tail": _tail(parts, items),
            "warnings": warnings, "parts": parts}


# -- reading one part --------------------------------------------------------------------------------
def _missing(number: int, directory: Path, detail: str = "not started: no part directory", units=None) -> dict:
    return {"part": number, "state": "missing", "detail": detail, "directory": str(directory), "counts": {},
            "units_done": 0, "tokens": 0, "part_batches": units, "silent_s": None, "holder": None,
            "last_commit_at": None}


def _sft_units(number: int, identities: list[dict]) -> list[int] | None:
    """[start, end) units of `mmtok sft` work item `number` (`mmtok.sft.build.work_items`: UNITS_PER_ITEM each, the
    last fewer), from what the run's parts record; None for other jobs (an image part's batches are the plan's)."""
    items = identities[0].get("work_items") if identities and identities[0].get("modality") == "sft" else None
    if not isinstance(items, dict) or not {"units_per_item", "units"} <= items.keys():
        return None
    start = number * items["units_per_item"]
    return [start, min(start + items["units_per_item"], items["units"])]


def _damaged(number: int, directory: Path, detail: str) -> dict:
    return {**_missing(number, directory), "state": "damaged", "detail": detail}


def _read_part(number: int, directory: Path) -> dict:
    """State, identity, counters and progress of one part directory, from its files alone."""
    part = _missing(number, directory)
    holder = WriterLock.holder(directory)
    if not (directory / partdir.IDENTITY).is_file():
        if holder:
            return {**part, "state": "running", "detail": f"starting (no identity yet); holder: {holder}"}
        if any(p.name != WriterLock.NAME for p in directory.iterdir()):
            return _damaged(number, directory, f"{directory}: files but no {partdir.IDENTITY} (damaged, or not an "
                            "mmtok part); delete the directory and rerun its encode command")
        return {**part, "detail": "not started: the encode stopped before it wrote the part's identity"}
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
    return {**part, "state": state, "detail": detail, "identity": identity, "holder": holder,
            "part_batches": identity.get("part_batches", identity.get("part_units")),  # sft: its units
            "counts": counts, "units_done": len(records),
            "silent_s": _silent_s(directory) if holder else None,
            "last_commit_at": _last_commit_at(directory) if records else None,
            "tokens": sum(n for record in records for n in record["lengths"]) + counts.get("item_tokens", 0)}


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


def _one_run(found: dict[int, dict]) -> tuple[list[dict], list[str]]:
    """The identities of the parts of one encode run (the first readable part's), and a warning naming
    the parts of another run, which become "damaged" in `found` with the first identity key that differs."""
    identities, foreign, reference = [], [], None
    for number, part in list(found.items()):
        if "identity" not in part:
            continue
        identity = part.pop("identity")
        if reference is None:
            reference = number, shared_identity(identity)
        difference = partdir.identity_difference(reference[1], shared_identity(identity))
        if difference is None:
            identities.append(identity)
            continue
        foreign.append(number)
        found[number] = _damaged(number, Path(part["directory"]),
                                 f"{part['directory']}: from another encode run than part {reference[0]}, "
                                 f"{difference}; delete it or give each run its own --out")
    warnings = [f"not from the encode run of part {reference[0]}: part(s) {', '.join(map(str, foreign))}; use one "
                "--out per run"] if foreign else []
    return identities, warnings


def _num_parts(identities: list[dict], found: dict[int, dict], plan) -> int:
    """How many parts the job has: its identities' `num_parts` (one run's, so they agree); without one,
    the plan's world size or the highest part directory."""
    if identities and "num_parts" in identities[0]:
        return int(identities[0]["num_parts"])
    return max(plan.world_size if plan is not None else 0, max(found, default=-1) + 1)


# -- the plan's cost model ---------------------------------------------------------------------------
def _curation(plan) -> dict | None:
    """What the plan's duplicate list (`plan --exclude`) dropped of its source, by reason; None without one."""
    exclude = plan.meta.get("exclude")
    if not exclude:
        return None
    by_reason = plan.meta.get("dropped_by_reason", {})
    listed = {reason: by_reason[reason] for reason in ("duplicate", "contaminated", "caption_flagged")
              if by_reason.get(reason)}
    return {"source": exclude["source"], "list": exclude["directory"], "rows": exclude["rows"], "by_reason": listed}


def _open_plan(directory: str | os.PathLike):
    """`Plan.open(directory)`; pyarrow is imported only when a plan is asked for."""
    from mmtok.formats.plan import Plan

    return Plan.open(directory)


def _plan_model(plan, identities: list[dict], num_parts: int) -> dict:
    """Batch costs, rank ranges and modeled imbalance of `plan` for `num_parts` ranks (the plan's
    own figure when that is its world size, else re-derived as encode re-derives the ranges)."""
    from mmtok.formats.plan import BATCHES_FILE

    recorded = {i.get("plan_fingerprint") for i in identities} - {None}
    if recorded and recorded != {plan.meta["fingerprint"]}:
        raise MmtokError(f"{plan.directory}: not the plan these parts were encoded from (fingerprint "
                         f"{plan.meta['fingerprint'][:12]}..., parts {sorted(f[:12] for f in recorded)}); pass the "
                         "--plan given to `mmtok encode`")
    costs = plan.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
    ranges = part_ranges(plan, _items(identities), num_parts)
    per_rank = rank_costs(costs, ranges)
    same = num_parts == plan.world_size and not _items(identities)
    return {"prefix": np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)]), "ranges": ranges,
            "per_rank": per_rank, "num_batches": int(plan.meta["num_batches"]),
            "imbalance": float(plan.meta["imbalance"]) if same else imbalance(per_rank),
            "plan_world_size": plan.world_size}


def part_ranges(plan, items: bool, num_parts: int) -> np.ndarray:
    """[start, end) batches of each part: the plan's work items for parts that are items (image encode), else
    the rank ranges of `num_parts` ranks (`mmtok sft`, and parts written before work items)."""
    return plan.work_items() if items else plan.ranges(num_parts)


def _items(identities: list[dict]) -> bool:
    """Whether the parts are the plan's work items (image encode), not rank ranges."""
    return any("work_items" in identity for identity in identities)


# -- figures -----------------------------------------------------------------------------------------
def _add_figures(part: dict, model: dict | None) -> None:
    """Progress, throughput and ETA of one part (see the module docstring for what each means)."""
    counts = part.pop("counts")
    written = _written(counts)
    timing = timing_stats({**counts, "tokens": part["tokens"], "item_tokens": 0})  # part tokens include the items
    span = _planned_range(part["part"], part.pop("part_batches"), model)
    planned = part["units_done"] if span is None and part["state"] == "done" else None  # audio: known once done
    part.update(units_planned=planned if span is None else span[1] - span[0], written=written,
                skipped=skips.total(counts, failed_items=True), **timing,
                per_s=written / timing["wall_s"] if timing["wall_s"] else 0.0)
    part["eta_s"] = 0.0 if part["state"] == "done" else _eta(part, span, model)
    part["projected_s"] = part["wall_s"] + (part["eta_s"] or 0.0)
    part["progress"], part["pace_s"] = _progress(part, span, model)
    part["work_done"], part["work_planned"] = _work(part, span, model)


def _written(counts: dict) -> int:
    """Inputs a part turned into tokens: images written as documents or handed on as items
    (`images_deferred`); audio: clips encoded (known once assembled); sft: conversations written."""
    if "encoded" in counts:
        return counts["encoded"]
    if "conversations" in counts:  # mmtok sft: conversations written
        return counts.get("documents_written", 0)
    return counts.get("images_written", 0) + counts.get("images_deferred", 0)


def _planned_range(number: int, identity_range, model: dict | None) -> tuple[int, int] | None:
    """[start, end) global batches of an image part: its identity's, else (a missing part) the plan's."""
    if identity_range:
        return tuple(identity_range)
    if model is not None and number < len(model["ranges"]):
        return tuple(int(x) for x in model["ranges"][number])
    return None


def _eta(part: dict, span: tuple[int, int] | None, model: dict | None) -> float | None:
    """Seconds the part still needs at its pace so far: the remaining share of its plan cost (with a
    plan), else its remaining batches x its mean seconds per batch; None when unknown."""
    if span is None or not part["units_done"] or not part["wall_s"]:
        return None
    start, end = span
    reached = start + part["units_done"]
    if model is not None:
        prefix = model["prefix"]
        done_cost = prefix[reached] - prefix[start]
        if done_cost > 0:
            return float(part["wall_s"] * (prefix[end] - prefix[reached]) / done_cost)
    return part["wall_s"] * (end - reached) / part["units_done"]


def _progress(part: dict, span: tuple[int, int] | None, model: dict | None) -> tuple[float | None, float | None]:
    """Share of the part's work done (its plan cost with a plan, else its batches), and its wall seconds
    per unit of that work (None before its first commit): what `_tail` compares between parts."""
    if part["state"] == "done":
        return 1.0, _pace(part["wall_s"], _work(part, span, model)[0])
    done, planned = _work(part, span, model)
    return (done / planned if planned else None), _pace(part["wall_s"], done)


def _work(part: dict, span: tuple[int, int] | None, model: dict | None) -> tuple[float, float | None]:
    """(work done, work planned) of a part: plan cost with a plan, else batches (audio: units)."""
    if span is None:
        return float(part["units_done"]), part["units_planned"]
    start, end = span
    if model is not None:
        prefix = model["prefix"]
        return float(prefix[start + part["units_done"]] - prefix[start]), float(prefix[end] - prefix[start])
    return float(part["units_done"]), float(end - start)


def _pace(wall_s: float, done: float) -> float | None:
    return wall_s / done if wall_s and done else None


def _tail(parts: list[dict], items: bool = False) -> dict:
    """The end of the job: each part's speed (the median pace of the parts that made progress over its
    own, so 0.5 = half as fast) and expected duration (its planned work at the median pace), the running
    parts slowest-to-finish first, and what to do about the tail: move slow or silent running parts to
    another node, resume stopped ones, and parts not started (in a SLURM array they start as slots free up).
    A running work item (`items`) is silent too long once its last sign of life is older than the whole
    item should take; a rank's part (written before work items; much longer) once it is older than STALL_UNITS
    of its batches."""
    paces = [p["pace_s"] for p in parts if p["pace_s"]]
    median = float(np.median(paces)) if paces else None
    for part in parts:
        part["speed"] = median / part["pace_s"] if median and part["pace_s"] else None
        part["expected_s"] = part["work_planned"] * median if median and part["work_planned"] else None
    running = sorted((p for p in parts if p["state"] == "running"),
                     key=lambda p: -(p["eta_s"] if p["eta_s"] is not None else np.inf))
    units = [p["wall_s"] / p["units_done"] for p in parts if p["units_done"] and p["wall_s"]]
    typical = float(np.median(units)) if units else None  # for a part that has committed nothing yet
    actions = []
    for part in running:
        own = part["wall_s"] / part["units_done"] if part["units_done"] else None
        per_unit = own or typical  # a part that hangs before its first commit is judged by the others' pace
        silent = part["silent_s"]  # None where this process holds the part's lock itself
        limit = _silence_limit(part, per_unit, items)
        if limit is not None and silent is not None and silent > limit:
            actions.append({"action": "stalled", "part": part["part"], "silent_s": part["silent_s"],
                            "unit_s": per_unit, "first": not part["units_done"], "limit_s": limit,
                            "expected_s": part["expected_s"] if items else None})
        elif part["speed"] is not None and part["speed"] < SLOW_SPEED:
            actions.append({"action": "slow", "part": part["part"], "speed": part["speed"]})
    for state, action in (("stopped", "resume"), ("missing", "not_started")):
        numbers = [p["part"] for p in parts if p["state"] == state]
        if numbers:
            actions.append({"action": action, "parts": numbers})
    return {"running": [p["part"] for p in running], "median_pace_s": median, "actions": actions}


def _silence_limit(part: dict, per_unit: float | None, items: bool) -> float | None:
    """Seconds without a sign of life after which a running part may hang: a work item's expected duration
    (it should have finished by then), at least STALL_UNITS batches; a rank's part, STALL_UNITS batches and
    STALL_S. None before any part has committed (model loading may be slow)."""
    if not per_unit:
        return None
    if items and part["expected_s"]:
        return max(part["expected_s"], STALL_UNITS * per_unit)
    return max(STALL_S, STALL_UNITS * per_unit)


def _add_shares(parts: list[dict], model: dict | None) -> None:
    """Each part's share of the summed wall seconds, and (with a plan) of the modeled rank cost."""
    wall = sum(p["wall_s"] for p in parts)
    cost = float(model["per_rank"].sum()) if model is not None else 0.0
    for part in parts:
        part["wall_share"] = part["wall_s"] / wall if wall else None
        known = model is not None and cost > 0 and part["part"] < len(model["per_rank"])
        part["modeled_share"] = float(model["per_rank"][part["part"]]) / cost if known else None


def _totals(parts: list[dict], model: dict | None) -> dict:
    planned = [p["units_planned"] for p in parts]
    wall, busy = sum(p["wall_s"] for p in parts), sum(p["device_busy_s"] for p in parts)
    return {"units_done": sum(p["units_done"] for p in parts),
            "units_planned": model["num_batches"] if model else (None if None in planned else sum(planned)),
            "written": sum(p["written"] for p in parts), "skipped": sum(p["skipped"] for p in parts),
            "tokens": sum(p["tokens"] for p in parts), "wall_s": wall, "device_busy_s": busy,
            "device_busy_fraction": busy / wall if wall else 0.0}


def _job_eta(parts: list[dict]) -> float | None:
    """0 when every part is done; else the largest ETA of the running parts (None when one of them
    has none yet, or none runs: stopped and missing parts do not finish by themselves)."""
    if parts and all(p["state"] == "done" for p in parts):
        return 0.0
    running = [p["eta_s"] for p in parts if p["state"] == "running"]
    return None if not running or None in running else max(running)


def _imbalance(parts: list[dict], modality: str | None, model: dict | None, num_parts: int) -> dict:
    """Measured (images, every part done: max/mean - 1 of the wall seconds, idle parts included) and
    modeled (the plan's cost model for `num_parts` ranks) imbalance; None where not known."""
    finished = bool(parts) and all(p["state"] == "done" for p in parts)
    measured = imbalance(np.array([p["wall_s"] for p in parts])) if finished and modality != "audio" else None
    return {"measured": measured, "modeled": model["imbalance"] if model else None, "world_size": num_parts,
            "plan_world_size": model["plan_world_size"] if model else None}


# -- per input: where every manifest row went --------------------------------------------------------
def input_table(status: dict, plan: str | os.PathLike) -> list[dict]:
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
    table = [{"input": name, "rows": 0, "scan": Counter(), "plan": Counter(), "encode": Counter(), "written": 0,
              "pending": 0} for name in names]
    for index, count in enumerate(np.bincount(codes, minlength=len(names))):
        table[index]["rows"] = int(count)
    dropped = opened.table(DROPPED_FILE, ["manifest_row", "reason"]).to_pydict()
    for row, reason in zip(dropped["manifest_row"], dropped["reason"], strict=True):
        scan = reason.startswith(SCAN_REASON)
        table[codes[row]]["scan" if scan else "plan"][reason[len(SCAN_REASON):] if scan else reason] += 1
    kept = opened.table(IMAGES_FILE, ["manifest_row"]).column(0).to_numpy()
    plan_row = opened.table(BATCHES_FILE, ["plan_row"]).column(0).to_numpy()
    bounds = np.append(plan_row, len(kept))
    out = Path(status["out"])
    ranges = part_ranges(opened, status["work_items"], status["num_parts"])
    for part, (start, end) in zip(status["parts"], ranges, strict=True):
        rows = kept[bounds[start]:bounds[end]]
        skipped = [r for r in commitlog.read_skipped(partdir.part_dir(out, part["part"]))
                   if r.position is not None and 0 <= r.position < len(codes)]
        column = "written" if part["state"] == "done" else "pending"
        for index, count in enumerate(np.bincount(codes[rows], minlength=len(names))):
            table[index][column] += int(count)
        for record in skipped:
            entry = table[codes[record.position]]
            entry["encode"][record.reason] += 1
            entry[column] -= 1
    for record in _merge_skips(out, len(codes)):  # good images of documents merge dropped for a failed one
        entry = table[codes[record.position]]
        entry["encode"][record.reason] += 1
        entry["written"] -= 1
    return table


def skip_records(status: dict, plan: str | os.PathLike | None) -> Iterator[skips.SkipRecord]:
    """Every input of the job that did not become tokens, one skip record each, stage by stage: with `plan`, the
    manifest rows it dropped (the scan's error rows and the plan's own drops, in manifest-row order), then each
    part's skips (encode, sft) in part order, then those merge added once `OUT/merged.skipped.jsonl` exists.
    `status` is `job_status(out, plan)`'s result. Reads only."""
    if plan is not None:
        yield from _open_plan(plan).skip_records()
    out = Path(status["out"])
    for part in status["parts"]:
        yield from commitlog.read_skipped(partdir.part_dir(out, part["part"]))
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
