"""WavTokenizer, 40 codes/s (24 kHz, hop 600, one 4,096-entry codebook): official files in, exact codes out.

Checkpoint directory: one YAML config in the Lightning CLI layout of the official
`wavtokenizer_*_frame40_*` configs (`model.init_args.{feature_extractor, backbone, head}`, each with
`class_path`/`init_args`) and one weights file: the Lightning `.ckpt` (its `state_dict`) or a
`.safetensors` conversion of that state dict. Keys under `feature_extractor.`, `backbone.` and
`head.` are used; discriminators, optimizer state and other training entries are ignored, as are the
SEANet decoder (`feature_extractor.encodec.decoder.*`, never run by WavTokenizer) and the codebook's
EMA statistics. Weight-normalised convs may be stored as `weight_g`/`weight_v` (legacy
`torch.nn.utils.weight_norm`) or `parametrizations.weight.original0/1` (the newer API).

Guarantees: codes equal the official `encode_infer` codes (nearest codebook row by squared Euclidean
distance, same expression, eval mode, codebook never updated); strict float32 with TF32 off for
matmul, cuDNN conv and cuDNN RNN; ceil(n/600) codes per clip; `trimmed_count(n)` = ceil(n/600) - 5
codes of a clip do not depend on the zero padding of its batch.
"""

from __future__ import annotations

import logging
import math
import pickle
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from mmtok.codecs.base import (
    Codec,
    PrecisionContract,
    checkpoint_fingerprint,
    finite_latents,
    refuse_low_precision,
    refuse_non_finite,
)
from mmtok.codecs.wavtokenizer_modules import (
    DIMENSION,
    Codebook,
    ISTFTHead,
    SEANetEncoder,
    VocosBackbone,
)
from mmtok.errors import MmtokError, Skip, brief
from mmtok.fsutil import own_file

NAME = "wavtokenizer"
# The codec contract (mmtok.codecs.base.CodecPlugin; registered in pyproject.toml's mmtok.codecs entry points)
MODALITY = "audio"
TOKENIZER_TYPE = "wavtokenizer"  # the `type` upstream spells in tokenizer_config.json
SAMPLE_RATE = 24_000
HOP = 600  # 40 codes per second
TRIM = 5  # = ceil(lookahead / HOP): codes whose receptive field can reach past the clip's end
PRECISION = PrecisionContract(tf32_matmul=False, tf32_conv=False, tf32_rnn=False)

# official state-dict prefix -> our module's prefix (all other keys are training-only or unused)
CODEBOOK_PREFIX = "feature_extractor.encodec.quantizer.vq.layers.0._codebook."
PREFIXES = {
    "feature_extractor.encodec.encoder.": "encoder.",
    CODEBOOK_PREFIX: "codebook.",
    "backbone.": "backbone.",
    "head.": "head.",
}
MODEL_ROOTS = ("feature_extractor.", "backbone.", "head.")  # what the official loader keeps
UNUSED_KEYS = ("feature_extractor.encodec.decoder.", CODEBOOK_PREFIX + "cluster_size", CODEBOOK_PREFIX + "embed_avg")
WEIGHT_NORM_NAMES = (("weight_g", "weight_v"),  # (magnitude, direction): legacy weight_norm, then parametrizations
                     ("parametrizations.weight.original0", "parametrizations.weight.original1"))


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WavTokenizerConfig:
    """The sizes the official YAML sets (defaults are the official class defaults)."""

    backbone_dim: int
    intermediate_dim: int
    num_layers: int
    n_fft: int
    head_hop: int
    head_dim: int
    adanorm_embeddings: int | None = None
    input_channels: int = DIMENSION
    downsamples: tuple[int, ...] = (6, 5, 5, 4)  # the YAML's `dowmsamples`; applied in reverse order
    codebook_size: int = 16_384
    num_quantizers: int = 1
    sample_rate: int = SAMPLE_RATE
    padding: str = "same"
    encodec_model: str = "encodec_24khz"


def _section(model_args: dict, name: str, expected_class: str, path: Path) -> dict:
    node = model_args.get(name)
    if not isinstance(node, dict) or not isinstance(node.get("class_path"), str):
        raise MmtokError(f"{path}: missing model.init_args.{name}.class_path (expected the Lightning CLI layout "
                         "of the official wavtokenizer_*_frame40_* configs)")
    if node["class_path"].rsplit(".", 1)[-1] != expected_class:
        raise MmtokError(f"{path}: model.init_args.{name} is {brief(node['class_path'])}; this codec implements "
                         f"{expected_class} only")
    args = node.get("init_args") or {}
    if not isinstance(args, dict):
        raise MmtokError(f"{path}: model.init_args.{name}.init_args must be a mapping, got {type(args).__name__}")
    return args


def read_config(path: Path) -> WavTokenizerConfig:
    """Parse and check an official WavTokenizer YAML; raises MmtokError naming the offending entry."""
    import yaml

    try:
        document = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise MmtokError(f"{path}: cannot read the WavTokenizer config: {brief(err)}") from None
    model = document.get("model") if isinstance(document, dict) else None
    model_args = model.get("init_args") if isinstance(model, dict) else None
    if not isinstance(model_args, dict):
        raise MmtokError(f"{path}: no model.init_args section (expected the Lightning CLI layout of the official "
                         "wavtokenizer_*_frame40_* configs)")
    features = _section(model_args, "feature_extractor", "EncodecFeatures", path)
    backbone = _section(model_args, "backbone", "VocosBackbone", path)
    head = _section(model_args, "head", "ISTFTHead", path)
    try:
        config = WavTokenizerConfig(
            backbone_dim=int(backbone["dim"]), intermediate_dim=int(backbone["intermediate_dim"]),
            num_layers=int(backbone["num_layers"]), adanorm_embeddings=backbone.get("adanorm_num_embeddings"),
            input_channels=int(backbone["input_channels"]), n_fft=int(head["n_fft"]),
            head_hop=int(head["hop_length"]), head_dim=int(head["dim"]), padding=head.get("padding", "same"),
            downsamples=tuple(int(r) for r in features.get("dowmsamples", (6, 5, 5, 4))),
            codebook_size=int(features.get("vq_bins", 16_384)),
            num_quantizers=int(features.get("num_quantizers", 1)),
            encodec_model=features.get("encodec_model", "encodec_24khz"),
            sample_rate=int(model_args.get("sample_rate", SAMPLE_RATE)),
        )
    except KeyError as err:
        raise MmtokError(f"{path}: missing required entry {err.args[0]!r} in model.init_args") from None
    except (TypeError, ValueError, AttributeError) as err:  # a list where a number is, a mapping where a list is
        raise MmtokError(f"{path}: an entry of model.init_args has the wrong type ({brief(err)})") from None
    check_config(config, str(path))
    return config


def check_config(config: WavTokenizerConfig, where: str) -> None:
    """Refuse configs this codec would encode differently from the 40 codes/s model."""
    hop = math.prod(config.downsamples)
    problems = []
    if hop != HOP:
        problems.append(f"the encoder strides {list(config.downsamples)} give a hop of {hop} samples, not {HOP} "
                        f"({SAMPLE_RATE / hop:g} codes/s; this codec is the 40 codes/s WavTokenizer)")
    if config.head_hop != HOP:
        problems.append(f"head.hop_length is {config.head_hop}, not {HOP}")
    if config.sample_rate != SAMPLE_RATE or config.encodec_model != "encodec_24khz":
        problems.append(f"sample_rate {config.sample_rate} / encodec_model {config.encodec_model!r}: "
                        f"only {SAMPLE_RATE} Hz encodec_24khz exists")
    if config.num_quantizers != 1:
        problems.append(f"num_quantizers is {config.num_quantizers}; the 40 codes/s model has one codebook")
    if config.head_dim != config.backbone_dim:
        problems.append(f"head.dim {config.head_dim} differs from backbone.dim {config.backbone_dim}")
    if config.input_channels != DIMENSION:
        problems.append(f"backbone.input_channels is {config.input_channels}, not the encoder's {DIMENSION}")
    if config.padding != "same" or config.n_fft <= HOP or (config.n_fft - HOP) % 2:
        problems.append(f"head n_fft {config.n_fft} / padding {config.padding!r}: expected padding 'same' and "
                        f"an n_fft above {HOP} with an even difference (official: 2400)")
    if problems:
        raise MmtokError(f"{where}: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------------
# Checkpoint files
# ---------------------------------------------------------------------------------------------


def checkpoint_paths(directory: Path) -> list[Path]:
    """The files whose bytes are the checkpoint's identity (config, weights), each inside `directory`."""
    return list(checkpoint_files(Path(directory)))


def checkpoint_files(directory: Path) -> tuple[Path, Path]:
    """(config YAML, weights file) of a checkpoint directory; exactly one of each is expected."""
    if not directory.is_dir():
        raise MmtokError(f"{directory}: not a directory (expected a WavTokenizer checkpoint directory with a "
                         "YAML config and a .ckpt or .safetensors file)")
    configs = sorted(p for p in directory.iterdir() if p.suffix in (".yaml", ".yml"))
    weights = sorted(p for p in directory.iterdir() if p.suffix in (".ckpt", ".safetensors"))
    for found, what in ((configs, "YAML config (*.yaml)"), (weights, "weights file (*.ckpt or *.safetensors)")):
        if len(found) != 1:
            names = ", ".join(p.name for p in found) or "none"
            raise MmtokError(f"{directory}: expected exactly one {what}, found {names}")
    return own_file(configs[0], f"{NAME} checkpoint file"), own_file(weights[0], f"{NAME} checkpoint file")


class _Inert(dict):
    """Stand-in for every class or function in a checkpoint that torch's weights-only allowlist lacks.

    Constructing, calling, building or filling it does nothing, so no code from the file runs.
    """

    def __init__(self, *args, **kwargs):
        super().__init__()

    def __setstate__(self, state) -> None:
        pass

    def append(self, item) -> None:
        pass

    def extend(self, items) -> None:
        pass


class _InertUnpickler(pickle._Unpickler):
    """Resolves only the globals torch's weights_only loader allows; everything else becomes _Inert. BUILD
    (which sets an object's state) applies only to instances the file made -- placeholders, tensors, dicts --
    as torch's own weights-only loader allows: on an allowed class or function it would change the running
    process (`collections.Counter.x = ...`). The pure-Python unpickler, because only it lets one opcode be
    replaced; it reads training metadata of a few kilobytes (the tensors' bytes come from the zip)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        from torch import _weights_only_unpickler

        allowed = _weights_only_unpickler._get_allowed_globals()
        return allowed.get(f"{module}.{name}", _Inert)

    def _build(self) -> None:
        target = self.stack[-2]
        if not isinstance(target, (_Inert, torch.Tensor, dict)):
            raise pickle.UnpicklingError(f"state set on {type(target).__name__} {getattr(target, '__name__', '')}"
                                         " (only an object the file made may take a state)")
        pickle._Unpickler.load_build(self)

    dispatch[pickle.BUILD[0]] = _build


_INERT_PICKLE = types.ModuleType("mmtok_inert_pickle")
_INERT_PICKLE.Unpickler = _InertUnpickler
_INERT_PICKLE.load = pickle.load


def _load_ckpt(path: Path) -> dict:
    """torch.load with weights_only=True; if the file's training metadata (hyper-parameters, callbacks,
    loggers) holds classes outside torch's allowlist, reload with those classes replaced by inert
    placeholders (tensors are rebuilt exactly as weights_only does; no class from the file is imported
    and nothing in it is called). Only `state_dict` is used afterwards."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as err:
        reason = str(err).split("WeightsUnpickler error:")[-1].strip().splitlines()[0].split(" Please use")[0]
    except Exception as err:  # a damaged file, or an allowlisted global called with bad arguments
        raise _unreadable(path, err) from None
    logging.getLogger(__name__).warning(f"wavtokenizer: {path.name}: weights_only loading refused ({reason}); "
                                        "reading it again with non-tensor training objects as inert placeholders")
    try:
        return torch.load(path, map_location="cpu", weights_only=False, mmap=True, pickle_module=_INERT_PICKLE)
    except Exception as err:  # e.g. an inert placeholder called, or an allowlisted global given bad arguments
        raise _unreadable(path, err) from None


def _unreadable(path: Path, err: Exception) -> MmtokError:
    return MmtokError(f"{path}: not a readable PyTorch checkpoint ({type(err).__name__}: {brief(err)}); it is "
                      "damaged or holds objects other than a Lightning checkpoint's -- copy it again from its source")


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The flat state dict of a Lightning .ckpt (its `state_dict` entry) or of a .safetensors file."""
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as err:  # safetensors raises its own SafetensorError
            raise MmtokError(f"{path}: not a readable safetensors file ({brief(err)})") from None
    checkpoint = _load_ckpt(path)
    state = checkpoint.get("state_dict", checkpoint) if isinstance(checkpoint, dict) else None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise MmtokError(f"{path}: expected a Lightning checkpoint with a `state_dict` of tensors")
    return state


def fold_weight_norm(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Replace each (g, v) weight-norm pair by the effective `weight` = v * g / ||v|| (norm over all
    dims but the first). Uses torch._weight_norm, the kernel both torch weight-norm APIs run, so the
    folded weights equal what the reference computes on every forward."""
    folded = dict(state)
    for g_name, v_name in WEIGHT_NORM_NAMES:
        for key in [k for k in state if k.endswith("." + v_name)]:
            stem = key[: -len(v_name)]
            if stem + g_name not in state:
                raise MmtokError(f"{where}: {key} has no matching {stem + g_name} (incomplete weight norm)")
            folded[stem + "weight"] = torch._weight_norm(state[key], state[stem + g_name], 0)
            del folded[key], folded[stem + g_name]
    orphans = [k for g_name, _ in WEIGHT_NORM_NAMES for k in folded if k.endswith("." + g_name)]
    if orphans:
        raise MmtokError(f"{where}: {orphans[0]} has no matching direction tensor (incomplete weight norm)")
    return folded


def relevant_state(state: dict[str, torch.Tensor], where: str = "checkpoint") -> dict[str, torch.Tensor]:
    """The entries the official loader keeps, less those WavTokenizer never runs, as float32; MmtokError for
    one that is not a finite floating-point tensor."""
    kept = {key: value for key, value in state.items()
            if key.startswith(MODEL_ROOTS) and not key.startswith(UNUSED_KEYS)}
    for key, value in kept.items():
        if not value.is_floating_point():
            raise MmtokError(f"{where}: tensor {key!r} is {value.dtype}, expected floating point")
    refuse_non_finite(kept, where)
    return {key: value.float() for key, value in kept.items()}


def model_state(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Official keys -> the codec's module names; a key outside the known prefixes is an error."""
    kept = {}
    for key, value in state.items():
        prefix = next((p for p in PREFIXES if key.startswith(p)), None)
        if prefix is None:
            raise MmtokError(f"{where}: unexpected key {key} (not part of the 40 codes/s WavTokenizer with "
                             "this config; wrong config for this checkpoint?)")
        kept[PREFIXES[prefix] + key[len(prefix):]] = value
    return kept


def official_key(name: str) -> str:
    """Our module key -> the official checkpoint key (for error messages)."""
    for official, ours in PREFIXES.items():
        if name.startswith(ours):
            return official + name[len(ours):]
    return name


# ---------------------------------------------------------------------------------------------
# The codec
# ---------------------------------------------------------------------------------------------


def trimmed_count(n_samples: int) -> int:
    """Codes the audio pipeline keeps for a clip of n samples: ceil(n / 600) - 5, the same rule for
    every clip, so a clip's tokens never depend on the zero padding of its batch (a code's receptive
    field reaches at most 2,877 samples past its start; see SEANetEncoder.lookahead_samples).
    Raises Skip("too_short") when fewer than one code would be kept (n <= 3,000 samples)."""
    kept = -(-int(n_samples) // HOP) - TRIM
    if kept < 1:
        raise Skip("too_short", f"{n_samples} samples at {SAMPLE_RATE} Hz keep no code after the "
                               f"uniform trim (need more than {TRIM * HOP})")
    return kept


def check_sample_rate(sample_rate: int) -> None:
    if int(sample_rate) != SAMPLE_RATE:
        raise MmtokError(f"{NAME}: audio at {sample_rate} Hz; the codec needs {SAMPLE_RATE} Hz mono. Resample "
                         "first with mmtok.media.audio.resample (soxr VHQ, the pipeline's resampler) or "
                         "pass an audio file to `mmtok codec encode`, which does it")


class WavTokenizer(Codec):
    """The 40 codes/s WavTokenizer: encode 24 kHz waveforms to codes, decode codes to waveforms."""

    name = NAME
    modality = "audio"
    sample_rate = SAMPLE_RATE
    hop = HOP

    def __init__(self, config: WavTokenizerConfig):
        super().__init__()
        self.config = config
        self.codebook_size = config.codebook_size
        self.precision = PRECISION
        self.encoder = SEANetEncoder(list(config.downsamples))
        self.codebook = Codebook(config.codebook_size)
        self.backbone = VocosBackbone(config.input_channels, config.backbone_dim, config.intermediate_dim,
                                      config.num_layers, config.adanorm_embeddings)
        self.head = ISTFTHead(config.head_dim, config.n_fft, config.head_hop)
        # bandwidth_id 0 selects row 0 of the AdaLayerNorm tables, as the reference's decode call does
        self.register_buffer("bandwidth_id", torch.tensor([0]), persistent=False)
        assert TRIM == -(-self.encoder.lookahead_samples() // HOP), "trim must cover the encoder look-ahead"

    def describe(self) -> dict:
        return {**super().describe(), "sample_rate": SAMPLE_RATE, "hop": HOP, "trim": TRIM,
                "config": asdict(self.config)}

    @property
    def device(self) -> torch.device:
        return self.codebook.embed.device

    def encode(self, wave: torch.Tensor, lengths, sample_rate: int = SAMPLE_RATE) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 [B, T] at 24 kHz + valid lengths -> (int32 codes [B, ceil(T/600)], counts = ceil(length/600)).

        Samples past each clip's length are zeroed first, so a batch is always "each clip followed by
        zeros". Codes past `counts` describe padding; of the counted ones, the last 5 may still depend
        on the padding (see `trimmed_count`).
        """
        check_sample_rate(sample_rate)
        wave, lengths = self._check_batch(wave, lengths)
        self.precision.apply()
        with torch.inference_mode():
            positions = torch.arange(wave.shape[1], device=wave.device)
            wave = wave.masked_fill(positions[None, :] >= lengths[:, None], 0.0)
            codes = self.codebook.nearest(finite_latents(self.encoder(wave.unsqueeze(1)), NAME))
        return codes.to(torch.int32), -(-lengths // HOP)

    def encode_clips(self, clips: Sequence[np.ndarray], sample_rate: int) -> list[np.ndarray]:
        """Encode mono clips as one zero-padded batch; returns each clip's kept codes (trimmed_count(n))."""
        check_sample_rate(sample_rate)
        if not clips:
            return []
        kept = [trimmed_count(len(clip)) for clip in clips]  # refuse too-short clips before any compute
        batch = np.zeros((len(clips), max(len(c) for c in clips)), dtype=np.float32)
        for row, clip in zip(batch, clips, strict=True):
            row[: len(clip)] = clip
        lengths = torch.tensor([len(c) for c in clips])
        codes, _ = self.encode(torch.from_numpy(batch).to(self.device), lengths.to(self.device))
        codes = codes.cpu().numpy()
        return [codes[i, :n].copy() for i, n in enumerate(kept)]

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """int codes [B, n] -> float32 waveform [B, n * 600] (backbone + iSTFT head; not clipped)."""
        self._check_params()
        codes = torch.as_tensor(codes, device=self.device)
        if codes.dim() != 2 or codes.dtype.is_floating_point:
            raise MmtokError(f"{NAME}: decode expects integer codes [B, n], got {codes.dtype} {list(codes.shape)}")
        if codes.numel() and (codes.min() < 0 or codes.max() >= self.codebook_size):
            raise MmtokError(f"{NAME}: codes must lie in 0..{self.codebook_size - 1}, got "
                             f"{int(codes.min())}..{int(codes.max())}")
        self.precision.apply()
        with torch.inference_mode():
            features = self.codebook.lookup(codes.long())
            return self.head(self.backbone(features, self.bandwidth_id))

    def _check_params(self) -> None:
        refuse_low_precision(str(self.codebook.embed.dtype), NAME)

    def _check_batch(self, wave, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_params()
        wave = torch.as_tensor(wave, device=self.device)
        refuse_low_precision(str(wave.dtype), NAME)
        if wave.dim() != 2 or wave.dtype != torch.float32:
            raise MmtokError(f"{NAME}: encode expects float32 [B, T] mono waveforms, got {wave.dtype} "
                             f"{list(wave.shape)}")
        lengths = torch.as_tensor(lengths, device=self.device).long().reshape(-1)
        if lengths.numel() != wave.shape[0] or (lengths < 1).any() or (lengths > wave.shape[1]).any():
            raise MmtokError(f"{NAME}: lengths {lengths.tolist()} must give one length in 1..{wave.shape[1]} per row")
        if not torch.isfinite(wave).all():
            raise MmtokError(f"{NAME}: the waveforms contain NaN or Inf samples")
        return wave, lengths


def build(config: WavTokenizerConfig) -> WavTokenizer:
    """An uninitialized codec for `config` (weights come from load() or write_random_checkpoint())."""
    check_config(config, "config")
    return WavTokenizer(config)


def load_weights(codec: WavTokenizer, state: dict[str, torch.Tensor], where: str) -> None:
    """Strictly load the official state dict into `codec`: every needed key present with its shape,
    no unexpected key under the model prefixes; raises MmtokError naming the first mismatch."""
    folded = fold_weight_norm(relevant_state(state, where), where)
    refuse_non_finite(folded, where)  # a zero weight-norm direction folds to NaN
    provided = model_state(folded, where)
    expected = codec.state_dict()
    for name, tensor in expected.items():
        if name not in provided:
            raise MmtokError(f"{where}: missing key {official_key(name)} (shape {list(tensor.shape)}); the "
                             "checkpoint does not match its config or is not a WavTokenizer checkpoint")
        if provided[name].shape != tensor.shape:
            raise MmtokError(f"{where}: {official_key(name)} has shape {list(provided[name].shape)}, the config "
                             f"implies {list(tensor.shape)}")
    for name in provided:
        if name not in expected:
            raise MmtokError(f"{where}: unexpected key {official_key(name)} for this config")
    if float(provided["codebook.inited"].reshape(-1)[0]) != 1.0:
        raise MmtokError(f"{where}: {CODEBOOK_PREFIX}inited is 0: the codebook was never initialized (the "
                         "official code would overwrite it by k-means on the first batch); not a trained model")
    codec.load_state_dict(provided, strict=True)
    codec.codebook.refresh()


def load(checkpoint_dir: Path, device: str | torch.device = "cpu", dtype: str = "float32") -> WavTokenizer:
    """Load the official config + weights onto `device` in eval mode (float32 only; bf16/fp16 refused)."""
    refuse_low_precision(dtype, NAME)
    config_path, weights_path = checkpoint_files(Path(checkpoint_dir))
    try:
        codec = build(read_config(config_path))
    except (RuntimeError, MemoryError, ValueError) as err:  # sizes no memory holds (vq_bins: 10^11)
        raise MmtokError(f"{config_path}: describes no codec this machine can build ({brief(err)})") from None
    load_weights(codec, read_state_dict(weights_path), str(weights_path))
    codec.checkpoint_sha256 = checkpoint_fingerprint([config_path, weights_path])
    codec.requires_grad_(False)
    return codec.to(device).eval()


# ---------------------------------------------------------------------------------------------
# Random-weight checkpoints in the official format (tests, demo, benchmarks)
# ---------------------------------------------------------------------------------------------

TINY_BACKBONE = {"dim": 32, "intermediate_dim": 64, "num_layers": 2}  # official: 768 / 2304 / 12
OFFICIAL_BACKBONE = {"dim": 768, "intermediate_dim": 2304, "num_layers": 12}
SEANET_DECODER_RATIOS = (8, 5, 4, 2)  # EncodecFeatures' fixed decoder (stored, never run)


def lightning_config(backbone: dict | None = None, feature_extractor: dict | None = None,
                     head: dict | None = None) -> dict:
    """The official frame40 YAML's model section (Lightning CLI layout), with optional overrides."""
    backbone = {"input_channels": DIMENSION, **OFFICIAL_BACKBONE, "adanorm_num_embeddings": 4, **(backbone or {})}
    features = {"encodec_model": "encodec_24khz", "bandwidths": [6.6, 6.6, 6.6, 6.6], "train_codebooks": True,
                "num_quantizers": 1, "dowmsamples": [6, 5, 5, 4], "vq_bins": 4096, "vq_kmeans": 200,
                **(feature_extractor or {})}
    head = {"dim": backbone["dim"], "n_fft": 2400, "hop_length": HOP, "padding": "same", **(head or {})}
    return {"seed_everything": 3407, "model": {"class_path": "decoder.experiment.WavTokenizer", "init_args": {
        "sample_rate": SAMPLE_RATE,
        "feature_extractor": {"class_path": "decoder.feature_extractors.EncodecFeatures", "init_args": features},
        "backbone": {"class_path": "decoder.models.VocosBackbone", "init_args": backbone},
        "head": {"class_path": "decoder.heads.ISTFTHead", "init_args": head}}}}


def _seanet_decoder_shapes(codebook_dim: int = DIMENSION) -> dict[str, tuple[int, ...]]:
    """Shapes of the fixed SEANet decoder's weights (official key names below encodec.decoder.model)."""
    shapes: dict[str, tuple[int, ...]] = {}

    def conv(index: str, kind: str, c_in: int, c_out: int, kernel: int, transposed: bool = False) -> None:
        g_rows = c_in if transposed else c_out
        v_shape = (c_in, c_out, kernel) if transposed else (c_out, c_in, kernel)
        shapes.update({f"{index}.{kind}.{kind}.bias": (c_out,), f"{index}.{kind}.{kind}.weight_g": (g_rows, 1, 1),
                       f"{index}.{kind}.{kind}.weight_v": v_shape})

    channels = 32 * 2 ** len(SEANET_DECODER_RATIOS)
    conv("0", "conv", codebook_dim, channels, 7)
    for layer in range(2):
        for part, shape in (("weight_ih", (4 * channels, channels)), ("weight_hh", (4 * channels, channels)),
                            ("bias_ih", (4 * channels,)), ("bias_hh", (4 * channels,))):
            shapes[f"1.lstm.{part}_l{layer}"] = shape
    index = 2
    for ratio in SEANET_DECODER_RATIOS:
        conv(f"{index + 1}", "convtr", channels, channels // 2, 2 * ratio, transposed=True)
        channels //= 2
        conv(f"{index + 2}.block.1", "conv", channels, channels // 2, 3)
        conv(f"{index + 2}.block.3", "conv", channels // 2, channels, 1)
        conv(f"{index + 2}.shortcut", "conv", channels, channels, 1)
        index += 3
    conv(f"{index + 1}", "conv", channels, 1, 7)
    return {f"feature_extractor.encodec.decoder.model.{k}": v for k, v in shapes.items()}


def _random_state(codec: WavTokenizer, seed: int) -> dict[str, torch.Tensor]:
    """Official-layout state dict with random weights drawn from `seed` (deterministic on any machine)."""
    gen = torch.Generator().manual_seed(seed)

    def uniform(shape, low: float, high: float) -> torch.Tensor:
        return low + (high - low) * torch.rand(shape, generator=gen)

    state: dict[str, torch.Tensor] = {}
    for name, tensor in codec.state_dict().items():
        key, shape = official_key(name), tuple(tensor.shape)
        if name.startswith("encoder.") and name.endswith(".weight") and ".lstm." not in name:
            stem = key[: -len("weight")]
            state[stem + "weight_v"] = torch.randn(shape, generator=gen)
            state[stem + "weight_g"] = uniform((shape[0], 1, 1), 0.8, 1.6)  # deliberately not ||v||
        elif ".lstm." in name:  # PyTorch's default LSTM init: U(-1/sqrt(hidden), 1/sqrt(hidden))
            bound = (shape[0] // 4) ** -0.5
            state[key] = uniform(shape, -bound, bound)
        elif name == "codebook.embed":
            state[key] = torch.randn(shape, generator=gen)
        elif name == "codebook.inited":
            state[key] = torch.ones(shape)
        elif name == "head.istft.window":
            state[key] = torch.hann_window(shape[0])
        elif name.endswith(("scale.weight", "gamma")) or (tensor.dim() == 1 and name.endswith("weight")):
            state[key] = 1.0 + 0.1 * torch.randn(shape, generator=gen)  # norm scales, AdaLN scales, layer scales
        elif name.endswith("bias") or name.endswith("shift.weight"):
            state[key] = 0.02 * torch.randn(shape, generator=gen)
        else:
            fan_in = math.prod(shape[1:]) or 1
            state[key] = torch.randn(shape, generator=gen) * fan_in ** -0.5
    state[CODEBOOK_PREFIX + "cluster_size"] = torch.zeros(codec.codebook_size)
    state[CODEBOOK_PREFIX + "embed_avg"] = torch.zeros(codec.codebook_size, DIMENSION)
    # never run by WavTokenizer, but the official strict loader requires it; constant keeps files compressible
    state.update({k: torch.full(s, 0.01) for k, s in _seanet_decoder_shapes().items()})
    return state


def write_random_checkpoint(directory: Path, config: dict | None = None, seed: int = 0) -> Path:
    """Write `config.yaml` + `model.ckpt` (Lightning layout, legacy weight_g/weight_v naming) with random
    weights into `directory`; returns the directory.

    `config` overrides the YAML's init_args per section: {"backbone": {...}, "feature_extractor": {...},
    "head": {...}}. Default: a tiny backbone (dim 32, intermediate 64, 2 layers; head dim 32). The SEANet
    encoder (about 8 M parameters) and the 4,096 x 512 codebook are fixed by the official
    EncodecFeatures, and the official loader also requires the SEANet decoder (about 8 M parameters;
    written as a constant, so the file compresses well), so a file is about 87 MB even with the tiny
    backbone. {"backbone": OFFICIAL_BACKBONE} gives the
    official size.
    """
    import yaml

    from mmtok.fsutil import atomic_write_bytes, atomic_writer

    overrides = {"backbone": TINY_BACKBONE, **(config or {})}
    unknown = set(overrides) - {"backbone", "feature_extractor", "head"}
    if unknown:
        raise MmtokError(f"write_random_checkpoint: unknown config sections {sorted(unknown)}")
    document = lightning_config(overrides.get("backbone"), overrides.get("feature_extractor"), overrides.get("head"))
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    text = ("# WavTokenizer 40 codes/s, random weights (mmtok write_random_checkpoint, seed "
            f"{seed}); layout of the official wavtokenizer_smalldata_frame40_*.yaml\n")
    atomic_write_bytes(directory / "config.yaml", (text + yaml.safe_dump(document, sort_keys=False)).encode())
    codec = build(read_config(directory / "config.yaml"))
    checkpoint = {"epoch": 0, "global_step": 0, "pytorch-lightning_version": "1.8.6",
                  "state_dict": _random_state(codec, seed)}
    with atomic_writer(directory / "model.ckpt") as handle:
        torch.save(checkpoint, handle)
    return directory
