"""Image size and EXIF orientation from a file's first bytes, never decoding pixels.

`probe` returns what `ImageOps.exif_transpose(PIL.Image.open(f)).size` would give, for JPEG
(baseline, progressive, CMYK, any SOF), PNG, WebP (VP8, VP8L, VP8X canvas), GIF, BMP and TIFF
(classic and BigTIFF). It reads `HEAD_BYTES` first; when the parser needs bytes further in (long
EXIF/ICC segments before a JPEG's SOF, a TIFF IFD stored after the pixels, a WebP EXIF chunk after
the bitstream) it reads `FETCH_BYTES` windows at exactly those offsets, never the whole file.

Hand-written rather than PIL because PIL's `Image.open` costs ~60 us per image and reads through
the file object; the scan budget is ~10 us per image. The rules follow PIL's plugins so the numbers
agree: JPEG takes the SOF before SOS and the first `Exif` APP1; PNG takes IHDR and the eXIf/text
metadata chunks before IDAT; a missing EXIF orientation falls back to the XMP `tiff:Orientation`.
Known gap: PIL also reads PNG metadata chunks placed after IDAT (rare; PNG 3 says eXIf precedes IDAT).
"""

from __future__ import annotations

import re
import struct
import zlib
from typing import Callable

from mmtok.errors import Skip

HEAD_BYTES = 4096
FETCH_BYTES = 4096
MAX_FETCHES = 64  # bounds the work on a hostile file whose segments lead far into it
MAX_METADATA_BYTES = 1 << 24  # a text/EXIF chunk larger than this is skipped, not read

# Limits for "absurd" sizes: no real encoder writes a side above 65,535 (JPEG's own limit), and
# 2**28 pixels (16,384^2) is where mmtok.media.images refuses to decode (MAX_DECODE_PIXELS).
MAX_SIDE = 65535
MAX_PIXELS = 1 << 28


# Reasons a probe can fail with (the manifest's `reason` column).
UNKNOWN_FORMAT = "unknown_format"
CORRUPT_IMAGE_HEADER = "corrupt_image_header"
TRUNCATED_IMAGE_HEADER = "truncated_image_header"
ZERO_DIMENSIONS = "zero_dimensions"
ABSURD_DIMENSIONS = "absurd_dimensions"

Fetch = Callable[[int, int], bytes]  # (absolute offset, length) -> bytes, shorter only at end of file

_SOF_MARKERS = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
_STANDALONE_MARKERS = frozenset(range(0xD0, 0xD9)) | {0x00, 0x01}
_EXIF_APP1 = b"Exif\x00\x00"
_XMP_APP1 = b"http://ns.adobe.com/xap/1.0/\x00"
_XMP_ORIENTATION = re.compile(rb'tiff:Orientation(="|>)([0-9])')
_TIFF_ORIENTATION = 0x0112


class ProbeError(Skip):
    """The header could not give a usable size; `reason` is the manifest reason.

    `format`, `width`, `height`, `orientation` hold what was learned before the failure (for
    absurd or zero dimensions: the sides as displayed), else "", 0, 0, 1.
    """

    def __init__(self, reason: str, format: str = "", width: int = 0, height: int = 0, orientation: int = 1):
        super().__init__(reason)
        self.format = format
        self.width, self.height, self.orientation = width, height, orientation


class _Reader:
    """Member bytes: the head already read, then windows fetched where a parser asks."""

    __slots__ = ("buf", "base", "size", "fetch", "origin", "fetches")

    def __init__(self, head: bytes, size: int, fetch: Fetch | None, origin: int):
        self.buf, self.base, self.size = head, 0, size
        self.fetch, self.origin, self.fetches = fetch, origin, 0

    def window(self, pos: int, n: int) -> tuple[bytes, int]:
        """Make [pos, pos+n) available; returns (buffer, member offset of its first byte)."""
        i = pos - self.base
        if 0 <= i and i + n <= len(self.buf):
            return self.buf, self.base
        if pos < 0 or pos + n > self.size or self.fetch is None:
            raise ProbeError(TRUNCATED_IMAGE_HEADER)
        if self.fetches >= MAX_FETCHES:
            raise ProbeError(CORRUPT_IMAGE_HEADER)
        self.fetches += 1
        self.buf = self.fetch(self.origin + pos, min(max(n, FETCH_BYTES), self.size - pos))
        self.base = pos
        if len(self.buf) < n:
            raise ProbeError(TRUNCATED_IMAGE_HEADER)
        return self.buf, pos

    def get(self, pos: int, n: int) -> bytes:
        buf, base = self.window(pos, n)
        return buf[pos - base:pos - base + n]


def probe(head: bytes, size: int, fetch: Fetch | None = None, origin: int = 0) -> tuple[str, int, int, int]:
    """(format, width, height, orientation) of an image member, width/height as displayed.

    `head` holds the member's first bytes (at most `size`); `fetch(origin + pos, n)` reads more
    when needed (None when `head` is the whole member). Orientation is the EXIF value 1-8 (1 when
    absent or invalid); orientations 5-8 swap the stored sides. Raises ProbeError(reason).
    """
    return probe_at(head, 0, len(head), size, fetch, origin)


def probe_at(data: bytes, start: int, end: int, size: int, fetch: Fetch | None = None,
             origin: int = 0) -> tuple[str, int, int, int]:
    """`probe(data[start:end], size, fetch, origin)` without copying the head out of `data`.

    The scan's read window holds a tar header and the member's first bytes: JPEG, PNG and WebP
    headers are parsed where they lie (a copy of the head is made only for a parser that needs
    bytes past `end`, or for GIF/BMP/TIFF). No parser reads `data` outside [start, end).
    """
    if data.startswith(b"\xff\xd8\xff", start, end):
        fmt, parse = "jpeg", _jpeg
    else:
        fmt = sniff(data[start:start + 12 if end - start > 12 else end])
        parse = _PARSERS.get(fmt)
    try:
        if parse is None:
            head = data[start:end]
            raise ProbeError(TRUNCATED_IMAGE_HEADER if len(head) < 12 and _is_magic_prefix(head) else UNKNOWN_FORMAT)
        width, height, orientation = parse(data, start, end, size, fetch, origin)
    except ProbeError as err:
        err.format = fmt or ""
        raise
    except (struct.error, IndexError):  # a field that runs past the bytes a parser was handed
        raise ProbeError(TRUNCATED_IMAGE_HEADER, fmt) from None
    if orientation > 4:
        width, height = height, width
    if width <= 0 or height <= 0 or width > MAX_SIDE or height > MAX_SIDE or width * height > MAX_PIXELS:
        raise ProbeError(dimension_problem(width, height), fmt, width, height, orientation)
    return fmt, width, height, orientation


def sniff(head: bytes) -> str | None:
    """The format named by a file's signature, or None."""
    if head[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if head[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "webp"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "gif"
    if head[:2] == b"BM":
        return "bmp"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "tiff"
    return None


def dimension_problem(width: int, height: int) -> str:
    """"" for a plausible size, else the reason: a zero side, or a size no real image has."""
    if width <= 0 or height <= 0:
        return ZERO_DIMENSIONS
    if width > MAX_SIDE or height > MAX_SIDE or width * height > MAX_PIXELS:
        return ABSURD_DIMENSIONS
    return ""


def _is_magic_prefix(head: bytes) -> bool:
    """A member too short to hold a full signature but starting like one is truncated, not unknown."""
    magics = (b"\xff\xd8\xff", b"\x89PNG\r\n\x1a\n", b"RIFF", b"GIF8", b"BM", b"II*\x00", b"MM\x00*")
    return bool(head) and any(m.startswith(head) or head.startswith(m) for m in magics)


def _orientation(exif_value: int | None, xmp: bytes | None) -> int:
    """PIL's rule: the EXIF tag when present (valid 1-8, else 1), otherwise XMP tiff:Orientation."""
    if exif_value is None and xmp is not None:
        match = _XMP_ORIENTATION.search(xmp)
        exif_value = int(match[2]) if match else None
    return exif_value if exif_value is not None and 1 <= exif_value <= 8 else 1


# --------------------------------------------------------------------------------------- JPEG


_SEGMENT = struct.Struct(">BBH").unpack_from  # fill byte, marker, length of a segment header
_FRAME_SIZE = struct.Struct(">HH").unpack_from  # height, width in a SOF segment (after its precision byte)
# Markers whose segment the walk passes without a look inside (APPn but APP1, DQT, DHT, DRI, COM, ...).
_SKIPPED = frozenset(range(256)) - _SOF_MARKERS - _STANDALONE_MARKERS - {0xFF, 0xDA, 0xD9, 0xE1}


def _jpeg(data: bytes, start: int, end: int, size: int, fetch: Fetch | None, origin: int) -> tuple[int, int, int]:
    """Walk the segments up to the first SOF (JPEG puts APPn metadata before the frame header).

    `buf[pos - base]` is the member's byte `pos`, valid below `buf[limit]`: first in place in
    `data` (the head is data[start:end]), then in a _Reader's windows once the walk leaves the head.
    """
    buf, base, limit, reader = data, -start, end, None
    pos, exif, xmp_at = 2, None, None
    exif_seen = False
    while True:
        i = pos - base
        while i + 4 <= limit:  # segments in _SKIPPED (most of them) are passed right here
            fill, marker, length = _SEGMENT(buf, i)
            if fill != 0xFF or marker not in _SKIPPED or length < 2:
                break
            i += 2 + length
        else:  # the next segment header lies past the bytes at hand
            pos = i + base
            reader = reader or _Reader(data[start:end], size, fetch, origin)
            buf, base = reader.window(pos, 4)
            i, limit = pos - base, len(buf)
            fill, marker, length = _SEGMENT(buf, i)
            if fill == 0xFF and marker in _SKIPPED and length >= 2:
                pos += 2 + length
                continue
        pos = i + base
        if fill != 0xFF:  # PIL skips junk between segments
            j = buf.find(b"\xff", i, limit)
            pos = base + (j if j >= 0 else limit)
            continue
        if marker in _SOF_MARKERS:
            if i + 9 > limit:
                reader = reader or _Reader(data[start:end], size, fetch, origin)
                buf, base = reader.window(pos, 9)
                i = pos - base
            height, width = _FRAME_SIZE(buf, i + 5)
            break
        if marker == 0xFF:
            pos += 1
            continue
        if marker == 0xDA or marker == 0xD9:  # scan data or end of image before any frame header
            raise ProbeError(CORRUPT_IMAGE_HEADER)
        if marker in _STANDALONE_MARKERS:
            pos += 2
            continue
        if length < 2:
            raise ProbeError(CORRUPT_IMAGE_HEADER)
        if marker == 0xE1:
            if i + 4 + len(_XMP_APP1) > limit and pos + 4 + len(_XMP_APP1) <= size:
                reader = reader or _Reader(data[start:end], size, fetch, origin)
                buf, base = reader.window(pos, 4 + len(_XMP_APP1))
                i, limit = pos - base, len(buf)
            if not exif_seen and buf.startswith(_EXIF_APP1, i + 4, limit):
                exif_seen = True
                exif = _exif_orientation_in(buf, i + 10, min(i + 2 + length, limit))
                if exif == -1:  # the IFD lies past the bytes at hand
                    reader = reader or _Reader(data[start:end], size, fetch, origin)
                    exif = _tiff_orientation(reader, pos + 10, pos + 2 + length)
                    buf, base = reader.buf, reader.base
                    limit = len(buf)
            elif buf.startswith(_XMP_APP1, i + 4, limit):
                xmp_at = (pos + 4 + len(_XMP_APP1), length - 2 - len(_XMP_APP1))
        pos += 2 + length
    if exif is None and xmp_at is not None and xmp_at[1] > 0:
        reader = reader or _Reader(data[start:end], size, fetch, origin)
        return width, height, _orientation(None, reader.get(*xmp_at))
    return width, height, exif if exif is not None and 1 <= exif <= 8 else 1


_EXIF_FIELDS = {b"II": (struct.Struct("<I").unpack_from, struct.Struct("<H").unpack_from,
                        struct.Struct("<HI").unpack_from, b"\x12\x01", "<"),
                b"MM": (struct.Struct(">I").unpack_from, struct.Struct(">H").unpack_from,
                        struct.Struct(">HI").unpack_from, b"\x01\x12", ">")}
_VALUE_FORMATS = {1: "B", 3: "H", 4: "I"}


def _exif_orientation_in(buf: bytes, t: int, end: int) -> int | None:
    """EXIF orientation of the TIFF structure at buf[t:], read in place; -1 when buf ends too soon.

    Returns the tag's value, 0 when present but unusable, None when absent or malformed.
    """
    if t + 8 > end:
        return -1
    fields = _EXIF_FIELDS.get(buf[t:t + 2])
    if fields is None:
        return None
    u32, u16, kind_count, tag, order = fields
    first = t + u32(buf, t + 4)[0] + 2
    if first > end:
        return -1
    last = first + 12 * u16(buf, first - 2)[0]
    if last > end:
        return -1
    j = buf.find(tag, first, last)
    while j >= 0 and (j - first) % 12:
        j = buf.find(tag, j + 1, last)
    if j < 0:
        return None
    kind, count = kind_count(buf, j + 2)
    value_format = _VALUE_FORMATS.get(kind)
    if count != 1 or value_format is None:
        return 0
    return struct.unpack_from(order + value_format, buf, j + 8)[0]


# --------------------------------------------------------------------------------- TIFF / EXIF


def _ifd_layout(r: _Reader, start: int) -> tuple[str, bool, int]:
    """(byte-order prefix, bigtiff, absolute IFD0 offset) of a TIFF structure at `start`."""
    head = r.get(start, 8)
    order = {b"II": "<", b"MM": ">"}.get(head[:2])
    if order is None:
        raise ProbeError(CORRUPT_IMAGE_HEADER)
    magic = struct.unpack_from(order + "H", head, 2)[0]
    if magic == 42:
        return order, False, start + struct.unpack_from(order + "I", head, 4)[0]
    if magic == 43:
        return order, True, start + struct.unpack_from(order + "Q", r.get(start + 8, 8))[0]
    raise ProbeError(CORRUPT_IMAGE_HEADER)


def _ifd_values(r: _Reader, start: int, limit: int, wanted: tuple[int, ...]) -> dict[int, int]:
    """Single integer values of `wanted` tags in IFD0 of the TIFF structure at [start, limit).

    A tag present with a non-integer type or a count other than 1 maps to 0 (PIL ignores such a value).
    """
    order, big, ifd = _ifd_layout(r, start)
    count_fmt, entry_size = ("Q", 20) if big else ("H", 12)
    count_size = 8 if big else 2
    if ifd + count_size > limit:
        return {}
    count = struct.unpack(order + count_fmt, r.get(ifd, count_size))[0]
    count = min(count, (limit - ifd - count_size) // entry_size)
    entries = r.get(ifd + count_size, count * entry_size)
    found: dict[int, int] = {}
    for k in range(count):
        e = k * entry_size
        tag, kind = struct.unpack_from(order + "HH", entries, e)
        if tag in wanted and tag not in found:
            n = struct.unpack_from(order + ("Q" if big else "I"), entries, e + 4)[0]
            value_at = e + (12 if big else 8)
            fmt = {1: "B", 3: "H", 4: "I", 16: "Q"}.get(kind)
            found[tag] = struct.unpack_from(order + fmt, entries, value_at)[0] if fmt and n == 1 else 0
    return found


def _tiff_orientation(r: _Reader, start: int, limit: int) -> int | None:
    """EXIF orientation tag of an embedded TIFF structure: its value, 0 if unusable, None if absent."""
    try:
        return _ifd_values(r, start, limit, (_TIFF_ORIENTATION,)).get(_TIFF_ORIENTATION)
    except ProbeError:
        return None  # a malformed EXIF block: PIL ignores it too


def _exif_bytes_orientation(data: bytes) -> int | None:
    """Orientation from an EXIF payload held in memory (PNG eXIf, WebP EXIF), with or without `Exif\\0\\0`."""
    start = len(_EXIF_APP1) if data.startswith(_EXIF_APP1) else 0
    try:
        return _tiff_orientation(_Reader(data, len(data), None, 0), start, len(data))
    except ProbeError:
        return None


def _tiff(data: bytes, start: int, end: int, size: int, fetch: Fetch | None, origin: int) -> tuple[int, int, int]:
    r = _Reader(data[start:end], size, fetch, origin)
    found = _ifd_values(r, 0, r.size, (256, 257, _TIFF_ORIENTATION))
    width, height = found.get(256), found.get(257)
    if width is None or height is None:
        raise ProbeError(CORRUPT_IMAGE_HEADER)
    return width, height, _orientation(found.get(_TIFF_ORIENTATION), None)


# ----------------------------------------------------------------------------------------- PNG


_PNG_CHUNK = struct.Struct(">I4s").unpack_from
_PNG_METADATA = frozenset((b"eXIf", b"tEXt", b"zTXt", b"iTXt"))


def _png(data: bytes, start: int, end: int, size: int, fetch: Fetch | None, origin: int) -> tuple[int, int, int]:
    """IHDR, then the chunks before IDAT (in place in data[start:end]) for orientation metadata."""
    if end - start < 33:
        data, start, end = _Reader(data[start:end], size, fetch, origin).get(0, 33), 0, 33
    if not data.startswith(b"IHDR", start + 12, end):
        raise ProbeError(CORRUPT_IMAGE_HEADER)
    width, height = struct.unpack_from(">II", data, start + 16)
    at = start + 33
    while at + 8 <= end:  # usually IDAT follows a few small chunks, all inside the head
        length, kind = _PNG_CHUNK(data, at)
        if kind == b"IDAT" or kind == b"IEND":
            return width, height, 1
        if kind in _PNG_METADATA:
            break
        at += 12 + length
    return width, height, _png_orientation(_Reader(data[start:end], size, fetch, origin), at - start)


def _png_orientation(r: _Reader, pos: int) -> int:
    """Orientation from the eXIf/text chunks between `pos` and IDAT (PIL's precedence)."""
    exif = raw_profile = xmp = None
    try:
        while True:
            length, kind = _PNG_CHUNK(r.get(pos, 8))
            if kind == b"IDAT" or kind == b"IEND":
                break
            if kind in _PNG_METADATA and length <= MAX_METADATA_BYTES:
                data = r.get(pos + 8, length)
                if kind == b"eXIf":
                    exif = data
                else:
                    key, value = _png_text(kind, data)
                    if key == b"exif" and kind == b"tEXt":
                        exif = value
                    elif key == b"Raw profile type exif":
                        raw_profile = value
                    elif key == b"XML:com.adobe.xmp":
                        xmp = value
            pos += 12 + length
    except ProbeError:
        pass  # metadata cut short: the size from IHDR stands, as it does for PIL
    if exif is None and raw_profile is not None:
        exif = _raw_profile_bytes(raw_profile)
    value = _exif_bytes_orientation(exif) if exif is not None else None
    return _orientation(value, xmp)


def _png_text(kind: bytes, data: bytes) -> tuple[bytes, bytes | None]:
    """(keyword, text bytes) of a tEXt/zTXt/iTXt chunk; text None when it cannot be read."""
    key, _, rest = data.partition(b"\x00")
    try:
        if kind == b"tEXt":
            return key, rest
        if kind == b"zTXt":
            return key, zlib.decompress(rest[1:]) if rest[:1] == b"\x00" else None
        compressed, method, rest = rest[0], rest[1], rest[2:]
        _lang, _translated, text = rest.split(b"\x00", 2)
        if compressed:
            return key, zlib.decompress(text) if method == 0 else None
        return key, text
    except (IndexError, ValueError, zlib.error):
        return key, None


def _raw_profile_bytes(text: bytes | None) -> bytes | None:
    """ImageMagick's 'Raw profile type exif' text: three header lines, then hex."""
    if text is None:
        return None
    try:
        return bytes.fromhex("".join(text.decode("latin-1").split("\n")[3:]))
    except ValueError:
        return None


# ---------------------------------------------------------------------------------------- WebP


def _webp(data: bytes, start: int, end: int, size: int, fetch: Fetch | None, origin: int) -> tuple[int, int, int]:
    """The first chunk's size fields, read in place (all within the first 30 bytes)."""
    if end - start < 30:
        raise ProbeError(TRUNCATED_IMAGE_HEADER)
    chunk = data[start + 12:start + 16]
    if chunk == b"VP8 ":
        if data[start + 23:start + 26] != b"\x9d\x01\x2a":
            raise ProbeError(CORRUPT_IMAGE_HEADER)
        width, height = struct.unpack_from("<HH", data, start + 26)
        return width & 0x3FFF, height & 0x3FFF, 1
    if chunk == b"VP8L":
        if data[start + 20] != 0x2F:
            raise ProbeError(CORRUPT_IMAGE_HEADER)
        bits = struct.unpack_from("<I", data, start + 21)[0]
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1, 1
    if chunk == b"VP8X":
        width = int.from_bytes(data[start + 24:start + 27], "little") + 1
        height = int.from_bytes(data[start + 27:start + 30], "little") + 1
        # Flag bits 3 (EXIF) and 2 (XMP) announce metadata chunks; libwebp's muxer sets them.
        if data[start + 20] & 0x0C:
            return width, height, _webp_orientation(_Reader(data[start:end], size, fetch, origin))
        return width, height, 1
    raise ProbeError(CORRUPT_IMAGE_HEADER)


def _webp_orientation(r: _Reader) -> int:
    exif = xmp = None
    pos = 12
    try:
        while pos + 8 <= r.size and (exif is None or xmp is None):
            kind, length = struct.unpack("<4sI", r.get(pos, 8))
            if kind in (b"EXIF", b"XMP ") and length <= MAX_METADATA_BYTES:
                data = r.get(pos + 8, length)
                if kind == b"EXIF" and exif is None:
                    exif = data
                elif kind == b"XMP " and xmp is None:
                    xmp = data
            pos += 8 + length + (length & 1)
    except ProbeError:
        pass  # a cut-short chunk list: keep what was found
    return _orientation(_exif_bytes_orientation(exif) if exif is not None else None, xmp)


# ----------------------------------------------------------------------------------- GIF / BMP


def _gif(data: bytes, start: int, end: int, size: int, fetch: Fetch | None, origin: int) -> tuple[int, int, int]:
    r = _Reader(data[start:end], size, fetch, origin)
    head = r.get(0, 13)
    width, height = struct.unpack_from("<HH", head, 6)
    flags = head[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)
    while True:  # PIL grows the size to the first frame's extent
        block = r.get(pos, 1)[0]
        if block == 0x2C:  # image descriptor
            x0, y0, w, h = struct.unpack("<HHHH", r.get(pos + 1, 8))
            return max(width, x0 + w), max(height, y0 + h), 1
        if block == 0x3B:  # trailer before any image
            raise ProbeError(CORRUPT_IMAGE_HEADER)
        if block == 0x21:  # extension: label, then sub-blocks up to a zero length
            pos += 2
            while n := r.get(pos, 1)[0]:
                pos += 1 + n
        pos += 1


def _bmp(data: bytes, start: int, end: int, size: int, fetch: Fetch | None, origin: int) -> tuple[int, int, int]:
    r = _Reader(data[start:end], size, fetch, origin)
    head = r.get(0, 26)
    header_size = struct.unpack_from("<I", head, 14)[0]
    if header_size == 12:  # OS/2 BITMAPCOREHEADER
        width, height = struct.unpack_from("<HH", head, 18)
    elif header_size in (40, 52, 56, 64, 108, 124):
        width, height = struct.unpack_from("<II", head, 18)
        if head[25] == 0xFF:  # negative height: rows stored top-down
            height = (1 << 32) - height
    else:
        raise ProbeError(CORRUPT_IMAGE_HEADER)
    return width, height, 1


_PARSERS = {"jpeg": _jpeg, "png": _png, "webp": _webp, "gif": _gif, "bmp": _bmp, "tiff": _tiff}
