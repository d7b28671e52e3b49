"""`mmtok bench reconstruct`: score tokenizer reconstructions per category (images: PSNR/SSIM/LPIPS; audio:
tokens/s, mel L1, STOI, wideband PESQ) on a stratified, seeded sample, preprocessed exactly as training.

--manifest is a scan manifest directory (category = a manifest column such as `tar`, or a column of a
--categories table joined on `key`) or a table file (.csv/.parquet/.jsonl) with a path column and the
category column. Each --tokenizer is NAME=CHECKPOINT[,key=value...] with NAME a registered codec
(emu3.5, emu3, wavtokenizer) and keys label=, min_pixels=, max_pixels=, max_aspect=, preset= (a plan
preset to take the image resize bounds from). Image resize defaults: Emu3 takes its checkpoint's
preprocessor_config.json (official: 262,144..1,048,576 pixels, 8 px per code, aspect <= 5); Emu3.5 takes
mmtok plan's defaults (65,536..262,144 pixels, 16 px per code, aspect <= 4).

OUT gets report.md, results.csv, summary.json, metrics.png, grids/ (images) and recon/ (kept
reconstructions and WAV pairs). Rerunning with the same arguments resumes: finished items are skipped.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.options import add_device_argument
from mmtok.commands.report import plural, print_summary

if TYPE_CHECKING:  # the benchmark is imported when it runs, not for `--help`
    from mmtok.bench.report import BenchSummary


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="tokenizer benchmarks",
                            description="Compare codecs on your own data: `reconstruct` encodes and decodes a sample "
                            "of a manifest with each codec and scores the reconstructions per category (PSNR, SSIM, "
                            "LPIPS; audio: mel L1, STOI, PESQ). `mmtok bench reconstruct --help`; docs/benchmarks.md.")
    bench_sub = parser.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    child = bench_sub.add_parser("reconstruct", help="score tokenizer reconstructions per category",
                                 description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    child.add_argument("--manifest", required=True, help="scan manifest directory or a table file (csv/parquet/jsonl)")
    child.add_argument("--category-column", required=True, help="column holding each item's category")
    child.add_argument("--per-category", type=int, default=50, help="items drawn per category (default 50)")
    child.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    child.add_argument("--tokenizer", action="append", required=True, metavar="NAME=CHECKPOINT[,k=v...]",
                       help="a codec and its checkpoint directory; repeat to compare several")
    child.add_argument("--out", required=True, help="output folder (resumed when it holds the same run)")
    child.add_argument("--modality", choices=("image", "audio"), default="image", help="default image")
    add_device_argument(child)
    child.add_argument("--path-column", default="path", help="table input: column with file paths (default path)")
    child.add_argument("--categories", default=None, help="manifest input: table with `key` and the category column")
    child.add_argument("--text-tokenizer", default="tekken",
                       help="text tokenizer counting the dimension tokens of image blocks (default tekken)")
    child.add_argument("--keep-per-category", type=int, default=4,
                       help="items per category whose reconstructions are kept for grids/WAV pairs (default 4)")
    child.add_argument("--no-progress", action="store_true", help="no progress bar")
    child.set_defaults(func=run)


def run(args) -> int:
    from mmtok.extras import require_extra

    require_extra("bench", "mmtok bench reconstruct")  # before hours of encoding, not at the report
    from mmtok.bench.reconstruct import RunOptions, parse_tokenizer
    from mmtok.bench.reconstruct import run as run_bench
    from mmtok.fsutil import refuse_out_overlapping

    refuse_out_overlapping(args.out, [args.manifest, args.categories])

    options = RunOptions(
        manifest=Path(args.manifest), category_column=args.category_column, per_category=args.per_category,
        seed=args.seed, tokenizers=[parse_tokenizer(t) for t in args.tokenizer], out=Path(args.out),
        modality=args.modality, device=args.device, path_column=args.path_column,
        categories=Path(args.categories) if args.categories else None, text_tokenizer=args.text_tokenizer,
        keep_per_category=args.keep_per_category, progress=not args.no_progress)
    summary = run_bench(options)
    print_summary("bench reconstruct", _summary_lines(summary, Path(args.out)))
    return 0


def _summary_lines(summary: BenchSummary, out: Path) -> list[str]:
    from mmtok.bench.report import METRICS, OVERALL

    metrics = METRICS[summary.identity["modality"]]
    lines = [f"{plural(summary.items, 'item')} -> {out}/report.md"]
    for label, groups in summary.means.items():
        overall = groups.get(OVERALL, {})
        values = ", ".join(f"{m.key} {overall.get(m.key)!s:.8}" for m in metrics)
        counts = summary.status_counts.get(label, {})
        lines.append(f"{label}: {overall.get('n', 0)} scored ({counts}); {values}")
    return lines
