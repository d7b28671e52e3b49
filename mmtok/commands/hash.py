"""`mmtok hash`: the perceptual hash (pHash) and sha256 of every image of a manifest, for `mmtok dedup`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.report import plural, print_summary

if TYPE_CHECKING:  # hashing is imported when a hash runs, not for `--help`
    from mmtok.curate.hashing import HashShare
    from mmtok.formats.hashes import CaptionChecks, HashMetadata

CHUNK_ROWS = 4096  # manifest rows per committed chunk: a few minutes of one core, so a kill loses little


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "hash", help="pHash and sha256 of every image of a manifest (for `mmtok dedup`)",
        description="Decode every image of a scanned manifest once and record its 64-bit perceptual hash (the same "
        "bits as imagehash.phash of ImageHash 4.3) and the sha256 of its bytes, into OUT/hashes.parquet + "
        "OUT/hashes.json; images that do not decode are named in OUT/skipped.jsonl. Finished chunks are "
        "committed as they go, so a rerun after a kill resumes. Across nodes: one process per rank "
        "(--rank/--world-size, or from torchrun/srun); the last to finish writes the table, the same bytes "
        "as one process's run. Each sample's caption is read in the same pass and measured for `mmtok dedup`'s "
        "caption checks (loops, number runs, repeated endings, prompt fragments, templates).")
    parser.add_argument("manifest", type=Path, help="manifest directory (from `mmtok scan`)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="output directory")
    parser.add_argument("--source", metavar="NAME",
                        help="the source name `mmtok dedup` policies refer to (default: the manifest's folder name)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="processes hashing in parallel (default: CPU count)")
    parser.add_argument("--rank", type=int, default=None,
                        help="this process's rank (default: RANK, else SLURM_PROCID, else 0)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: WORLD_SIZE, else SLURM_NTASKS, else 1)")
    parser.add_argument("--chunk-rows", type=int, default=CHUNK_ROWS, metavar="N",
                        help=f"manifest rows per committed chunk (default {CHUNK_ROWS}); every rank of a job must use "
                        "the same value (the table's bytes do not depend on it)")
    parser.add_argument("--prompt-fragments", type=Path, metavar="FILE",
                        help="UTF-8 file of prompt fragments, one per line, that must not appear in a caption (a "
                        "prompt echoed into the answer); `mmtok dedup` flags the captions holding one "
                        "(docs/curation.md). Every rank of a job must be given the same file")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.curate.captions import Fragments
    from mmtok.curate.hashing import hash_manifest
    from mmtok.errors import MmtokError
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.launch import resolve_rank

    if args.workers < 1:
        raise MmtokError(f"--workers must be at least 1, got {args.workers}")
    if args.source is not None and not args.source.strip():
        raise MmtokError("--source must name the source (it may not be empty)")
    refuse_out_overlapping(args.out, [args.manifest])
    fragments = Fragments.read(args.prompt_fragments) if args.prompt_fragments else None
    rank, world_size = resolve_rank(args.rank, args.world_size)
    share = hash_manifest(args.manifest, args.out, args.source, rank, world_size, args.workers, args.chunk_rows,
                          progress=not args.no_progress, fragments=fragments)
    meta = share.table
    if meta is None:
        print_summary("hash", f"rank {rank} of {world_size}: hashed {plural(share.hashed_chunks, 'chunk')} "
                              f"({share.taken_over:,} taken over), {plural(share.images, 'image')}; "
                              f"{plural(share.left, 'chunk')} left to other ranks: the last of them writes the "
                              "table (or run `mmtok hash` without --rank when they have ended)")
        return 0
    print_summary("hash", summary_lines(meta, share, args.out))
    return 0


def summary_lines(meta: HashMetadata, share: HashShare, out: Path) -> list[str]:
    """The table's counts, which add up to the manifest's rows, and where each kind of row is."""
    counts = meta.counts
    skipped = sum(counts.skipped.values())
    reasons = ", ".join(f"{reason} {n:,}" for reason, n in counts.skipped.items())
    rate = share.images / share.seconds if share.seconds > 0 else 0.0
    return [f"source {meta.source!r}: {plural(counts.manifest_rows, 'manifest row')} = "
            f"{meta.hashed:,} hashed + {skipped:,} skipped{f' ({reasons})' if reasons else ''} + "
            f"{counts.scan_errors:,} scan error rows",
            f"{share.images:,} hashed in this run ({rate:,.0f} images/s with {plural(share.workers, 'worker')}, "
            f"{share.chunks - share.hashed_chunks:,} of {plural(share.chunks, 'chunk')} done before)",
            caption_line(meta.captions),
            f"wrote {out / 'hashes.parquet'}" + (f"; skipped images named in {out / 'skipped.jsonl'}" if skipped
                                                 else "")]


def caption_line(record: CaptionChecks) -> str:
    """How many hashed rows had their caption checked, and why the others were not (these add up to hashed)."""
    counts = record.counts
    others = ", ".join(f"{n:,} {name}" for name, n in counts.items() if name != "checked" and n)
    fragments = len(record.fragments)
    return (f"captions: {counts['checked']:,} checked" + (f", {others}" if others else "")
            + (f"; {plural(fragments, 'prompt fragment')} looked for" if fragments else ""))
