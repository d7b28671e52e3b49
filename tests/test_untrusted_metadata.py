"""Untrusted metadata: a damaged `.idx`/`.bin`, a JSON file of the wrong shape, a broken tokenizer file or a
`--device` that is no device is one line on stderr naming the file (and the key), exit 2 -- never a traceback,
never a megabyte of file content in the message."""

from __future__ import annotations

import functools
import json
import struct
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

from mmtok.cli import main
from mmtok.formats.commitlog import PartWriter
from mmtok.formats.megatron import DatasetWriter
from mmtok.formats.partdir import IDENTITY, STATS, part_dir
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout

HEAD = 34  # magic (9) + version (8) + dtype code (1) + sequence count (8) + document count (8)
COUNT = 3  # sequences in the dataset every damage starts from


def one_error_line(capsys, *names: str) -> str:
    """The command's whole stderr: one `mmtok ...: error:` line, a few hundred characters, naming `names`."""
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "error:" in err and "Traceback" not in err, err[:2000]
    assert len(err) < 600, err[:2000]
    for name in names:
        assert str(name) in err, err
    return err


# -- damaged .idx / .bin -------------------------------------------------------------------------------
def _patch(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + len(data)] = data
    path.write_bytes(bytes(raw))


DAMAGES = {
    "truncated_idx": lambda idx, bin_: idx.write_bytes(idx.read_bytes()[:40]),
    "wrong_magic": lambda idx, bin_: _patch(idx, 0, b"XXIDIDX\x00\x00"),
    "flipped_version": lambda idx, bin_: _patch(idx, 9, b"\x07"),
    "flipped_dtype": lambda idx, bin_: _patch(idx, 17, b"\x63"),
    "count_past_the_end": lambda idx, bin_: _patch(idx, 18, struct.pack("<Q", 1 << 60)),
    "pointer_past_the_end": lambda idx, bin_: _patch(idx, HEAD + COUNT * 4 + 8, struct.pack("<q", 10**9)),
    "negative_length": lambda idx, bin_: _patch(idx, HEAD, struct.pack("<ii", -5, 10**6)),
    "document_index_past_the_end": lambda idx, bin_: _patch(idx, len(idx.read_bytes()) - 8, struct.pack("<q", 99)),
    "short_bin": lambda idx, bin_: bin_.write_bytes(bin_.read_bytes()[:-4]),
    "empty_bin": lambda idx, bin_: bin_.write_bytes(b""),
}


@functools.cache
def tekken():
    return load_text_tokenizer()


def damaged_dataset(root: Path, damage: str | None, text_size: int) -> Path:
    """OUT/merged: three caption-like sequences and a merged.json that records their layout, then `damage`
    (None: left intact)."""
    tokenizer = tekken()
    root.mkdir(parents=True, exist_ok=True)
    with DatasetWriter(root / "merged") as writer:
        for i in range(COUNT):
            writer.add(np.array([tokenizer.bos_id, *tokenizer.encode(f" sentence {i}"), tokenizer.eos_id]))
    layout = VocabLayout(text_size)
    (root / "merged.json").write_text(json.dumps({"identity": {
        "vocab": layout.offsets(), "text_tokenizer": {"name": "tekken", "bos_id": 1, "eos_id": 2}, "codec": {}}}))
    if damage:
        DAMAGES[damage](root / "merged.idx", root / "merged.bin")
    return root / "merged"


@pytest.fixture(scope="module")
def small_omni_tokenizer(tmp_path_factory) -> tuple[Path, int]:
    """An omnimodal tokenizer directory built from a 300-token base (fast to build), and that base's size."""
    root = tmp_path_factory.mktemp("omni")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, 300)}}
    base = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    base.pre_tokenizer = pre_tokenizers.Whitespace()
    base.add_special_tokens([AddedToken(name, special=True) for name in ("<unk>", "<s>", "</s>")])
    (root / "base").mkdir()
    base.save(str(root / "base" / "tokenizer.json"))
    (root / "base" / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    assert main(["tokenizer", "build", "--text-tokenizer", str(root / "base"), "--out", str(root / "omni")]) == 0
    return root / "omni", 300


@pytest.mark.damages_datasets
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_inspect_of_a_damaged_dataset_is_one_line_naming_the_file(tmp_path, capsys, damage):
    prefix = damaged_dataset(tmp_path, damage, tekken().vocab_size)
    assert main(["inspect", str(prefix), "--text-tokenizer", "tekken"]) == 2
    one_error_line(capsys, prefix.parent, "merged.")


@pytest.mark.damages_datasets
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_inspect_megatron_of_a_damaged_dataset_is_one_line_naming_the_file(tmp_path, capsys, damage):
    prefix = damaged_dataset(tmp_path, damage, tekken().vocab_size)
    assert main(["inspect", "--megatron", str(prefix)]) == 2
    one_error_line(capsys, prefix.parent, "merged.")


@pytest.mark.damages_datasets
@pytest.mark.parametrize("damage", ["pointer_past_the_end", "wrong_magic"])  # the rest: as for inspect
def test_tokenizer_check_of_a_damaged_dataset_is_one_line_naming_the_file(tmp_path, capsys, damage,
                                                                           small_omni_tokenizer):
    directory, text_size = small_omni_tokenizer
    prefix = damaged_dataset(tmp_path, damage, text_size)
    assert main(["tokenizer", "check", str(directory), "--data", str(prefix)]) == 2
    one_error_line(capsys, prefix.parent, "merged.")


@pytest.mark.damages_datasets
@pytest.mark.parametrize("token", [-(1 << 31), 1 << 30], ids=["negative", "past_the_vocabulary"])
def test_inspect_of_a_bin_holding_an_id_outside_the_vocabulary_is_one_line_naming_it(tmp_path, capsys, token):
    prefix = damaged_dataset(tmp_path, None, tekken().vocab_size)
    _patch(prefix.parent / "merged.bin", 4, struct.pack("<i", token))  # the second token of sequence 0: a flipped bit
    assert main(["inspect", str(prefix), "--text-tokenizer", "tekken"]) == 2
    one_error_line(capsys, prefix.parent, "merged.bin")


def test_an_intact_dataset_still_inspects(tmp_path, capsys):
    prefix = damaged_dataset(tmp_path, None, tekken().vocab_size)  # the checks pass every dataset mmtok writes
    assert main(["inspect", str(prefix), "--text-tokenizer", "tekken"]) == 0
    assert f"{COUNT} sequences" in capsys.readouterr().out
    assert main(["inspect", "--megatron", str(prefix)]) == 0


# -- JSON files that parse but have the wrong shape ------------------------------------------------------
def image_part(out: Path, part: int = 0, num_parts: int = 1, **identity) -> Path:
    directory = part_dir(out, part)
    full = {"part": part, "num_parts": num_parts, "modality": "image", "plan_fingerprint": "p",
            "part_batches": [part, part + 1], "text_tokenizer": {"name": "t", "bos_id": 1, "eos_id": 2}, **identity}
    with PartWriter(directory, {k: v for k, v in full.items() if v is not None}) as writer:
        writer.commit(0, [np.array([1, 5, 2], np.int32)], [{"key": "k"}], {"written": 1, "tokens": 3})
        writer.finish({"wall_s": 1.0})
    return directory


def replace_json(path: Path, value) -> None:
    path.write_text(json.dumps(value))


@pytest.mark.parametrize("command", ["merge", "status"])
@pytest.mark.parametrize("identity, key", [([0, 1], IDENTITY), ({"part": "0", "num_parts": 1}, "part"),
                                           ({"part": 0}, "num_parts"), ({"part": 0, "num_parts": [1]}, "num_parts"),
                                           ({"part": 0, "num_parts": 1, "part_batches": "0-1"}, "part_batches"),
                                           ({"part": 0, "num_parts": 1, "part_batches": [1, 0]}, "part_batches"),
                                           ({"part": 0, "num_parts": 1, "modality": ["image"]}, "modality")],
                         ids=["a_list", "a_string_part", "no_num_parts", "a_list_num_parts", "a_string_part_batches",
                              "a_backwards_part_batches", "a_list_modality"])
def test_an_identity_of_the_wrong_shape_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, command,
                                                                                 identity, key):
    directory = image_part(tmp_path)
    replace_json(directory / IDENTITY, identity)
    code = main([command, str(tmp_path), *(["--no-progress"] if command == "merge" else [])])
    if command == "status":  # status reports every part's state: this one is damaged, named with its key
        out = capsys.readouterr()
        assert code == 0 and "Traceback" not in out.err
        [line] = [line for line in out.out.splitlines() if " damaged " in line]
        assert str(directory / IDENTITY) in line and key in line and line.count(str(directory)) == 1, line
        return
    assert code == 2
    one_error_line(capsys, directory / IDENTITY, key)


def test_merge_of_a_checksummed_identity_without_text_special_ids_is_one_line(tmp_path, capsys):
    # the part's checksums match (PartWriter wrote it so): the shape is what is wrong
    directory = image_part(tmp_path, text_special_ids=["<|inner_prefix|>"])
    assert main(["merge", str(tmp_path), "--strip-reasoning", "--no-progress"]) == 2
    one_error_line(capsys, directory / IDENTITY, "text_special_ids")


@pytest.mark.parametrize("stats, key", [([1, 2], STATS), ({"counts": "many"}, "counts"),
                                        ({"counts": {}, "dataset": "yes"}, "dataset")],
                         ids=["a_list", "a_string_counts", "a_string_dataset"])
def test_inspect_of_stats_of_the_wrong_shape_is_one_line_naming_the_file_and_the_key(tmp_path, capsys, stats, key):
    directory = image_part(tmp_path)
    replace_json(directory / STATS, stats)
    assert main(["inspect", str(tmp_path)]) == 2
    one_error_line(capsys, directory / STATS, key)


@pytest.mark.parametrize("summary, key", [([], "merged.json"), ({"identity": []}, "identity"),
                                          ({"identity": {"vocab": {"text_size": "131072"}}}, "text_size"),
                                          ({"identity": {"vocab": [], "text_tokenizer": {}}}, "vocab")],
                         ids=["a_list", "a_list_identity", "a_string_text_size", "a_list_vocab"])
def test_inspect_megatron_of_a_merged_json_of_the_wrong_shape_names_the_file_and_the_key(tmp_path, capsys,
                                                                                        summary, key):
    prefix = damaged_dataset(tmp_path, None, 131_072)
    replace_json(tmp_path / "merged.json", summary)
    assert main(["inspect", "--megatron", str(prefix)]) == 2
    one_error_line(capsys, tmp_path / "merged.json", key)


def test_sft_of_an_image_run_whose_identity_has_the_wrong_shape_names_the_file_and_the_key(tmp_path, capsys):
    images = tmp_path / "images"
    directory = image_part(images, mode="sft", text_tokenizer="tekken", vocab=VocabLayout().offsets())
    conversations = tmp_path / "chat.jsonl"
    conversations.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    assert main(["sft", str(conversations), "--text-tokenizer", "tekken", "--images", str(images),
                 "--out", str(tmp_path / "sft"), "--no-progress"]) == 2
    one_error_line(capsys, directory / IDENTITY, "text_tokenizer")


def test_plain_inspect_of_a_merged_json_of_the_wrong_shape_names_the_file_and_the_key(tmp_path, capsys):
    prefix = damaged_dataset(tmp_path, None, 131_072)
    replace_json(tmp_path / "merged.json", {"identity": {"text_tokenizer": {"name": 7, "sha256": "x"}}})
    assert main(["inspect", str(prefix)]) == 2
    one_error_line(capsys, tmp_path / "merged.json", "name")


@pytest.mark.parametrize("name, value, key", [
    ("plan.json", [], "format"), ("plan.json", "a plan", "format"),
    ("plan.json", {"world_size": "2"}, "world_size"),
    ("plan.json", {"world_size": 2, "num_batches": 1, "fingerprint": "f", "files": ["plan.parquet"]}, "files"),
    ("manifest.json", [], "format"), ("manifest.json", 7, "format")],
    ids=["plan_a_list", "plan_a_string", "plan_a_string_world_size", "plan_a_list_of_files", "manifest_a_list",
         "manifest_a_number"])
def test_inspect_of_a_plan_or_manifest_json_of_the_wrong_shape_names_the_file(tmp_path, capsys, name, value, key):
    from mmtok.formats.plan import FORMAT, FORMAT_VERSION

    if isinstance(value, dict):  # a plan of this format and version: the shape of its keys is what is wrong
        value = {**value, "format": FORMAT, "format_version": FORMAT_VERSION}
    replace_json(tmp_path / name, value)
    assert main(["inspect", str(tmp_path)]) == 2
    one_error_line(capsys, tmp_path / name, key)


# -- tokenizer files: what the parser says is quoted briefly ---------------------------------------------
@pytest.fixture
def broken_tokenizer(tmp_path) -> Path:
    """A tokenizer.json that parses as JSON but whose vocabulary holds a 1 MB string where an id belongs: the
    tokenizers library's error quotes that string whole."""
    directory = tmp_path / "broken"
    directory.mkdir()
    (directory / "tokenizer.json").write_text(json.dumps(
        {"version": "1.0", "model": {"type": "BPE", "vocab": {"a": "x" * 1_000_000}, "merges": []}}))
    (directory / "tokenizer_config.json").write_text(json.dumps({"base_vocab_size": 300}))
    return directory


@pytest.mark.parametrize("command", ["inspect", "build", "check"])
def test_an_error_about_a_tokenizer_file_is_a_few_hundred_characters(tmp_path, capsys, broken_tokenizer, command):
    prefix = damaged_dataset(tmp_path / "data", None, 131_072)
    argv = {"inspect": ["inspect", str(prefix), "--text-tokenizer", str(broken_tokenizer)],
            "build": ["tokenizer", "build", "--text-tokenizer", str(broken_tokenizer), "--out", str(tmp_path / "o")],
            "check": ["tokenizer", "check", str(broken_tokenizer), "--data", str(prefix)]}[command]
    assert main(argv) == 2
    one_error_line(capsys, broken_tokenizer / "tokenizer.json")


def test_a_tokenizer_config_of_the_wrong_shape_names_the_file(tmp_path, capsys, broken_tokenizer):
    prefix = damaged_dataset(tmp_path / "data", None, 131_072)
    (broken_tokenizer / "tokenizer_config.json").write_text("[1, 2]")
    assert main(["inspect", str(prefix), "--text-tokenizer", str(broken_tokenizer)]) == 2
    one_error_line(capsys, broken_tokenizer / "tokenizer_config.json")


# -- --device ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["gpu0", "cuda:-1", "bogus", "cuda:0;rm"])
@pytest.mark.parametrize("command", ["encode", "audio_encode", "calibrate"])
def test_a_device_that_is_no_device_is_refused_saying_what_is_accepted(tmp_path, capsys, command, device):
    encode = ["encode", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "out")]
    argv = {"encode": [*encode, "--plan", str(tmp_path / "plan")],
            "audio_encode": [*encode, "--modality", "audio", "--shar", str(tmp_path / "shar")],
            "calibrate": ["calibrate", "--checkpoint", str(tmp_path), "--out", str(tmp_path / "cost.yaml")]}[command]
    with pytest.raises(SystemExit) as stopped:  # refused by argparse, before the command reads anything
        main([*argv, "--device", device])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert "Traceback" not in err and "error: argument --device:" in last and repr(device) in last, err
    assert "cpu, cuda, cuda:N" in last, err


def test_a_cuda_device_the_process_cannot_see_is_one_line(monkeypatch):
    import torch

    from mmtok.errors import MmtokError
    from mmtok.launch import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    with pytest.raises(MmtokError, match=r"sees 2 CUDA device\(s\), cuda:0 … cuda:1"):
        resolve_device("cuda:2")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
