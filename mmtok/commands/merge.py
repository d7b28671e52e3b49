"""`mmtok merge`: join the finished parts of an encode output into one Megatron dataset."""

from __future__ import annotations

import argparse


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
    parser.set_defaults(func=run)


def run(args) -> int:
    import time

    from mmtok.formats.megatron import MMTOK_READER
    from mmtok.formats import skips
    from mmtok.merge.merge import merge

    started = time.perf_counter()
    summary = merge(args.out, strip_reasoning=args.strip_reasoning, progress=not args.no_progress)
    seconds = time.perf_counter() - started
    if summary["verified_with"] == MMTOK_READER:
        print("mmtok merge: megatron-core is not installed (pip install 'mmtok[megatron]'); verified with "
              "mmtok's own reader")
    skipped = skips.by_reason(summary["counts"])
    if summary["dataset"]:
        print(f"mmtok merge: {summary['num_parts']} parts -> {args.out}/merged.bin/.idx: {summary['sequences']:,} "
              f"sequences, {summary['tokens']:,} tokens in {seconds:.1f} s (verified with {summary['verified_with']})")
    else:
        print(f"mmtok merge: {summary['num_parts']} parts, no sequence with a token: no dataset written (megatron-core "
              f"cannot open an empty one); merged.json says so")
    assembled = summary["assembled"]
    if assembled["documents"] or assembled["documents_skipped"]:
        print(f"  of which {assembled['documents']:,} documents with several images assembled from the parts' items "
              f"({assembled['tokens']:,} tokens; {assembled['documents_skipped']:,} skipped)")
    if skipped:
        listed = f"{args.out}/{summary['skipped_file']}"
        print(f"  skipped {sum(skipped.values()):,} (" + ", ".join(f"{k} {v:,}" for k, v in sorted(skipped.items()))
              + f"), each named in {listed}")
    strip = summary.get("strip_reasoning")
    if strip and not strip["dataset"]:
        print("  merged_no_reasoning: no sequence left: not written")
    elif strip:
        print(f"  merged_no_reasoning: {strip['sequences']:,} sequences; {strip['spans_removed']:,} reasoning spans "
              f"({strip['reasoning_tokens_removed']:,} tokens) removed, {strip['orphan_prefixes']} orphan prefixes, "
              f"{strip['orphan_suffixes']} orphan suffixes, {strip['dropped_empty_sequences']} empty sequences dropped")
    return 0
