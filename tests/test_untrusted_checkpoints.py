"""Untrusted checkpoints and tokenizers (issue 35): a checkpoint or a tokenizer from a stranger never writes a
corpus of wrong tokens with exit 0, and never ends in a traceback.

* a non-finite weight (one NaN tensor made every image code 0 and every clip audio code 0) is refused at load,
  naming the tensor; latents that overflow are refused at encode before anything is committed; a batch whose
  every code is one value is flagged (counted, with a warning line);
* a tokenizer whose ids are not contiguous (a token moved past the vocabulary, into the image codes) is refused
  by every stage that tokenizes text;
* every unreadable or malformed checkpoint is one line naming the file, exit 2 -- and a pickle's code never runs.
"""

from __future__ import annotations

import collections
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from encodekit import chat_tokenizer
from mmtok.bench.lpips import LPIPS
from mmtok.cli import main
from mmtok.codecs import emu3, emu35
from mmtok.codecs import wavtokenizer as wt
from mmtok.commands.demo_flow import DEMO_DATA
from mmtok.errors import MmtokError
from mmtok.text import load_text_tokenizer

PHOTO = DEMO_DATA / "images" / "chelsea.jpg"
SPEECH = sorted((DEMO_DATA / "audio").glob("*.flac"))[0]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A random-weight checkpoint of each codec, in the official formats."""
    root = tmp_path_factory.mktemp("checkpoints")
    return {"emu3.5": emu35.write_random_checkpoint(root / "emu35"),
            "emu3": emu3.write_random_checkpoint(root / "emu3"),
            "wavtokenizer": wt.write_random_checkpoint(root / "wt")}


def _edited(source: Path, target: Path, edit) -> Path:
    """A copy of checkpoint directory `source` whose state dict `edit` changed in place."""
    shutil.copytree(source, target)
    for name in ("model.ckpt", "model.safetensors"):
        path = target / name
        if not path.exists():
            continue
        if name.endswith(".safetensors"):
            state = load_file(str(path))
            edit(state)
            save_file(state, str(path), metadata={"format": "pt"})
        else:
            checkpoint = torch.load(path, weights_only=True)
            edit(checkpoint.get("state_dict", checkpoint))
            torch.save(checkpoint, path)
    return target


def _codec_encode(codec: str, checkpoint: Path, tmp_path: Path) -> int:
    source = SPEECH if codec == "wavtokenizer" else PHOTO
    return main(["codec", "encode", "--codec", codec, "--checkpoint", str(checkpoint), str(source),
                 "--out", str(tmp_path / "codes.npy"), "--device", "cpu"])


def _one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("wavtokenizer:")]
    assert len(lines) == 1, lines
    return lines[0]


# -- 1. non-finite weights and latents, uniform codes -------------------------------------------------
TENSORS = {"emu3.5": "encoder.conv_in.weight", "emu3": "encoder.conv_in.weight",
           "wavtokenizer": "feature_extractor.encodec.encoder.model.0.conv.conv.weight_v"}


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("codec", sorted(TENSORS))
def test_a_non_finite_weight_is_refused_at_load_naming_the_tensor(checkpoints, tmp_path, capsys, codec, value):
    key = TENSORS[codec]
    bad = _edited(checkpoints[codec], tmp_path / "bad", lambda state: state[key].fill_(value))
    assert _codec_encode(codec, bad, tmp_path) == 2
    line = _one_line(capsys)
    assert f"tensor {key!r} holds" in line and "non-finite values" in line, line
    assert not (tmp_path / "codes.npy").exists()


def test_a_zero_weight_norm_direction_that_folds_to_nan_is_refused(checkpoints, tmp_path, capsys):
    key = TENSORS["wavtokenizer"]
    bad = _edited(checkpoints["wavtokenizer"], tmp_path / "bad", lambda state: state[key].zero_())
    assert _codec_encode("wavtokenizer", bad, tmp_path) == 2
    assert "non-finite values" in _one_line(capsys)


def _overflowing(state, key: str) -> None:
    key = key.replace("weight_v", "weight_g")  # weight norm divides a direction by its norm: scale the magnitude
    state[key].fill_(3e38)  # finite, but every sum of a few of them overflows float32


@pytest.mark.parametrize("codec", sorted(TENSORS))
def test_latents_that_overflow_are_refused_at_encode(checkpoints, tmp_path, capsys, codec):
    bad = _edited(checkpoints[codec], tmp_path / "bad", lambda state: _overflowing(state, TENSORS[codec]))
    assert _codec_encode(codec, bad, tmp_path) == 2
    line = _one_line(capsys)
    assert "the encoder gave" in line and "non-finite values" in line and "nothing of it was committed" in line, line


def test_an_audio_batch_whose_every_code_is_one_value_is_flagged(checkpoints, tmp_path, monkeypatch, capsys):
    shar = _speech_shar(tmp_path, clips=2)
    encode = wt.WavTokenizer.encode
    monkeypatch.setattr(wt.WavTokenizer, "encode", lambda self, wave, lengths, *a: (
        lambda codes, counts: (codes * 0 + 3, counts))(*encode(self, wave, lengths, *a)))
    capsys.readouterr()
    assert main(["encode", "--modality", "audio", "--shar", str(shar), "--checkpoint", str(checkpoints["wavtokenizer"]),
                 "--out", str(tmp_path / "audio"), "--num-workers", "0", "--no-progress", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 batch gave every clip one code (flagged:uniform_codes)" in err, err
    assert main(["merge", str(tmp_path / "audio")]) == 0
    merged = json.loads((tmp_path / "audio" / "merged.json").read_text())
    assert merged["counts"]["flagged:uniform_codes"] == 1


# -- 3. malformed checkpoints: one line naming the file; a pickle's code never runs --------------------
class _NotAllowed(dict):
    """Outside torch's allowlist (like Lightning's AttributeDict): sends the load to the inert unpickler."""


class _BadArguments:
    """Pickles as an allowlisted global called with arguments it refuses."""

    def __reduce__(self):
        return (collections.OrderedDict, (5,))


class _BadRebuild:
    def __reduce__(self):
        return (torch._utils._rebuild_parameter, ("x", 1, 2))


def _leave_marker(path: str) -> str:
    Path(path).write_text("code from the checkpoint ran")
    return path


class _LeavesMarker:
    """Would write a file when unpickled, if anything from the checkpoint ran: through a function (inert
    placeholder: the file loads) or through a bound method (a placeholder "called": the file is refused)."""

    def __init__(self, path: str, method: bool = False):
        self.path, self.method = path, method

    def __reduce__(self):
        if self.method:
            return (Path(self.path).write_text, ("code from the checkpoint ran",))
        return (_leave_marker, (self.path,))


def _with_metadata(source: Path, target: Path, metadata) -> Path:
    shutil.copytree(source, target)
    checkpoint = torch.load(target / "model.ckpt", weights_only=True)
    checkpoint["hyper_parameters"] = metadata
    torch.save(checkpoint, target / "model.ckpt")
    return target


def _speech_shar(tmp_path: Path, clips: int = 1) -> Path:
    source = tmp_path / "speech"
    source.mkdir()
    for clip in sorted((DEMO_DATA / "audio").glob("*.flac"))[:clips]:
        shutil.copy(clip, source / clip.name)
    assert main(["audio", "convert", str(source), "--out", str(tmp_path / "shar"), "--workers", "1",
                 "--no-progress"]) == 0
    return tmp_path / "shar"


@pytest.mark.parametrize("metadata", [
    [_NotAllowed(a=1), _BadArguments()],      # the inert reload, then a bad call
    [_BadArguments()],                        # weights_only itself raises TypeError
    [_BadRebuild()],                          # weights_only raises AttributeError
    [_NotAllowed(a=1), _LeavesMarker("MARKER", method=True)],  # an inert placeholder "called"
], ids=["inert-then-bad-call", "bad-call", "bad-rebuild", "inert-called"])
def test_a_malformed_wavtokenizer_ckpt_is_one_line_in_codec_encode_and_audio_encode(checkpoints, tmp_path, capsys,
                                                                                    metadata):
    marker = tmp_path / "marker"
    metadata = [_LeavesMarker(str(marker), m.method) if isinstance(m, _LeavesMarker) else m for m in metadata]
    bad = _with_metadata(checkpoints["wavtokenizer"], tmp_path / "bad", metadata)
    assert _codec_encode("wavtokenizer", bad, tmp_path) == 2
    line = _one_line(capsys)
    assert f"{bad / 'model.ckpt'}: not a readable PyTorch checkpoint" in line, line
    shar = _speech_shar(tmp_path)
    capsys.readouterr()
    assert main(["encode", "--modality", "audio", "--shar", str(shar), "--checkpoint", str(bad),
                 "--out", str(tmp_path / "audio"), "--num-workers", "0", "--no-progress", "--device", "cpu"]) == 2
    assert f"{bad / 'model.ckpt'}: not a readable PyTorch checkpoint" in _one_line(capsys)
    assert not marker.exists()


def test_a_pickle_that_would_run_code_in_unread_metadata_never_runs_it(checkpoints, tmp_path):
    marker = tmp_path / "marker"
    loaded = wt.load(_with_metadata(checkpoints["wavtokenizer"], tmp_path / "ok",
                                    {"hparams": _NotAllowed(a=1), "callback": _LeavesMarker(str(marker))}))
    assert not marker.exists()  # the file loads (only its state_dict is used), and nothing of it ran
    assert torch.equal(loaded.codebook.embed, wt.load(checkpoints["wavtokenizer"]).codebook.embed)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("damage, expected", [
    (lambda d: _truncate(d / "model.safetensors"), "not a readable safetensors file"),
    (lambda d: (d / "config.json").write_text("{not json"), "not valid JSON"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "expected a JSON object"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "ch_mult": "abc"})), "ch_mult must be a list"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "ch": 64})), "does not match"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "ch": 33})), "describes no network this codec builds"),
    (lambda d: (d / "config.json").write_text(json.dumps({**json.loads((d / "config.json").read_text()),
                                                          "codebook_size": 10 ** 12})), "does not match"),  # no 16 TB
    (lambda d: (d / "preprocessor_config.json").write_text(json.dumps({"min_pixels": "many"})),
     "min_pixels must be a positive integer"),
    (lambda d: (d / "preprocessor_config.json").write_text(json.dumps({"min_pixels": 10 ** 18, "max_pixels": 1})),
     "min_pixels 1,000,000,000,000,000,000 is above max_pixels 1"),
    (lambda d: _edit_safetensors(d, lambda s: s.update({"encoder.conv_in.weight": s["encoder.conv_in.weight"].int()})),
     "tensor 'encoder.conv_in.weight' is torch.int32, expected torch.float32"),
], ids=["truncated", "bad-json", "not-an-object", "mistyped-key", "wrong-shape", "no-network", "huge-codebook",
     "bad-preprocessor", "pixels-crossed", "int-weight"])
def test_a_damaged_emu3_checkpoint_is_one_line(checkpoints, tmp_path, capsys, damage, expected):
    bad = tmp_path / "bad"
    shutil.copytree(checkpoints["emu3"], bad)
    damage(bad)
    assert _codec_encode("emu3", bad, tmp_path) == 2
    line = _one_line(capsys)
    assert expected in line and str(bad) in line, line


def _edit_safetensors(directory: Path, edit) -> None:
    state = load_file(str(directory / "model.safetensors"))
    edit(state)
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})


def test_an_integer_wavtokenizer_weight_is_refused(checkpoints, tmp_path, capsys):
    key = TENSORS["wavtokenizer"]
    bad = _edited(checkpoints["wavtokenizer"], tmp_path / "bad",
                  lambda state: state.update({key: state[key].to(torch.int64)}))
    assert _codec_encode("wavtokenizer", bad, tmp_path) == 2
    assert f"{bad / 'model.ckpt'}: tensor {key!r} is torch.int64, expected floating point" in _one_line(capsys)


@pytest.mark.parametrize("damage, expected", [
    (lambda path: _truncate(path), "not a readable .npz"),
    (lambda path: _rewrite_npz(path, lambda a: a.update({k: a[k][:1] for k in list(a)[:1]})), "not the LPIPS AlexNet"),
    (lambda path: _rewrite_npz(path, lambda a: a.update({k: np.full_like(a[k], np.nan) for k in list(a)[:1]})),
     "non-finite values"),
    (lambda path: _rewrite_npz(path, lambda a: a.update({k: a[k].astype(np.int64) for k in list(a)[:1]})),
     "expected float32"),
], ids=["truncated", "wrong-shape", "nan", "integer"])
def test_damaged_lpips_weights_are_one_line(tmp_path, damage, expected):
    from mmtok.bench.lpips import WEIGHTS

    path = tmp_path / "lpips.npz"
    shutil.copy(WEIGHTS, path)
    damage(path)
    with pytest.raises(MmtokError, match=expected):
        LPIPS(path)


def _rewrite_npz(path: Path, edit) -> None:
    with np.load(path) as arrays:
        state = {key: arrays[key] for key in arrays.files}
    edit(state)
    np.savez(path, **state)


# -- 2. tokenizers whose ids are not contiguous --------------------------------------------------------
def _moved_token_tokenizer(tmp_path: Path) -> tuple[Path, int]:
    """The chat tokenizer with one ordinary token moved past the vocabulary (what the adversarial check did)."""
    directory = chat_tokenizer(tmp_path / "tok")
    state = json.loads((directory / "tokenizer.json").read_text())
    vocab = state["model"]["vocab"]
    moved = next(piece for piece, index in vocab.items() if index > 100)
    vocab[moved] = 5000
    (directory / "tokenizer.json").write_text(json.dumps(state))
    return directory, vocab[moved]


@pytest.mark.parametrize("command", [
    ["sft", "CONVS", "--out", "OUT", "--no-progress"],
    ["audio", "convert", "--kind", "conversations", "CONVS", "--out", "OUT", "--no-progress"],
    ["tokenizer", "build", "--out", "OUT"],
], ids=["sft", "audio-convert", "tokenizer-build"])
def test_a_tokenizer_whose_ids_are_not_contiguous_is_refused_at_start_up(tmp_path, capsys, command):
    directory, moved = _moved_token_tokenizer(tmp_path)
    convs = tmp_path / "c.jsonl"
    convs.write_text(json.dumps({"messages": [{"role": "user", "content": "hello there"},
                                              {"role": "assistant", "content": "hi"}]}) + "\n")
    argv = [{"CONVS": str(convs), "OUT": str(tmp_path / "out")}.get(a, a) for a in command]
    assert main([*argv, "--text-tokenizer", str(directory)]) == 2
    line = _one_line(capsys)
    assert "its ids are not contiguous" in line and f"highest id {moved:,}" in line, line
    assert not any((tmp_path / "out").rglob("*.bin"))


def test_a_text_id_outside_the_vocabulary_is_never_returned(tmp_path):
    """The last guard, for a tokenizer that passes the start-up check and still gives an id past its size."""
    tokenizer = load_text_tokenizer(str(chat_tokenizer(tmp_path / "tok")))
    assert tokenizer.encode("hello there")
    tokenizer.vocab_size = 10  # as if every id from 10 on were in the image range
    with pytest.raises(MmtokError, match="outside its 10 text ids"):
        tokenizer.encode("hello there")
    with pytest.raises(MmtokError, match="outside its 10 text ids"):
        tokenizer.encode_many(["hello there"])


# -- 4. checkpoint files that leave their directory ----------------------------------------------------
FILES = {"emu3.5": "config.yaml", "emu3": "config.json", "wavtokenizer": "model.ckpt"}


@pytest.mark.parametrize("codec", sorted(FILES))
def test_a_checkpoint_file_that_links_outside_its_directory_is_refused(checkpoints, tmp_path, capsys, codec):
    linked = tmp_path / "linked"
    shutil.copytree(checkpoints[codec], linked)
    name = next(p.name for p in linked.iterdir() if p.name == FILES[codec] or p.suffix == Path(FILES[codec]).suffix)
    (tmp_path / "elsewhere").mkdir()
    shutil.move(linked / name, tmp_path / "elsewhere" / name)
    (linked / name).symlink_to(tmp_path / "elsewhere" / name)
    assert _codec_encode(codec, linked, tmp_path) == 2
    line = _one_line(capsys)
    assert f"checkpoint file {linked / name} resolves to {tmp_path / 'elsewhere' / name}, outside its directory" in line


def test_a_checkpoint_in_the_hub_cache_layout_loads(checkpoints, tmp_path):
    repo = tmp_path / "models--org--emu3"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for number, file in enumerate(sorted(checkpoints["emu3"].iterdir())):
        shutil.copy(file, blobs / f"blob{number}")
        (snapshot / file.name).symlink_to(f"../../blobs/blob{number}")
    loaded, direct = emu3.load(snapshot), emu3.load(checkpoints["emu3"])
    assert all(torch.equal(value, direct.state_dict()[key]) for key, value in loaded.state_dict().items())


def test_audio_parts_of_another_checkpoint_are_refused_before_the_codec_loads(checkpoints, tmp_path, monkeypatch,
                                                                               capsys):
    """Issue 48.4, audio: the shards' parts are the run; a rank with another checkpoint stops at start-up."""
    from mmtok.codecs import registry

    shar = _speech_shar(tmp_path, clips=2)
    command = ["encode", "--modality", "audio", "--shar", str(shar), "--out", str(tmp_path / "audio"),
               "--num-workers", "0", "--no-progress", "--device", "cpu"]
    assert main([*command, "--checkpoint", str(checkpoints["wavtokenizer"])]) == 0
    other = wt.write_random_checkpoint(tmp_path / "other", seed=3)
    monkeypatch.setattr(registry, "load_codec", lambda *a, **k: pytest.fail("the codec was loaded"))
    capsys.readouterr()
    assert main([*command, "--checkpoint", str(other)]) == 2
    assert "holds part-00000, a part of another run: codec.checkpoint_sha256" in _one_line(capsys)


def test_a_float64_weight_that_overflows_float32_is_refused_at_load(checkpoints, tmp_path, capsys):
    """1e300 is finite in float64 and Inf in the float32 the codec runs in: checked as the model holds it."""
    key = "quantize.embedding.weight"

    def big(state):
        state[key] = state[key].double()
        state[key][0, 0] = 1e300

    bad = _edited(checkpoints["emu3"], tmp_path / "bad", big)
    assert _codec_encode("emu3", bad, tmp_path) == 2
    assert f"tensor {key!r} holds 1 non-finite values" in _one_line(capsys)


def test_the_inert_unpickler_sets_no_state_on_a_class_of_the_running_process():
    """GLOBAL collections.Counter, then BUILD with a (None, slots) state: the standard unpickler sets a class
    attribute in this process; the fallback loader refuses it (torch's weights-only loader does too)."""
    import io
    import pickle

    crafted = b"\x80\x02ccollections\nCounter\nN}X\x08\x00\x00\x00tamperedX\x03\x00\x00\x00yess\x86b."
    pickle.loads(crafted)  # what the standard unpickler does with it: sets a class attribute of this process
    assert collections.Counter.tampered == "yes"
    del collections.Counter.tampered
    with pytest.raises(pickle.UnpicklingError, match="state set on type Counter"):
        wt._InertUnpickler(io.BytesIO(crafted)).load()
    assert not hasattr(collections.Counter, "tampered")


def test_only_marker_shaped_template_tokens_become_controls(tmp_path):
    """Issue 48.1, kept narrow: an added word the template's code holds (`role`) stays text, tokenized as the
    tokenizers library does; a marker it writes (`<|user_end|>`) unflagged is a control."""
    from tokenizers import Tokenizer

    directory = chat_tokenizer(tmp_path / "tok")
    state = json.loads((directory / "tokenizer.json").read_text())
    for token in state["added_tokens"]:
        if token["content"] == "<|user_end|>":
            token["special"] = False
    (directory / "tokenizer.json").write_text(json.dumps(state))
    library = Tokenizer.from_file(str(directory / "tokenizer.json"))
    library.add_tokens(["role"])
    library.save(str(directory / "tokenizer.json"))
    tokenizer = load_text_tokenizer(str(directory))
    assert tokenizer.promoted_controls == ["<|user_end|>"]
    text = "Say your role."
    assert tokenizer.encode(text) == library.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("codes, flagged", [
    ([np.full((3, 3), 7)], True),                     # one image, every code one value
    ([np.full((2, 2), 7), np.full((1, 4), 7)], True),  # two images, the same value
    ([np.full((2, 2), 7), np.full((1, 4), 8)], False),
    ([np.array([7])], False),                          # one code says nothing
    ([None, np.full((2, 2), 3)], True),                # a failed image (no codes) beside a uniform one
])
def test_uniform_codes_flags_a_batch_of_one_value_whatever_its_size(codes, flagged):
    from mmtok.encode.loop import UNIFORM_CODES, uniform_codes

    assert uniform_codes(codes) == ({UNIFORM_CODES: 1} if flagged else {})
