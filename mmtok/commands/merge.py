"""`mmtok merge`: join the finished parts of an encode output into one Megatron dataset."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "merge", help="join the finished parts of an encode output into one Megatron dataset",
        description="Join OUT/parts/part-* (all must be DONE) in part order into OUT/merged.bin/.idx, with "
        "OUT/merged.provenance.jsonl (line i describes sequence i) and OUT/merged.json (summed stats), and "
        "verify the result with megatron-core's IndexedDataset. The merged bytes do not depend on the "
        "number of ranks that encoded the parts.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out", help="the encode output directory (the --out of `mmtok encode`)")
    parser.add_argument("--strip-reasoning", action="store_true",
                        help="also write OUT/merged_no_reasoning.bin/.idx with every <|inner_prefix|> ... "
                        "<|inner_suffix|> span removed (markers included); sequences left empty are dropped")
    parser.set_defaults(func=run)


def run(args) -> int:
    import time

    from mmtok.merge import merge

    started = time.perf_counter()
    summary = merge(args.out, strip_reasoning=args.strip_reasoning)
    seconds = time.perf_counter() - started
    skipped = {k: v for k, v in summary["counts"].items() if k.startswith("skipped:")}
    print(f"mmtok merge: {summary['num_parts']} parts -> {args.out}/merged.bin/.idx: {summary['sequences']:,} "
          f"sequences, {summary['tokens']:,} tokens in {seconds:.1f} s (verified with {summary['verified_with']})")
    if skipped:
        print("  skipped: " + ", ".join(f"{k.split(':', 1)[1]} {v:,}" for k, v in sorted(skipped.items())))
    if "strip_reasoning" in summary:
        strip = summary["strip_reasoning"]
        print(f"  merged_no_reasoning: {strip['sequences']:,} sequences; {strip['spans_removed']:,} reasoning spans "
              f"({strip['reasoning_tokens_removed']:,} tokens) removed, {strip['orphan_prefixes']} orphan prefixes, "
              f"{strip['orphan_suffixes']} orphan suffixes, {strip['dropped_empty_sequences']} empty sequences dropped")
    return 0
