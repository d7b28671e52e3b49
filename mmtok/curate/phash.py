"""The perceptual hash of an image: 64 bits, equal to `imagehash.phash` (ImageHash 4.3.x) for every image.

The algorithm (`ALGORITHM`): the image as stored (first frame, no EXIF orientation, as `Image.open` gives it
to imagehash), converted to 8-bit grayscale by Pillow, resized to 32x32 with Pillow's Lanczos filter, a 2-D
type-II DCT (SciPy's fftpack, rows then columns, unnormalized), the top-left 8x8 coefficients compared with
their median: bit = coefficient > median, row-major, the first bit the most significant of the uint64.
Each step is the same library call imagehash makes, so the bits agree exactly, ties at the median included;
the decode is mmtok's own (`decode_stored`: bounded pixels, a named reason for bad bytes).

Two hashes of different algorithm ids are never compared (`mmtok dedup` refuses): a change to any step
above is a new id.
"""

from __future__ import annotations

import hashlib

import numpy as np
from PIL import Image

from mmtok.media.images import ImageDecodeError, decode_stored

ALGORITHM = "phash-imagehash-4.3"  # the id stored with every hash table; see the module docstring
HASH_SIZE = 8  # 8x8 low-frequency coefficients: 64 bits
HIGHFREQ_FACTOR = 4  # the DCT input is HASH_SIZE * 4 = 32 pixels square


def phash_of_image(image: Image.Image) -> int:
    """The 64-bit pHash of a decoded PIL image (as an unsigned int)."""
    from scipy.fftpack import dct  # imagehash's DCT; scipy.fft's differs in the last bits, which can flip ties

    side = HASH_SIZE * HIGHFREQ_FACTOR
    pixels = np.asarray(image.convert("L").resize((side, side), Image.Resampling.LANCZOS))
    coefficients = dct(dct(pixels, axis=0), axis=1)[:HASH_SIZE, :HASH_SIZE]
    bits = coefficients > np.median(coefficients)
    return int.from_bytes(np.packbits(bits).tobytes(), "big")


def image_hashes(data: bytes) -> tuple[int, bytes]:
    """(pHash, sha256 digest) of encoded image bytes. Raises ImageDecodeError (a Skip) for bytes that do not
    decode; the sha256 is of the bytes as stored, so equal files are found even where the pHash is off."""
    digest = hashlib.sha256(data).digest()
    image = decode_stored(data)
    try:
        return phash_of_image(image), digest
    except Exception as err:  # a mode Pillow decodes but cannot convert to grayscale
        raise ImageDecodeError("decode_error", f"{type(err).__name__}: {err}") from None


def hex64(value: int) -> str:
    """A hash as imagehash prints it: 16 lowercase hex digits."""
    return f"{value:016x}"
