"""`mmtok pack`: the conversations of .jsonl / .parquet / .tar inputs and their media (file paths, Parquet cells,
base64, tar members) become WebDataset samples -- KEY.json keeping the conversation's id with every medium named
by its member, the media bytes unchanged -- and the SFT flow run on the packed tars gives each medium the tokens
of the same file encoded the old way. Real photos (skimage) and real speech (asterisk digits), never synthetic noise.

The corpus (`_write_inputs`) has one conversation of each reference form; `EXPECTED` says, in input order, what
each one must become: its members (suffix after "KEY.", the bytes of which source) and its packed record written
by hand, or the reason it is not packed.
"""

from __future__ import annotations

import base64
import json
import re
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import mmtok.sft.pack
from audio_corpus import digit
from encodekit import chat_tokenizer, image_items, real_images, write_tar
from mmtok.cli import main
from mmtok.codecs import emu35, wavtokenizer
from mmtok.formats import audio_cache
from mmtok.formats.conversations import audio_clip_id, content_id, locate, read_conversations
from mmtok.formats.megatron import read_sequences
from mmtok.sft.pack import pack_conversation
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout
from summaries import summary_lines

# The media of the corpus: name -> where its bytes come from (real photos, real speech).
SOURCES = {"chelsea.png": "image", "rocket.jpg": "image", "coffee.png": "image", "astronaut.png": "image",
           "camera.png": "image", "horse.png": "image", "one.wav": "1", "two.wav": "2", "three.wav": "3",
           "four.wav": "4"}


def _media_bytes() -> dict[str, bytes]:
    images = real_images()
    return {name: images[name].read_bytes() if how == "image" else digit(how).read_bytes()
            for name, how in SOURCES.items()}


def _turns(content, answer: str = "Noted.") -> list[dict]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


# Input order: chats.tar (2 samples), talk.jsonl (6 lines), rows.parquet (2 rows). "members": (suffix after
# "KEY.", source name) in the order pack writes them (slot order), the json last; "packed": the KEY.json
# record for key K, written by hand ("id" is added by the test: the original conversation's id).
EXPECTED = [
    {"input": "chats", "origin": "s0",  # a bare typed placeholder: the sample's member
     "members": [("0.png", "horse.png")],
     "packed": lambda k: {"messages": _turns("<image> What animal is this?", "A horse."), "images": [f"{k}.0.png"]}},
    {"input": "chats", "origin": "s1", "own_id": "tar-own-id",  # a member by its name after "KEY."
     "members": [("0.wav", "three.wav")],
     "packed": lambda k: {"messages": _turns([{"type": "audio", "audio": f"{k}.0.wav"},
                                              {"type": "text", "text": " Which digit?"}], "Three."),
                          "audios": [f"{k}.0.wav"]}},
    {"input": "talk", "origin": "line 1",  # OpenAI parts: an image by relative path, an inline input_audio
     "members": [("0.png", "chelsea.png"), ("0.wav", "two.wav")],
     "packed": lambda k: {"messages": _turns([{"type": "image", "image": f"{k}.0.png"},
                                              {"type": "text", "text": " Listen: "},
                                              {"type": "audio", "audio": f"{k}.0.wav"}], "Two."),
                          "images": [f"{k}.0.png"], "audios": [f"{k}.0.wav"]}},
    {"input": "talk", "origin": "line 2", "own_id": "typed-lists",  # typed placeholders, the record's lists
     "members": [("0.wav", "one.wav"), ("0.jpg", "rocket.jpg")],
     "packed": lambda k: {"messages": _turns("<|audio|> <image> Which digit, and what is this?", "One, a rocket."),
                          "audios": [f"{k}.0.wav"], "images": [f"{k}.0.jpg"], "source": "hand-written"}},
    {"input": "talk", "origin": "line 3",  # a clip of an audio cache: stays a cut reference
     "members": [],
     "packed": lambda k: {"messages": _turns([{"type": "text", "text": "Which digit is "},
                                              {"type": "audio", "audio": {"cut_id": "x"}}], "Seven."),
                          "audios": [{"cut_id": "x"}]}},
    {"input": "talk", "origin": "line 4",  # text only
     "members": [],
     "packed": lambda k: {"messages": _turns("What is the weather in Zurich?", "Cloudy.")}},
    {"input": "talk", "origin": "line 5", "reason": "invalid_json", "id": "talk/line-5"},  # a garbage line
    {"input": "talk", "origin": "line 6", "reason": "missing_media",  # an audio file that is not there
     "detail": ["audio 0", "speech/gone.wav"]},
    {"input": "rows", "origin": "row 0",  # a JSON-string `messages` column, list<binary> media cells
     "members": [("0.png", "coffee.png"), ("0.wav", "four.wav")],
     "packed": lambda k: {"messages": _turns("<image> and <audio>: what is it?", "Coffee, four."),
                          "images": [f"{k}.0.png"], "audios": [f"{k}.0.wav"]}},
    {"input": "rows", "origin": "row 1",  # bare image parts taking the `images` cells; no audio (a null cell)
     "members": [("0.png", "astronaut.png"), ("1.png", "camera.png")],
     "packed": lambda k: {"messages": _turns([{"type": "image", "image": f"{k}.0.png"},
                                              {"type": "text", "text": " then "},
                                              {"type": "image", "image": f"{k}.1.png"}], "Two people."),
                          "images": [f"{k}.0.png", f"{k}.1.png"]}},
]


def _write_inputs(root: Path, media: dict[str, bytes]) -> list[Path]:
    """chats.tar, talk.jsonl (media under root/images and root/speech) and rows.parquet: EXPECTED's inputs."""
    for name, data in media.items():
        folder = root / ("speech" if name.endswith(".wav") else "images")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    tar = write_tar(root / "chats.tar", [
        ("s0.0.png", media["horse.png"]),
        ("s0.json", json.dumps({"messages": _turns("<image> What animal is this?", "A horse.")}).encode()),
        ("s1.0.wav", media["three.wav"]),
        ("s1.json", json.dumps({"id": "tar-own-id", "messages": _turns(
            [{"type": "audio", "audio": "0.wav"}, {"type": "text", "text": " Which digit?"}], "Three.")}).encode())])
    inline = base64.b64encode(media["two.wav"]).decode()
    lines = [
        {"messages": _turns([{"type": "image", "image": "images/chelsea.png"}, {"type": "text", "text": " Listen: "},
                             {"type": "input_audio", "input_audio": {"data": inline, "format": "wav"}}], "Two.")},
        {"id": "typed-lists", "source": "hand-written", "audios": ["speech/one.wav"], "images": ["images/rocket.jpg"],
         "messages": _turns("<|audio|> <image> Which digit, and what is this?", "One, a rocket.")},
        {"messages": _turns([{"type": "text", "text": "Which digit is "}, {"type": "audio", "audio": {"cut_id": "x"}}],
                            "Seven.")},
        {"messages": _turns("What is the weather in Zurich?", "Cloudy.")},
    ]
    missing = {"messages": _turns([{"type": "audio", "audio": "speech/gone.wav"}], "Five.")}
    jsonl = root / "talk.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines) + "{this is no json\n" + json.dumps(missing)
                     + "\n")
    rows = {"messages": [json.dumps(_turns("<image> and <audio>: what is it?", "Coffee, four.")),
                         json.dumps(_turns([{"type": "image"}, {"type": "text", "text": " then "}, {"type": "image"}],
                                           "Two people."))],
            "images": [[media["coffee.png"]], [media["astronaut.png"], media["camera.png"]]],
            "audios": [[media["four.wav"]], None]}
    parquet = root / "rows.parquet"
    pq.write_table(pa.table(rows, schema=pa.schema([("messages", pa.string()), ("images", pa.list_(pa.binary())),
                                                    ("audios", pa.list_(pa.binary()))])), parquet)
    return [tar, jsonl, parquet]


PACK_FILES = [".lock", "conversations-000000.tar", "pack.json", "skipped.jsonl"]  # .lock: the writer lock


def _pack(inputs: list[Path], out: Path, *flags) -> dict:
    assert main(["pack", *map(str, inputs), "--out", str(out), "--no-progress", *map(str, flags)]) == 0
    return json.loads((out / "pack.json").read_text())


def _tar_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as archive:
        return [(m.name, archive.extractfile(m).read()) for m in archive]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """The corpus, its original conversations (ids in input order), and one pack of it."""
    root = tmp_path_factory.mktemp("pack")
    media = _media_bytes()
    inputs = _write_inputs(root / "data", media)
    report = _pack(inputs, root / "out")
    ids = [c.id for c in read_conversations(inputs)]
    assert len(ids) == len(EXPECTED)
    return SimpleNamespace(root=root, media=media, inputs=inputs, out=root / "out", report=report, ids=ids)


# -- what a pack writes ----------------------------------------------------------------------------------------
def test_original_ids_are_the_records_own_else_stem_and_content_hash(packed):
    lines = (packed.root / "data" / "talk.jsonl").read_text().splitlines()
    for ident, spec in zip(packed.ids, EXPECTED, strict=True):
        if "own_id" in spec:
            assert ident == spec["own_id"]
        elif "id" in spec:
            assert ident == spec["id"]
        elif spec["input"] == "chats":
            assert ident == f"chats/{spec['origin']}"
        elif spec["input"] == "talk":
            line = lines[int(spec["origin"].split()[1]) - 1]
            assert ident == f"talk/{content_id(json.loads(line))}" and re.fullmatch(r"talk/[0-9a-f]{16}", ident)
        else:
            assert re.fullmatch(r"rows/[0-9a-f]{16}", ident)
    assert len(set(packed.ids)) == len(packed.ids)


def test_each_sample_holds_its_conversations_media_bytes_under_member_names_and_its_id(packed):
    assert packed.report["tars"] == ["conversations-000000.tar"]
    assert sorted(p.name for p in packed.out.iterdir()) == PACK_FILES
    members = _tar_members(packed.out / "conversations-000000.tar")
    expected_names, expected_bytes = [], []
    for ordinal, (ident, spec) in enumerate(zip(packed.ids, EXPECTED, strict=True)):
        if "reason" in spec:
            continue
        key = f"{ordinal:09d}"  # the conversation's ordinal among all of the inputs
        for suffix, source in spec["members"]:
            expected_names.append(f"{key}.{suffix}")
            expected_bytes.append(packed.media[source])
        expected_names.append(f"{key}.json")
        expected_bytes.append({**spec["packed"](key), "id": ident})
    assert [name for name, _ in members] == expected_names  # media in slot order, then the json; nothing else
    for (name, data), expected in zip(members, expected_bytes, strict=True):
        if name.endswith(".json"):
            assert json.loads(data) == expected, name  # references rewritten to member names, the id kept
        else:
            assert data == expected, name  # the bytes of the source file / cell / base64, unchanged
    with tarfile.open(packed.out / "conversations-000000.tar") as archive:
        assert {(m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) for m in archive} == {(0, 0, 0, "", "", 0o644)}


def test_counts_add_up_and_each_unpacked_conversation_is_named_with_its_reason(packed):
    counts = packed.report["counts"]
    written = [spec for spec in EXPECTED if "reason" not in spec]
    reasons = [spec["reason"] for spec in EXPECTED if "reason" in spec]
    assert counts == {"conversations": len(EXPECTED), "packed": len(written),
                      "image_packed": sum(s.endswith(("png", "jpg")) for w in written for s, _ in w["members"]),
                      "audio_packed": sum(s.endswith("wav") for w in written for s, _ in w["members"]),
                      **{f"skipped:{r}": reasons.count(r) for r in reasons}}
    assert counts["conversations"] == counts["packed"] + sum(v for k, v in counts.items() if k.startswith("skipped:"))
    assert [p["path"] for p in packed.report["inputs"]] == [str(p.resolve()) for p in packed.inputs]
    skipped = _lines(packed.out / "skipped.jsonl")
    assert [(s["key"], s["reason"]) for s in skipped] == [
        (ident, spec["reason"]) for ident, spec in zip(packed.ids, EXPECTED, strict=True) if "reason" in spec]
    for record, spec in zip(skipped, [spec for spec in EXPECTED if "reason" in spec], strict=True):
        assert record["source"] == f"{packed.root / 'data' / 'talk.jsonl'}:{spec['origin']}"
        assert all(word in record["detail"] for word in spec.get("detail", [])), record


def test_the_packed_tar_reads_back_as_the_same_conversations_with_the_same_media_in_slot_order(packed):
    originals = [c for c, spec in zip(read_conversations(packed.inputs), EXPECTED, strict=True) if "reason" not in spec]
    again = list(read_conversations([packed.out / "conversations-000000.tar"]))
    assert [c.id for c in again] == [c.id for c in originals]
    for original, copy in zip(originals, again, strict=True):
        media, copied = original.media(), copy.media()
        assert [m.slot for m in copied] == [m.slot for m in media], original.id
        for ref in media:
            before, after = locate(original, media, ref.slot), locate(copy, copied, ref.slot)
            if before.kind == "cut":
                assert (after.kind, after.cut_id) == ("cut", before.cut_id)
            else:
                assert after.kind == "member" and after.read() == before.read(), (original.id, ref.slot)


# -- determinism, tar splitting, replacing an earlier pack -------------------------------------------------------
def test_packing_twice_gives_byte_identical_tars(packed, tmp_path, capsys):
    capsys.readouterr()
    report = _pack(packed.inputs, tmp_path / "again")
    headline, following = summary_lines(capsys.readouterr(), "pack")
    assert f"conversations -> 1 tar in {tmp_path / 'again'}: {report['counts']['packed']:,} packed" in headline
    assert following.startswith("  next: mmtok scan ")
    for name in ("conversations-000000.tar", "skipped.jsonl"):
        assert (tmp_path / "again" / name).read_bytes() == (packed.out / name).read_bytes(), name


def test_samples_per_tar_splits_in_order_and_a_repack_removes_the_stale_tars(packed, tmp_path):
    out = tmp_path / "split"
    report = _pack(packed.inputs, out, "--samples-per-tar", 3)
    tars = [f"conversations-{n:06d}.tar" for n in range(3)]
    assert report["tars"] == tars and sorted(p.name for p in out.glob("*.tar")) == tars
    keys = [[name.split(".")[0] for name, _ in _tar_members(out / tar) if name.endswith(".json")] for tar in tars]
    packed_keys = [f"{n:09d}" for n, spec in enumerate(EXPECTED) if "reason" not in spec]
    assert keys == [packed_keys[0:3], packed_keys[3:6], packed_keys[6:8]]  # 8 packed conversations: 3 + 3 + 2
    whole = _tar_members(packed.out / "conversations-000000.tar")
    assert [m for tar in tars for m in _tar_members(out / tar)] == whole  # the same samples, cut in order
    report = _pack(packed.inputs, out)  # into the earlier pack output: replaced, its extra tars removed
    assert report["tars"] == ["conversations-000000.tar"]
    assert sorted(p.name for p in out.iterdir()) == PACK_FILES
    assert (out / "conversations-000000.tar").read_bytes() == (packed.out / "conversations-000000.tar").read_bytes()


def test_an_out_directory_that_is_no_pack_output_is_refused_in_one_line(packed, tmp_path, capsys):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    capsys.readouterr()
    assert main(["pack", *map(str, packed.inputs), "--out", str(out), "--no-progress"]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("mmtok pack: error: ") and str(out) in line and captured.out == ""
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_a_rerun_after_a_first_pack_was_interrupted_packs(packed, tmp_path, monkeypatch):
    """A pack stopped before its first tar leaves only its writer lock in OUT: that is its own output."""
    calls = []

    def interrupted(conversation, key, *options):
        calls.append(key)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return pack_conversation(conversation, key, *options)

    out = tmp_path / "out"
    monkeypatch.setattr(mmtok.sft.pack, "pack_conversation", interrupted)
    assert main(["pack", *map(str, packed.inputs), "--out", str(out), "--no-progress"]) == 130
    monkeypatch.undo()
    assert not list(out.glob("conversations-*.tar")) and not (out / "pack.json").exists()
    _pack(packed.inputs, out)  # the same command again
    assert (out / "conversations-000000.tar").read_bytes() == (packed.out / "conversations-000000.tar").read_bytes()


# -- media pack cannot read ----------------------------------------------------------------------------------
def _unreadable_images(root: Path, media: dict[str, bytes]) -> list[Path]:
    """good.jsonl: a photo (packed), a real wav named as an image, and a photo then base64 text bytes."""
    (root / "speech").mkdir(parents=True)
    (root / "images").mkdir()
    (root / "speech" / "one.wav").write_bytes(media["one.wav"])
    (root / "images" / "rocket.jpg").write_bytes(media["rocket.jpg"])
    text = base64.b64encode(b"plain text, no picture in here at all").decode()
    lines = [{"id": "photo", "images": ["images/rocket.jpg"], "messages": _turns("<image> What is it?", "A rocket.")},
             {"id": "wav-as-image", "images": ["speech/one.wav"], "messages": _turns("<image> What is it?", "?")},
             {"id": "text-as-image", "messages": _turns([
                 {"type": "image", "image": "images/rocket.jpg"}, {"type": "text", "text": " and "},
                 {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{text}"}}], "?")}]
    jsonl = root / "good.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return [jsonl]


def test_image_bytes_of_no_known_format_are_missing_media_saying_the_format_is_unknown(packed, tmp_path):
    report = _pack(_unreadable_images(tmp_path / "data", packed.media), tmp_path / "out")
    assert report["counts"] == {"conversations": 3, "packed": 1, "image_packed": 1, "skipped:missing_media": 2}
    skipped = _lines(tmp_path / "out" / "skipped.jsonl")
    assert [(s["key"], s["reason"]) for s in skipped] == [("wav-as-image", "missing_media"),
                                                          ("text-as-image", "missing_media")]
    for record in skipped:
        assert "image bytes of no format mmtok reads" in record["detail"], record
    assert "they look like wav audio" in skipped[0]["detail"]  # named by its format, never by its bytes
    names = [name for name, _ in _tar_members(tmp_path / "out" / "conversations-000000.tar")]
    assert names == ["000000000.0.jpg", "000000000.json"]  # nothing of the unreadable conversations


def test_an_unreadable_medium_is_named_by_its_slot_in_the_skip_detail(packed, tmp_path):
    """Like a missing file ("audio 0: ..."), bytes of no known format name which medium they are."""
    _pack(_unreadable_images(tmp_path / "data", packed.media), tmp_path / "out")
    details = {s["key"]: s["detail"] for s in _lines(tmp_path / "out" / "skipped.jsonl")}
    assert details["wav-as-image"].startswith("image 0: ") and "speech/one.wav" in details["wav-as-image"]
    assert details["text-as-image"].startswith("image 1: ")  # the second image, after the photo that reads


def test_a_parquet_column_without_a_json_form_is_a_named_skip_not_a_crash(tmp_path):
    """A column the chat template does not use (raw bytes here) cannot go into KEY.json: that row is named in
    skipped.jsonl and the pack goes on (`mmtok sft` reads such a table directly)."""
    messages = json.dumps(_turns("What is the weather in Zurich?", "Cloudy."))
    table = tmp_path / "extra.parquet"
    pq.write_table(pa.table({"messages": [messages, messages.replace("Cloudy", "Sunny")], "raw": [b"\x00\x01", None]},
                            schema=pa.schema([("messages", pa.string()), ("raw", pa.binary())])), table)
    ids = [c.id for c in read_conversations([table])]
    report = _pack([table], tmp_path / "out")
    assert report["counts"]["conversations"] == 2 and report["counts"]["packed"] == 1
    (skipped,) = _lines(tmp_path / "out" / "skipped.jsonl")
    assert skipped["key"] == ids[0] and "raw" in skipped["detail"]
    (sample,) = [data for name, data in _tar_members(tmp_path / "out" / "conversations-000000.tar")]
    assert json.loads(sample)["id"] == ids[1]


# -- the SFT flow on packed tars --------------------------------------------------------------------------------
SMALL_IMAGES = ["--min-pixels", "1024", "--max-pixels", "2304", "--min-source-pixels", "100", "--token-budget", "40",
                "--max-batch-images", "1"]  # 32-48 px, one image per batch: an image's tokens have no batch mates


def test_packing_a_pack_into_itself_is_refused_and_a_failed_rerun_keeps_the_finished_pack(packed, tmp_path, capsys):
    out = tmp_path / "self"
    assert main(["pack", str(packed.inputs[0]), "--out", str(out), "--no-progress"]) == 0
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    capsys.readouterr()
    assert main(["pack", str(out / "conversations-000000.tar"), "--out", str(out), "--no-progress"]) == 2
    assert main(["pack", str(tmp_path / "typo.jsonl"), "--out", str(out), "--no-progress"]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and "inside --out" in errors[0] and "not found" in errors[1]
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before  # nothing deleted or unfinished


def test_records_no_tokenizer_can_take_are_invalid_json_and_integer_ids_are_kept(tmp_path):
    lines = ['{"messages": [{"role": "user", "content": "lone \\ud800"}, {"role": "assistant", "content": "x"}]}',
             "[" * 100_000,  # nesting deeper than the parser's recursion limit
             json.dumps({"id": 7, "messages": [{"role": "user", "content": "hi \U0001F600"}, {"role": "assistant",
                                                                                            "content": "x"}]})]
    source = tmp_path / "odd.jsonl"
    source.write_text("\n".join(lines) + "\n")
    got = [(c.id, c.error.reason if c.error else None) for c in read_conversations([source])]
    assert got == [("odd/line-1", "invalid_json"), ("odd/line-2", "invalid_json"), ("7", None)]
    assert main(["pack", str(source), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    with tarfile.open(tmp_path / "out" / "conversations-000000.tar") as archive:
        (record,) = [json.loads(archive.extractfile(m).read()) for m in archive if m.name.endswith(".json")]
    assert record["id"] == "7" and record["messages"][0]["content"] == "hi \U0001F600"


def _run(*argv) -> None:
    assert main([*map(str, argv)]) == 0, argv


def _cache_ids(out: Path) -> dict[str, list[int]]:
    """cut id -> audio ids, from an audio encode's token cache."""
    found = {}
    for path in audio_cache.find_cache_parts(out):
        cut_ids = audio_cache.read_cache_index(path).column("cut_id").to_pylist()
        found.update(zip(cut_ids, (np.asarray(t).tolist() for t in audio_cache.read_tokens(path)[0]), strict=True))
    return found


def _blocks(tokens: np.ndarray, layout: VocabLayout) -> list[tuple[str, list[int]]]:
    """("image", the whole block) and ("audio", the ids between its markers) of a sequence, in order."""
    special = layout.special_ids()
    tokens, blocks, i = tokens.tolist(), [], 0
    while i < len(tokens):
        if tokens[i] == special["<|img_start|>"]:
            end = tokens.index(special["<|img_end|>"], i)
            blocks.append(("image", tokens[i:end + 1]))
            i = end
        elif tokens[i] == special["<|audio_start|>"]:
            end = tokens.index(special["<|audio_end|>"], i)
            blocks.append(("audio", tokens[i + 1:end]))
            i = end
        i += 1
    return blocks


def test_packed_conversations_through_the_sft_flow_get_the_tokens_of_the_same_files(packed, tmp_path):
    torch.set_num_threads(1)
    data, work = tmp_path / "data", tmp_path / "work"
    speech = data / "speech"
    speech.mkdir(parents=True)
    (data / "images").mkdir()
    for name in ("one.wav", "two.wav"):
        (speech / name).write_bytes(packed.media[name])
    for name in ("chelsea.png", "rocket.jpg"):
        (data / "images" / name).write_bytes(packed.media[name])
    lines = [{"messages": _turns([{"type": "image", "image": "images/chelsea.png"}, {"type": "text", "text": " and "},
                                  {"type": "audio", "audio": "speech/one.wav"}], "A cat, one.")},
             {"images": ["images/rocket.jpg"], "messages": _turns("<image> What is this?", "A rocket.")},
             {"audios": ["speech/two.wav"], "messages": _turns("<|audio|> Which digit?", "Two.")}]
    jsonl = data / "e2e.jsonl"
    jsonl.write_text("".join(json.dumps(line) + "\n" for line in lines))
    ids = [c.id for c in read_conversations([jsonl])]
    # the old way: the same photos as members of a conversation tar, scanned and encoded in the same run
    old = write_tar(data / "old.tar", [
        ("o0.0.png", packed.media["chelsea.png"]), ("o0.json", json.dumps({"messages": _turns("<image>")}).encode()),
        ("o1.0.jpg", packed.media["rocket.jpg"]), ("o1.json", json.dumps({"messages": _turns("<image>")}).encode())])
    text = chat_tokenizer(work / "tokenizer")
    emu, wav = emu35.write_random_checkpoint(work / "emu35"), wavtokenizer.write_random_checkpoint(work / "wav")

    _run("pack", jsonl, "--out", work / "packed", "--no-progress")
    tars = sorted((work / "packed").glob("conversations-*.tar"))
    assert [t.name for t in tars] == ["conversations-000000.tar"]
    _run("scan", *tars, old, "--out", work / "manifest", "--workers", 1, "--no-progress")
    _run("plan", work / "manifest", "--mode", "sft", "--text-tokenizer", text, "--out", work / "plan", "--quiet",
         *SMALL_IMAGES)
    _run("encode", "--plan", work / "plan", "--checkpoint", emu, "--out", work / "images", "--device", "cpu",
         "--loader-threads", 1, "--no-progress")
    _run("audio", "convert", "--kind", "conversations", *tars, "--text-tokenizer", text, "--out", work / "converted",
         "--workers", 0, "--no-progress")
    _run("encode", "--modality", "audio", "--shar", work / "converted", "--checkpoint", wav, "--text-tokenizer", text,
         "--out", work / "audio", "--num-workers", 0, "--no-progress")
    # the pretraining path for the same speech files: cut ids "one", "two"
    _run("audio", "convert", speech, "--text-tokenizer", text, "--out", work / "pretrain-shar", "--workers", 0,
         "--no-progress")
    _run("encode", "--modality", "audio", "--shar", work / "pretrain-shar", "--checkpoint", wav, "--text-tokenizer",
         text, "--out", work / "pretrain", "--num-workers", 0, "--no-progress")
    _run("sft", *tars, "--text-tokenizer", text, "--images", work / "images", "--audio", work / "audio", "--converted",
         work / "converted", "--out", work / "sft", "--no-progress")
    _run("merge", work / "sft")

    items, clips, pretrain = image_items(work / "images"), _cache_ids(work / "audio"), _cache_ids(work / "pretrain")
    items = {key: block.tolist() for key, block in items.items()}
    packed_tar = tars[0].name
    old_image = {"chelsea.png": items[("old.tar", "o0", 0)], "rocket.jpg": items[("old.tar", "o1", 0)]}
    assert items[(packed_tar, "000000000", 0)] == old_image["chelsea.png"]
    assert items[(packed_tar, "000000001", 0)] == old_image["rocket.jpg"]
    assert old_image["chelsea.png"] != old_image["rocket.jpg"]
    assert set(pretrain) == {"one", "two"}
    assert clips == {audio_clip_id(ids[0], 0): pretrain["one"], audio_clip_id(ids[2], 0): pretrain["two"]}

    media = [[("image", old_image["chelsea.png"]), ("audio", pretrain["one"])], [("image", old_image["rocket.jpg"])],
             [("audio", pretrain["two"])]]
    provenance = _lines(work / "sft" / "merged.provenance.jsonl")
    assert [p["conversation"] for p in provenance] == ids  # the original conversations' ids, in order
    assert [p["audio"] for p in provenance] == [[audio_clip_id(ids[0], 0)], [], [audio_clip_id(ids[2], 0)]]
    assert [[m.rsplit(":", 1)[1] for m in p["image"]] for p in provenance] == [
        ["000000000.0.png"], ["000000001.0.jpg"], []]
    tokenizer = load_text_tokenizer(str(text))
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    sequences = list(read_sequences(work / "sft" / "merged"))
    assert [_blocks(np.asarray(s), layout) for s in sequences] == media
    for tokens in sequences:
        layout.split_sequence(tokens)  # every block parses
    counts = json.loads((work / "sft" / "merged.json").read_text())["counts"]
    assert (counts["documents_written"], counts.get("documents_skipped", 0), counts["images_written"],
            counts["audio_written"]) == (3, 0, 2, 2)
