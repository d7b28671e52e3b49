"""Image decoding as every stage does it: PIL decode, EXIF orientation, one RGB conversion, bicubic resize.

The encode loaders, the codec CLI and the reconstruction benchmark all go through these functions, so
an image gets the same pixels wherever it is tokenized. Nothing here changes pixels for speed (no JPEG
draft mode, no reduced decoding).
"""

from __future__ import annotations

import io
import warnings

import numpy as np
from PIL import Image, ImageOps

from mmtok.errors import Skip

# Pixel count above which a decode is refused as a decompression bomb. The plan's max-pixels filter
# drops such images long before; this guards against files whose header lies.
MAX_DECODE_PIXELS = 16384 * 16384
WHITE = (255, 255, 255)


class ImageDecodeError(Skip):
    """An image that cannot be turned into RGB pixels; `reason` is a short counted name."""


def open_image(data: bytes) -> Image.Image:
    """Decode image bytes fully (first frame), apply EXIF orientation. Raises ImageDecodeError."""
    image = decode_stored(data)
    try:
        return ImageOps.exif_transpose(image)
    except Exception as err:
        raise ImageDecodeError("exif_error", f"{type(err).__name__}: {err}") from None


def decode_stored(data: bytes) -> Image.Image:
    """Decode image bytes fully (first frame) as stored: no EXIF orientation. Raises ImageDecodeError;
    an image of more than MAX_DECODE_PIXELS is refused before its pixels are decoded."""
    if not data:
        raise ImageDecodeError("empty_file")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size
            if width * height > MAX_DECODE_PIXELS:
                raise ImageDecodeError("decompression_bomb", f"{width}x{height}")
            image.load()
    except ImageDecodeError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
        raise ImageDecodeError("decompression_bomb", str(err)) from None
    except Exception as err:  # PIL raises many types (OSError, SyntaxError, ValueError...) for bad bytes
        raise ImageDecodeError("decode_error", f"{type(err).__name__}: {err}") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """Convert any PIL mode to 8-bit RGB the same way every time.

    Transparency is composited onto white; 16/32-bit integer images are scaled (not clipped) to
    8 bits; CMYK and YCbCr use PIL's conversion; grayscale is replicated to three channels.
    """
    mode = image.mode
    if mode == "RGB":
        return image
    if mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        mode = image.mode
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I"):
        array = np.asarray(image, dtype=np.int64)
        bits = 16 if mode.startswith("I;16") or array.max(initial=0) <= 65535 else 32
        image = Image.fromarray((np.clip(array, 0, 2**bits - 1) >> (bits - 8)).astype(np.uint8), "L")
        mode = "L"
    if mode == "F":
        array = np.asarray(image, dtype=np.float32)
        image = Image.fromarray(np.clip(np.nan_to_num(array), 0, 255).astype(np.uint8), "L")
        mode = "L"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, WHITE + (255,))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def decode_rgb(data: bytes) -> Image.Image:
    """Bytes -> oriented RGB PIL image. Raises ImageDecodeError with a reason."""
    return to_rgb(open_image(data))


def resize_rgb(image: Image.Image, height: int, width: int) -> np.ndarray:
    """Bicubic resize to (height, width); returns uint8 HWC. A no-op when the size already matches."""
    if image.size != (width, height):
        image = image.resize((width, height), Image.BICUBIC)
    return np.asarray(image, dtype=np.uint8)


def load_rgb_file(path: str) -> Image.Image:
    with open(path, "rb") as handle:
        return decode_rgb(handle.read())
