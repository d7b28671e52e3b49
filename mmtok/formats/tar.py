"""Walk a tar file's headers from byte offsets: ustar, GNU (long names `L`/`K`), pax (`x`/`g`).
Members whose data is not the file's bytes (GNU sparse, multi-volume) are walked past and refused.

The one tar member reader of mmtok: the scan drives `TarWalker` itself (it parses image heads from
the walk's read window); every other stage reads a tar with `read_members` and `read_tar_member`, so a
member kind, a damaged header or a truncation gets the same named reason in every stage.

Why not `tarfile`: it reads each header through a file object, builds a TarInfo per member and
cannot report where damage starts without raising; the scan needs ~1 us per header and every
member before the damage. `TarWalker` does one `os.pread` per header (a window that also holds
the first bytes of the member's data) and verifies header checksums in vectorized batches: members
are yielded optimistically and the caller re-walks up to the first bad header when one is found.
"""

from __future__ import annotations

import os
import struct
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np

from mmtok.formats.containers import ShortRead

BLOCK = 512
CHECK_BATCH = 4096  # headers verified together (bounds the memory held for verification)
RESYNC_CHUNK = 1 << 20
MAX_NAME_BYTES = 1 << 16  # a GNU long name or pax header larger than this is treated as corrupt
MAX_SIZE = (1 << 63) - 1  # off_t's limit, as in GNU tar; also what the manifest's int64 columns hold

# Member kinds yielded by TarWalker.members. BAD_SIZE: the pax `size` record is unusable and the
# walk went on with the ustar size field (as GNU tar does), so neither size can be trusted.
# UNSUPPORTED: a file whose bytes are not its data read by byte range -- GNU sparse (old-GNU `S`, pax
# GNU.sparse.* records: the data is a map plus the non-hole chunks) or a multi-volume continuation (`M`:
# the tail of a file begun in another volume); never decoded, whatever its name says.
REGULAR, TRUNCATED, SPECIAL, BAD_SIZE, UNSUPPORTED = 0, 1, 2, 3, 4

# How a walk ended (TarWalker.end_reason); "" is a clean end-of-archive block.
TRUNCATED_TAR = "truncated_tar"
CORRUPT_HEADER = "corrupt_header"
BAD_MEMBER_SIZE = "bad_member_size"  # a header with a valid checksum but no usable size

# The reason each member kind other than REGULAR is refused (not read by byte range), in every stage.
KIND_REASONS = {TRUNCATED: "truncated_member", SPECIAL: "not_a_regular_file", BAD_SIZE: BAD_MEMBER_SIZE,
                UNSUPPORTED: "unsupported_member"}
NON_UTF8_NAME = "non_utf8_name"
READ_WINDOW = 4 * BLOCK  # read_members needs headers only: a small window per member

# Stream magics of compressed tars (`tar czf` and friends), with the command that undoes each.
_COMPRESSIONS = ((b"\x1f\x8b", "gzip", "gunzip"), (b"BZh", "bzip2", "bunzip2"), (b"\xfd7zXZ\x00", "xz", "unxz"),
                 (b"\x28\xb5\x2f\xfd", "zstd", "unzstd"), (b"\x04\x22\x4d\x18", "lz4", "unlz4"))

_ZERO_BLOCK = bytes(BLOCK)
_REGULAR_TYPES = frozenset(b"07\x00")
_UNSUPPORTED_TYPES = frozenset(b"SM")  # old-GNU sparse, GNU multi-volume continuation
_SPARSE_PAX = b"GNU.sparse."  # pax records of a GNU sparse member (formats 0.0, 0.1, 1.0)
_SPARSE_EXTENDED = 482  # old-GNU header byte: the sparse map goes on in extension blocks after the header
_EXTENSION_EXTENDED = 504  # the same flag in an extension block
MAX_SPARSE_EXTENSIONS = 1 << 16  # a longer chain of extension blocks is treated as a corrupt header
_POSIX_MAGIC = b"ustar\x0000"
# Name (100 bytes), size (12), type flag, magic (8) and the first byte of the ustar prefix.
_HEADER_FIELDS = struct.Struct("100s24x12s20xB100x8s80xB").unpack_from


class _BadHeader(Exception):
    """A header that cannot be parsed; the walk stops there."""


class TarWalker:
    """Reads one tar file by offsets. Counts every byte it requests (`bytes_read`, `reads`)."""

    def __init__(self, fd: int, file_size: int, window: int):
        self.fd, self.file_size, self.window = fd, file_size, window
        self.bytes_read = 0
        self.reads = 0
        self.end_reason = ""
        self.end_offset = 0
        self.bad_offset: int | None = None  # first header that failed its checksum or parse
        self.bad_name = b""  # the member at bad_offset when end_reason is BAD_MEMBER_SIZE
        self.bad_detail = ""  # its size fields, as found
        self.verified = 0  # members whose data starts at or before this offset have checked headers
        self._buf, self._base = b"", 0

    def read(self, offset: int, n: int) -> bytes:
        """Bytes [offset, offset+n) of the file (fewer at its end), counted."""
        self.reads += 1
        data = os.pread(self.fd, n, offset)
        self.bytes_read += len(data)
        return data

    def head(self, offset: int, n: int) -> bytes:
        """The n bytes at `offset`, taken from the current window where it holds them.

        When the window holds only their start, just the rest is read. The window itself is left
        alone: the next header lies past the member's data, outside what this call reads.
        """
        buf, base = self._buf, self._base
        i = offset - base
        if 0 <= i and i + n <= len(buf):
            return buf[i:i + n]
        end = base + len(buf)
        if base <= offset < end:
            return buf[i:] + self.read(end, offset + n - end)
        return self.read(offset, n)

    # One function on purpose: this is the scan's per-member hot loop (about 620,000 GNU members per CPU-second).
    # Metadata headers and what they say are split out (`_metadata`, `_Pending.apply`); each further call per member
    # costs a few percent of the walk (benchmarks/RESULTS.md, "Tar header walk").
    def members(self, start: int = 0, stop: int | None = None) -> Iterator[tuple[bytes, int, int, int, bytes, int]]:
        """Yield (raw name, kind, data offset, size, window, at) for each member from the header at `start`.

        `window[at:]` is what the last read holds of the member's data (empty when `at` is past its
        end): the caller parses a member's head there, without a copy, before taking the next member.

        Stops before `stop`, at the end-of-archive block, at the end of the file (`end_reason`
        "truncated_tar" unless a zero block was seen), after a TRUNCATED member, or at an unusable
        header (`bad_offset`; `end_reason` "bad_member_size" when its checksum holds but it gives no
        size in [0, MAX_SIZE], since the next header cannot be located). Directories and metadata
        headers are consumed, not yielded.
        Members past a header with a bad checksum may have been yielded: when `bad_offset` is set
        afterwards, walk again with `stop=bad_offset`.
        """
        self.end_reason, self.end_offset, self.bad_offset, self.bad_name, self.bad_detail = "", start, None, b"", ""
        self.verified = start
        headers: list[bytes] = []
        offsets: list[int] = []
        unchecked = CHECK_BATCH
        pos, file_size, window, limit = start, self.file_size, self.window, stop if stop is not None else 1 << 62
        fd, pread = self.fd, os.pread
        pending = _Pending()
        buf, base, end = self._buf, self._base, self._base + len(self._buf)
        reads = requested = 0  # added to self.reads and self.bytes_read once, when the walk ends
        try:
            while pos < limit:
                if pos < base or pos + BLOCK > end:
                    if pos + BLOCK > file_size:
                        self.end_reason, self.end_offset = TRUNCATED_TAR, pos
                        break
                    buf = self._buf = pread(fd, window, pos)  # one read per member: header and head
                    reads += 1
                    requested += len(buf)
                    base = self._base = pos
                    end = pos + len(buf)
                i = pos - base
                # The fields the walk needs, in one call; the checksum of the whole block is
                # verified later, in batches.
                name, size_field, flag, magic, has_prefix = _HEADER_FIELDS(buf, i)
                name = name.partition(b"\x00")[0]
                if not name and buf[i:i + BLOCK] == _ZERO_BLOCK:
                    self.end_offset = pos
                    break
                headers.append(buf[i:i + BLOCK])
                offsets.append(pos)
                try:
                    size = int(size_field.rstrip(b"\x00"), 8)
                except ValueError:
                    size = _parse_size(size_field)
                if size is not None and not 0 <= size <= MAX_SIZE:
                    size = None  # a pax `size` record may still give it
                if has_prefix and magic == _POSIX_MAGIC:
                    name = buf[i + 345:i + 500].split(b"\x00", 1)[0] + b"/" + name
                unchecked -= 1
                if not unchecked:
                    if self._fail(headers, offsets, _first_bad_checksum(headers)):
                        return
                    headers, offsets, unchecked = [], [], CHECK_BATCH
                    self.verified = pos + BLOCK  # the header at `pos` was in the batch
                data = pos + BLOCK
                if flag in _REGULAR_TYPES:
                    kind = REGULAR
                elif flag in b"LKxg" or flag == 0x35:  # metadata of the next member, or a directory
                    if size is None:
                        self._bad_size(headers, offsets, name, f"size field {size_field!r}")
                        return
                    pos = data + ((size + BLOCK - 1) & ~(BLOCK - 1))
                    if flag == 0x35:
                        pending.long_name, pending.pax = None, {}
                    elif not self._metadata(flag, data, size, pending, headers, offsets):
                        return
                    continue
                elif flag in _UNSUPPORTED_TYPES:
                    kind = UNSUPPORTED
                    if flag == 0x53 and buf[i + _SPARSE_EXTENDED]:
                        data = self._past_extensions(data)
                        if data is None:
                            self._fail(headers, offsets, len(headers) - 1)
                            return
                else:
                    kind = SPECIAL
                bad_record = None
                if pending.pax or pending.pax_global or pending.long_name is not None:
                    name, size, kind, bad_record = pending.apply(name, size, kind)
                if size is None:
                    pax_text = "" if bad_record is None else f"pax size={bad_record!r}, "
                    self._bad_size(headers, offsets, name, f"{pax_text}size field {size_field!r}")
                    return
                if bad_record is not None:
                    kind = BAD_SIZE
                pos = data + ((size + BLOCK - 1) & ~(BLOCK - 1))
                if data + size > file_size and kind == REGULAR:
                    if not self._fail(headers, offsets, _first_bad_checksum(headers)):
                        self.end_offset = data
                        yield name, TRUNCATED, data, size, buf, data - base
                    return
                yield name, kind, data, size, buf, data - base
            self._fail(headers, offsets, _first_bad_checksum(headers))
        finally:  # also when the caller drops the walk early
            self.reads += reads
            self.bytes_read += requested

    def _metadata(self, flag: int, data: int, size: int, pending: _Pending, headers: list[bytes],
                  offsets: list[int]) -> bool:
        """Read the payload of a metadata header (data at `data`, `size` bytes) into `pending`; False when the walk
        ends there (`_fail` says why): a payload longer than a name or pax records can be, cut by the end of
        the file, or unparsable."""
        if size > MAX_NAME_BYTES:
            self._fail(headers, offsets, len(headers) - 1)
            return False
        if data + size > self.file_size:
            if not self._fail(headers, offsets, _first_bad_checksum(headers)):
                self.end_reason, self.end_offset = TRUNCATED_TAR, data
            return False
        payload = self.head(data, size)
        if flag == 0x4C:  # L: a GNU long name (K, a long link name, is read and not kept)
            pending.long_name = payload.split(b"\x00", 1)[0]
        elif flag == 0x78 or flag == 0x67:  # x: pax records of the next member; g: global ones
            try:
                (pending.pax if flag == 0x78 else pending.pax_global).update(_pax_records(payload))
            except _BadHeader:
                self._fail(headers, offsets, len(headers) - 1)
                return False
        return True

    def _past_extensions(self, data: int) -> int | None:
        """Where an old-GNU sparse member's data starts: past the extension blocks of its sparse map that
        follow the header at `data - BLOCK` (the member's size counts only the data). None for a chain
        longer than MAX_SPARSE_EXTENSIONS; a chain the file ends inside leaves the walk at its end."""
        for _ in range(MAX_SPARSE_EXTENSIONS):
            block = self.head(data, BLOCK)
            data += BLOCK
            if len(block) < BLOCK or not block[_EXTENSION_EXTENDED]:
                return data
        return None

    def _fail(self, headers: list[bytes], offsets: list[int], bad: int | None) -> bool:
        """Record the first bad header among `headers[:bad+1]` (checksums first); True if any."""
        if bad is None:
            return False
        earlier = _first_bad_checksum(headers[:bad])
        self.bad_offset = offsets[earlier if earlier is not None else bad]
        self.end_reason, self.end_offset = CORRUPT_HEADER, self.bad_offset
        return True

    def _bad_size(self, headers: list[bytes], offsets: list[int], name: bytes, detail: str) -> None:
        """Stop at the last header, whose size is unusable -- unless a checksum says it is garbage."""
        if self._fail(headers, offsets, _first_bad_checksum(headers)):
            return
        self.bad_offset, self.bad_name, self.bad_detail = offsets[-1], name, detail
        self.end_reason, self.end_offset = BAD_MEMBER_SIZE, offsets[-1]

    def resync(self, after: int) -> int | None:
        """Offset of the next block after `after` that is a valid ustar/GNU header, or None."""
        pos = after + BLOCK
        while pos < self.file_size:
            chunk = self.read(pos, RESYNC_CHUNK + BLOCK)
            at = chunk.find(b"ustar", 257)
            while at >= 0:
                start = at - 257
                if start % BLOCK == 0 and start + BLOCK <= len(chunk):
                    header = chunk[start:start + BLOCK]
                    if _first_bad_checksum([header]) is None:
                        return pos + start
                at = chunk.find(b"ustar", at + 1)
            pos += RESYNC_CHUNK
        return None


@dataclass(frozen=True)
class Member:
    """One member of a tar, in tar order: a regular file to read by byte range when `reason` is "",
    else refused with its reason (KIND_REASONS: a link, a device, a GNU sparse file, a member the file
    ends inside, a size that cannot be trusted; NON_UTF8_NAME)."""

    name: str  # with backslash escapes when the reason is NON_UTF8_NAME
    offset: int  # of its data
    size: int
    reason: str = ""


@dataclass(frozen=True)
class Damage:
    """Where a walk met damage: TRUNCATED_TAR, CORRUPT_HEADER or BAD_MEMBER_SIZE at a header offset, or
    for the whole file "empty_file", "compressed_tar", "not_a_tar"; `member` when the header names one."""

    reason: str
    offset: int
    member: str = ""
    detail: str = ""

    def describe(self) -> str:
        """The damage for people: its offset, member and detail."""
        named = f" ({self.member})" if self.member else ""
        return f"at byte {self.offset}{named}" + (f": {self.detail}" if self.detail else "")


class MemberTruncated(ShortRead):
    """The file ends inside a member's data."""


def read_members(path: str | os.PathLike) -> Iterator[Member | Damage]:
    """Every member of the tar at `path` in tar order, and a Damage where the walk met damage.

    Directories and metadata headers are no members. Only members whose headers passed their checksums
    are yielded; after a corrupt header (or an unusable size) the walk resumes at the next valid header,
    as the scan's does. OSError when the file cannot be read.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        if file_size == 0:
            yield Damage("empty_file", 0)
            return
        walker = TarWalker(fd, file_size, READ_WINDOW)
        start: int | None = 0
        while start is not None:
            yield from _checked_members(walker, start)
            opened = start == 0 and walker.end_reason and walker.end_offset == 0
            if opened and (detail := compressed_detail(walker.read(0, 8))) is not None:
                yield Damage("compressed_tar", 0, detail=detail)
                return
            bad, reason = walker.bad_offset, walker.end_reason
            start = None if bad is None else walker.resync(bad)
            if reason == CORRUPT_HEADER and bad == 0 and start is None:
                yield Damage("not_a_tar", 0, detail="no valid tar header anywhere in the file")
            elif reason:
                name = walker.bad_name.decode("utf-8", "backslashreplace")
                yield Damage(reason, walker.end_offset, name, walker.bad_detail)
    finally:
        os.close(fd)


def _checked_members(walker: TarWalker, start: int) -> Iterator[Member]:
    """The members of one walk from `start` that lie before its first bad header.

    A member is held back until its header's checksum batch is verified (`TarWalker.verified`): the
    walker yields members past a bad checksum, which the caller must never see.
    """
    pending: deque[Member] = deque()
    for raw, kind, offset, size, _, _ in walker.members(start):
        try:
            pending.append(Member(raw.decode("utf-8"), offset, size, KIND_REASONS.get(kind, "")))
        except UnicodeDecodeError:
            pending.append(Member(raw.decode("utf-8", "backslashreplace"), offset, size, NON_UTF8_NAME))
        while pending and pending[0].offset <= walker.verified:
            yield pending.popleft()
    bad = walker.bad_offset
    yield from (member for member in pending if bad is None or member.offset < bad)


def read_tar_member(path: str | os.PathLike, offset: int, size: int) -> bytes:
    """The `size` data bytes at `offset` of a member of the tar at `path`, never more;
    MemberTruncated when the file ends inside them."""
    with open(path, "rb") as handle:
        return read_range(handle.fileno(), offset, size, path)


def read_range(fd: int, offset: int, size: int, path: str | os.PathLike) -> bytes:
    """Exactly `size` bytes at `offset` of the open file `fd` (`path`, for the message); MemberTruncated when
    the file ends inside them. The one reader of a member's bytes by its byte range (images, captions, clips,
    conversation media): `os.pread` keeps no file position, so threads may share `fd`."""
    data = os.pread(fd, size, offset)
    while len(data) < size:  # (one pread returns at most ~2 GiB; a short one at the end of the file: none more)
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            raise _truncated(path, offset, len(data), size)
        data += more
    return data


class _Descriptor:
    """An open tar file and the number of reads using it now; `cached` while `TarRanges` lists it."""

    __slots__ = ("fd", "users", "cached")

    def __init__(self, fd: int):
        self.fd, self.users, self.cached = fd, 0, True


class TarRanges:
    """The `Fields` of tars (`mmtok.formats.containers`): an image and its caption sidecar are byte ranges, read with
    `read_range`. Thread-safe.

    One descriptor per file, shared by every thread (pread has no file position, so threads never race, and it
    releases the GIL). A descriptor is closed only when no read is using it, so a read never sees it closed or its
    number reused for another file. At most `max_open` idle descriptors stay open however many tars a job walks
    through; while more files than that are being read at once, each of them stays open until its last read ends.
    """

    def __init__(self, max_open: int = 256):
        self._fds: OrderedDict[str, _Descriptor] = OrderedDict()  # least recently used first
        self._lock = threading.Lock()
        self._max_open = max_open

    def read(self, path: str, offset: int, size: int) -> bytes:
        """Exactly `size` bytes at `offset` of `path`; MemberTruncated when the file ends early."""
        entry = self._acquire(path)
        try:
            return read_range(entry.fd, offset, size, path)  # outside the lock: reads of many threads overlap
        finally:
            self._release(entry)

    def member(self, path: str, member: str, offset: int, size: int) -> bytes:
        return self.read(path, offset, size)

    def text(self, path: str, offset: int, size: int, column: str | None) -> bytes:
        return self.read(path, offset, size)

    def _acquire(self, path: str) -> _Descriptor:
        """The descriptor of `path`, counted as in use until `_release`."""
        with self._lock:
            entry = self._fds.pop(path, None)
            if entry is None:
                entry = _Descriptor(os.open(path, os.O_RDONLY))
            entry.users += 1
            self._fds[path] = entry
            self._trim()
            return entry

    def _release(self, entry: _Descriptor) -> None:
        with self._lock:
            entry.users -= 1
            if entry.cached:
                self._trim()
            elif not entry.users:  # dropped by close() while this read was running
                os.close(entry.fd)

    def _trim(self) -> None:
        """Close least recently used idle descriptors while more than `max_open` are open (lock held)."""
        excess = len(self._fds) - self._max_open
        if excess <= 0:
            return
        for path in [p for p, entry in self._fds.items() if not entry.users][:excess]:
            os.close(self._fds.pop(path).fd)

    def close(self) -> None:
        """Close every descriptor; one still in use by a read is closed when that read ends."""
        with self._lock:
            for entry in self._fds.values():
                entry.cached = False
                if not entry.users:
                    os.close(entry.fd)
            self._fds.clear()


def open_range(path: str | os.PathLike, offset: int, size: int) -> BinaryIO:
    """The file at `path` open at `offset`, to copy the `size` bytes there in pieces (a medium too large to hold
    at once); MemberTruncated when the file does not hold them all now. The caller closes it."""
    handle = open(path, "rb")
    try:
        held = max(os.fstat(handle.fileno()).st_size - offset, 0)
        if held < size:
            raise _truncated(path, offset, held, size)
        handle.seek(offset)
    except BaseException:
        handle.close()
        raise
    return handle


def _truncated(path: str | os.PathLike, offset: int, held: int, size: int) -> MemberTruncated:
    return MemberTruncated(f"{path}: the file ends inside the member at byte {offset} ({held:,} of {size:,} bytes)")


def _parse_size(field: bytes) -> int | None:
    """The size field when the plain octal parse fails: octal cut at a NUL, or GNU base-256."""
    if field[0] == 0x80:  # GNU base-256, for sizes of 8 GiB and more (0xFF would be negative)
        return int.from_bytes(field[1:], "big")
    try:
        size = int(field.split(b"\x00", 1)[0] or b"0", 8)
    except ValueError:
        return None
    return size if size >= 0 else None


def _pax_records(data: bytes) -> dict[bytes, bytes]:
    """Parse pax extended-header records `"%d %s=%s\\n"`; raises _BadHeader when malformed."""
    records: dict[bytes, bytes] = {}
    pos = 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise _BadHeader from None
        end = pos + length
        if space < 0 or length <= 0 or end > len(data) or data[end - 1] != 0x0A:
            raise _BadHeader
        key, eq, value = data[space + 1:end - 1].partition(b"=")
        if not eq:
            raise _BadHeader
        records[key] = value
        pos = end
    return records


class _Pending:
    """What metadata headers said of the member that follows them: a GNU long name and its pax records, and
    the global pax records, which hold for every later member."""

    __slots__ = ("long_name", "pax", "pax_global")

    def __init__(self) -> None:
        self.long_name: bytes | None = None
        self.pax: dict[bytes, bytes] = {}
        self.pax_global: dict[bytes, bytes] = {}

    def apply(self, name: bytes, size: int | None, kind: int) -> tuple[bytes, int | None, int, bytes | None]:
        """The member's name, size and kind after what is pending (then forgotten, but the global records),
        and its pax `size` record when that is unusable (`_apply_pax`)."""
        bad_record = None
        if self.pax or self.pax_global:
            # A sparse map in a global header marks every later member sparse (what tarfile reads)
            if kind == REGULAR and any(key.startswith(_SPARSE_PAX) for key in [*self.pax, *self.pax_global]):
                kind = UNSUPPORTED
            name, size, bad_record = _apply_pax(name, size, self.pax_global, self.pax)
            self.pax = {}
        if self.long_name is not None:
            name, self.long_name = self.long_name, None
        return name, size, kind, bad_record


def _apply_pax(name: bytes, size: int | None, pax_global: dict[bytes, bytes],
               pax: dict[bytes, bytes]) -> tuple[bytes, int | None, bytes | None]:
    """Member name and size after pax `path`/`size` records (local over global), and the `size`
    record when it is unusable (not decimal digits, or above MAX_SIZE).

    An unusable `size` record leaves the ustar size in place, as GNU tar does.
    """
    merged = {**pax_global, **pax}
    name = pax.get(b"GNU.sparse.name") or merged.get(b"path", name)  # a sparse member's path is a stand-in
    record = merged.get(b"size")
    if record is None:
        return name, size, None
    digits = record.lstrip(b"0") or b"0"  # bounded before int(): Python refuses > 4300 digits
    if record.isdigit() and len(digits) <= 19 and int(digits) <= MAX_SIZE:  # no sign, exponent, spaces
        return name, int(digits), None
    return name, size, record


def compressed_detail(head: bytes) -> str | None:
    """What the file is and how to undo it when `head`, its first bytes, opens a compressed stream
    (gzip, bzip2, xz, zstd, lz4) rather than a tar header; else None."""
    for magic, kind, command in _COMPRESSIONS:
        if head.startswith(magic):
            return (f"{kind}-compressed: members are read by byte range, which needs an uncompressed tar; "
                    f"decompress it (`{command}`)")
    return None


def _first_bad_checksum(headers: list[bytes]) -> int | None:
    """Index of the first header whose checksum field disagrees with its bytes, or None.

    The checksum is the byte sum with the field itself counted as spaces; like GNU tar and Python's
    tarfile, both the unsigned and the (historical) signed sum are accepted.
    """
    if not headers:
        return None
    blocks = np.frombuffer(b"".join(headers), np.uint8).reshape(-1, BLOCK)
    field = blocks[:, 148:156]
    unsigned = (blocks.sum(1, dtype=np.uint32) - field.sum(1, dtype=np.uint32) + 8 * 32).astype(np.int64)
    # The stored value: octal digits up to the first NUL, spaces ignored, anything else invalid.
    after_nul = np.maximum.accumulate(field == 0, axis=1)
    digit = (field >= 0x30) & (field <= 0x37) & ~after_nul
    invalid = (~(digit | (field == 0x20) | after_nul)).any(1)
    stored = np.zeros(len(blocks), np.int64)
    for k in range(field.shape[1]):
        stored = np.where(digit[:, k], stored * 8 + (field[:, k].astype(np.int64) - 0x30), stored)
    for index in np.flatnonzero((stored != unsigned) | invalid):
        row = blocks[index]
        signed = int(row.view(np.int8).sum()) - int(row[148:156].view(np.int8).sum()) + 8 * 32
        if invalid[index] or stored[index] != signed:
            return int(index)
    return None
