"""WavTokenizer 40 codes/s: exact parity with the official code's golden vectors, the uniform trim on
real speech, strict loading of the official files, and the precision contract."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from mmtok.cli import main
from mmtok.codecs import wavtokenizer as wt
from mmtok.codecs.base import PrecisionContract
from mmtok.codecs.registry import load_codec
from mmtok.errors import MmtokError, Skip
from mmtok.media.audio import load_audio, peak_normalize
from realmedia import ALSA_DIR, ASTERISK_DIR, alsa_sounds, asterisk_prompts

REFERENCE_LOOKAHEAD = 2877  # measured on the official code by perturbing single samples (golden README)


@pytest.fixture(scope="module")
def gold(golden_sets) -> Path:
    return golden_sets("wavtokenizer")


@pytest.fixture(scope="module")
def codec(gold):
    return load_codec("wavtokenizer", gold / "checkpoint", "cpu")


@pytest.fixture(scope="module")
def inputs(gold) -> dict[str, np.ndarray]:
    with np.load(gold / "inputs_24k.npz") as data:
        return {key: data[key] for key in data.files}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return wt.write_random_checkpoint(tmp_path_factory.mktemp("wavtokenizer-tiny"), seed=7)


def encode_alone(codec, wave: np.ndarray) -> np.ndarray:
    codes, counts = codec.encode(torch.from_numpy(wave)[None], [wave.size])
    assert int(counts[0]) == codes.shape[1] == math.ceil(wave.size / 600)
    return codes[0].numpy()


def padded_batch(clips: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    batch = np.zeros((len(clips), max(c.size for c in clips)), np.float32)
    for row, clip in zip(batch, clips, strict=True):
        row[: clip.size] = clip
    return torch.from_numpy(batch), torch.tensor([c.size for c in clips])


def rewrite(source: Path, target: Path, edit_state=None, edit_config=None) -> Path:
    """Copy a checkpoint directory as config.yaml + model.safetensors; the edits mutate in place."""
    from safetensors.torch import save_file

    state = dict(wt.read_state_dict(source / "model.ckpt"))
    if edit_state:
        edit_state(state)
    config = yaml.safe_load((source / "config.yaml").read_text())
    if edit_config:
        edit_config(config["model"]["init_args"])
    target.mkdir(parents=True)
    (target / "config.yaml").write_text(yaml.safe_dump(config))
    save_file({k: v.contiguous() for k, v in state.items()}, str(target / "model.safetensors"))
    return target


# --- golden parity --------------------------------------------------------------------------------


def test_single_clip_codes_equal_reference_codes(codec, gold, inputs):
    with np.load(gold / "codes_single.npz") as reference:
        for key, wave in inputs.items():
            np.testing.assert_array_equal(encode_alone(codec, wave), reference[key], err_msg=key)


def test_batched_codes_equal_reference_batched_codes(codec, gold, inputs):
    with np.load(gold / "codes_batched.npz") as reference:
        names, n_samples, expected = list(reference["names"]), reference["n_samples"], reference["codes"]
    wave, lengths = padded_batch([inputs[name] for name in names])
    codes, counts = codec.encode(wave, lengths)
    assert codes.dtype == torch.int32
    np.testing.assert_array_equal(codes.numpy(), expected)
    np.testing.assert_array_equal(counts.numpy(), -(-n_samples // 600))


def test_encoder_output_matches_reference(codec, gold, inputs):
    with np.load(gold / "encoder_out.npz") as reference, torch.inference_mode():
        for key, wave in inputs.items():
            latents = codec.encoder(torch.from_numpy(wave)[None, None])[0].numpy()
            scale = np.abs(reference[key]).max()
            assert np.abs(latents - reference[key]).max() <= 1e-5 * scale, key


def test_distance_gaps_match_reference(codec, gold, inputs):
    """The codebook scores are the reference's -(|x|^2 - 2x.e + |e|^2): the best/second-best gaps agree."""
    with np.load(gold / "distance_margin.npz") as reference, torch.inference_mode():
        for key, wave in inputs.items():
            rows = codec.encoder(torch.from_numpy(wave)[None, None])[0].t()
            embed = codec.codebook.embed
            scores = -(rows.pow(2).sum(1, keepdim=True) - 2 * rows @ embed.t() + embed.pow(2).sum(1)[None])
            top2 = scores.topk(2, dim=1).values
            np.testing.assert_allclose((top2[:, 0] - top2[:, 1]).numpy(), reference[key], atol=2e-3, err_msg=key)


def test_decoded_audio_within_1e4_of_reference(codec, gold):
    with np.load(gold / "codes_single.npz") as codes, np.load(gold / "decoded.npz") as reference:
        for key in codes.files:
            decoded = codec.decode(torch.from_numpy(codes[key])[None])[0].numpy()
            assert decoded.dtype == np.float32 and decoded.shape == (codes[key].size * 600,)
            assert np.abs(decoded - reference[key]).max() < 1e-4, key


def test_safetensors_and_parametrizations_naming_give_the_same_codes(gold, inputs, tmp_path):
    def to_parametrizations(state):
        for old, new in (("weight_g", "parametrizations.weight.original0"),
                         ("weight_v", "parametrizations.weight.original1")):
            for key in [k for k in state if k.endswith(old)]:
                state[key[: -len(old)] + new] = state.pop(key)

    converted = wt.load(rewrite(gold / "checkpoint", tmp_path / "st", edit_state=to_parametrizations))
    with np.load(gold / "codes_single.npz") as reference:
        for key, wave in inputs.items():
            np.testing.assert_array_equal(encode_alone(converted, wave), reference[key])


def test_encoding_never_changes_weights_or_codebook(codec, inputs):
    before = {k: v.clone() for k, v in codec.state_dict().items()}
    wave = inputs["alsa_front_center"]
    expected = encode_alone(codec, wave)
    codec.train()  # even in training mode nothing may update (no EMA, no k-means, no dropout in the encoder)
    try:
        np.testing.assert_array_equal(encode_alone(codec, wave), expected)
    finally:
        codec.eval()
    after = codec.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
    assert float(codec.codebook.inited) == 1.0


# --- the uniform trim -----------------------------------------------------------------------------


def real_speech_clips() -> dict[str, np.ndarray]:
    """Real speech at 24 kHz through the shared resampler, some cut mid-speech at chosen n mod 600."""
    alsa = {p.name: p for p in alsa_sounds()}
    prompts = {p.name: p for p in asterisk_prompts()}
    picks = [(alsa["Front_Center.wav"], None), (alsa["Rear_Right.wav"], 600 * 40 + 1),
             (prompts["agent-pass.wav"], 600 * 70 + 477), (prompts["agent-loginok.wav"], None),
             (prompts["agent-alreadyon.wav"], 600 * 55 + 200), (prompts["auth-thankyou.wav"], 600 * 30 + 478),
             (prompts["conf-getpin.wav"], 600 * 62), (prompts["call-fwd-no-ans.wav"], 600 * 48 + 599)]
    assert all(p.parent in (ALSA_DIR, ASTERISK_DIR) for p, _ in picks)
    clips = {}
    for path, cut in picks:
        wave, rate = load_audio(str(path))
        assert rate in (48_000, 8_000)
        clips[f"{path.stem}@{cut}"] = peak_normalize(wave[:cut])
    return clips


def trailing_differences(alone: np.ndarray, batched: np.ndarray) -> int:
    """How many codes from the end of the clip's counted codes are within the differing span."""
    differing = np.flatnonzero(alone != batched)
    return 0 if differing.size == 0 else alone.size - differing[0]


def test_kept_codes_do_not_depend_on_the_batch_on_real_speech(codec):
    clips = real_speech_clips()
    names = list(clips)
    alone = {name: encode_alone(codec, clips[name]) for name in names}
    worst = 0
    for group in (names, names[0::2], names[1::2][::-1]):  # different partners, paddings and row orders
        wave, lengths = padded_batch([clips[n] for n in group])
        codes, counts = codec.encode(wave, lengths)
        for row, name in enumerate(group):
            counted = codes[row, : int(counts[row])].numpy()
            kept = wt.trimmed_count(clips[name].size)
            np.testing.assert_array_equal(counted[:kept], alone[name][:kept], err_msg=f"{name} in {group}")
            worst = max(worst, trailing_differences(alone[name], counted))
    kept_by_helper = codec.encode_clips([clips[n] for n in names[::-1]], sample_rate=24_000)
    for name, kept_codes in zip(names[::-1], kept_by_helper, strict=True):
        np.testing.assert_array_equal(kept_codes, alone[name][: wt.trimmed_count(clips[name].size)])
    # the padding does move the last codes of clips cut mid-speech (so the trim matters), never beyond 5
    assert 1 <= worst <= wt.TRIM


def test_lookahead_matches_single_sample_perturbations(codec):
    """A change at sample s first moves code ceil((s - 2877) / 600): the trim of 5 covers every reach."""
    assert codec.encoder.lookahead_samples() == REFERENCE_LOOKAHEAD
    assert wt.TRIM == math.ceil(REFERENCE_LOOKAHEAD / wt.HOP)
    wave = torch.randn(1, 1, 600 * 20, generator=torch.Generator().manual_seed(3)) * 0.1
    with torch.inference_mode():
        base = codec.encoder(wave)
        for sample in (6000, 6001, 6477, 6478, 9000):
            moved = wave.clone()
            moved[..., sample] += 0.5
            change = (codec.encoder(moved) - base).abs().amax(dim=(0, 1))
            first = int(torch.nonzero(change > 1e-4 * base.abs().max())[0])
            assert first == math.ceil((sample - REFERENCE_LOOKAHEAD) / 600), sample


def test_encode_zeroes_samples_past_each_length(codec, inputs):
    clips = [inputs["alsa_front_center"], inputs["allison_demo_echodone_cut50000"]]
    wave, lengths = padded_batch(clips)
    noisy = wave.clone()
    noisy[0, clips[0].size:] = 0.3  # stale buffer content past the clip must not leak into its codes
    np.testing.assert_array_equal(codec.encode(noisy, lengths)[0].numpy(), codec.encode(wave, lengths)[0].numpy())


def test_trimmed_count_is_ceil_minus_five_and_refuses_short_clips(codec):
    assert wt.trimmed_count(34_273) == 58 - 5
    assert wt.trimmed_count(72_000) == 120 - 5
    assert wt.trimmed_count(3_001) == 1
    for n in (3_000, 600, 1):
        with pytest.raises(Skip) as err:
            wt.trimmed_count(n)
        assert err.value.reason == "too_short"
    with pytest.raises(Skip, match="too_short"):
        codec.encode_clips([np.zeros(5000, np.float32) + 0.1, np.zeros(2000, np.float32) + 0.1], sample_rate=24_000)


# --- errors ---------------------------------------------------------------------------------------


def test_missing_key_is_named(tiny, tmp_path):
    key = "feature_extractor.encodec.encoder.model.13.lstm.weight_hh_l1"
    broken = rewrite(tiny, tmp_path / "missing", edit_state=lambda s: s.pop(key))
    with pytest.raises(MmtokError, match=f"missing key {key}"):
        wt.load(broken)


@pytest.mark.parametrize("section, entry, value, message", [
    ("feature_extractor", "dowmsamples", [8, 5, 4, 2], "hop of 320 samples"),
    ("head", "hop_length", 320, "head.hop_length is 320"),
    ("feature_extractor", "num_quantizers", 4, "num_quantizers is 4"),
])
def test_wrong_hop_or_config_is_refused(tiny, tmp_path, section, entry, value, message):
    def edit(model_args):
        model_args[section]["init_args"][entry] = value

    with pytest.raises(MmtokError, match=message):
        wt.load(rewrite(tiny, tmp_path / "bad", edit_config=edit))


def test_config_that_does_not_match_the_weights_names_the_first_mismatch(tiny, tmp_path):
    def wider(model_args):
        model_args["backbone"]["init_args"]["dim"] = model_args["head"]["init_args"]["dim"] = 64

    def shallower(model_args):
        model_args["backbone"]["init_args"]["num_layers"] = 1

    with pytest.raises(MmtokError, match=r"backbone\.embed\.weight has shape \[32, 512, 7\]"):
        wt.load(rewrite(tiny, tmp_path / "wide", edit_config=wider))
    with pytest.raises(MmtokError, match=r"unexpected key backbone\.convnext\.1\."):
        wt.load(rewrite(tiny, tmp_path / "shallow", edit_config=shallower))


def test_broken_weight_norm_and_uninitialized_codebook_are_refused(tiny, tmp_path):
    conv = "feature_extractor.encodec.encoder.model.3.conv.conv."
    with pytest.raises(MmtokError, match=f"{conv}weight_v has no matching {conv}weight_g"):
        wt.load(rewrite(tiny, tmp_path / "wn", edit_state=lambda s: s.pop(conv + "weight_g")))

    def uninitialized(state):
        state[wt.CODEBOOK_PREFIX + "inited"] = torch.zeros(1)

    with pytest.raises(MmtokError, match="never initialized"):
        wt.load(rewrite(tiny, tmp_path / "init", edit_state=uninitialized))


def test_checkpoint_directory_needs_one_config_and_one_weights_file(tiny, tmp_path):
    twice = tmp_path / "twice"
    shutil.copytree(tiny, twice)
    shutil.copy(twice / "model.ckpt", twice / "other.ckpt")
    with pytest.raises(MmtokError, match="found model.ckpt, other.ckpt"):
        wt.load(twice)
    flat = tmp_path / "flat"
    shutil.copytree(tiny, flat)
    (flat / "config.yaml").write_text(yaml.safe_dump({"feature_extractor": {}}))
    with pytest.raises(MmtokError, match="Lightning CLI layout"):
        wt.load(flat)


def test_non_24k_input_is_refused(codec, inputs):
    wave = inputs["alsa_front_center"]
    with pytest.raises(MmtokError, match="16000 Hz"):
        codec.encode(torch.from_numpy(wave)[None], [wave.size], sample_rate=16_000)
    with pytest.raises(MmtokError, match="8000 Hz.*soxr"):
        codec.encode_clips([wave], sample_rate=8_000)


def test_low_precision_is_refused(codec, inputs, tiny):
    with pytest.raises(MmtokError, match="bf16 encoding is refused"):
        wt.load(tiny, dtype="bf16")
    wave = torch.from_numpy(inputs["alsa_front_center"])[None]
    with pytest.raises(MmtokError, match="refused"):
        codec.encode(wave.to(torch.bfloat16), [wave.shape[1]])


# --- checkpoint loading paths and the random checkpoint writer -------------------------------------


def test_training_objects_in_a_ckpt_are_never_executed(tiny, tmp_path, caplog):
    """A Lightning ckpt whose metadata holds non-allowlisted objects loads, and none of its code runs."""
    target = tmp_path / "lightning"
    shutil.copytree(tiny, target)
    checkpoint = torch.load(target / "model.ckpt", weights_only=True)
    marker = tmp_path / "marker"
    checkpoint["hyper_parameters"] = _AttributeDict(lr=2e-4, trainer=_LeavesMarker(str(marker)))
    torch.save(checkpoint, target / "model.ckpt")
    loaded = wt.load(target)
    assert not marker.exists()
    assert "weights_only loading refused" in caplog.text  # a logged warning: stderr when nothing handles logs
    reference = wt.load(tiny)
    for key, value in reference.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


def _leave_marker(path: str) -> str:
    Path(path).write_text("code from the checkpoint ran")
    return path


class _LeavesMarker:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (_leave_marker, (self.path,))


class _AttributeDict(dict):
    """Like Lightning's AttributeDict: a dict subclass outside torch's allowlist."""


def test_random_checkpoint_has_the_official_layout(gold, tmp_path):
    golden_backbone = {"dim": 64, "intermediate_dim": 192, "num_layers": 2}
    written = wt.write_random_checkpoint(tmp_path / "layout", {"backbone": golden_backbone})
    ours = torch.load(written / "model.ckpt", weights_only=True)
    official = torch.load(gold / "checkpoint" / "model.ckpt", weights_only=True)
    assert set(ours) == set(official)
    shapes = {k: tuple(v.shape) for k, v in ours["state_dict"].items()}
    assert shapes == {k: tuple(v.shape) for k, v in official["state_dict"].items()}
    config = yaml.safe_load((written / "config.yaml").read_text())["model"]["init_args"]
    assert config["feature_extractor"]["init_args"]["dowmsamples"] == [6, 5, 5, 4]


def test_random_checkpoint_is_deterministic_tiny_and_loadable(tiny, tmp_path, inputs):
    again = wt.write_random_checkpoint(tmp_path / "again", seed=7)
    other = wt.write_random_checkpoint(tmp_path / "other", seed=8)
    first, second, third = (wt.read_state_dict(d / "model.ckpt") for d in (tiny, again, other))
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert not torch.equal(first[wt.CODEBOOK_PREFIX + "embed"], third[wt.CODEBOOK_PREFIX + "embed"])
    codec = wt.load(tiny)
    backbone_params = sum(p.numel() for p in codec.backbone.parameters())
    assert backbone_params < 200_000 and codec.config.backbone_dim == 32
    codes = encode_alone(codec, inputs["allison_conf_onlyperson"])
    assert len(set(codes.tolist())) > 10  # random weights still spread over the codebook
    assert codec.decode(torch.from_numpy(codes)[None].long()).shape == (1, codes.size * 600)


def test_precision_contract_is_strict_fp32_and_applied(codec, inputs):
    assert codec.precision == PrecisionContract(tf32_matmul=False, tf32_conv=False, tf32_rnn=False)
    assert codec.describe()["precision"]["dtype"] == "float32"
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.rnn.fp32_precision = "tf32"
    encode_alone(codec, inputs["alsa_front_center"])
    assert torch.backends.cuda.matmul.fp32_precision == "ieee"
    assert torch.backends.cudnn.conv.fp32_precision == "ieee"
    assert torch.backends.cudnn.rnn.fp32_precision == "ieee"


def test_describe_identifies_checkpoint_and_config(codec, tiny):
    described, other = codec.describe(), wt.load(tiny).describe()
    assert described["sample_rate"] == 24_000 and described["hop"] == 600 and described["trim"] == 5
    assert len(described["checkpoint_sha256"]) == 64
    assert described["checkpoint_sha256"] != other["checkpoint_sha256"]
    assert described["config"]["backbone_dim"] == 64 and other["config"]["backbone_dim"] == 32


# --- the CLI --------------------------------------------------------------------------------------


def test_cli_encode_decode_npy_reproduces_reference(gold, inputs, tmp_path):
    wave_path, codes_path = tmp_path / "clip.npy", tmp_path / "codes.npy"
    np.save(wave_path, inputs["allison_agent_pass_cut72000"])
    checkpoint = str(gold / "checkpoint")
    assert main(["codec", "encode", "--codec", "wavtokenizer", "--checkpoint", checkpoint, str(wave_path),
                 "--out", str(codes_path)]) == 0
    with np.load(gold / "codes_single.npz") as reference:
        np.testing.assert_array_equal(np.load(codes_path), reference["allison_agent_pass_cut72000"])
    for suffix in (".npy", ".wav"):
        out = tmp_path / f"decoded{suffix}"
        assert main(["codec", "decode", "--codec", "wavtokenizer", "--checkpoint", checkpoint, str(codes_path),
                     "--out", str(out)]) == 0
    import soundfile

    decoded_wav, rate = soundfile.read(tmp_path / "decoded.wav", dtype="float32")
    with np.load(gold / "decoded.npz") as reference:
        expected = reference["allison_agent_pass_cut72000"]
    assert rate == 24_000
    assert np.abs(np.load(tmp_path / "decoded.npy")[0] - expected).max() < 1e-4
    assert np.abs(decoded_wav - expected).max() < 1e-4


def test_cli_encodes_a_48k_audio_file_as_the_pipeline_does(codec, gold, tmp_path):
    source = next(p for p in alsa_sounds() if p.name == "Front_Left.wav")
    out = tmp_path / "codes.npy"
    assert main(["codec", "encode", "--codec", "wavtokenizer", "--checkpoint", str(gold / "checkpoint"),
                 str(source), "--out", str(out)]) == 0
    wave, _ = load_audio(str(source))
    expected = encode_alone(codec, peak_normalize(wave))
    np.testing.assert_array_equal(np.load(out), expected)
    assert expected.size == math.ceil(wave.size / 600)


def test_cli_reports_a_wrong_hop_config(tiny, tmp_path, capsys):
    def edit(model_args):
        model_args["feature_extractor"]["init_args"]["dowmsamples"] = [8, 5, 4, 2]

    bad = rewrite(tiny, tmp_path / "bad", edit_config=edit)
    np.save(tmp_path / "clip.npy", np.zeros(6000, np.float32))
    assert main(["codec", "encode", "--codec", "wavtokenizer", "--checkpoint", str(bad), str(tmp_path / "clip.npy"),
                 "--out", str(tmp_path / "codes.npy")]) == 2
    assert "hop of 320 samples" in capsys.readouterr().err
