"""Tar surgery for the tests that plant damage in a header."""

from __future__ import annotations

SIZE_FIELD = slice(124, 136)
TYPE_FLAG = slice(156, 157)


def with_header_field(data: bytes, header: int, field: slice, value: bytes) -> bytes:
    """`data` with `field` of the header at byte `header` replaced by `value` and its checksum redone."""
    block = bytearray(data[header:header + 512])
    block[field] = value
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block)
    return data[:header] + bytes(block) + data[header + 512:]
