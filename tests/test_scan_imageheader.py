"""Header-only image sizes equal what PIL shows after EXIF orientation, on real photos in every format."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest
from PIL import Image, ImageOps, PngImagePlugin

from mmtok.scan.imageheader import HEAD_BYTES, MAX_PIXELS, ProbeError, probe
from realmedia import mate_photos, skimage_images

THUMB = 320  # re-encoded variants are small so the suite stays fast; originals are used at full size


def pil_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return ImageOps.exif_transpose(image).size


def probe_bytes(data: bytes) -> tuple[str, int, int, int]:
    """Probe as the scan does: the first HEAD_BYTES, then reads at the offsets the parser asks for."""
    reads = []

    def fetch(offset: int, n: int) -> bytes:
        reads.append((offset, n))
        return data[offset:offset + n]

    return probe(data[:HEAD_BYTES], len(data), fetch, 0)


def load_small(path) -> Image.Image:
    with Image.open(path) as image:
        image.draft("RGB", (THUMB * 2, THUMB * 2))  # fast JPEG decode of the 5640x3172 photos
        image = ImageOps.exif_transpose(image)
        image.thumbnail((THUMB, THUMB))
        return image.convert("RGBA" if "A" in image.mode or "transparency" in image.info else "RGB")


@pytest.fixture(scope="module")
def photos() -> dict[str, Image.Image]:
    paths = skimage_images() + mate_photos()
    return {p.name: load_small(p) for p in paths if p.name != "multipage_rgb.tif"}


def exif_bytes(orientation: int, maker_note: int = 0) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    exif[0x010F] = "Debian"
    if maker_note:
        exif.get_ifd(0x8769)[0x927C] = bytes(range(256)) * (maker_note // 256)
    return exif.tobytes()


def save(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def variants(name: str, image: Image.Image) -> dict[str, bytes]:
    """Every supported format and the layouts that take different parser paths."""
    rgb = image.convert("RGB")
    rgba = image.convert("RGBA")
    palette = rgb.quantize(64, method=Image.Quantize.FASTOCTREE)
    out = {
        "jpeg": save(rgb, "JPEG", quality=85),
        "jpeg_progressive": save(rgb, "JPEG", quality=85, progressive=True),
        "jpeg_gray": save(rgb.convert("L"), "JPEG"),
        "jpeg_cmyk": save(rgb.convert("CMYK"), "JPEG"),
        "jpeg_long_exif": save(rgb, "JPEG", exif=exif_bytes(6, maker_note=20_000)),
        "jpeg_big_icc": save(rgb, "JPEG", icc_profile=bytes(range(256)) * 400),  # 100 KB of APP2 before SOF
        "jpeg_xmp_orientation": save(rgb, "JPEG",
                                     xmp=b'<x:xmpmeta><rdf:Description tiff:Orientation="8"/></x:xmpmeta>'),
        "png": save(rgb, "PNG", compress_level=1),
        "png_alpha": save(rgba, "PNG", compress_level=1),
        "png_palette": save(palette, "PNG", compress_level=1),
        "png_palette_transparency": save(palette, "PNG", compress_level=1, transparency=0),
        "png_gray": save(rgb.convert("L"), "PNG", compress_level=1),
        "png_16bit": save(Image.fromarray((np.asarray(rgb.convert("L"), np.uint16) * 257)), "PNG", compress_level=1),
        "png_exif": save(rgb, "PNG", exif=exif_bytes(6), compress_level=1),
        "png_xmp": save(rgb, "PNG", pnginfo=_xmp_pnginfo(5), compress_level=1),
        "webp_lossy": save(rgb, "WEBP", quality=80),
        "webp_lossless": save(rgb, "WEBP", lossless=True, method=0),
        "webp_alpha": save(rgba, "WEBP", quality=80),
        "webp_exif": save(rgb, "WEBP", exif=exif_bytes(8)),
        "gif": save(palette, "GIF"),
        "gif_animated": save(palette, "GIF", save_all=True, append_images=[palette.rotate(90)], duration=100),
        "bmp": save(rgb, "BMP"),
        "bmp_palette": save(rgb.quantize(16, method=Image.Quantize.FASTOCTREE), "BMP"),
        "tiff": save(rgb, "TIFF"),
        "tiff_lzw": save(rgb, "TIFF", compression="tiff_lzw"),
        "tiff_orientation": save(rgb, "TIFF", exif=exif_bytes(6)),
        "bigtiff": save(rgb, "TIFF", big_tiff=True),
    }
    for orientation in range(1, 9):
        out[f"jpeg_exif_{orientation}"] = save(rgb, "JPEG", exif=exif_bytes(orientation))
    return {f"{name}:{k}": v for k, v in out.items()}


def _xmp_pnginfo(orientation: int) -> PngImagePlugin.PngInfo:
    info = PngImagePlugin.PngInfo()
    info.add_itxt("XML:com.adobe.xmp", f'<x:xmpmeta tiff:Orientation="{orientation}"/>')
    return info


def test_reencoded_real_photos_match_pil_in_every_format(photos):
    checked = 0
    for name, image in photos.items():
        for label, data in variants(name, image).items():
            fmt, width, height, _orientation = probe_bytes(data)
            assert (width, height) == pil_size(data), label
            assert fmt == label.split(":")[1].split("_")[0].replace("bigtiff", "tiff"), label
            checked += 1
    assert checked >= 1000


def test_original_files_match_pil():
    """The bundled files themselves: JPEG/PNG with ICC, XMP and EXIF blocks, GIF, multi-page TIFF."""
    checked = 0
    for path in skimage_images() + mate_photos():
        data = path.read_bytes()
        try:
            expected = pil_size(data)
        except Exception:
            # PIL cannot decode this file (skimage's planar multipage_rgb.tif): the header still parses.
            assert probe_bytes(data)[0] == "tiff", path.name
            continue
        assert probe_bytes(data)[1:3] == expected, path.name
        checked += 1
    assert checked >= 40


def test_exif_orientation_swaps_sides_for_rotations(photos):
    image = photos["chelsea.png"].convert("RGB")  # 320x212: not square
    for orientation in range(1, 9):
        fmt, width, height, recorded = probe_bytes(save(image, "JPEG", exif=exif_bytes(orientation)))
        assert recorded == orientation
        assert (width, height) == (image.size[::-1] if orientation >= 5 else image.size)


def test_long_exif_is_read_past_the_first_4kib(photos):
    data = save(photos["coffee.png"].convert("RGB"), "JPEG", exif=exif_bytes(6, maker_note=40_000))
    assert data.find(b"\xff\xc0") > HEAD_BYTES
    assert probe_bytes(data) == ("jpeg", 213, 320, 6)


def test_gif_size_grows_to_a_frame_beyond_the_logical_screen(photos):
    data = bytearray(save(photos["astronaut.png"].convert("RGB").quantize(32, method=Image.Quantize.FASTOCTREE), "GIF"))
    struct.pack_into("<HH", data, 6, 100, 50)  # shrink the logical screen below the frame
    assert probe_bytes(bytes(data))[1:3] == pil_size(bytes(data)) == (320, 320)


def test_top_down_bmp_reports_positive_height(photos):
    data = bytearray(save(photos["coffee.png"].convert("RGB"), "BMP"))
    (height,) = struct.unpack_from("<i", data, 22)
    struct.pack_into("<i", data, 22, -height)
    assert probe_bytes(bytes(data))[1:3] == pil_size(bytes(data)) == (320, 213)


def png_header(width: int, height: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = b"IDAT" + zlib.compress(b"\x00" * 16)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat)))


@pytest.mark.parametrize("width,height,reason", [
    (100_000, 100_000, "absurd_dimensions"),
    (70_000, 10, "absurd_dimensions"),      # a side above 65,535
    (20_000, 20_000, "absurd_dimensions"),  # 4e8 pixels > 2**28
    (0, 50, "zero_dimensions"),
])
def test_absurd_and_zero_sizes_are_named(width, height, reason):
    with pytest.raises(ProbeError) as err:
        probe_bytes(png_header(width, height))
    assert (err.value.reason, err.value.format, err.value.width, err.value.height) == (reason, "png", width, height)


def test_largest_plausible_size_is_accepted():
    assert probe_bytes(png_header(16384, 16384))[1:3] == (16384, 16384)
    assert 16384 * 16384 == MAX_PIXELS


@pytest.mark.parametrize("data,reason", [
    (b"this is not an image at all, just text", "unknown_format"),
    (bytes(range(256)) * 8, "unknown_format"),
    (b"\xff\xd8", "truncated_image_header"),
    (b"\x89PNG\r\n\x1a\n\x00\x00", "truncated_image_header"),
    (b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00", "truncated_image_header"),
    (b"\xff\xd8\xff\xda\x00\x08\x01\x01\x00\x00\x3f\x00", "corrupt_image_header"),  # scan data before any frame
    (b"GIF89a\x10\x00\x10\x00\x00\x00\x00;", "corrupt_image_header"),  # trailer, no image
    (b"BM" + bytes(12) + struct.pack("<I", 99) + bytes(20), "corrupt_image_header"),  # unknown BMP header
])
def test_damaged_headers_are_named(data, reason):
    with pytest.raises(ProbeError) as err:
        probe_bytes(data)
    assert err.value.reason == reason


def test_truncated_real_jpeg_is_not_reported_ok(photos):
    data = save(photos["rocket.jpg"], "JPEG", exif=exif_bytes(1, maker_note=8_000))
    cut = data[:data.find(b"\xff\xc0")]  # ends just before the frame header
    with pytest.raises(ProbeError) as err:
        probe(cut[:HEAD_BYTES], len(cut), lambda offset, n: cut[offset:offset + n])
    assert err.value.reason == "truncated_image_header"
