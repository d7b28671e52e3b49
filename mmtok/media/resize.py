"""The target-shape rule: the size an image is resized to before encoding.

`h = round(H/f)*f, w = round(W/f)*f`; if `h*w > MAX`: `s = sqrt(H*W/MAX)`, `h = floor(H/s/f)*f`,
`w = floor(W/s/f)*f`; if `h*w < MIN`: `s = sqrt(MIN/(H*W))`, `h = ceil(H*s/f)*f`, `w = ceil(W*s/f)*f`;
no side below f. `round` is round-half-to-even (Python's and NumPy's). f is the codec's pixels per
code: 16 for Emu3.5, 8 for Emu3. The plan (vectorized) and every other stage (scalar) call this one
function, so the shape an image is planned at is the shape it is encoded at.
"""

from __future__ import annotations

import numpy as np


def target_shapes(height: np.ndarray, width: np.ndarray, *, min_pixels: int, max_pixels: int,
                  factor: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Vectorized rule over arrays of source heights and widths -> (target heights, target widths), int64."""
    H = np.asarray(height, dtype=np.float64)
    W = np.asarray(width, dtype=np.float64)
    h = np.rint(H / factor) * factor
    w = np.rint(W / factor) * factor
    with np.errstate(divide="ignore", invalid="ignore"):
        too_big = h * w > max_pixels
        s = np.sqrt(H * W / max_pixels)
        h = np.where(too_big, np.floor(H / s / factor) * factor, h)
        w = np.where(too_big, np.floor(W / s / factor) * factor, w)
        too_small = h * w < min_pixels
        s = np.sqrt(min_pixels / (H * W))
        h = np.where(too_small, np.ceil(H * s / factor) * factor, h)
        w = np.where(too_small, np.ceil(W * s / factor) * factor, w)
    h = np.maximum(np.nan_to_num(h, nan=factor, posinf=factor), factor)
    w = np.maximum(np.nan_to_num(w, nan=factor, posinf=factor), factor)
    return h.astype(np.int64), w.astype(np.int64)


def target_shape(height: int, width: int, *, min_pixels: int, max_pixels: int, factor: int = 16) -> tuple[int, int]:
    """The rule for one image -> (target height, target width)."""
    h, w = target_shapes(np.array([height]), np.array([width]), min_pixels=min_pixels,
                         max_pixels=max_pixels, factor=factor)
    return int(h[0]), int(w[0])
