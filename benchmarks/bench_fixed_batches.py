"""What `mmtok plan --fixed-batches` costs: modeled imbalance with and without balance splits, per world size.

    PYTHONPATH=. python benchmarks/bench_fixed_batches.py [--rows 200000] [--mixed-rows 1000000]
        [--world-sizes 8,64,800,4096] [--workdir /tmp/mmtok-bench-plan]

--fixed-batches never splits a batch at a rank target, so a plan's batch list is the same for every world
size and the merged bytes do not rely on the device's codes being batch-invariant. The price is balance
where a corpus has few batches per rank. The corpora are bench_plan.py's synthetic manifests (shapes
resampled from real photos; "captions": one image per document; "mixed": 15% of documents hold 2-20
images), planned with the apertus-stage1 preset in mode image, both ways in the same run. Reported per
(corpus, world size): batches per rank, the imbalance (max/mean rank cost - 1) of the default plan and of
the fixed-batches plan, the batches the default split, and both plans' CPU seconds. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import PRESET, machine, write_synthetic_manifest  # noqa: E402 -- the same synthetic corpora
from mmtok.formats.presets import load_preset  # noqa: E402
from mmtok.plan import build_plan  # noqa: E402


def plan_both(manifest: Path, world_size: int, work: Path) -> dict:
    params = load_preset(PRESET).override(mode="image")
    result = {}
    for name, fixed in (("default", False), ("fixed", True)):
        started = time.process_time()
        meta = build_plan(manifest, params, work / f"{name}-{world_size}", world_size=world_size, progress=False,
                          fixed_batches=fixed)
        result[name] = {"imbalance": meta.imbalance, "batches": meta.num_batches,
                        "split": meta.balance.split_batches, "cpu": time.process_time() - started}
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the captions corpus")
    parser.add_argument("--mixed-rows", type=int, default=1_000_000, help="rows of the mixed corpus (0: none)")
    parser.add_argument("--world-sizes", default="8,64,800,4096")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmtok-bench-plan"), help="manifest cache")
    args = parser.parse_args()
    sizes = [int(n) for n in args.world_sizes.split(",")]
    corpora = [("captions", args.rows, 0.0)] + ([("mixed", args.mixed_rows, 0.15)] if args.mixed_rows else [])
    started = time.perf_counter()
    lines = ["| corpus | rows | ranks | batches per rank | imbalance (default) | batches split (default) | "
             "imbalance (--fixed-batches) | plan CPU s default / fixed |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, rows, share in corpora:
        manifest = write_synthetic_manifest(args.workdir / f"fixed-{name}-{rows}", rows, share, (2, 20))
        for n in sizes:
            with tempfile.TemporaryDirectory() as tmp:
                r = plan_both(manifest, n, Path(tmp))
            d, f = r["default"], r["fixed"]
            lines.append(f"| {name} | {rows:,} | {n:,} | {f['batches'] / n:,.1f} | {100 * d['imbalance']:.3f}% | "
                         f"{d['split']:,} | {100 * f['imbalance']:.3f}% | {d['cpu']:.1f} / {f['cpu']:.1f} |")
            print(f"{name} {n}: default {100 * d['imbalance']:.3f}%, fixed {100 * f['imbalance']:.3f}%",
                  file=sys.stderr, flush=True)
    print(f"Command: `PYTHONPATH=. python benchmarks/bench_fixed_batches.py --rows {args.rows} --mixed-rows "
          f"{args.mixed_rows} --world-sizes {args.world_sizes}`; {machine()}; "
          f"{time.perf_counter() - started:.0f} s in all.\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
