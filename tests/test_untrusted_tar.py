"""Untrusted tars and input paths (issue 21, §3 and §4): member kinds mmtok cannot read exactly (GNU sparse,
multi-volume) are `unsupported_member` in every tar reader and never decoded; one file reached by two paths is
read once (`duplicate_input`); a conversation naming one member twice gets its block twice; file names that
are not UTF-8 never crash `scan` or `audio convert`."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

import pytest
from PIL import Image

from audio_corpus import digit
from convertkit import dropped_records, encoded, load_cuts, report
from mmtok.audio.convert import ConvertOptions, convert
from mmtok.cli import main as cli
from mmtok.errors import Skip
from mmtok.formats.conversations import locate, read_conversations
from mmtok.formats.manifest import Manifest
from mmtok.formats.shar import index_members
from mmtok.formats.tar import Damage, read_members
from mmtok.scan.scanner import ScanOptions, describe, run_scan
from tarkit import archive, header, multi_volume, old_gnu_sparse, pax_records, pax_sparse, regular

UNSUPPORTED = "unsupported_member"
# (offset, data) chunks of a sparse file with holes: 4 in an old-GNU header, 6 in its one extension block.
CHUNKS = [(k << 16, bytes([65 + k]) * 700) for k in range(10)]
REALSIZE = 11 << 16


def png(shade: int = 30) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, shade, 30)).save(out, "PNG")
    return out.getvalue()


def unsupported(kind: str, name: str, data: bytes = b"") -> bytes:
    """A member of `kind` that mmtok cannot read exactly; `data` (when given) is its stored bytes."""
    chunks = [(0, data)] if data else CHUNKS
    if kind == "old-gnu-sparse":
        return old_gnu_sparse(name, chunks, REALSIZE)
    if kind == "multi-volume":
        return multi_volume(name, data or b"tail of a file begun in the previous volume", 1 << 20)
    return pax_sparse(name, chunks, REALSIZE, kind.removeprefix("pax-sparse-"))


KINDS = ["old-gnu-sparse", "pax-sparse-0.0", "pax-sparse-0.1", "pax-sparse-1.0", "multi-volume"]


# -- §3: GNU sparse and multi-volume members -----------------------------------------------------------------

@pytest.mark.parametrize("kind", KINDS)
def test_the_tar_reader_refuses_a_member_it_cannot_read_exactly_and_reads_the_next(tmp_path, kind):
    tar = tmp_path / "t.tar"
    tar.write_bytes(archive(regular("a.txt", b"first"), unsupported(kind, "b.bin"), regular("c.txt", b"after")))
    entries = list(read_members(tar))
    assert not [e for e in entries if isinstance(e, Damage)]
    assert [(e.name, e.reason) for e in entries] == [("a.txt", ""), ("b.bin", UNSUPPORTED), ("c.txt", "")]
    after = entries[2]
    assert tar.read_bytes()[after.offset:after.offset + after.size] == b"after"


@pytest.mark.parametrize("kind", KINDS)
def test_the_scan_gives_a_sparse_image_its_reason_and_keeps_the_images_around_it(tmp_path, kind):
    tar = tmp_path / "s.tar"
    tar.write_bytes(archive(regular("a.png", png()), unsupported(kind, "b.png", png(90)), regular("c.png", png())))
    run_scan([describe(str(tar))], tmp_path / "out", ScanOptions(), workers=1, progress=False)
    rows = [(r["member"], r["status"], r["reason"]) for r in Manifest.open(tmp_path / "out").read().to_pylist()]
    assert rows == [("a.png", "ok", ""), ("b.png", "error", UNSUPPORTED), ("c.png", "ok", "")]


def test_a_sparse_caption_is_a_reason_of_the_shard_not_an_ignored_member(tmp_path):
    tar = tmp_path / "s.tar"
    tar.write_bytes(archive(regular("a.png", png()), unsupported("pax-sparse-1.0", "a.txt", b"a caption")))
    run_scan([describe(str(tar))], tmp_path / "out", ScanOptions(), workers=1, progress=False)
    meta = Manifest.open(tmp_path / "out").metadata
    assert meta.reasons == {UNSUPPORTED: 1} and meta.ignored_members == {}
    errors = [(r.reason, r.member) for r in Manifest.open(tmp_path / "out").skip_records()]
    assert errors == [(UNSUPPORTED, "a.txt")]


@pytest.mark.parametrize("kind", ["old-gnu-sparse", "pax-sparse-0.1"])  # each reader: KINDS above
def test_sparse_audio_in_a_tar_is_never_decoded(tmp_path, kind):
    flac = encoded(digit("3"))
    tar = tmp_path / "calls.tar"
    tar.write_bytes(archive(regular("one.flac", encoded(digit("1"))), unsupported(kind, "two.flac", flac),
                            regular("three.flac", flac)))
    convert([tar], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    assert [cut.id for cut in load_cuts(tmp_path / "out")] == ["calls/one", "calls/three"]
    assert [(d["key"], d["reason"]) for d in dropped_records(tmp_path / "out")] == [("calls/two", UNSUPPORTED)]
    assert report(tmp_path / "out")["counts"]["skipped:" + UNSUPPORTED] == 1


def test_a_sparse_map_in_a_global_pax_header_makes_the_next_members_unsupported(tmp_path):
    """Issue 34.1(b): GNU.sparse.* records in a global (`g`) pax header apply to the members after it (Python's
    tarfile reads them as sparse); taken as plain members their stored bytes -- the file with its holes cut
    out -- became a shorter clip, with no reason."""
    flac = encoded(digit("3"))
    records = pax_records([("GNU.sparse.numblocks", "1"), ("GNU.sparse.map", f"0,{len(flac)}"),
                           ("GNU.sparse.size", str(len(flac) + 4096))])
    global_header = header(b"./GlobalHead.0", len(records), b"g") + records + bytes(-len(records) % 512)
    tar = tmp_path / "calls.tar"
    tar.write_bytes(archive(regular("one.flac", encoded(digit("1"))), global_header, regular("two.flac", flac)))
    assert [(e.name, e.reason) for e in read_members(tar)] == [("one.flac", ""), ("two.flac", UNSUPPORTED)]
    assert cli(["audio", "convert", "--kind", "tar", str(tar), "--out", str(tmp_path / "out"), "--workers", "1",
                 "--no-progress"]) == 0
    assert [cut.id for cut in load_cuts(tmp_path / "out")] == ["calls/one"]
    assert [(d["key"], d["reason"]) for d in dropped_records(tmp_path / "out")] == [("calls/two", UNSUPPORTED)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_conversation_whose_medium_or_json_is_sparse_is_skipped_with_the_reason(tmp_path, kind):
    chat = {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "a.wav"}]},
                         {"role": "assistant", "content": "Noted."}]}
    record = json.dumps(chat).encode()
    tar = tmp_path / "chats.tar"
    tar.write_bytes(archive(regular("one.json", record), regular("one.a.wav", b"RIFF" + bytes(600)),
                            regular("two.json", record), unsupported(kind, "two.a.wav", b"RIFF" + bytes(600)),
                            unsupported(kind, "three.json", record), regular("three.a.wav", b"RIFF")))
    reasons = {}
    for item in read_conversations([tar]):
        try:
            media = item.media()
            reasons[item.id] = [locate(item, media, ref.slot).kind for ref in media]
        except Skip as skip:
            reasons[item.id] = skip.reason
        except Exception as err:  # ConversationError: the record itself is refused
            reasons[item.id] = err.reason
    assert reasons == {"chats/one": ["member"], "chats/two": UNSUPPORTED, "chats/three": UNSUPPORTED}


def test_the_shar_index_refuses_a_sparse_recording(tmp_path):
    tar = tmp_path / "recording.000000.tar"
    tar.write_bytes(archive(unsupported("pax-sparse-1.0", "cut-a.flac", b"fLaC" + bytes(900)),
                            regular("cut-b.flac", b"fLaC" + bytes(900))))
    members, damage = index_members(tar)
    assert damage is None and isinstance(members["cut-b"], tuple)
    assert members["cut-a"].startswith(UNSUPPORTED + ":")


# -- §3: one file reached by two paths ------------------------------------------------------------------------

def two_more_paths(path: Path) -> list[Path]:
    """`path`, a symbolic link to it and a hard link to it: three paths, one file."""
    link = path.with_name("link-" + path.name)
    link.symlink_to(path)
    hard = path.with_name("hard-" + path.name)
    os.link(path, hard)
    return [path, link, hard]


def test_the_scan_reads_a_shard_reached_by_three_paths_once(tmp_path):
    tar = tmp_path / "s.tar"
    tar.write_bytes(archive(regular("a.png", png()), regular("b.png", png(90))))
    paths = two_more_paths(tar)
    run = run_scan([describe(str(p)) for p in paths], tmp_path / "out", ScanOptions(), workers=1, progress=False).run
    assert (run.scanned_shards, run.cached_shards) == (1, 0)  # a duplicate is no cache hit
    manifest = Manifest.open(tmp_path / "out")
    rows = [(r["tar"], r["member"], r["reason"]) for r in manifest.read().to_pylist()]
    assert rows == [(str(tar), "a.png", ""), (str(tar), "b.png", ""),
                    (str(paths[1]), "", "duplicate_input"), (str(paths[2]), "", "duplicate_input")]
    assert manifest.metadata.images_ok == 2 and manifest.metadata.reasons == {"duplicate_input": 2}
    records = list(manifest.skip_records())
    assert [(r.source, r.position, r.reason) for r in records] == [(str(p), row, "duplicate_input")
                                                                   for p, row in ((paths[1], 2), (paths[2], 3))]
    assert all(str(tar) in r.detail for r in records)


def test_audio_convert_reads_a_tar_reached_by_two_paths_once(tmp_path):
    tar = tmp_path / "calls.tar"
    tar.write_bytes(archive(regular("one.flac", encoded(digit("1")))))
    paths = two_more_paths(tar)
    convert(paths, tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    assert [cut.id for cut in load_cuts(tmp_path / "out")] == ["calls/one"]
    assert [(d["key"], d["reason"]) for d in dropped_records(tmp_path / "out")] == [
        ("link-calls.tar", "duplicate_input"), ("hard-calls.tar", "duplicate_input")]
    assert report(tmp_path / "out")["counts"] == {"in": 3, "written": 1, "skipped:duplicate_input": 2}


def test_conversations_of_a_file_reached_by_two_paths_are_read_once(tmp_path):
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]}
    first = tmp_path / "chats.jsonl"
    first.write_text(json.dumps(chat) + "\n")
    other = tmp_path / "other"
    other.mkdir()
    (other / "chats.jsonl").symlink_to(first)  # the same stem: no longer refused as an id collision
    (other / "more.jsonl").symlink_to(first)
    read = [(c.id, c.whole_file, c.error.reason if c.error else None)
            for c in read_conversations([first, other / "chats.jsonl", other / "more.jsonl"])]
    assert read[0][1:] == (False, None) and read[1:] == [
        ("chats.jsonl", True, "duplicate_input"), ("more.jsonl", True, "duplicate_input")]


# -- §3: a conversation that names one member twice -----------------------------------------------------------

@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    from encodekit import chat_tokenizer as write_chat_tokenizer
    from mmtok.text import load_text_tokenizer

    return load_text_tokenizer(str(write_chat_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.mark.parametrize("placed", ["placeholders", "parts"])
def test_a_conversation_naming_one_image_member_twice_gets_its_block_twice(chat_tokenizer, placed):
    from chatkit import ImageStore, build, image_block, tar_conversation

    if placed == "placeholders":  # two <image> placeholders, the record's `images` list names one member twice
        record = {"messages": [{"role": "user", "content": "<image><image> The same photo twice?"},
                               {"role": "assistant", "content": "Yes."}], "images": ["a.png", "a.png"]}
    else:
        part = {"type": "image", "image": "a.png"}
        record = {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "And again:"}, part]},
                               {"role": "assistant", "content": "Yes."}]}
    block = image_block(chat_tokenizer, 0)
    other = image_block(chat_tokenizer, 1)
    images = ImageStore({("t.tar", "k.a.png"): block, ("t.tar", "k.b.png"): other}, counts={("t.tar", "k"): 1})
    tokens, used = build(chat_tokenizer, tar_conversation(record, ["a.png", "json"]), images)
    assert used["image"] == ["t.tar:k.a.png", "t.tar:k.a.png"]
    text = tokens.tolist()
    assert sum(text[i:i + block.size] == block.tolist() for i in range(len(text))) == 2
    # a sample whose second image no slot names is still a mismatch (two slots, but one distinct member)
    images.counts = {("t.tar", "k"): 2}
    assert built_reason(chat_tokenizer, tar_conversation(record, ["a.png", "b.png", "json"]), images) == \
        "placeholder_mismatch"


def built_reason(tokenizer, conversation, images) -> str:
    from chatkit import build

    try:
        build(tokenizer, conversation, images)
    except Skip as skip:
        return skip.reason
    return ""


# -- §4: file names that are not UTF-8 -----------------------------------------------------------------------

LATIN1 = os.fsdecode(b"caf\xe9")  # "café" in Latin-1: how Python holds a name that is not UTF-8


def test_scan_names_a_member_and_an_input_path_that_are_not_utf8_and_writes_the_manifest(tmp_path, capsys):
    good = tmp_path / "good.tar"
    good.write_bytes(archive(regular("a.png", png()), regular(LATIN1 + ".png", png(90))))
    folder = tmp_path / LATIN1
    folder.mkdir()
    (folder / "s.tar").write_bytes(archive(regular("b.png", png())))
    out = tmp_path / "out"
    code = cli(["scan", str(good), str(folder / "s.tar"), "--out", str(out), "--workers", "1", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    manifest = Manifest.open(out)
    rows = [(r["tar"], r["member"], r["reason"]) for r in manifest.read().to_pylist()]
    shown = str(tmp_path / "caf\\xe9" / "s.tar")
    assert rows == [(str(good), "a.png", ""), (str(good), "caf\\xe9.png", "non_utf8_name"),
                    (shown, "", "non_utf8_path")]
    assert [i.path for i in manifest.metadata.inputs] == [str(good), shown]
    assert "non_utf8_path 1" in capsys.readouterr().err


def test_audio_convert_refuses_a_file_name_that_is_not_utf8_and_reads_a_folder_that_is_not(tmp_path, capsys):
    root = tmp_path / LATIN1  # the input folder itself is not UTF-8: its files are read all the same
    root.mkdir()
    (root / "one.flac").write_bytes(encoded(digit("1")))
    (root / (LATIN1 + ".flac")).write_bytes(encoded(digit("2")))
    (root / ("notes." + LATIN1)).write_bytes(b"not audio")
    out = tmp_path / "out"
    code = cli(["audio", "convert", str(root), "--out", str(out), "--workers", "0", "--no-progress"])
    assert code == 0, capsys.readouterr().err
    assert [cut.id for cut in load_cuts(out)] == ["one"]
    assert [(d["key"], d["reason"]) for d in dropped_records(out)] == [("caf\\xe9.flac", "non_utf8_name")]
    assert report(out)["counts"] == {"in": 3, "written": 1, "skipped:non_utf8_name": 1, "ignored:caf\\xe9": 1}
    for path in (out / "dropped").glob("*.jsonl"):
        path.read_bytes().decode("utf-8")  # nothing but valid text: escapes, no lone surrogates
        assert "\\udc" not in path.read_text()
