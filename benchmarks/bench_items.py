"""Work items and take-over against the static split and today's arrays: real `mmtok encode` processes.

    python benchmarks/bench_items.py [--workers 8] [--ideal-s 120] [--item-s 2] [--requeue-s 10] [--out FILE]

G worker slots (GPUs), each running `mmtok encode` processes one after another, with one slot at half speed for
the whole job and one whose process is killed (SIGKILL) at 40% of the ideal time; that slot comes back
--requeue-s later (SLURM's requeue). The device is the stand-in codec (benchmarks/standin.py: it sleeps
pixels / rate, like a GPU synchronisation) installed as a codec plugin (`--codec standin`), its speed set per
slot; its checkpoint, so every part's identity, is the same on every slot. Policies, on one plan:

  static      G ranks, one per slot, each its own items only (`--no-take-over`): `srun`, before work items
  array       k x G ranks as a SLURM array (`--array=0-(kG-1)%G`): a free slot starts the next rank, each its
              own items only; a killed rank is pending again after the requeue delay (taken first)
  take-over   G ranks, one per slot, then each takes the items nobody finished or holds (the default)
  ray         one `mmtok encode --executor ray --ray-workers G` driver on a local Ray cluster (`ray start --head
              --num-cpus G`): G actors keep the codec loaded; the first actor to load it is the slow one, and an
              actor other than it is killed at the same time as the others' process (Ray places its replacement
              at once: there is no requeue delay); backups at the tail

The killed process's rank is started again on its slot after the delay (static, take-over) or requeued
(array). Every process start pays the interpreter, torch and mmtok imports and the plan's setup (the model load
of a GPU job). Reported: wall, wall / ideal (ideal = total device seconds at full speed / G), wall / (ideal + one
process start, as every slot starts once), and wall / the best possible (`best_possible`: the work, the killed
slot's absence and one restart spread over the slots' summed speed, plus one start). The merged bytes of every
policy are compared. Markdown on stdout and in --out (default /tmp/results-items.md); about 10 minutes here.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from bench_encode import build_corpus, web_jpegs  # noqa: E402 (also puts tests/ on sys.path)
from mmtok.cli import main as cli  # noqa: E402
from mmtok.formats.partdir import is_done, part_dir  # noqa: E402
from mmtok.formats.plan import BATCHES_FILE, Plan  # noqa: E402
from mmtok.fsutil import sha256_file  # noqa: E402
from standin import REFERENCE_PIXELS  # noqa: E402

# The stand-in as an installed codec plugin (a module and a .dist-info on PYTHONPATH, as pip lays them out), so
# that real `mmtok encode` processes load it with `--codec standin`. MMTOK_BENCH_SPEED slows one slot's device.
PLUGIN = '''
import json, os
from pathlib import Path
from mmtok.codecs.base import checkpoint_fingerprint
from standin import StandInCodec

MODALITY, TOKENIZER_TYPE = "image", "StandIn"


def checkpoint_paths(directory):
    return [Path(directory) / "config.json"]


def write_random_checkpoint(directory, config=None, seed=0):
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "config.json").write_text(json.dumps(dict(config or {"images_per_second": 1.0})))
    return Path(directory)


class SlotStandIn(StandInCodec):
    """The checkpoint's device at this slot's speed: slower sleeps, the same identity (a slow GPU of one model)."""

    def __init__(self, rate, speed):
        super().__init__(rate)
        self.speed = speed

    def seconds_for(self, pixels):
        return super().seconds_for(pixels) / self.speed


def load(directory, device):
    rate = json.loads((Path(directory) / "config.json").read_text())["images_per_second"]
    speed = float(os.environ.get("MMTOK_BENCH_SPEED", "1"))
    slow = os.environ.get("MMTOK_BENCH_SLOW_DIR")  # (ray) the first process to claim it is the slow slot
    if slow:
        try:
            os.mkdir(slow)
            Path(slow, "pid").write_text(str(os.getpid()))
            speed = float(os.environ["MMTOK_BENCH_SLOW_SPEED"])
        except FileExistsError:
            pass
    codec = SlotStandIn(rate, speed)
    codec.checkpoint_sha256 = checkpoint_fingerprint(checkpoint_paths(directory))
    return codec
'''
POLICIES = ("static", "array", "take-over", "ray")


@dataclass
class Job:
    plan: Path
    checkpoint: Path
    site: Path
    items: int
    device_s: float  # total device seconds at full speed


@dataclass
class Slot:
    speed: float = 1.0
    process: subprocess.Popen | None = None
    rank: int | None = None
    started: float = 0.0
    back_at: float = 0.0  # a killed slot is unavailable until then (the requeue delay)
    starts: list[float] = field(default_factory=list)
    first_rank: int = 0
    first_wall: float = 0.0  # time.time() of its first process start


def install_plugin(site: Path) -> None:
    site.mkdir(parents=True, exist_ok=True)
    (site / "mmtok_bench_standin.py").write_text(PLUGIN)
    info = site / "mmtok_bench_standin-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: mmtok-bench-standin\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[mmtok.codecs]\nstandin = mmtok_bench_standin\n")


def small_jpegs(count: int, side: int) -> list[tuple[str, bytes]]:
    """Real photo crops (bench_encode.web_jpegs) scaled to a long side of `side` px: little decode work per
    image, so G processes on a few cores measure scheduling, not the host."""
    import io

    from PIL import Image

    out = []
    for name, data in web_jpegs(count):
        image = Image.open(io.BytesIO(data)).convert("RGB")
        image.thumbnail((side, side), Image.BICUBIC)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        out.append((name, buffer.getvalue()))
    return out


def prepare(args, root: Path) -> Job:
    """Corpus, scan, plan with items of about --item-s device seconds, the stand-in's checkpoint and plugin."""
    site = root / "site"
    install_plugin(site)
    sys.path.insert(0, str(site))
    import mmtok_bench_standin

    checkpoint = mmtok_bench_standin.write_random_checkpoint(root / "ckpt", {"images_per_second": args.rate})
    # the crops keep their aspect ratio: ~0.7 x side^2 pixels each on average
    per_image_s = 0.7 * args.side ** 2 / (REFERENCE_PIXELS * args.rate)
    images = max(args.workers, round(args.ideal_s * args.workers / per_image_s))
    build_corpus(root, small_jpegs(images, args.side))
    flags = ["--quiet", "--mode", "image-text", "--min-pixels", str(64 * 64), "--max-pixels", str(args.side ** 2),
             "--token-budget", str(4 * 300), "--max-batch-images", "4", "--factor", "16"]
    assert cli(["plan", str(root / "manifest"), "--out", str(root / "plan0"), *flags]) == 0
    device_s = _device_seconds(Plan.open(root / "plan0"), args.rate)
    spu = Plan.open(root / "plan0").meta.parameters["cost_model"]["seconds_per_unit"]
    costs = Plan.open(root / "plan0").item_costs().sum()
    item_seconds = costs * spu * args.item_s / device_s  # the cost model's seconds for --item-s real seconds
    assert cli(["plan", str(root / "manifest"), "--out", str(root / "plan-items"), *flags, "--item-seconds",
                str(float(item_seconds))]) == 0
    plan = Plan.open(root / "plan-items")
    return Job(root / "plan-items", checkpoint, site, len(plan.work_items()), _device_seconds(plan, args.rate))


def _device_seconds(plan: Plan, rate: float) -> float:
    table = plan.table(BATCHES_FILE, ["target_height", "target_width", "num_images"])
    height, width, count = (table.column(i).to_numpy().astype(np.float64) for i in range(3))
    return float((height * width * count).sum() / (REFERENCE_PIXELS * rate))


def _spawn(job: Job, out: Path, rank: int, world_size: int, speed: float, take_over: bool, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(job.site), str(BENCH)]), "OMP_NUM_THREADS": "1",
           "MMTOK_BENCH_SPEED": str(speed)}
    argv = [sys.executable, "-m", "mmtok", "encode", "--plan", str(job.plan), "--codec", "standin", "--checkpoint",
            str(job.checkpoint), "--out", str(out), "--device", "cpu", "--loader-threads", "1", "--no-progress",
            "--rank", str(rank), "--world-size", str(world_size), *([] if take_over else ["--no-take-over"])]
    return subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=log)


def run_policy(job: Job, out: Path, policy: str, args, ideal: float) -> dict:
    """Wall seconds of the job under `policy` with the slow slot and the killed one; the mean process start."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    world_size = args.workers * args.ranks_per_slot if policy == "array" else args.workers
    take_over = policy == "take-over"
    slots = [Slot(speed=args.slow_speed if w == args.slow else 1.0) for w in range(args.workers)]
    pending = list(range(world_size)) if policy == "array" else []
    requeued: list[tuple[float, int]] = []  # (when, rank)
    kill_at, killed = ideal * args.kill_at, False
    log = open(out / "workers.log", "ab")
    begin = time.monotonic()
    if policy != "array":
        for w, slot in enumerate(slots):
            slot.rank, slot.started, slot.first_rank, slot.first_wall = w, time.monotonic(), w, time.time()
            slot.process = _spawn(job, out, w, world_size, slot.speed, take_over, log)
            slot.starts.append(slot.started)
    while True:
        now = time.monotonic()
        if not killed and now - begin >= kill_at and slots[args.killed].process is not None:
            victim = slots[args.killed]
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait()
            requeued.append((now + args.requeue_s, victim.rank))
            victim.process, victim.back_at, killed = None, now + args.requeue_s, True
        for w, slot in enumerate(slots):
            if slot.process is not None and slot.process.poll() is not None:
                if slot.process.returncode != 0:
                    raise RuntimeError(f"{policy}: rank {slot.rank} exited {slot.process.returncode}; see "
                                       f"{out / 'workers.log'}")
                slot.process = None
            if slot.process is None and slot.back_at <= now:
                rank = _next_rank(policy, w, pending, requeued, now)
                if rank is not None:
                    if not slot.starts:
                        slot.first_rank, slot.first_wall = rank, time.time()
                    slot.rank, slot.started = rank, now
                    slot.process = _spawn(job, out, rank, world_size, slot.speed, take_over, log)
                    slot.starts.append(now)
        if all(s.process is None for s in slots) and not pending and not requeued:
            break
        time.sleep(0.05)
    wall = time.monotonic() - begin
    log.close()
    missing = [i for i in range(job.items) if not is_done(part_dir(out, i))]
    assert not missing, f"{policy}: items not finished: {missing[:10]}"
    assert cli(["merge", str(out), "--no-progress"]) == 0
    return {"policy": policy, "ranks": world_size, "wall_s": wall,
            "process_starts": sum(len(s.starts) for s in slots), "start_s": _start_seconds(job, out, slots, world_size)}


def run_ray(job: Job, out: Path, args, ideal: float) -> dict:
    """Wall seconds of the job driven on a local Ray cluster, with the slow actor and a killed one."""
    from mmtok.formats.partdir import parts_root
    from mmtok.formats.private_parts import PRIVATE_DIR

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    slow = out / "slow-claim"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(job.site), str(BENCH)]), "OMP_NUM_THREADS": "1",
           "MMTOK_BENCH_SLOW_DIR": str(slow), "MMTOK_BENCH_SLOW_SPEED": str(args.slow_speed)}
    ray_cli = str(Path(sys.executable).parent / "ray")
    log = open(out / "workers.log", "ab")
    subprocess.run([ray_cli, "start", "--head", "--num-cpus", str(args.workers), "--include-dashboard=false",
                    "--disable-usage-stats"], env=env, stdout=log, stderr=log, check=True)
    try:
        argv = [sys.executable, "-m", "mmtok", "encode", "--plan", str(job.plan), "--codec", "standin",
                "--checkpoint", str(job.checkpoint), "--out", str(out), "--device", "cpu", "--loader-threads", "1",
                "--no-progress", "--executor", "ray", "--address", "auto", "--ray-workers", str(args.workers),
                "--json"]
        begin, begin_at, killed = time.monotonic(), time.time(), None
        driver = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=log, text=True)
        while driver.poll() is None:
            if killed is None and time.monotonic() - begin >= ideal * args.kill_at:
                killed = _kill_an_actor(parts_root(out) / PRIVATE_DIR, slow)
            time.sleep(0.05)
        wall = time.monotonic() - begin
        record = json.loads(driver.stdout.read().strip().splitlines()[-1])
        if driver.returncode != 0:
            raise RuntimeError(f"ray: the driver exited {driver.returncode}; see {out / 'workers.log'}")
    finally:
        subprocess.run([ray_cli, "stop", "--force"], stdout=log, stderr=log)
        log.close()
    assert cli(["merge", str(out), "--no-progress"]) == 0
    # from the driver's start to the median of its first workers' codec loaded (what a rank's start is here)
    start = record["began_at"] - begin_at + float(np.median(record["worker_starts"][:args.workers]))
    identities = sorted(p.stat().st_mtime for p in out.glob("parts/part-*/identity.json"))
    return {"policy": "ray", "ranks": args.workers, "wall_s": wall,
            "process_starts": args.workers + record["workers_lost"], "start_s": start,
            "backups": record["backups"], "backups_won": record["backups_won"], "retries": record["retries"],
            "killed_pid": killed, "first_part_s": identities[0] - (time.time() - wall) if identities else None}


def _kill_an_actor(private: Path, slow: Path) -> int | None:
    """SIGKILL the actor writing the first private copy that is not the slow actor's; its pid (None: none yet)."""
    slow_pid = int((slow / "pid").read_text()) if (slow / "pid").is_file() else None
    for copy in sorted(private.iterdir()) if private.is_dir() else []:
        pid = int(copy.name.rsplit(".", 1)[1])
        if pid != slow_pid:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            return pid
    return None


def _next_rank(policy: str, slot: int, pending: list[int], requeued: list[tuple[float, int]], now: float):
    """What a free slot runs next: a requeued rank that is due (static/take-over: its own slot's), else (array)
    the next pending one in index order."""
    for entry in sorted(requeued):
        if entry[0] <= now and (policy == "array" or entry[1] == slot):
            requeued.remove(entry)
            return entry[1]
    return pending.pop(0) if policy == "array" and pending else None


def _start_seconds(job: Job, out: Path, slots: list[Slot], world_size: int) -> float:
    """The median seconds from a slot's first process start to the identity.json of that process's first own
    item (written once it has imported everything, read the plan, loaded the codec and opened the part)."""
    plan = Plan.open(job.plan)
    seen = []
    for slot in slots:
        first = plan.worker_items(slot.first_rank, world_size).start
        identity = part_dir(out, first) / "identity.json"
        if identity.exists():
            seen.append(identity.stat().st_mtime - slot.first_wall)
    return float(np.median(seen)) if seen else float("nan")


def best_possible(device_s: float, args, start_s: float) -> float:
    """The least wall time any policy can reach with these faults: every slot starts once, and the work, the
    killed slot's absence (--requeue-s) and its one restart are spread over the slots' summed speed. With few
    slots a half-speed one is a real share of the capacity (1 of 8: 6%), which no scheduling can win back."""
    speeds = args.workers - 1 + args.slow_speed
    return (device_s + args.requeue_s + start_s) / speeds + start_s


def machine() -> str:
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=8, help="slots (GPUs); default 8")
    parser.add_argument("--ideal-s", type=float, default=120.0, help="device seconds per slot at full speed")
    parser.add_argument("--item-s", type=float, default=2.0, help="device seconds per work item (full speed)")
    parser.add_argument("--rate", type=float, default=0.5, help="stand-in images/s of 512x512 at full speed")
    parser.add_argument("--side", type=int, default=256, help="long side of the corpus images, px")
    parser.add_argument("--ranks-per-slot", type=int, default=8, help="array: ranks per slot (k); default 8")
    parser.add_argument("--slow", type=int, default=3, help="the slot at --slow-speed")
    parser.add_argument("--slow-speed", type=float, default=0.5)
    parser.add_argument("--killed", type=int, default=5, help="the slot whose process is killed")
    parser.add_argument("--kill-at", type=float, default=0.4, help="when, as a share of the ideal time")
    parser.add_argument("--requeue-s", type=float, default=10.0, help="seconds until the killed slot is back")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "results-items.md")
    args = parser.parse_args()
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-items-"))
    started = time.monotonic()
    job = prepare(args, root)
    ideal = job.device_s / args.workers
    print(f"job: {job.items} work items, {job.device_s:.1f} device seconds, ideal {ideal:.1f} s on {args.workers} "
          f"slots", file=sys.stderr, flush=True)
    rows = []
    for policy in args.policies.split(","):
        result = (run_ray if policy == "ray" else run_policy)(job, root / f"out-{policy}", *(
            [args, ideal] if policy == "ray" else [policy, args, ideal]))
        result["merged_sha256"] = sha256_file(root / f"out-{policy}" / "merged.bin")
        rows.append(result)
        print(json.dumps(result), file=sys.stderr, flush=True)
    identical = len({r["merged_sha256"] for r in rows}) == 1
    command = " ".join(["python benchmarks/bench_items.py", *sys.argv[1:]])
    lines = [f"Command: `{command}`; {time.monotonic() - started:.0f} s on {machine()}; load average at the end "
             f"{os.getloadavg()[0]:.2f}.", "",
             f"G = {args.workers} slots; {job.items} work items of ~{args.item_s:g} device s; total device time "
             f"{job.device_s:.0f} s, ideal {ideal:.1f} s; slot {args.slow} at {args.slow_speed:g}x speed, slot "
             f"{args.killed}'s process killed at {args.kill_at:.0%} of the ideal and back {args.requeue_s:g} s later.",
             "", "| policy | ranks | process starts | wall (s) | wall / ideal | median start (s) | "
             "wall / (ideal + start) | wall / best possible |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        start = r["start_s"]
        lines.append(f"| {r['policy']} | {r['ranks']} | {r['process_starts']} | {r['wall_s']:.1f} | "
                     f"{r['wall_s'] / ideal:.3f} | {r['start_s']:.1f} | {r['wall_s'] / (ideal + start):.3f} | "
                     f"{r['wall_s'] / best_possible(job.device_s, args, start):.3f} |")
    lines += [f"ray: {r['backups']} backups ({r['backups_won']} finished first), {r['retries']} retries"
              for r in rows if r["policy"] == "ray"]
    lines += ["", f"Merged `.bin` of every policy byte-identical: {identical}."]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.write_text(text)
    if args.workdir is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
