"""Bucketed batches of one Shar shard (`mmtok.formats.shar` finds the shards, fingerprints them and
indexes their recording tars; `mmtok.ranks.assign_shards` says which rank takes which shard).

Guarantee: `make_batches` is a deterministic function of one shard's cuts and the batching parameters
  (lhotse DynamicBucketingSampler, fixed seed, world size 1), so batch k of a part is the same
  on every run; this is what lets a killed part resume from its last committed batch.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from mmtok.errors import MmtokError


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
