"""pairs_within (mmtok/curate/search.py) against an O(n^2) brute force, on planted near-duplicates and edge cases."""

from __future__ import annotations

import numpy as np
import pytest

from mmtok.curate import search
from mmtok.curate.search import _blocks, pairs_within


def brute_force_pairs(values: np.ndarray, radius: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every pair (i < j) within `radius`, by comparing all pairs (chunked so memory stays ~chunk * n)."""
    n = len(values)
    found_i, found_j, found_d = [], [], []
    columns = np.arange(n)
    for start in range(0, n, 256):
        rows = np.arange(start, min(n, start + 256))
        distance = np.bitwise_count(values[rows, None] ^ values[None, :])
        hit_r, hit_c = np.nonzero((distance <= radius) & (columns[None, :] > rows[:, None]))
        found_i.append(rows[hit_r])
        found_j.append(hit_c)
        found_d.append(distance[hit_r, hit_c])
    if not found_i:
        return np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0, np.uint8)
    i, j, d = (np.concatenate(part) for part in (found_i, found_j, found_d))
    order = np.lexsort((j, i))
    return i[order].astype(np.int64), j[order].astype(np.int64), d[order].astype(np.uint8)


def _random(rng: np.random.Generator, count: int) -> np.ndarray:
    return rng.integers(0, 2**64, size=count, dtype=np.uint64, endpoint=False)


def _flip(rng: np.random.Generator, value: np.uint64, bits: int) -> np.uint64:
    """`value` with exactly `bits` distinct random bits flipped."""
    mask = 0
    for bit in rng.choice(64, size=bits, replace=False):
        mask |= 1 << int(bit)
    return value ^ np.uint64(mask)


def _assert_same(got: tuple, expected: tuple) -> None:
    for g, e, dtype in zip(got, expected, (np.int64, np.int64, np.uint8), strict=True):
        assert g.dtype == dtype
        np.testing.assert_array_equal(g, e)


@pytest.mark.parametrize("radius", [1, 2, 4, 8])
def test_pairs_within_matches_brute_force_on_planted_near_duplicates(radius: int) -> None:
    rng = np.random.default_rng(0)
    values = list(_random(rng, 3000))
    planted = []  # (index a, index b, distance)
    for distance in range(radius + 2):
        for base in _random(rng, 4):
            planted.append((len(values), len(values) + 1, distance))
            values += [base, _flip(rng, base, distance)]
    cluster = _random(rng, 1)[0]  # one base with many variants within the radius: long runs of equal keys
    values += [cluster] + [_flip(rng, cluster, int(d)) for d in rng.integers(1, radius + 1, size=50)]
    values += [values[int(k)] for k in rng.integers(0, 3000, size=20)]  # exact repeats of random values
    values = np.array(values, dtype=np.uint64)
    # Shuffle so planted pairs are not adjacent and i < j is not the planting order.
    order = rng.permutation(len(values))
    values = values[order]
    where = np.argsort(order)

    got = pairs_within(values, radius)
    _assert_same(got, brute_force_pairs(values, radius))

    found = {(int(i), int(j)): int(d) for i, j, d in zip(*got, strict=True)}
    for a, b, distance in planted:
        pair = (min(where[a], where[b]), max(where[a], where[b]))
        if distance <= radius:
            assert found.get(pair) == distance, f"planted pair at distance {distance} missed"
        else:
            assert pair not in found, f"planted pair at distance {distance} > radius {radius} reported"


def _boundary_masks(widths: list[int], radius: int) -> list[int]:
    """Flip patterns that leave exactly len(widths) - radius blocks equal, or sit on edges of the 64 bits/blocks."""
    starts = np.cumsum([0] + widths[:-1]).tolist()
    lows = [1 << s for s in starts]  # lowest bit of each block
    highs = [1 << (s + w - 1) for s, w in zip(starts, widths, strict=True)]  # highest bit of each block
    masks = [1 << 63, 1, 1 | 1 << 63]
    for edge in (lows, highs):
        masks += [sum(edge[:radius]), sum(edge[-radius:]), sum(edge[1 : radius + 1]), sum(edge[::2][:radius])]
        masks += [edge[block] for block in range(len(widths))]
    masks += [lows[b] | highs[b] for b in range(len(widths))]  # two bits in one block, at both of its edges
    return [mask for mask in masks if 0 < bin(mask).count("1") <= radius]


@pytest.mark.parametrize("radius", [1, 2, 3, 4, 8])
def test_pairs_at_block_boundaries_are_found(radius: int) -> None:
    rng = np.random.default_rng(1)
    n = 600
    masks = _boundary_masks(_blocks(n, radius), radius)
    for base in (np.uint64(0), np.uint64(2**64 - 1), _random(rng, 1)[0]):
        values = np.concatenate([[base], base ^ np.array(masks, dtype=np.uint64), _random(rng, n - 1 - len(masks))])
        got = pairs_within(values, radius)
        _assert_same(got, brute_force_pairs(values, radius))
        found = set(zip(got[0].tolist(), got[1].tolist(), strict=True))
        assert all((0, 1 + k) in found for k in range(len(masks)))


@pytest.mark.parametrize("mix", [0, 1])
def test_colliding_hashed_keys_cost_time_not_exactness(monkeypatch: pytest.MonkeyPatch, mix: int) -> None:
    """Keys are hashed into the bits above the position; force collisions (0: every key collides, 1: keys that differ
    only in their low bits collide) and the result must not change."""
    rng = np.random.default_rng(2)
    base = _random(rng, 40)
    values = np.concatenate([base, [_flip(rng, v, int(d)) for v, d in zip(base, rng.integers(0, 4, 40), strict=True)]])
    monkeypatch.setattr(search, "_MIX", np.uint64(mix))
    _assert_same(pairs_within(values, 3), brute_force_pairs(values, 3))


def test_empty_and_single() -> None:
    for n in (0, 1):
        i, j, d = pairs_within(np.arange(n, dtype=np.uint64), 3)
        assert (len(i), len(j), len(d)) == (0, 0, 0)
        assert (i.dtype, j.dtype, d.dtype) == (np.int64, np.int64, np.uint8)


def test_all_identical_values_pair_at_distance_zero() -> None:
    values = np.full(200, 0xDEADBEEF12345678, dtype=np.uint64)
    i, j, d = pairs_within(values, 2)
    expected_i, expected_j = np.triu_indices(200, k=1)
    np.testing.assert_array_equal(i, expected_i)
    np.testing.assert_array_equal(j, expected_j)
    assert len(i) == 19900 and not d.any()


def test_radius_zero_is_plain_equality() -> None:
    values = np.array([5, 7, 5, 9, 7, 5], dtype=np.uint64)
    _assert_same(pairs_within(values, 0), brute_force_pairs(values, 0))


def test_rejects_other_dtypes_and_radii() -> None:
    with pytest.raises(TypeError):
        pairs_within(np.arange(4, dtype=np.int64), 1)
    with pytest.raises(ValueError):
        pairs_within(np.arange(4, dtype=np.uint64), 64)


@pytest.mark.parametrize("n", [0, 1, 100, 10**4, 10**6, 10**8])
@pytest.mark.parametrize("radius", range(1, 9))
def test_blocks_cover_64_bits_with_enough_blocks(n: int, radius: int) -> None:
    widths = _blocks(n, radius)
    assert sum(widths) == 64
    assert len(widths) >= radius + 1
    assert max(widths) - min(widths) <= 1


# -- pairs_across: training hashes against benchmark hashes ----------------------------------------------------------
@pytest.mark.parametrize("radius", [0, 1, 3, 4, 6, 8])
def test_pairs_across_matches_brute_force_with_planted_hits_at_every_distance(radius: int, monkeypatch) -> None:
    rng = np.random.default_rng(radius)
    queries = rng.integers(0, 2**64 - 1, 3000, dtype=np.uint64)
    references = rng.integers(0, 2**64 - 1, 400, dtype=np.uint64)
    for planted in range(120):  # hits at every distance 0..radius+2, some queries near several references
        value = references[planted % 400]
        for bit in rng.choice(64, planted % (radius + 3), replace=False):
            value ^= np.uint64(1 << int(bit))
        queries[rng.integers(0, 3000)] = value
    queries[5], references[7] = queries[6], references[8]  # repeated values on both sides
    monkeypatch.setattr(search, "QUERY_CHUNK", 1000)  # several chunks
    q, r, d = search.pairs_across(queries, references, radius)
    distance = np.bitwise_count(queries[:, None] ^ references[None, :])
    expected_q, expected_r = np.nonzero(distance <= radius)
    assert q.tolist() == expected_q.tolist() and r.tolist() == expected_r.tolist()  # each pair once, sorted
    assert (d == distance[expected_q, expected_r]).all() and len(q) >= 40


def test_pairs_across_with_an_empty_side_and_wrong_types() -> None:
    values = np.arange(5, dtype=np.uint64)
    assert all(len(a) == 0 for a in search.pairs_across(values, np.zeros(0, np.uint64), 3))
    assert all(len(a) == 0 for a in search.pairs_across(np.zeros(0, np.uint64), values, 3))
    with pytest.raises(TypeError):
        search.pairs_across(values.astype(np.int64), values, 2)
