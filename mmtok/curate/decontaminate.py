"""Decontamination (`mmtok dedup --against BENCH`): the training images that match a benchmark image, by sample id.

A training image matches a benchmark image when their bytes are equal (always) or their pHashes are within its
source's radius (`decontaminate: r` in the policy, default `Guards.radius`; `off`: equal bytes only). An image that
matches several benchmark images is named with the nearest (then the first by benchmark name and manifest row).

Guards against false positives -- low-entropy domains (satellite tiles, document scans, flat medical images) match
unrelated images at small radii, and one bad match must never take a dataset with it:
* a benchmark image whose pHash matches more than `max_matches` training images is *suspect*: those matches are
  held back;
* a source more than `max_share` of whose hashed images (and at least `min_flagged`) match by pHash is *suspect*:
  every pHash match of that source is held back.
A byte copy of a benchmark image is certain: it is always dropped and counts towards neither guard.
Held matches are listed (OUT/held.parquet, with why), not dropped, unless `--confirm` names the benchmark item
(`BENCH:KEY`) or the source. Drops are decided image by image; nothing is ever dropped by dataset.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from mmtok.curate.search import pairs_across
from mmtok.errors import MmtokError

ITEM_SUSPECT = "benchmark_image_matches_many"  # why a match is held: its benchmark image matches too many images
SOURCE_SUSPECT = "source_share"  # why a match is held: its source has an unusually large share flagged


@dataclass(frozen=True)
class Guards:
    """The `decontamination:` mapping of a policy (every key optional)."""

    radius: int = 4  # pHash radius to benchmark images of a source without `decontaminate:`
    max_matches: int = 20  # a benchmark image matching more training images than this is suspect
    max_share: float = 0.01  # a source with a larger share of its images flagged is suspect...
    min_flagged: int = 20  # ...once at least this many are (a few hits in a small source are not a pattern)

    @classmethod
    def from_policy(cls, path: Path, entry: dict, max_radius: int, shown) -> Guards:
        """The guards of the policy's `decontamination:` mapping; MmtokError naming the key for anything else
        (values quoted through `shown`, which never expands a YAML alias bomb)."""
        known = {f.name: f.default for f in fields(cls)}
        unknown = [key for key in entry if key not in known]
        if unknown:
            raise MmtokError(f"{path}: `decontamination:` has no key {shown(unknown[0])} (known: "
                             f"{', '.join(sorted(known))})")
        for key, value in entry.items():
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            fits = number and (0 < value <= 1 if key == "max_share" else isinstance(value, int) and value >= 0
                               and (key != "radius" or value <= max_radius))
            if not fits:
                want = "a share in (0, 1]" if key == "max_share" else \
                    f"an integer 0..{max_radius}" if key == "radius" else "an integer >= 0"
                raise MmtokError(f"{path}: `decontamination: {key}` is {want}, got {shown(value)}")
        return cls(**entry)


@dataclass(frozen=True)
class Matches:
    """One entry per training image that matched a benchmark image, sorted by training index: the benchmark
    image (its index among the benchmarks' rows), the pHash distance, and why it is held back ("" = dropped)."""

    train: np.ndarray
    bench: np.ndarray
    distance: np.ndarray
    why: np.ndarray
    suspect_items: dict  # bench index -> training images it matches (over max_matches, not confirmed)
    suspect_sources: dict  # source index -> (flagged, hashed) (over the share, not confirmed)

    @property
    def dropped(self) -> np.ndarray:
        return self.why == ""


def sha_heads(sha: np.ndarray) -> np.ndarray:
    """The first 8 bytes of each sha256 (rows of 32 uint8) as uint64: equal heads propose equal digests."""
    return np.ascontiguousarray(sha[:, :8]).view(">u8").ravel().astype(np.uint64)


def match_pairs(phash: np.ndarray, sha: np.ndarray, radius: np.ndarray, bench_phash: np.ndarray,
                bench_sha: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every (training image, benchmark image, pHash distance, equal bytes) that matches: equal sha256, or pHashes
    within the training image's `radius` (-1: off). Each pair once, sorted."""
    train, bench, _ = pairs_across(sha_heads(sha), sha_heads(bench_sha), 0)  # equal heads, then full digests
    same = np.all(sha[train] == bench_sha[bench], axis=1)
    found = [(train[same], bench[same])]
    for r in sorted(set(radius.tolist()) - {-1}):
        chosen = np.flatnonzero(radius == r)
        t, b, _ = pairs_across(phash[chosen], bench_phash, int(r))
        found.append((chosen[t], b))
    train = np.concatenate([f[0] for f in found])
    bench = np.concatenate([f[1] for f in found])
    pairs = np.unique(np.stack([train, bench], axis=1), axis=0) if len(train) else np.zeros((0, 2), np.int64)
    train, bench = pairs[:, 0].astype(np.int64), pairs[:, 1].astype(np.int64)
    distance = np.bitwise_count(phash[train] ^ bench_phash[bench]).astype(np.int8)
    return train, bench, distance, np.all(sha[train] == bench_sha[bench], axis=1)


def choose(train: np.ndarray, bench: np.ndarray, distance: np.ndarray, same: np.ndarray, source_of: np.ndarray,
           hashed: np.ndarray, guards: Guards, confirmed_items: set[int], confirmed_sources: set[int]) -> Matches:
    """One match per training image from all pairs, with the guards applied (see the module docstring). A byte
    copy of a benchmark image is certain: it is never held back, and never counts towards a guard."""
    near = bench[~same]
    matched = np.bincount(near) if len(near) else np.zeros(0, np.int64)  # distinct training images per image
    suspect = {int(b): int(matched[b]) for b in np.flatnonzero(matched > guards.max_matches)
               if int(b) not in confirmed_items}
    trusted = same | ~np.isin(bench, list(suspect))
    # each image's best match: trusted first, then byte copies, then the nearest (lexsort: the last key sorts first)
    order = np.lexsort((bench, distance, ~same, ~trusted, train))
    first = order[np.concatenate([[True], train[order][1:] != train[order][:-1]])] if len(order) else order
    why = np.where(trusted[first], "", ITEM_SUSPECT).astype(object)
    images, by_phash = train[first], ~same[first]
    flagged = np.bincount(source_of[images[(why == "") & by_phash]], minlength=len(hashed))
    unusual = (flagged > guards.max_share * hashed) & (flagged >= max(guards.min_flagged, 1))
    sources = {int(s): (int(flagged[s]), int(hashed[s])) for s in np.flatnonzero(unusual)
               if int(s) not in confirmed_sources}
    why[(why == "") & by_phash & np.isin(source_of[images], list(sources))] = SOURCE_SUSPECT
    return Matches(images, bench[first], distance[first], why, suspect, sources)
