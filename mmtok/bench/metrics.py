"""Reconstruction metrics: images (PSNR, SSIM, LPIPS on uint8 RGB) and audio (mel L1, STOI, wideband PESQ).

Images are compared as uint8 RGB [H, W, 3] at the size the tokenizer saw (the resized input) against
its reconstruction mapped back to uint8 by `to_uint8`.

- PSNR: `skimage.metrics.peak_signal_noise_ratio(data_range=255)` over all pixels and channels;
  identical images give `inf` (returned as float('inf'), never a division warning).
- SSIM: `skimage.metrics.structural_similarity` with the settings of Wang et al. 2004 (the paper's
  MATLAB reference): `channel_axis=-1` (SSIM per channel, averaged), `data_range=255`,
  `gaussian_weights=True`, `sigma=1.5` (an 11x11 Gaussian window), `use_sample_covariance=False`,
  K1=0.01, K2=0.03 (skimage defaults).
- LPIPS: AlexNet v0.1 (mmtok.bench.lpips), inputs x/127.5 - 1; undefined (NaN, noted) for sides < 31 px.

Audio is compared at the codec's rate (24 kHz) between the peak-normalized input and the decoded clip,
trimmed to the input length.

- mel L1: mean |log(max(M_ref, 1e-5)) - log(max(M_dec, 1e-5))| over a 100-band magnitude mel
  spectrogram (n_fft 1024, hop 256, Hann window, centered; the HTK mel scale with unnormalized filters, as
  torchaudio's MelSpectrogram computes it, here in plain torch: `mel_filterbank`), the mel-loss setup of
  the WavTokenizer/Vocos training recipes.
- STOI: `pystoi.stoi(ref, dec, 24000, extended=False)` (pystoi resamples to 10 kHz internally, as the
  standard specifies).
- PESQ: `pesq.pesq(16000, ref, dec, "wb")` (ITU-T P.862.2 wideband) after resampling both signals to
  16 kHz with the project's one resampler (soxr VHQ). Clips PESQ cannot score (no speech found, too
  short) get NaN and a named note instead of failing the run.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from mmtok.extras import require

COMMAND = "mmtok bench reconstruct"

SSIM_SETTINGS = {"channel_axis": -1, "data_range": 255, "gaussian_weights": True, "sigma": 1.5,
                 "use_sample_covariance": False}
MEL_SETTINGS = {"sample_rate": 24_000, "n_fft": 1024, "hop_length": 256, "n_mels": 100, "power": 1.0,
                "center": True, "floor": 1e-5}
PESQ_RATE = 16_000
# AlexNet's two 3x3/2 max-pools need >= 3x3 maps: sides below 31 pixels leave nothing to compare.
LPIPS_MIN_SIDE = 31


def to_uint8(decoded: torch.Tensor) -> np.ndarray:
    """Model-scale float [B, 3, H, W] (or [3, H, W]) -> uint8 [B, H, W, 3]: clamp((x+1)*127.5, 0, 255), rounded."""
    if decoded.ndim == 3:
        decoded = decoded[None]
    pixels = torch.clamp((decoded.float() + 1.0) * 127.5, 0.0, 255.0).round().to(torch.uint8)
    return pixels.permute(0, 2, 3, 1).cpu().numpy()


def psnr(reference: np.ndarray, test: np.ndarray) -> float:
    """PSNR in dB of two uint8 images of one shape; inf when they are identical."""
    skimage_metrics = require("skimage.metrics", "bench", COMMAND)

    _check_pair(reference, test)
    if np.array_equal(reference, test):
        return math.inf
    return float(skimage_metrics.peak_signal_noise_ratio(reference, test, data_range=255))


def ssim(reference: np.ndarray, test: np.ndarray) -> float:
    """Mean SSIM (Wang et al. settings, see module docstring) of two uint8 RGB images; 1.0 when identical."""
    skimage_metrics = require("skimage.metrics", "bench", COMMAND)

    _check_pair(reference, test)
    return float(skimage_metrics.structural_similarity(reference, test, **SSIM_SETTINGS))


def _check_pair(reference: np.ndarray, test: np.ndarray) -> None:
    if reference.shape != test.shape or reference.dtype != np.uint8 or test.dtype != np.uint8:
        raise ValueError(f"metrics need two uint8 images of one shape, got {reference.dtype}{reference.shape} "
                         f"and {test.dtype}{test.shape}")


class ImageScorer:
    """PSNR, SSIM and LPIPS of uint8 RGB pairs; LPIPS runs on `device`."""

    def __init__(self, device: torch.device | str = "cpu"):
        from mmtok.bench.lpips import LPIPS

        self.device = torch.device(device)
        self.lpips_model = LPIPS().to(self.device)

    @torch.no_grad()
    def lpips(self, reference: np.ndarray, test: np.ndarray) -> float:
        from mmtok.bench.lpips import uint8_to_model

        _check_pair(reference, test)
        value = self.lpips_model(uint8_to_model(reference, self.device), uint8_to_model(test, self.device))
        return float(value[0])

    def score(self, reference: np.ndarray, test: np.ndarray) -> tuple[dict[str, float], str]:
        """(metrics, note); LPIPS is NaN with note `lpips:too_small` below LPIPS_MIN_SIDE pixels a side."""
        scores = {"psnr": psnr(reference, test), "ssim": ssim(reference, test), "lpips": math.nan}
        if min(reference.shape[:2]) < LPIPS_MIN_SIDE:
            return scores, "lpips:too_small"
        scores["lpips"] = self.lpips(reference, test)
        return scores, ""


# ---- audio ----------------------------------------------------------------------------------------------


class AudioScorer:
    """mel L1, STOI and wideband PESQ of a reference clip and its reconstruction (float32, 24 kHz)."""

    def __init__(self, sample_rate: int = 24_000):
        self.sample_rate = sample_rate
        self.window = torch.hann_window(MEL_SETTINGS["n_fft"])
        self.filters = mel_filterbank(sample_rate, MEL_SETTINGS["n_fft"], MEL_SETTINGS["n_mels"])

    def mel(self, waves: torch.Tensor) -> torch.Tensor:
        """Magnitude mel spectrogram [..., n_mels, frames] of float32 waves [..., samples] (MEL_SETTINGS)."""
        shape = waves.shape
        spectrum = torch.stft(waves.reshape(-1, shape[-1]), n_fft=MEL_SETTINGS["n_fft"],
                              hop_length=MEL_SETTINGS["hop_length"], win_length=MEL_SETTINGS["n_fft"],
                              window=self.window, center=MEL_SETTINGS["center"], pad_mode="reflect",
                              normalized=False, onesided=True, return_complex=True)
        magnitude = spectrum.reshape(shape[:-1] + spectrum.shape[-2:]).abs()  # power 1.0
        return torch.matmul(magnitude.transpose(-1, -2), self.filters).transpose(-1, -2)

    @torch.no_grad()
    def mel_l1(self, reference: np.ndarray, test: np.ndarray) -> float:
        pair = torch.from_numpy(np.stack([reference, test]).astype(np.float32))
        log_mel = torch.log(torch.clamp(self.mel(pair), min=MEL_SETTINGS["floor"]))
        return float((log_mel[0] - log_mel[1]).abs().mean())

    def stoi(self, reference: np.ndarray, test: np.ndarray) -> float:
        pystoi = require("pystoi", "bench", COMMAND)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pystoi warns (and returns ~1e-5) on clips shorter than 30 frames
            return float(pystoi.stoi(reference.astype(np.float64), test.astype(np.float64), self.sample_rate,
                                     extended=False))

    def pesq(self, reference: np.ndarray, test: np.ndarray) -> tuple[float, str]:
        """(wideband PESQ MOS-LQO, note); NaN with a note such as `pesq:no_utterances` when unscorable."""
        from mmtok.media.audio import resample

        pesq = require("pesq", "bench", COMMAND)

        ref16 = resample(reference, self.sample_rate, PESQ_RATE).astype(np.float64)
        deg16 = resample(test, self.sample_rate, PESQ_RATE).astype(np.float64)
        try:
            return float(pesq.pesq(PESQ_RATE, ref16, deg16, "wb")), ""
        except pesq.PesqError as err:
            return math.nan, "pesq:" + _snake(type(err).__name__.removesuffix("Error"))

    def score(self, reference: np.ndarray, test: np.ndarray) -> tuple[dict[str, float], str]:
        """Metrics of one pair (test trimmed/padded to the reference length) and a note ('' when all scored)."""
        test = match_length(test, reference.size)
        pesq_value, note = self.pesq(reference, test)
        return {"mel_l1": self.mel_l1(reference, test), "stoi": self.stoi(reference, test), "pesq": pesq_value}, note


def mel_filterbank(sample_rate: int, n_fft: int, n_mels: int) -> torch.Tensor:
    """[n_fft // 2 + 1, n_mels] triangular filters on the HTK mel scale from 0 Hz to sample_rate // 2,
    unnormalized: torchaudio's `melscale_fbanks(norm=None, mel_scale="htk")`, computed by the same steps in
    the same float32 order, so mel L1 equals torchaudio's MelSpectrogram without depending on torchaudio
    (whose wheels follow torch releases and would pull a training container's torch along)."""
    nyquist = float(sample_rate // 2)
    freqs = torch.linspace(0, sample_rate // 2, n_fft // 2 + 1)
    mel_points = torch.linspace(0.0, 2595.0 * math.log10(1.0 + nyquist / 700.0), n_mels + 2)
    hz_points = 700.0 * (10.0 ** (mel_points / 2595.0) - 1.0)
    widths = hz_points[1:] - hz_points[:-1]
    slopes = hz_points.unsqueeze(0) - freqs.unsqueeze(1)
    rising = (-1.0 * slopes[:, :-2]) / widths[:-1]
    falling = slopes[:, 2:] / widths[1:]
    return torch.max(torch.zeros(1), torch.min(rising, falling))


def match_length(wave: np.ndarray, length: int) -> np.ndarray:
    """float32 copy of `wave` cut or zero-padded to `length` samples."""
    wave = np.asarray(wave, dtype=np.float32)
    if wave.size >= length:
        return wave[:length]
    return np.pad(wave, (0, length - wave.size))


def _snake(name: str) -> str:
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))
