"""One item through one tokenizer: preprocess as training does, encode, decode, score (images and audio).

A task loads an item once (`load` -> the decoded source, or None and a reason), then `run` gives one
results row per tokenizer. Kept items (the first few of each category) also leave their inputs and
reconstructions under OUT/recon/ for the grids and the WAV pairs.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from mmtok.bench import metrics

RECON = "recon"
DISPLAY_SIDE = 1024  # the kept copy of a source image; reconstructions are kept at full size


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # wall times would otherwise measure kernel launches only


def _timed(device: torch.device, fn, *args):
    _synchronize(device)
    started = time.perf_counter()
    out = fn(*args)
    _synchronize(device)
    return out, time.perf_counter() - started


def _save_png(path: Path, pixels: np.ndarray) -> None:
    from PIL import Image

    from mmtok.fsutil import atomic_writer

    with atomic_writer(path) as handle:
        Image.fromarray(pixels).save(handle, format="PNG")


class ImageTask:
    """Images: decode + orient + RGB (mmtok.media.images), resize per tokenizer rule, PSNR/SSIM/LPIPS."""

    columns = ("item", "category", "source", "tokenizer", "status", "src_height", "src_width", "height", "width",
               "codes", "tokens", "psnr", "ssim", "lpips", "encode_s", "decode_s", "metrics_s", "note")

    def __init__(self, device: torch.device, text_tokenizer: str = "tekken"):
        from mmtok.text import load_text_tokenizer

        self.device = torch.device(device)
        self.scorer = metrics.ImageScorer(self.device)
        self.text = load_text_tokenizer(text_tokenizer)

    def settings(self) -> dict:
        return {"psnr": {"data_range": 255}, "ssim": metrics.SSIM_SETTINGS,
                "lpips": {"net": "alex", "version": "0.1", "weights": "mmtok/data/lpips_alex_v0.1.npz"},
                "reconstruction_to_uint8": "round(clamp((x + 1) * 127.5, 0, 255))",
                "tokens": "image block length: markers + dimension text tokens + codes + end-of-row markers",
                "text_tokenizer": self.text.describe()}

    def load(self, reader, location: tuple):
        from mmtok.media.images import ImageDecodeError, decode_rgb

        try:
            return decode_rgb(reader.read(location)), ""
        except ImageDecodeError as err:
            return None, err.reason
        except OSError:
            return None, "read_error"

    def tokens(self, height: int, width: int) -> int:
        from mmtok.vocab import VocabLayout

        return VocabLayout.image_block_length(height, width, len(self.text.encode(f"{height}*{width}")))

    def run(self, entry, image, keep_dir: Path | None, slug: str) -> dict:
        from mmtok.media.images import resize_rgb

        row = {"src_height": image.height, "src_width": image.width}
        shape, reason = entry.rule.target(image.height, image.width)
        if shape is None:
            return {**row, "status": reason}
        pixels = resize_rgb(image, *shape)
        codec, device = entry.codec, self.device
        batch = torch.from_numpy(pixels[None].copy()).to(device)
        codes, encode_s = _timed(device, codec.encode, batch)
        decoded, decode_s = _timed(device, codec.decode, codes)
        started = time.perf_counter()
        recon = metrics.to_uint8(decoded)[0]
        scores, note = self.scorer.score(pixels, recon)
        metrics_s = time.perf_counter() - started
        if keep_dir is not None:
            _save_png(keep_dir / RECON / f"{slug}__{entry.spec.label}.png", recon)
        code_h, code_w = codes.shape[1:]
        return {**row, "status": "ok", "height": shape[0], "width": shape[1], "codes": int(code_h * code_w),
                "tokens": self.tokens(int(code_h), int(code_w)), **scores,
                "encode_s": encode_s, "decode_s": decode_s, "metrics_s": metrics_s, "note": note}

    def keep_input(self, image, keep_dir: Path, slug: str) -> None:
        """A display copy of the source (long side at most DISPLAY_SIDE) for the grids."""
        from PIL import Image

        view = image.copy()
        view.thumbnail((DISPLAY_SIDE, DISPLAY_SIDE), Image.BICUBIC)
        _save_png(keep_dir / RECON / f"{slug}__input.png", np.asarray(view, dtype=np.uint8))


class AudioTask:
    """Audio: mono, resampled to the codec rate (soxr VHQ), peak-normalized as the pipeline does;
    tokens per second, mel L1, STOI, wideband PESQ."""

    columns = ("item", "category", "source", "tokenizer", "status", "duration_s", "samples", "codes", "tokens_per_s",
               "mel_l1", "stoi", "pesq", "encode_s", "decode_s", "metrics_s", "note")

    def __init__(self, sample_rate: int):
        self.sample_rate = sample_rate
        self.scorer = metrics.AudioScorer(sample_rate)

    def settings(self) -> dict:
        from mmtok.media.audio import PEAK_DBFS, RESAMPLER

        return {"sample_rate": self.sample_rate, "mel_l1": metrics.MEL_SETTINGS, "stoi": {"extended": False},
                "pesq": {"mode": "wb", "rate": metrics.PESQ_RATE, "resampler": RESAMPLER},
                "input": {"peak_dbfs": PEAK_DBFS, "resampler": RESAMPLER},
                "tokens_per_s": "codes of the clip / clip duration"}

    def load(self, reader, location: tuple):
        import io

        import soundfile

        from mmtok.media.audio import AudioReason, check_finite, peak_normalize, resample, to_mono

        try:
            samples, rate = soundfile.read(io.BytesIO(reader.read(location)), dtype="float32", always_2d=False)
            mono = to_mono(samples)
            check_finite(mono)
            return peak_normalize(resample(mono, rate, self.sample_rate)), ""
        except AudioReason as err:
            return None, err.reason
        except (OSError, RuntimeError, soundfile.LibsndfileError):
            return None, "decode_error"

    def run(self, entry, wave: np.ndarray, keep_dir: Path | None, slug: str) -> dict:
        codec = entry.codec
        device = next(codec.parameters()).device
        batch = torch.from_numpy(wave[None].copy()).to(device)
        (codes, counts), encode_s = _timed(device, codec.encode, batch, torch.tensor([wave.size], device=device))
        count = int(counts[0])
        decoded, decode_s = _timed(device, codec.decode, codes[:, :count])
        started = time.perf_counter()
        recon = decoded[0].float().cpu().numpy()[: wave.size]
        scores, note = self.scorer.score(wave, recon)
        metrics_s = time.perf_counter() - started
        if keep_dir is not None:
            self._save_wav(keep_dir / RECON / f"{slug}__{entry.spec.label}.wav", metrics.match_length(recon, wave.size))
        duration = wave.size / self.sample_rate
        return {"status": "ok", "duration_s": duration, "samples": int(wave.size), "codes": count,
                "tokens_per_s": count / duration, **scores, "encode_s": encode_s, "decode_s": decode_s,
                "metrics_s": metrics_s, "note": note}

    def keep_input(self, wave: np.ndarray, keep_dir: Path, slug: str) -> None:
        self._save_wav(keep_dir / RECON / f"{slug}__input.wav", wave)

    def _save_wav(self, path: Path, wave: np.ndarray) -> None:
        import soundfile

        from mmtok.fsutil import atomic_writer

        with atomic_writer(path) as handle:
            soundfile.write(handle, np.clip(wave, -1.0, 1.0), self.sample_rate, subtype="PCM_16", format="WAV")
