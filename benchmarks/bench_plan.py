"""Benchmark `mmtok plan`: time and peak memory on 10 M / 100 M-row manifests (one core), rank
imbalance at 8 / 64 / 800 / 4,096 ranks, and budget use next to a baseline that does not sort by shape.

    python benchmarks/bench_plan.py                       # 10M and 100M rows, writes the Markdown report
    python benchmarks/bench_plan.py --rows 1000000 --out /tmp/results-plan.md

Synthetic manifests: (width, height) resampled from the real images of scikit-image and Debian's
mate-backgrounds, each scaled by a log-normal factor (sigma 0.6: the same photo at many resolutions)
and, for 30% of them, the aspect ratio jittered (log-normal, sigma 0.15: crops) -- about a thousand
distinct 512²-bounded target shapes, the ten most common holding ~60% of the images; 0.2% scan errors.
Two corpora: "captions" (one image per document, what the stage presets plan) at every size, and
"mixed" (15% of documents hold 2-6 images, interleaved-style) at 10 M rows, planned with several
lane sizes to show the rank-balance / batch-fill trade-off of multi-image documents. The plan runs in a fresh process pinned to
one CPU with pyarrow limited to one thread; peak memory is that process's ru_maxrss.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
WORLD_SIZES = (8, 64, 800, 4096)
PRESET = "apertus-stage1"  # low resolution: the most images per batch, the hardest case for the planner
CROPPED = 0.3  # share of images whose aspect ratio is jittered (crops); the rest keep a real photo's aspect


# ----------------------------------------------------------------------------- synthetic manifest


def real_sizes() -> np.ndarray:
    """(width, height) of every real image Pillow can read, at least 64x64."""
    from PIL import Image

    from realmedia import mate_photos, skimage_images

    sizes = []
    for path in skimage_images() + mate_photos():
        try:
            with Image.open(path) as image:
                if image.size[0] * image.size[1] >= 64 * 64:
                    sizes.append(image.size)
        except OSError:
            continue
    return np.array(sizes, np.int64)


def synthetic_chunk(rng: np.random.Generator, sizes: np.ndarray, start: int, n: int, first_doc: int,
                    multi_share: float):
    """Columns of manifest rows [start, start + n) (contract layout); returns (columns, next document id)."""
    import pyarrow as pa

    base = sizes[rng.integers(0, len(sizes), n)]
    scale = np.exp(rng.normal(0.0, 0.6, n))
    aspect = np.where(rng.random(n) < CROPPED, np.exp(rng.normal(0.0, 0.15, n)), 1.0)
    width = np.maximum(np.rint(base[:, 0] * scale * aspect), 1).astype(np.int32)
    height = np.maximum(np.rint(base[:, 1] * scale / aspect), 1).astype(np.int32)
    doc_sizes = np.where(rng.random(n) < multi_share, rng.integers(2, 7, n), 1)
    document = np.repeat(np.arange(first_doc, first_doc + n), doc_sizes)[:n]
    starts = np.flatnonzero(np.diff(document, prepend=document[0] - 1))
    image_index = (np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))).astype(np.int32)
    error = rng.random(n) < 0.002
    row = np.arange(start, start + n, dtype=np.int64)
    key = _fixed_strings(document, 10)
    tar_id = row // 10_000
    tars = pa.array([f"/data/shards/shard-{t:06d}.tar" for t in range(int(tar_id[0]), int(tar_id[-1]) + 1)])
    columns = {
        "key": key, "document": document.astype(np.int64), "image_index": image_index,
        "tar": pa.DictionaryArray.from_arrays(pa.array(tar_id - tar_id[0], pa.int32()), tars).dictionary_decode(),
        "container": _constant("tar", n), "member": key,  # member names are not read by the plan
        "offset": row * 100_000 + 512, "size": np.full(n, 99_000, np.int64),
        "width": np.where(error, 0, width), "height": np.where(error, 0, height),
        "format": _constant("jpeg", n), "orientation": np.ones(n, np.int8),
        "text_offset": row * 100_000 + 99_600, "text_size": np.full(n, 80, np.int64),
        "json_offset": np.full(n, -1, np.int64), "json_size": np.full(n, -1, np.int64),
        "status": pa.DictionaryArray.from_arrays(pa.array(error.astype(np.int32)), pa.array(["ok", "error"])).dictionary_decode(),
        "reason": pa.DictionaryArray.from_arrays(pa.array(error.astype(np.int32)), pa.array(["", "truncated_member"])).dictionary_decode(),
    }
    return columns, int(document[-1]) + 1


def _fixed_strings(values: np.ndarray, width: int):
    """Zero-padded decimal strings built from buffers (pa.array over 100 M Python strings is too slow)."""
    import pyarrow as pa

    digits = (values[:, None] // 10 ** np.arange(width - 1, -1, -1) % 10 + ord("0")).astype(np.uint8)
    offsets = np.arange(0, width * len(values) + 1, width, dtype=np.int32)
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(digits.tobytes()))


def _constant(value: str, n: int):
    import pyarrow as pa

    return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int32)), pa.array([value])).dictionary_decode()


def write_synthetic_manifest(directory: Path, rows: int, multi_share: float, seed: int = 0) -> Path:
    """A contract-layout manifest of `rows` rows (cached: reused when it already has that many rows)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmtok.formats.manifest import FORMAT, FORMAT_VERSION

    path = directory / "manifest.parquet"
    meta = directory / "manifest.json"
    recorded = json.loads(meta.read_text()) if meta.is_file() else {}
    if path.is_file() and "format" in recorded and recorded["fingerprint"] == _tag(rows, multi_share, seed):
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng, sizes = np.random.default_rng(seed), real_sizes()
    writer, document, chunk = None, 0, 1 << 21
    for start in range(0, rows, chunk):
        columns, document = synthetic_chunk(rng, sizes, start, min(chunk, rows - start), document, multi_share)
        table = pa.table(columns)
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema, compression="zstd")
        writer.write_table(table, row_group_size=1 << 20)
    writer.close()
    (directory / "manifest.json").write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "rows": rows,
                                                         "fingerprint": _tag(rows, multi_share, seed)}))
    return directory


def _tag(rows: int, multi_share: float, seed: int) -> str:
    """Identifies the synthetic corpus (reused from the work directory only when it matches)."""
    return f"synthetic-v3-rows{rows}-multi{multi_share}-seed{seed}-cropped{CROPPED}"


# ----------------------------------------------------------------------------- one plan, one core

CHILD = r"""
import json, os, resource, sys, time
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
import pyarrow as pa
pa.set_cpu_count(1); pa.set_io_thread_count(1)
from mmtok.formats.plan import PlanWriter
from mmtok.plan import batching, core, load_preset
from mmtok.plan.rows import text_tokenizer
phases = {"read + filter + target shapes": 0.0, "windows + batches": 0.0, "write files": 0.0}

def timed(owner, name, phase):
    inner = getattr(owner, name)
    def wrapper(*args, **kwargs):
        t = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[phase] += time.process_time() - t
    setattr(owner, name, wrapper)

timed(core, "filter_manifest", "read + filter + target shapes")
timed(batching.GroupPlanner, "plan", "windows + batches")
timed(core, "_write_group", "write files")
timed(PlanWriter, "finish", "write files")
params = load_preset(sys.argv[3]).override(mode="image", **json.loads(sys.argv[4]))
text_tokenizer(params.text_tokenizer)  # tokenizer load (~1.5 s) is not planning work
wall, cpu = time.perf_counter(), time.process_time()
meta = core.build_plan(sys.argv[1], params, sys.argv[2], world_size=800, progress=False)
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
phases["other (shape table, ranks, metadata)"] = cpu - sum(phases.values())
print(json.dumps({"seconds": wall, "cpu_seconds": cpu, "phases": phases,
                  "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                  "num_batches": meta["num_batches"], "kept": meta["totals"]["kept_images"],
                  "files_bytes": sum(f["bytes"] for f in meta["files"].values())}))
"""


def run_plan(manifest: Path, out: Path, **overrides) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", CHILD, str(manifest), str(out), PRESET, json.dumps(overrides)],
                          env=env, check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- analyses


def rank_imbalance(plan_dir: Path) -> dict:
    """Imbalance and partition time per world size, from the plan's batch costs and documents."""
    import pyarrow.parquet as pq

    from mmtok.ranks import allowed_cuts, imbalance, partition_ranks, rank_costs

    cost = pq.read_table(plan_dir / "batches.parquet", columns=["cost"]).column(0).to_numpy()
    docs = pq.read_table(plan_dir / "documents.parquet", columns=["first_batch", "last_batch"])
    cut_ok = allowed_cuts(docs.column(0).to_numpy(), docs.column(1).to_numpy(), len(cost))
    results: dict = {"cut_ok_fraction": float(cut_ok.mean())}
    for n in WORLD_SIZES:
        t0 = time.perf_counter()
        ranges = partition_ranks(cost, cut_ok, n)
        results[n] = {"imbalance": imbalance(rank_costs(cost, ranges)), "seconds": time.perf_counter() - t0}
    return results


def planner_utilization(plan_dir: Path, budget: int) -> dict:
    import pyarrow.parquet as pq

    b = pq.read_table(plan_dir / "batches.parquet", columns=["num_images", "tokens", "full"])
    tokens = b.column("tokens").to_numpy()
    full = b.column("full").to_numpy()
    count = b.column("num_images").to_numpy()
    return {"batches": len(tokens), "full_fraction": float(full.mean()),
            "images_in_full": float(count[full].sum() / count.sum()),
            "mean_fill": float(np.minimum(tokens / budget, 1).mean()),
            "images_per_batch": float(b.column("num_images").to_numpy().mean()),
            "mixed_images": 0.0, "padding_overhead": 0.0}


def baseline_utilization(plan_dir: Path, budget: int, max_images: int, window_rows: int) -> dict:
    """A planner without the shape sort: kept images in manifest order, cut greedily by the same
    budget and cap inside the same windows. Reports how many images would need padding or resizing
    to the batch's most common shape, and the tokens padding to the largest shape would add."""
    import pyarrow.parquet as pq

    t = pq.read_table(plan_dir / "plan.parquet", columns=["manifest_row", "target_height", "target_width", "tokens"])
    order = np.argsort(t.column("manifest_row").to_numpy(), kind="stable")
    row = t.column("manifest_row").to_numpy()[order]
    h, w = (t.column(c).to_numpy()[order].astype(np.int64) for c in ("target_height", "target_width"))
    tokens = t.column("tokens").to_numpy()[order].astype(np.int64)
    window = row // window_rows  # same windows up to document snapping (irrelevant for utilization)
    batch, full = _greedy_batches(tokens, window, budget, max_images)
    count = np.bincount(batch)
    batch_tokens = np.bincount(batch, weights=tokens)
    shape = h << 20 | w
    pairs, pair_count = np.unique(np.stack([batch, shape], 1), axis=0, return_counts=True)
    modal = np.zeros(len(count), np.int64)
    np.maximum.at(modal, pairs[:, 0], pair_count)
    max_h, max_w = np.zeros(len(count), np.int64), np.zeros(len(count), np.int64)
    np.maximum.at(max_h, batch, h)
    np.maximum.at(max_w, batch, w)
    padded = count * ((max_h // 16) * (max_w // 16 + 1) + 9)  # block length, 5 dimension digits assumed
    return {"batches": len(count), "full_fraction": float(full.mean()),
            "images_in_full": float(count[full].sum() / count.sum()),
            "mean_fill": float(np.minimum(batch_tokens / budget, 1).mean()), "images_per_batch": float(count.mean()),
            "mixed_images": float((count - modal).sum() / count.sum()),
            "uniform_batches": float(np.mean(count == modal)),
            "padding_overhead": float(padded.sum() / tokens.sum() - 1)}


def _greedy_batches(tokens: np.ndarray, window: np.ndarray, budget: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy consecutive batches: one searchsorted per batch (the baseline is allowed a Python loop)."""
    prefix = np.concatenate([[0], np.cumsum(tokens)])
    window_end = np.searchsorted(window, window, side="right")
    batch = np.empty(len(tokens), np.int64)
    full = []
    i = b = 0
    while i < len(tokens):
        j = int(np.searchsorted(prefix, prefix[i] + budget, side="right")) - 1
        j = max(i + 1, min(j, i + cap, int(window_end[i])))
        batch[i:j] = b
        full.append(j < window_end[i])  # stopped by budget or cap, not by the window's end
        i, b = j, b + 1
    return batch, np.array(full, bool)


# ----------------------------------------------------------------------------- report


def machine() -> str:
    return f"2-core x86_64 CPU VM, no GPU ({platform.python_implementation()} {platform.python_version()}, numpy {np.__version__})"


def report(results: dict, mixed: dict, command: str) -> str:
    first = next(iter(results.values()))["plan"]
    lines = ["# `mmtok plan` benchmark", "",
             f"Command: `{command}`  ", f"Machine: {machine()}; the plan runs in a fresh process pinned to ONE core, "
             f"pyarrow limited to 1 thread. Load average at the end of the run: {os.getloadavg()[0]:.1f} (other jobs "
             "shared the 2 cores), so CPU seconds (process time) are the figure to compare; wall time is shown too.  ",
             f"Preset `{PRESET}` with mode image: budget 131,072 tokens and <= 256 images a batch, windows of 262,144 "
             "rows, targets 256²..512².  ",
             "Sizes resampled from the 58 readable skimage + mate-backgrounds images, log-normal scale (sigma 0.6), "
             "30% with aspect jitter (crops): ~1,000 distinct target shapes; 0.2% scan errors.", "",
             "## Captions corpus (one image per document): time and peak memory (targets: 100 M rows < 60 s, < 6 GB)", "",
             "| rows | kept images | batches | CPU time | wall time | rows/s (CPU) | peak RSS | bytes/row | plan files |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for rows, r in results.items():
        p = r["plan"]
        lines.append(f"| {rows:,} | {p['kept']:,} | {p['num_batches']:,} | {p['cpu_seconds']:.1f} s | {p['seconds']:.1f} s | "
                     f"{rows / p['cpu_seconds'] / 1e6:.2f} M | {p['peak_rss_bytes'] / 2**30:.2f} GiB | "
                     f"{p['peak_rss_bytes'] / rows:.0f} | {p['files_bytes'] / 2**20:.0f} MiB |")
    lines += ["", "CPU seconds by phase:", "", "| rows | " + " | ".join(first["phases"]) + " |",
              "|---:|" + "---:|" * len(first["phases"])]
    for rows, r in results.items():
        lines.append(f"| {rows:,} | " + " | ".join(f"{v:.1f} s" for v in r["plan"]["phases"].values()) + " |")
    lines += ["", "## Rank imbalance of the cost model (max/mean - 1; target < 0.5% at 800 ranks)", "",
              "| plan | " + " | ".join(f"{n:,} ranks" for n in WORLD_SIZES) + " | legal cut points | partition time at 4,096 |",
              "|---|" + "---:|" * (len(WORLD_SIZES) + 2)]
    rows_of = [(f"captions, {rows:,} rows", r["ranks"]) for rows, r in results.items()]
    rows_of += [(f"mixed, {mixed['rows']:,} rows, {label}", m["ranks"]) for label, m in mixed["runs"].items()]
    for label, imb in rows_of:
        lines.append(f"| {label} | " + " | ".join(f"{100 * imb[n]['imbalance']:.3f}%" for n in WORLD_SIZES)
                     + f" | {100 * imb['cut_ok_fraction']:.1f}% | {imb[WORLD_SIZES[-1]]['seconds']:.2f} s |")
    lines += ["", "A rank may only start where no document has images on both sides. In the mixed corpus the images "
              "of multi-image documents are batched in lanes of `multi_window_images` images (their documents block "
              "cuts inside a lane); lane-0 batches (one-image documents) are interleaved between lanes. Smaller "
              "lanes give finer cuts and emptier batches; without lanes ranks can only start at window boundaries."]
    for rows, r in results.items():
        if "baseline" in r:
            lines += _utilization_table(f"captions corpus, {rows:,} rows", {"mmtok plan (one shape per batch)": r["planner"]},
                                        r["baseline"])
    lines += _utilization_table(f"mixed corpus, {mixed['rows']:,} rows",
                                {f"mmtok plan, {label}": m["planner"] for label, m in mixed["runs"].items()},
                                mixed["baseline"])
    return "\n".join(lines) + "\n"


def _utilization_table(title: str, planners: dict, baseline: dict) -> list[str]:
    lines = ["", f"## Budget use, {title}: shape-sorted planner vs a baseline without the sort", "",
             "| planner | batches | full batches | images in full batches | mean fill of the budget | images/batch "
             "| images needing padding or resize | tokens added by padding to the batch's largest shape |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [_utilization_row(label, u) for label, u in planners.items()]
    lines.append(_utilization_row("baseline: manifest order, same budget and windows", baseline))
    p = next(iter(planners.values()))
    lines += ["", f"Ratios (first planner row / baseline): batches x{p['batches'] / baseline['batches']:.2f}, images in "
              f"full batches x{p['images_in_full'] / baseline['images_in_full']:.2f}, mean fill "
              f"x{p['mean_fill'] / baseline['mean_fill']:.2f}. The baseline's batches hold one shape only "
              f"{100 * baseline['uniform_batches']:.1f}% of the time: {100 * baseline['mixed_images']:.1f}% of its images "
              "would be padded or resized to another shape."]
    return lines


def _utilization_row(label: str, u: dict) -> str:
    return (f"| {label} | {u['batches']:,} | {100 * u['full_fraction']:.1f}% | {100 * u['images_in_full']:.1f}% | "
            f"{100 * u['mean_fill']:.1f}% | {u['images_per_batch']:.1f} | {100 * u['mixed_images']:.1f}% | "
            f"{100 * u['padding_overhead']:.1f}% |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="10000000,100000000", help="comma-separated sizes of the captions corpus")
    parser.add_argument("--mixed-rows", type=int, default=10_000_000, help="size of the mixed corpus")
    parser.add_argument("--lanes", default="512,2048", help="multi_window_images values for the mixed corpus")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmtok-bench-plan"))
    parser.add_argument("--baseline-max-rows", type=int, default=10_000_000, help="baseline only up to this size")
    parser.add_argument("--out", type=Path, default=Path("/work/notes/results-plan.md"))
    args = parser.parse_args()
    from mmtok.plan import load_preset

    params = load_preset(PRESET)
    results = {}
    for rows in (int(r) for r in args.rows.split(",")):
        manifest = _manifest(args.workdir / f"captions-{rows}", rows, 0.0)
        out = args.workdir / f"plan-captions-{rows}"
        r = {"plan": run_plan(manifest, out)}
        print(f"plan {rows:,}: {r['plan']}", file=sys.stderr)
        r["ranks"] = rank_imbalance(out)
        if rows <= args.baseline_max_rows:
            r["planner"] = planner_utilization(out, params.token_budget)
            r["baseline"] = baseline_utilization(out, params.token_budget, params.max_batch_images, params.window_rows)
        results[rows] = r
    manifest = _manifest(args.workdir / f"mixed-{args.mixed_rows}", args.mixed_rows, 0.15)
    mixed = {"rows": args.mixed_rows, "runs": {}}
    for lanes in [int(v) for v in args.lanes.split(",")] + [0]:
        label = f"lanes of {lanes:,} images" if lanes else "without lanes"
        out = args.workdir / f"plan-mixed-{args.mixed_rows}-lanes{lanes}"
        m = {"plan": run_plan(manifest, out, multi_window_images=lanes or 1 << 62)}
        m["ranks"] = rank_imbalance(out)
        m["planner"] = planner_utilization(out, params.token_budget)
        mixed["runs"][label] = m
        if "baseline" not in mixed:
            mixed["baseline"] = baseline_utilization(out, params.token_budget, params.max_batch_images, params.window_rows)
        print(f"mixed {label}: {m}", file=sys.stderr)
    text = report(results, mixed, "python benchmarks/bench_plan.py " + " ".join(sys.argv[1:]))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


def _manifest(directory: Path, rows: int, multi_share: float) -> Path:
    t0 = time.perf_counter()
    write_synthetic_manifest(directory, rows, multi_share)
    print(f"manifest {directory.name} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return directory


if __name__ == "__main__":
    sys.exit(main())
