"""The parts of an output: how a stage's ranks leave their work for the next stage to find.

An output directory OUT holds `OUT/parts/part-<n>/`, one per work item (audio: per Shar shard), each written by
exactly one writer through `mmtok.formats.commitlog` (checksummed units; identity and DONE:
`mmtok.formats.partdir`). This module is the reading side every consumer shares (merge, sft, status,
inspect): `find_parts` lists the finished parts of one run in part order and verifies each against its commit
log's checksums before any of its tokens are used; `shared_identity` is what every part of one run agrees on;
`timing_stats` turns a part's counters into the figures its stats.json and the summaries report.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mmtok.errors import DamagedFile, MmtokError
from mmtok.formats import commitlog, partdir


@dataclass(frozen=True)
class Part:
    number: int
    directory: Path
    identity: dict
    records: tuple = ()  # its commit records, checked against the part's bytes (commitlog.verify_part)


def find_parts(out: Path, progress: bool = False, check_bytes: bool = True) -> list[Part]:
    """The finished parts of `out`, in part order; refuses missing/unfinished or inconsistent parts.

    `check_bytes=False` lists them without reading their bytes (`records` left empty): only for a caller that verifies
    them itself before use, or that holds a record of these very files having been verified (`mmtok sft`'s kept
    image index, made by the rank that verified them: `ImageIndex.cached`)."""
    found = {}
    for _, directory in partdir.part_directories(out):
        if not (directory / partdir.IDENTITY).is_file():
            raise MmtokError(f"{directory}: no {partdir.IDENTITY} (damaged, or not an mmtok part); delete the "
                             "directory and re-encode that part (rerun its `mmtok encode`)")
        identity = read_part_json(directory / partdir.IDENTITY, partdir.read_identity, directory)
        found[identity["part"]] = Part(identity["part"], directory, identity)
    if not found:
        raise MmtokError(f"{out}: no encoded parts under {partdir.parts_root(out)}; run `mmtok encode --out {out}` "
                         "first")
    counts = {part.identity["num_parts"] for part in found.values()}
    if len(counts) != 1:
        raise MmtokError(f"{out}: parts disagree on the number of parts ({sorted(counts)}); they come from "
                         "different encode runs -- use one --out per run")
    num_parts = counts.pop()
    missing = [n for n in range(num_parts) if n not in found or not partdir.is_done(found[n].directory)]
    if missing:
        listed = ", ".join(str(partdir.part_dir(out, n)) for n in missing[:20])
        more = f" and {len(missing) - 20} more" if len(missing) > 20 else ""
        stage = "mmtok sft" if next(iter(found.values())).identity.get("modality") == "sft" else "mmtok encode"
        raise MmtokError(f"{out}: {len(missing)} of {num_parts} parts are not finished (no DONE marker): "
                         f"{listed}{more}. Run (or resume) `{stage}` for them, then merge again.")
    from mmtok.progress import progress as progress_bar

    parts = []  # each checked against its checksums: damage is named before it can pass for another run's part
    for n in progress_bar(range(num_parts), desc="merge: check parts", unit="part", enabled=progress and check_bytes):
        records = tuple(commitlog.verify_part(found[n].directory)) if check_bytes else ()
        parts.append(Part(n, found[n].directory, found[n].identity, records))
    _check_same_run(parts)
    return parts


def shared_identity(identity: dict) -> dict:
    """The identity keys every part of one run shares (per-part keys are `part` and `part_*`)."""
    return {k: v for k, v in identity.items() if k != "part" and not k.startswith("part_")}


def _check_same_run(parts: list[Part]) -> None:
    reference = shared_identity(parts[0].identity)
    for part in parts[1:]:
        difference = partdir.identity_difference(reference, shared_identity(part.identity))
        if difference:
            raise MmtokError(f"{part.directory}: does not belong to the same encode run as part 0: {difference}")


def refuse_other_run(out: str | Path, identity: dict, command: str = "mmtok encode") -> None:
    """MmtokError when `out` already holds a part of another run: one whose shared identity differs from
    `identity` in a key `identity` names (nested objects key by key, so a caller may check what it knows before
    it loads a codec, and again after). Called before any work, so ranks of another plan, codec, checkpoint or
    world size are refused at start-up, not by merge after the GPU time is spent."""
    wanted = partdir.normalized(shared_identity(identity))
    for _, directory in partdir.part_directories(out):
        if not (directory / partdir.IDENTITY).is_file():
            continue  # a part killed before its identity was written: its own rank resumes or refuses it
        recorded = read_part_json(directory / partdir.IDENTITY, partdir.read_identity, directory)
        difference = partdir.identity_difference(_named_by(recorded, wanted), wanted)
        if difference:
            raise MmtokError(f"{out} holds {directory.name}, a part of another run: {difference}; use one --out per "
                             f"run (or delete the other run's parts) -- nothing was written ({command})")


def _named_by(recorded, wanted):
    """`recorded` cut to the keys `wanted` has, at every level."""
    if isinstance(recorded, dict) and isinstance(wanted, dict):
        return {key: _named_by(recorded[key], wanted[key]) for key in wanted if key in recorded}
    return recorded


def read_part_json(path: Path, reader, directory: Path):
    """`reader(directory)`, with a damaged or unreadable file reported as one line naming it (and, for a
    file of the wrong shape, the key)."""
    try:
        return reader(directory)
    except DamagedFile:
        raise
    except (ValueError, OSError) as err:
        raise MmtokError(f"{path}: unreadable ({err}); the part is damaged -- delete {directory} and re-encode "
                         "this part") from None


def timing_stats(counts: dict[str, int]) -> dict[str, float]:
    """A part's wall and device-busy seconds (summed over every session that wrote it), their ratio, and
    its tokens per second (sequences and items: the ids the rank encoded)."""
    wall = counts.get("wall_ms", 0) / 1000
    busy = counts.get("device_busy_ms", 0) / 1000
    return {"wall_s": wall, "device_busy_s": busy, "device_busy_fraction": busy / wall if wall else 0.0,
            "tokens_per_s": (counts.get("tokens", 0) + counts.get("item_tokens", 0)) / wall if wall else 0.0}
