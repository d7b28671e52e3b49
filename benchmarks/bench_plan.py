"""Benchmark `mmtok plan`, before vs after the change that took lanes out of the planner, in one run.

    python benchmarks/bench_plan.py                  # captions 200k / 10M / 100M, mixed 10M: ~10 min here
                                                     # (~6 min once the manifests are cached in --workdir)
    python benchmarks/bench_plan.py --quick          # captions 200k, mixed 1M: ~1 min
    python benchmarks/bench_plan.py --rows 200000,10000000   # without the 100 M-row corpus: ~3 min

Before: the planner of commit 094ba96 (a `git worktree` of it, run in a subprocess with that tree first
on PYTHONPATH): images of multi-image documents batched in lanes of `multi_window_images` images whose
batches block rank cuts; the batch list is the same for every world size, so it plans once (at 800
ranks) and re-derives the ranges for each world size as its `Plan.ranges(N)` does. After: the working
tree's planner: every image batched by (window, shape), any batch boundary a legal cut (merge assembles
documents of several images), and a second pass that splits the batches holding the rank targets when
the modeled imbalance exceeds 0.1% -- so the batch list depends on --world-size and it plans once per
world size. For each (corpus, planner, world size): modeled imbalance (max/mean rank cost - 1), mean
fill of the budget (tokens / token_budget capped at 1, mean over batches: plan.json batch_fill), batches,
split batches, plan CPU time, and plan.json `balance.limited_by`. Then a counterfactual for the old
design, from its plan files in NumPy: lanes topped up with same-shape one-image documents (`top_up`);
time and peak memory of each plan; budget use next to a baseline that does not sort by shape.

Synthetic manifests: (width, height) resampled from the real images of scikit-image and Debian's
mate-backgrounds, each scaled by a log-normal factor (sigma 0.6: the same photo at many resolutions)
and, for 30% of them, the aspect ratio jittered (log-normal, sigma 0.15: crops) -- about a thousand
distinct 512²-bounded target shapes, the ten most common holding ~60% of the images; 0.2% scan errors.
Corpora: "captions" (one image per document, what the stage presets plan) at each --rows size, and
"mixed" (15% of documents hold 2-20 images, uniform, shapes drawn per image) at --mixed-rows. Each
plan runs in a fresh process pinned to one CPU with pyarrow limited to one thread; peak memory is that
process's VmHWM.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
WORLD_SIZES = (8, 64, 800, 4096)
PRESET = "apertus-stage1"  # low resolution: the most images per batch, the hardest case for the planner
CROPPED = 0.3  # share of images whose aspect ratio is jittered (crops); the rest keep a real photo's aspect
OLD_COMMIT = "094ba96"  # the last commit with the lane planner
PLANNER_SOURCES = ("mmtok/ranks.py", "mmtok/plan", "mmtok/formats/plan.py")  # fingerprinted: the tree may change
CAPTION_DOC_IMAGES = (2, 6)  # unused by a captions corpus (no multi-image documents); keeps its random stream


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
                    multi_share: float, doc_images: tuple[int, int]):
    """Columns of manifest rows [start, start + n) (contract layout); returns (columns, next document id).
    A share `multi_share` of the documents holds doc_images[0]..doc_images[1] images (uniform)."""
    import pyarrow as pa

    base = sizes[rng.integers(0, len(sizes), n)]
    scale = np.exp(rng.normal(0.0, 0.6, n))
    aspect = np.where(rng.random(n) < CROPPED, np.exp(rng.normal(0.0, 0.15, n)), 1.0)
    width = np.maximum(np.rint(base[:, 0] * scale * aspect), 1).astype(np.int32)
    height = np.maximum(np.rint(base[:, 1] * scale / aspect), 1).astype(np.int32)
    doc_sizes = np.where(rng.random(n) < multi_share, rng.integers(doc_images[0], doc_images[1] + 1, n), 1)
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
        "status": pa.DictionaryArray.from_arrays(pa.array(error.astype(np.int32)),
                                                 pa.array(["ok", "error"])).dictionary_decode(),
        "reason": pa.DictionaryArray.from_arrays(pa.array(error.astype(np.int32)),
                                                 pa.array(["", "truncated_member"])).dictionary_decode(),
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


# The manifest version the synthetic manifests claim: 2, whose rows every planner compared here reads (the working
# tree reads version 2 too; version 3 added only skipped.jsonl beside the same rows, which no planner reads).
SYNTHETIC_VERSION = 2


def write_synthetic_manifest(directory: Path, rows: int, multi_share: float, doc_images: tuple[int, int],
                             seed: int = 0, columns: tuple[str, ...] | None = None) -> Path:
    """A contract-layout manifest of `rows` rows (cached: reused when it already has that many rows);
    only `columns` where given (the plan in image mode reads six: a smaller file, written faster)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = directory / "manifest.parquet"
    meta = directory / "manifest.json"
    recorded = json.loads(meta.read_text()) if meta.is_file() else {}
    tag = _tag(rows, multi_share, doc_images, seed) + (f"-columns{len(columns)}" if columns else "")
    if path.is_file() and "format" in recorded and recorded["fingerprint"] == tag:
        if "options" not in recorded:  # the bare manifest.json of an earlier run: the rows are reused as they are
            _write_synthetic_json(directory, rows, tag)
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    rng, sizes = np.random.default_rng(seed), real_sizes()
    writer, document, chunk = None, 0, 1 << 21
    for start in range(0, rows, chunk):
        chunk_columns, document = synthetic_chunk(rng, sizes, start, min(chunk, rows - start), document, multi_share,
                                             doc_images)
        table = pa.table(chunk_columns if columns is None else {c: chunk_columns[c] for c in columns})
        if writer is None:
            writer = pq.ParquetWriter(path, table.schema, compression="zstd")
        writer.write_table(table, row_group_size=1 << 20)
    writer.close()
    _write_synthetic_json(directory, rows, tag)
    return directory


def _write_synthetic_json(directory: Path, rows: int, tag: str) -> None:
    """The manifest.json of a synthetic corpus: every key a scan writes (the tree's `Manifest.open` checks them all),
    its counts those of manifest.parquet, of version SYNTHETIC_VERSION (so `shard_errors`, empty), no input file,
    and the tag as its fingerprint."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from mmtok.formats.manifest import ManifestMetadata, ScanOptions

    reasons: dict[str, int] = {}
    ok = documents = 0
    for batch in pq.ParquetFile(directory / "manifest.parquet").iter_batches(columns=["document", "status", "reason"]):
        errors = pc.not_equal(batch.column("status"), "ok")
        ok += batch.num_rows - pc.sum(errors).as_py()
        for entry in pc.value_counts(batch.column("reason").filter(errors)).to_pylist():
            reasons[entry["values"]] = reasons.get(entry["values"], 0) + entry["counts"]
        documents = max(documents, pc.max(batch.column("document")).as_py() + 1)
    meta = ManifestMetadata(inputs=[], shards=0, documents=documents, images_ok=ok, errors=sum(reasons.values()),
                            reasons=dict(sorted(reasons.items())), formats={"jpeg": ok}, ignored_members={},
                            bytes_read=0, options=ScanOptions(), scan_version=0, rows=rows, fingerprint=tag,
                            skipped_sha256=None, shard_errors=[], format_version=SYNTHETIC_VERSION)
    (directory / "manifest.json").write_text(json.dumps(meta.to_json()))


def _tag(rows: int, multi_share: float, doc_images: tuple[int, int], seed: int) -> str:
    """Identifies the synthetic corpus (reused from the work directory only when it matches)."""
    images = f"-images{doc_images[0]}to{doc_images[1]}" if multi_share else ""
    return f"synthetic-v3-rows{rows}-multi{multi_share}{images}-seed{seed}-cropped{CROPPED}"


# ----------------------------------------------------------------------------- one plan, one core

CHILD = r"""
import json, os, sys, time
os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})
import pyarrow as pa
pa.set_cpu_count(1); pa.set_io_thread_count(1)
import mmtok
from mmtok.formats import manifest as manifest_format
from mmtok.formats.plan import BATCHES_FILE, PlanWriter, Plan
try:
    from mmtok.formats.presets import load_preset
except ImportError:  # the old tree: presets were part of the planner's parameters then
    from mmtok.plan.params import load_preset
from mmtok.plan import batching, core, rows
from mmtok.plan.rows import text_tokenizer
from mmtok.ranks import imbalance, rank_costs
phases = {"read + filter + target shapes": 0.0, "windows + batches": 0.0, "write files": 0.0}

def timed(owner, name, phase):
    inner = getattr(owner, name, None)
    if inner is None:  # the other planner's layout (whole-table: core.filter_manifest; streaming: rows._filter_batch)
        return
    def wrapper(*args, **kwargs):
        t = time.process_time()
        try:
            return inner(*args, **kwargs)
        finally:
            phases[phase] += time.process_time() - t
    setattr(owner, name, wrapper)

timed(core, "filter_manifest", "read + filter + target shapes")
timed(rows, "_filter_batch", "read + filter + target shapes")  # streaming: the Parquet reads land in "other"
timed(batching.GroupPlanner, "plan", "windows + batches")
timed(core, "_write_group", "write files")
timed(PlanWriter, "finish", "write files")
job = json.loads(sys.argv[1])
# the synthetic manifest's rows are the same in every version; a planner that knows an older one only (094ba96:
# version 1) reads it as its own (the working tree reads it as it is)
if job["manifest_version"] not in getattr(manifest_format, "READ_VERSIONS", ()):
    manifest_format.FORMAT_VERSION = job["manifest_version"]
params = load_preset(job["preset"]).override(mode="image", **job["overrides"])
text_tokenizer(params.text_tokenizer)  # tokenizer load (~1.5 s) is not planning work
wall, cpu = time.perf_counter(), time.process_time()
meta = core.build_plan(job["manifest"], params, job["out"], world_size=job["world_size"], progress=False)
meta = meta.to_json() if hasattr(meta, "to_json") else meta  # the old tree's build_plan returns plan.json's dict
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
phases["other (shape table, ranks, metadata)"] = cpu - sum(phases.values())
rederived = {}
if job["rederive"]:  # the old planner: one batch list, ranges re-derived per world size (Plan.ranges)
    plan = Plan.open(job["out"])
    costs = plan.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
    for n in job["rederive"]:
        t = time.process_time()
        ranges = plan.ranges(n)
        rederived[n] = {"imbalance": imbalance(rank_costs(costs, ranges)), "cpu_seconds": time.process_time() - t}
with open("/proc/self/status") as status:  # VmHWM: this process's own peak (ru_maxrss counts the parent's at fork)
    peak = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
print(json.dumps({"seconds": wall, "cpu_seconds": cpu, "phases": phases, "code": mmtok.__file__,
                  "peak_rss_bytes": peak,
                  "num_batches": meta["num_batches"], "kept": meta["totals"]["kept_images"],
                  "imbalance": meta["imbalance"], "mean_fill": meta["batch_fill"]["mean_fill"],
                  "balance": meta.get("balance", {}), "rederived": rederived,
                  "files_bytes": sum(f["bytes"] for f in meta["files"].values())}))
"""


def run_plan(source: Path, manifest: Path, out: Path, world_size: int, overrides: dict | None = None,
             rederive: tuple[int, ...] = ()) -> dict:
    """Plan `manifest` into `out` with the mmtok package of `source` (a checkout) in a fresh one-core process."""
    job = {"manifest": str(manifest), "out": str(out), "preset": PRESET, "overrides": overrides or {},
           "world_size": world_size, "rederive": list(rederive), "manifest_version": SYNTHETIC_VERSION}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "PYTHONPATH": str(source)}
    done = subprocess.run([sys.executable, "-c", CHILD, json.dumps(job)], cwd=source, env=env,  # cwd: its plans/
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"plan of {manifest} with {source} failed:\n{done.stderr[-4000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if Path(result["code"]).resolve().parents[1] != source.resolve():
        raise RuntimeError(f"the plan ran {result['code']}, not the package of {source}")
    result["rederived"] = {int(n): r for n, r in result["rederived"].items()}
    return result


def planner_fingerprint(root: Path) -> str:
    """A short hash of the planner's sources under `root` (the working tree is not a commit)."""
    digest = hashlib.sha256()
    for source in PLANNER_SOURCES:
        path = root / source
        for file in sorted(path.glob("*.py")) if path.is_dir() else [path]:
            digest.update(file.relative_to(root).as_posix().encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()[:12]


@contextmanager
def old_checkout(commit: str, path: Path):
    """A detached `git worktree` of `commit` at `path`, removed afterwards."""
    git = ["git", "-C", str(REPO), "worktree"]
    if path.exists():
        subprocess.run([*git, "remove", "--force", str(path)], check=False, capture_output=True)
    subprocess.run([*git, "add", "--detach", str(path), commit], check=True, capture_output=True)
    try:
        yield path
    finally:
        subprocess.run([*git, "remove", "--force", str(path)], check=True, capture_output=True)


# ----------------------------------------------------------------------------- analyses


@dataclass(frozen=True)
class Corpus:
    name: str
    rows: int
    multi_share: float
    doc_images: tuple[int, int]

    @property
    def label(self) -> str:
        return f"{self.name} {_short(self.rows)}"


def _short(rows: int) -> str:
    for unit, size in (("M", 10 ** 6), ("k", 10 ** 3)):
        if rows >= size and rows % size == 0:
            return f"{rows // size}{unit}"
    return f"{rows:,}"


def _old_cuts(plan_dir: Path, num_batches: int) -> np.ndarray:
    """cut_ok[j] for j in 0..num_batches under the old rule: may a rank start at batch j, i.e. does no
    multi-image document (documents.parquet first/last batch) have images both before and from it."""
    import pyarrow.parquet as pq

    docs = pq.read_table(plan_dir / "documents.parquet", columns=["first_batch", "last_batch"])
    first, last = docs.column(0).to_numpy(), docs.column(1).to_numpy()
    span = first < last
    opened = np.bincount(first[span] + 1, minlength=num_batches + 1)[:num_batches + 1]
    closed = np.bincount(last[span] + 1, minlength=num_batches + 1)[:num_batches + 1]
    return np.cumsum(opened - closed) == 0


def blocked_imbalance(costs: np.ndarray, cut_ok: np.ndarray) -> dict[int, float]:
    """Imbalance per world size when ranks may start only where cut_ok: the current partition
    (every boundary legal) over the stretches between legal cuts, i.e. the old rule's partition."""
    from mmtok.ranks import imbalance, partition_ranks, rank_costs

    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])
    stretches = np.diff(prefix[np.flatnonzero(cut_ok)])
    return {n: imbalance(rank_costs(stretches, partition_ranks(stretches, n))) for n in WORLD_SIZES}


TOP_UP_RULES = {"in order": "the first lane batches first", "spread": "spread evenly over the lane batches"}


def top_up(plan_dir: Path, rule: str) -> dict:
    """Counterfactual for the old (lane) plan in `plan_dir`: in every window, the one-image-document
    images (lane 0) of each shape move into that window's non-full multi-image-lane batches of the
    same shape, up to capacity -- `rule` "in order": batch order, each filled before the next;
    "spread": an equal share each (a share above a batch's spare stays in lane 0). What is left of
    lane 0 is re-cut at capacity into its first batches (in order; emptied batches disappear).
    Multi-image documents keep their batches, so the legal cuts are the old ones; the imbalance is
    re-partitioned from them. The mean fill hardly depends on the rule (moving images between
    non-full batches keeps the sum of fills)."""
    import pyarrow.parquet as pq

    meta = json.loads((plan_dir / "plan.json").read_text())
    p = meta["parameters"]
    budget, cap_images, overhead = p["token_budget"], p["max_batch_images"], p["cost_model"]["batch"]
    b = pq.read_table(plan_dir / "batches.parquet", columns=["window", "lane", "num_images", "target_height",
                                                              "target_width", "tokens", "cost"])
    window, lane, count, height, width, tokens = (b.column(i).to_numpy().astype(np.int64) for i in range(6))
    cost = b.column("cost").to_numpy()
    n = len(count)
    per_image_tokens = tokens // count
    per_image_cost = (cost - overhead) / count
    capacity = np.maximum(1, np.minimum(cap_images, budget // per_image_tokens))
    one_image = lane == 0
    _, group = np.unique(window << 40 | height << 20 | width, return_inverse=True)
    supply = np.bincount(group, weights=np.where(one_image, count, 0)).astype(np.int64)
    order = np.lexsort((np.arange(n), group))  # by (window, shape), then batch order
    g = group[order]
    first_of_group = np.searchsorted(g, g)  # index (in `order`) of the group's first batch

    def before_in_group(values: np.ndarray) -> np.ndarray:  # sum of `values` over earlier batches of the group
        c = np.cumsum(values) - values
        return c - c[first_of_group]

    spare = np.where(one_image, 0, capacity - count)[order]
    if rule == "in order":
        add = np.clip(supply[g] - before_in_group(spare), 0, spare)
    else:
        lane_batch = (~one_image[order]).astype(np.int64)
        lanes_in_group = np.maximum(np.bincount(g, weights=lane_batch).astype(np.int64), 1)
        share = supply[g] // lanes_in_group[g] + (before_in_group(lane_batch) < supply[g] % lanes_in_group[g])
        add = np.minimum(spare, share * lane_batch)
    left = supply - np.bincount(g, weights=add, minlength=len(supply)).astype(np.int64)
    nth = before_in_group(one_image[order].astype(np.int64))  # k-th lane-0 batch of its group
    refill = np.clip(left[g] - nth * capacity[order], 0, capacity[order])
    new_count = np.empty(n, np.int64)
    new_count[order] = np.where(one_image[order], refill, count[order] + add)
    kept = np.flatnonzero(new_count)
    new_tokens = new_count[kept] * per_image_tokens[kept]
    new_cost = new_count[kept] * per_image_cost[kept] + overhead
    cut_ok = _old_cuts(plan_dir, n)
    lanes = ~one_image[kept]
    fill = np.minimum(new_tokens / budget, 1)
    return {"batches": len(kept), "mean_fill": float(fill.mean()), "lane_fill": float(fill[lanes].mean()),
            "lane_fill_before": float(np.minimum(tokens[~one_image] / budget, 1).mean()),
            "one_image": int(supply.sum()), "left_in_lane0": int(left.sum()),
            "imbalance": blocked_imbalance(new_cost, np.append(cut_ok[kept], True)),
            "imbalance_untouched": blocked_imbalance(cost, cut_ok)}


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
            "mean_fill": float(np.minimum(batch_tokens / budget, 1).mean()),
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
    return (f"2-core x86_64 CPU VM, no GPU ({platform.python_implementation()} {platform.python_version()}, "
            f"numpy {np.__version__})")


def _pct(value: float, digits: int = 3) -> str:
    return f"{100 * value:.{digits}f}%"


def report(corpora: list[dict], command: str, load: tuple[float, float], planner: tuple[str, str]) -> str:
    lines = [f"# `mmtok plan` benchmark: before ({OLD_COMMIT}, lanes) vs after (per-image batches)", "",
             f"Command: `{command}`  ", f"Machine: {machine()}; each plan runs in a fresh process pinned to ONE core, "
             f"pyarrow limited to 1 thread. Load average {load[0]:.1f} at the start, {load[1]:.1f} at the end of the "
             "run (other jobs shared the 2 cores), so CPU seconds (process time) are the figure to compare.  ",
             f"Preset `{PRESET}` with mode image: budget 131,072 tokens and <= 256 images a batch, windows of 262,144 "
             "rows, targets 256²..512².  ",
             "Sizes resampled from the 58 readable skimage + mate-backgrounds images, log-normal scale (sigma 0.6), "
             "30% with aspect jitter (crops): ~1,000 distinct target shapes; 0.2% scan errors.  ",
             "Before: the old planner plans once (at 800 ranks) and its `Plan.ranges(N)` re-derives the ranges for "
             "every N (legal cuts only where no multi-image document spans); after: one plan per world size (a "
             "second, splitting pass where the first is above 0.1%), the working tree's planner (sources "
             f"{planner[0]}" + (", unchanged during the run)." if planner[0] == planner[1] else
                                f", CHANGED to {planner[1]} during the run: figures mix two versions)."), "",
             "## Modeled imbalance (max/mean - 1; target < 0.5%) and mean fill of the budget", "",
             "| corpus | planner | " + " | ".join(f"{n:,} ranks" for n in WORLD_SIZES) + " | mean fill | batches |",
             "|---|---|" + "---:|" * (len(WORLD_SIZES) + 2)]
    for c in corpora:
        for label, runs in c["runs"].items():
            fills = sorted({round(100 * r["mean_fill"], 1) for r in runs.values()})
            batches = sorted({r["num_batches"] for r in runs.values()})
            imbalances = " | ".join(_pct(runs[n]["imbalance"]) for n in WORLD_SIZES)
            lines.append(f"| {c['corpus'].label} | {label} | {imbalances} | {_span(fills, '{:.1f}%')} | "
                         f"{_span(batches, '{:,}')} |")
    lines += ["", "## Per world size", "",
              "| corpus | planner | ranks | imbalance | mean fill | batches | split batches | plan CPU | peak RSS | "
              "balance.limited_by |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for c in corpora:
        for label, runs in c["runs"].items():
            for n, r in runs.items():
                lines.append(f"| {c['corpus'].label} | {label} | {n:,} | {_pct(r['imbalance'])} | "
                             f"{100 * r['mean_fill']:.1f}% | {r['num_batches']:,} | {r['split_batches']:,} | "
                             f"{r['cpu_seconds']:.1f} s | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                             f"{r['limited_by'] or ''} |")
    lines += ["", "Before: plan CPU is the one plan's (every world size shares it) + the re-derivation of that world "
              "size's ranges. After: the plan made for that world size, both passes included where it splits.",
              ""] + _top_up_table(corpora) + _time_table(corpora) + _baseline_table(corpora)
    return "\n".join(lines) + "\n"


def _span(values: list, fmt: str) -> str:
    return fmt.format(values[0]) if len(values) == 1 else f"{fmt.format(values[0])}–{fmt.format(values[-1])}"


def _top_up_table(corpora: list[dict]) -> list[str]:
    with_top_up = [c for c in corpora if c.get("top_up")]
    if not with_top_up:
        return []
    lines = ["## Counterfactual: old lanes topped up with same-shape one-image documents", "",
             "| corpus | plan | mean fill | lane batches' mean fill | batches | one-image images left in lane 0 | "
             + " | ".join(f"imbalance at {n:,}" for n in WORLD_SIZES) + " |",
             "|---|---|---:|---:|---:|---:|" + "---:|" * len(WORLD_SIZES)]
    for c in with_top_up:
        corpus = c["corpus"].label
        for label, rules in c["top_up"].items():
            old, t = c["runs"][label][WORLD_SIZES[0]], next(iter(rules.values()))
            lines.append(f"| {corpus} | {label}, as planned | {100 * old['mean_fill']:.1f}% | "
                         f"{100 * t['lane_fill_before']:.1f}% | {old['num_batches']:,} | {t['one_image']:,} (100%) | "
                         + " | ".join(_pct(t["imbalance_untouched"][n]) for n in WORLD_SIZES) + " |")
            for rule, t in rules.items():
                lines.append(f"| {corpus} | {label}, topped up {rule} | {100 * t['mean_fill']:.1f}% | "
                             f"{100 * t['lane_fill']:.1f}% | {t['batches']:,} | {t['left_in_lane0']:,} "
                             f"({100 * t['left_in_lane0'] / max(t['one_image'], 1):.1f}%) | "
                             + " | ".join(_pct(t["imbalance"][n]) for n in WORLD_SIZES) + " |")
        after = c["runs"]["after"]
        lines.append(f"| {corpus} | after: no lanes (fill and batches at 800 ranks) | "
                     f"{100 * after[800]['mean_fill']:.1f}% | -- | {after[800]['num_batches']:,} | -- | "
                     + " | ".join(_pct(after[n]["imbalance"]) for n in WORLD_SIZES) + " |")
    check = max(abs(t["imbalance_untouched"][n] - c["runs"][label][n]["imbalance"]) for c in with_top_up
                for label, rules in c["top_up"].items() for t in rules.values() for n in WORLD_SIZES)
    return lines + ["", "Top-up: per window and shape, the lane-0 (one-image document) images go into the non-full "
                    "lane batches of that shape up to capacity, `in order` (" + TOP_UP_RULES["in order"] + ") or "
                    "`spread` (" + TOP_UP_RULES["spread"] + "); the rest stay in lane 0, re-cut at capacity. "
                    "Multi-image documents keep their batches, so the legal cuts are the old ones; imbalance = the "
                    "partition over the stretches between legal cuts (the `as planned` rows reproduce the old "
                    f"code's own figures to {check:.1e}).", ""]


def _time_table(corpora: list[dict]) -> list[str]:
    lines = ["## Time and peak memory at 800 ranks (targets: 100 M rows < 60 s, < 6 GB)", "",
             "| corpus | planner | kept images | batches | CPU time | wall time | rows/s (CPU) | peak RSS | bytes/row "
             "| plan files |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    phase_rows = []
    for c in corpora:
        rows = c["corpus"].rows
        for label, runs in c["runs"].items():
            r = runs[800]
            cpu = r["plan_cpu_seconds"]
            lines.append(f"| {c['corpus'].label} | {label} | {r['kept']:,} | {r['num_batches']:,} | {cpu:.1f} s | "
                         f"{r['seconds']:.1f} s | {rows / cpu / 1e6:.2f} M | {r['peak_rss_bytes'] / 2**30:.2f} GiB | "
                         f"{r['peak_rss_bytes'] / rows:.0f} | {r['files_bytes'] / 2**20:.0f} MiB |")
            phase_rows.append((c["corpus"].label, label, r["phases"]))
    names = list(phase_rows[0][2])
    lines += ["", "CPU seconds by phase (the plan alone; after: both passes where it splits):", "",
              "| corpus | planner | " + " | ".join(names) + " |", "|---|---|" + "---:|" * len(names)]
    lines += [f"| {corpus} | {label} | " + " | ".join(f"{phases[k]:.1f} s" for k in names) + " |"
              for corpus, label, phases in phase_rows]
    return lines + [""]


def _baseline_table(corpora: list[dict]) -> list[str]:
    rows = [c for c in corpora if "baseline" in c]
    if not rows:
        return []
    lines = ["## Budget use vs a baseline without the shape sort (after, 800 ranks)", "",
             "| corpus | planner | batches | mean fill of the budget | images needing padding or resize | "
             "tokens added by padding to the batch's largest shape |", "|---|---|---:|---:|---:|---:|"]
    for c in rows:
        r, base = c["runs"]["after"][800], c["baseline"]
        lines.append(f"| {c['corpus'].label} | after (one shape per batch) | {r['num_batches']:,} | "
                     f"{100 * r['mean_fill']:.1f}% | 0.0% | 0.0% |")
        lines.append(f"| {c['corpus'].label} | baseline: manifest order, same budget and windows | "
                     f"{base['batches']:,} | {100 * base['mean_fill']:.1f}% | {100 * base['mixed_images']:.1f}% | "
                     f"{100 * base['padding_overhead']:.1f}% |")
    return lines + [""]


# ----------------------------------------------------------------------------- main


def bench_corpus(corpus: Corpus, args, old: Path) -> dict:
    """Every planner on one corpus: the runs per world size, the top-up counterfactual, the baseline."""
    from mmtok.formats.presets import load_preset

    params = load_preset(PRESET)
    manifest = _manifest(args.workdir / corpus.label.replace(" ", "-"), corpus)
    result = {"corpus": corpus, "runs": {}}
    variants = [(f"before, lanes of {lanes:,}", {"multi_window_images": lanes}) for lanes in args.lanes] \
        if corpus.multi_share else [("before", {})]
    for label, overrides in variants:
        out = args.workdir / f"plan-{corpus.label.replace(' ', '-')}-{label.split()[-1].replace(',', '')}-old"
        r = run_plan(old, manifest, out, 800, overrides, rederive=WORLD_SIZES)
        result["runs"][label] = {n: {**r, "imbalance": d["imbalance"], "plan_cpu_seconds": r["cpu_seconds"],
                                     "cpu_seconds": r["cpu_seconds"] + d["cpu_seconds"], "split_batches": 0,
                                     "limited_by": None} for n, d in r["rederived"].items()}
        print(f"{corpus.label} {label}: {_brief(r)}", file=sys.stderr)
        if corpus.multi_share:
            result.setdefault("top_up", {})[label] = {rule: top_up(out, rule) for rule in TOP_UP_RULES}
            print(f"  top-up: {result['top_up'][label]}", file=sys.stderr)
    runs = result["runs"]["after"] = {}
    for n in WORLD_SIZES:
        out = args.workdir / f"plan-{corpus.label.replace(' ', '-')}-new-{n}"
        r = run_plan(REPO, manifest, out, n)
        runs[n] = {**r, "plan_cpu_seconds": r["cpu_seconds"], "split_batches": r["balance"]["split_batches"],
                   "limited_by": r["balance"]["limited_by"]}
        print(f"{corpus.label} after, {n} ranks: {_brief(r)} balance {r['balance']}", file=sys.stderr)
        if n == 800 and corpus.rows <= args.baseline_max_rows:
            result["baseline"] = baseline_utilization(out, params.token_budget, params.max_batch_images,
                                                      params.window_rows)
    return result


def _brief(r: dict) -> str:
    return (f"{r['num_batches']:,} batches, fill {100 * r['mean_fill']:.1f}%, imbalance {_pct(r['imbalance'])}, "
            f"{r['cpu_seconds']:.1f} s CPU, {r['seconds']:.1f} s wall")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="200000,10000000,100000000",
                        help="comma-separated sizes of the captions corpora")
    parser.add_argument("--mixed-rows", type=int, default=10_000_000, help="size of the mixed corpus (0: none)")
    parser.add_argument("--mixed-images", default="2-20", help="images of a mixed corpus's multi-image document, lo-hi")
    parser.add_argument("--lanes", default="512,2048", help="the old planner's multi_window_images on the mixed corpus")
    parser.add_argument("--quick", action="store_true", help="captions 200k and mixed 1M only (~2 min)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmtok-bench-plan"))
    parser.add_argument("--old-tree", type=Path, default=Path("/tmp/mmtok-old"),
                        help=f"where the worktree of {OLD_COMMIT} is made (and removed after the run)")
    parser.add_argument("--baseline-max-rows", type=int, default=10_000_000, help="baseline only up to this size")
    parser.add_argument("--out", type=Path, default=Path("/work/notes/results-plan.md"))
    args = parser.parse_args()
    if args.quick:
        args.rows, args.mixed_rows = "200000", 1_000_000
    args.lanes = [int(v) for v in args.lanes.split(",")]
    low, high = (int(v) for v in args.mixed_images.split("-"))
    corpora = [Corpus("captions", int(r), 0.0, CAPTION_DOC_IMAGES) for r in args.rows.split(",")]
    if args.mixed_rows:
        corpora.append(Corpus("mixed", args.mixed_rows, 0.15, (low, high)))
    load, planner = os.getloadavg()[0], planner_fingerprint(REPO)
    with old_checkout(OLD_COMMIT, args.old_tree) as old:
        results = [bench_corpus(corpus, args, old) for corpus in corpora]
    text = report(results, "python benchmarks/bench_plan.py " + " ".join(sys.argv[1:]), (load, os.getloadavg()[0]),
                  (planner, planner_fingerprint(REPO)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


def _manifest(directory: Path, corpus: Corpus) -> Path:
    t0 = time.perf_counter()
    write_synthetic_manifest(directory, corpus.rows, corpus.multi_share, corpus.doc_images)
    print(f"manifest {directory.name} ready in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    return directory


if __name__ == "__main__":
    sys.exit(main())
