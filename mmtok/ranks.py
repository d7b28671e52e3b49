"""Contiguous, cost-balanced batch ranges for N ranks that never communicate: the one rank-range rule.

A cut is legal where no document has images on both sides (`allowed_cuts`). The ranges minimise
the largest rank cost (the job's wall time) over every partition with legal cuts, then place each
cut as close to its even-split target k/N of the total as that optimum allows, so ranks stay evenly
loaded rather than the last ones idling. Only (costs, cut_ok, N) matter: the planner
(`mmtok.plan`) and a reader re-deriving the ranges for another world size
(`mmtok.formats.plan.Plan.rank_range`) both call these functions and get the same ranges.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

import numpy as np

_BISECTIONS = 64  # enough to pin the bottleneck to ~1e-9 of the mean rank cost


def allowed_cuts(first_batch: np.ndarray, last_batch: np.ndarray, num_batches: int, offset: int = 0) -> np.ndarray:
    """cut_ok[j] for j in 0..num_batches: may a rank start at batch offset + j, i.e. does no document
    (given by its first and last batch) have images both before it and from it on."""
    span = first_batch < last_batch
    opened = np.bincount(first_batch[span] - offset + 1, minlength=num_batches + 1)
    closed = np.bincount(last_batch[span] - offset + 1, minlength=num_batches + 1)
    return np.cumsum(opened[:num_batches + 1] - closed[:num_batches + 1]) == 0


def partition_ranks(costs: np.ndarray, cut_ok: np.ndarray, world_size: int) -> np.ndarray:
    """[start, end) batch ranges, shape [world_size, 2], covering 0..len(costs) in order.

    `cut_ok[j]` (length len(costs) + 1; both ends must be True) says whether a rank may start at
    batch j. The largest range cost is the minimum possible under those cuts (up to 1e-9 relative);
    ranks past the work get empty ranges.
    """
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    n = len(costs)
    ranges = np.zeros((world_size, 2), np.int64)
    if n == 0:
        return ranges
    prefix = np.concatenate([[0.0], np.cumsum(costs, dtype=np.float64)])
    allowed = np.flatnonzero(cut_ok)
    at = prefix[allowed]
    cuts = _nearest_cuts(at, world_size)
    worst = float(np.max(np.diff(at[np.concatenate([[0], cuts, [len(at) - 1]])])))
    floor = max(float(at[-1]) / world_size, float(np.max(np.diff(at))))
    if worst > floor * (1 + 1e-9):
        cuts = _balanced_cuts(at.tolist(), world_size, _bottleneck(at.tolist(), world_size, floor, worst), cuts)
    bounds = np.concatenate([[0], allowed[cuts], [n]])
    ranges[:, 0], ranges[:, 1] = bounds[:-1], bounds[1:]
    return ranges


def _nearest_cuts(at: np.ndarray, world_size: int) -> np.ndarray:
    """Index (into the legal cuts) of the legal cut nearest to each target k/N (ties: the earlier)."""
    targets = at[-1] * np.arange(1, world_size, dtype=np.float64) / world_size
    after = np.clip(np.searchsorted(at, targets), 1, len(at) - 1)
    cuts = np.where(targets - at[after - 1] <= at[after] - targets, after - 1, after)
    return np.maximum.accumulate(cuts) if len(cuts) else cuts


def _reach(at: list[float], start: int, limit: float) -> int:
    """The furthest legal cut a rank starting at legal cut `start` can end at within cost `limit`."""
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
    first legal cut from which the remaining N-k ranges can still cover the rest (computed from the
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
