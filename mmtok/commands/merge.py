"""`mmtok merge`: join the finished parts of an encode output into one Megatron dataset."""

from __future__ import annotations

import argparse
from pathlib import Path

from mmtok.commands.report import plural, print_report, reasons, refuse_nothing_usable
from mmtok.formats import skips
from mmtok.formats.megatron import MMTOK_READER
from mmtok.formats.merged import MergeSummary


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "merge", help="join the finished parts of an encode output into one Megatron dataset",
        description="Join OUT/parts/part-* (all must be DONE) in part order into OUT/merged.bin/.idx, with "
        "OUT/merged.provenance.jsonl (line i describes sequence i) and OUT/merged.json (summed stats), and "
        "verify the result with megatron-core's IndexedDataset. Every part is first checked against the "
        "checksums of its commit log (a damaged part is refused, naming it and the batch); the parts' skip "
        "lists are joined into OUT/merged.skipped.jsonl. The merged bytes do not depend on the "
        "number of ranks that encoded the parts. One merge per OUT at a time (OUT/.lock).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", help="the encode output directory (the --out of `mmtok encode`)")
    parser.add_argument("--strip-reasoning", action="store_true",
                        help="also write OUT/merged_no_reasoning.bin/.idx with every <|inner_prefix|> ... "
                        "<|inner_suffix|> span removed (markers included); sequences left empty are dropped")
    parser.add_argument("--no-progress", action="store_true", help="no progress (checking the parts reads every byte)")
    parser.add_argument("--json", action="store_true",
                        help="also print the merge's summary (merged.json + out, seconds) as one JSON object on stdout")
    parser.set_defaults(func=run)


def run(args) -> int:
    import time

    from mmtok.merge.merge import merge

    started = time.perf_counter()
    summary = merge(args.out, strip_reasoning=args.strip_reasoning, progress=not args.no_progress)
    seconds = time.perf_counter() - started
    print_report("merge", summary_lines(summary, args.out, seconds),
                 {**summary.to_json(), "out": args.out, "seconds": round(seconds, 3)} if args.json else None)
    if not summary.dataset:
        refuse_nothing_usable(args.out, 0, summary.counts, Path(args.out) / summary.skipped_file)
    return 0


def summary_lines(summary: MergeSummary, out: str, seconds: float) -> list[str]:
    """What the merge wrote: the dataset (or why none), assembled documents, skips, the reasoning-free copy."""
    parts = plural(summary.num_parts, "part")
    if summary.dataset:
        lines = [f"{parts} -> {out}/merged.bin/.idx: {plural(summary.sequences, 'sequence')}, "
                 f"{plural(summary.tokens, 'token')} in {seconds:.1f} s (verified with {summary.verified_with})"]
    else:
        lines = [f"{parts}, no sequence with a token: no dataset written (megatron-core cannot open an empty one); "
                 "merged.json says so"]
    if summary.verified_with == MMTOK_READER:
        lines.append("megatron-core is not installed (pip install 'mmtok[megatron]'): verified with mmtok's own reader")
    assembled = summary.assembled
    if assembled.documents or assembled.documents_skipped:
        lines.append(f"of which {plural(assembled.documents, 'document')} with several images assembled from the "
                     f"parts' items ({plural(assembled.tokens, 'token')}; {assembled.documents_skipped:,} skipped)")
    skipped = skips.by_reason(summary.counts)
    if skipped:
        lines.append(f"skipped {sum(skipped.values()):,} ({reasons(skipped)}), each named in "
                     f"{out}/{summary.skipped_file}")
    return lines + _stripped_lines(summary.strip_reasoning)


def _stripped_lines(strip: dict | None) -> list[str]:
    if not strip:
        return []
    if not strip["dataset"]:
        return ["merged_no_reasoning: no sequence left: not written"]
    return [f"merged_no_reasoning: {plural(strip['sequences'], 'sequence')}; "
            f"{plural(strip['spans_removed'], 'reasoning span')} "
            f"({plural(strip['reasoning_tokens_removed'], 'token')}) "
            f"removed, {plural(strip['orphan_prefixes'], 'orphan prefix', 'orphan prefixes')}, "
            f"{plural(strip['orphan_suffixes'], 'orphan suffix', 'orphan suffixes')}, "
            f"{plural(strip['dropped_empty_sequences'], 'empty sequence')} dropped"]
