"""`mmtok dedup`'s grouping (`mmtok.curate.dedup.find_duplicates`) on synthetic hashes with planted duplicates.

    python benchmarks/bench_dedup.py --images 100000000 [--near-share 0.1] [--radius 4] [--json OUT.json]

The images: random 64-bit pHashes and sha256s; a share `--near-share` of them belongs to a source deduplicated
within `--radius` (egocentric frames), the rest to sources deduplicated by equal pHash. Planted: 1% byte copies
(equal sha256 and pHash), 1% re-encodings (equal pHash, other bytes), and, in the radius source, 1% near copies
1..radius bits away. A sha256 is stood for by a content id (the head is a 64-bit mix of it, and two images have
equal bytes exactly when their ids are equal), so the byte check is real without 32 bytes an image. Reported:
wall and CPU time, peak memory (ru_maxrss) and that every planted duplicate was found (each planted image is
dropped or is its group's keeper, and no image outside the plants is dropped unless it is a random
near-duplicate within the radius, which is counted). Baseline in the same run: the same grouping at a tenth of
the size, for the growth factor.
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from pathlib import Path

import numpy as np


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer: distinct ids -> distinct 64-bit heads."""
    z = values.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def synthetic(n: int, near_share: float, radius: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    phash = rng.integers(0, np.iinfo(np.int64).max, n, dtype=np.int64).astype(np.uint64) << np.uint64(1)
    phash |= rng.integers(0, 2, n, dtype=np.uint64)
    content = np.arange(n, dtype=np.int64)
    near_from = n - int(n * near_share)
    radii = np.zeros(n, np.int8)
    radii[near_from:] = radius
    plants = n // 100
    copies = rng.integers(0, n, (2, plants))  # byte copies
    content[copies[1]], phash[copies[1]] = content[copies[0]], phash[copies[0]]
    encodings = rng.integers(0, n, (2, plants))  # equal pHash, other bytes
    phash[encodings[1]] = phash[encodings[0]]
    near = rng.integers(near_from, n, (2, int((n - near_from) / 100)))
    flips = np.zeros(near.shape[1], np.uint64)
    for _ in range(radius):  # 1..radius distinct bits (a repeated bit cancels: fewer flips, still within)
        flips ^= np.uint64(1) << rng.integers(0, 64, near.shape[1]).astype(np.uint64)
    flips[flips == 0] = np.uint64(1)
    phash[near[1]] = phash[near[0]] ^ flips
    return {"phash": phash, "content": content, "radius": radii,
            "planted": np.unique(np.concatenate([copies.ravel(), encodings.ravel(), near.ravel()]))}


def run(n: int, near_share: float, radius: int) -> dict:
    from mmtok.curate.dedup import find_duplicates

    data = synthetic(n, near_share, radius)
    content = data["content"]
    began, cpu = time.perf_counter(), time.process_time()
    found = find_duplicates(data["phash"], _mix(content), data["radius"], lambda nodes: nodes,
                            lambda a, b: content[a] == content[b])
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    grouped = np.union1d(found.dropped, found.keeper)
    missed = np.setdiff1d(data["planted"], grouped)
    # a planted image may land on itself (a copy of itself) or be overwritten by a later plant: only those miss
    lost = [int(i) for i in missed[:20] if not _self_planted(int(i), data)]  # a sample: each check scans n
    return {"images": n, "radius_images": int((data["radius"] > 0).sum()), "radius": radius,
            "dropped": len(found.dropped), "groups": int(found.group.max()) + 1 if len(found.group) else 0,
            "by_rule": {r: int((found.rule == r).sum()) for r in ("sha256", "phash_exact", "phash_radius")},
            "planted_images": len(data["planted"]), "planted_not_grouped": len(missed), "lost": lost,
            "wall_s": wall, "cpu_s": cpu, "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _self_planted(i: int, data: dict) -> bool:
    """Whether image i has no duplicate after all plants (it was its own copy, or its partner was overwritten)."""
    same = np.flatnonzero((data["phash"] == data["phash"][i]) | (data["content"] == data["content"][i]))
    if len(same) > 1:
        return False
    if data["radius"][i] > 0:
        near = np.flatnonzero(data["radius"] > 0)
        return bool(np.bitwise_count(data["phash"][near] ^ data["phash"][i]).astype(int).__le__(
            int(data["radius"][i])).sum() <= 1)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100_000_000)
    parser.add_argument("--near-share", type=float, default=0.1)
    parser.add_argument("--radius", type=int, default=4)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = [run(args.images // 10, args.near_share, args.radius), run(args.images, args.near_share, args.radius)]
    for r in results:
        print(f"{r['images']:,} images ({r['radius_images']:,} within radius {r['radius']}): {r['dropped']:,} dropped "
              f"in {r['groups']:,} groups {r['by_rule']}; {r['wall_s']:.1f} s wall, {r['cpu_s']:.1f} s CPU, peak "
              f"{r['peak_rss_gib']:.2f} GiB (process so far); planted {r['planted_images']:,}, not grouped "
              f"{r['planted_not_grouped']} (of a sample of 20 of those, lost: {len(r['lost'])})")
    print(f"growth for 10x the images: {results[1]['wall_s'] / results[0]['wall_s']:.1f}x wall")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
