"""Codes that do not depend on the batch: the same input gives the same codes whatever batch it is in.

The plan's batch list depends on --world-size (batches are split at rank targets), so merged bytes are
world-size independent only if an image's codes do not depend on its batch size or its neighbours, and
a clip's kept codes not on its duration bucket. On the CPU this holds bit for bit (latents included);
the GPU is measured by benchmarks/gpu_check.py (batch_invariance step).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mmtok.codecs import emu3, emu35
from mmtok.codecs import wavtokenizer as wt
from mmtok.codecs.base import Conv1d, Conv2d
from mmtok.media.audio import load_audio, peak_normalize
from mmtok.media.images import load_rgb_file, resize_rgb
from realmedia import alsa_sounds, asterisk_prompts, skimage_images

BATCH_SIZES = (1, 2, 3, 8, 17)
IMAGES = 17


def real_photos(count: int, height: int, width: int) -> torch.Tensor:
    """`count` real skimage photos resized (bicubic, as the pipeline) to one shape: uint8 [N, H, W, 3]."""
    paths = [p for p in skimage_images() if p.suffix.lower() in (".png", ".jpg")]
    return torch.from_numpy(np.stack([resize_rgb(load_rgb_file(str(paths[i % len(paths)])), height, width)
                                      for i in range(count)]))


def in_batches(encode, pixels: torch.Tensor, size: int) -> torch.Tensor:
    return torch.cat([encode(pixels[start:start + size]) for start in range(0, len(pixels), size)])


def compositions(count: int) -> list[np.ndarray]:
    """Orders that put every image between other neighbours (reversed, interleaved, seeded shuffles)."""
    rng = np.random.default_rng(0)
    return [np.arange(count)[::-1], np.concatenate([np.arange(0, count, 2), np.arange(1, count, 2)]),
            *(rng.permutation(count) for _ in range(2))]


def assert_batch_invariant(encode, pixels: torch.Tensor) -> torch.Tensor:
    """encode(pixels) image by image equals it in every batch size and order; returns the one-by-one result."""
    alone = in_batches(encode, pixels, 1)
    for size in BATCH_SIZES[1:]:
        assert torch.equal(in_batches(encode, pixels, size), alone), f"batch size {size}"
    for order in compositions(len(pixels))[2:3]:
        for size in (8,):
            shuffled = in_batches(encode, pixels[torch.from_numpy(order.copy())], size)
            assert torch.equal(shuffled[torch.from_numpy(np.argsort(order))], alone), f"order {order}, batch {size}"
    return alone


@pytest.fixture(scope="module")
def emu35_codec(tmp_path_factory):
    return emu35.load(emu35.write_random_checkpoint(tmp_path_factory.mktemp("emu35")), "cpu")


@pytest.fixture(scope="module")
def emu3_codec(tmp_path_factory):
    # A random 32,768 x 4 codebook is full of near-ties: any batch-dependent rounding would flip codes here.
    return emu3.load(emu3.write_random_checkpoint(tmp_path_factory.mktemp("emu3") / "ckpt", seed=3), "cpu")


# ------------------------------------------------------------------------------------ images


def test_emu35_latents_and_codes_do_not_depend_on_batch_size_or_neighbours(emu35_codec):
    pixels = real_photos(IMAGES, 32, 48)
    alone = assert_batch_invariant(emu35_codec.latents, pixels)  # bit for bit, before the argmax
    codes_alone = torch.cat([emu35_codec.quantize.codes(latents[None]) for latents in alone]).to(torch.int32)
    assert torch.equal(emu35_codec.encode(pixels), codes_alone)


def test_emu3_codes_do_not_depend_on_batch_size_or_neighbours(emu3_codec):
    assert_batch_invariant(emu3_codec.encode, real_photos(IMAGES, 32, 40))


def test_emu35_quantizer_code_ignores_the_other_vectors_of_its_block(emu35_codec):
    latents = emu35_codec.latents(real_photos(4, 64, 64))
    quantizer = emu35_codec.quantize
    together = quantizer.codes(latents)
    alone = torch.cat([quantizer.codes(latents[i:i + 1]) for i in range(len(latents))])
    assert torch.equal(together, alone)
    for budget in (1 << 12, 1 << 16):  # a smaller block: still one shape for every batch
        assert torch.equal(quantizer.codes(latents, budget=budget), together)


@pytest.mark.parametrize("conv, shape", [(Conv2d(32, 32, 3, padding=1), (17, 32, 8, 8)),
                                         (Conv2d(64, 64, 1), (17, 64, 4, 4)),
                                         (Conv2d(32, 32, 3, stride=2), (17, 32, 9, 9)),
                                         (Conv1d(32, 64, 8, stride=4), (17, 32, 600))])
def test_cpu_convolution_gives_a_sample_the_same_output_in_any_batch(conv, shape):
    # Plain nn.Conv2d switches kernels between one small image and a batch (im2col vs oneDNN, ~1e-6 apart).
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        batched = conv(x)
        for start, size in ((0, 1), (5, 1), (3, 2), (8, 9)):
            assert torch.equal(conv(x[start:start + size]), batched[start:start + size]), (start, size)


# ------------------------------------------------------------------------------------ audio


@pytest.fixture(scope="module")
def wav_codec(tmp_path_factory):
    return wt.load(wt.write_random_checkpoint(tmp_path_factory.mktemp("wavtokenizer")), "cpu")


def speech_clips(count: int) -> list[np.ndarray]:
    """`count` real speech clips at 24 kHz, 0.15 to 0.4 s, cut at varied sample counts (n mod 600)."""
    sources = [load_audio(str(p))[0] for p in alsa_sounds()[:2] + asterisk_prompts()[:6]]
    rng = np.random.default_rng(1)
    clips = []
    for index in range(count):
        wave = sources[index % len(sources)]
        length = min(wave.size, int(rng.integers(3_601, 9_600)))
        start = int(rng.integers(0, wave.size - length + 1))
        clips.append(peak_normalize(wave[start:start + length]))
    return clips


def kept_codes(codec, clips: list[np.ndarray], order, size: int) -> dict[int, np.ndarray]:
    """Encode clips[order] in zero-padded batches of `size` (the encode stage's layout); each clip's kept codes."""
    kept = {}
    for start in range(0, len(order), size):
        group = list(order[start:start + size])
        encoded = codec.encode_clips([clips[i] for i in group], sample_rate=wt.SAMPLE_RATE)
        for index, codes in zip(group, encoded, strict=True):
            kept[index] = codes
    return kept


def test_wavtokenizer_kept_codes_do_not_depend_on_batch_size_bucket_or_neighbours(wav_codec):
    clips = speech_clips(IMAGES)
    alone = kept_codes(wav_codec, clips, range(len(clips)), 1)
    assert all(alone[i].size == wt.trimmed_count(clip.size) for i, clip in enumerate(clips))
    by_duration = np.argsort([clip.size for clip in clips])
    layouts = [(range(len(clips)), size) for size in BATCH_SIZES[1:]]  # mixed durations: much padding
    layouts += [(by_duration[::-1], 3), (compositions(len(clips))[2], 8)]  # duration buckets; other neighbours
    for order, size in layouts:
        batched = kept_codes(wav_codec, clips, order, size)
        for index in range(len(clips)):
            np.testing.assert_array_equal(batched[index], alone[index], err_msg=f"clip {index}, batch {size}")


def test_wavtokenizer_clip_padded_alike_has_identical_codes_in_any_batch(wav_codec):
    # Same padded length, different batch sizes: every code (trimmed or not) and the encoder output agree.
    clips = speech_clips(8)
    width = max(clip.size for clip in clips)
    wave = torch.zeros(len(clips), width)
    for row, clip in zip(wave, clips, strict=True):
        row[: clip.size] = torch.from_numpy(clip)
    lengths = torch.tensor([clip.size for clip in clips])
    codes, _ = wav_codec.encode(wave, lengths)
    for start, size in ((0, 1), (3, 1), (2, 3), (5, 3)):
        part, _ = wav_codec.encode(wave[start:start + size], lengths[start:start + size])
        assert torch.equal(part, codes[start:start + size]), (start, size)
