"""`mmtok.formats.keys.KeyTable`: the compact index of the per-item stores' string keys."""

from __future__ import annotations

from mmtok.formats.keys import KeyTable, key_digest


def test_a_table_finds_each_key_keeps_the_chosen_repeat_and_counts_them():
    keys = ["t.tar\0a.0.jpg", "t.tar\0b.0.jpg", "t.tar\0a.0.jpg", "u.tar\0a.0.jpg", "t.tar\0a.0.jpg"]
    digests = b"".join(map(key_digest, keys))
    first, rows_first = KeyTable.of(digests, count=True)
    last, rows_last = KeyTable.of(digests, keep="last")
    assert len(first) == len(last) == 3
    for key, first_row, last_row in (("t.tar\0a.0.jpg", 0, 4), ("t.tar\0b.0.jpg", 1, 1), ("u.tar\0a.0.jpg", 3, 3)):
        assert rows_first[first.find(key)] == first_row and rows_last[last.find(key)] == last_row
    assert first.counts[first.find("t.tar\0a.0.jpg")] == 3
    assert first.find("t.tar\0c.0.jpg") == -1 and first.find("a.0.jpg") == -1


def test_an_empty_table_finds_nothing():
    table, rows = KeyTable.of(b"", count=True)
    assert len(table) == 0 and rows.size == 0 and table.find("t.tar\0a.0.jpg") == -1


def test_an_empty_table_keeps_no_last_repeat_either():
    # (sft over image parts that hold no image item -- templates only, or none -- built its index from nothing)
    table, rows = KeyTable.of(b"", keep="last")
    assert len(table) == 0 and rows.size == 0
