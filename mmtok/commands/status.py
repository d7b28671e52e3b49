"""`mmtok status OUT`: a read-only view of an encode output -- per-part state, progress, ETA, balance."""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING

from mmtok.commands.report import listed, plural

if TYPE_CHECKING:  # the view's types; the module itself is imported when the command runs
    from mmtok.tools.status import InputRow, JobStatus, PartStatus, Slow, Stalled, Waiting

DESCRIPTION = """\
Show where an encode job stands, from OUT/parts alone. Reads only: takes no lock and writes nothing,
so it is safe to run (and rerun) while the ranks are encoding, from any host that sees OUT.

States of a part:
  done      finished (DONE written); merge can take it
  running   a process holds the part's writer lock (the holder's host and pid are shown)
  stopped   started but not finished and nobody writes it (killed or failed): rerun the same encode
            command to resume it where it stopped
  missing   expected (0 .. num_parts-1) but not started
  damaged   its identity or commit log cannot be read; the line says which file and what to do

Figures per part (from its commit log): batches committed of planned (audio: units, known once the
part is done), images written (audio: clips encoded), skipped inputs, tokens, wall seconds (summed over
the sessions that wrote it, model loading excluded), device-busy share of that wall time, images (clips)
and tokens per second, and the ETA of an unfinished part: its remaining batches at its own pace so far
(with --plan: its remaining share of the plan's cost model). The job's ETA is the largest ETA of the
running parts. Once every part is done, the measured imbalance is max/mean - 1 of the parts' wall
seconds (idle parts included), beside the plan's modeled imbalance (with --plan; re-derived for the
job's world size when it differs from the plan's). While parts are unfinished, the tail line names the
running parts that finish last (progress, speed against the median pace, ETA) and the action lines say
what to do: requeue a slow or silent running part on another node, resume stopped parts, and parts not
started (in a SLURM array they start as slots free up). See docs/status.md.

Image encode writes one part per work item of the plan: there parts are shown as items, `running` as
"in progress" (with the holder and the time of the last commit) and `missing` as "pending", and an item
in progress that has shown no life for longer than the whole item should take (its planned work at the
median pace) is flagged.
"""
TABLE_LIMIT = 20  # parts shown one per line; above it only unfinished and slowest ones


def add_parser(sub) -> None:
    parser = sub.add_parser("status", help="show the state, progress, ETA and balance of an encode output (read-only)",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="the encode output directory (the --out of `mmtok encode`)")
    parser.add_argument("--plan", metavar="PLAN", default=None,
                        help="images: the plan the job encodes; adds the modeled imbalance and per-rank cost shares, "
                        "and weights ETAs by the plan's batch costs")
    parser.add_argument("--inputs", action="store_true",
                        help="images, with --plan: one line per input (tar or table file) saying where each of its "
                        "manifest rows went -- scan errors, plan drops, encode skips (by reason), written, pending -- "
                        "adding up to its rows")
    parser.add_argument("--skipped", action="store_true",
                        help="instead of the view: every input that did not become tokens, one skip record (a JSON "
                        "line, the schema of every stage's skipped.jsonl) each -- with --plan the scan's error rows "
                        "and the plan's drops first, then the parts' skips, then merge's -- and the count per stage "
                        "and reason on stderr")
    parser.add_argument("--json", action="store_true", help="print every figure as one JSON object instead")
    parser.set_defaults(func=run)


def run(args) -> int:
    import dataclasses
    import json

    from mmtok.errors import MmtokError
    from mmtok.tools.status import input_table, job_status

    if args.inputs and args.plan is None:
        raise MmtokError("--inputs needs --plan: the plan the image job encodes (its manifest lists the inputs; an "
                         "audio output has none: its skips are in the parts' skipped.jsonl)")
    if args.skipped and (args.inputs or args.json):
        raise MmtokError("--skipped prints skip records (JSON lines) instead of the view: leave out --inputs, --json")
    status = job_status(args.out, plan=args.plan)
    if args.skipped:
        return print_skipped(status, args.plan)
    if args.inputs:
        status = dataclasses.replace(status, inputs=input_table(status, args.plan))
    print(json.dumps(status.to_json(), indent=2) if args.json else render(status))
    return 0


def print_skipped(status: JobStatus, plan: str | None) -> int:
    """`--skipped`: every skip record of the job on stdout, then their count by stage and reason on stderr."""
    import sys

    from mmtok.formats import skips
    from mmtok.tools.status import skip_records

    counts: Counter[tuple[str, str]] = Counter()
    for record in skip_records(status, plan):
        sys.stdout.buffer.write(skips.to_line(record))
        counts[record.stage, record.reason] += 1
    sys.stdout.flush()
    stages: dict[str, list[str]] = {"scan": [], "plan": []}  # then the others as they came; reasons as first seen
    for (stage, reason), n in counts.items():
        stages.setdefault(stage, []).append(f"{reason} {n:,}")
    by_stage = "; ".join(f"{stage} {', '.join(reasons)}" for stage, reasons in stages.items() if reasons)
    print(f"mmtok status: {plural(sum(counts.values()), 'skip record')}" + (f" ({by_stage})" if by_stage else "")
          + ("; the scan's and the plan's are listed with --plan" if plan is None and status.modality == "image"
             else ""), file=sys.stderr)
    return 0


# Image encode writes one part per work item: there a part is called an item, and its states say where the
# item stands (`running`: in progress, `missing`: pending); JSON keeps the state names.
ITEM_STATES = {"running": "in progress", "missing": "pending"}


def noun(status: JobStatus) -> str:
    return "item" if status.work_items else "part"


def state_label(status: JobStatus, state: str) -> str:
    return ITEM_STATES.get(state, state) if status.work_items else state


def render(status: JobStatus) -> str:
    """The human view of a `job_status` result: header, part table, totals, balance, ETA."""
    states = ", ".join(f"{n} {state_label(status, state)}" for state, n in status.states.items() if n)
    what = "work item" if status.work_items else "part"
    lines = [f"mmtok status {status.out}: {status.modality or 'unknown'} job, "
             f"{plural(status.num_parts, what)}" + (f": {states}" if states else "")]
    lines += [f"  warning: {w}" for w in status.warnings]
    curation = status.curation
    if curation:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in curation.by_reason.items()) or "none in the plan"
        lines.append(f"  curation: the plan excludes {plural(curation.rows, 'row')} of source {curation.source} "
                     f"listed by {curation.list} ({reasons}); they never reach a GPU")
    lines += _table(status)
    lines += _summary(status)
    if status.inputs is not None:
        lines += _inputs(status.inputs)
    return "\n".join(lines)


def _inputs(table: list[InputRow]) -> list[str]:
    """The per-input lines of `--inputs` (every input: the user reconciles each one), then their total."""
    import os

    from mmtok.tools.status import INPUT_STAGES, InputRow

    total = InputRow("total", rows=sum(t.rows for t in table), written=sum(t.written for t in table),
                     pending=sum(t.pending for t in table),
                     **{stage: dict(sum((Counter(t.stages()[stage]) for t in table), Counter()))
                        for stage in INPUT_STAGES})
    folder = os.path.commonpath([os.path.dirname(t.input) for t in table]) if table else ""
    shown = {t.input: os.path.relpath(t.input, folder) if folder else t.input for t in table}
    shown["total"] = "total"
    width = max(len(name) for name in shown.values())
    lines = [f"inputs: {plural(len(table), 'input')}{f' under {folder}' if folder else ''}, images per input: rows "
             "= scan errors + plan drops + encode skips + written + pending",
             f"  {'input':<{width}} {'rows':>9} {'scan':>7} {'plan':>7} {'encode':>7} {'written':>9} {'pending':>9}"
             "  reasons"]
    for entry in [*table, total]:
        stages = entry.stages()
        numbers = " ".join(f"{sum(stages[s].values()):>7,}" for s in INPUT_STAGES)
        reasons = "; ".join(f"{stage} {reason} {n:,}" for stage in INPUT_STAGES
                            for reason, n in sorted(stages[stage].items()))
        lines.append(f"  {shown[entry.input]:<{width}} {entry.rows:>9,} {numbers} {entry.written:>9,} "
                     f"{entry.pending:>9,}  {reasons or '-'}")
    return lines


def _table(status: JobStatus) -> list[str]:
    parts = status.parts
    shown = parts
    if len(parts) > TABLE_LIMIT:
        wanted = {p.part for p in parts if p.state != "done"} | set(status.slowest)
        shown = [p for p in parts if p.part in wanted][:TABLE_LIMIT]
    with_plan = status.imbalance.modeled is not None
    unit, item, rate = LABELS[status.item]
    header = (f"  {noun(status):>5} {'state':<11} {unit:>13} {item:>9} {'skipped':>7} {'tokens':>12} {'wall':>8} "
              f"{'busy':>5} {rate:>8} {'tok/s':>9} {'eta':>8}" + ("  cost% wall%" if with_plan else ""))
    lines = [header]
    for p in shown:
        planned = "?" if p.units_planned is None else f"{p.units_planned:,}"
        state = state_label(status, p.state)
        line = (f"  {p.part:>5} {state:<11} {p.units_done:>6,}/{planned:<6} {p.written:>9,} "
                f"{p.skipped:>7,} {p.tokens:>12,} {_duration(p.wall_s):>8} "
                f"{100 * p.device_busy_fraction:>4.0f}% {p.per_s:>8.1f} {p.tokens_per_s:>9,.0f} "
                f"{_duration(p.eta_s) if p.state != 'done' else '-':>8}")
        if with_plan:
            line += f"  {_percent(p.modeled_share):>5} {_percent(p.wall_share):>5}"
        lines.append(line + (f"  {_detail(p)}" if p.detail else ""))
    hidden = Counter(state_label(status, p.state) for p in parts if p not in shown)
    if hidden:
        lines.append("  not shown: " + ", ".join(f"{n} {s}" for s, n in hidden.items()) +
                     f" (--json lists every {noun(status)})")
    return lines


def _detail(part: PartStatus) -> str:
    """A part's note: why it is in its state; for a running one its holder and when it last committed."""
    if part.state != "running" or not part.last_commit_at:
        return part.detail
    ago = f" ({_duration(part.silent_s)} ago)" if part.silent_s is not None else ""
    return f"{part.detail}; last commit {part.last_commit_at}{ago}"


# What a part's units and written inputs are called, per status item (images, audio clips, SFT conversations).
LABELS = {"image": ("batches", "images", "img/s"), "clip": ("units", "clips", "clip/s"),
          "conversation": ("units", "convs", "conv/s")}


def _summary(status: JobStatus) -> list[str]:
    t, balance = status.totals, status.imbalance
    planned = "?" if t.units_planned is None else f"{t.units_planned:,}"
    unit, item, _rate = LABELS[status.item]
    total = (f"total: {t.units_done:,}/{planned} {unit}, {t.written:,} "
             f"{item}, {t.skipped:,} skipped, {t.tokens:,} tokens, {_duration(t.wall_s)} part-time, "
             f"device busy {100 * t.device_busy_fraction:.0f}%")
    lines = [total]
    if status.item == "image":
        measured = _percent(balance.measured) if balance.measured is not None else "once every part is done"
        if status.work_items:
            over = f"{balance.world_size} items"
        else:
            plan_size = balance.plan_world_size
            over = f"{balance.world_size} ranks" + ("" if balance.world_size == plan_size
                                                         else f", re-derived from the plan's {plan_size}")
        modeled = ("" if balance.modeled is None else f"; modeled {_percent(balance.modeled)} (plan cost model, "
                   f"{over})")
        lines.append(f"imbalance (max/mean - 1 of wall time): measured {measured}{modeled}")
    if status.slowest:
        lines.append("slowest: " + ", ".join(_slow(status, n) for n in status.slowest))
    lines.append(f"eta: {_eta(status)}")
    return lines + _tail(status)


TAIL_SHOWN = 5  # running parts named on the tail line


def _tail(status: JobStatus) -> list[str]:
    """The tail line (the running parts that finish last, their progress, speed and ETA) and one line
    per recommended action."""
    tail, states = status.tail, status.states
    if states["done"] == status.num_parts:
        return []
    if status.work_items:
        counts = f"{states['missing']} pending, {states['running']} in progress, {states['done']} done"
    else:
        counts = f"{states['missing']} not started, {states['running']} running, {states['done']} done"
    by_number = {p.part: p for p in status.parts}
    shown = [_running(by_number[n], noun(status)) for n in tail.running[:TAIL_SHOWN]]
    lines = [f"tail: {counts}" + (f"; last to finish: {', '.join(shown)}" if shown else "")]
    from mmtok.tools.status import stage_command

    command = stage_command(status.modality)
    return lines + [f"action: {_action(a, noun(status), command, status.takes_over)}" for a in tail.actions]


def _running(part: PartStatus, name: str) -> str:
    progress = "?" if part.progress is None else f"{100 * part.progress:.0f}%"
    speed = "" if part.speed is None else f" at {part.speed:.2f}x the median pace"
    return f"{name} {part.part} {progress}{speed}, eta {_duration(part.eta_s)}"


def _action(action: Stalled | Slow | Waiting, name: str = "part", command: str = "mmtok encode",
            takes_over: bool = False) -> str:
    kind = action.action
    if kind == "slow":
        return (f"{name} {action.part} runs at {action.speed:.2f}x the median pace: requeue it on another node "
                "(cancel its task and exclude the node; the rerun resumes after its last commit)")
    if kind == "stalled":
        pace = ("no batch yet, the others' take " if action.first else "its batches take ") + \
            _duration(action.unit_s)
        if action.expected_s:
            pace = f"the whole item should take {_duration(action.expected_s)} at the median pace; {pace}"
        return (f"{name} {action.part} has committed nothing for {_duration(action.silent_s)} ({pace}): its "
                "node may hang; requeue it on another node")
    parts, many = listed(action.parts), plural(len(action.parts), name)
    if kind == "resume":
        return f"{many} stopped ({parts}): requeue their tasks or rerun the same {command} command"
    if name == "item" or takes_over:
        return (f"{many} pending ({parts}): running workers take them over as they finish their own (unless run "
                "with --no-take-over); in a SLURM array more start as slots free up; otherwise launch workers (any "
                "number)")
    return f"{many} not started ({parts}): in a SLURM array they start as slots free up; otherwise launch their ranks"


def _slow(status: JobStatus, number: int) -> str:
    part = next(p for p in status.parts if p.part == number)
    if part.state == "done":
        return f"{noun(status)} {number} {_duration(part.wall_s)}"
    return f"{noun(status)} {number} {_duration(part.projected_s)} projected"


def _eta(status: JobStatus) -> str:
    states = status.states
    if status.eta_s == 0.0:
        return "none: every part is done (`mmtok merge OUT` next)"
    stuck = ", ".join(f"{states[s]} {state_label(status, s)}" for s in ("stopped", "missing", "damaged") if states[s])
    why = ("workers taking over items may do them, but their time is not in it"
           if status.takes_over else "as they do not finish by themselves")
    stuck = f"; not counted, {why}: {stuck}" if stuck else ""
    if status.eta_s is None:
        why = "no part is running" if not states["running"] else "a running part has committed nothing yet"
        return f"unknown ({why}){stuck}"
    return f"{_duration(status.eta_s)} (the slowest running part){stuck}"


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if seconds < 60:
        return f"{seconds:.1f}s"
    seconds = round(seconds)
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"
