"""Host side of `mmtok encode`: loader/device overlap, decode+resize cost per core, commit cost.

    python benchmarks/bench_encode.py [--images 256] [--rates 23,auto] [--threads 2] [--dir DIR]

Corpus: --images distinct JPEGs cut from the real photos on this machine (Debian mate-backgrounds,
1280x1024 to 5640x3172, and scikit-image's rocket/retina/hubble): seeded random crops in common
aspect ratios (1:1, 4:3, 3:2, 16:9 and portrait) scaled to a long side of 512-2048 px, quality 90,
with captions, in WebDataset tar shards; scanned and planned as `image-text` with 512x512 targets
(min 256x256), at most 16 images per batch.
The device is `benchmarks/standin.py` `StandInCodec`: encode time proportional to pixels, a sleep that
releases the GIL like a CUDA sync, simulating a GPU that encodes R images of 512x512 per second.

1. Overlap: device-busy fraction of wall time, end to end (`encode_image_rank`: loader threads, device
   loop, background commits), for each rate R in --rates, next to a serial baseline that decodes,
   resizes and encodes each batch in one thread. The loaders' own rate (instant device) is measured
   first; `auto` is a device these loaders can feed on this machine, so its row isolates the overlap
   from the machine's core count (23 images/s needs the cores of section 2). "after first batch"
   leaves out the pipeline fill (the device waiting for its very first batch, `fill_s` in the
   stats), which a production run amortizes over hours.
2. Host decode+resize throughput of one core (one thread, PIL with EXIF orientation and one RGB
   conversion, bicubic; thread CPU time) at 256x256, 512x512 and 1024x1024 target bounds, and the
   loader cores one GPU needs at 23 images/s at 512x512 (the GH200 softmax-path reference rate) and
   at twice that.
3. Commit cost at 23 images/s: the encode loop's wall time with durable per-batch commits vs the
   same run with commits replaced by a no-op (best of --repeats alternating runs), the time the
   device loop spent waiting for the background committer (the commit's share of the critical
   path), and the median time of one commit next to the device time of a 16-image batch.
Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from encodekit import write_tar  # noqa: E402
from mmtok.cli import main as cli  # noqa: E402
from mmtok.encode.loop import CommitThread  # noqa: E402
from mmtok.encode.runner import EncodeOptions, encode_image_rank  # noqa: E402
from mmtok.formats.commitlog import PartWriter  # noqa: E402
from mmtok.media.images import decode_rgb, resize_rgb  # noqa: E402
from mmtok.media.resize import target_shape  # noqa: E402
from realmedia import mate_photos, skimage_images  # noqa: E402
from standin import StandInCodec  # noqa: E402 (benchmarks/standin.py: a simulated device, not a codec)


def real_jpegs() -> list[Path]:
    return [p for p in mate_photos() + skimage_images() if p.suffix.lower() == ".jpg"]


ASPECTS = (1.0, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16)  # the camera/screen formats most web images have


def web_jpegs(count: int, seed: int = 0) -> list[tuple[str, bytes]]:
    """`count` distinct JPEGs cut from the real photos: a random crop (30-100% of the largest crop of
    a common aspect ratio) scaled to a long side of 512-2048 px, quality 90 -- web-like sizes and
    formats with real photo content (seeded, so every run sees the same files)."""
    import io
    import random

    from PIL import Image

    rng = random.Random(seed)
    paths = real_jpegs()
    photos = [Image.open(p).convert("RGB") for p in paths]
    out = []
    for i in range(count):
        photo = photos[i % len(photos)]
        aspect = rng.choice(ASPECTS)  # width / height
        width = int(min(photo.width, photo.height * aspect) * rng.uniform(0.3, 1.0))
        height = min(photo.height, max(64, round(width / aspect)))
        left, top = rng.randint(0, photo.width - width), rng.randint(0, photo.height - height)
        crop = photo.crop((left, top, left + width, top + height))
        scale = rng.uniform(512, 2048) / max(crop.size)
        crop = crop.resize((max(16, round(crop.width * scale)), max(16, round(crop.height * scale))), Image.BICUBIC)
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=90)
        out.append((f"{paths[i % len(paths)].stem}-{i}", buffer.getvalue()))
    return out


def build_corpus(root: Path, images: list[tuple[str, bytes]], per_shard: int = 64) -> Path:
    members = []
    for i, (name, data) in enumerate(images):
        members += [(f"k{i:06d}.jpg", data), (f"k{i:06d}.txt", f"a photo: {name}".encode())]
    for shard, start in enumerate(range(0, len(members), 2 * per_shard)):
        write_tar(root / "data" / f"shard-{shard:03d}.tar", members[start : start + 2 * per_shard])
    assert cli(["scan", str(root / "data" / "*.tar"), "--out", str(root / "manifest"), "--no-progress"]) == 0
    assert cli(["plan", str(root / "manifest"), "--out", str(root / "plan"), "--quiet", "--mode", "image-text",
                "--min-pixels", str(256 * 256), "--max-pixels", str(512 * 512), "--token-budget", str(16 * 1100),
                "--max-batch-images", "16"]) == 0
    return root / "plan"


AUTO_MARGIN = 0.7  # `auto` device rate: the device needs 70% of what the loaders delivered alone


def mean_target_pixels(plan: Path) -> float:
    table = pq.read_table(plan / "plan.parquet", columns=["target_height", "target_width"])
    return float(np.mean(table.column(0).to_numpy().astype(np.int64) * table.column(1).to_numpy()))


def overlapped(plan: Path, out: Path, rate: float, threads: int) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    return encode_image_rank(plan, out, StandInCodec(rate), rank=0, world_size=1,
                             options=EncodeOptions(loader_threads=threads, progress=False)).to_json()


def serial(plan: Path, rate: float) -> dict:
    """Decode, resize and encode each batch in one thread (no overlap): the baseline."""
    import torch

    codec = StandInCodec(rate)
    images = pq.read_table(plan / "plan.parquet").to_pylist()
    manifest_dir = Path(json.loads((plan / "plan.json").read_text())["manifest_dir"])
    manifest = pq.read_table(manifest_dir / "manifest.parquet").to_pylist()
    batches: dict[int, list[dict]] = {}
    for row in images:
        batches.setdefault(row["batch"], []).append(row)
    device = 0.0
    started = time.perf_counter()
    for batch in batches.values():
        height, width = batch[0]["target_height"], batch[0]["target_width"]
        pixels = np.zeros((len(batch), height, width, 3), np.uint8)
        for slot, row in enumerate(batch):
            entry = manifest[row["manifest_row"]]
            with open(entry["tar"], "rb") as handle:
                handle.seek(entry["offset"])
                pixels[slot] = resize_rgb(decode_rgb(handle.read(entry["size"])), height, width)
        tick = time.perf_counter()
        codec.encode(torch.from_numpy(pixels))
        device += time.perf_counter() - tick
    wall = time.perf_counter() - started
    return {"wall_s": wall, "device_busy_s": device, "device_busy_fraction": device / wall,
            "images_per_s": len(images) / wall}


def host_throughput(data: list[bytes], bounds: list[int], per_size: int) -> dict[int, float]:
    """Images per CPU-second of one thread: decode (bytes already in memory), orient, RGB, resize.

    Thread CPU time, not wall time: the figure is per core and holds on a machine shared with
    other work (wall-clock throughput there would measure the other work)."""
    rates = {}
    for side in bounds:
        started = time.thread_time()
        for i in range(per_size):
            image = decode_rgb(data[i % len(data)])
            height, width = target_shape(image.height, image.width, min_pixels=(side // 2) ** 2,
                                         max_pixels=side * side)
            resize_rgb(image, height, width)
        rates[side] = per_size / (time.thread_time() - started)
    return rates


def commit_cost(plan: Path, root: Path, rate: float, threads: int, repeats: int) -> dict:
    """Durable commits vs no-op commits (alternating runs, best wall of `repeats`), the time one commit
    takes, and how long the device loop waited for the committer (its queue full): the commit's cost
    on the critical path."""
    real_commit, real_submit = PartWriter.commit, CommitThread.submit
    inside: list[float] = []
    stalled = [0.0]

    def timed_commit(self, *args, **kwargs):
        started = time.perf_counter()
        real_commit(self, *args, **kwargs)
        inside.append(time.perf_counter() - started)

    def no_commit(self, unit, sequences, provenance, counts, **kwargs):
        self.next_unit = unit + 1
        self.lengths.extend(int(np.asarray(s).size) for s in sequences)
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + int(value)

    def timed_submit(self, job):
        started = time.perf_counter()
        real_submit(self, job)
        stalled[0] += time.perf_counter() - started

    walls: dict[str, list[float]] = {"durable": [], "none": []}
    CommitThread.submit = timed_submit
    try:
        for _ in range(repeats):
            for mode, method in (("durable", timed_commit), ("none", no_commit)):
                PartWriter.commit = method
                walls[mode].append(overlapped(plan, root / f"out-{mode}", rate, threads)["wall_s"])
    finally:
        PartWriter.commit, CommitThread.submit = real_commit, real_submit
    durable, none = min(walls["durable"]), min(walls["none"])
    return {"durable_s": durable, "none_s": none, "overhead": durable / none - 1,
            "commit_s": statistics.median(inside), "commits": len(inside),
            "stall_share": stalled[0] / sum(walls["durable"] + walls["none"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--rates", default="23,auto",
                        help="simulated device rates, images/s at 512x512; auto = a device that needs 70%% of "
                        "the images/s the loaders deliver alone on this machine (measured first)")
    parser.add_argument("--threads", type=int, default=2, help="loader threads")
    parser.add_argument("--host-images", type=int, default=64, help="images per target size for the host figure")
    parser.add_argument("--repeats", type=int, default=5, help="repeats of the commit-cost comparison")
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    root = Path(tempfile.mkdtemp(prefix="bench-encode-", dir=args.dir))
    try:
        images = web_jpegs(args.images)
        plan = build_corpus(root, images)
        megapixels = statistics.mean(np.prod(decode_rgb(data).size) for _, data in images) / 1e6
        print(f"Corpus: {args.images} JPEGs cut from {len(real_jpegs())} real photos (long side 512-2048 px, "
              f"mean {megapixels:.2f} MP), image-text, targets <= 512x512; {args.threads} loader threads\n")
        host = host_throughput([data for _, data in images], [256, 512, 1024], args.host_images)
        feed = overlapped(plan, root / "out", 0, args.threads)["images_per_s"]  # loaders alone, device instant
        rates = [float(r) for r in args.rates.split(",") if r != "auto"]
        if "auto" in args.rates.split(","):
            rates.append(round(AUTO_MARGIN * feed * mean_target_pixels(plan) / (512 * 512), 1))
        print("## 1. Device-busy fraction of wall time (stand-in device)\n")
        print(f"Loaders alone (instant device): {feed:.1f} images/s with {args.threads} threads on this machine now.\n")
        print("| device rate (512² img/s) | pipeline busy | after first batch | pipeline img/s | serial busy | "
              "serial img/s |\n|---:|---:|---:|---:|---:|---:|")
        for rate in rates:
            piped = overlapped(plan, root / "out", rate, args.threads)
            steady = piped["device_busy_s"] / (piped["wall_s"] - piped["fill_s"])
            base = serial(plan, rate)
            print(f"| {rate:g} | {piped['device_busy_fraction']:.1%} | {steady:.1%} | {piped['images_per_s']:.1f} | "
                  f"{base['device_busy_fraction']:.1%} | {base['images_per_s']:.1f} |")
        print("\n## 2. Host decode + resize, one core (thread CPU time)\n")
        print("| target bound | images/s per core | cores for 23 img/s | cores for 46 img/s |\n|---|---:|---:|---:|")
        for side, per_core in host.items():
            print(f"| {side}x{side} | {per_core:.1f} | {23 / per_core:.1f} | {46 / per_core:.1f} |")
        print("\n## 3. Durable per-batch commit vs no commit\n")
        reference = 23.0  # the GH200 softmax-path rate: how a real run would pace the commits
        cost = commit_cost(plan, root, reference, args.threads, args.repeats)
        batch_seconds = 16 / 23  # a 16-image batch of 512x512 at the reference 23 images/s
        print("| device rate | wall, durable commits | wall, no commits | wall overhead | device loop waiting "
              "on commits | one commit (median) | commit / 16-image batch at 23 img/s |\n"
              "|---:|---:|---:|---:|---:|---:|---:|")
        print(f"| {reference:g} | {cost['durable_s']:.2f} s | {cost['none_s']:.2f} s | {cost['overhead']:+.2%} | "
              f"{cost['stall_share']:.3%} of wall | {1000 * cost['commit_s']:.1f} ms ({cost['commits']} commits) | "
              f"{cost['commit_s'] / batch_seconds:.2%} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
