"""What every codec shares: the precision contract, the contract a codec meets (`CodecPlugin`, `Codec`), and
the helpers for it (strict loading, batch invariance).

A codec is a plugin: a module registered in the `mmtok.codecs` entry-point group (mmtok/codecs/registry.py, the
built-in emu35.py, emu3.py and wavtokenizer.py included) that provides what `CodecPlugin` declares; its `load`
returns a `Codec`. Image codecs encode uint8 [B, H, W, 3] (or [B, 3, H, W]) -> int32 codes [B, H/p, W/p] and
decode codes -> float32 [B, 3, H, W] in the model's [-1, 1] scale, unclamped. Audio codecs encode float32 [B, T]
at their sample rate plus valid lengths -> (int32 codes [B, ceil(T/hop)], valid code counts [B]) and decode
codes -> float32 [B, T]. docs/write-a-codec.md shows a whole plugin.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol

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
    """What a loaded codec is: subclasses set the attributes below and implement `encode` and `decode`.

    Every stage relies on these and nothing else (`check_codec` checks them when a codec is loaded)."""

    name: str = ""  # the registered name; recorded in every output and compared on resume
    modality: str = ""  # "image" or "audio"
    codebook_size: int = 0  # codes lie in [0, codebook_size); at most the vocabulary's block for the modality
    precision: PrecisionContract  # applied before encoding, recorded in outputs
    checkpoint_sha256: str = ""  # `checkpoint_fingerprint` of the plugin's `checkpoint_paths`; set by `load`
    # image codecs
    pixels_per_code: int = 0  # side of the square of pixels one code stands for (the plan's --factor)
    resize_defaults: dict | None = None  # the codec's own resize rule, where it has one (bench reconstruct)
    # audio codecs
    sample_rate: int = 0  # Hz of the waveforms `encode` takes and `decode` gives
    hop: int = 0  # samples per code

    @property
    def device(self) -> torch.device:
        """Where the codec's weights are, and so where `encode` and `decode` run."""
        for tensor in itertools.chain(self.parameters(), self.buffers()):
            return tensor.device
        return torch.device("cpu")

    def encode(self, *batch: Any) -> Any:
        """Image: uint8 pixels [B, H, W, 3] or [B, 3, H, W] (H, W multiples of `pixels_per_code`) -> int32 codes
        [B, H/p, W/p]. Audio: float32 waves [B, T] and their valid lengths [B] -> (int32 codes [B, ceil(T/hop)],
        valid code counts [B]). A code never depends on the rest of its batch (docs/codecs.md)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """Codes as `encode` gives them -> float32 pixels [B, 3, H, W] in [-1, 1], or waves [B, T]."""
        raise NotImplementedError

    def describe(self) -> dict:
        """Identity recorded in output metadata and compared on resume."""
        return {
            "name": self.name,
            "modality": self.modality,
            "codebook_size": self.codebook_size,
            "checkpoint_sha256": self.checkpoint_sha256,
            "precision": self.precision.to_dict(),
        }


class CodecPlugin(Protocol):
    """What the object a `mmtok.codecs` entry point names provides (a module, usually). Read before any
    checkpoint is loaded: `MODALITY` and `TOKENIZER_TYPE` by `mmtok tokenizer build`, `checkpoint_paths` to
    fingerprint a checkpoint before a resume loads it."""

    MODALITY: str  # "image" or "audio"
    TOKENIZER_TYPE: str  # the codec's `type` in tokenizer_config.json (`mmtok tokenizer build`)

    def load(self, checkpoint_dir: Path, device: torch.device) -> Codec:
        """The codec of a checkpoint directory, on `device`; MmtokError naming the file on anything wrong."""

    def checkpoint_paths(self, checkpoint_dir: Path) -> list[Path]:
        """The files whose bytes the codes depend on (fingerprinted into `checkpoint_sha256`)."""

    def write_random_checkpoint(self, directory: Path, config: Mapping | None = None, seed: int = 0) -> Path:
        """A checkpoint with random weights in the codec's own format (tests, the demo, benchmarks)."""


MODALITIES = ("image", "audio")
PLUGIN_FUNCTIONS = ("load", "checkpoint_paths", "write_random_checkpoint")


def check_plugin(plugin: object, where: str) -> None:
    """MmtokError naming `where` unless `plugin` provides what `CodecPlugin` declares."""
    missing = [name for name in PLUGIN_FUNCTIONS if not callable(getattr(plugin, name, None))]
    if missing:
        raise MmtokError(f"{where} does not meet the codec contract: it has no function {', '.join(missing)} "
                         "(mmtok.codecs.base.CodecPlugin; docs/write-a-codec.md)")
    if getattr(plugin, "MODALITY", None) not in MODALITIES:
        raise MmtokError(f"{where} does not meet the codec contract: MODALITY must be one of {', '.join(MODALITIES)}, "
                         f"not {getattr(plugin, 'MODALITY', None)!r}")
    if not isinstance(getattr(plugin, "TOKENIZER_TYPE", None), str) or not plugin.TOKENIZER_TYPE:
        raise MmtokError(f"{where} does not meet the codec contract: TOKENIZER_TYPE must be a non-empty string")


def check_codec(codec: object, plugin: CodecPlugin, name: str, where: str) -> None:
    """MmtokError naming `where` unless what its `load` returned is a `Codec` registered as `name` (the name
    every output records and a resume compares), with the attributes its modality needs, codes that fit the
    vocabulary's block for it, and its plugin's modality."""
    from mmtok.vocab import AUDIO_CODEBOOK, IMAGE_CODEBOOK

    if not isinstance(codec, Codec):
        raise MmtokError(f"{where}: load() returned a {type(codec).__name__}, not a mmtok.codecs.base.Codec")
    problems = []
    if codec.name != name:
        problems.append(f"name {codec.name!r} is not the name it is registered as ({name!r})")
    if codec.modality != plugin.MODALITY:
        problems.append(f"modality {codec.modality!r} is not the plugin's MODALITY {plugin.MODALITY!r}")
    if not isinstance(getattr(codec, "precision", None), PrecisionContract):
        problems.append("precision is not a PrecisionContract")
    room = IMAGE_CODEBOOK if plugin.MODALITY == "image" else AUDIO_CODEBOOK
    if not isinstance(codec.codebook_size, int) or not 0 < codec.codebook_size <= room:
        problems.append(f"codebook_size {codec.codebook_size!r} is not in 1..{room} (the vocabulary's "
                        f"{plugin.MODALITY} block)")
    needed = ("pixels_per_code",) if plugin.MODALITY == "image" else ("sample_rate", "hop")
    problems += [f"{name} must be a positive int, not {getattr(codec, name, None)!r}" for name in needed
                 if not isinstance(getattr(codec, name, None), int) or getattr(codec, name) <= 0]
    if problems:
        raise MmtokError(f"{where} does not meet the codec contract: {'; '.join(problems)} "
                         "(mmtok.codecs.base.Codec; docs/write-a-codec.md)")


def checkpoint_fingerprint(paths: list[Path]) -> str:
    """sha256 over the given checkpoint files (name + bytes), in the given order."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        with open(path, "rb") as handle:
            while block := handle.read(1 << 22):
                digest.update(block)
    return digest.hexdigest()
