"""Who does what: the one owner of how work is split over N ranks that never communicate.

Two policies, one per kind of work, each a pure function of (the work's sizes, N), so every rank
computes the same split on its own:
* image batches of a plan: contiguous, cost-balanced batch ranges (`partition_ranks`, below), and work
  items, contiguous batch ranges of a target cost whose number does not depend on N (`item_ranges`);
* Shar shards of an audio encode: whole shards, longest first to the least-loaded rank (`assign_shards`).
`mmtok sft` cuts its conversations into work items too (`mmtok.sft.build.work_items`) and gives worker w
of W its first items by `worker_items`.

Image batch ranges:

Every batch boundary is a legal cut (a document of several images is assembled by merge, so its
images may sit on any ranks). The ranges minimise the largest rank cost (the job's wall time) over
every contiguous partition, then place each cut as close to its even-split target k/N of the total as
that optimum allows, so ranks stay evenly loaded rather than the last ones idling. Only (costs, N)
matter: the planner (`mmtok.plan`) and a reader re-deriving the ranges for another world size
(`mmtok.formats.plan.Plan.rank_range`) both call these functions and get the same ranges.

`balance_splits` says where the planner should split batches so that a small corpus still balances:
with few batches per rank the nearest batch boundary can be far from k/N; splitting the batch that
holds each target at the image nearest to it bounds every rank's error by about half an image.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left, bisect_right

import numpy as np

from mmtok.errors import MmtokError

_BISECTIONS = 64  # enough to pin the bottleneck to ~1e-9 of the mean rank cost
SEARCH_ABOVE = 0.005  # imbalance of the nearest-target splits above which `_searched_splits` runs
MAX_SEARCH_IMAGES = 5_000_000  # it holds a float per image; corpora this large balance without it
_SEARCH_BISECTIONS = 5  # below the target, a few halvings of the bound are enough
_BELOW = 10.0  # a rank may fall this many slacks below the mean (only the largest rank matters)
_ANCHOR = 0.05  # reachable cuts stay this share of the mean (times sqrt(k)) near their even share



def partition_ranks(costs: np.ndarray, world_size: int) -> np.ndarray:
    """[start, end) batch ranges, shape [world_size, 2], covering 0..len(costs) in order.

    The largest range cost is the minimum possible (up to 1e-9 relative); ranks left without work
    get empty ranges.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    n = len(costs)
    ranges = np.zeros((world_size, 2), np.int64)
    if n == 0:
        return ranges
    at = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])
    cuts = _nearest_cuts(at, world_size)
    worst = float(np.max(np.diff(at[np.concatenate([[0], cuts, [len(at) - 1]])])))
    floor = max(float(at[-1]) / world_size, float(np.max(np.diff(at))))
    if worst > floor * (1 + 1e-9):
        cuts = _balanced_cuts(at.tolist(), world_size, _bottleneck(at.tolist(), world_size, floor, worst), cuts)
    bounds = np.concatenate([[0], cuts, [n]])
    ranges[:, 0], ranges[:, 1] = bounds[:-1], bounds[1:]
    return ranges


def balance_splits(costs: np.ndarray, counts: np.ndarray, overhead: float, world_size: int) -> list[tuple[int, int]]:
    """(batch, image position) of every split that brings a rank cut to its even-split target: the
    splits that give the lowest imbalance under `partition_ranks`, none when no split helps.

    `costs[i]` = counts[i] * per-image cost + `overhead` (one shape per batch); a piece of m images
    of that batch costs m * per-image cost + `overhead`. The targets are k/N of the total after the
    splits, which depends on how many are made: the split count is iterated to a fixed point, and
    every candidate is scored by the partition it gives. Deterministic in its inputs.

    Limit: a piece costs at least `overhead` + one image, so a target just after a batch start (or
    inside a run of one-image batches) cannot be reached closer than about half of that.
    """
    costs = np.asarray(costs, np.float64)
    counts = np.asarray(counts, np.int64)
    if world_size < 2 or not len(costs):
        return []
    def score(splits: list[tuple[int, int]]) -> float:
        pieces = split_costs(costs, counts, overhead, splits)
        return imbalance(rank_costs(pieces, partition_ranks(pieces, world_size)))

    best, best_imbalance = [], score([])
    assumed, tried = world_size - 1, set()
    while assumed not in tried:
        tried.add(assumed)
        splits = _target_splits(costs, counts, overhead, world_size, assumed)
        if (value := score(splits)) < best_imbalance:
            best, best_imbalance = splits, value
        assumed = len(splits)
    if best_imbalance > SEARCH_ABOVE and int(counts.sum()) <= MAX_SEARCH_IMAGES:
        searched = _searched_splits(costs, counts, overhead, world_size)
        if searched and score(searched) < best_imbalance:
            best = searched
    return best


def _searched_splits(costs: np.ndarray, counts: np.ndarray, overhead: float, world_size: int) -> list[tuple[int, int]]:
    """Cuts found by search where nearest-target splits miss: every cut is a batch start or a split
    after j images of a batch; for a bound on the largest rank cost (first 0.9 x the target, then a
    few halvings towards the best found), a forward pass
    keeps the cut positions reachable with every rank under it (and not far below the mean), then a
    backward pass picks, cut by cut, the reachable position whose next rank is nearest the mean.

    Positions q are in unsplit coordinates: a split after j images of batch b is at
    start_b + j * image_b and adds `overhead` to the rank it ends; a batch start adds nothing. So a
    rank from q to q' costs q' + (overhead if q' is a split) - q.
    """
    per_image = (costs - overhead) / np.maximum(counts, 1)
    start = np.concatenate([[0.0], np.cumsum(costs)[:-1]])
    inner = np.maximum(counts - 1, 0)
    split_batch = np.repeat(np.arange(len(costs)), inner)
    split_at = np.arange(len(split_batch)) - np.repeat(np.cumsum(inner) - inner, inner) + 1
    points = _CutPoints(np.concatenate([start[split_batch] + split_at * per_image[split_batch], start[1:]]),
                        np.concatenate([np.full(len(split_batch), overhead), np.zeros(len(costs) - 1)]))
    total = float(costs.sum())
    mean = (total + (world_size - 1) * overhead) / world_size
    low, high = 0.0, SEARCH_ABOVE * mean * 0.9  # only a partition under the target is worth its time
    found = points.reachable(world_size, mean, high, total)
    for _ in range(_SEARCH_BISECTIONS if found is not None else 0):
        middle = (low + high) / 2
        reach = points.reachable(world_size, mean, middle, total)
        if reach is None:
            low = middle
        else:
            high, found = middle, reach
    if found is None:
        return []
    chosen = points.walk_back(found, mean, high, total)
    return sorted((int(split_batch[i]), int(split_at[i])) for i in chosen if i < len(split_batch))


class _CutPoints:
    """Candidate cut positions (sorted by where a rank ending there ends) for `_searched_splits`."""

    def __init__(self, position: np.ndarray, added: np.ndarray):
        ends = position + added
        order = np.argsort(ends, kind="stable")
        self.order, self.ends, self.position = order, ends[order], position[order]
        self.mean_added = float(np.mean(added)) if len(added) else 0.0  # a cut's average overhead (drift guard)

    def reachable(self, world_size: int, mean: float, slack: float, total: float) -> list[np.ndarray] | None:
        """Per cut 1..N-1 the sorted candidate indices reachable with every rank in
        [mean - BELOW * slack, mean + slack] and within ANCHOR * mean of its even share; None when
        the last rank cannot also fit."""
        low = np.array([0.0])
        high = np.array([0.0])
        steps = []
        for k in range(1, world_size):
            found = self._within(low + mean - _BELOW * slack, high + mean + slack)
            share = k * (mean - self.mean_added)  # where cut k lies when every cut adds the average overhead
            found = found[np.abs(self.position[found] - share) <= _ANCHOR * mean * max(1, k) ** 0.5]
            if not len(found):
                return None
            found = found[np.argsort(self.position[found], kind="stable")]
            steps.append(found)
            position = self.position[found]
            breaks = np.flatnonzero(np.diff(position) > (1 + _BELOW) * slack)
            low = position[np.concatenate([[0], breaks + 1])]
            high = position[np.concatenate([breaks, [len(position) - 1]])]
        last = total - self.position[steps[-1]]
        if not np.any((last >= mean - _BELOW * slack) & (last <= mean + slack)):
            return None
        return steps

    def _within(self, low: np.ndarray, high: np.ndarray) -> np.ndarray:
        """Indices of candidates whose end lies in any [low_i, high_i]."""
        first = np.searchsorted(self.ends, low, "left")
        stop = np.searchsorted(self.ends, high, "right")
        size = np.maximum(stop - first, 0)
        return np.unique(np.repeat(first - np.cumsum(size) + size, size) + np.arange(int(size.sum())))

    def walk_back(self, steps: list[np.ndarray], mean: float, slack: float, total: float) -> list[int]:
        """Original candidate indices of the chosen cuts."""
        chosen = []
        following = total  # where the next rank ends
        for found in steps[::-1]:
            cost = following - self.position[found]
            fits = found[(cost >= mean - _BELOW * slack) & (cost <= mean + slack)]
            pick = fits[np.argmin(np.abs(following - self.position[fits] - mean))]
            chosen.append(int(self.order[pick]))
            following = float(self.ends[pick])
        return chosen


def _target_splits(costs: np.ndarray, counts: np.ndarray, overhead: float, world_size: int,
                   assumed: int) -> list[tuple[int, int]]:
    """Splits putting a boundary nearest each target k/N of (total + assumed splits' overheads)."""
    targets = (float(costs.sum()) + assumed * overhead) * np.arange(1, world_size) / world_size
    per_image = (costs - overhead) / np.maximum(counts, 1)
    splits: list[tuple[int, int]] = []
    begin, k = 0.0, 0  # cost before the current piece (splits so far included); next target
    for batch in range(len(costs)):
        taken, piece, image = 0, costs[batch], per_image[batch]  # images in earlier pieces; this piece's cost
        while k < len(targets) and targets[k] < begin + piece:
            target, k = targets[k], k + 1
            nearest = min(target - begin, begin + piece - target)
            left = counts[batch] - taken
            if left < 2 or image <= 0:
                continue
            first = int(min(max(np.rint((target - begin - overhead) / image), 1), left - 1))
            cut = begin + overhead + first * image
            if abs(cut - target) < nearest:  # nearer than the piece's ends
                splits.append((batch, taken + first))
                taken += first
                begin = cut
                piece = overhead + (counts[batch] - taken) * image
        begin += piece
    return splits


def split_costs(costs: np.ndarray, counts: np.ndarray, overhead: float, splits: list[tuple[int, int]]) -> np.ndarray:
    """Batch costs after `splits` (batch, image position; sorted), the pieces in order."""
    if not splits:
        return np.asarray(costs, np.float64)
    costs = np.asarray(costs, np.float64)
    per_image = (costs - overhead) / np.maximum(counts, 1)
    out, at = [], 0
    by_batch: dict[int, list[int]] = {}
    for batch, position in splits:
        by_batch.setdefault(batch, []).append(position)
    for batch, positions in sorted(by_batch.items()):
        out.append(costs[at:batch])
        edges = np.array([0, *positions, counts[batch]])
        out.append(np.diff(edges) * per_image[batch] + overhead)
        at = batch + 1
    out.append(costs[at:])
    return np.concatenate(out)


def item_ranges(costs: np.ndarray, target: float) -> np.ndarray:
    """Work items: contiguous [start, end) batch ranges of about `target` cost each, shape [items, 2].

    ceil(total / target) items (at least 1, at most one per batch), cut at the batch boundary nearest each
    k * total / items, so their costs are as even as whole batches allow. They depend on the batch costs and
    the target alone, never on how many workers will take them."""
    costs = np.asarray(costs, np.float64)
    if not len(costs):
        return np.zeros((0, 2), np.int64)
    at = np.concatenate([[0.0], np.cumsum(costs)])
    ratio = at[-1] / target
    count = len(costs) if not math.isfinite(ratio) or ratio >= len(costs) else max(math.ceil(ratio), 1)
    cuts = np.unique(np.concatenate([[0], _nearest_cuts(at, count), [len(costs)]]))
    return np.stack([cuts[:-1], cuts[1:]], axis=1).astype(np.int64)


def worker_items(item_costs: np.ndarray, workers: int) -> np.ndarray:
    """[start, end) item ranges of `workers` workers that share nothing: contiguous and cost-balanced
    (`partition_ranks` over the item costs); with no more items than workers, item w is worker w's."""
    n = len(item_costs)
    if n <= workers:
        w = np.arange(workers)
        return np.stack([np.minimum(w, n), np.minimum(w + 1, n)], axis=1).astype(np.int64)
    return partition_ranks(np.asarray(item_costs, np.float64), workers)


def worker_range(item_costs: np.ndarray, workers: int, worker: int) -> range:
    """The items worker `worker` of `workers` starts with (`worker_items`), as a range."""
    start, end = worker_items(item_costs, workers)[worker]
    return range(int(start), int(end))


def _nearest_cuts(at: np.ndarray, world_size: int) -> np.ndarray:
    """Index (into the batch boundaries) of the boundary nearest to each target k/N (ties: the earlier)."""
    targets = at[-1] * np.arange(1, world_size, dtype=np.float64) / world_size
    after = np.clip(np.searchsorted(at, targets), 1, len(at) - 1)
    cuts = np.where(targets - at[after - 1] <= at[after] - targets, after - 1, after)
    return np.maximum.accumulate(cuts) if len(cuts) else cuts


def _reach(at: list[float], start: int, limit: float) -> int:
    """The furthest boundary a rank starting at boundary `start` can end at within cost `limit`."""
    return bisect_right(at, at[start] + limit) - 1


def _fits(at: list[float], world_size: int, limit: float) -> bool:
    """Can world_size ranges of cost <= limit each cover everything? (greedy: each range maximal)"""
    position, last = 0, len(at) - 1
    for _ in range(world_size):
        position = _reach(at, position, limit)
        if position == last:
            return True
    return False


def _bottleneck(at: list[float], world_size: int, low: float, high: float) -> float:
    """Smallest feasible largest-range cost, by bisection between an infeasible-or-equal `low` and a
    feasible `high` (the nearest-cut partition's)."""
    if _fits(at, world_size, low):
        return low
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if _fits(at, world_size, middle):
            high = middle
        else:
            low = middle
        if high - low <= 1e-12 * high:
            break
    return high


def _balanced_cuts(at: list[float], world_size: int, limit: float, nearest: np.ndarray) -> np.ndarray:
    """Cuts with every range <= limit, each as close to its nearest-target cut as feasibility allows.

    Cut k may lie in [earliest_k, latest]: latest = the greedy reach from cut k-1; earliest_k = the
    first boundary from which the remaining N-k ranges can still cover the rest (computed from the
    right). Starting inside that interval keeps the rest feasible, so a forward pass suffices.
    """
    last = len(at) - 1
    earliest = [0] * (world_size + 1)
    earliest[world_size] = last
    for k in range(world_size - 1, 0, -1):
        earliest[k] = min(bisect_left(at, at[earliest[k + 1]] - limit), earliest[k + 1])
    cuts = np.zeros(world_size - 1, np.int64)
    previous = 0
    for k in range(1, world_size):
        latest = _reach(at, previous, limit)
        previous = min(max(int(nearest[k - 1]), earliest[k], previous), latest)
        cuts[k - 1] = previous
    return cuts


def rank_costs(costs: np.ndarray, ranges: np.ndarray) -> np.ndarray:
    """Summed cost of each rank's range."""
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])
    return prefix[ranges[:, 1]] - prefix[ranges[:, 0]]


def imbalance(per_rank: np.ndarray) -> float:
    """max / mean - 1 over all ranks (idle ones included); 0 for no work."""
    mean = float(np.mean(per_rank)) if len(per_rank) else 0.0
    return float(np.max(per_rank) / mean - 1.0) if mean > 0 else 0.0


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
