"""A stand-in image "device" for tests and benchmarks -- NOT a real codec.

`StandInCodec` has the image-codec interface (`encode` uint8 [B, H, W, 3] -> int32 [B, H/16, W/16],
`decode`, `describe`, `precision`) and simulates a GPU: `encode` takes `pixels / rate` seconds,
where `rate` is the pixel throughput of a device that encodes `images_per_second` images of 512x512,
and waits with `time.sleep`, which releases the GIL exactly like a CUDA synchronisation does. Its
codes are a deterministic function of the pixels (each 16x16 patch's mean colour quantized to
6/6/5 bits), so output comparisons in tests remain meaningful, and `decode` paints the patch colours
back. It lets the loader/commit overlap be measured on a machine without a GPU.
"""

from __future__ import annotations

import hashlib
import time

import torch

from mmtok.codecs.base import Codec, PrecisionContract

PATCH = 16
REFERENCE_PIXELS = 512 * 512
BITS = (6, 6, 5)  # red, green, blue bits of a code: 2**17 = 131,072 codes like Emu3.5


class StandInCodec(Codec):
    """Simulated image codec; `images_per_second` at 512x512 sets the simulated device speed (0: no wait)."""

    name = "standin"
    modality = "image"
    pixels_per_code = PATCH
    codebook_size = 1 << sum(BITS)
    precision = PrecisionContract(tf32_matmul=False, tf32_conv=False)

    def __init__(self, images_per_second: float = 23.0):
        super().__init__()
        self.images_per_second = float(images_per_second)
        self.checkpoint_sha256 = hashlib.sha256(b"mmtok-standin-v1").hexdigest()

    def seconds_for(self, pixels: int) -> float:
        """Simulated device time for a batch of `pixels` pixels in total."""
        if self.images_per_second <= 0:
            return 0.0
        return pixels / (REFERENCE_PIXELS * self.images_per_second)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        if pixels.shape[1] == 3 and pixels.shape[-1] != 3:
            pixels = pixels.permute(0, 2, 3, 1)
        batch, height, width, _ = pixels.shape
        patches = pixels.reshape(batch, height // PATCH, PATCH, width // PATCH, PATCH, 3).float().mean(dim=(2, 4))
        levels = torch.tensor([(1 << b) - 1 for b in BITS], dtype=torch.float32)
        quantized = torch.round(patches / 255.0 * levels).to(torch.int32)
        codes = (quantized[..., 0] << (BITS[1] + BITS[2])) | (quantized[..., 1] << BITS[2]) | quantized[..., 2]
        remaining = self.seconds_for(batch * height * width) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)  # the simulated device is busy; the GIL is free for the loaders
        return codes

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = torch.as_tensor(codes).to(torch.int64)
        channels = [(codes >> (BITS[1] + BITS[2])) & 63, (codes >> BITS[2]) & 63, codes & 31]
        rgb = torch.stack([c.float() / ((1 << b) - 1) for c, b in zip(channels, BITS, strict=True)], dim=1) * 2 - 1
        return rgb.repeat_interleave(PATCH, dim=2).repeat_interleave(PATCH, dim=3)

    def describe(self) -> dict:
        return {**super().describe(), "pixels_per_code": PATCH, "images_per_second_512": self.images_per_second}
