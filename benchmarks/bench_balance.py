"""Rank balance of a real image encode job: the imbalance the ranks achieve beside the one the plan models.

    python benchmarks/bench_balance.py [--images 150] [--rates 40,10] [--repeats 2] [--no-calibrated] [--out FILE]

Corpus: --images distinct JPEGs cut from the real photos on this machine (`bench_encode.web_jpegs`:
seeded crops in common aspect ratios, long side 512-2048 px) in WebDataset tars, scanned, and planned
`image-text` for 3 ranks with targets 256x256..512x512 and at most 8 images per batch, so the batches
have many shapes and different costs. The plan's cost model is the analytic default unless said.

Configurations, each encoded --repeats times into a fresh output:
  stand-in R     `benchmarks/standin.py` `StandInCodec(R)`: a simulated device whose time is exactly
                 pixels / (R images of 512x512 per second)
  tiny Emu3.5    the real codec code with random weights (`emu35.TINY_CONFIG`, written by
                 `write_random_checkpoint`, loaded by `load_codec`), on the CPU with 1 torch thread
  calibrated     the tiny Emu3.5 on a plan made with `--cost-model` from a calibration of that codec
                 on this CPU (`mmtok.plan.calibrate` on the plan's shapes, batch sizes 1 and 4, as `mmtok calibrate
                 --plan PLAN --device cpu` does, but timed in CPU seconds like bench_calibrate.py: the
                 machine is shared)
The three ranks of a job run one after another in this process (`encode_image_rank`, 1 loader thread), so
they never compete for the machine's cores; each encodes its work items (`Plan.worker_items`, items of
0.1 s by the cost model), and `job_status(out, plan)` then reads the parts' counters, summed per rank.

Reported per rank: wall and device-busy seconds, pipeline fill (the device waiting for its first
batch), images, and the shares of wall, device-busy and modeled cost. Per job: the imbalance
max/mean - 1 measured from wall seconds (what `mmtok status` reports), from wall minus fill, and
from device-busy seconds (the codec alone, without host noise) and, for the real codec, from the
thread CPU seconds inside its `encode` (without the other processes' share of the cores), beside the
plan's modeled imbalance and the imbalance the same ranges have under the codec's own cost (the
stand-in: exactly pixels; the tiny codec: its calibrated model), which separates cost-model error from
run-to-run noise.
Markdown on stdout and in --out (default /tmp/results-balance.md); progress on stderr. About 8 minutes
on 2 shared cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_encode import build_corpus, web_jpegs  # noqa: E402 (also puts tests/ on sys.path)
from mmtok.cli import main as cli  # noqa: E402
from mmtok.codecs import emu35  # noqa: E402
from mmtok.codecs.registry import load_codec  # noqa: E402
from mmtok.encode.runner import EncodeOptions, encode_image_rank  # noqa: E402
from mmtok.formats import presets  # noqa: E402
from mmtok.formats.plan import BATCHES_FILE, Plan  # noqa: E402
from mmtok.formats.presets import CostModel  # noqa: E402
from mmtok.plan import calibrate as cal  # noqa: E402
from mmtok.ranks import imbalance, rank_costs  # noqa: E402
from mmtok.tools.status import JobStatus, job_status  # noqa: E402
from standin import StandInCodec  # noqa: E402

WORLD_SIZE = 3
PLAN_FLAGS = ("--mode", "image-text", "--world-size", str(WORLD_SIZE), "--min-pixels", str(256 * 256),
              "--max-pixels", str(512 * 512), "--token-budget", str(8 * 1100), "--max-batch-images", "8",
              "--item-seconds", "0.1")  # several work items per rank (the unit a rank's parts are made of)
DEFAULT_MODEL = "analytic default"
PIXELS = CostModel(a=1.0, b=0.0, c=0.0, batch=0.0, source="time proportional to pixels (the stand-in's own cost)")


@dataclass(frozen=True)
class Configuration:
    """One codec on one plan; `own_cost` is the codec's real cost (None: unknown), `cpu` whether its
    encode's CPU seconds mean anything (a real codec, not the sleeping stand-in)."""

    name: str
    plan_model: str
    plan: Path
    codec: object
    own_cost: CostModel | None
    cpu: bool = False


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()} (torch {torch.__version__}, {torch.get_num_threads()} "
            f"torch thread, Python {platform.python_version()}); load average at the end {os.getloadavg()[0]:.2f}")


def make_plan(manifest: Path, out: Path, cost_model: Path | None = None) -> Path:
    """`mmtok plan` of the manifest with PLAN_FLAGS (and `--cost-model FILE` when given)."""
    extra = ["--cost-model", str(cost_model)] if cost_model else []
    assert cli(["plan", str(manifest), "--out", str(out), "--quiet", *PLAN_FLAGS, *extra]) == 0
    return out


def worker_ranges(opened: Plan) -> np.ndarray:
    """[start, end) batches of each of the WORLD_SIZE workers: its work items (`Plan.worker_items`) joined."""
    items = opened.work_items()
    shares = [opened.worker_items(w, WORLD_SIZE) for w in range(WORLD_SIZE)]
    return np.array([[items[r.start][0], items[r.stop - 1][1]] if len(r) else [0, 0] for r in shares], np.int64)


def costs_under(plan: Path, model: CostModel) -> tuple[float, np.ndarray]:
    """Imbalance and per-rank shares of the plan's worker ranges (their work items) when its batches cost
    `model`."""
    opened = Plan.open(plan)
    batches = opened.table(BATCHES_FILE, ["target_height", "target_width", "num_images"])
    height, width, count = (batches.column(i).to_numpy() for i in range(3))
    per_rank = rank_costs(model.batch_cost(height, width, count), worker_ranges(opened))
    return imbalance(per_rank), per_rank / per_rank.sum()


def encode_job(plan: Path, out: Path, codec, cpu: bool) -> dict:
    """Ranks 0..WORLD_SIZE-1 encoded one after another (1 loader thread), then `job_status(out, plan)`
    with each part's pipeline fill (from `encode_image_rank`'s stats) and, when `cpu`, the thread CPU seconds
    of its `codec.encode` calls (`cpu_s`) added."""
    shutil.rmtree(out, ignore_errors=True)
    added = []
    for rank in range(WORLD_SIZE):
        timed = CpuTimed(codec)
        result = encode_image_rank(plan, out, timed, rank=rank, world_size=WORLD_SIZE,
                                   options=EncodeOptions(loader_threads=1, progress=False))
        added.append({"fill_s": result.fill_s, "cpu_s": timed.seconds if cpu else None})
    return by_worker(job_status(out, plan), Plan.open(plan), added)


def by_worker(status: JobStatus, opened: Plan, added: list[dict]) -> dict:
    """The job view per worker (rank): the parts of its work items summed, with its fill and codec CPU seconds,
    and the measured and modeled imbalance over the workers."""
    parts = status.parts
    costs = opened.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
    modeled = rank_costs(costs, worker_ranges(opened))
    workers = []
    for w, extra in enumerate(added):
        mine = [parts[i] for i in opened.worker_items(w, WORLD_SIZE)]
        wall, busy = sum(p.wall_s for p in mine), sum(p.device_busy_s for p in mine)
        workers.append({"part": w, "written": sum(p.written for p in mine), "wall_s": wall, "device_busy_s": busy,
                        "device_busy_fraction": busy / wall if wall else 0.0,
                        "modeled_share": modeled[w] / modeled.sum(), **extra})
    walls = np.array([w["wall_s"] for w in workers])
    for worker in workers:
        worker["wall_share"] = worker["wall_s"] / walls.sum()
    return {"parts": workers, "imbalance": {"measured": imbalance(walls), "modeled": imbalance(modeled)}}


def measured(status: dict) -> dict:
    """max/mean - 1 of the parts' wall, wall minus fill, device-busy and (when counted) codec CPU seconds."""
    parts = status["parts"]
    counted = all(p["cpu_s"] is not None for p in parts)
    return {"wall": status["imbalance"]["measured"],
            "steady": imbalance(np.array([p["wall_s"] - p["fill_s"] for p in parts])),
            "busy": imbalance(np.array([p["device_busy_s"] for p in parts])),
            "cpu": imbalance(np.array([p["cpu_s"] for p in parts])) if counted else None}


def calibrate_tiny(codec, plan: Path, out: Path, max_shapes: int, repeats: int) -> cal.Calibration:
    """Fit of the codec's cost model to its timings on the plan's shapes (`mmtok.plan.calibrate.plan_grid`,
    batch sizes 1 and 4), timed in CPU seconds of this process as `benchmarks/bench_calibrate.py` does
    on a shared CPU; written to `out` for `mmtok plan --cost-model`. Returns the calibration result."""
    import torch

    device = torch.device("cpu")
    grid = cal.plan_grid(plan, max_shapes)
    cells = cal.grid_cells(grid, [1, 4], max_images=4)
    started = time.perf_counter()
    timings = cal.time_cells(codec, device, cells, repeats, warmup=0, progress=False, clock=time.process_time)
    identity = {**cal.codec_identity(codec, device), "clock": "CPU seconds of the process (time.process_time)"}
    result = cal.calibration_result(timings, grid, identity, repeats=repeats, warmup=0,
                                    timing_seconds=time.perf_counter() - started)
    presets.write_calibration(out, result.to_json())
    return result


class CpuTimed:
    """`codec` with the thread CPU seconds spent in its `encode` counted in `seconds`: the device thread's
    own work, which other processes on a shared CPU do not inflate the way they inflate wall time."""

    def __init__(self, codec):
        self.codec, self.seconds = codec, 0.0

    def __getattr__(self, name: str):
        return getattr(self.codec, name)

    def encode(self, pixels):
        started = time.thread_time()
        try:
            return self.codec.encode(pixels)
        finally:
            self.seconds += time.thread_time() - started


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.2f}%"


def report(jobs: list[dict], calibration: cal.Calibration | None, corpus: str, seconds: float) -> str:
    lines = ["## Rank balance, measured vs modeled (`benchmarks/bench_balance.py`)", "",
             f"Command: `{' '.join(['python', 'benchmarks/bench_balance.py', *sys.argv[1:]])}`  ",
             f"Machine: {machine()}.  ",
             f"Corpus: {corpus}. Plan: `mmtok plan {' '.join(PLAN_FLAGS)}`.  ",
             (f"Ranks encoded one after another in one process ({WORLD_SIZE} ranks, 1 loader thread each), so they "
              f"do not compete for the cores; `job_status(out, plan)` reads the parts. {seconds / 60:.1f} min in "
              "all."), ""]
    if calibration:
        model, errors = calibration.cost_model, calibration.evaluation.errors
        held_text = f", {pct(errors.held_out.median)} held out" if errors.held_out else ""
        lines += [(f"Calibration of the tiny codec (`mmtok.plan.calibrate` on the default plan's shapes, CPU seconds, "
                   f"{len(calibration.timings)} batches, {calibration.timing_seconds:.0f} s): a = {model.a:.3g}, "
                   f"b = {model.b:.3g}, c = {model.c:.3g}, batch = {model.batch:.3g} s; per-batch error "
                   f"median {pct(errors.fitted.median)} timed{held_text}."), ""]
    lines += [("Imbalance = max/mean - 1 over the 3 ranks. *Modeled*: the plan's figure (its cost model). *Codec's "
               "own cost*: the same rank ranges costed by the codec's real cost (stand-in: exactly pixels; tiny "
               "Emu3.5: its calibrated model). *Codec CPU*: thread CPU seconds inside `codec.encode` (the real codec "
               "only; the stand-in sleeps)."), "",
              ("| configuration | plan cost model | run | measured, wall | measured, wall - fill "
               "| measured, device-busy | measured, codec CPU | modeled (plan) | codec's own cost |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for job in jobs:
        m = measured(job["status"])
        lines.append(f"| {job['name']} | {job['model']} | {job['run']} | {pct(m['wall'])} | {pct(m['steady'])} | "
                     f"{pct(m['busy'])} | {pct(m['cpu'])} | {pct(job['status']['imbalance']['modeled'])} | "
                     f"{pct(job['own'])} |")
    lines += ["", "Per rank (shares: of the 3 ranks' sum):", "",
              ("| configuration | plan cost model | run | rank | images | wall s | fill s | device-busy s "
               "| busy / wall | codec CPU s | wall share | busy share | modeled share | codec's own share |"),
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for job in jobs:
        parts = job["status"]["parts"]
        busy = sum(p["device_busy_s"] for p in parts)
        for part, own in zip(parts, job["own_shares"], strict=True):
            cpu = "—" if part["cpu_s"] is None else f"{part['cpu_s']:.2f}"
            lines.append(f"| {job['name']} | {job['model']} | {job['run']} | {part['part']} | {part['written']} | "
                         f"{part['wall_s']:.2f} | {part['fill_s']:.2f} | {part['device_busy_s']:.2f} | "
                         f"{part['device_busy_fraction']:.1%} | {cpu} | {part['wall_share']:.1%} | "
                         f"{part['device_busy_s'] / busy:.1%} | {part['modeled_share']:.1%} | "
                         f"{'—' if own is None else f'{own:.1%}'} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=150)
    parser.add_argument("--rates", default="40,10", help="stand-in device rates, images/s of 512x512 (comma-separated)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each configuration")
    parser.add_argument("--no-calibrated", action="store_true", help="skip the calibration and the calibrated plan")
    parser.add_argument("--calibrate-shapes", type=int, default=8, help="shapes timed by the calibration")
    parser.add_argument("--calibrate-repeats", type=int, default=2, help="timed runs per calibration batch")
    parser.add_argument("--dir", type=Path, default=None, help="parent of the temporary work directory")
    parser.add_argument("--out", type=Path, default=Path("/tmp/results-balance.md"), help="Markdown file to write")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",") if r]
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="bench-balance-", dir=args.dir))
    try:
        images = web_jpegs(args.images)
        build_corpus(root, images)  # tars + scan (its own 1-rank plan is not used here)
        plan = make_plan(root / "manifest", root / "plan-default")
        corpus = (f"{args.images} JPEGs cut from real photos (long side 512-2048 px, "
                  f"{sum(len(d) for _, d in images) / len(images) / 1e3:.0f} KB mean), "
                  f"{Plan.open(plan).meta.num_batches} batches")
        tiny = load_codec("emu3.5", emu35.write_random_checkpoint(root / "ckpt"), "cpu")
        configurations = [Configuration(f"stand-in {r:g} img/s", DEFAULT_MODEL, plan, StandInCodec(r), PIXELS)
                          for r in rates]
        calibration = None
        if args.no_calibrated:
            configurations.append(Configuration("tiny Emu3.5, CPU", DEFAULT_MODEL, plan, tiny, None, cpu=True))
        else:
            log("bench_balance: calibrating the tiny codec")
            calibration = calibrate_tiny(tiny, plan, root / "cost.yaml", args.calibrate_shapes, args.calibrate_repeats)
            fitted = CostModel.from_file(root / "cost.yaml")
            calibrated = make_plan(root / "manifest", root / "plan-calibrated", root / "cost.yaml")
            configurations += [Configuration("tiny Emu3.5, CPU", DEFAULT_MODEL, plan, tiny, fitted, cpu=True),
                               Configuration("tiny Emu3.5, CPU", "calibrated (`--cost-model`)", calibrated, tiny,
                                             fitted, cpu=True)]
        jobs = []
        for config in configurations:
            own, shares = costs_under(config.plan, config.own_cost) if config.own_cost else (None, [None] * WORLD_SIZE)
            for run in range(1, args.repeats + 1):
                log(f"bench_balance: {config.name}, {config.plan_model}, run {run}")
                status = encode_job(config.plan, root / "out", config.codec, config.cpu)
                jobs.append({"name": config.name, "model": config.plan_model, "run": run, "status": status,
                             "own": own, "own_shares": shares})
        text = report(jobs, calibration, corpus, time.perf_counter() - started)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
