"""Padding waste of the encode stage's batching: lhotse DynamicBucketingSampler vs fixed-size batches.

    python benchmarks/bench_audio_bucketing.py [--max-duration 300] [--clips 5000] [--seed 0]

Waste = padded samples / total samples of the padded batches (B x longest clip, summed over batches),
at 24 kHz. Both batchings see the same clips in the same run:
* bucketed: `mmtok.encode.audio_batches.make_batches` (what `mmtok encode --modality audio` runs per shard),
  batches capped by padded duration --max-duration, for several --num-buckets values;
* fixed: batches of N consecutive clips in clip order, N = --max-duration / longest clip (the largest
  size that never exceeds the padded cap) and N = --max-duration / mean clip duration.
Distributions: the real durations of Debian's asterisk-core-sounds-en prompts (568 files, one shard,
clips over 60 s dropped as `mmtok audio convert` does), and a log-normal fit to them sampled for one
shard of --clips clips (the default shard size). Markdown on stdout.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import numpy as np

from mmtok.encode.audio_batches import Batching, make_batches

RATE = 24_000
ASTERISK = Path("/usr/share/asterisk/sounds/en")
MAX_CLIP = 60.0  # `mmtok audio convert --max-duration` default


def asterisk_durations() -> np.ndarray:
    import soundfile

    files = sorted(ASTERISK.rglob("*.wav"))
    if not files:
        raise SystemExit(f"no prompts under {ASTERISK}: apt-get install asterisk-core-sounds-en-wav")
    durations = np.array([soundfile.info(f).duration for f in files])
    return durations[durations <= MAX_CLIP]


def lognormal_fit(durations: np.ndarray, count: int, seed: int) -> tuple[np.ndarray, float, float]:
    logs = np.log(durations)
    mu, sigma = float(logs.mean()), float(logs.std())
    sample = np.random.default_rng(seed).lognormal(mu, sigma, count)
    return np.clip(sample, 0.3, MAX_CLIP), mu, sigma  # the converter's duration limits


def waste(batches: list[list[int]], samples: np.ndarray) -> tuple[float, str]:
    """(padding waste, "batches (mean padded seconds per batch)")."""
    padded = sum(len(b) * int(samples[b].max()) for b in batches)
    return 1.0 - samples.sum() / padded, f"{len(batches)} ({padded / RATE / len(batches):.0f} s)"


def cutset(durations: np.ndarray):
    from lhotse import CutSet, MonoCut

    return CutSet.from_cuts(MonoCut(f"c{i:06d}", 0.0, float(d), 0) for i, d in enumerate(durations))


def rows_for(name: str, durations: np.ndarray, max_duration: float, buckets: list[int], seed: int) -> list[str]:
    samples = np.round(durations * RATE).astype(np.int64)
    cuts = cutset(samples / RATE)
    rows = []
    safe = max(1, int(max_duration // durations.max()))  # never exceeds the padded cap
    mean = max(1, round(max_duration / durations.mean()))  # same mean clip duration per batch as the cap
    for size, label in ((safe, "fits the cap"), (mean, "cap / mean clip")):
        order = np.arange(len(samples))
        batches = [order[i:i + size].tolist() for i in range(0, len(order), size)]
        w, n = waste(batches, samples)
        rows.append(f"| {name} | fixed {size} clips ({label}), clip order | {n} | {100 * w:.2f}% |")
    for count in buckets:
        batches = make_batches(cuts, Batching(max_duration, count, seed))
        w, n = waste(batches, samples)
        rows.append(f"| {name} | bucketed, {count} buckets, max {max_duration:g} s padded | {n} | {100 * w:.2f}% |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-duration", type=float, default=300.0)
    parser.add_argument("--clips", type=int, default=5000)
    parser.add_argument("--buckets", type=int, nargs="+", default=[10, 30, 50, 100])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    real = asterisk_durations()
    fitted, mu, sigma = lognormal_fit(real, args.clips, args.seed)
    print(f"asterisk prompts: {len(real)} clips, mean {real.mean():.2f} s, median {np.median(real):.2f} s, "
          f"max {real.max():.1f} s; log-normal fit mu {mu:.3f} sigma {sigma:.3f} "
          f"(median {math.exp(mu):.2f} s), {args.clips} clips sampled\n")
    print("| durations | batching | batches (mean padded s) | padding waste |")
    print("|---|---|---|---|")
    for row in rows_for("asterisk (real)", real, args.max_duration, args.buckets, args.seed):
        print(row)
    for row in rows_for("log-normal fit", fitted, args.max_duration, args.buckets, args.seed):
        print(row)


if __name__ == "__main__":
    main()
