"""Stragglers and dead nodes: the wall time of an encode job under three ways of running its ranks.

    python benchmarks/bench_stragglers.py [--workers 800] [--rows 1000000] [--ideal-hours 12]
        [--start-s 120] [--requeue-s 600,3600] [--no-real] [--out FILE]

A job of R ranks on G workers (GPUs) where one worker runs at half speed for the whole job and two
die mid-run (at 30% and 60% of the ideal time) and are requeued, against the ideal: total work / G.

Policies:
  static R = G        one rank per GPU, all started at once (`srun`; docs/slurm.md before this change). A dead
                      worker's rank resumes from its last commit on a replacement node after the requeue delay.
  array R = k x G     a SLURM array `--array=0-(R-1)%G`: a free worker takes the next rank in index order; a
                      killed rank is pending again after the requeue delay (taken first), and the dead worker's
                      slot is back after the same delay.
  work-taking R = G   simulated only (mmtok does not implement it): a worker with nothing left takes the part of
                      the slowest remaining range that makes both finish together (a dead rank's range whole).
Every start of a rank (a resume too) costs --start-s (model load, CUDA init, the loaders filling); a kill loses
the batch in flight (--lost-s). Work is continuous, as mmtok commits after every batch.

Rank durations come from a real plan: the synthetic manifest of bench_plan.py (shapes resampled from real
images, --rows rows, mode image, preset apertus-stage1) planned by `mmtok plan --world-size R` for each R; the
per-rank modeled costs are scaled so that the R = G plan's total work / G = --ideal-hours (Apertus 1.5: 821.6 M
images on 800 GPUs at ~23 images/s each is ~12 h).

The simulation is checked against a real run (unless --no-real): the stand-in codec (benchmarks/standin.py, a
device that sleeps pixels / rate) on --real-images real JPEGs, G = 2 worker threads (one at half speed), one
death (worker 0 stops at --real-death-s, its rank resumes after --real-requeue-s), static R = 2 vs array
R = 8, each rank start sleeping --real-start-s; the measured wall beside the simulated one from the plan's own
per-rank pixels. Markdown on stdout and in --out (default /tmp/results-stragglers.md); about 3 minutes here.
"""

from __future__ import annotations

import argparse
import heapq
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_plan import write_synthetic_manifest  # noqa: E402 (also puts tests/ on sys.path)
from mmtok.cli import main as cli  # noqa: E402
from mmtok.formats.plan import BATCHES_FILE, Plan  # noqa: E402
from mmtok.ranks import rank_costs  # noqa: E402

POLICIES = ("static", "array", "taking")
_DONE = 1e-9  # seconds of work below which a piece is finished (float round-off)


@dataclass(frozen=True)
class Faults:
    """What goes wrong: worker speeds (1.0 unless listed), deaths (worker, second), and the costs of
    a rank start, of a requeue and of a kill."""

    slow: dict[int, float] = field(default_factory=dict)
    deaths: tuple[tuple[int, float], ...] = ()
    drain_s: float | None = None  # the slow workers are taken out then (status flagged them), replaced at speed 1
    requeue_s: float = 600.0
    start_s: float = 120.0
    lost_s: float = 30.0


def simulate(durations: np.ndarray, workers: int, faults: Faults, policy: str) -> float:
    """Wall seconds until every rank's work (`durations`, seconds at speed 1, in rank order) is done.

    Workers are slots: a busy one first spends `start_s` loading, then works at its speed. A death
    puts the worker's remaining work (plus the lost batch) back as pending after `requeue_s` and
    returns the slot after `requeue_s`. Which idle worker takes what is the policy's rule (module
    docstring)."""
    if policy in ("static", "taking") and len(durations) != workers:
        raise ValueError(f"{policy} runs one rank per worker: {len(durations)} ranks on {workers} workers")
    speed = np.ones(workers)
    for worker, value in faults.slow.items():
        speed[worker] = value
    load = np.zeros(workers)  # start-up seconds left
    work = np.zeros(workers)  # work seconds left (at speed 1)
    done_here = np.zeros(workers)  # work done in the current piece (what a kill can lose is bounded by it)
    busy = np.zeros(workers, bool)
    back = np.zeros(workers)  # a dead worker's slot returns at this time
    fresh = list(range(len(durations)))[::-1]  # array: pending ranks, next one last
    requeued: list[tuple[float, int, float]] = []  # (eligible time, rank, work), a heap
    deaths = sorted([*faults.deaths, *((w, faults.drain_s) for w in faults.slow if faults.drain_s is not None)],
                    key=lambda d: d[1])
    rank_of = np.full(workers, -1)
    t = 0.0

    def start(worker: int, rank: int, amount: float) -> None:
        busy[worker], rank_of[worker] = True, rank
        load[worker], work[worker], done_here[worker] = faults.start_s, amount, 0.0

    def assign() -> None:
        for worker in np.flatnonzero(~busy & (back <= t)):
            if policy == "static":
                if t == 0.0:
                    start(worker, worker, float(durations[worker]))
                else:
                    own = [r for r in requeued if r[1] == worker and r[0] <= t]
                    if own:
                        requeued.remove(own[0])
                        heapq.heapify(requeued)
                        start(worker, worker, own[0][2])
            elif requeued and requeued[0][0] <= t:
                _, rank, amount = heapq.heappop(requeued)
                start(worker, rank, amount)
            elif policy == "array" and fresh:
                rank = fresh.pop()
                start(worker, rank, float(durations[rank]))
            elif policy == "taking":
                if t == 0.0:
                    start(worker, worker, float(durations[worker]))
                else:
                    take(worker)

    def take(thief: int) -> None:
        """Work-taking: the rest of a waiting requeued range, else the share of the busiest worker's range
        that makes both end together."""
        if requeued:
            _, rank, amount = heapq.heappop(requeued)
            start(thief, rank, amount)
            return
        left = np.where(busy, load + work / speed, -1.0)
        victim = int(np.argmax(left))
        if left[victim] <= faults.start_s:
            return
        share = (left[victim] - faults.start_s) / (1 / speed[thief] + 1 / speed[victim])
        share = min(share, work[victim])
        if share > _DONE:
            work[victim] -= share
            start(thief, int(rank_of[victim]), share)

    assign()
    while busy.any() or requeued or (policy == "array" and fresh):
        ends = np.where(busy, t + load + work / speed, np.inf)
        candidates = [ends.min()]
        if deaths:
            candidates.append(deaths[0][1])
        candidates += [b for b in back if b > t]
        candidates += [r[0] for r in requeued if r[0] > t]
        upcoming = min(candidates)
        if not np.isfinite(upcoming):
            raise RuntimeError("the simulation stalled: work left but no event to come")
        step = upcoming - t
        loading = np.minimum(load, step)
        progress = np.where(busy, (step - loading) * speed, 0.0)
        load -= np.where(busy, loading, 0.0)
        work -= np.minimum(progress, work)
        done_here += progress
        t = upcoming
        while deaths and deaths[0][1] <= t:
            worker, _ = deaths.pop(0)
            if busy[worker]:
                lost = min(faults.lost_s, done_here[worker])
                heapq.heappush(requeued, (t + faults.requeue_s, int(rank_of[worker]), float(work[worker] + lost)))
            busy[worker], back[worker], speed[worker] = False, t + faults.requeue_s, 1.0  # a replacement node
        busy &= ~((work <= _DONE) & (load <= _DONE))
        assign()
    return t


# -- the plans ------------------------------------------------------------------------------------------------
def rank_seconds(plan_dir: Path) -> tuple[np.ndarray, float]:
    """Modeled cost of each rank of the plan (its own world size), and the plan's total cost."""
    plan = Plan.open(plan_dir)
    costs = plan.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
    return rank_costs(costs, plan.ranges()), float(costs.sum())


def plan_for(manifest: Path, out: Path, world_size: int) -> Path:
    if not (out / "plan.json").is_file():
        assert cli(["plan", str(manifest), "--out", str(out), "--quiet", "--preset", "apertus-stage1",
                    "--mode", "image", "--world-size", str(world_size)]) == 0
    return out


def simulated_table(args, work: Path) -> tuple[list[str], dict]:
    """Wall / ideal per policy and requeue delay, with the faults and without them."""
    g = args.workers
    manifest = write_synthetic_manifest(work / f"manifest-{args.rows}", args.rows, 0.0, (2, 6))
    layouts = [("static", 1), *[("array", k) for k in args.k], ("taking", 1)]
    per_rank = {k: rank_seconds(plan_for(manifest, work / f"plan-{args.rows}-{k * g}", k * g))[0]
                for k in sorted({k for _, k in layouts})}
    scale = args.ideal_hours * 3600 * g / per_rank[1].sum()  # seconds per cost unit: the R = G plan's ideal
    ideal = per_rank[1].sum() * scale / g
    slow, deaths = {17 % g: 0.5}, ((100 % g, 0.3 * ideal), (500 % g, 0.6 * ideal))
    first = args.requeue_s[0]
    cases = [("no faults", Faults()), ("slow node", Faults(slow=slow)),
             (f"2 deaths, requeue {first / 60:.0f} min", Faults(deaths=deaths, requeue_s=first)),
             *((f"both, requeue {d / 60:.0f} min", Faults(slow=slow, deaths=deaths, requeue_s=d))
               for d in args.requeue_s),
             (f"both, slow node drained at {args.drain_s / 60:.0f} min", Faults(slow=slow, deaths=deaths,
                                                                                requeue_s=first, drain_s=args.drain_s))]
    lines = ["| policy | R | rank (h) | " + " | ".join(name for name, _ in cases) + " |",
             "|---|---:|---:|" + "---:|" * len(cases)]
    figures = {}
    for policy, k in layouts:
        durations = per_rank[k] * scale
        row = [simulate(durations, g, replace(faults, start_s=args.start_s, lost_s=args.lost_s), policy) / ideal
               for _, faults in cases]
        name = {"static": "static (srun, one rank per GPU)", "array": f"array `--array=0-{k * g - 1}%{g}`",
                "taking": "work-taking (simulated only)"}[policy]
        lines.append(f"| {name} | {k * g:,} | {durations.mean() / 3600:.2f} | "
                     + " | ".join(f"{r:.3f}" for r in row) + " |")
        figures[(policy, k)] = row
        log(f"{name}: " + ", ".join(f"{r:.3f}" for r in row))
    return lines, {"ideal_h": ideal / 3600, "figures": figures}


# -- the real run -----------------------------------------------------------------------------------------------
class Died(Exception):
    """Raised inside a worker's codec: its node died (the committed batches stay)."""


class DyingCodec:
    """The stand-in slowed to a worker's speed (one codec identity for every worker, as a GPU of another
    speed runs the same model); raises Died at the first batch after `dies_at` (a monotonic time)."""

    def __init__(self, codec, speed: float, dies_at: float | None):
        self.codec, self.speed, self.dies_at = codec, speed, dies_at
        self.busy_s = 0.0  # seconds spent in encode: the device's share of a session

    def __getattr__(self, name):
        return getattr(self.codec, name)

    def encode(self, pixels):
        if self.dies_at is not None and time.monotonic() >= self.dies_at:
            self.dies_at = None
            raise Died()
        began = time.perf_counter()
        codes = self.codec.encode(pixels)
        time.sleep((time.perf_counter() - began) * (1 / self.speed - 1))
        self.busy_s += time.perf_counter() - began
        return codes


def real_run(plan_dir: Path, out: Path, world_size: int, workers: int, faults: Faults, rate: float,
             policy: str) -> tuple[float, float]:
    """Wall seconds of the job run by `workers` threads (encode_image_rank, 1 loader thread each), under `faults`,
    and the mean seconds a rank session spent outside the device (start sleep, setup, pipeline fill, host waits)."""
    from mmtok.encode.runner import EncodeOptions, encode_image_rank
    from standin import StandInCodec

    shutil.rmtree(out, ignore_errors=True)
    pending = list(range(world_size))  # array: index order
    requeued: list[tuple[float, int]] = []
    lock = threading.Lock()
    begin = time.monotonic()
    death = {w: begin + s for w, s in faults.deaths}
    outside: list[float] = []

    def next_rank(worker: int, first: bool) -> int | None:
        while True:
            with lock:
                now = time.monotonic()
                ready = [r for r in requeued if r[0] <= now and (policy != "static" or r[1] == worker)]
                if ready:
                    requeued.remove(ready[0])
                    return ready[0][1]
                if policy == "static" and first:
                    return worker
                if policy == "array" and pending:
                    return pending.pop(0)
                if not requeued:
                    return None
            time.sleep(0.02)

    def run(worker: int) -> None:
        codec = DyingCodec(StandInCodec(rate), faults.slow.get(worker, 1.0), death.get(worker))
        first = True
        while (rank := next_rank(worker, first)) is not None:
            first = False
            began, busy = time.monotonic(), codec.busy_s
            time.sleep(faults.start_s)  # the model load of a rank start
            try:
                encode_image_rank(plan_dir, out, codec, rank=rank, world_size=world_size,
                                  options=EncodeOptions(loader_threads=1, progress=False))
            except Died:
                with lock:
                    requeued.append((time.monotonic() + faults.requeue_s, rank))
                time.sleep(faults.requeue_s)  # the replacement node comes up
                continue
            outside.append(time.monotonic() - began - (codec.busy_s - busy))

    threads = [threading.Thread(target=run, args=(w,)) for w in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - begin, float(np.mean(outside))


def real_table(args, work: Path) -> list[str]:
    """The simulation beside a real stand-in run, G = 2, static R = 2 vs array R = 8."""
    from bench_encode import build_corpus, web_jpegs
    from standin import REFERENCE_PIXELS

    root = work / "real"
    shutil.rmtree(root, ignore_errors=True)
    build_corpus(root, web_jpegs(args.real_images))
    lines = ["| policy | R | measured wall (s) | measured s outside the device per rank start | simulated wall (s), "
             "start = the sleep | simulated / measured | simulated wall (s), start = measured | simulated / measured |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    merged = {}
    for policy, world_size in (("static", 2), ("array", 8)):
        plan_dir = root / f"plan-{world_size}"
        assert cli(["plan", str(root / "manifest"), "--out", str(plan_dir), "--quiet", "--mode", "image-text",
                    "--min-pixels", str(256 * 256), "--max-pixels", str(512 * 512), "--token-budget", str(4 * 1100),
                    "--max-batch-images", "4", "--world-size", str(world_size)]) == 0
        plan = Plan.open(plan_dir)
        batches = plan.table(BATCHES_FILE, ["target_height", "target_width", "num_images"])
        height, width, count = (batches.column(i).to_numpy() for i in range(3))
        pixels = (height * width * count).astype(np.float64)
        durations = rank_costs(pixels, plan.ranges()) / (REFERENCE_PIXELS * args.real_rate)
        faults = Faults(slow={1: 0.5}, deaths=((0, args.real_death_s),), requeue_s=args.real_requeue_s,
                        start_s=args.real_start_s, lost_s=float(durations.max() / 4))
        simulated = simulate(durations, 2, faults, policy)
        out = root / f"out-{policy}"
        measured, outside = real_run(plan_dir, out, world_size, 2, faults, args.real_rate, policy)
        calibrated = simulate(durations, 2, replace(faults, start_s=outside), policy)
        assert cli(["merge", str(out)]) == 0
        merged[policy] = (out / "merged.bin").read_bytes()
        lines.append(f"| {policy} | {world_size} | {measured:.1f} | {outside:.1f} | {simulated:.1f} | "
                     f"{simulated / measured:.2f} | {calibrated:.1f} | {calibrated / measured:.2f} |")
        log(lines[-1])
    assert merged["static"] == merged["array"], "the merged bytes differ between the policies"
    return lines + ["", f"Merged `.bin` of both runs byte-identical: {merged['static'] == merged['array']}."]


# -- report -------------------------------------------------------------------------------------------------------
def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine() -> str:
    import torch

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or platform.machine())
    return (f"{cpu}, {os.cpu_count()} cores (torch {torch.__version__}, Python {platform.python_version()}); "
            f"load average at the end {os.getloadavg()[0]:.2f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=800, help="G: GPUs running at once")
    parser.add_argument("--k", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 8, 16],
                        help="array policies: R = k x G ranks (comma-separated)")
    parser.add_argument("--rows", type=int, default=1_000_000, help="rows of the synthetic manifest")
    parser.add_argument("--ideal-hours", type=float, default=12.0, help="total work / G, hours")
    parser.add_argument("--start-s", type=float, default=120.0, help="seconds every rank start costs (model load)")
    parser.add_argument("--lost-s", type=float, default=30.0, help="work lost at a kill (the batch in flight), s")
    parser.add_argument("--requeue-s", type=lambda s: [float(x) for x in s.split(",")], default=[600.0, 3600.0],
                        help="seconds from a death until its rank may resume and its slot is back (comma-separated)")
    parser.add_argument("--drain-s", type=float, default=1800.0,
                        help="seconds after which `mmtok status` has flagged the slow node and it is replaced")
    parser.add_argument("--no-real", action="store_true", help="skip the real stand-in run")
    parser.add_argument("--real-images", type=int, default=96)
    parser.add_argument("--real-rate", type=float, default=6.0, help="stand-in images/s of 512x512 at full speed")
    parser.add_argument("--real-start-s", type=float, default=0.5)
    parser.add_argument("--real-death-s", type=float, default=3.0)
    parser.add_argument("--real-requeue-s", type=float, default=2.0)
    parser.add_argument("--workdir", type=Path, default=None, help="parent of the work directory (kept plans: reused)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/results-stragglers.md"))
    args = parser.parse_args()
    started = time.monotonic()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="mmtok-stragglers-"))
    work.mkdir(parents=True, exist_ok=True)
    simulated, info = simulated_table(args, work)
    real = [] if args.no_real else real_table(args, work)
    command = "python benchmarks/bench_stragglers.py " + " ".join(sys.argv[1:])
    text = "\n".join([
        "## Stragglers and dead nodes: wall time / ideal per policy (`benchmarks/bench_stragglers.py`)", "",
        f"Command: `{command.strip()}`; {time.monotonic() - started:.0f} s on {machine()}.", "",
        f"G = {args.workers:,} workers; ideal = total work / G = {info['ideal_h']:.1f} h (plans of a {args.rows:,}-row "
        f"synthetic manifest, apertus-stage1, mode image, one per R); every rank start costs {args.start_s:.0f} s, "
        f"a kill loses {args.lost_s:.0f} s. Faults: worker 17 at half speed (\"slow node\"), workers 100 and 500 "
        "die at 30% and 60% of the ideal time (\"2 deaths\"); \"drained\": the slow node is taken out when "
        "`mmtok status` flags it (its rank resumes from its last commit after the requeue delay, on a node at full "
        "speed). Figures: simulated wall / ideal.", "", *simulated, "",
        *([f"Real run (stand-in codec at {args.real_rate:g} images/s of 512², {args.real_images} real JPEGs, 2 worker "
           f"threads, worker 1 at half speed, worker 0 dies at {args.real_death_s:g} s and is back "
           f"{args.real_requeue_s:g} s later, {args.real_start_s:g} s per rank start) beside the simulation of the "
           "same plan:", "", *real] if real else [])])
    print(text)
    args.out.write_text(text + "\n")
    if args.workdir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
