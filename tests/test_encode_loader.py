"""The loaders' host ring: the bound on prefetched bytes."""

from __future__ import annotations

import random
import threading

from mmtok.encode.loader import HostRing


def test_host_ring_hands_out_disjoint_regions_in_order():
    ring = HostRing(100, pin=False)
    stop = threading.Event()
    rng = random.Random(0)
    live: list[tuple[int, int]] = []
    for _ in range(2000):
        size = rng.randint(1, 60)
        # release the oldest regions until the new one fits, as the device loop would
        while (region := ring._fit(size)) is None:
            ring.release()
            live.pop(0)
        tensor = ring.acquire(size, stop)
        start = tensor.data_ptr() - ring._arena.data_ptr()
        assert tensor.numel() == size and start == region and start + size <= 100
        assert all(start + size <= a or b <= start for a, b in live), (start, size, live)
        live.append((start, start + size))
