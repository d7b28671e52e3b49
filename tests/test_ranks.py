"""mmtok.ranks: balance splits for corpora with few images per rank, where nearest-target splits miss."""

from __future__ import annotations

import numpy as np
import pytest

from mmtok import ranks
from mmtok.ranks import balance_splits, imbalance, partition_ranks, rank_costs, split_costs

OVERHEAD = 4096.0  # the analytic default per-batch cost: about four 512x512 images


def _clumped_batches(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Shape-sorted batches as a small caption corpus gives them: full batches of common shapes,
    and runs of one- to three-image batches of rare shapes next to each other."""
    rng = np.random.default_rng(seed)
    costs, counts = [], []
    for _ in range(120):
        per_image = float(rng.uniform(320, 1110))
        for _ in range(int(rng.integers(1, 4))):
            n = 128 if rng.random() < 0.7 else int(rng.integers(20, 128))
            costs.append(n * per_image + OVERHEAD)
            counts.append(n)
        for _ in range(int(rng.integers(0, 12))):  # a clump of rare shapes
            n = int(rng.integers(1, 4))
            costs.append(n * float(rng.uniform(320, 1110)) + OVERHEAD)
            counts.append(n)
    return np.array(costs), np.array(counts)


def _split_imbalance(costs, counts, world_size, splits) -> float:
    pieces = split_costs(costs, counts, OVERHEAD, splits)
    return imbalance(rank_costs(pieces, partition_ranks(pieces, world_size)))


def test_search_balances_where_nearest_target_splits_leave_gaps(monkeypatch):
    costs, counts = _clumped_batches()
    world_size = int(counts.sum()) // 250  # ~250 images a rank: a 200,000-image corpus on 800 ranks
    found = balance_splits(costs, counts, OVERHEAD, world_size)
    assert _split_imbalance(costs, counts, world_size, found) <= 0.005
    monkeypatch.setattr(ranks, "SEARCH_ABOVE", float("inf"))  # nearest-target splits only
    nearest = balance_splits(costs, counts, OVERHEAD, world_size)
    assert _split_imbalance(costs, counts, world_size, nearest) > 0.005


def test_searched_splits_are_valid_and_deterministic():
    costs, counts = _clumped_batches(seed=1)
    world_size = int(counts.sum()) // 250
    found = balance_splits(costs, counts, OVERHEAD, world_size)
    assert found == balance_splits(costs.copy(), counts.copy(), OVERHEAD, world_size)
    assert found == sorted(found) and len(set(found)) == len(found)
    assert all(0 < at < counts[batch] for batch, at in found)
    pieces = split_costs(costs, counts, OVERHEAD, found)
    assert len(pieces) == len(costs) + len(found)
    assert pieces.sum() == pytest.approx(costs.sum() + len(found) * OVERHEAD)


def test_no_split_beats_splits_that_cannot_help():
    costs, counts = np.full(8, 128 * 1000.0 + OVERHEAD), np.full(8, 128)
    assert balance_splits(costs, counts, OVERHEAD, 4) == []  # 2 whole batches a rank: exact already
    assert balance_splits(costs, counts, OVERHEAD, 1) == []
