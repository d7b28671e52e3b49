"""Reconstruction benchmark runner: its own overhead per image (I/O, metrics, logging) vs the codec time.

One command (CPU, tiny random-weight configs of Emu3.5 and Emu3, real photos):

    python benchmarks/bench_reconstruct.py [--per-category 4] [--threads 2] [--out /tmp/bench-reconstruct]

It runs `mmtok bench reconstruct` on skimage photos and Debian mate photos (one category per folder) at the
training sizes (Emu3.5: mmtok plan defaults, 65,536..262,144 pixels; Emu3: the official processor bounds,
262,144..1,048,576 pixels), then splits the wall time per image into load (read + decode + orient),
encode, decode, metrics (PSNR + SSIM + LPIPS) and the durable results append, and times each metric alone
on the same image sizes. The baseline is the codec time: the runner's overhead is reported as a ratio to it.
With the real models (about 100x-300x the tiny configs' compute) the codec share only grows.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from mmtok.bench.report import BenchSummary

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def write_table(path: Path) -> Path:
    from realmedia import mate_photos, skimage_images

    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "source"])
        writer.writerows([[str(p), "skimage"] for p in skimage_images() if p.suffix in (".png", ".jpg")])
        writer.writerows([[str(p), f"mate-{p.parent.name}"] for p in mate_photos() if p.suffix == ".jpg"])
    return path


def per_metric_times(out: Path, repeats: int = 3) -> dict[str, float]:
    """Median seconds of PSNR, SSIM and LPIPS alone on the kept reconstructions (training sizes)."""
    from PIL import Image

    from mmtok.bench import metrics

    scorer = metrics.ImageScorer("cpu")
    pairs = []
    for recon in sorted((out / "recon").glob("*__emu3.png")):
        image = np.asarray(Image.open(recon).convert("RGB"))
        pairs.append((image, np.ascontiguousarray(image[::-1])))
    times = {"psnr": [], "ssim": [], "lpips": []}
    for _ in range(repeats):
        for name, fn in (("psnr", metrics.psnr), ("ssim", metrics.ssim), ("lpips", scorer.lpips)):
            started = time.perf_counter()
            for a, b in pairs:
                fn(a, b)
            times[name].append((time.perf_counter() - started) / len(pairs))
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--per-category", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None, help="output folder (default: a temporary one, removed)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from mmtok.bench import reconstruct
    from mmtok.codecs import emu3, emu35

    work = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="bench-reconstruct-"))
    work.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work / "out", ignore_errors=True)
    table = write_table(work / "images.csv")
    specs = [reconstruct.parse_tokenizer(f"emu3.5={emu35.write_random_checkpoint(work / 'emu35')}"),
             reconstruct.parse_tokenizer(f"emu3={emu3.write_random_checkpoint(work / 'emu3')}")]
    options = reconstruct.RunOptions(manifest=table, category_column="source", per_category=args.per_category,
                                     seed=0, tokenizers=specs, out=work / "out", progress=False)
    started = time.perf_counter()
    summary = reconstruct.run(options)
    total = time.perf_counter() - started
    report(summary, work / "out", total, args)
    if not args.out:
        shutil.rmtree(work)


def report(summary: BenchSummary, out: Path, total: float, args) -> None:
    timing = summary.this_invocation_timing_s
    items = timing["items"]
    rows = list(csv.DictReader(open(out / "results.csv", newline="")))
    codec = timing["encode_s"] + timing["decode_s"]
    overhead = timing["load_s"] + timing["metrics_s"] + timing["write_s"]
    pixels = {label: statistics.mean(int(r["height"]) * int(r["width"]) for r in rows if r["tokenizer"] == label)
              for label in ("emu3.5", "emu3")}
    alone = per_metric_times(out)
    print("# bench reconstruct: runner overhead vs codec time\n")
    print(f"machine: {platform.machine()} {os.cpu_count()}-core CPU VM, no GPU; torch {torch.__version__}, "
          f"{args.threads} threads; load average {os.getloadavg()[0]:.1f} at the end")
    print(f"{items} images x 2 tokenizers (tiny random configs), mean pixels per scored image: "
          + ", ".join(f"{k} {v:,.0f}" for k, v in pixels.items()))
    print(f"total wall {total:.1f} s (incl. model/tokenizer loading and the report)\n")
    print("| stage | s per image (both tokenizers) | share of the item loop |")
    print("|---|---:|---:|")
    loop = codec + overhead
    for name, key in (("load (read + decode + orient)", "load_s"), ("encode (codec)", "encode_s"),
                      ("decode (codec)", "decode_s"), ("metrics (PSNR+SSIM+LPIPS)", "metrics_s"),
                      ("results append + fsync", "write_s")):
        print(f"| {name} | {timing[key] / items:.3f} | {timing[key] / loop:.1%} |")
    print(f"\nrunner overhead / codec time = {overhead / codec:.2f} (baseline: codec = 1.00)")
    print("\nEach metric alone, median s per Emu3-sized reconstruction (" + f"{pixels['emu3']:,.0f} px): "
          + ", ".join(f"{k} {v:.3f}" for k, v in alone.items()))
    print("\n" + json.dumps({"timing": timing, "metric_alone_s": alone, "pixels": pixels}, indent=None))


if __name__ == "__main__":
    main()
