"""Emu3 vision tokenizer: parity with the official code's golden vectors, and the codec contract."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from mmtok.codecs import emu3
from mmtok.codecs.registry import load_codec
from mmtok.errors import MmtokError
from mmtok.media.images import resize_rgb
from mmtok.media.resize import target_shape
from realmedia import skimage_images

NAMES = ("astronaut", "coffee", "rocket", "chelsea", "immunohistochemistry")


@pytest.fixture(scope="module")
def gold(golden_sets):
    return golden_sets("emu3")


@pytest.fixture(scope="module")
def model(gold):
    torch.set_num_threads(2)  # the golden set was made with 2 threads
    return emu3.load(gold / "checkpoint", "cpu")


def npz(gold, name):
    with np.load(gold / name) as data:
        return {key: data[key] for key in data.files}


def test_golden_checkpoint_loads_strictly_with_official_key_names(model, gold):
    from safetensors.torch import load_file

    state = load_file(str(gold / "checkpoint" / "model.safetensors"))
    ours = model.state_dict()
    assert set(ours) == set(state)
    assert all(torch.equal(ours[k], state[k]) for k in state)
    assert model.pixels_per_code == 8 and model.codebook_size == 32768
    assert model.resize_defaults == {"factor": 8, "min_pixels": 4096, "max_pixels": 16384, "max_aspect": 5.0}


def test_pixel_values_are_bit_identical_to_the_processor(model, gold):
    inputs, pixel_values = npz(gold, "inputs_uint8.npz"), npz(gold, "pixel_values.npz")
    for name in NAMES:
        ours = emu3._to_model_input(torch.from_numpy(inputs[name].copy())[None], 8)
        assert np.array_equal(ours.numpy(), pixel_values[name]), name


def test_codes_match_the_official_code_exactly(model, gold):
    inputs, codes = npz(gold, "inputs_uint8.npz"), npz(gold, "codes.npz")
    for name in NAMES:
        ours = model.encode(torch.from_numpy(inputs[name].copy())[None])
        assert ours.dtype == torch.int32 and tuple(ours.shape) == codes[name].shape
        assert np.array_equal(ours.numpy(), codes[name]), name


def test_quantizer_input_matches_the_reference_latents(model, gold):
    inputs, latents = npz(gold, "inputs_uint8.npz"), npz(gold, "latents.npz")
    for name in NAMES:
        x = emu3._to_model_input(torch.from_numpy(inputs[name].copy())[None], 8)
        clip = model.encoder.spatial(x)[:, :, None].expand(-1, -1, 4, -1, -1)
        with torch.no_grad():
            ours = model.latents(model.encoder.temporal(clip))
        np.testing.assert_allclose(ours.numpy(), latents[name], atol=1e-4, err_msg=name)


def test_decoded_frame_zero_matches_within_tolerance(model, gold):
    codes, decoded = npz(gold, "codes.npz"), npz(gold, "decoded.npz")
    for name in NAMES:
        ours = model.decode(torch.from_numpy(codes[name]))
        assert ours.dtype == torch.float32 and tuple(ours.shape) == decoded[name].shape
        np.testing.assert_allclose(ours.numpy(), decoded[name], atol=1e-4, rtol=0, err_msg=name)


def test_all_four_decoded_frames_match_the_temporal_path(model, gold):
    codes, frames = npz(gold, "codes.npz"), npz(gold, "decoded_frames.npz")
    for name in NAMES:
        ours = model.decode_frames(torch.from_numpy(codes[name])[:, None])
        np.testing.assert_allclose(ours.numpy(), frames[name], atol=1e-2, rtol=0, err_msg=name)


def test_video_clip_codes_exact_and_decode_within_frame_tolerance(model, gold):
    video = npz(gold, "video.npz")
    pixels = emu3._to_model_input(torch.from_numpy(video["frames_uint8"].copy()), 8)
    assert np.array_equal(pixels.numpy(), video["pixel_values"][0])
    codes = model.encode_frames(torch.from_numpy(video["pixel_values"]))
    assert np.array_equal(codes.numpy(), video["codes"])
    decoded = model.decode_frames(codes).numpy()
    # Later frames are badly conditioned (the README: float32 vs float64 differ by up to 4.6e-3 in the
    # reference itself), so compare each frame relative to its own largest value.
    for t in range(decoded.shape[1]):
        scale = np.abs(video["decoded"][0, t]).max()
        assert np.abs(decoded[0, t] - video["decoded"][0, t]).max() <= 5e-3 * scale, t


def test_float64_decode_agrees_with_the_reference_as_its_own_float64_check_did(gold):
    # Structural check free of float32 rounding: our float64 decode differs from the reference float32
    # output by at most what the reference's own float64 re-evaluation found (4.6e-3 on the worst frame).
    model = emu3.load(gold / "checkpoint", "cpu").double()
    video = npz(gold, "video.npz")
    with torch.no_grad():
        decoded = model.decode_frames(torch.from_numpy(video["codes"])).numpy()
    assert np.abs(decoded - video["decoded"]).max() < 1e-2


def test_preprocess_cases_follow_the_plan_rule_with_the_checkpoint_bounds(model, gold):
    cases = npz(gold, "preprocess_cases.npz")
    rule = model.resize_defaults
    for key in [k for k in cases if k.endswith("__uint8")]:
        name = key[: -len("__uint8")]
        raw = cases[key]
        height, width = target_shape(*raw.shape[:2], min_pixels=rule["min_pixels"], max_pixels=rule["max_pixels"],
                                     factor=rule["factor"])
        pixels = resize_rgb(Image.fromarray(raw), height, width).copy()
        ours = emu3._to_model_input(torch.from_numpy(pixels)[None], 8).numpy()
        assert np.array_equal(ours, cases[name + "__pixel_values"]), name


# ---- the contract on random checkpoints -------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return emu3.write_random_checkpoint(tmp_path_factory.mktemp("emu3") / "ckpt", seed=3)


def real_image(size: int = 96) -> np.ndarray:
    path = next(p for p in skimage_images() if p.stem == "chelsea")
    return resize_rgb(Image.open(path).convert("RGB"), size, size + 32).copy()


def test_random_checkpoint_is_official_layout_and_loads_through_the_registry(tiny):
    assert sorted(p.name for p in tiny.iterdir()) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Emu3VisionVQModel"] and config["codebook_size"] == 32768
    codec = load_codec("emu3", tiny, "cpu")
    assert codec.name == "emu3" and codec.modality == "image" and codec.pixels_per_code == 8
    assert codec.describe()["precision"] == {"tf32_matmul": False, "tf32_conv": False, "tf32_rnn": False,
                                             "dtype": "float32", "deterministic": True}
    assert len(codec.checkpoint_sha256) == 64
    assert codec.resize_defaults["min_pixels"] == 512 * 512  # the official processor's bounds


def test_random_checkpoint_is_deterministic_per_seed(tmp_path, tiny):
    again = emu3.write_random_checkpoint(tmp_path / "same", seed=3)
    other = emu3.write_random_checkpoint(tmp_path / "other", seed=4)
    same_bytes = (tiny / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == same_bytes
    assert (other / "model.safetensors").read_bytes() != same_bytes


def test_random_codes_spread_over_the_codebook_and_round_trip_shapes(tiny):
    codec = emu3.load(tiny)
    pixels = torch.from_numpy(real_image())[None]
    codes = codec.encode(pixels)
    assert tuple(codes.shape) == (1, 12, 16) and codes.dtype == torch.int32
    assert len(torch.unique(codes)) > codes.numel() // 4
    nchw = codec.encode(pixels.permute(0, 3, 1, 2).contiguous())
    assert torch.equal(codes, nchw)
    decoded = codec.decode(codes)
    assert decoded.dtype == torch.float32 and tuple(decoded.shape) == (1, 3, 96, 128)
    assert torch.equal(codec.encode(pixels), codes)  # repeatable


def test_codes_of_an_image_do_not_depend_on_its_batch_mates(model, gold):
    # On the golden checkpoint (a realistic codebook spread: smallest margin 1.5e-4). A random 4-D codebook
    # of 32,768 rows has near-ties that batch-size-dependent conv rounding (~1e-6) can flip.
    astronaut = npz(gold, "inputs_uint8.npz")["astronaut"]
    batch = np.stack([astronaut, np.ascontiguousarray(astronaut[::-1, ::-1])])
    together = model.encode(torch.from_numpy(batch))
    alone = torch.cat([model.encode(torch.from_numpy(x[None].copy())) for x in batch])
    assert torch.equal(together, alone)
    assert np.array_equal(together[:1].numpy(), npz(gold, "codes.npz")["astronaut"])


def test_image_shortcut_equals_the_four_frame_reference_path(model, gold, tiny):
    inputs = npz(gold, "inputs_uint8.npz")
    for name in NAMES:
        pixels = torch.from_numpy(inputs[name].copy())[None]
        clip = emu3._to_model_input(pixels, 8)[:, None].repeat(1, 4, 1, 1, 1)
        assert torch.equal(model.encode_frames(clip)[:, 0].to(torch.int32), model.encode(pixels)), name
    codec = emu3.load(tiny)
    codes = codec.encode(torch.from_numpy(real_image())[None])
    torch.testing.assert_close(codec.decode(codes), codec.decode_frames(codes[:, None])[:, 0], atol=1e-4, rtol=0)


def test_bad_inputs_are_refused_with_clear_errors(tiny, tmp_path):
    codec = emu3.load(tiny)
    with pytest.raises(MmtokError, match="multiple of 8"):
        codec.encode(torch.zeros(1, 20, 24, 3, dtype=torch.uint8))
    with pytest.raises(MmtokError, match="uint8"):
        codec.encode(torch.zeros(1, 16, 16, 3))
    with pytest.raises(MmtokError, match="codes must lie"):
        codec.decode(torch.full((1, 2, 2), 32768))
    with pytest.raises(MmtokError, match="not found"):
        emu3.load(tmp_path)
    broken = emu3.write_random_checkpoint(tmp_path / "broken")
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "ch": 64}))
    with pytest.raises(MmtokError, match="does not match"):
        emu3.load(broken)
