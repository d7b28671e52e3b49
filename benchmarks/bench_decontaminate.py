"""Decontamination at scale: N training pHashes against M benchmark pHashes (`mmtok dedup --against`).

    python benchmarks/bench_decontaminate.py [--train 100000000] [--bench 1000000] [--radius 4] [--sample 2000]

Synthetic, uniform random 64-bit pHashes and sha256 digests (what a large web corpus looks like to the search:
real pHashes are less uniform, which only adds candidates inside the few dense buckets), with planted hits: for
--planted benchmark images, a training copy at every distance 0..radius+2 (those beyond the radius must not be
found) and one byte copy (equal sha256, pHash flipped by 10 bits: found by bytes only). It times
`mmtok.curate.decontaminate.match_pairs` exactly as `mmtok dedup` calls it and reports the process's peak RSS
(VmHWM), then checks recall:
* every planted hit within the radius found, none beyond it;
* brute force (every benchmark hash against --sample training rows, NumPy popcount) finds exactly the pairs the
  search found for those rows; its time per row, times N, is the baseline printed beside the search.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mmtok.curate.decontaminate import match_pairs  # noqa: E402


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def corpus(n: int, m: int, radius: int, planted: int, seed: int):
    """(train phash, train sha, bench phash, bench sha, planted (train row, bench row, distance, by_bytes))."""
    rng = np.random.default_rng(seed)
    phash = rng.integers(0, 2**64 - 1, n, dtype=np.uint64, endpoint=True)
    bench_phash = rng.integers(0, 2**64 - 1, m, dtype=np.uint64, endpoint=True)
    sha = np.empty((n, 32), np.uint8)
    for start in range(0, n, 1 << 24):  # in chunks: one 3.2 GB draw would double the peak
        sha[start:start + (1 << 24)] = rng.integers(0, 256, (min(1 << 24, n - start), 32), dtype=np.uint8)
    bench_sha = rng.integers(0, 256, (m, 32), dtype=np.uint8)
    rows = rng.choice(n, planted * (radius + 4), replace=False)
    plants = []
    for k, bench_row in enumerate(rng.choice(m, planted, replace=False)):
        for distance in range(radius + 3):
            row = rows[k * (radius + 4) + distance]
            flip = np.uint64(sum(1 << int(b) for b in rng.choice(64, distance, replace=False)))
            phash[row] = bench_phash[bench_row] ^ flip
            plants.append((row, bench_row, distance, False))
        row = rows[k * (radius + 4) + radius + 3]
        sha[row] = bench_sha[bench_row]
        phash[row] = bench_phash[bench_row] ^ np.uint64(sum(1 << b for b in range(0, 60, 6)))  # 10 bits apart
        plants.append((row, bench_row, 10, True))
    return phash, sha, bench_phash, bench_sha, plants


def brute_force(phash: np.ndarray, bench_phash: np.ndarray, radius: int, rows: np.ndarray) -> tuple[set, float]:
    """Pairs (row, bench row) within the radius for `rows`, by comparing each with every benchmark hash."""
    started = time.perf_counter()
    found = set()
    for row in rows.tolist():
        near = np.flatnonzero(np.bitwise_count(bench_phash ^ phash[row]) <= radius)
        found.update((row, int(b)) for b in near)
    return found, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--train", type=int, default=100_000_000)
    parser.add_argument("--bench", type=int, default=1_000_000)
    parser.add_argument("--radius", type=int, default=4)
    parser.add_argument("--planted", type=int, default=1000)
    parser.add_argument("--sample", type=int, default=2000, help="training rows checked by brute force")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    phash, sha, bench_phash, bench_sha, plants = corpus(args.train, args.bench, args.radius, args.planted, args.seed)
    made = time.perf_counter() - started
    print(f"corpus: {args.train:,} training and {args.bench:,} benchmark hashes in {made:.0f} s; peak RSS "
          f"{peak_rss_mib():,.0f} MiB", file=sys.stderr)
    started = time.perf_counter()
    train, bench, distance, _ = match_pairs(phash, sha, np.full(args.train, args.radius, np.int8), bench_phash,
                                         bench_sha)
    search_s = time.perf_counter() - started
    peak = peak_rss_mib()
    pairs = set(zip(train.tolist(), bench.tolist(), strict=True))
    within = [(r, b) for r, b, d, by_bytes in plants if d <= args.radius or by_bytes]
    beyond = [(r, b) for r, b, d, by_bytes in plants if d > args.radius and not by_bytes]
    recall_planted = sum(p in pairs for p in within) / len(within)
    false_planted = sum(p in pairs for p in beyond)
    rng = np.random.default_rng(args.seed + 1)
    sample = np.unique(np.concatenate([rng.choice(args.train, args.sample, replace=False),
                                       np.array([r for r, _, d, b in plants if not b][:200])]))
    expected, brute_s = brute_force(phash, bench_phash, args.radius, sample)
    in_sample = {(r, b) for r, b in pairs if r in set(sample.tolist())}
    bytes_only = {(r, b) for r, b, _, by_bytes in plants if by_bytes}
    agree = (in_sample - bytes_only) == expected
    brute_total = brute_s / len(sample) * args.train
    print(f"| {args.train:,} | {args.bench:,} | {args.radius} | {search_s:,.1f} | {peak:,.0f} | {len(train):,} | "
          f"{recall_planted:.3f} | {false_planted} | {len(sample):,}: {'equal' if agree else 'DIFFERENT'} | "
          f"{brute_total:,.0f} | {brute_total / search_s:,.0f}x |")
    if not agree or recall_planted < 1 or false_planted:
        sys.exit(1)


if __name__ == "__main__":
    main()
