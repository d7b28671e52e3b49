"""`mmtok audio convert --kind conversations`: the audio that SFT conversations reference (tar members,
files, inline bytes) becomes the same Shar clips as the files themselves, named `<conversation id>/audio-<k>`;
what cannot be found is dropped by name, and clips already in an audio cache are left alone."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import soundfile

from audio_corpus import digit, write_jsonl
from convertkit import assert_counts_add_up, dropped_records, encoded, load_cuts, make_tar, report, stored_bytes
from mmtok.audio import convert as convert_module
from mmtok.audio import sources
from mmtok.audio.convert import ConvertOptions, convert
from mmtok.cli import main as cli_main
from realmedia import alsa_sounds

OPTIONS = ConvertOptions(shard_size=2)
WRITTEN = {  # clip id -> the reference file (under media/) whose audio it must be
    "chats/c1/audio-0": "one.wav",
    "chats/c2/audio-0": "speech.flac",
    "chats/c2/audio-1": "inline.wav",
    "j-front/audio-0": "front.wav",
    "calls/00000000/audio-0": "three.wav",
    "calls/00000000/audio-1": "four.wav",
}
DROPPED = {  # id -> reason
    "chats/c5": "invalid_json",
    "talk/00000002/audio-0": "missing_media",
    "j-silent/audio-0": "silent",
    "calls/00000001": "placeholder_mismatch",
}


def user_then_assistant(content, answer: str = "Noted.") -> list[dict]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


def sidecar(content, **record) -> bytes:
    return json.dumps({"messages": user_then_assistant(content), **record}).encode()


def write_media(folder: Path) -> dict[str, bytes]:
    """Real speech (asterisk digits at 8 kHz, alsa's Front Center at 48 kHz) and digital silence; the
    files of the reference `--kind dir` conversion. Returns name -> file bytes."""
    folder.mkdir(parents=True)
    front = next(p for p in alsa_sounds() if p.name == "Front_Center.wav")
    files = {"one.wav": digit("1").read_bytes(), "speech.flac": encoded(digit("2")),
             "inline.wav": encoded(digit("5"), "WAV"), "front.wav": front.read_bytes(),
             "three.wav": digit("3").read_bytes(), "four.wav": encoded(digit("4"), "WAV")}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    soundfile.write(folder / "silent.wav", np.zeros(16_000, np.float32), 16_000, subtype="PCM_16")
    files["silent.wav"] = (folder / "silent.wav").read_bytes()
    return files


def write_conversations(root: Path) -> list[Path]:
    """A conversation tar, a .jsonl with relative paths and a .parquet with an `audios` bytes list."""
    media = write_media(root / "media")
    inline = base64.b64encode(media["inline.wav"]).decode()
    tar = make_tar(root / "chats.tar", [
        ("c1.json", sidecar("<|audio|> Which digit is this?")),  # typed placeholder: the sample's audio member
        ("c1.0.wav", media["one.wav"]),
        ("c2.json", sidecar([{"type": "text", "text": "Compare "},
                             {"type": "audio", "audio": "speech.flac"},  # the member c2.speech.flac, by name
                             {"type": "text", "text": " with "},
                             {"type": "input_audio", "input_audio": {"data": inline, "format": "wav"}}])),
        ("c2.speech.flac", media["speech.flac"]),
        ("c3.json", sidecar([{"type": "audio", "audio": {"cut_id": "pretrain/clip-7"}}])),  # in an audio cache
        ("c4.json", sidecar("<|image|> What is in the picture?")),  # no audio: nothing to convert
        ("c5.json", b'{"messages": ['),  # unreadable: dropped by its conversation id
    ])
    (root / "jsonl" / "clips").mkdir(parents=True)
    shutil.copy(root / "media" / "front.wav", root / "jsonl" / "clips" / "front.wav")
    shutil.copy(root / "media" / "silent.wav", root / "jsonl" / "clips" / "silent.wav")
    jsonl = write_jsonl(root / "jsonl" / "talk.jsonl", [
        {"id": "j-front", "messages": user_then_assistant([{"type": "audio", "audio": "clips/front.wav"},
                                                           {"type": "text", "text": "Which speaker?"}])},
        {"messages": user_then_assistant([{"type": "audio", "audio": "clips/gone.wav"}])},  # no such file
        {"id": "j-silent", "messages": user_then_assistant([{"type": "audio", "audio": "clips/silent.wav"}])},
    ])
    rows = [{"messages": json.dumps(user_then_assistant("<|audio|> then <|audio|>: which is larger?")),
             "audios": [media["three.wav"], media["four.wav"]]},
            {"messages": json.dumps(user_then_assistant("<|audio|> alone")),  # two audios for one placeholder
             "audios": [media["three.wav"], media["four.wav"]]}]
    parquet = root / "calls.parquet"
    pq.write_table(pa.Table.from_pylist(rows, schema=pa.schema([("messages", pa.string()),
                                                                ("audios", pa.list_(pa.binary()))])), parquet)
    return [tar, jsonl, parquet]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    paths = write_conversations(tmp_path_factory.mktemp("conversations"))
    _name_by_content(paths, WRITTEN)
    _name_by_content(paths, DROPPED)
    return paths


def _name_by_content(paths: list[Path], table: dict) -> None:
    """Rewrite `table`'s keys `<stem>/<8-digit line or row>[/audio-k]` (records without an `id`) to the ids
    the reader gives them -- `<stem>/<content id>` -- keeping the order."""
    from mmtok.formats.conversations import read_conversations

    by_place = {}
    for conversation in read_conversations(paths):
        place = conversation.origin.rsplit("/", 1)[-1]  # "talk.jsonl:line 2", "calls.parquet:row 0"
        by_place[place] = conversation.id
    renamed = {}
    for key, value in table.items():
        stem, _, rest = key.partition("/")
        number, slash, tail = rest.partition("/")
        if number.isdigit():
            place = f"calls.parquet:row {int(number)}" if stem == "calls" else f"{stem}.jsonl:line {int(number)}"
            key = by_place[place] + slash + tail
        renamed[key] = value
    table.clear()
    table.update(renamed)


@pytest.fixture(scope="module")
def converted(inputs, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted")
    code = cli_main(["audio", "convert", "--kind", "conversations", *map(str, inputs), "--out", str(out),
                     "--shard-size", str(OPTIONS.shard_size), "--workers", "0", "--no-progress"])
    assert code == 0
    return out


@pytest.fixture(scope="module")
def reference(inputs, tmp_path_factory) -> dict:
    """The media files converted as a plain `--kind dir` source: cut id (file stem) -> cut."""
    out = tmp_path_factory.mktemp("reference")
    convert([inputs[0].parent / "media"], out, ConvertOptions(), kind="dir", workers=0, progress=False)
    return {cut.id: cut for cut in load_cuts(out)}


def test_conversation_audio_becomes_clips_named_by_conversation_and_slot_in_input_order(converted):
    cuts = load_cuts(converted)
    assert [cut.id for cut in cuts] == list(WRITTEN)
    for cut in cuts:
        conversation, _, slot = cut.id.rpartition("/audio-")
        assert (cut.custom["source_id"], cut.custom["clip"]) == (conversation, int(slot))
        assert "text_tokens" not in cut.custom and not cut.supervisions  # the text is the conversation's


def test_a_conversation_clip_is_sample_exact_the_same_file_converted_as_a_directory(converted, reference):
    for cut in load_cuts(converted):
        same = reference[WRITTEN[cut.id].rsplit(".", 1)[0]]
        assert cut.custom["original_sampling_rate"] == same.custom["original_sampling_rate"]
        assert np.array_equal(cut.load_audio(), same.load_audio()), cut.id


def test_unlocatable_and_unreadable_audio_is_dropped_by_id_and_cache_clips_are_not_counted(converted, inputs):
    dropped = dropped_records(converted)
    assert {d["key"]: d["reason"] for d in dropped} == DROPPED
    origins = {d["key"]: d["source"] for d in dropped}
    missing = next(key for key, reason in DROPPED.items() if reason == "missing_media")  # talk.jsonl line 2's clip
    assert origins["chats/c5"] == f"{inputs[0]}:c5" and origins[missing] == f"{inputs[1]}:line 2"
    assert "gone.wav" in next(d["detail"] for d in dropped if d["key"] == missing)
    counts = report(converted)["counts"]
    # c3's cache clip and c4 (no audio) are no clips of these inputs
    assert counts == {"in": len(WRITTEN) + len(DROPPED), "written": len(WRITTEN),
                      **{f"skipped:{reason}": 1 for reason in DROPPED.values()}}
    assert_counts_add_up(counts)


def test_audio_that_vanished_after_it_was_located_is_missing_media(inputs, tmp_path):
    (tmp_path / "clips").mkdir()
    shutil.copy(inputs[0].parent / "media" / "one.wav", tmp_path / "clips" / "one.wav")
    jsonl = write_jsonl(tmp_path / "late.jsonl", [
        {"id": "late", "messages": user_then_assistant([{"type": "audio", "audio": "clips/one.wav"}])}])
    (unit,) = sources.collect_units([jsonl], kind="conversations").units
    (tmp_path / "clips" / "one.wav").unlink()
    convert_module.init_worker(ConvertOptions(), tokenizer=object())  # no text: the tokenizer is never asked
    (result,) = convert_module.process_unit(unit)
    assert (result.key, result.reason) == ("late/audio-0", "missing_media") and "one.wav" in result.detail


def test_units_are_bounded_never_span_inputs_and_give_the_same_bytes_with_workers(inputs, converted, tmp_path,
                                                                                 monkeypatch):
    monkeypatch.setattr(sources.conversations, "CONVERSATION_UNIT_CLIPS", 2)
    units = sources.collect_units(inputs, kind="conversations").units
    ids = list(WRITTEN)
    assert [[spec.id for _, spec in unit.clips] for unit in units] == [  # the silent clip is dropped at decode
        ids[:2], ids[2:3], [ids[3], "j-silent/audio-0"], ids[4:]]
    convert(inputs, tmp_path, OPTIONS, kind="conversations", workers=2, progress=False)
    assert stored_bytes(tmp_path) == stored_bytes(converted)
    assert report(tmp_path)["counts"] == report(converted)["counts"]


def test_killed_conversion_of_conversations_resumes_after_its_last_shard(inputs, converted, tmp_path, monkeypatch):
    real_write = convert_module.write_shar_shard
    written = []

    def dying_write(out, index, clips):
        if written:
            raise KeyboardInterrupt  # a kill after the first shard
        written.append(index)
        return real_write(out, index, clips)

    monkeypatch.setattr(convert_module, "write_shar_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        convert(inputs, tmp_path, OPTIONS, kind="conversations", workers=0, progress=False)
    assert len(report(tmp_path)["shards"]) == 1 and not report(tmp_path)["complete"]
    monkeypatch.setattr(convert_module, "write_shar_shard", real_write)
    convert(inputs, tmp_path, OPTIONS, kind="conversations", workers=0, progress=False)
    assert stored_bytes(tmp_path) == stored_bytes(converted)
    assert report(tmp_path)["counts"] == report(converted)["counts"]


def test_cli_help_names_the_kind_and_transcripts_are_refused_for_it(inputs, tmp_path, capsys):
    with pytest.raises(SystemExit):
        cli_main(["audio", "convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--kind conversations" in help_text and "`mmtok sft` assembles the conversations" in help_text
    code = cli_main(["audio", "convert", "--kind", "conversations", str(inputs[1]), "--transcripts",
                     str(inputs[1]), "--out", str(tmp_path / "out"), "--workers", "0", "--no-progress"])
    assert code == 2 and "--transcripts applies to a directory input" in capsys.readouterr().err
