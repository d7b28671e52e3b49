"""Scan throughput: `mmtok scan` (header-only) vs the naive `tarfile` + `PIL.Image.open(...).size`.

    python benchmarks/bench_scan.py [--workdir /tmp/mmtok-bench-scan] [--images 200000] [--shards 64]
                                    [--world-size N]

Builds (once, cached in WORKDIR) WebDataset shards of real photos (Debian mate-backgrounds and
scikit-image data) re-encoded at web sizes (30-100 KB): baseline and progressive JPEG, JPEG with a
small EXIF block and with a camera-style EXIF whose maker note puts the SOF past the first 4 KiB,
PNG and WebP. Two layouts of the same images: `images` (one image member per sample) and
`captions` (each sample also has a .txt caption, every fourth a .json), measured one after the
other. For each layout, in one run:

- warm page cache: our scan on 1 worker (the per-shard scan, and the whole `run_scan` with manifest
  writing) vs the baseline on the same shards, images/s per core and the ratio;
- cold page cache (pages dropped with POSIX_FADV_DONTNEED): our scan's images/s, bytes requested
  per image (every pread counted) and the bytes the kernel read from storage (/proc/self/io);
- with `--world-size N` (cold page cache each time): `mmtok scan --workers 1` in one process vs N
  concurrent `mmtok scan --rank r --world-size N --workers 1` processes into one OUT (the model of N
  nodes), wall time, small reads per second, and whether both manifests are byte-identical.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

CORPUS_VERSION = 2
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif", ".bmp", ".tif", ".tiff")
# Share of each variant among image members.
MIX = (("jpeg", 0.30), ("jpeg_exif", 0.20), ("jpeg_camera_exif", 0.10), ("jpeg_progressive", 0.10),
       ("png", 0.15), ("webp", 0.15))


def _sources() -> list[Path]:
    from realmedia import mate_photos, skimage_images

    photos = [p for p in mate_photos() if p.suffix.lower() == ".jpg"]
    colour = [p for p in skimage_images() if p.name in ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg",
                                                         "motorcycle_left.png", "hubble_deep_field.jpg", "retina.jpg")]
    return photos + colour


def _camera_exif(orientation: int, rng: random.Random) -> bytes:
    """EXIF as cameras write it: make/model/date, an orientation, and a maker note of 8-24 KB,
    so the JPEG's SOF lies past the first 4 KiB (the scan's retry path)."""
    from PIL import Image

    exif = Image.Exif()
    exif[0x010F], exif[0x0110], exif[0x0132] = "Debian", "mate-backgrounds", "2021:12:10 12:00:00"
    exif[0x0112] = orientation
    exif.get_ifd(0x8769)[0x927C] = rng.randbytes(rng.randrange(8_000, 24_000))
    return exif.tobytes()


def _encode(image, variant: str, rng: random.Random) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    if variant == "png":
        image.save(out, "PNG", compress_level=6)
    elif variant == "webp":
        image.save(out, "WEBP", quality=80)
    else:
        kwargs = {"quality": rng.choice((80, 85, 90))}
        if variant == "jpeg_progressive":
            kwargs["progressive"] = True
        elif variant == "jpeg_exif":
            exif = Image.Exif()
            exif[0x0112] = rng.choice((1, 3, 6, 8))
            kwargs["exif"] = exif.tobytes()
        elif variant == "jpeg_camera_exif":
            kwargs["exif"] = _camera_exif(rng.choice((1, 6)), rng)
        image.save(out, "JPEG", **kwargs)
    return out.getvalue()


def _fit_size(image, variant: str, rng: random.Random) -> bytes:
    """Encode at a scale whose file lands in 30-100 KB (typical web images)."""
    target = rng.uniform(30_000, 100_000)
    lo, hi = 64, max(image.size)
    best = None
    for _ in range(8):
        side = (lo + hi) // 2
        small = image.copy()
        small.thumbnail((side, side))
        data = _encode(small, variant, rng)
        best = data
        if abs(len(data) - target) < 6_000:
            break
        lo, hi = (side, hi) if len(data) < target else (lo, side)
    return best


def load_pool(directory: Path, per_variant: int, seed: int = 0) -> list[tuple[str, str, bytes]]:
    """The encoded images, built once into `directory` (one file per image)."""
    stamp = directory / "pool.json"
    params = {"version": CORPUS_VERSION, "per_variant": per_variant, "seed": seed}
    if not (stamp.exists() and json.loads(stamp.read_text()) == params):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
        for k, (variant, ext, data) in enumerate(build_pool(per_variant, seed)):
            (directory / f"{k:05d}-{variant}.{ext}").write_bytes(data)
        stamp.write_text(json.dumps(params))
    return [(p.stem.split("-", 1)[1], p.suffix[1:], p.read_bytes())
            for p in sorted(directory.iterdir()) if p.name != "pool.json"]


def build_pool(per_variant: int, seed: int = 0) -> list[tuple[str, str, bytes]]:
    """Distinct encoded images: (variant, extension, bytes), `per_variant` of each MIX variant."""
    from PIL import Image

    rng = random.Random(seed)
    images = []
    for path in _sources():
        with Image.open(path) as im:
            im = im.convert("RGB")
            im.thumbnail((1600, 1600))
            images.append(im)
    pool = []
    for variant, _share in MIX:
        for k in range(per_variant):
            image = images[k % len(images)]
            if k // len(images) % 2:
                image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            ext = {"png": "png", "webp": "webp"}.get(variant, "jpg")
            pool.append((variant, ext, _fit_size(image, variant, rng)))
    return pool


def build_corpus(directory: Path, images: int, shards: int, captions: bool, seed: int = 0) -> list[Path]:
    """WebDataset shards of `images` samples (with `captions`: + txt, every fourth + json), cached by parameters."""
    params = {"version": CORPUS_VERSION, "images": images, "shards": shards, "captions": captions, "seed": seed}
    stamp = directory / "corpus.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("params") == params:
        return sorted(directory.glob("shard-*.tar"))
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    print(f"building corpus: {images:,} images in {shards} shards under {directory} ...", file=sys.stderr)
    pool = load_pool(directory.parent / "pool", per_variant=40, seed=seed)
    by_variant = {v: [p for p in pool if p[0] == v] for v, _ in MIX}
    rng = random.Random(seed)
    variants = [v for v, _ in MIX]
    weights = [w for _, w in MIX]
    per_shard = -(-images // shards)
    paths = []
    sample = 0
    for s in range(shards):
        path = directory / f"shard-{s:05d}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for _ in range(min(per_shard, images - sample)):
                _variant, ext, data = rng.choice(by_variant[rng.choices(variants, weights)[0]])
                key = f"{sample:09d}"
                _add(tar, f"{key}.{ext}", data)
                if captions:
                    _add(tar, f"{key}.txt", f"caption of sample {sample}".encode())
                if captions and sample % 4 == 0:
                    _add(tar, f"{key}.json", json.dumps({"key": key, "url": f"https://example.org/{key}"}).encode())
                sample += 1
        paths.append(path)
    sizes = [len(d) for _, _, d in pool]
    stamp.write_text(json.dumps({"params": params, "pool_images": len(pool),
                                 "pool_mean_bytes": sum(sizes) / len(sizes)}, indent=2))
    return paths


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


def baseline(paths: list[Path]) -> int:
    """The naive scan: iterate each tar with tarfile and open every image with PIL."""
    from PIL import Image

    count = 0
    for path in paths:
        with tarfile.open(path) as tar:
            for member in tar:
                if member.isfile() and member.name.lower().endswith(IMAGE_SUFFIXES):
                    with Image.open(tar.extractfile(member)) as image:
                        image.size  # noqa: B018  (what the baseline measures)
                    count += 1
    return count


def our_shard_scan(paths: list[Path]) -> tuple[int, int, int]:
    """The per-shard scan alone, in this process: (image rows, bytes requested, reads)."""
    from mmtok.scan.scanner import ScanOptions, describe, scan_source

    rows = read = reads = 0
    for path in paths:
        out, _ = scan_source(describe(str(path)), ScanOptions())
        rows += sum(1 for r in out.rows if r[0])
        read += out.bytes_read
        reads += out.reads
    return rows, read, reads


def our_full_scan(paths: list[Path], out: Path) -> dict:
    """`mmtok scan --workers 1` end to end (cache empty): shard scans, cache files, manifest."""
    from mmtok.scan.scanner import ScanOptions, describe, run_scan

    shutil.rmtree(out, ignore_errors=True)
    return run_scan([describe(str(p)) for p in paths], out, ScanOptions(), workers=1, progress=False).meta.to_json()


def drop_page_cache(paths: list[Path]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_page_cache(paths: list[Path]) -> None:
    for path in paths:
        with open(path, "rb") as handle:
            while handle.read(1 << 24):
                pass


def storage_read_bytes() -> int:
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("read_bytes:")).split()[1])


def timed(fn, *args):
    """(result, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn(*args)
    return result, time.perf_counter() - wall, time.process_time() - cpu


def calibration() -> float:
    """CPU ms of a fixed pure-Python loop (sum(range(2e6))): compares machines and load levels."""
    return min(timed(sum, range(2_000_000))[2] for _ in range(5)) * 1e3


def measure(paths: list[Path], workdir: Path, repeat: int) -> dict:
    total_bytes = sum(p.stat().st_size for p in paths)
    warm_page_cache(paths)
    runs = [timed(our_shard_scan, paths) for _ in range(repeat)]
    (images, requested, reads), ours_wall, _ = min(runs, key=lambda r: r[1])
    ours_cpu = min(r[2] for r in runs)
    meta, full_wall, full_cpu = timed(our_full_scan, paths, workdir / "out")
    base_images, base_wall, base_cpu = timed(baseline, paths)
    assert base_images == images == meta["images_ok"] + meta["errors"], (base_images, images, meta["images_ok"])

    drop_page_cache(paths)
    storage_before = storage_read_bytes()
    (cold_images, cold_requested, _), cold_wall, cold_cpu = timed(our_shard_scan, paths)
    storage = storage_read_bytes() - storage_before
    return {
        "corpus": {"shards": len(paths), "images": images, "gb": round(total_bytes / 1e9, 2),
                   "bytes_per_image_member": round(total_bytes / images)},
        "warm": {
            "ours_images_per_cpu_s": round(images / ours_cpu),
            "ours_images_per_wall_s": round(images / ours_wall),
            "ours_full_scan_images_per_cpu_s": round(images / full_cpu),
            "baseline_images_per_cpu_s": round(base_images / base_cpu),
            "baseline_images_per_wall_s": round(base_images / base_wall),
            "ratio_cpu": round(base_cpu / ours_cpu, 1),
            "ratio_wall": round(base_wall / ours_wall, 1),
            "ratio_full_scan_cpu": round(base_cpu / full_cpu, 1),
            "reads_per_image": round(reads / images, 2),
        },
        "cold": {
            "ours_images_per_wall_s": round(cold_images / cold_wall),
            "ours_images_per_cpu_s": round(cold_images / cold_cpu),
            "bytes_requested_per_image": round(cold_requested / cold_images),
            "storage_bytes_read_per_image": round(storage / cold_images),
        },
    }


def commit_totals(out: Path) -> tuple[int, int]:
    """(rows, reads) over the shard commits a scan left in OUT/.scan-cache."""
    rows = reads = 0
    for path in (out / ".scan-cache").glob("*.json"):
        stats = json.loads(path.read_text())["stats"]
        rows, reads = rows + stats["rows"], reads + stats["reads"]
    return rows, reads


def cli_scan(paths: list[Path], out: Path, world_size: int) -> float:
    """Wall seconds of a cold-cache `mmtok scan --workers 1` into an empty OUT: one process, or
    `world_size` rank processes started together (then the final assembly if no rank wrote it)."""
    import subprocess

    shutil.rmtree(out, ignore_errors=True)
    drop_page_cache(paths)
    command = [sys.executable, "-m", "mmtok", "scan", *map(str, paths), "--out", str(out), "--workers", "1",
               "--no-progress"]
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    began = time.perf_counter()
    ranks = [subprocess.Popen(command + (["--rank", str(r), "--world-size", str(world_size)] if world_size > 1 else []),
                              env=env, stderr=subprocess.DEVNULL) for r in range(world_size)]
    if any(rank.wait() for rank in ranks):
        raise SystemExit(f"a scan process failed: {command}")
    if not (out / "manifest.json").exists():
        subprocess.run(command, env=env, check=True, stderr=subprocess.DEVNULL)
    return time.perf_counter() - began


def measure_ranks(paths: list[Path], workdir: Path, world_size: int) -> dict:
    """One process vs `world_size` rank processes, cold page cache: wall time and small reads per second."""
    one = cli_scan(paths, workdir / "one", 1)
    many = cli_scan(paths, workdir / "ranks", world_size)
    rows, reads = commit_totals(workdir / "one")
    same = (workdir / "one" / "manifest.parquet").read_bytes() == (workdir / "ranks" / "manifest.parquet").read_bytes()
    return {"world_size": world_size, "rows": rows, "reads": reads, "reads_per_image": round(reads / rows, 3),
            "one_process_wall_s": round(one, 2), "ranks_wall_s": round(many, 2), "speedup": round(one / many, 2),
            "one_process_small_reads_per_s": round(reads / one), "ranks_small_reads_per_s": round(reads / many),
            "manifest_bytes_identical": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "mmtok-bench-scan")
    parser.add_argument("--images", type=int, default=200_000)
    parser.add_argument("--shards", type=int, default=64)
    parser.add_argument("--layouts", default="images,captions", help="comma-separated: images, captions")
    parser.add_argument("--repeat", type=int, default=3, help="warm runs of our scan (the best is reported)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--world-size", type=int, default=0,
                        help="also compare one scan process with this many concurrent rank processes (cold cache)")
    args = parser.parse_args()

    figures = {"machine": f"{os.cpu_count()}-core {os.uname().machine}, Python {sys.version.split()[0]}",
               "load_average_at_start": os.getloadavg()[0], "calibration_ms": round(calibration(), 1)}
    for layout in args.layouts.split(","):
        paths = build_corpus(args.workdir / layout, args.images, args.shards, captions=layout == "captions")
        figures[layout] = measure(paths, args.workdir, args.repeat)
        if args.world_size > 1:
            figures[layout]["ranks"] = measure_ranks(paths, args.workdir, args.world_size)
        print(json.dumps({layout: figures[layout]}, indent=2), file=sys.stderr)
    figures["calibration_ms_at_end"] = round(calibration(), 1)
    figures["load_average_at_end"] = os.getloadavg()[0]
    print(json.dumps(figures, indent=2))
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
