"""Audio preprocessing shared by conversion, encoding, the codec CLI and the benchmark.

One resampler everywhere: soxr at "VHQ" quality (deterministic, CPU, band-limited), so a clip gets
the same samples whichever stage resamples it. Peak normalization refuses silent and non-finite clips
with a reason instead of dividing by zero.
"""

from __future__ import annotations

import io
import re

import numpy as np

from mmtok.errors import Skip

TARGET_SAMPLE_RATE = 24_000
PEAK_DBFS = -3.0
RESAMPLER = {"library": "soxr", "quality": "VHQ"}
SILENCE_PEAK = 1e-6  # peak below this (about -120 dBFS) counts as silent


class AudioReason(Skip):
    """A clip that cannot be used; `reason` is a short counted name."""


# libsndfile names an in-memory file by its Python object, address included: dropped, so a skip's detail is the
# same on every run (a skip record is part of what a run writes)
_OBJECT_ADDRESS = re.compile(r"<[\w.]+ object at 0x[0-9a-fA-F]+>")


def decode_bytes(data: bytes) -> tuple[np.ndarray, int]:
    """Encoded audio bytes (WAV, FLAC, OGG/Opus, MP3) decoded by libsndfile -> (samples [T] or [T, C] float32,
    sampling rate); AudioReason `decode_error` saying why, the same words for the same bytes."""
    import soundfile

    try:
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except Exception as err:  # libsndfile reports every malformed input as a generic error
        raise AudioReason("decode_error", _OBJECT_ADDRESS.sub("the audio bytes", str(err))) from None
    return samples, int(rate)


def to_mono(samples: np.ndarray) -> np.ndarray:
    """[T] or [T, C] (soundfile's layout) -> float32 [T], downmixing by the mean of the channels."""
    samples = np.asarray(samples, dtype=np.float32)
    if samples.ndim == 2:
        samples = samples.mean(axis=1, dtype=np.float32)
    elif samples.ndim != 1:
        raise AudioReason("bad_shape", f"audio array of shape {samples.shape}")
    return np.ascontiguousarray(samples)


def resample(samples: np.ndarray, rate_in: int, rate_out: int = TARGET_SAMPLE_RATE) -> np.ndarray:
    """Resample a mono float32 clip with soxr VHQ; identity when the rates match."""
    samples = np.asarray(samples, dtype=np.float32)
    if rate_in == rate_out:
        return samples
    import soxr

    return soxr.resample(samples, rate_in, rate_out, quality="VHQ").astype(np.float32, copy=False)


def check_finite(samples: np.ndarray) -> None:
    if samples.size == 0:
        raise AudioReason("zero_length")
    if not np.isfinite(samples).all():
        raise AudioReason("non_finite", "NaN or Inf samples")


def peak_normalize(samples: np.ndarray, peak_dbfs: float = PEAK_DBFS) -> np.ndarray:
    """x * 10^(peak_dbfs/20) / max|x|, as float32. Raises AudioReason for empty, NaN/Inf or silent clips."""
    samples = np.asarray(samples, dtype=np.float32)
    check_finite(samples)
    peak = float(np.max(np.abs(samples)))
    if peak < SILENCE_PEAK:
        raise AudioReason("silent", f"peak {peak:.3g}")
    gain = np.float32(10.0 ** (peak_dbfs / 20.0) / peak)
    return samples * gain


def load_audio(path: str, rate_out: int = TARGET_SAMPLE_RATE) -> tuple[np.ndarray, int]:
    """Read an audio file (WAV/FLAC/OGG/Opus/MP3 via soundfile) -> (mono float32 at `rate_out`, original rate)."""
    import soundfile

    try:
        samples, rate = soundfile.read(path, dtype="float32", always_2d=False)
    except Exception as err:
        raise AudioReason("decode_error", f"{path}: {err}") from None
    mono = to_mono(samples)
    check_finite(mono)
    return resample(mono, rate, rate_out), rate
