"""Shar shards as encode input: discovery, rank assignment, bucketed batches, and member byte ranges.

Guarantees:
* `assign_shards` depends only on the shard durations and the world size: largest shard first to
  the least-loaded rank (ties: lower shard index first, then lower rank), so every rank computes
  the same assignment without talking to the others.
* `make_batches` is a deterministic function of one shard's cuts and the batching parameters
  (lhotse DynamicBucketingSampler, fixed seed, world size 1), so batch k of a part is the same
  on every run; this is what lets a killed part resume from its last committed batch.
"""

from __future__ import annotations

import gzip
import heapq
import json
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path

from mmtok.audio.convert import REPORT, SHAR_DIR, manifest_sha256, shard_files
from mmtok.errors import MmtokError


@dataclass(frozen=True)
class Shard:
    index: int
    cuts_path: Path
    recording_path: Path
    duration: float
    num_cuts: int


@dataclass(frozen=True)
class Batching:
    """Parameters of the bucketing sampler (recorded in every part's identity)."""

    max_duration: float = 300.0
    num_buckets: int = 50
    seed: int = 0
    # Longer clips are skipped (`too_long`), not encoded: the sampler yields such a clip alone, and
    # the encoder's activations grow with its length (a 2-hour clip needs ~22 GB), so this bounds a
    # batch's memory by max(max_duration, max_clip_duration) seconds of audio.
    max_clip_duration: float = 600.0

    def to_dict(self) -> dict:
        import lhotse

        return {"sampler": "lhotse.dataset.DynamicBucketingSampler", "lhotse": lhotse.__version__,
                "max_duration": self.max_duration, "num_buckets": self.num_buckets, "seed": self.seed,
                "max_clip_duration": self.max_clip_duration}


def shar_location(path: Path) -> tuple[Path, dict | None]:
    """(Shar directory, conversion report or None) for a `mmtok audio convert` output or a bare Shar dir."""
    report_path = path / REPORT
    if report_path.is_file() and (path / SHAR_DIR).is_dir():
        report = json.loads(report_path.read_text("utf-8"))
        if not report.get("complete"):
            raise MmtokError(f"{report_path}: the conversion is not complete; rerun `mmtok audio convert` with the "
                             "same arguments to finish it before encoding")
        return path / SHAR_DIR, report
    if not any(path.glob("cuts.*.jsonl.gz")):
        raise MmtokError(f"{path}: no Shar shards (cuts.NNNNNN.jsonl.gz); pass the --out of `mmtok audio convert` "
                         "or a Lhotse Shar directory")
    return path, None


def discover_shards(path: Path) -> tuple[list[Shard], dict | None]:
    """Every shard 0..n-1 of a Shar directory with its total duration (from the conversion report when
    there is one, else summed from the cuts manifests)."""
    shar, report = shar_location(path)
    indices = sorted(int(p.name.split(".")[1]) for p in shar.glob("cuts.*.jsonl.gz"))
    if indices != list(range(len(indices))):
        missing = sorted(set(range(max(indices) + 1)) - set(indices))
        raise MmtokError(f"{shar}: shard indices must be 0..n-1; missing {missing[:10]}")
    recorded = {s["index"]: s for s in report["shards"]} if report else {}
    shards = []
    for index in indices:
        cuts_name, recording_name = shard_files(index)
        if not (shar / recording_name).is_file():
            raise MmtokError(f"{shar / recording_name}: missing (every Shar shard needs its recording tar)")
        if index in recorded:
            duration, count = recorded[index]["duration"], recorded[index]["cuts"]
        else:
            durations = [c["duration"] for c in read_cut_dicts(shar / cuts_name)]
            duration, count = sum(durations), len(durations)
        shards.append(Shard(index, shar / cuts_name, shar / recording_name, float(duration), int(count)))
    return shards, report


def read_cut_dicts(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]


def shard_fingerprint(shard: Shard) -> dict:
    """What identifies a shard's content for resume checks: the decompressed cuts manifest's sha256
    (gzip headers carry a timestamp) and the recording tar's size."""
    return {"index": shard.index, "cuts_sha256": manifest_sha256(shard.cuts_path),
            "recording_bytes": shard.recording_path.stat().st_size, "cuts": shard.num_cuts}


def assign_shards(durations: list[float], world_size: int) -> list[list[int]]:
    """Shard indices per rank (each list ascending): longest-processing-time-first greedy."""
    if world_size < 1:
        raise MmtokError(f"world size must be at least 1, got {world_size}")
    loads = [(0.0, rank) for rank in range(world_size)]
    heapq.heapify(loads)
    assigned: list[list[int]] = [[] for _ in range(world_size)]
    for index in sorted(range(len(durations)), key=lambda i: (-durations[i], i)):
        load, rank = heapq.heappop(loads)
        assigned[rank].append(index)
        heapq.heappush(loads, (load + durations[index], rank))
    return [sorted(indices) for indices in assigned]


def make_batches(cuts, batching: Batching) -> list[list[int]]:
    """Positions (indices into `cuts`) of each batch, in sampler order."""
    from lhotse.dataset import DynamicBucketingSampler

    position = {cut.id: i for i, cut in enumerate(cuts)}
    if len(position) != len(cuts):
        raise MmtokError("duplicate cut ids in one shard; the shard is not a valid CutSet")
    if len(cuts) < 2:  # lhotse needs two cuts to estimate bucket bins
        return [[0]] if len(cuts) else []
    with warnings.catch_warnings():
        # eager CutSets and single cuts longer than max_duration (yielded alone) are both expected here
        warnings.simplefilter("ignore", UserWarning)
        for message in ("Mean of empty slice", "invalid value encountered"):  # its buffer heuristic, tiny shards
            warnings.filterwarnings("ignore", message, RuntimeWarning)
        sampler = DynamicBucketingSampler(
            cuts, max_duration=batching.max_duration, num_buckets=min(batching.num_buckets, len(cuts)),
            shuffle=False, drop_last=False, seed=batching.seed, world_size=1, rank=0,
            buffer_size=max(len(cuts), 1), num_cuts_for_bins_estimate=max(len(cuts), 1))
        batches = [[position[cut.id] for cut in batch] for batch in sampler]
    covered = sorted(p for batch in batches for p in batch)
    if covered != list(range(len(cuts))):
        raise MmtokError("the bucketing sampler did not return every cut of the shard exactly once")
    return batches


def index_members(recording_path: Path) -> dict[str, tuple[int, int]]:
    """cut id -> (data offset, size) of its audio member in a Shar recording tar (headers only)."""
    members = {}
    with tarfile.open(recording_path, "r:") as archive:
        for member in archive:
            name, _, ext = member.name.rpartition(".")
            if member.isfile() and ext in ("flac", "wav", "mp3", "opus", "ogg"):
                members[name] = (member.offset_data, member.size)
    return members
