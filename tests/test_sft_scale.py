"""`mmtok sft` at scale: every output file of a small job (one rank and three ranks, a rank rerun from the
count kept in OUT, then merged) hashes to what the two-pass, dict-indexed `mmtok sft` wrote; a rank that finds
the count reads the inputs once."""

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
from mmtok.formats.conversations import COUNT_FILE, cached_count, input_fingerprint, read_conversations

# What differs between two runs of one job: wall times, and the CRCs of the records that hold them or its directory.
VARYING = rb'"(wall_ms|wall_s|stats_crc|identity_crc)": ?[\d.]+|\t[0-9a-f]{8}(?=\n)'
UNIT = 4  # conversations a unit: 19 conversations are 5 units, split 1/2/2 over 3 ranks


def _hashes(out: Path, root: Path) -> dict[str, str]:
    """sha256 of every file under `out`, the run's own directory and the wall times left out."""
    hashes = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name not in (".lock", COUNT_FILE)):
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


def test_a_rank_rerun_reads_the_inputs_once_and_writes_the_same_bytes(job, monkeypatch):
    root, argv = job
    _sft(job, monkeypatch, "rerun", 3)
    fingerprint = input_fingerprint([Path(a) for a in argv[1:4]])
    assert cached_count(root / "rerun", fingerprint) == 19
    reads = []

    def counted(*args, **kwargs):
        reads.append(args)
        return read_conversations(*args, **kwargs)

    shutil.rmtree(root / "rerun" / "parts" / "part-00001")  # a lost rank, run again
    monkeypatch.setattr(mmtok.sft.build, "read_conversations", counted)
    assert main([*argv, "--out", "rerun", "--rank", "1", "--world-size", "3"]) == 0
    assert len(reads) == 1
    assert main(["merge", "rerun", "--no-progress"]) == 0
    assert _digest(_hashes(root / "rerun", root)) == RECORDED[3]


def test_a_count_of_inputs_that_changed_since_is_not_used(tmp_path):
    talk = tmp_path / "talk.jsonl"
    talk.write_text('{"messages": [{"role": "user", "content": "Hi."}]}\n')
    mmtok.formats.conversations.write_count(tmp_path / "out", input_fingerprint([talk]), 1)
    assert cached_count(tmp_path / "out", input_fingerprint([talk])) == 1
    talk.write_text(talk.read_text() * 2)
    assert cached_count(tmp_path / "out", input_fingerprint([talk])) is None


@pytest.mark.parametrize("kept", [2, -3])
def test_a_count_below_what_the_inputs_hold_is_refused_not_written_short(job, monkeypatch, capsys, kept):
    # OUT/conversations.json edited, or inputs rewritten keeping size and mtime: the last rank must not stop short.
    root, argv = job
    monkeypatch.chdir(root)
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    fingerprint = input_fingerprint([Path(a) for a in argv[1:4]])
    mmtok.formats.conversations.write_count(root / f"short{kept}", fingerprint, kept)
    assert main([*argv, "--out", f"short{kept}"]) == 2
    assert "the inputs hold more conversations than the" in capsys.readouterr().err
