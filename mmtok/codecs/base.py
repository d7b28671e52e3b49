"""What every codec shares: the precision contract, the common interface, and the registry.

A codec module (emu35.py, emu3.py, wavtokenizer.py) provides:
  load(checkpoint_dir, device) -> Codec          strict loading of the official files
  write_random_checkpoint(directory, config=None, seed=0) -> Path
                                                  a random-weight checkpoint in the official format
                                                  (tiny documented config by default; for tests)
Image codecs encode uint8 [B, H, W, 3] (or [B, 3, H, W]) -> int32 codes [B, H/p, W/p] and decode
codes -> float32 [B, 3, H, W] in the model's [-1, 1] scale, unclamped. Audio codecs encode
float32 [B, T] at their sample rate plus valid lengths -> int32 codes [B, ceil(T/hop)] and decode
codes -> float32 [B, T].
"""

from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from mmtok.errors import MmtokError

REFUSED_DTYPES = ("bfloat16", "bf16", "float16", "fp16", "half")


@dataclass(frozen=True)
class PrecisionContract:
    """The numeric settings a codec's codes depend on; applied before encoding, recorded in outputs.

    TF32 flags use PyTorch's fp32_precision API (mixing it with the legacy allow_tf32 flags is an
    error in torch >= 2.9). They only matter on CUDA; on CPU the contract is recorded all the same.
    """

    tf32_matmul: bool
    tf32_conv: bool
    tf32_rnn: bool = False
    dtype: str = "float32"
    deterministic: bool = True

    def apply(self) -> None:
        def mode(flag: bool) -> str:
            return "tf32" if flag else "ieee"

        torch.backends.cuda.matmul.fp32_precision = mode(self.tf32_matmul)
        torch.backends.cudnn.conv.fp32_precision = mode(self.tf32_conv)
        torch.backends.cudnn.rnn.fp32_precision = mode(self.tf32_rnn)
        torch.backends.cudnn.benchmark = False  # autotuning may pick different kernels run to run
        torch.backends.cudnn.deterministic = self.deterministic

    def to_dict(self) -> dict:
        return asdict(self)


def refuse_low_precision(dtype: str, codec: str) -> None:
    """Refuse bf16/fp16 encoding: argmax/nearest-code selection flips codes at reduced precision."""
    if str(dtype).lower().replace("torch.", "") in REFUSED_DTYPES:
        raise MmtokError(
            f"{codec}: {dtype} encoding is refused. Codes are an argmax over the codebook, and reduced "
            "precision moves the logits enough to flip the winner (about 7% of Emu3.5 codes in bf16 vs "
            "0.5% for TF32), so the tokens would not match the corpus made with this codec's contract. "
            "Use float32 (the default)."
        )


def refuse_non_finite(state: Mapping[str, torch.Tensor], source, name: Callable[[str], str] = str) -> None:
    """MmtokError naming the first floating-point tensor of `state` (read from `source`) that holds NaN or
    Inf once in float32, the dtype every codec runs in. A loader calls it before the weights reach the model:
    one NaN weight turns every latent into NaN, and the argmax over NaN logits is code 0 for every input -- a
    whole corpus of wrong tokens, exit 0."""
    for key, tensor in state.items():
        if not tensor.is_floating_point():
            continue
        tensor = tensor.float()  # as the model holds it: a float64 1e300 is finite, and Inf in float32
        if not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise MmtokError(f"{source}: tensor {name(key)!r} holds {bad:,} non-finite values (NaN or Inf) of "
                             f"{tensor.numel():,}; every code would be wrong -- the checkpoint is damaged (copy "
                             "it again from its source)")


def check_state_dict(expected: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor],
                     checkpoint_path: Path, config_path: Path) -> None:
    """Raise MmtokError naming the first missing key, unexpected key, or shape mismatch (compared before any
    weight is copied: a model built on the meta device costs no memory)."""
    missing = [key for key in expected if key not in state]
    if missing:
        raise MmtokError(f"{checkpoint_path}: key {missing[0]!r}, required by the architecture in {config_path}, "
                         f"is missing ({len(missing)} missing in all); the checkpoint does not match the config")
    unexpected = [key for key in state if key not in expected]
    if unexpected:
        raise MmtokError(f"{checkpoint_path}: key {unexpected[0]!r} is not used by the architecture in "
                         f"{config_path} ({len(unexpected)} unused in all); the checkpoint does not match the config")
    for key, tensor in expected.items():
        if tuple(state[key].shape) != tuple(tensor.shape):
            raise MmtokError(f"{checkpoint_path}: {key!r} has shape {list(state[key].shape)} in the checkpoint "
                             f"but {list(tensor.shape)} in the architecture from {config_path}; the checkpoint does "
                             "not match the config")


def finite_latents(latents: torch.Tensor, codec: str) -> torch.Tensor:
    """`latents` when every value is finite; MmtokError otherwise, before any code is chosen from them, so
    nothing of the batch is committed (finite weights can still overflow on extreme inputs or weights)."""
    if not bool(torch.isfinite(latents).all()):
        bad = int((~torch.isfinite(latents)).sum())
        raise MmtokError(f"{codec}: the encoder gave {bad:,} non-finite values (NaN or Inf) of {latents.numel():,} "
                         "for this batch, so its codes would be meaningless; nothing of it was committed. The "
                         "checkpoint's weights overflow float32 (check it against its source)")
    return latents


# ----------------------------------------------------------------------------------------------
# Batch invariance: the numbers of one input never depend on the batch it is in


class BatchInvariantConv:
    """Mixin for nn.Conv1d/2d/3d: on the CPU, float32 convolutions always run oneDNN's kernel.

    PyTorch picks the CPU kernel by shape, batch size and thread count (the im2col "slow" kernel for a
    single small image or, on one thread, a 1x1 conv under 16 images; oneDNN otherwise), and the two
    round differently (~1e-6). Calling oneDNN for every batch size makes a sample's output the same
    whatever its batch or, for audio, its padded length. Other devices and dtypes keep PyTorch's choice.
    Weights and their names are nn.Conv's, so checkpoints load unchanged."""

    def _conv_forward(self, input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (input.device.type == "cpu" and input.dtype == torch.float32 and self.padding_mode == "zeros"
                and not isinstance(self.padding, str) and torch.backends.mkldnn.is_available()
                and torch.backends.mkldnn.enabled):  # a user who turned oneDNN off keeps PyTorch's choice
            return torch.mkldnn_convolution(input, weight, bias, self.padding, self.stride, self.dilation, self.groups)
        return super()._conv_forward(input, weight, bias)


class Conv1d(BatchInvariantConv, nn.Conv1d):
    pass


class Conv2d(BatchInvariantConv, nn.Conv2d):
    pass


class Conv3d(BatchInvariantConv, nn.Conv3d):
    pass


def row_blocks(rows: torch.Tensor, block: int, device_block: int | None = None):
    """Yield (start, count, a [block, D] view or zero-padded copy) over `rows` [N, D]; on an accelerator the
    blocks have `device_block` rows when given (there a small block costs a kernel launch per few rows, and
    a block the same for every batch is all invariance needs).

    Every block has exactly `block` rows, so a matmul over it runs the same kernel whatever N is: BLAS
    libraries pick their kernel by the row count (a vector kernel for one row, others for a few), and a
    row's dot products then round differently. Only the first `count` rows of a block's results are real."""
    if device_block is not None and rows.device.type != "cpu":
        block = device_block
    for start in range(0, len(rows), block):
        chunk = rows[start:start + block]
        count = len(chunk)
        if count < block:
            chunk = torch.cat([chunk, chunk.new_zeros(block - count, *chunk.shape[1:])])
        yield start, count, chunk


class Codec(torch.nn.Module):
    """Base class: subclasses set the attributes below and implement encode/decode."""

    name: str = ""
    modality: str = ""  # "image" or "audio"
    codebook_size: int = 0
    precision: PrecisionContract
    checkpoint_sha256: str = ""

    def describe(self) -> dict:
        """Identity recorded in output metadata and compared on resume."""
        return {
            "name": self.name,
            "modality": self.modality,
            "codebook_size": self.codebook_size,
            "checkpoint_sha256": self.checkpoint_sha256,
            "precision": self.precision.to_dict(),
        }


# name -> module implementing load()/write_random_checkpoint()
CODEC_MODULES = {
    "emu3.5": "mmtok.codecs.emu35",
    "emu3": "mmtok.codecs.emu3",
    "wavtokenizer": "mmtok.codecs.wavtokenizer",
}


def codec_module(name: str):
    if name not in CODEC_MODULES:
        raise MmtokError(f"unknown codec {name!r}; known codecs: {', '.join(CODEC_MODULES)}")
    return importlib.import_module(CODEC_MODULES[name])


def load_codec(name: str, checkpoint: str | os.PathLike, device: str | torch.device = "cpu") -> Codec:
    """Load codec `name` from its official checkpoint directory onto `device`, in eval mode."""
    path = Path(checkpoint)
    if not path.exists():
        raise MmtokError(f"{name}: checkpoint not found: {path}")
    codec = codec_module(name).load(path, torch.device(device))
    return codec.eval()


def checkpoint_sha256(name: str, checkpoint: str | os.PathLike) -> str | None:
    """The `checkpoint_sha256` codec `name` will record for `checkpoint` once loaded, computed without loading
    it (so a run can be compared with an earlier one first); None when a file is missing (the load says so)."""
    paths = codec_module(name).checkpoint_paths(Path(checkpoint))
    return checkpoint_fingerprint(paths) if all(path.is_file() for path in paths) else None


def checkpoint_fingerprint(paths: list[Path]) -> str:
    """sha256 over the given checkpoint files (name + bytes), in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()
