"""String keys of the per-item stores (image items by tar member, audio clips by cut id) looked up in 16 bytes a
key: the readers of 10^8 media keep NumPy columns, not a Python dict of strings (a few hundred bytes an entry).

A key is the 128-bit blake2b of its UTF-8 text (`key_digest`): two different keys share a digest with a
probability of about n^2 / 2^129 (10^-22 for 10^8 keys), far below any storage error rate, so a digest stands
for its key. `KeyTable` sorts the digests once and finds a key by binary search.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

DIGEST_BYTES = 16
_HALVES = struct.Struct("<QQ")  # a digest as the two little-endian uint64 columns KeyTable sorts by


def key_digest(text: str) -> bytes:
    """The 16-byte digest that stands for `text` in a `KeyTable`."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=DIGEST_BYTES).digest()


class KeyTable:
    """Distinct keys, sorted by digest; `find` gives a key's position among them. `counts[i]` (when asked for):
    how many times the i-th key occurred."""

    def __init__(self, high: np.ndarray, low: np.ndarray, counts: np.ndarray | None):
        self._high, self._low, self.counts = high, low, counts

    @classmethod
    def of(cls, digests: bytes | bytearray, keep: str = "first", count: bool = False) -> tuple[KeyTable, np.ndarray]:
        """(the table of the distinct keys of `digests` -- `key_digest`s concatenated in read order --, for each
        of its keys the read-order position of the occurrence kept: the first, or the last with `keep="last"`,
        where a later record of one key replaces the earlier). The caller orders its own columns by the second."""
        halves = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
        order = np.lexsort((halves[:, 1], halves[:, 0]))  # stable: equal keys keep read order
        high, low = halves[order, 0], halves[order, 1]
        new = np.concatenate(([True], (high[1:] != high[:-1]) | (low[1:] != low[:-1])))[:order.size]  # none: none
        starts = np.flatnonzero(new)
        ends = np.append(starts[1:], order.size) if starts.size else starts  # (no key: no end either)
        counts = (ends - starts).astype(np.int32) if count else None
        return cls(high[starts], low[starts], counts), order[starts if keep == "first" else ends - 1]

    def __len__(self) -> int:
        return self._high.size

    def halves(self) -> tuple[np.ndarray, np.ndarray]:
        """The sorted digests' two 64-bit halves (what `KeyTable(high, low, counts)` takes back)."""
        return self._high, self._low

    @property
    def nbytes(self) -> int:
        """Bytes the table keeps: the sorted digests and the counts."""
        return self._high.nbytes + self._low.nbytes + (0 if self.counts is None else self.counts.nbytes)

    def find(self, text: str) -> int:
        """The position of key `text` among the distinct sorted keys, or -1 when it is not in the table."""
        high, low = (np.uint64(half) for half in _HALVES.unpack(key_digest(text)))
        position = int(np.searchsorted(self._high, high))
        while position < self._high.size and self._high[position] == high:  # one row but for 2^-64 chances
            if self._low[position] == low:
                return position
            position += 1
        return -1


def repeated_positions(digests: bytes | bytearray) -> np.ndarray:
    """Positions of the `key_digest`s (concatenated) equal to an earlier one, unsorted. One stable sort on the
    first half finds the few digests that share it; only those are sorted on both halves (and position) --
    faster than `KeyTable.of` when few repeat, the common case."""
    keys = np.frombuffer(digests, dtype="<u8").reshape(-1, 2)
    order = np.argsort(keys[:, 0], kind="stable")
    same = keys[order[1:], 0] == keys[order[:-1], 0]
    shared = np.zeros(len(order), bool)
    shared[1:] |= same
    shared[:-1] |= same
    candidates = order[shared]
    ranked = candidates[np.lexsort((candidates, keys[candidates, 1], keys[candidates, 0]))]
    equal = np.all(keys[ranked[1:]] == keys[ranked[:-1]], axis=1)
    return ranked[1:][equal]
