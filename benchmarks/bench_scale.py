"""Benchmark `mmtok plan` at corpus scale: peak memory and time of an Apertus-size plan (821.6 M rows, 4,096 ranks).

    python benchmarks/bench_scale.py                          # 10 M, 100 M, 821.6 M rows (~40 min here)
    python benchmarks/bench_scale.py --rows 10000000          # one size: ~2 min
    python benchmarks/bench_scale.py --rows 10000000,100000000 --old-rows 10000000,100000000

Synthetic manifests as benchmarks/bench_plan.py makes them ((width, height) resampled from real images,
log-normal scale, 30% cropped, 0.2% scan errors), with a share `--multi-share` of multi-image documents
(2..8 images), holding only the six columns the plan reads in image mode (the rest are never read; a
smaller file is written faster). Each plan runs in a fresh process pinned to one CPU, pyarrow on one
thread, preset apertus-stage1 in image mode, `--ranks` ranks. New: the working tree's planner. Old: the
planner of `--old` (a `git worktree` of it), run on the sizes in `--old-rows`; where both run, the
sha256 of the plan's files that both planners write alike is compared: plan.parquet, batches.parquet,
documents.parquet and the (manifest_row, reason) columns of dropped.parquet (plan.json and dropped.parquet's
`keeper` column have gained fields since).
Peak memory is the plan process's VmHWM. A watchdog kills a plan when the machine's MemAvailable drops
below `--min-available` GiB (this VM is shared), and `--max-gib` caps the plan's address space.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pyarrow

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_plan import machine, old_checkout, write_synthetic_manifest  # noqa: E402

APERTUS_ROWS = 821_600_000  # vision samples of the Apertus 1.5 report
PLAN_COLUMNS = ("document", "image_index", "width", "height", "status", "reason")
DOC_IMAGES = (2, 8)
OLD_COMMIT = "6b0f67a"  # the last commit with the whole-table planner (every manifest row in memory)
FILES = ("plan.parquet", "batches.parquet", "documents.parquet")  # compared byte for byte; dropped.parquet: 2 columns

CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
import pyarrow as pa
pa.set_cpu_count(1); pa.set_io_thread_count(1)
import mmtok
from mmtok.formats.presets import load_preset
from mmtok.plan import core
from mmtok.plan.rows import text_tokenizer
job = json.loads(sys.argv[1])
params = load_preset("apertus-stage1").override(mode="image")
text_tokenizer(params.text_tokenizer)  # tokenizer load (~1.5 s) is not planning work
wall, cpu = time.perf_counter(), time.process_time()
meta = core.build_plan(job["manifest"], params, job["out"], world_size=job["world_size"], progress=False)
meta = meta.to_json() if hasattr(meta, "to_json") else meta  # the old tree's build_plan returns plan.json's dict
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
with open("/proc/self/status") as status:
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": wall, "cpu_seconds": cpu, "peak_rss_bytes": peak, "code": mmtok.__file__,
                  "num_batches": meta["num_batches"], "kept": meta["totals"]["kept_images"],
                  "imbalance": meta["imbalance"], "split_batches": meta["balance"]["split_batches"]}))
"""


def mem_available() -> int:
    with open("/proc/meminfo") as meminfo:
        return next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))


def run_plan(source: Path, manifest: Path, out: Path, world_size: int, max_gib: float, min_available: float) -> dict:
    """Plan with the mmtok package of `source` in a fresh one-core process, under an address-space cap and a
    watchdog on the machine's free memory; the result has the sha256 of every plan file."""
    job = {"manifest": str(manifest), "out": str(out), "world_size": world_size}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(source)}
    command = ["prlimit", f"--as={int(max_gib * 2 ** 30)}", sys.executable, "-c", CHILD, json.dumps(job)]
    child = subprocess.Popen(command, cwd=source, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    low = False
    while child.poll() is None:
        if mem_available() < min_available * 2 ** 30:
            child.kill()
            low = True
        time.sleep(0.2)
    stdout, stderr = child.communicate()
    if low or child.returncode:
        why = f"killed: MemAvailable below {min_available} GiB" if low else stderr[-3000:]
        return {"failed": why}
    result = json.loads(stdout.strip().splitlines()[-1])
    if Path(result["code"]).resolve().parents[1] != source.resolve():
        raise RuntimeError(f"the plan ran {result['code']}, not the package of {source}")
    result["sha256"] = plan_digests(out)
    return result


def plan_digests(out: Path) -> dict[str, str]:
    """The sha256 of each of FILES, and of the rows and reasons of dropped.parquet."""
    import pyarrow.parquet as pq

    digests = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in FILES}
    dropped = pq.read_table(out / "dropped.parquet", columns=["manifest_row", "reason"])
    digest = hashlib.sha256(dropped.column("manifest_row").to_numpy().tobytes())
    digest.update("\n".join(dropped.column("reason").to_pylist()).encode())
    digests["dropped.parquet (manifest_row, reason)"] = digest.hexdigest()
    return digests


def _short(rows: int) -> str:
    return f"{rows / 1e6:g} M"


def report(results: list[dict], command: str, ranks: int) -> str:
    lines = ["## Plan at scale (`benchmarks/bench_scale.py`)", "", f"Command: `{command}`  ",
             f"Machine: {machine()}, pyarrow {pyarrow.__version__}; each plan in a fresh process pinned to ONE core "
             "(2-core AMD EPYC VM shared with other jobs: CPU seconds are the figure to compare).", "",
             "| rows | ranks | planner | batches | peak GiB | bytes/row | CPU s | wall s | M rows/s (CPU) | "
             "plan files vs old |", "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        for label in ("old", "new"):
            run = r.get(label)
            if run is None:
                continue
            if "failed" in run:
                lines.append(f"| {_short(r['rows'])} | {ranks:,} | {label} | -- | -- | -- | -- | -- | -- | "
                             f"{run['failed']} |")
                continue
            same = "" if label == "old" or "old" not in r or "failed" in r["old"] else \
                ("identical (sha256: images, batches, documents, drops)" if run["sha256"] == r["old"]["sha256"]
                 else "DIFFERENT")
            lines.append(f"| {_short(r['rows'])} | {ranks:,} | {label} | {run['num_batches']:,} | "
                         f"{run['peak_rss_bytes'] / 2 ** 30:.2f} | {run['peak_rss_bytes'] / r['rows']:.1f} | "
                         f"{run['cpu_seconds']:.1f} | {run['seconds']:.1f} | "
                         f"{r['rows'] / run['cpu_seconds'] / 1e6:.2f} | {same} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=f"10000000,100000000,{APERTUS_ROWS}", help="comma-separated corpus sizes")
    parser.add_argument("--old-rows", default="10000000", help="sizes the old planner also plans (comma-separated)")
    parser.add_argument("--ranks", type=int, default=4096)
    parser.add_argument("--multi-share", type=float, default=0.05, help="share of documents with 2..8 images")
    parser.add_argument("--old", default=OLD_COMMIT, help="commit of the old planner")
    parser.add_argument("--max-gib", type=float, default=20.0, help="address-space cap of a plan process")
    parser.add_argument("--min-available", type=float, default=3.0, help="kill a plan below this MemAvailable (GiB)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmtok-bench-scale"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/mmtok-bench-scale/results.md"))
    args = parser.parse_args()
    sizes = [int(v) for v in args.rows.split(",")]
    old_sizes = {int(v) for v in args.old_rows.split(",") if v}
    results = []
    with old_checkout(args.old, args.workdir / "old-tree") as old:
        for rows in sizes:
            t0 = time.perf_counter()
            manifest = write_synthetic_manifest(args.workdir / f"manifest-{rows}", rows, args.multi_share, DOC_IMAGES,
                                                columns=PLAN_COLUMNS)
            print(f"manifest of {_short(rows)} rows ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
            result = {"rows": rows}
            for label, source in (("old", old), ("new", REPO)):
                if label == "old" and rows not in old_sizes:
                    continue
                result[label] = run_plan(source, manifest, args.workdir / f"plan-{rows}-{label}", args.ranks,
                                         args.max_gib, args.min_available)
                print(f"{_short(rows)} {label}: {json.dumps(result[label])}", file=sys.stderr)
            results.append(result)
    text = report(results, "python benchmarks/bench_scale.py " + " ".join(sys.argv[1:]), args.ranks)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
