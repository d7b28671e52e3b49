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


# -- members built byte by byte: the kinds Python's tarfile cannot write (GNU sparse, multi-volume) ----------
# Layouts as GNU tar 1.34 writes them (`tar --format=gnu -S`, `tar --format=posix --sparse-version=...`).

BLOCK = 512
GNU_MAGIC = b"ustar  \x00"
POSIX_MAGIC = b"ustar\x0000"


def _padded(data: bytes) -> bytes:
    return data + bytes(-len(data) % BLOCK)


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\x00" % (width - 1, value)


def header(name: bytes, size: int, flag: bytes, magic: bytes = POSIX_MAGIC,
           extra: dict[int, bytes] | None = None) -> bytes:
    """One checksummed header block; `extra` puts bytes at header offsets (a sparse map, a volume offset)."""
    block = bytearray(BLOCK)
    block[0:len(name)] = name
    block[100:108], block[108:116], block[116:124] = _octal(0o644, 8), _octal(0, 8), _octal(0, 8)
    block[124:136], block[136:148] = _octal(size, 12), _octal(1_700_000_000, 12)
    block[156:157] = flag
    block[257:265] = magic
    for at, value in (extra or {}).items():
        block[at:at + len(value)] = value
    block[148:156] = b" " * 8
    block[148:156] = b"%06o\x00 " % sum(block)
    return bytes(block)


def regular(name: str, data: bytes) -> bytes:
    """A plain ustar regular file member: header and padded data."""
    return header(name.encode("utf-8", "surrogateescape"), len(data), b"0") + _padded(data)


def pax_records(records: list[tuple[str, str]]) -> bytes:
    """pax extended-header records `"%d key=value\\n"` (the length counts itself); keys may repeat."""
    out = b""
    for key, value in records:
        body = f" {key}={value}\n".encode()
        length = len(body) + 1
        while len(str(length).encode()) + len(body) != length:
            length += 1
        out += str(length).encode() + body
    return out


def _sparse_chunks(chunks: list[tuple[int, bytes]]) -> bytes:
    return b"".join(data for _, data in chunks)


def old_gnu_sparse(name: str, chunks: list[tuple[int, bytes]], realsize: int) -> bytes:
    """An old-GNU sparse member (type `S`): (offset, data) chunks, the first 4 map entries in the header,
    the rest in extension blocks of 21 entries between the header and the data."""
    entries = [(_octal(offset, 12), _octal(len(data), 12)) for offset, data in chunks]
    extra = {483: _octal(realsize, 12)}
    for k, (offset, numbytes) in enumerate(entries[:4]):
        extra[386 + 24 * k], extra[398 + 24 * k] = offset, numbytes
    rest = entries[4:]
    extra[482] = b"\x01" if rest else b"\x00"
    stored = _sparse_chunks(chunks)
    out = header(name.encode(), len(stored), b"S", GNU_MAGIC, extra)
    while rest:
        block = bytearray(BLOCK)
        for k, (offset, numbytes) in enumerate(rest[:21]):
            block[24 * k:24 * k + 12], block[24 * k + 12:24 * k + 24] = offset, numbytes
        rest = rest[21:]
        block[504] = 1 if rest else 0
        out += bytes(block)
    return out + _padded(stored)


def pax_sparse(name: str, chunks: list[tuple[int, bytes]], realsize: int, version: str = "1.0") -> bytes:
    """A pax GNU sparse member (`--sparse-version` 0.0, 0.1 or 1.0): a pax header of GNU.sparse.* records,
    then a type `0` member (1.0: its data starts with the decimal sparse map, padded to a block)."""
    stored = _sparse_chunks(chunks)
    numbers = [str(n) for offset, data in chunks for n in (offset, len(data))]
    if version == "1.0":
        records = [("GNU.sparse.major", "1"), ("GNU.sparse.minor", "0"), ("GNU.sparse.name", name),
                   ("GNU.sparse.realsize", str(realsize))]
        stored = _padded("".join(f"{n}\n" for n in [str(len(chunks)), *numbers]).encode()) + stored
        member = f"./GNUSparseFile.0/{name}"
    elif version == "0.1":
        records = [("GNU.sparse.size", str(realsize)), ("GNU.sparse.numblocks", str(len(chunks))),
                   ("GNU.sparse.name", name), ("GNU.sparse.map", ",".join(numbers))]
        member = f"./GNUSparseFile.0/{name}"
    else:
        records = [("GNU.sparse.size", str(realsize)), ("GNU.sparse.numblocks", str(len(chunks)))]
        records += [(key, n) for pair in zip(numbers[::2], numbers[1::2], strict=True)
                    for key, n in zip(("GNU.sparse.offset", "GNU.sparse.numbytes"), pair, strict=True)]
        member = name
    pax = pax_records(records)
    return (header(b"./PaxHeaders.0/" + name.encode(), len(pax), b"x") + _padded(pax)
            + header(member.encode(), len(stored), b"0") + _padded(stored))


def multi_volume(name: str, data: bytes, offset: int) -> bytes:
    """A GNU multi-volume continuation (type `M`): the last bytes of a file begun in the previous volume."""
    return header(name.encode(), len(data), b"M", GNU_MAGIC, {369: _octal(offset, 12)}) + _padded(data)


def archive(*members: bytes) -> bytes:
    """Members followed by the end-of-archive blocks, padded to a 10 KiB record like tar writes."""
    data = b"".join(members) + bytes(2 * BLOCK)
    return data + bytes(-len(data) % (20 * BLOCK))
