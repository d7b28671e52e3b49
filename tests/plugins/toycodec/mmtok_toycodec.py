"""A toy image codec registered with mmtok through the `mmtok.codecs` entry-point group.

Each 8x8 patch becomes the index of the nearest colour (squared distance, ties to the lower index) of a 64-entry
palette to the patch's mean colour; decoding paints each patch in its palette colour. The checkpoint directory holds
`config.json` ({"pixels_per_code": 8, "codebook_size": 64}) and `palette.safetensors` (one float32 tensor
`palette` [64, 3] in [0, 1]).

Every number is computed per patch, with no matrix product whose kernel could depend on the batch size, so an
image's codes are the same in any batch (mmtok merges bytes that do not depend on the world size only then).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mmtok.codecs.base import (
    Codec,
    PrecisionContract,
    checkpoint_fingerprint,
    refuse_non_finite,
)
from mmtok.errors import MmtokError

# What mmtok reads from the module before loading anything (mmtok.codecs.base.CodecPlugin).
MODALITY = "image"
TOKENIZER_TYPE = "ToyImage"  # the `type` `mmtok tokenizer build` writes into tokenizer_config.json

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "palette.safetensors"


class ToyImageCodec(Codec):
    name = "toy-image"
    modality = "image"
    precision = PrecisionContract(tf32_matmul=False, tf32_conv=False)

    def __init__(self, palette: torch.Tensor, pixels_per_code: int):
        super().__init__()
        self.register_buffer("palette", palette.float())
        self.codebook_size = int(palette.shape[0])
        self.pixels_per_code = pixels_per_code
        self.resize_defaults = None  # the plan's resize rule as it is

    @property
    def device(self) -> torch.device:
        return self.palette.device

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        pixels = torch.as_tensor(pixels)
        if pixels.dtype != torch.uint8 or pixels.ndim != 4:
            raise MmtokError(f"toy-image: encode takes uint8 [B, H, W, 3], got {pixels.dtype} {list(pixels.shape)}")
        if pixels.shape[1] == 3 and pixels.shape[-1] != 3:
            pixels = pixels.permute(0, 2, 3, 1)
        batch, height, width, _ = pixels.shape
        side = self.pixels_per_code
        if height % side or width % side:
            raise MmtokError(f"toy-image: {height}x{width} is not a multiple of {side}")
        patches = pixels.to(self.device).float().reshape(batch, height // side, side, width // side, side, 3)
        means = patches.mean(dim=(2, 4)) / 255.0  # [B, h, w, 3]
        distances = ((means[..., None, :] - self.palette) ** 2).sum(-1)  # [B, h, w, codebook]
        return distances.argmin(-1).to(torch.int32)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        codes = torch.as_tensor(codes, device=self.device).long()
        colours = self.palette[codes] * 2 - 1  # [B, h, w, 3] in the [-1, 1] scale
        side = self.pixels_per_code
        return colours.permute(0, 3, 1, 2).repeat_interleave(side, 2).repeat_interleave(side, 3)


def checkpoint_paths(directory: Path) -> list[Path]:
    """The files whose bytes make the codes (fingerprinted into every output)."""
    return [Path(directory) / CONFIG_FILE, Path(directory) / WEIGHTS_FILE]


def load(directory: Path, device: torch.device) -> ToyImageCodec:
    config_path, weights_path = checkpoint_paths(directory)
    try:
        config = json.loads(config_path.read_text("utf-8"))
        state = load_file(str(weights_path))
    except (OSError, ValueError) as err:
        raise MmtokError(f"toy-image: cannot read the checkpoint in {directory}: {err}") from None
    if set(state) != {"palette"} or state["palette"].ndim != 2 or state["palette"].shape[1] != 3:
        raise MmtokError(f"{weights_path}: expected one tensor 'palette' [N, 3]")
    if config.get("codebook_size") != state["palette"].shape[0] or config.get("pixels_per_code") not in (8, 16):
        raise MmtokError(f"{config_path}: codebook_size must be the palette's length and pixels_per_code 8 or 16")
    refuse_non_finite(state, weights_path)
    codec = ToyImageCodec(state["palette"], int(config["pixels_per_code"])).to(device)
    codec.checkpoint_sha256 = checkpoint_fingerprint(checkpoint_paths(directory))
    return codec


def write_random_checkpoint(directory, config=None, seed: int = 0) -> Path:
    """A checkpoint with a random palette (seeded), for tests."""
    config = {"pixels_per_code": 8, "codebook_size": 64, **(config or {})}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    save_file({"palette": torch.rand(config["codebook_size"], 3, generator=generator)}, str(directory / WEIGHTS_FILE))
    (directory / CONFIG_FILE).write_text(json.dumps(config), "utf-8")
    return directory
