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
from mmtok.audio.sources import TarUnit
from mmtok.cli import main as cli
from mmtok.errors import Skip
from mmtok.formats.conversations import locate, read_conversations
from mmtok.formats.manifest import Manifest
from mmtok.formats.shar import index_members
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import Damage, read_members
from mmtok.scan.scanner import ScanOptions, describe, run_scan
from tarkit import archive, multi_volume, old_gnu_sparse, pax_sparse, regular

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
    assert meta["reasons"] == {UNSUPPORTED: 1} and meta["ignored_members"] == {}
    assert [(e["reason"], e["member"]) for e in meta["shard_errors"]] == [(UNSUPPORTED, "a.txt")]


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
