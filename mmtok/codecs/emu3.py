"""Emu3 vision tokenizer (BAAI "Emu3VisionVQ", a MoVQ-style VQ-VAE), 8x8 pixels per code.

Loads the official Hugging Face files: `config.json` (ch, ch_mult, num_res_blocks, attn_resolutions as
LEVEL indices, codebook_size, embed_dim, z_channels, double_z, in/out_channels,
temporal_downsample_factor, dropout) and `model.safetensors` with the original BAAI key names
(`encoder.down.{l}.block.{i}.norm1.weight`, `decoder.up.{l}.block.{i}.norm1.conv_y.weight`, ...), so loading
is a strict `load_state_dict`. An optional `preprocessor_config.json` gives the image processor's
min_pixels / max_pixels / spatial_factor (see `resize_defaults`).

Architecture (what the official code computes):
- Encoder: a 2-D taming-style stack on every frame (conv_in; per level `num_res_blocks` ResNet blocks with
  GroupNorm(32, eps 1e-6) and SiLU, single-head attention after each block at the levels listed in
  attn_resolutions, a zero-padded (0,1,0,1) stride-2 3x3 downsample at every level but the last; middle
  res/attn/res; norm_out, SiLU, conv_out), then log2(T) temporal downsamplers (causal 3-D conv, kernel
  (4,3,3), stride (2,1,1), then SiLU) and `num_res_blocks` temporal ResNet blocks (BatchNorm3d in eval
  mode, causal 3x3x3 convs). A causal 3-D conv pads 2 frames at the front of time whatever its kernel.
- An image is a clip of `temporal_downsample_factor` (4) identical frames; time goes 4 -> 2 -> 1.
- quant_conv (causal (3,1,1) conv), then the nearest codebook row by squared L2 distance
  (|x|^2 + |e|^2 - 2 x.e in float32, first index on ties).
- Decoder: the codebook vectors zq and z = post_quant_conv(zq) are stacked along the batch axis through
  the temporal ResNet blocks and log2(T) temporal upsamplers (nearest x2 in time, causal 3x3x3 conv,
  SiLU); then z runs through a 2-D decoder (conv_in, middle, levels from the deepest up with
  `num_res_blocks + 1` blocks and a nearest x2 upsample at every level but 0) whose every norm is a
  spatial norm: GroupNorm(x) * conv_y(zq') + conv_b(zq'), zq' being the frame's zq resized (nearest) to
  the feature size.

Images take two shortcuts that compute the same numbers as the 4-frame reference: the 2-D encoder runs
once per image and its output is repeated over the 4 frames (the reference runs it on 4 identical
frames), and the 2-D decoder runs on frame 0 only, the frame the reference returns for an image (causal
temporal convs make frame 0 depend on nothing later). `encode_frames`/`decode_frames` are the full clip
versions (used for video and to check the temporal path).

Precision contract: strict float32, TF32 off for matmul and convolutions. The nearest-code margins are
small (the official-code golden set has a smallest squared-distance gap of 1.5e-4 against fp32 latent
errors of ~3e-5); TF32's 10-bit mantissa moves latents by ~1e-3 and would flip codes. Weights stored in
bf16/fp16 are upcast to float32 on load; the network always runs in float32.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from mmtok.codecs.base import (
    Codec,
    Conv2d,
    Conv3d,
    PrecisionContract,
    check_state_dict,
    checkpoint_fingerprint,
    finite_latents,
    refuse_non_finite,
    row_blocks,
)
from mmtok.errors import MmtokError, brief
from mmtok.fsutil import own_file

CONFIG_FILE = "config.json"
# The codec contract (mmtok.codecs.base.CodecPlugin; registered in pyproject.toml's mmtok.codecs entry points)
MODALITY = "image"
TOKENIZER_TYPE = "Emu3"  # the `type` upstream spells in tokenizer_config.json
WEIGHTS_FILE = "model.safetensors"
PREPROCESSOR_FILE = "preprocessor_config.json"
PRECISION = PrecisionContract(tf32_matmul=False, tf32_conv=False, dtype="float32", deterministic=True)
# The image processor's defaults (official Emu3VisionVQImageProcessor): used when the checkpoint has no
# preprocessor_config.json. Its smart_resize refuses an aspect ratio above 5.
OFFICIAL_MIN_PIXELS = 512 * 512
OFFICIAL_MAX_PIXELS = 1024 * 1024
MAX_ASPECT = 5.0
# Positions per distance matrix block (CPU: 128 x 32,768 float32 = 16 MiB; a GPU: 2,048, 256 MiB), the same
# for every batch: the last block is zero-padded, so each block's matmul runs one kernel whatever the batch size.
QUANTIZE_CHUNK = 128
QUANTIZE_CHUNK_DEVICE = 2048


@dataclass(frozen=True)
class Emu3Config:
    """The fields of the official config.json that shape the network."""

    ch: int = 256
    ch_mult: tuple[int, ...] = (1, 2, 2, 4)
    num_res_blocks: int = 2
    attn_resolutions: tuple[int, ...] = (3,)
    codebook_size: int = 32768
    embed_dim: int = 4
    z_channels: int = 4
    double_z: bool = False
    in_channels: int = 3
    out_channels: int = 3
    temporal_downsample_factor: int = 4
    dropout: float = 0.0

    @classmethod
    def from_json(cls, data: dict, path: Path | str = CONFIG_FILE) -> "Emu3Config":
        """The fields of config.json `data` this network uses, each checked for its type; MmtokError naming
        the file and the key otherwise (the file comes from a stranger)."""
        if not isinstance(data, dict):
            raise MmtokError(f"emu3: {path}: expected a JSON object, got {type(data).__name__}")
        values = {}
        for field in fields(cls):
            if field.name not in data:
                continue
            value, default = data[field.name], field.default
            if isinstance(value, list):
                value = tuple(value)
            if not _same_kind(value, default):
                raise MmtokError(f"emu3: {path}: {field.name} must be {_kind_name(default)}, got {brief(repr(value))}")
            values[field.name] = value
        return cls(**values)


def _same_kind(value, default) -> bool:
    if isinstance(default, tuple):
        return isinstance(value, tuple) and all(_same_kind(item, default[0]) for item in value)
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(default, bool)
    if isinstance(default, int):
        return isinstance(value, int) and value > 0
    return isinstance(value, (int, float))  # dropout


def _kind_name(default) -> str:
    return ("a list of positive integers" if isinstance(default, tuple) else "true or false"
            if isinstance(default, bool) else "a positive integer" if isinstance(default, int) else "a number")


# The default of write_random_checkpoint: 4 levels (8x downsampling), 32 channels (GroupNorm needs
# multiples of 32), one block per level, attention at the deepest level. About 1.2 M parameters (a 4.9 MB file).
TINY_CONFIG = {"ch": 32, "ch_mult": [1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [3],
               "codebook_size": 32768, "embed_dim": 4, "z_channels": 4}


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)  # the reference's exact expression (F.silu may round differently)


class SpatialNorm(nn.Module):
    """GroupNorm(x) * conv_y(zq) + conv_b(zq), zq resized (nearest) to x's spatial size."""

    def __init__(self, channels: int, zq_channels: int):
        super().__init__()
        self.norm_layer = nn.GroupNorm(32, channels, eps=1e-6)
        self.conv_y = Conv2d(zq_channels, channels, 1)
        self.conv_b = Conv2d(zq_channels, channels, 1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        zq = F.interpolate(zq, size=x.shape[-2:], mode="nearest")
        return self.norm_layer(x) * self.conv_y(zq) + self.conv_b(zq)


def _norm(channels: int, zq_channels: int | None) -> nn.Module:
    return nn.GroupNorm(32, channels, eps=1e-6) if zq_channels is None else SpatialNorm(channels, zq_channels)


def _apply_norm(norm: nn.Module, x: torch.Tensor, zq: torch.Tensor | None) -> torch.Tensor:
    return norm(x) if zq is None else norm(x, zq)


class ResnetBlock(nn.Module):
    """Two 3x3 convs with norm + SiLU before each, and a 1x1 shortcut where the width changes."""

    def __init__(self, in_channels: int, out_channels: int, zq_channels: int | None = None):
        super().__init__()
        self.norm1 = _norm(in_channels, zq_channels)
        self.conv1 = Conv2d(in_channels, out_channels, 3, padding=1)
        self.norm2 = _norm(out_channels, zq_channels)
        self.conv2 = Conv2d(out_channels, out_channels, 3, padding=1)
        if in_channels != out_channels:
            self.nin_shortcut = Conv2d(in_channels, out_channels, 1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor | None = None) -> torch.Tensor:
        h = self.conv1(_silu(_apply_norm(self.norm1, x, zq)))
        h = self.conv2(_silu(_apply_norm(self.norm2, h, zq)))
        shortcut = self.nin_shortcut(x) if hasattr(self, "nin_shortcut") else x
        return shortcut + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all positions, softmax(q^T k / sqrt(C)), residual after proj_out."""

    def __init__(self, channels: int, zq_channels: int | None = None):
        super().__init__()
        self.norm = _norm(channels, zq_channels)
        self.q = Conv2d(channels, channels, 1)
        self.k = Conv2d(channels, channels, 1)
        self.v = Conv2d(channels, channels, 1)
        self.proj_out = Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor, zq: torch.Tensor | None = None) -> torch.Tensor:
        h = _apply_norm(self.norm, x, zq)
        b, c, height, width = x.shape
        q = self.q(h).reshape(b, c, -1)
        k = self.k(h).reshape(b, c, -1)
        v = self.v(h).reshape(b, c, -1)
        weights = torch.softmax(torch.bmm(q.permute(0, 2, 1), k) / (c ** 0.5), dim=2)
        out = torch.bmm(v, weights.permute(0, 2, 1)).reshape(b, c, height, width)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = Conv2d(channels, channels, 3, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class CausalConv3d(nn.Module):
    """Conv3d on [B, C, T, H, W]: 2 frames of zero padding in front of time (whatever the kernel),
    (k - s) spatial padding split with the extra pixel first."""

    def __init__(self, in_channels: int, out_channels: int, kernel: tuple[int, int, int],
                 stride: tuple[int, int, int] = (1, 1, 1)):
        super().__init__()
        pad_h, pad_w = kernel[1] - stride[1], kernel[2] - stride[2]
        self.padding = (pad_w - pad_w // 2, pad_w // 2, pad_h - pad_h // 2, pad_h // 2, 2, 0)
        self.conv = Conv3d(in_channels, out_channels, kernel, stride=stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, self.padding))


class TemporalResnetBlock(nn.Module):
    """BatchNorm3d (running statistics) + SiLU + causal 3x3x3 conv, twice, plus the identity."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm1 = nn.BatchNorm3d(channels)
        self.conv1 = CausalConv3d(channels, channels, (3, 3, 3))
        self.norm2 = nn.BatchNorm3d(channels)
        self.conv2 = CausalConv3d(channels, channels, (3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(_silu(self.norm1(x)))
        return x + self.conv2(_silu(self.norm2(h)))


class TemporalDownsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = CausalConv3d(channels, channels, (4, 3, 3), stride=(2, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x)


class TemporalUpsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = CausalConv3d(channels, channels, (3, 3, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x.repeat_interleave(2, dim=2))  # nearest x2 in time: frames a, a, b, b


def _level_blocks(config: Emu3Config, count: int, level: int, block_in: int, block_out: int,
                  zq_channels: int | None) -> tuple[nn.ModuleList, nn.ModuleList]:
    blocks, attns = nn.ModuleList(), nn.ModuleList()
    for _ in range(count):
        blocks.append(ResnetBlock(block_in, block_out, zq_channels))
        block_in = block_out
        if level in config.attn_resolutions:
            attns.append(AttnBlock(block_out, zq_channels))
    return blocks, attns


def _middle(channels: int, zq_channels: int | None) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels, zq_channels)
    mid.attn_1 = AttnBlock(channels, zq_channels)
    mid.block_2 = ResnetBlock(channels, channels, zq_channels)
    return mid


def _run_level(level: nn.Module, h: torch.Tensor, zq: torch.Tensor | None) -> torch.Tensor:
    for index, block in enumerate(level.block):
        h = block(h, zq)
        if len(level.attn):
            h = level.attn[index](h, zq)
    return h


def _run_middle(mid: nn.Module, h: torch.Tensor, zq: torch.Tensor | None) -> torch.Tensor:
    return mid.block_2(mid.attn_1(mid.block_1(h, zq), zq), zq)


class Encoder(nn.Module):
    def __init__(self, config: Emu3Config):
        super().__init__()
        ch, mult = config.ch, config.ch_mult
        self.conv_in = Conv2d(config.in_channels, ch, 3, padding=1)
        self.down = nn.ModuleList()
        block_in = ch
        for level, factor in enumerate(mult):
            down = nn.Module()
            down.block, down.attn = _level_blocks(config, config.num_res_blocks, level, block_in, ch * factor, None)
            block_in = ch * factor
            if level != len(mult) - 1:
                down.downsample = Downsample(block_in)
            self.down.append(down)
        self.mid = _middle(block_in, None)
        self.norm_out = nn.GroupNorm(32, block_in, eps=1e-6)
        z = 2 * config.z_channels if config.double_z else config.z_channels
        self.conv_out = Conv2d(block_in, z, 3, padding=1)
        steps = int(math.log2(config.temporal_downsample_factor))
        self.time_conv = nn.ModuleList(TemporalDownsample(z) for _ in range(steps))
        self.time_res_stack = nn.Sequential(*(TemporalResnetBlock(z) for _ in range(config.num_res_blocks)))

    def spatial(self, x: torch.Tensor) -> torch.Tensor:
        """[N, 3, H, W] frames -> [N, z, H/8, W/8]."""
        h = self.conv_in(x)
        for down in self.down:
            h = _run_level(down, h, None)
            if hasattr(down, "downsample"):
                h = down.downsample(h)
        h = _run_middle(self.mid, h, None)
        return self.conv_out(_silu(self.norm_out(h)))

    def temporal(self, h: torch.Tensor) -> torch.Tensor:
        """[B, z, T, h, w] -> [B, z, T / temporal_downsample_factor, h, w]."""
        for conv in self.time_conv:
            h = _silu(conv(h))
        return self.time_res_stack(h)


class Decoder(nn.Module):
    def __init__(self, config: Emu3Config):
        super().__init__()
        ch, mult, zq_ch, z = config.ch, config.ch_mult, config.embed_dim, config.z_channels
        self.time_res_stack = nn.Sequential(*(TemporalResnetBlock(z) for _ in range(config.num_res_blocks)))
        steps = int(math.log2(config.temporal_downsample_factor))
        self.time_conv = nn.ModuleList(TemporalUpsample(z) for _ in range(steps))
        block_in = ch * mult[-1]
        self.conv_in = Conv2d(z, block_in, 3, padding=1)
        self.mid = _middle(block_in, zq_ch)
        levels: list[nn.Module] = []
        for level in reversed(range(len(mult))):
            up = nn.Module()
            up.block, up.attn = _level_blocks(config, config.num_res_blocks + 1, level, block_in, ch * mult[level],
                                              zq_ch)
            block_in = ch * mult[level]
            if level != 0:
                up.upsample = Upsample(block_in)
            levels.insert(0, up)
        self.up = nn.ModuleList(levels)  # indexed by level: up[0] is full resolution and runs last
        self.norm_out = SpatialNorm(block_in, zq_ch)
        self.conv_out = Conv2d(block_in, config.out_channels, 3, padding=1)

    def temporal(self, z: torch.Tensor, zq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """z, zq [B, c, t, h, w] -> both [B, c, t * temporal_downsample_factor, h, w] (shared weights)."""
        h = self.time_res_stack(torch.cat((z, zq), dim=0))
        for conv in self.time_conv:
            h = _silu(conv(h))
        return torch.chunk(h, 2, dim=0)

    def spatial(self, z: torch.Tensor, zq: torch.Tensor) -> torch.Tensor:
        """Per frame: z, zq [N, c, h, w] -> [N, out_channels, 8h, 8w]."""
        h = _run_middle(self.mid, self.conv_in(z), zq)
        for level in reversed(range(len(self.up))):
            h = _run_level(self.up[level], h, zq)
            if level != 0:
                h = self.up[level].upsample(h)
        return self.conv_out(_silu(self.norm_out(h, zq)))


class Quantizer(nn.Module):
    def __init__(self, config: Emu3Config):
        super().__init__()
        self.embedding = nn.Embedding(config.codebook_size, config.embed_dim)

    def nearest(self, x: torch.Tensor) -> torch.Tensor:
        """[N, c] -> int64 [N]: argmin of |x|^2 + |e|^2 - 2 x.e (float32), in fixed-shape row blocks, so
        a row's code does not depend on the other rows."""
        codebook = self.embedding.weight
        e_sq = codebook.pow(2).sum(dim=1)
        out = []
        for _, count, rows in row_blocks(x, QUANTIZE_CHUNK, QUANTIZE_CHUNK_DEVICE):
            distance = rows.pow(2).sum(dim=1, keepdim=True) + e_sq - 2 * (rows @ codebook.t())
            out.append(distance.argmin(dim=1)[:count])
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.long, device=x.device)


class Emu3VisionTokenizer(Codec):
    """The Emu3 8x8 vision tokenizer behind the mmtok image-codec interface (see mmtok.codecs.base)."""

    name = "emu3"
    modality = "image"
    pixels_per_code = 8

    def __init__(self, config: Emu3Config, preprocessor: dict | None = None):
        super().__init__()
        if config.embed_dim != config.z_channels:
            raise MmtokError(f"emu3: embed_dim {config.embed_dim} != z_channels {config.z_channels} is not supported")
        self.config = config
        self.codebook_size = config.codebook_size
        self.precision = PRECISION
        self.preprocessor = preprocessor or {}
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)
        self.quantize = Quantizer(config)
        self.quant_conv = CausalConv3d(config.z_channels, config.embed_dim, (3, 1, 1))
        self.post_quant_conv = CausalConv3d(config.embed_dim, config.z_channels, (3, 1, 1))
        self.pixels_per_code = 2 ** (len(config.ch_mult) - 1)

    @property
    def frames(self) -> int:
        return self.config.temporal_downsample_factor

    @property
    def resize_defaults(self) -> dict:
        """The resize rule of the official image processor for this checkpoint (its preprocessor_config.json)."""
        return {"factor": int(self.preprocessor.get("spatial_factor", self.pixels_per_code)),
                "min_pixels": int(self.preprocessor.get("min_pixels", OFFICIAL_MIN_PIXELS)),
                "max_pixels": int(self.preprocessor.get("max_pixels", OFFICIAL_MAX_PIXELS)),
                "max_aspect": MAX_ASPECT}

    def describe(self) -> dict:
        return {**super().describe(), "pixels_per_code": self.pixels_per_code, "config": asdict(self.config)}

    # -- images ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] or [B, 3, H, W] (H, W multiples of 8) -> int32 codes [B, H/8, W/8]."""
        x = _to_model_input(pixels.to(self.quantize.embedding.weight.device), self.pixels_per_code)
        h = self.encoder.spatial(x)  # one pass stands for the 4 identical frames of the reference
        clip = h[:, :, None].expand(-1, -1, self.frames, -1, -1)
        return self._quantize(self.encoder.temporal(clip))[:, 0].to(torch.int32)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, h, w] -> float32 [B, 3, 8h, 8w], frame 0 of the reference decode, model scale, unclamped."""
        z, zq = self._temporal_decode(codes[:, None])
        return self.decoder.spatial(z[:, :, 0], zq[:, :, 0])

    # -- clips (the reference's 5-D path) -----------------------------------------------------------------

    @torch.no_grad()
    def encode_frames(self, x: torch.Tensor) -> torch.Tensor:
        """float32 model-scale frames [B, T, 3, H, W] -> int64 codes [B, T/4, H/8, W/8]."""
        b, t = x.shape[:2]
        h = self.encoder.spatial(x.reshape(b * t, *x.shape[2:]))
        clip = h.reshape(b, t, *h.shape[1:]).permute(0, 2, 1, 3, 4)
        return self._quantize(self.encoder.temporal(clip))

    @torch.no_grad()
    def decode_frames(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, t, h, w] -> float32 [B, 4t, 3, 8h, 8w], every decoded frame."""
        z, zq = self._temporal_decode(codes)
        frames = self.decoder.spatial(_frames_as_batch(z), _frames_as_batch(zq))
        return frames.reshape(z.shape[0], z.shape[2], *frames.shape[1:])

    # -- shared steps -------------------------------------------------------------------------------------

    def latents(self, clip: torch.Tensor) -> torch.Tensor:
        """Encoder output [B, z, t, h, w] -> quantizer input [B, t, c, h, w] (after quant_conv)."""
        return finite_latents(self.quant_conv(clip), "emu3").permute(0, 2, 1, 3, 4)

    def _quantize(self, clip: torch.Tensor) -> torch.Tensor:
        latents = self.latents(clip)
        b, t, c, h, w = latents.shape
        flat = latents.permute(0, 1, 3, 4, 2).reshape(-1, c)
        return self.quantize.nearest(flat).reshape(b, t, h, w)

    def _temporal_decode(self, codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes = codes.to(self.quantize.embedding.weight.device).long()
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise MmtokError(f"emu3: codes must lie in [0, {self.codebook_size}), got "
                             f"{int(codes.min())}..{int(codes.max())}")
        zq = self.quantize.embedding(codes).permute(0, 4, 1, 2, 3)  # [B, c, t, h, w]
        return self.decoder.temporal(self.post_quant_conv(zq), zq)


def _frames_as_batch(clip: torch.Tensor) -> torch.Tensor:
    """[B, c, T, h, w] -> [B*T, c, h, w], frames of one clip consecutive (the reference's order)."""
    b, c, t = clip.shape[:3]
    return clip.permute(0, 2, 1, 3, 4).reshape(b * t, c, *clip.shape[3:])


def _to_model_input(pixels: torch.Tensor, factor: int) -> torch.Tensor:
    """uint8 NHWC/NCHW -> float32 NCHW, x/127.5 - 1 computed in float32 (bit-equal to the processor's
    rescale 1/255 then (x - 0.5)/0.5)."""
    if pixels.dtype != torch.uint8 or pixels.ndim != 4:
        raise MmtokError(f"emu3: expected uint8 [B, H, W, 3] or [B, 3, H, W], got {pixels.dtype} {tuple(pixels.shape)}")
    if pixels.shape[-1] == 3 and pixels.shape[1] != 3:
        pixels = pixels.permute(0, 3, 1, 2)
    elif pixels.shape[1] != 3:
        raise MmtokError(f"emu3: cannot tell the channel axis of shape {tuple(pixels.shape)}")
    height, width = pixels.shape[2:]
    if height % factor or width % factor:
        raise MmtokError(f"emu3: image {height}x{width} is not a multiple of {factor} pixels; resize it first")
    # Contiguous NCHW like the processor's output: a channels-last view would make the convolutions pick
    # other kernels, whose rounding differs (latents moved by up to 1e-3 in a test, against 1.5e-4 margins).
    return pixels.contiguous().float() / 127.5 - 1.0


# ---- loading and random checkpoints -----------------------------------------------------------------------


def load(checkpoint_dir: Path, device: torch.device | str = "cpu") -> Emu3VisionTokenizer:
    """Load config.json + model.safetensors (strict: every key, every shape) in float32, eval mode."""
    from safetensors.torch import load_file

    checkpoint_dir = Path(checkpoint_dir)
    config_path, weights_path = checkpoint_paths(checkpoint_dir)
    preprocessor_path = own_file(checkpoint_dir / PREPROCESSOR_FILE, "emu3 checkpoint file")
    for path in (config_path, weights_path):
        if not path.is_file():
            raise MmtokError(f"emu3: {path} not found (expected the official Hugging Face files "
                             f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    preprocessor = _read_json(preprocessor_path) if preprocessor_path.is_file() else None
    _check_preprocessor(preprocessor, preprocessor_path)
    config = Emu3Config.from_json(_read_json(config_path), config_path)
    try:
        with torch.device("meta"):  # no memory until the file's shapes match: a config of 10^9 channels is one line
            model = Emu3VisionTokenizer(config, preprocessor)
    except (ValueError, RuntimeError, IndexError, ZeroDivisionError) as err:
        raise MmtokError(f"emu3: {config_path}: describes no network this codec builds ({brief(err)})") from None
    try:
        state = load_file(str(weights_path))
    except Exception as err:  # safetensors raises its own SafetensorError (and others) for a damaged file
        raise MmtokError(f"emu3: {weights_path}: not a readable safetensors file ({brief(err)}); it is truncated "
                         "or corrupt -- copy it again from its source") from None
    expected = model.state_dict()
    for key, tensor in state.items():  # an integer weight would load as its float value, silently
        if key in expected and tensor.is_floating_point() != expected[key].is_floating_point():
            raise MmtokError(f"emu3: {weights_path}: tensor {key!r} is {tensor.dtype}, expected {expected[key].dtype}")
    check_state_dict(expected, state, weights_path, config_path)
    refuse_non_finite(state, f"emu3: {weights_path}")
    model = model.to_empty(device="cpu")  # the model holds no buffer outside its state dict: all of it is loaded
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
    model.checkpoint_sha256 = checkpoint_fingerprint([config_path, weights_path])
    return model.to(device).eval()


def checkpoint_paths(directory: Path) -> list[Path]:
    """The files whose bytes are the checkpoint's identity (config, weights), each inside `directory`."""
    return [own_file(Path(directory) / name, "emu3 checkpoint file") for name in (CONFIG_FILE, WEIGHTS_FILE)]


def _check_preprocessor(preprocessor, path: Path) -> None:
    if preprocessor is None:
        return
    if not isinstance(preprocessor, dict):
        raise MmtokError(f"emu3: {path}: expected a JSON object, got {type(preprocessor).__name__}")
    for key in ("spatial_factor", "min_pixels", "max_pixels"):
        value = preprocessor.get(key, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise MmtokError(f"emu3: {path}: {key} must be a positive integer, got {brief(repr(value))}")
    low, high = preprocessor.get("min_pixels", OFFICIAL_MIN_PIXELS), preprocessor.get("max_pixels", OFFICIAL_MAX_PIXELS)
    if low > high:
        raise MmtokError(f"emu3: {path}: min_pixels {low:,} is above max_pixels {high:,}")


def _read_json(path: Path):
    try:
        return json.loads(path.read_bytes())
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise MmtokError(f"emu3: {path}: not valid JSON ({brief(err)})") from None


def write_random_checkpoint(directory: str | Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write a random-weight Emu3 tokenizer in the official layout (config.json, model.safetensors with
    metadata {"format": "pt"}, preprocessor_config.json with the official processor values).

    Default config: TINY_CONFIG (about 1.2 M parameters, 8 px per code, codebook 32,768 x 4). Weights
    use PyTorch's default init under `seed`; the codebook is then redrawn from the mean/std of each
    latent channel measured on a fixed smooth test pattern, so the codes spread over the codebook
    instead of collapsing (as the official near-zero codebook init would make them).
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    values = {**asdict(Emu3Config()), **TINY_CONFIG, **(config or {})}
    cfg = Emu3Config.from_json(values)
    generator = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Emu3VisionTokenizer(cfg).eval()
    _spread_codebook(model, generator)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(directory / WEIGHTS_FILE), metadata={"format": "pt"})
    hf_config = {"architectures": ["Emu3VisionVQModel"], "model_type": "Emu3VisionVQ", "torch_dtype": "float32",
                 **{k: list(v) if isinstance(v, tuple) else v for k, v in asdict(cfg).items()}}
    (directory / CONFIG_FILE).write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    (directory / PREPROCESSOR_FILE).write_text(json.dumps(_official_preprocessor(cfg), indent=2, sort_keys=True) + "\n")
    return directory


def _official_preprocessor(cfg: Emu3Config) -> dict:
    return {"image_processor_type": "Emu3VisionVQImageProcessor", "do_convert_rgb": True, "do_normalize": True,
            "do_rescale": True, "do_resize": True, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
            "min_pixels": OFFICIAL_MIN_PIXELS, "max_pixels": OFFICIAL_MAX_PIXELS, "resample": 3,
            "rescale_factor": 1 / 255, "spatial_factor": 2 ** (len(cfg.ch_mult) - 1),
            "size": {"min_pixels": OFFICIAL_MIN_PIXELS, "max_pixels": OFFICIAL_MAX_PIXELS}}


@torch.no_grad()
def _spread_codebook(model: Emu3VisionTokenizer, generator: torch.Generator) -> None:
    side = 8 * model.pixels_per_code
    ramp = torch.linspace(0, 255, side)
    pattern = torch.stack([ramp[:, None].expand(side, side), ramp[None, :].expand(side, side),
                           (ramp[:, None] + ramp[None, :]) / 2], dim=-1)
    pixels = pattern.round().to(torch.uint8)[None]
    h = model.encoder.spatial(_to_model_input(pixels, model.pixels_per_code))
    clip = h[:, :, None].expand(-1, -1, model.frames, -1, -1)
    latents = model.latents(model.encoder.temporal(clip))
    mean, std = latents.mean(dim=(0, 1, 3, 4)), latents.std(dim=(0, 1, 3, 4)).clamp_min(1e-3)
    noise = torch.randn(model.config.codebook_size, model.config.embed_dim, generator=generator)
    model.quantize.embedding.weight.copy_(mean + std * noise)
