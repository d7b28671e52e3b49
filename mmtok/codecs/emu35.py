"""Emu3.5 vision tokenizer (IBQ): official checkpoint, argmax codes, exact parity with the reference.

An official checkpoint directory (baaivision/Emu3.5, `build_vision_tokenizer("ibq", DIR)`) holds
  config.yaml   the IBQ keyword arguments: n_embed, embed_dim, ddconfig (ch, ch_mult, num_res_blocks,
                attn_resolutions, resolution, in_channels, out_ch, z_channels, double_z, dropout)
  model.ckpt    torch.save of the state dict, or of {"state_dict": state dict}
The modules below are assembled from the config in the taming-transformers layout and named after
the checkpoint's key paths (`encoder.down.4.attn.0.q.weight`, `quantize.embedding.weight`), so
loading is one strict `load_state_dict`.

Codes are the argmax over the codebook of the dot products z.e (no normalisation, no distance),
computed in chunks so no [B, n_embed, h, w] tensor ever exists. The reference takes a softmax over the
whole codebook, its max, a one-hot and an einsum; that path is kept as `encode_reference` for tests
and benchmarks. Both pick the same index: softmax is monotonic, and ties go to the first index.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.nn.functional as F
import yaml
from torch import nn

from mmtok.codecs.base import (
    Codec,
    Conv2d,
    PrecisionContract,
    check_state_dict,
    checkpoint_fingerprint,
    finite_latents,
    refuse_low_precision,
    refuse_non_finite,
    row_blocks,
)
from mmtok.errors import MmtokError, brief
from mmtok.fsutil import atomic_writer, own_file

NAME = "emu3.5"
# The codec contract (mmtok.codecs.base.CodecPlugin; registered in pyproject.toml's mmtok.codecs entry points)
MODALITY = "image"
TOKENIZER_TYPE = "Emu3.5"  # the `type` upstream spells in tokenizer_config.json
CONFIG_FILE = "config.yaml"
CHECKPOINT_FILE = "model.ckpt"

# TF32 on for matmul and conv: the Apertus corpora were tokenized that way (docs/codecs.md).
PRECISION = PrecisionContract(tf32_matmul=True, tf32_conv=True)

# Largest logits block the chunked argmax materializes (elements; 2**24 float32 = 64 MiB).
LOGITS_BUDGET = 1 << 24
# Latent vectors per block, the same for every batch (the last block is zero-padded) so each block's
# matmul runs one kernel whatever the batch; 512 rows x 32,768 codes still run at full speed.
ROW_BLOCK = 512

# Tiny default for tests and the demo: 5 levels (16 pixels per code), attention at the lowest level
# and in the middle blocks, a 1,024 x 32 codebook; about 1.2 M parameters, a 5 MB checkpoint.
TINY_CONFIG = {
    "n_embed": 1024,
    "embed_dim": 32,
    "ddconfig": {
        "double_z": False, "z_channels": 32, "resolution": 128, "in_channels": 3, "out_ch": 3,
        "ch": 32, "ch_mult": [1, 1, 1, 2, 2], "num_res_blocks": 1, "attn_resolutions": [8], "dropout": 0.0,
    },
}
# The published model's architecture (the defaults of the official loader; about 455 M parameters,
# 131,072 x 256 codebook). Used with random weights by the benchmark.
FULL_SIZE_CONFIG = {
    "n_embed": 131072,
    "embed_dim": 256,
    "ddconfig": {
        "double_z": False, "z_channels": 256, "resolution": 256, "in_channels": 3, "out_ch": 3,
        "ch": 256, "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 4, "attn_resolutions": [16], "dropout": 0.0,
    },
}

DDCONFIG_REQUIRED = ("ch", "ch_mult", "num_res_blocks", "attn_resolutions", "resolution", "in_channels",
                     "out_ch", "z_channels")
# Optional keys the reference accepts, with the only value this implementation supports (None: any
# value, it has no effect in eval mode). double_z defaults to True in the reference, where it cannot
# work with quant_conv either.
DDCONFIG_OPTIONAL = {"double_z": False, "dropout": None, "resamp_with_conv": True, "give_pre_end": False}
TOP_REQUIRED = ("n_embed", "embed_dim", "ddconfig")
TOP_OPTIONAL = {  # IBQ keyword arguments: training-only (None), or changing codes unless at this value
    "beta": None, "use_entropy_loss": None, "entropy_temperature": None, "sample_minimization_weight": None,
    "batch_maximization_weight": None, "l2_normalize": False, "cosine_similarity": False, "remap": None,
}


# ----------------------------------------------------------------------------------------------
# Building blocks (taming-transformers layout; attribute names are checkpoint key components)


def swish(x: torch.Tensor) -> torch.Tensor:
    # Written as in the reference rather than F.silu, whose fused kernel rounds differently.
    return x * torch.sigmoid(x)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


def conv3x3(in_channels: int, out_channels: int, stride: int = 1) -> Conv2d:
    return Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1 if stride == 1 else 0)


class ResnetBlock(nn.Module):
    """norm, swish, conv, norm, swish, conv, plus a 1x1 shortcut when the channel count changes."""

    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = conv3x3(in_channels, out_channels)
        self.norm2 = group_norm(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels)
        if in_channels != out_channels:
            self.nin_shortcut = Conv2d(in_channels, out_channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))  # dropout sits here in training; identity in eval
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over all spatial positions, 1x1 convs for q, k, v and output."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = Conv2d(channels, channels, kernel_size=1)
        self.k = Conv2d(channels, channels, kernel_size=1)
        self.v = Conv2d(channels, channels, kernel_size=1)
        self.proj_out = Conv2d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, channels, height, width = x.shape
        h = self.norm(x)
        q = self.q(h).reshape(batch, channels, -1).transpose(1, 2)  # [b, hw, c]
        k = self.k(h).reshape(batch, channels, -1)  # [b, c, hw]
        v = self.v(h).reshape(batch, channels, -1)  # [b, c, hw]
        # Explicit bmm + softmax, as the reference computes it (fused attention kernels round differently).
        weights = torch.softmax(torch.bmm(q, k) * channels ** (-0.5), dim=2)  # [b, query, key]
        out = torch.bmm(v, weights.transpose(1, 2)).reshape(batch, channels, height, width)
        return x + self.proj_out(out)


class Downsample(nn.Module):
    """Stride-2 3x3 conv after a zero pad of one pixel on the right and bottom only."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv3x3(channels, channels, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0.0))


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling, then a 3x3 conv."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = conv3x3(channels, channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(F.interpolate(x, scale_factor=2.0, mode="nearest"))


class Level(nn.Module):
    """One resolution level: `count` ResNet blocks, each followed by attention if the level has it.

    The encoder adds `downsample`, the decoder `upsample` (names as in the checkpoint)."""

    def __init__(self, in_channels: int, out_channels: int, count: int, attention: bool):
        super().__init__()
        self.block = nn.ModuleList()
        self.attn = nn.ModuleList()
        for _ in range(count):
            self.block.append(ResnetBlock(in_channels, out_channels))
            in_channels = out_channels
            if attention:
                self.attn.append(AttnBlock(out_channels))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.block):
            h = block(h)
            if len(self.attn):
                h = self.attn[index](h)
        return h


class Middle(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.block_1 = ResnetBlock(channels, channels)
        self.attn_1 = AttnBlock(channels)
        self.block_2 = ResnetBlock(channels, channels)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.block_2(self.attn_1(self.block_1(h)))


class Encoder(nn.Module):
    """RGB [B, 3, H, W] -> [B, z_channels, H/2**(L-1), W/2**(L-1)] for L = len(ch_mult) levels.

    Attention placement follows the config's `resolution`, not the image size: the level counter
    starts at `resolution` and halves per level."""

    def __init__(self, *, ch: int, ch_mult: list[int], num_res_blocks: int, attn_resolutions: list[int],
                 resolution: int, in_channels: int, z_channels: int, **_unused):
        super().__init__()
        self.conv_in = conv3x3(in_channels, ch)
        self.down = nn.ModuleList()
        block_in, level_resolution = ch, resolution
        for index, mult in enumerate(ch_mult):
            level = Level(block_in, ch * mult, num_res_blocks, level_resolution in attn_resolutions)
            block_in = ch * mult
            if index != len(ch_mult) - 1:
                level.downsample = Downsample(block_in)
                level_resolution //= 2
            self.down.append(level)
        self.mid = Middle(block_in)
        self.norm_out = group_norm(block_in)
        self.conv_out = conv3x3(block_in, z_channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for index, level in enumerate(self.down):
            h = level(h)
            if index != len(self.down) - 1:
                h = level.downsample(h)
        h = self.mid(h)
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    """The mirror of the encoder with num_res_blocks + 1 blocks per level; levels run from the last."""

    def __init__(self, *, ch: int, ch_mult: list[int], num_res_blocks: int, attn_resolutions: list[int],
                 resolution: int, out_ch: int, z_channels: int, **_unused):
        super().__init__()
        block_in = ch * ch_mult[-1]
        level_resolution = resolution // 2 ** (len(ch_mult) - 1)
        self.conv_in = conv3x3(z_channels, block_in)
        self.mid = Middle(block_in)
        levels: list[Level] = [None] * len(ch_mult)  # type: ignore[list-item]
        for index in reversed(range(len(ch_mult))):
            level = Level(block_in, ch * ch_mult[index], num_res_blocks + 1, level_resolution in attn_resolutions)
            block_in = ch * ch_mult[index]
            if index != 0:
                level.upsample = Upsample(block_in)
                level_resolution *= 2
            levels[index] = level
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = conv3x3(block_in, out_ch)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.mid(self.conv_in(z))
        for index in reversed(range(len(self.up))):
            h = self.up[index](h)
            if index != 0:
                h = self.up[index].upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class Quantizer(nn.Module):
    """The IBQ codebook: `codes` (chunked argmax), `codes_reference` (official path), `lookup`."""

    def __init__(self, n_embed: int, embed_dim: int):
        super().__init__()
        self.embedding = nn.Embedding(n_embed, embed_dim)

    def codes(self, z: torch.Tensor, budget: int = LOGITS_BUDGET) -> torch.Tensor:
        """int64 [B, h, w]: argmax over the codebook of z.e for each latent vector of z [B, D, h, w].

        Guarantees: the same index as torch.argmax over the full logits row (first maximum on ties,
        first NaN if any); a vector's index does not depend on the other vectors of z (fixed-shape
        blocks); no intermediate larger than `budget` elements besides the inputs."""
        batch, dim, height, width = z.shape
        vectors = z.permute(0, 2, 3, 1).reshape(-1, dim)
        # Not min(len(vectors), ...): one block shape for every batch; a padded block is rows x dim elements.
        rows = max(1, min(ROW_BLOCK, budget // dim))
        columns = max(1, min(self.embedding.num_embeddings, budget // rows))
        best = torch.empty(len(vectors), dtype=torch.int64, device=z.device)
        for start, count, block in row_blocks(vectors, rows):
            best[start:start + count] = self._argmax_rows(block, columns)[:count]
        return best.reshape(batch, height, width)

    def _argmax_rows(self, vectors: torch.Tensor, columns: int) -> torch.Tensor:
        weight = self.embedding.weight
        best_value = torch.full((len(vectors),), float("-inf"), dtype=vectors.dtype, device=vectors.device)
        best_index = torch.zeros(len(vectors), dtype=torch.int64, device=vectors.device)
        for start in range(0, len(weight), columns):
            value, index = (vectors @ weight[start:start + columns].T).max(dim=1)  # first max in the chunk
            # Strictly greater keeps the earlier chunk on ties; a NaN wins once, as in torch.argmax.
            better = (value > best_value) | (value.isnan() & ~best_value.isnan())
            best_value = torch.where(better, value, best_value)
            best_index = torch.where(better, index + start, best_index)
        return best_index

    def codes_reference(self, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The official eval path: logits, softmax over the codebook, max, one-hot, einsum.

        Returns (codes int64 [B, h, w], quantized latents [B, D, h, w]). Materializes three
        [B, n_embed, h, w] tensors; for tests and benchmarks only."""
        weight = self.embedding.weight
        logits = torch.einsum("bdhw,nd->bnhw", z, weight)
        probabilities = torch.softmax(logits, dim=1)
        index = probabilities.max(dim=1, keepdim=True)[1]
        one_hot = torch.zeros_like(logits).scatter_(1, index, 1.0)
        return index[:, 0], torch.einsum("bnhw,nd->bdhw", one_hot, weight)

    def lookup(self, codes: torch.Tensor) -> torch.Tensor:
        """Codebook rows for codes [B, h, w] -> [B, D, h, w]."""
        return self.embedding(codes).permute(0, 3, 1, 2).contiguous()


# ----------------------------------------------------------------------------------------------
# The codec


def pixel_table(device: torch.device) -> torch.Tensor:
    """float32 value of every byte: x / 127.5 - 1 computed in float64, as the reference's numpy code does."""
    values = torch.arange(256, dtype=torch.float64) / 127.5 - 1.0
    return values.to(torch.float32).to(device)


class Emu35Codec(Codec):
    """Emu3.5 IBQ image codec: uint8 RGB -> int32 codes [B, H/16, W/16] -> float32 RGB in [-1, 1] scale."""

    name = NAME
    modality = "image"
    precision = PRECISION

    def __init__(self, config: Mapping):
        super().__init__()
        ddconfig = config["ddconfig"]
        self.encoder = Encoder(**ddconfig)
        self.decoder = Decoder(**ddconfig)
        self.quantize = Quantizer(config["n_embed"], config["embed_dim"])
        self.quant_conv = Conv2d(ddconfig["z_channels"], config["embed_dim"], kernel_size=1)
        self.post_quant_conv = Conv2d(config["embed_dim"], ddconfig["z_channels"], kernel_size=1)
        self.config = copy.deepcopy(dict(config))
        self.codebook_size = int(config["n_embed"])
        self.pixels_per_code = 2 ** (len(ddconfig["ch_mult"]) - 1)
        self.checkpoint_sha256 = ""
        self._pixel_table: torch.Tensor | None = None

    @property
    def device(self) -> torch.device:
        return self.quantize.embedding.weight.device

    def describe(self) -> dict:
        return {**super().describe(), "pixels_per_code": self.pixels_per_code}

    def normalize(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 [B, H, W, 3] or [B, 3, H, W] -> float32 NCHW on the codec's device, x / 127.5 - 1.

        Bit-identical to the reference's float64 route (a 256-entry table gathered by byte value)."""
        pixels = torch.as_tensor(pixels)
        if pixels.dtype != torch.uint8:
            raise MmtokError(f"{NAME}: encode takes uint8 RGB pixels, got {pixels.dtype}; pass the decoded "
                             "image bytes, not normalised floats")
        if pixels.ndim != 4 or 3 not in (pixels.shape[1], pixels.shape[-1]):
            raise MmtokError(f"{NAME}: encode takes a batch [B, H, W, 3] or [B, 3, H, W], got {list(pixels.shape)}")
        if pixels.shape[1] != 3:
            pixels = pixels.permute(0, 3, 1, 2)  # NHWC -> NCHW; a side of 3 cannot be a multiple of 16
        height, width = pixels.shape[2:]
        factor = self.pixels_per_code
        if height % factor or width % factor or not height or not width:
            raise MmtokError(f"{NAME}: image size {height}x{width} is not a multiple of {factor}; resize it "
                             f"first (mmtok.media.resize.target_shape gives the size the pipeline uses)")
        if self._pixel_table is None or self._pixel_table.device != self.device:
            self._pixel_table = pixel_table(self.device)  # cached: no host-device copy per batch
        # Contiguous NCHW like the reference's input, so the convolutions pick the same kernels. A host
        # batch is copied synchronously: the caller may refill its (pinned) buffer as soon as we return.
        return self._pixel_table[pixels.to(self.device).contiguous().int()]

    def _refuse_reduced_precision(self) -> None:
        for parameter in self.parameters():
            if parameter.dtype != torch.float32:
                refuse_low_precision(str(parameter.dtype), NAME)
                raise MmtokError(f"{NAME}: parameters are {parameter.dtype}; the codec runs in float32 only")
        if torch.is_autocast_enabled(self.device.type):
            refuse_low_precision(str(torch.get_autocast_dtype(self.device.type)), NAME)

    @torch.no_grad()
    def latents(self, pixels: torch.Tensor) -> torch.Tensor:
        """The quantizer's input (quant_conv output), float32 [B, embed_dim, H/16, W/16]."""
        self._refuse_reduced_precision()
        return finite_latents(self.quant_conv(self.encoder(self.normalize(pixels))), NAME)

    @torch.no_grad()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """uint8 RGB batch of one shape -> int32 codes [B, H/16, W/16] (chunked argmax; bounded memory)."""
        return self.quantize.codes(self.latents(pixels)).to(torch.int32)

    @torch.no_grad()
    def encode_reference(self, pixels: torch.Tensor) -> torch.Tensor:
        """Same contract as `encode`, through the official softmax/one-hot path (tests, benchmarks)."""
        return self.quantize.codes_reference(self.latents(pixels))[0].to(torch.int32)

    @torch.no_grad()
    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes [B, h, w] -> float32 RGB [B, 3, 16h, 16w] in the model's [-1, 1] scale, unclamped."""
        codes = torch.as_tensor(codes, device=self.device)
        if codes.ndim != 3 or codes.dtype.is_floating_point or codes.dtype == torch.bool:
            raise MmtokError(f"{NAME}: decode takes integer codes [B, h, w], got {codes.dtype} {list(codes.shape)}")
        if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= self.codebook_size):
            raise MmtokError(f"{NAME}: codes must lie in [0, {self.codebook_size}), got "
                             f"[{int(codes.min())}, {int(codes.max())}]")
        self._refuse_reduced_precision()
        return self.decoder(self.post_quant_conv(self.quantize.lookup(codes.long())))


# ----------------------------------------------------------------------------------------------
# Loading and writing the official files


def load(checkpoint_dir: Path, device: str | torch.device = "cpu", dtype: str = "float32") -> Emu35Codec:
    """Load the official checkpoint directory strictly (every key used, none missing, shapes equal).

    Raises MmtokError naming the file and the first offending key; bf16/fp16 are refused."""
    refuse_low_precision(dtype, NAME)
    if str(dtype).replace("torch.", "") not in ("float32", "fp32"):
        raise MmtokError(f"{NAME}: dtype {dtype} is not supported; the codec runs in float32")
    directory = Path(checkpoint_dir)
    config_path, checkpoint_path = checkpoint_paths(directory)
    config = read_config(config_path)
    state = read_state_dict(checkpoint_path)
    with torch.device("meta"):  # no random init, no double allocation: weights come from the file
        codec = Emu35Codec(config)
    check_state_dict(codec.state_dict(), state, checkpoint_path, config_path)
    refuse_non_finite(state, checkpoint_path)
    codec = codec.to_empty(device=torch.device(device))
    codec.load_state_dict(state, strict=True)
    codec.checkpoint_sha256 = checkpoint_fingerprint([config_path, checkpoint_path])
    return codec.eval()


def checkpoint_paths(directory: Path) -> list[Path]:
    """The files whose bytes are the checkpoint's identity (config, weights), each inside `directory`."""
    return [own_file(Path(directory) / name, f"{NAME} checkpoint file") for name in (CONFIG_FILE, CHECKPOINT_FILE)]


def read_config(path: Path) -> dict:
    """config.yaml -> validated dict; MmtokError naming the file and key otherwise."""
    if not path.is_file():
        raise MmtokError(f"{path}: not found; an {NAME} checkpoint directory holds {CONFIG_FILE} and {CHECKPOINT_FILE}")
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise MmtokError(f"{path}: not valid YAML ({brief(err)})") from None
    return validate_config(config, path)


def validate_config(config, path: Path | str = CONFIG_FILE) -> dict:
    """Check keys, types and the values this implementation supports; returns a plain dict copy."""
    config = _check_keys(config, TOP_REQUIRED, TOP_OPTIONAL, path, "the top level")
    ddconfig = _check_keys(config["ddconfig"], DDCONFIG_REQUIRED, DDCONFIG_OPTIONAL, path, "ddconfig")
    ddconfig.setdefault("double_z", True)  # the reference's default, refused below as it would be there
    if ddconfig["double_z"] is not False:
        raise MmtokError(f"{path}: ddconfig.double_z must be false (quant_conv takes z_channels inputs)")
    for key in ("n_embed", "embed_dim"):
        _check_int(config[key], path, key)
    for key in ("ch", "num_res_blocks", "resolution", "z_channels"):
        _check_int(ddconfig[key], path, f"ddconfig.{key}")
    for key in ("in_channels", "out_ch"):
        if ddconfig[key] != 3:
            raise MmtokError(f"{path}: ddconfig.{key} is {ddconfig[key]!r}; this codec encodes RGB (3)")
    for key in ("ch_mult", "attn_resolutions"):
        if not isinstance(ddconfig[key], (list, tuple)) or (key == "ch_mult" and not ddconfig[key]):
            raise MmtokError(f"{path}: ddconfig.{key} must be a list of integers, got {ddconfig[key]!r}")
        for item in ddconfig[key]:
            _check_int(item, path, f"ddconfig.{key}")
    channels = [ddconfig["ch"] * mult for mult in ddconfig["ch_mult"]]
    if any(count % 32 for count in [ddconfig["ch"], *channels]):
        raise MmtokError(f"{path}: channel counts {[ddconfig['ch'], *channels]} must be multiples of 32 "
                         "(GroupNorm with 32 groups)")
    config["ddconfig"] = ddconfig
    return config


def _check_keys(mapping, required, optional: dict, path, where: str) -> dict:
    if not isinstance(mapping, Mapping):
        raise MmtokError(f"{path}: {where} must be a mapping, got {type(mapping).__name__}")
    known = [*required, *optional]
    for key in mapping:
        if key not in known:
            hint = difflib.get_close_matches(str(key), known, n=1)
            raise MmtokError(f"{path}: unknown key {key!r} in {where}"
                             + (f" (did you mean {hint[0]!r}?)" if hint else f"; known keys: {', '.join(known)}"))
    for key in required:
        if key not in mapping:
            raise MmtokError(f"{path}: missing key {key!r} in {where}")
    for key, supported in optional.items():
        if key in mapping and supported is not None and mapping[key] != supported:
            raise MmtokError(f"{path}: {key}={mapping[key]!r} in {where} is not supported (only {supported!r}); "
                             "it changes the codes")
    return dict(mapping)


def _check_int(value, path, key: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise MmtokError(f"{path}: {key} must be a positive integer, got {value!r}")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """model.ckpt (a state dict, or {"state_dict": ...}) read with weights_only=True, on the CPU."""
    if not path.is_file():
        raise MmtokError(f"{path}: not found; an {NAME} checkpoint directory holds {CONFIG_FILE} and {CHECKPOINT_FILE}")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError/EOFError/UnpicklingError/zip errors for bad files
        detail = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise MmtokError(f"{path}: cannot be read by torch.load(weights_only=True): {detail}. The file is "
                         f"truncated or corrupt (compare its size and sha256 with the source and copy it "
                         f"again), or it holds objects other than tensors") from None
    if isinstance(state, Mapping) and "state_dict" in state:
        state = state["state_dict"]
    if not isinstance(state, Mapping):
        raise MmtokError(f"{path}: expected a state dict or {{'state_dict': ...}}, got {type(state).__name__}")
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or not value.is_floating_point():
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise MmtokError(f"{path}: entry {key!r} is {kind}, expected a floating-point tensor")
    return dict(state)


def random_codec(config: Mapping | None = None, seed: int = 0) -> Emu35Codec:
    """A codec with random weights on the CPU (default: TINY_CONFIG), deterministic for (config, seed).

    Weights: PyTorch's default initialisers under `seed` (codebook N(0, 1)), GroupNorm scale
    1 + 0.1 N(0, 1) and shift 0.1 N(0, 1) so a loader that ignores them is caught. The global RNG
    state is left untouched."""
    config = validate_config(copy.deepcopy(dict(config or TINY_CONFIG)))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        codec = Emu35Codec(config)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for module in codec.modules():
            if isinstance(module, nn.GroupNorm):
                module.weight.copy_(1 + 0.1 * torch.randn(module.weight.shape, generator=generator))
                module.bias.copy_(0.1 * torch.randn(module.bias.shape, generator=generator))
    return codec.eval()


def write_random_checkpoint(directory: str | Path, config: Mapping | None = None, seed: int = 0) -> Path:
    """Write config.yaml + model.ckpt ({"state_dict": ...}) of `random_codec(config, seed)` in the
    official layout; returns the directory. Default config: TINY_CONFIG."""
    directory = Path(directory)
    codec = random_codec(config, seed)
    with atomic_writer(directory / CHECKPOINT_FILE) as handle:
        torch.save({"state_dict": codec.state_dict()}, handle)
    with atomic_writer(directory / CONFIG_FILE, "w") as handle:
        yaml.safe_dump(codec.config, handle, sort_keys=False)
    return directory
