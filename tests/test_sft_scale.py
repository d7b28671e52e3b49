"""`mmtok sft` at scale: every output file of a small job (one rank and three ranks, a rank rerun from the
conversation index kept in OUT, then merged) hashes to what the two-pass, dict-indexed `mmtok sft` wrote; the
merged bytes are the same for 1, 5 and 20 ranks; a rank reads only its own range; an index of inputs that
changed since is refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

import mmtok.sft.build
from chatkit import sft_job
from encodekit import chat_tokenizer
from mmtok.cli import main
from mmtok.formats import conversation_index
from mmtok.formats.conversation_index import ARRAYS_FILE, META_FILE
from mmtok.formats.conversations import input_records, read_conversations
from mmtok.formats.items import KEPT_DIR
from mmtok.sft.build import CLIPS_DIR

# What differs between two runs of one job: wall times, and the CRCs of the records that hold them or its directory.
VARYING = rb'"(wall_ms|wall_s|stats_crc|identity_crc)": ?[\d.]+|\t[0-9a-f]{8}(?=\n)'
UNIT = 4  # conversations a unit: 19 conversations are 5 units, split 1/2/2 over 3 ranks


def _hashes(out: Path, root: Path) -> dict[str, str]:
    """sha256 of every file under `out`, the run's own directory and the wall times left out."""
    hashes = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name not in (".lock", META_FILE, ARRAYS_FILE)
                       and not {KEPT_DIR, CLIPS_DIR} & set(p.relative_to(out).parts)):  # kept for the ranks
        data = path.read_bytes().replace(os.fsencode(os.path.realpath(root)), b"ROOT")
        hashes[path.relative_to(out).as_posix()] = hashlib.sha256(re.sub(VARYING, b"", data)).hexdigest()
    return hashes


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-scale")
    return root, sft_job(root, chat_tokenizer(root / "tok"))


def _sft(job, monkeypatch, out: str, world_size: int) -> dict[str, str]:
    root, argv = job
    monkeypatch.chdir(root)
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    for rank in range(world_size):
        assert main([*argv, "--out", out, "--rank", str(rank), "--world-size", str(world_size)]) == 0
    assert main(["merge", out, "--no-progress"]) == 0
    return _hashes(root / out, root)


def _digest(hashes: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(hashes, sort_keys=True).encode()).hexdigest()


# The digest of every output file's sha256 (`_hashes`) as the two-pass `mmtok sft` with dict indexes wrote them.
RECORDED = {1: "f6535e2b47ee9b2468cc4b6f635684b6f2129bb59cda7f5fb7ea690a9ddce05a",
            3: "b53b8f46bdc7a4a524a664a22a3df43b60041a0cefeef8bf2d7d820275bceced"}


@pytest.mark.parametrize("world_size", [1, 3])
def test_every_output_file_is_the_bytes_the_two_pass_sft_wrote(job, monkeypatch, world_size):
    hashes = _sft(job, monkeypatch, f"ranks-{world_size}", world_size)
    assert _digest(hashes) == RECORDED[world_size], hashes


def test_a_rank_rerun_reads_only_its_range_and_writes_the_same_bytes(job, monkeypatch):
    root, argv = job
    _sft(job, monkeypatch, "rerun", 3)
    index = json.loads((root / "rerun" / META_FILE).read_text())
    assert index["conversations"] == 19 and index["duplicates"] == 1  # gamma's second g1
    reads = []

    def counted(*args, **kwargs):
        for found in input_records(*args, **kwargs):
            reads.append(found[2].id)
            yield found

    shutil.rmtree(root / "rerun" / "parts" / "part-00001")  # a lost rank, run again: units 1-2, ordinals 4-11
    monkeypatch.setattr(conversation_index, "input_records", counted)
    assert main([*argv, "--out", "rerun", "--rank", "1", "--world-size", "3"]) == 0
    expected = [c.id for c in read_conversations([root / a for a in argv[1:4]])][4:12]
    assert reads == expected  # nothing before its range is read, nothing after it
    assert main(["merge", "rerun", "--no-progress"]) == 0
    assert _digest(_hashes(root / "rerun", root)) == RECORDED[3]


def test_the_merged_bytes_are_the_same_for_1_5_and_20_ranks(job, monkeypatch):
    # 19 conversations in 5 units: 20 ranks leave 15 idle; units start inside a tar and at a .jsonl line
    # after a repeated id, which the rank reading it marks from the index
    root, _ = job
    merged = {}
    for world_size in (1, 5, 20):
        _sft(job, monkeypatch, f"w{world_size}", world_size)
        merged[world_size] = {name: (root / f"w{world_size}" / name).read_bytes()
                              for name in ("merged.bin", "merged.idx", "merged.skipped.jsonl")}
    assert merged[1] == merged[5] == merged[20]
    assert b"duplicate_conversation" in merged[1]["merged.skipped.jsonl"]


def test_an_index_of_inputs_that_changed_since_is_refused(job, monkeypatch, capsys):
    root, argv = job
    monkeypatch.chdir(root)
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    shutil.copytree(root / "convs", root / "convs2")
    other = [a.replace("convs/", "convs2/") for a in argv]
    assert main([*other, "--out", "changed", "--rank", "0", "--world-size", "2"]) == 0
    jsonl = root / "convs2" / "gamma.jsonl"
    jsonl.write_text(jsonl.read_text().replace("g2", "G2"))  # same size; another mtime and other first bytes
    capsys.readouterr()
    assert main([*other, "--out", "changed", "--rank", "1", "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "gamma.jsonl changed since the conversation index in" in err and "its offsets are not this file's" in err
    assert len(err.strip().splitlines()) == 1


def test_a_damaged_index_is_refused_not_read_short(job, monkeypatch, capsys):
    # OUT/conversations.json edited, or its arrays damaged: refused, never a rank that stops short.
    root, argv = job
    monkeypatch.chdir(root)
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    assert main([*argv, "--out", "damaged", "--rank", "0", "--world-size", "2"]) == 0
    meta = json.loads((root / "damaged" / META_FILE).read_text())
    (root / "damaged" / META_FILE).write_text(json.dumps({**meta, "conversations": 9}))
    assert main([*argv, "--out", "damaged", "--rank", "1", "--world-size", "2"]) == 2
    assert "9 conversations do not fit its 5 unit starts" in capsys.readouterr().err
    arrays = root / "damaged" / ARRAYS_FILE
    arrays.write_bytes(arrays.read_bytes()[:-1] + b"!")
    (root / "damaged" / META_FILE).write_text(json.dumps(meta))
    assert main([*argv, "--out", "damaged", "--rank", "1", "--world-size", "2"]) == 2
    assert "its bytes do not match the sha256" in capsys.readouterr().err


def test_later_ranks_map_the_media_indexes_the_first_rank_kept_and_rebuild_a_stale_or_damaged_one(job, monkeypatch):
    # the image items are parsed (one json record each), the clips' cut ids read and every media part checked
    # against its checksums by the first rank only; the others memory-map the arrays it kept in OUT/image-index
    # and OUT/clip-index, unless the parts changed since or an array file is not the one its writer recorded
    from mmtok.formats import audio_cache, commitlog

    root, argv = job
    _sft(job, monkeypatch, "kept", 3)
    checked, verify_part, verify_cache = [], commitlog.verify_part, audio_cache.verify
    monkeypatch.setattr(commitlog, "verify_part", lambda directory, *more: checked.append(Path(directory).parts[0])
                        or verify_part(directory, *more))
    monkeypatch.setattr(audio_cache, "verify", lambda path: checked.append("audio") or verify_cache(path))
    parsed, plain = [], commitlog.iter_items

    def counted(directory):
        if Path(directory).parts[0] == "img":  # the image encode's parts (merge reads the sft parts' own items)
            parsed.append(directory)
        return plain(directory)

    monkeypatch.setattr(commitlog, "iter_items", counted)  # items.py reaches it as commitlog.iter_items
    indexed, read_index = [], audio_cache.read_index
    monkeypatch.setattr(audio_cache, "read_index", lambda path: indexed.append(path) or read_index(path))

    def rerun_rank_1() -> None:
        shutil.rmtree(root / "kept" / "parts" / "part-00001")
        assert main([*argv, "--out", "kept", "--rank", "1", "--world-size", "3"]) == 0
        assert main(["merge", "kept", "--no-progress"]) == 0
        assert _digest(_hashes(root / "kept", root)) == RECORDED[3]

    rerun_rank_1()
    assert parsed == [] and indexed == [] and "img" not in checked and "audio" not in checked
    array = next((root / "kept" / KEPT_DIR).glob("members_high.npy"))
    array.write_bytes(array.read_bytes()[:-1] + b"\x01")  # rewritten: rebuilt from the parts, never trusted
    rerun_rank_1()
    assert len(parsed) == 2 and checked.count("img") == 2  # the parts checked again before the rebuild
    parsed.clear()
    rerun_rank_1()  # the rebuilt index was kept again
    assert parsed == []
    os.utime(root / "img" / "parts" / "part-00000" / commitlog.ITEMS)  # a part rewritten since: rebuilt
    rerun_rank_1()
    assert len(parsed) == 2


def test_a_media_part_damaged_after_the_index_was_kept_is_named_not_trusted(job, monkeypatch, capsys):
    # a later rank relies on the first rank's check of the image parts only while their files are those it checked
    from mmtok.formats import commitlog

    root, argv = job
    _sft(job, monkeypatch, "rotted", 2)
    tokens = root / "img" / "parts" / "part-00000" / commitlog.ITEM_IDS  # an sft-mode part: its blocks
    data = tokens.read_bytes()
    try:
        tokens.write_bytes(data[:8] + bytes([data[8] ^ 1]) + data[9:])  # bit rot: same size, a new mtime
        shutil.rmtree(root / "rotted" / "parts" / "part-00001")
        capsys.readouterr()
        assert main([*argv, "--out", "rotted", "--rank", "1", "--world-size", "2"]) == 2
        err = capsys.readouterr().err.strip()
        assert "do not match their checksum" in err and str(tokens.name) in err and len(err.splitlines()) == 1
    finally:
        tokens.write_bytes(data)
