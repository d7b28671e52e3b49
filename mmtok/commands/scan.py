"""`mmtok scan`: index tar shards (headers only) and Parquet/Arrow image files into a Parquet manifest."""

from __future__ import annotations

import glob
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.report import plural, print_summary
from mmtok.errors import MmtokError
from mmtok.fsutil import refuse_out_overlapping

if TYPE_CHECKING:  # the scanner is imported when a scan runs, not for `--help`
    from mmtok.formats.manifest import ManifestMetadata
    from mmtok.scan.scanner import ReadTotals, Scanned, ScanShare

_GLOB_CHARS = "*?["


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "scan",
        help="index tar shards (headers only) into a Parquet manifest",
        description="Index WebDataset tar shards (reading only tar headers and the first KiB of each image) "
        "and Parquet/Arrow files with an image column into OUT/manifest.parquet + OUT/manifest.json; every "
        "error row (a member, row or shard that gave no image) is also named, with its reason and detail, in "
        "OUT/skipped.jsonl (the skip records every stage writes). "
        "Finished shards are cached in OUT/.scan-cache, so a rerun after a kill resumes. Across nodes: "
        "run one process per rank (--rank/--world-size, or from torchrun/srun); each scans its share, takes "
        "over the shards no other rank has started, and the last to finish writes the manifest (the same "
        "bytes as one process's scan; a final `mmtok scan` without --rank does it too).",
    )
    parser.add_argument("shards", nargs="*", metavar="SHARD", help="tar/Parquet/Arrow files or glob patterns")
    parser.add_argument("--shard-list", type=Path, metavar="FILE",
                        help="file with one path or glob per line (# comments; relative paths are "
                        "relative to the list's directory); appended after SHARD arguments")
    parser.add_argument("--source", type=Path, metavar="FILE",
                        help="source declaration (manifests/*.yaml): its inputs are added after SHARD arguments "
                        "and its options apply where no flag is given")
    parser.add_argument("--root", type=Path, metavar="DIR",
                        help="directory that relative inputs of --source are relative to (default: its folder)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes scanning shards in parallel (default: CPU count)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's rank (default: RANK, else SLURM_PROCID, else 0)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: WORLD_SIZE, else SLURM_NTASKS, else 1: one process "
                        "scans every shard not committed yet and writes the manifest)")
    parser.add_argument("--image-column", metavar="NAME",
                        help="Parquet/Arrow column with image bytes (binary or {bytes, path}); "
                        "default: 'image' or the first such column")
    parser.add_argument("--text-column", metavar="NAME", help="Parquet/Arrow string column recorded as the caption")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run, parser=parser)


def expand_inputs(patterns: list[str], shard_list: Path | None) -> list[str]:
    """Input paths in the given order (each glob sorted); MmtokError on an empty glob or a duplicate."""
    entries = [(p, Path.cwd()) for p in patterns]
    if shard_list is not None:
        try:
            lines = shard_list.read_text(encoding="utf-8").splitlines()
        except OSError as err:
            raise MmtokError(f"cannot read --shard-list {shard_list}: {err}") from None
        entries += [(line.strip(), shard_list.parent) for line in lines
                    if line.strip() and not line.lstrip().startswith("#")]
    paths: list[str] = []
    for pattern, base in entries:
        full = os.path.join(base, os.path.expanduser(pattern))
        if any(c in pattern for c in _GLOB_CHARS) and not os.path.exists(full):
            matches = sorted(glob.glob(full))
            if not matches:
                raise MmtokError(f"pattern {pattern!r} matches no file (relative to {base})")
            paths += matches
        else:
            paths.append(full)
    if not paths:
        raise MmtokError("no input: give shard paths/globs or --shard-list FILE")
    absolute = [os.path.abspath(p) for p in paths]
    seen: set[str] = set()
    for path in absolute:
        if path in seen:
            raise MmtokError(f"{path} is given twice; each input may appear once (its rows would repeat)")
        seen.add(path)
    return absolute


def run(args) -> int:
    from mmtok.launch import resolve_rank
    from mmtok.scan.scanner import ScanOptions, describe, run_scan, scan_share, split_sidecars

    if args.source is not None:
        from mmtok.commands.sources import apply_source, load_source

        args.shards = list(args.shards) + apply_source(args, args.parser, load_source(args.source, args.root), "image")
    if args.workers < 1:
        raise MmtokError(f"--workers must be at least 1, got {args.workers}")
    paths, sidecars = split_sidecars(expand_inputs(args.shards, args.shard_list))
    if sidecars:
        names = ", ".join(os.path.basename(path) for path in sidecars[:3]) + (" ..." if len(sidecars) > 3 else "")
        print_summary("scan", f"skipped {plural(len(sidecars), 'sidecar file')} a producer writes beside its shards "
                              f"(img2dataset's NNNNN_stats.json and NNNNN.parquet metadata): {names}")
    if not paths:
        raise MmtokError("no input left once the producer's sidecar files are set aside; pass the .tar shards")
    refuse_out_overlapping(args.out, [*paths, args.shard_list, args.source])
    sources = [describe(p) for p in paths]
    options = ScanOptions(image_column=args.image_column, text_column=args.text_column)
    rank, world_size = resolve_rank(args.rank, args.world_size)
    if world_size == 1:
        scanned = run_scan(sources, args.out, options, workers=args.workers, progress=not args.no_progress)
    else:
        share = scan_share(sources, args.out, options, rank, world_size, args.workers, progress=not args.no_progress)
        scanned = share.manifest
        print_summary("scan", share_line(share))
        if scanned is None:
            return 0
    if not scanned.meta.images_ok:
        raise MmtokError(no_image_message(scanned, args.out))
    print_summary("scan", [summary_line(scanned, args.out), *warning_lines(scanned.meta, args.out)])
    return 0


def warning_lines(meta: ManifestMetadata, out: str) -> list[str]:
    """What a user should look at although nothing failed: samples that held more than one caption, or images
    named past the key's first dot (both most often separate samples a producer named with dots)."""
    from mmtok.formats.manifest import Manifest
    from mmtok.scan.scanner import EXTRA_CAPTION

    extra = meta.ignored_members.get(EXTRA_CAPTION, 0)
    merged, key, members = Manifest.open(out).merged_by_dots()
    if not extra and not merged:
        return []
    found = [f"{plural(extra, 'caption')} beyond a sample's first went unused"] if extra else []
    if merged:
        found.append(f"{plural(merged, 'sample')} {'holds' if merged == 1 else 'hold'} several images named past "
                     f"the key's first dot (first: sample `{key}` with "
                     f"{', '.join(members[:3])}{' ...' if len(members) > 3 else ''})")
    return [f"warning: {'; '.join(found)}: a WebDataset sample key is a member's name up to its first dot, so "
            "`laion.v2.000001.jpg` and `laion.v2.000002.jpg` are both sample `laion` -- rename such members "
            "(docs/scan.md)"]


def share_line(share: ScanShare) -> str:
    """What one rank scanned, and who writes the manifest."""
    line = (f"rank {share.rank} of {share.world_size}: scanned {plural(share.scanned_shards, 'shard')} "
            f"({share.taken_over:,} taken over from other ranks; its share was {share.own_shards:,} of "
            f"{share.shards:,}), {plural(share.read.rows, 'image')}"
            + (f", {per_image(share.read)}" if share.read.rows else ""))
    if share.left:
        return (line + f"; {plural(share.left, 'shard')} still being scanned by other ranks: the last of them "
                "writes the manifest (or run `mmtok scan` without --rank when they have ended)")
    if share.manifest is None:
        return line + "; every shard is done: the other rank that finished last writes the manifest"
    return line + "; every shard is done: writing the manifest"


def per_image(totals: ReadTotals) -> str:
    """Reads and bytes requested from storage per image row (what a scan costs a parallel file system)."""
    rows = max(totals.rows, 1)
    return f"{totals.reads / rows:.2f} reads and {totals.bytes_read / rows / 1000:.1f} KB read per image"


def no_image_message(scanned: Scanned, out: Path) -> str:
    """One line for a scan that found no usable image: the errors by reason, each with its first
    input and detail, the members skipped by extension, and what to check."""
    meta = scanned.meta
    found = []
    for reason, count in sorted(meta.reasons.items(), key=lambda item: -item[1]):
        err = scanned.first_errors.get(reason)
        where = f" (first: {err.source}{': ' + err.detail if err.detail else ''})" if err else ""
        found.append(f"{reason} {count:,}{where}")
    ignored = ", ".join(f"{name} {count:,}" for name, count in meta.ignored_members.items())
    if ignored:
        found.append(f"skipped members: {ignored}")
    return (f"no image found in {meta.shards:,} input(s): {'; '.join(found) or 'no image members'}. "
            "Check the paths: mmtok scan reads uncompressed tar shards (image members named "
            "*.jpg/png/webp/...) and Parquet/Arrow files with an image column; "
            + (f"every error row is in {out / 'manifest.parquet'}, each named with its reason and detail in "
               f"{out / 'skipped.jsonl'}" if scanned.written else
               f"nothing written, the earlier manifest in {out} is kept"))


def summary_line(scanned: Scanned, out: Path) -> str:
    meta, run = scanned.meta, scanned.run
    errors = ", ".join(f"{reason} {count:,}" for reason, count in meta.reasons.items()) or "none"
    # Rows scanned in this run (cached shards excluded), error rows included: the work done per second.
    rate = run.rows_scanned / run.seconds if run.seconds > 0 else 0.0
    return (f"{plural(meta.shards, 'shard')} ({run.cached_shards:,} from cache), "
            f"{plural(meta.images_ok, 'image')} ok, {plural(meta.errors, 'error')} ({errors}), "
            f"{rate:,.0f} images/s with {plural(run.workers, 'worker')}, {per_image(run.read)}; "
            f"wrote {out / 'manifest.parquet'}"
            + (f"; every error named in {out / 'skipped.jsonl'}" if meta.errors else ""))
