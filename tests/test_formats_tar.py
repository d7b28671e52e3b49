"""One tar member reader: a GNU sparse member, a symbolic link and a truncated tar get the same named
reason, without a crash, in the scan, in conversation reading, in audio source reading and in the Shar
index -- and no module but mmtok/formats/tar.py reads tars with `tarfile`."""

from __future__ import annotations

import ast
import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from mmtok.audio.sources.tar import TarUnit
from mmtok.encode.audio import load_clip
from mmtok.errors import Skip
from mmtok.formats import skips
from mmtok.formats.chat import ConversationError
from mmtok.formats.conversations import locate, read_conversations
from mmtok.formats.shar import index_members
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import CHECK_BATCH, Damage, Member, read_members
from mmtok.media.audio import AudioReason
from mmtok.scan.scanner import scan_image_tar
from mmtok.sft.pack import pack
from tarkit import TYPE_FLAG, with_header_field

REPO = Path(__file__).resolve().parent.parent
# The fault planted in a tar's last member, and the reason every stage gives for it.
FAULTS = {"sparse": "unsupported_member", "symlink": "not_a_regular_file", "cut_in_member": "truncated_member",
          "cut_in_header": "truncated_tar"}
# Modules that create tars: `tarfile` there only writes (every `tarfile.open` has a "w" mode).
TAR_WRITERS = {"mmtok/formats/conversations.py", "mmtok/commands/demo_flow.py"}


def faulty_tar(path: Path, members: list[tuple[str, bytes]], fault: str) -> Path:
    """A GNU tar of `members` whose last member carries `fault` (a key of FAULTS; any other: none)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for index, (name, data) in enumerate(members):
            info = tarfile.TarInfo(name)
            info.mtime = 1_700_000_000
            if fault == "symlink" and index == len(members) - 1:
                info.type, info.linkname = tarfile.SYMTYPE, members[0][0]
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    data = out.getvalue()
    last = _header_offsets(data)[-1]
    if fault == "sparse":
        data = with_header_field(data, last, TYPE_FLAG, b"S")  # GNU sparse
    elif fault == "cut_in_member":
        data = data[:last + 512 + len(members[-1][1]) // 2]
    elif fault == "cut_in_header":
        data = data[:last + 100]
    path.write_bytes(data)
    return path


def _header_offsets(data: bytes) -> list[int]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [m.offset for m in tar.getmembers()]


def png() -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(out, "PNG")
    return out.getvalue()


WAV = b"RIFF" + bytes(2000)  # never decoded here: only located


def conversation(audio: str | None) -> bytes:
    """A record whose audio is named `audio`, or (None) a placeholder for the sample's audio member."""
    content = [{"type": "audio", "audio": audio}] if audio else "<|audio|> What is said?"
    return json.dumps({"messages": [{"role": "user", "content": content},
                                    {"role": "assistant", "content": "Noted."}]}).encode()


@pytest.mark.parametrize("fault", FAULTS)
def test_the_scan_names_the_fault_and_keeps_the_sound_member(tmp_path, fault):
    shard = faulty_tar(tmp_path / "s.tar", [("a.png", png()), ("b.png", png())], fault)
    rows = [(row[3], row[11]) for row in scan_image_tar(str(shard)).rows]
    named = "" if fault == "cut_in_header" else "b.png"
    assert rows == [("a.png", ""), (named, FAULTS[fault])]


def test_the_scan_splits_sample_keys_by_the_rule_the_sample_reader_uses(tmp_path):
    """The scan's hot loop splits a member name inline; it must give the keys `webdataset.sample_key` gives
    (WebDataset's: the base name up to its first dot, directories kept, dots in them included)."""
    from mmtok.formats.webdataset import sample_key

    names = ["plain.png", "dir.v2/a.png", "x.y/z/img.png", "nested/dir/c.png", "d.e/f.0.png"]  # (KEY.N.ext: pack's)
    shard = faulty_tar(tmp_path / "s.tar", [(name, png()) for name in names], "none")
    rows = scan_image_tar(str(shard)).rows
    assert [(row[0], row[3]) for row in rows] == [(sample_key(name)[0], name) for name in names]


def test_samples_are_runs_of_one_key_and_a_repeated_key_marks_each_of_its_samples(tmp_path):
    """read_samples: consecutive members of one key are one sample; a key that comes back later, or a sample
    holding one member name twice, is marked (how, and which occurrence) on every one of its samples."""
    from mmtok.formats.webdataset import read_samples

    names = ["a.json", "a.0.png", "b.json", "a.json", "c.json", "c.json", "d.json"]
    shard = faulty_tar(tmp_path / "s.tar", [(name, png()) for name in names], "none")
    samples = read_samples(shard)
    assert [(s.key, [m.name for m in s.members], s.occurrence) for s in samples] == [
        ("a", ["a.json", "a.0.png"], 1), ("b", ["b.json"], 1), ("a", ["a.json"], 2),
        ("c", ["c.json", "c.json"], 1), ("d", ["d.json"], 1)]
    assert [s.repeated for s in samples] == ["2 samples of this tar are named 'a'", "",
                                             "2 samples of this tar are named 'a'",
                                             "sample 'c' holds member c.json 2 times", ""]


@pytest.mark.parametrize("named", [True, False], ids=["named", "placeholder"])
@pytest.mark.parametrize("fault", FAULTS)
def test_conversation_reading_names_the_fault_and_keeps_the_sound_sample(tmp_path, fault, named):
    members = [(f"{key}.json", conversation(f"{key}.wav" if named else None)) for key in ("one", "two")]
    tar = faulty_tar(tmp_path / "chats.tar", [members[0], ("one.wav", WAV), members[1], ("two.wav", WAV)], fault)
    reasons = {}
    for item in read_conversations([tar]):
        if item.error is not None:
            reasons[item.id] = item.error.reason
            continue
        media = item.media()
        try:
            reasons[item.id] = [locate(item, media, ref.slot).kind for ref in media]
        except Skip as skip:
            reasons[item.id] = skip.reason
    # a cut header ends sample two, which may have lost members: one record, of the damage's reason
    assert reasons == {"chats/one": ["member"], "chats/two": FAULTS[fault]}


@pytest.mark.parametrize("fault", FAULTS)
def test_audio_source_reading_names_the_fault_and_keeps_the_sound_clip(tmp_path, fault):
    tar = faulty_tar(tmp_path / "calls.tar", [("one.txt", b"one"), ("one.flac", WAV), ("two.txt", b"two"),
                                              ("two.flac", WAV)], fault)
    payloads = list(TarUnit(origin="calls.tar", path=str(tar)).payloads())
    dropped = sorted(p.reason for p in payloads if isinstance(p, SkipRecord))
    clips = [p[1][0].id for p in payloads if not isinstance(p, SkipRecord)]
    assert clips == ["calls/one"]
    # a sample cut inside its header has lost its audio member, and says so too
    assert dropped == sorted([FAULTS[fault]] + (["no_audio_member"] if fault == "cut_in_header" else []))


@pytest.mark.parametrize("fault", FAULTS)
def test_the_shar_index_names_the_fault_and_keeps_the_sound_cut(tmp_path, fault):
    tar = faulty_tar(tmp_path / "recording.000000.tar", [("cut-a.flac", WAV), ("cut-b.flac", WAV)], fault)
    members, damage = index_members(tar)
    assert isinstance(members["cut-a"], tuple)
    request = type("Request", (), {"min_samples": 0, "max_clip_duration": 600.0})
    with open(tar, "rb") as handle, pytest.raises(AudioReason) as raised:
        load_clip(handle, members.get("cut-b", damage), 1.0, request)
    assert raised.value.reason == FAULTS[fault]


def test_a_tar_cut_after_it_was_indexed_is_a_truncated_member_to_every_byte_range_reader(tmp_path):
    """Images (`MemberReader`), clips (`load_clip`) and conversation media (`read_tar_member`) read a member's bytes
    through one function, `read_range`: a file that ends inside them is `truncated_member`, never bytes cut
    short (a clip used to reach the decoder cut and be skipped as decode_error)."""
    import numpy as np
    import soundfile

    from mmtok.formats.manifest import MemberReader, ShortRead
    from mmtok.formats.tar import MemberTruncated, read_tar_member

    sound = io.BytesIO()
    soundfile.write(sound, 0.5 * np.sin(np.arange(4800) / 5.0), 24_000, format="WAV", subtype="PCM_16")
    tar = faulty_tar(tmp_path / "recording.000000.tar", [("cut-a.wav", sound.getvalue()),
                                                           ("cut-b.wav", sound.getvalue())], "none")
    members, _ = index_members(tar)
    offset, size = members["cut-b"]
    with open(tar, "r+b") as handle:
        handle.truncate(offset + size // 2)  # the file changed since it was indexed (and verified)
    with pytest.raises(MemberTruncated, match="ends inside the member"):
        read_tar_member(tar, offset, size)
    with pytest.raises(ShortRead, match="ends inside the member"):
        MemberReader().read(str(tar), offset, size)
    request = type("Request", (), {"min_samples": 0, "max_clip_duration": 600.0})
    with open(tar, "rb") as handle, pytest.raises(AudioReason) as raised:
        load_clip(handle, members["cut-b"], 1.0, request)
    assert raised.value.reason == "truncated_member"
    with open(tar, "rb") as handle:  # the member before the cut is whole
        assert load_clip(handle, members["cut-a"], 1.0, request).size > 0


def test_members_past_a_corrupt_header_are_read_after_the_resync(tmp_path):
    names = [("a.txt", b"a" * 600), ("b.txt", b"b"), ("c.txt", b"c")]
    tar = faulty_tar(tmp_path / "s.tar", names, "none")
    data = bytearray(tar.read_bytes())
    data[_header_offsets(bytes(data))[1] + 3] ^= 0x20  # a flipped bit in b's name
    tar.write_bytes(bytes(data))
    entries = list(read_members(tar))
    assert [type(e) for e in entries] == [Member, Damage, Member]
    assert (entries[0].name, entries[2].name, entries[1].reason) == ("a.txt", "c.txt", "corrupt_header")


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT], ids=["gnu", "pax"])
def test_members_are_tarfiles_own_and_none_past_a_bad_header_beyond_a_checksum_batch(tmp_path, fmt):
    count = CHECK_BATCH + 900  # the bad header lies in the second batch of checked headers
    names = [(f"d{k % 3}/{'n' * (k % 140)}{k:05d}.txt", b"x" * (k % 700)) for k in range(count)]  # long names too
    tar = tmp_path / "s.tar"
    with tarfile.open(tar, "w", format=fmt) as archive:
        for name, data in names:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    with tarfile.open(tar) as archive:
        expected = [Member(m.name, m.offset_data, m.size) for m in archive]
    assert list(read_members(tar)) == expected
    bad = CHECK_BATCH + 500
    data = bytearray(tar.read_bytes())
    data[expected[bad].offset - 512 + 2] ^= 0x20  # the member's own header, after its long-name header
    tar.write_bytes(bytes(data))
    entries = list(read_members(tar))
    assert entries[:bad] == expected[:bad] and entries[bad + 1:] == expected[bad + 1:]
    assert entries[bad] == Damage("corrupt_header", expected[bad].offset - 512)


def test_a_compressed_and_a_foreign_file_are_named(tmp_path):
    (tmp_path / "z.tar").write_bytes(gzip.compress(bytes(2048)))
    (tmp_path / "x.tar").write_bytes(b"not a tar" * 200)
    assert [e.reason for e in read_members(tmp_path / "z.tar")] == ["compressed_tar"]
    assert [e.reason for e in read_members(tmp_path / "x.tar")] == ["not_a_tar"]


def _tarfile_uses(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) for each use of `tarfile` that reads: an open without a write mode, or a reading API."""
    reads = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "open" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "tarfile":
            modes = [k.value for k in node.keywords if k.arg == "mode"] + node.args[1:2]
            mode = modes[0].value if modes and isinstance(modes[0], ast.Constant) else "r"
            if not str(mode).startswith(("w", "x")):
                reads.append((node.lineno, f"tarfile.open(mode={mode!r})"))
        if isinstance(node, ast.Attribute) and node.attr in ("extractfile", "getmembers", "getmember", "next",
                                                            "extractall", "extract", "is_tarfile"):
            reads.append((node.lineno, node.attr))
    return reads


def test_no_module_but_the_tar_reader_reads_tars_with_tarfile():
    """Creating a tar (pack, the demo) may use `tarfile`; reading one goes through mmtok.formats.tar."""
    importers, reading = set(), []
    for path in sorted((REPO / "mmtok").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        tree = ast.parse(path.read_text(), rel)
        imported = any(isinstance(n, ast.Import) and any(a.name == "tarfile" for a in n.names)
                       or isinstance(n, ast.ImportFrom) and n.module == "tarfile" for n in ast.walk(tree))
        if not imported or rel == "mmtok/formats/tar.py":
            continue
        importers.add(rel)
        reading += [f"{rel}:{line}: {what}" for line, what in _tarfile_uses(tree)]
    assert reading == [], "read tars with mmtok.formats.tar.read_members / read_tar_member"
    assert importers <= TAR_WRITERS, f"tarfile imported outside the writers: {sorted(importers - TAR_WRITERS)}"


# -- a sample the damage cuts is one record of the damage's reason -----------------------------------
def two_clip_chats(tmp_path: Path) -> tuple[Path, bytes, dict[str, int]]:
    """A tar of four samples, each a json with two audio placeholders and two clips; its bytes and the
    header offset of each member."""
    members = []
    for key in ("one", "two", "three", "four"):
        record = json.dumps({"messages": [{"role": "user", "content": "<|audio|> <|audio|> Same?"},
                                          {"role": "assistant", "content": "Yes."}]}).encode()
        members += [(f"{key}.json", record), (f"{key}.0.wav", WAV), (f"{key}.1.wav", WAV)]
    tar = faulty_tar(tmp_path / "chats.tar", members, "none")
    data = tar.read_bytes()
    return tar, data, dict(zip((name for name, _ in members), _header_offsets(data), strict=True))


def located_reasons(tar: Path) -> dict[str, object]:
    """Conversation id -> its error's reason, else what its media locate to, else the locate's Skip reason."""
    reasons = {}
    for item in read_conversations([tar]):
        try:
            media = item.media()
            reasons[item.id] = [locate(item, media, ref.slot).kind for ref in media]
        except (Skip, ConversationError) as err:
            reasons[item.id] = err.reason
    return reasons


SOUND = ["member", "member"]


def test_a_sample_the_tar_ends_inside_is_truncated_member_not_a_placeholder_mismatch(tmp_path):
    tar, data, headers = two_clip_chats(tmp_path)
    tar.write_bytes(data[:headers["two.0.wav"] + 512 + 1000])  # two.1.wav is lost with the cut
    assert located_reasons(tar) == {"chats/one": SOUND, "chats/two": "truncated_member"}


def test_a_corrupt_header_mid_sample_is_one_record_and_the_counts_add_up(tmp_path):
    tar, data, headers = two_clip_chats(tmp_path)
    damaged = bytearray(data)
    damaged[headers["two.0.wav"] + 3] ^= 0x20  # a flipped bit in the name: its checksum fails
    tar.write_bytes(bytes(damaged))
    assert located_reasons(tar) == {"chats/one": SOUND, "chats/two": "corrupt_header", "chats/three": SOUND,
                                    "chats/four": SOUND}  # two.1.wav, after the resync, is still sample two's
    counts = pack([tar], tmp_path / "packed", progress=False).counts
    assert (counts["conversations"], counts["packed"], skips.by_reason(counts)) == (4, 3, {"corrupt_header": 1})


def test_a_media_member_named_in_no_utf8_is_non_utf8_name_in_its_sample(tmp_path):
    tar, data, headers = two_clip_chats(tmp_path)
    tar.write_bytes(with_header_field(data, headers["two.0.wav"], slice(0, 1), b"\xff"))  # "\xffwo.0.wav"
    assert located_reasons(tar) == {"chats/one": SOUND, "chats/two": "non_utf8_name", "chats/three": SOUND,
                                    "chats/four": SOUND}


@pytest.mark.parametrize("content", [b"", bytes(10240)], ids=["empty_file", "no_samples"])
def test_a_tar_without_a_sample_is_no_conversation_and_one_file_reason(tmp_path, content):
    tar = tmp_path / "chats.tar"
    tar.write_bytes(content)
    report = pack([tar], tmp_path / "packed", progress=False)
    reason = "empty_file" if not content else "no_samples"
    assert report.counts == {skips.file_count_key(reason): 1}
    [record] = skips.read(tmp_path / "packed" / "skipped.jsonl")
    assert (record.key, record.container, record.reason) == ("chats.tar", "tar", reason)
