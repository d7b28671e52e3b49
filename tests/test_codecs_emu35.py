"""Emu3.5 IBQ codec: golden parity, argmax vs official softmax path, strict loading, precision, CLI."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mmtok.cli import main
from mmtok.codecs import emu35
from mmtok.codecs.base import PrecisionContract, checkpoint_fingerprint
from mmtok.codecs.registry import load_codec
from mmtok.errors import MmtokError
from mmtok.media.images import load_rgb_file, resize_rgb
from realmedia import skimage_images

REAL_NAMES = ("astronaut.png", "coffee.png", "chelsea.png", "rocket.jpg")


def real_images(height: int, width: int) -> np.ndarray:
    """Real skimage photos resized (bicubic, as the pipeline does) to one shape: uint8 [N, H, W, 3]."""
    paths = {path.name: path for path in skimage_images()}
    return np.stack([resize_rgb(load_rgb_file(str(paths[name])), height, width) for name in REAL_NAMES])


@pytest.fixture(scope="module")
def golden_dir(golden_sets) -> Path:
    return golden_sets("emu35")


@pytest.fixture(scope="module")
def golden_codec(golden_dir):
    return emu35.load(golden_dir / "checkpoint", "cpu")


@pytest.fixture(scope="module")
def golden_arrays(golden_dir):
    return {name: dict(np.load(golden_dir / f"{name}.npz")) for name in ("inputs_uint8", "codes", "decoded", "latents")}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return emu35.write_random_checkpoint(tmp_path_factory.mktemp("emu35_tiny"))


@pytest.fixture(scope="module")
def tiny_codec(tiny_dir):
    return emu35.load(tiny_dir, "cpu")


@pytest.fixture(scope="module")
def full_codebook_codec(tmp_path_factory):
    """Tiny encoder, full-size 131,072 x 256 codebook, random weights, written and loaded as official files."""
    config = {**emu35.TINY_CONFIG, "n_embed": 131072, "embed_dim": 256}
    return emu35.load(emu35.write_random_checkpoint(tmp_path_factory.mktemp("emu35_full"), config, seed=5), "cpu")


# ------------------------------------------------------------------------------------ golden vectors


def test_golden_codes_are_reproduced_exactly(golden_codec, golden_arrays):
    for key, pixels in golden_arrays["inputs_uint8"].items():
        codes = golden_codec.encode(torch.from_numpy(pixels[None]))
        assert codes.dtype == torch.int32 and codes.shape == (1, *golden_arrays["codes"][key].shape)
        np.testing.assert_array_equal(codes[0].numpy(), golden_arrays["codes"][key], err_msg=key)


def test_golden_reference_path_reproduces_the_codes_too(golden_codec, golden_arrays):
    for key, pixels in golden_arrays["inputs_uint8"].items():
        codes = golden_codec.encode_reference(torch.from_numpy(pixels[None]))
        np.testing.assert_array_equal(codes[0].numpy(), golden_arrays["codes"][key], err_msg=key)


def test_golden_decoded_images_match_within_1e4(golden_codec, golden_arrays):
    for key, codes in golden_arrays["codes"].items():
        decoded = golden_codec.decode(torch.from_numpy(codes[None]))
        assert decoded.dtype == torch.float32 and decoded.shape == golden_arrays["decoded"][key].shape
        assert np.abs(decoded.numpy() - golden_arrays["decoded"][key]).max() < 1e-4, key


def test_golden_latents_match_within_1e4(golden_codec, golden_arrays):
    for key, pixels in golden_arrays["inputs_uint8"].items():
        latents = golden_codec.latents(torch.from_numpy(pixels[None]))
        assert np.abs(latents.numpy() - golden_arrays["latents"][key]).max() < 1e-4, key


def test_normalization_is_bit_identical_to_the_float64_route_for_every_byte(golden_codec):
    every_byte = np.arange(256, dtype=np.uint8).reshape(1, 16, 16, 1).repeat(3, axis=3)
    expected = (every_byte / 127.5 - 1).astype(np.float32).transpose(0, 3, 1, 2)
    normalized = golden_codec.normalize(torch.from_numpy(every_byte))
    assert normalized.dtype == torch.float32 and normalized.is_contiguous()
    np.testing.assert_array_equal(normalized.numpy().view(np.int32), expected.view(np.int32))


def test_codes_do_not_depend_on_layout_or_batch_composition(golden_codec):
    batch = real_images(48, 64)
    together = golden_codec.encode(torch.from_numpy(batch))
    channels_first = golden_codec.encode(torch.from_numpy(batch).permute(0, 3, 1, 2))
    one_by_one = torch.cat([golden_codec.encode(torch.from_numpy(image[None])) for image in batch])
    assert together.shape == (len(batch), 3, 4)
    assert torch.equal(together, channels_first) and torch.equal(together, one_by_one)
    assert torch.equal(together, golden_codec.encode(torch.from_numpy(batch)))  # deterministic


# ------------------------------------------------------------------------------ quantizer parity


def test_argmax_path_equals_softmax_path_on_real_and_random_images(tiny_codec):
    pixels = torch.from_numpy(real_images(64, 48))
    assert torch.equal(tiny_codec.encode(pixels), tiny_codec.encode_reference(pixels))
    noise = np.random.default_rng(0).integers(0, 256, (3, 64, 48, 3), dtype=np.uint8)
    for latents in (tiny_codec.latents(pixels), tiny_codec.latents(torch.from_numpy(noise))):
        reference, _ = tiny_codec.quantize.codes_reference(latents)
        for budget in (24, 1000, 4097, emu35.LOGITS_BUDGET):  # chunks that do not divide codebook or rows
            assert torch.equal(tiny_codec.quantize.codes(latents, budget=budget), reference)


def test_argmax_path_equals_softmax_path_with_the_full_size_codebook(full_codebook_codec):
    assert full_codebook_codec.quantize.embedding.weight.shape == (131072, 256)
    noise = np.random.default_rng(1).integers(0, 256, (2, 64, 64, 3), dtype=np.uint8)
    pixels = torch.from_numpy(np.concatenate([real_images(64, 64), noise]))
    codes = full_codebook_codec.encode(pixels)
    assert torch.equal(codes, full_codebook_codec.encode_reference(pixels))
    assert len(torch.unique(codes)) > 16  # a real spread of codes, not one winner everywhere


class LargestNewTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) that any op allocates; views of its inputs excluded."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in inputs:
                self.largest = max(self.largest, tensor.numel())
        return out


def test_chunked_argmax_never_materializes_more_than_its_budget(full_codebook_codec):
    quantizer = full_codebook_codec.quantize
    latents = full_codebook_codec.latents(torch.from_numpy(real_images(64, 64)))  # [4, 256, 4, 4]
    with torch.no_grad(), LargestNewTensor() as chunked:
        codes = quantizer.codes(latents, budget=1 << 16)
    with torch.no_grad(), LargestNewTensor() as reference:
        expected, _ = quantizer.codes_reference(latents)
    assert torch.equal(codes, expected)
    assert chunked.largest <= 1 << 16
    assert reference.largest >= latents.shape[0] * 131072 * 16  # the monitor sees the full logits there


def test_chunked_argmax_breaks_ties_like_torch_argmax():
    quantizer = emu35.Quantizer(10, 2)
    rows = [[0, 1], [3, 0], [5, 5], [1, 1], [5, 5], [2, 2], [0, 0], [5, 5], [4, 6], [6, 4]]
    with torch.no_grad():
        quantizer.embedding.weight.copy_(torch.tensor(rows, dtype=torch.float32))
    latents = torch.tensor([[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [-1.0, -1.0]]).T.reshape(1, 2, 2, 2)
    full = torch.einsum("bdhw,nd->bnhw", latents, quantizer.embedding.weight).argmax(dim=1)
    for budget in (3, 4, 7, 100):  # exact ties inside one chunk and across chunk boundaries
        assert torch.equal(quantizer.codes(latents, budget=budget), full)
    with torch.no_grad():
        quantizer.embedding.weight[6, 0] = float("nan")
    full = torch.einsum("bdhw,nd->bnhw", latents, quantizer.embedding.weight).argmax(dim=1)
    assert torch.equal(quantizer.codes(latents, budget=3), full)


# ------------------------------------------------------------------------------- loading, errors


def test_raw_state_dict_and_wrapped_state_dict_load_the_same(tiny_dir, tiny_codec, tmp_path):
    raw_dir = tmp_path / "raw"
    shutil.copytree(tiny_dir, raw_dir)
    state = torch.load(raw_dir / emu35.CHECKPOINT_FILE, weights_only=True)["state_dict"]
    torch.save(state, raw_dir / emu35.CHECKPOINT_FILE)
    raw = load_codec("emu3.5", raw_dir, "cpu")
    assert not raw.training
    pixels = torch.from_numpy(real_images(48, 48))
    assert torch.equal(raw.encode(pixels), tiny_codec.encode(pixels))


def test_random_checkpoint_is_deterministic_and_leaves_global_rng_alone(tmp_path):
    state = torch.random.get_rng_state()
    first = emu35.write_random_checkpoint(tmp_path / "a", seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = emu35.write_random_checkpoint(tmp_path / "b", seed=3)
    other = emu35.write_random_checkpoint(tmp_path / "c", seed=4)

    def weights(directory):
        return torch.load(directory / emu35.CHECKPOINT_FILE, weights_only=True)["state_dict"]

    a, b, c = weights(first), weights(second), weights(other)
    assert all(torch.equal(a[key], b[key]) for key in a)
    assert not torch.equal(a["quantize.embedding.weight"], c["quantize.embedding.weight"])
    assert (first / emu35.CONFIG_FILE).read_text() == (second / emu35.CONFIG_FILE).read_text()


def rewrite_config(directory: Path, edit) -> None:
    import yaml

    path = directory / emu35.CONFIG_FILE
    config = yaml.safe_load(path.read_text())
    edit(config)
    path.write_text(yaml.safe_dump(config))


@pytest.fixture
def tiny_copy(tiny_dir, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_dir, tmp_path / "ckpt"))


def test_misspelled_config_key_is_named(tiny_copy):
    rewrite_config(tiny_copy, lambda config: config.update(n_embeds=config.pop("n_embed")))
    with pytest.raises(MmtokError, match=r"unknown key 'n_embeds'.*did you mean 'n_embed'"):
        emu35.load(tiny_copy, "cpu")


def test_misspelled_ddconfig_key_is_named(tiny_copy):
    rewrite_config(tiny_copy, lambda config: config["ddconfig"].update(attn_resolution=[8]))
    with pytest.raises(MmtokError, match=r"config.yaml: unknown key 'attn_resolution' in ddconfig"):
        emu35.load(tiny_copy, "cpu")


def test_missing_config_key_and_code_changing_option_are_refused(tiny_copy):
    rewrite_config(tiny_copy, lambda config: config["ddconfig"].pop("z_channels"))
    with pytest.raises(MmtokError, match=r"missing key 'z_channels' in ddconfig"):
        emu35.load(tiny_copy, "cpu")
    with pytest.raises(MmtokError, match=r"l2_normalize=True .* not supported"):
        emu35.validate_config({**emu35.TINY_CONFIG, "l2_normalize": True})


def test_truncated_checkpoint_gives_a_clear_error(tiny_copy):
    path = tiny_copy / emu35.CHECKPOINT_FILE
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(MmtokError, match=r"model.ckpt: cannot be read .* truncated or corrupt"):
        emu35.load(tiny_copy, "cpu")


def test_shape_mismatch_names_the_key_and_both_shapes(tiny_copy):
    rewrite_config(tiny_copy, lambda config: config.update(embed_dim=64))
    with pytest.raises(MmtokError, match=r"'quantize.embedding.weight' has shape \[1024, 32\] in the checkpoint "
                                         r"but \[1024, 64\] in the architecture"):
        emu35.load(tiny_copy, "cpu")


def test_missing_and_unused_checkpoint_keys_are_named(tiny_copy):
    path = tiny_copy / emu35.CHECKPOINT_FILE
    state = torch.load(path, weights_only=True)["state_dict"]
    torch.save({"state_dict": {**state, "loss.discriminator.weight": torch.zeros(1)}}, path)
    with pytest.raises(MmtokError, match=r"key 'loss.discriminator.weight' is not used"):
        emu35.load(tiny_copy, "cpu")
    del state["encoder.mid.attn_1.k.bias"]
    torch.save({"state_dict": state}, path)
    with pytest.raises(MmtokError, match=r"key 'encoder.mid.attn_1.k.bias', required by .* is missing"):
        emu35.load(tiny_copy, "cpu")


def test_bad_pixels_and_codes_are_refused_clearly(tiny_codec):
    with pytest.raises(MmtokError, match=r"100x128 is not a multiple of 16"):
        tiny_codec.encode(torch.zeros(1, 100, 128, 3, dtype=torch.uint8))
    with pytest.raises(MmtokError, match=r"uint8 RGB pixels, got torch.float32"):
        tiny_codec.encode(torch.zeros(1, 3, 64, 64))
    with pytest.raises(MmtokError, match=r"\[B, H, W, 3\] or \[B, 3, H, W\]"):
        tiny_codec.encode(torch.zeros(64, 64, 3, dtype=torch.uint8))
    with pytest.raises(MmtokError, match=r"codes must lie in \[0, 1024\)"):
        tiny_codec.decode(torch.full((1, 2, 2), 1024))


# ------------------------------------------------------------------------------------- precision


def test_precision_contract_and_checkpoint_identity_are_recorded(tiny_dir, tiny_codec):
    assert tiny_codec.precision == PrecisionContract(tf32_matmul=True, tf32_conv=True, tf32_rnn=False,
                                                     dtype="float32", deterministic=True)
    identity = tiny_codec.describe()
    assert identity["precision"] == tiny_codec.precision.to_dict()
    assert identity["name"] == "emu3.5" and identity["pixels_per_code"] == 16 and identity["codebook_size"] == 1024
    assert identity["checkpoint_sha256"] == checkpoint_fingerprint(
        [tiny_dir / emu35.CONFIG_FILE, tiny_dir / emu35.CHECKPOINT_FILE])


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_is_refused_everywhere(tiny_dir, dtype):
    with pytest.raises(MmtokError, match="refused"):
        emu35.load(tiny_dir, "cpu", dtype=dtype)
    codec = emu35.load(tiny_dir, "cpu")
    pixels = torch.zeros(1, 32, 32, 3, dtype=torch.uint8)
    with pytest.raises(MmtokError, match="refused"), torch.autocast("cpu", dtype=getattr(torch, dtype)):
        codec.encode(pixels)
    with pytest.raises(MmtokError, match="refused"):
        codec.to(getattr(torch, dtype)).encode(pixels)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_golden_vectors_on_cuda_with_strict_fp32(golden_dir, golden_arrays):
    flags = (torch.backends.cuda.matmul, torch.backends.cudnn.conv, torch.backends.cudnn.rnn)
    saved = [flag.fp32_precision for flag in flags], torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic
    PrecisionContract(tf32_matmul=False, tf32_conv=False).apply()  # the golden set was made without TF32
    try:
        codec = emu35.load(golden_dir / "checkpoint", "cuda")
        for key, pixels in golden_arrays["inputs_uint8"].items():
            codes = codec.encode(torch.from_numpy(pixels[None]).cuda())
            np.testing.assert_array_equal(codes[0].cpu().numpy(), golden_arrays["codes"][key], err_msg=key)
            decoded = codec.decode(torch.from_numpy(golden_arrays["codes"][key][None]).cuda()).cpu().numpy()
            assert np.abs(decoded - golden_arrays["decoded"][key]).max() < 1e-4, key
    finally:
        for flag, value in zip(flags, saved[0], strict=True):
            flag.fp32_precision = value
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[1:]


# ------------------------------------------------------------------------------------------- CLI


def test_cli_encodes_npy_and_image_files_like_the_api(golden_dir, golden_codec, golden_arrays, tmp_path):
    checkpoint = str(golden_dir / "checkpoint")
    array = tmp_path / "astronaut.npy"
    np.save(array, golden_arrays["inputs_uint8"]["astronaut"])
    out = tmp_path / "codes.npy"
    assert main(["codec", "encode", "--codec", "emu3.5", "--checkpoint", checkpoint, str(array),
                 "--out", str(out)]) == 0
    codes = np.load(out)
    assert codes.dtype == np.int32
    np.testing.assert_array_equal(codes, golden_arrays["codes"]["astronaut"])

    photo = next(path for path in skimage_images() if path.name == "coffee.png")  # 400 x 600
    assert main(["codec", "encode", "--codec", "emu3.5", "--checkpoint", checkpoint, str(photo),
                 "--out", str(out)]) == 0
    expected = golden_codec.encode(torch.tensor(resize_rgb(load_rgb_file(str(photo)), 400, 608)[None]))
    np.testing.assert_array_equal(np.load(out), expected[0].numpy())


def test_cli_decodes_to_npy_and_png(golden_dir, golden_arrays, tmp_path):
    from PIL import Image

    checkpoint = str(golden_dir / "checkpoint")
    codes = tmp_path / "codes.npy"
    np.save(codes, golden_arrays["codes"]["chelsea"].astype(np.int32))
    for suffix in ("npy", "png"):
        out = tmp_path / f"recon.{suffix}"
        command = ["codec", "decode", "--codec", "emu3.5", "--checkpoint", checkpoint, str(codes), "--out", str(out)]
        assert main(command) == 0
    expected = golden_arrays["decoded"]["chelsea"]
    assert np.abs(np.load(tmp_path / "recon.npy") - expected).max() < 1e-4
    image = np.asarray(Image.open(tmp_path / "recon.png"))
    assert image.shape == (80, 112, 3)
    as_pixels = np.clip((expected[0].transpose(1, 2, 0) + 1) * 127.5, 0, 255)
    assert np.abs(image - as_pixels).max() <= 1.0


def test_cli_reports_a_non_multiple_of_16_array(golden_dir, tmp_path, capsys):
    array = tmp_path / "odd.npy"
    np.save(array, np.zeros((40, 64, 3), dtype=np.uint8))
    rc = main(["codec", "encode", "--codec", "emu3.5", "--checkpoint", str(golden_dir / "checkpoint"), str(array),
               "--out", str(tmp_path / "codes.npy")])
    assert rc == 2 and "not a multiple of 16" in capsys.readouterr().err
