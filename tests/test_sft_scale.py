"""`mmtok sft` at scale: every output file of a small job is the same for 1, 3 and 7 workers (work items, not rank
ranges) and merges to the bytes the rank-split `mmtok sft` merged; a worker that finished its own items takes over
the others'; a rerun item reads only its own conversations from the index kept in OUT; an index of inputs that
changed since is refused."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
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
from mmtok.formats.partdir import is_done, part_dir
from mmtok.fsutil import WriterLock
from mmtok.launch import STOPPED_EXIT
from mmtok.sft.build import CLIPS_DIR
from summaries import json_result

# What differs between two runs of one job: wall times, and the CRCs of the records that hold them or its directory.
VARYING = rb'"(wall_ms|wall_s|stats_crc|identity_crc)": ?[\d.]+|\t[0-9a-f]{8}(?=\n)'
UNIT = 4  # conversations a unit: 19 conversations are 5 units
ITEM = 2  # units a work item: 5 units are 3 items (units 0-1, 2-3, 4), split 1/1/1 over 3 workers
# The merged files of this job as `mmtok sft` wrote them when it split the conversations into rank ranges (before
# work items; the same for 1 and 3 ranks): work items change the parts, never what merge makes of them.
MERGED = {"merged.bin": "3413d1500092556b7b39f9b69f22013897e3c2b07b5f03dc68cdc90da2d4c2ae",
          "merged.idx": "004b48025a5815b0adbb5a5ee5639762f198c00ff322a06879bed516d1cb7c5d",
          "merged.provenance.jsonl": "14726f7ec10b601b886b88ec8b52ee2b9e1a484f558257488d4ac830e503b305",
          "merged.skipped.jsonl": "0fd392a0dc060598611cacb695ec726b7504c407b27980cda1e20e6cc048edb3"}


def _hashes(out: Path, root: Path) -> dict[str, str]:
    """sha256 of every file under `out`, the run's own directory and the wall times left out."""
    hashes = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.name not in (".lock", META_FILE, ARRAYS_FILE)
                       and not {KEPT_DIR, CLIPS_DIR} & set(p.relative_to(out).parts)):  # kept for the workers
        data = path.read_bytes().replace(os.fsencode(os.path.realpath(root)), b"ROOT")
        hashes[path.relative_to(out).as_posix()] = hashlib.sha256(re.sub(VARYING, b"", data)).hexdigest()
    return hashes


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-scale")
    return root, sft_job(root, chat_tokenizer(root / "tok"))


def _small_items(monkeypatch) -> None:
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    monkeypatch.setattr(mmtok.sft.build, "UNITS_PER_ITEM", ITEM)


def _sft(job, monkeypatch, out: str, world_size: int, *flags: str) -> dict[str, str]:
    """Workers 0..world_size-1 one after another (each alone: with take-over the first would do every item, so
    the static split is shown with --no-take-over), then merge; every file's hash."""
    root, argv = job
    monkeypatch.chdir(root)
    _small_items(monkeypatch)
    for rank in range(world_size):
        assert main([*argv, "--out", out, "--rank", str(rank), "--world-size", str(world_size), *flags]) == 0
    assert main(["merge", out, "--no-progress"]) == 0
    return _hashes(root / out, root)


def test_every_output_file_is_the_same_for_1_3_and_7_workers_and_merges_to_the_rank_split_bytes(job, monkeypatch):
    # 7 workers leave 4 without an item; items start inside a tar and at a .jsonl line after a repeated id,
    # which the worker reading it marks from the index
    hashes = {workers: _sft(job, monkeypatch, f"w{workers}", workers, "--no-take-over") for workers in (1, 3, 7)}
    assert hashes[1] == hashes[3] == hashes[7]
    assert {name: hashes[1][name] for name in MERGED} == MERGED
    assert sorted(name for name in hashes[1] if name.endswith("/DONE")) == [
        f"parts/part-{item:05d}/DONE" for item in range(3)]  # a part per item, whatever the number of workers
    stats = [json.loads((job[0] / "w3" / f"parts/part-{item:05d}/stats.json").read_text()) for item in range(3)]
    assert [s["units"] for s in stats] == [[0, 2], [2, 4], [4, 5]]
    assert b"duplicate_conversation" in (job[0] / "w1" / "merged.skipped.jsonl").read_bytes()


def test_a_worker_that_finished_its_items_takes_over_the_others(job, monkeypatch, capsys):
    root, argv = job
    reference = _sft(job, monkeypatch, "static", 3, "--no-take-over")
    capsys.readouterr()
    assert main([*argv, "--out", "taken", "--rank", "0", "--world-size", "3", "--json"]) == 0
    result = json_result(capsys.readouterr())
    assert (result["items"], result["taken_over"], result["stopped"]) == ([0, 1], [2, 1], None)  # far end first
    for rank in (1, 2):  # the owners come later: nothing left for them
        assert main([*argv, "--out", "taken", "--rank", str(rank), "--world-size", "3"]) == 0
        err = capsys.readouterr().err
        assert f"part-{rank:05d}, already finished" in err and "nothing to do" in err and "took over" not in err
    assert main(["merge", "taken", "--no-progress"]) == 0
    assert _hashes(root / "taken", root) == reference


def test_a_rerun_item_reads_only_its_conversations_and_writes_the_same_bytes(job, monkeypatch):
    root, argv = job
    reference = _sft(job, monkeypatch, "rerun", 3, "--no-take-over")
    index = json.loads((root / "rerun" / META_FILE).read_text())
    assert index["conversations"] == 19 and index["duplicates"] == 1  # gamma's second g1
    reads = []

    def counted(*args, **kwargs):
        for found in input_records(*args, **kwargs):
            reads.append(found[2].id)
            yield found

    shutil.rmtree(root / "rerun" / "parts" / "part-00001")  # a lost item, run again: units 2-3, ordinals 8-15
    monkeypatch.setattr(conversation_index, "input_records", counted)
    assert main([*argv, "--out", "rerun", "--rank", "1", "--world-size", "3"]) == 0
    expected = [c.id for c in read_conversations([root / a for a in argv[1:4]])][8:16]
    assert reads == expected  # nothing before its range is read, nothing after it
    assert main(["merge", "rerun", "--no-progress"]) == 0
    assert _hashes(root / "rerun", root) == reference


def test_an_index_of_inputs_that_changed_since_is_refused(job, monkeypatch, capsys):
    root, argv = job
    monkeypatch.chdir(root)
    _small_items(monkeypatch)
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
    _small_items(monkeypatch)
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
    from mmtok.formats import audio_cache, commitlog, partdir
    from mmtok.formats import items as item_records

    root, argv = job
    reference = _sft(job, monkeypatch, "kept", 3)
    checked, verify_part, verify_cache = [], commitlog.verify_part, audio_cache.verify
    monkeypatch.setattr(commitlog, "verify_part", lambda directory, *more: checked.append(Path(directory).parts[0])
                        or verify_part(directory, *more))
    monkeypatch.setattr(audio_cache, "verify", lambda path: checked.append("audio") or verify_cache(path))
    parsed, plain = [], item_records.iter_items

    def counted(directory):
        if Path(directory).parts[0] == "img":  # the image encode's parts (merge reads the sft parts' own items)
            parsed.append(directory)
        return plain(directory)

    monkeypatch.setattr(item_records, "iter_items", counted)  # ImageIndex reaches it by its module's name
    indexed, read_cache_index = [], audio_cache.read_cache_index
    monkeypatch.setattr(audio_cache, "read_cache_index", lambda path: indexed.append(path) or read_cache_index(path))

    def rerun_rank_1() -> None:
        shutil.rmtree(root / "kept" / "parts" / "part-00001")
        assert main([*argv, "--out", "kept", "--rank", "1", "--world-size", "3"]) == 0
        assert main(["merge", "kept", "--no-progress"]) == 0
        assert _hashes(root / "kept", root) == reference

    rerun_rank_1()
    assert parsed == [] and indexed == [] and "img" not in checked and "audio" not in checked
    array = next((root / "kept" / KEPT_DIR).glob("members_high.npy"))
    array.write_bytes(array.read_bytes()[:-1] + b"\x01")  # rewritten: rebuilt from the parts, never trusted
    rerun_rank_1()
    assert len(parsed) == 2 and checked.count("img") == 2  # the parts checked again before the rebuild
    parsed.clear()
    rerun_rank_1()  # the rebuilt index was kept again
    assert parsed == []
    os.utime(root / "img" / "parts" / "part-00000" / partdir.ITEMS)  # a part rewritten since: rebuilt
    rerun_rank_1()
    assert len(parsed) == 2


def test_a_media_part_damaged_after_the_index_was_kept_is_named_not_trusted(job, monkeypatch, capsys):
    # a later rank relies on the first rank's check of the image parts only while their files are those it checked
    from mmtok.formats import partdir

    root, argv = job
    _sft(job, monkeypatch, "rotted", 2)
    tokens = root / "img" / "parts" / "part-00000" / partdir.ITEM_IDS  # an sft-mode part: its blocks
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


def test_usr1_commits_the_unit_in_hand_and_exits_75_and_two_workers_finish_the_job(job, monkeypatch, capsys):
    # the signal comes from the worker's own commit of unit 2 (item 1's first): the handler `mmtok sft` installed
    # runs before the next unit is read, so the stop lands at that commit on every run
    root, argv = job
    reference = _sft(job, monkeypatch, "whole", 1)
    commit, commits = mmtok.sft.build._Unit.commit, []

    def signalling(self, part):
        commit(self, part)
        commits.append(self.unit)
        if self.unit == 2:
            os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(mmtok.sft.build._Unit, "commit", signalling)
    capsys.readouterr()
    assert main([*argv, "--out", "stopped", "--json"]) == STOPPED_EXIT
    captured = capsys.readouterr()
    assert json_result(captured)["stopped"] == {"signal": "SIGUSR1", "item": 1}
    assert "stopped on SIGUSR1 in work item 1 (every unit it read is committed)" in captured.err
    stopped = root / "stopped"
    assert commits == [0, 1, 2] and is_done(part_dir(stopped, 0)) and not is_done(part_dir(stopped, 1))
    assert WriterLock.holder(part_dir(stopped, 1)) is None  # released: any worker may resume it
    assert main(["status", "stopped", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["work_items"] and [(p["state"], p["units_done"], p["units_planned"]) for p in status["parts"]] == [
        ("done", 2, 2), ("stopped", 1, 2), ("missing", 0, 1)]  # item 2's units known before it started
    monkeypatch.setattr(mmtok.sft.build._Unit, "commit", commit)
    assert _sft(job, monkeypatch, "stopped", 2) == reference


def test_an_item_another_process_holds_is_left_to_it_or_without_take_over_refused_naming_it(job, monkeypatch, capsys):
    root, argv = job
    reference = _sft(job, monkeypatch, "reference", 1)
    held = part_dir(root / "held", 1)
    held.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import sys; from mmtok.fsutil import WriterLock; "
                               f"lock = WriterLock({str(held)!r}, 'part 1'); print('held', flush=True); "
                               "sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        capsys.readouterr()
        assert main([*argv, "--out", "held", "--json"]) == 0
        captured = capsys.readouterr()
        result = json_result(captured)
        assert (result["held_by_others"], result["taken_over"]) == ([1], [])
        assert "left 1 own item to the workers holding them: 1" in captured.err
        assert is_done(part_dir(root / "held", 0)) and is_done(part_dir(root / "held", 2))
        assert main([*argv, "--out", "held", "--no-take-over"]) == 2
        err = capsys.readouterr().err.strip()
        assert "is being written by another process" in err and f"pid {holder.pid}" in err
        assert len(err.splitlines()) == 1
    finally:
        holder.communicate("")
    assert main([*argv, "--out", "held"]) == 0
    assert main(["merge", "held", "--no-progress"]) == 0
    assert _hashes(root / "held", root) == reference


def test_an_out_of_rank_parts_written_before_work_items_is_refused_in_one_line(job, monkeypatch, capsys):
    # a part-per-rank identity has no work_items: resuming it as items would mix two layouts in one OUT
    root, argv = job
    _sft(job, monkeypatch, "old", 1)
    identity = root / "old" / "parts" / "part-00000" / "identity.json"
    recorded = json.loads(identity.read_text())
    del recorded["work_items"]
    identity.write_text(json.dumps({**recorded, "num_parts": 2, "part_units": [0, 3]}))
    shutil.rmtree(root / "old" / "parts" / "part-00001")
    capsys.readouterr()
    assert main([*argv, "--out", "old"]) == 2
    err = capsys.readouterr().err.strip()
    assert "a part of another run: num_parts (recorded 2, now 3)" in err and "nothing was written" in err
    assert len(err.splitlines()) == 1
    assert not (root / "old" / "parts" / "part-00001").exists()  # nothing written


def test_a_stop_after_the_last_own_item_still_exits_75_naming_the_item_it_would_take_next(job, monkeypatch, capsys):
    # found by an attack: a stop that ended the take-over scan (not an item) exited 0 with items left undone
    root, argv = job
    _small_items(monkeypatch)
    monkeypatch.chdir(root)
    commit = mmtok.sft.build._Unit.commit

    def signalling(self, part):
        commit(self, part)
        if self.unit == 1:  # the last unit of item 0, worker 0's only own item
            os.kill(os.getpid(), signal.SIGUSR1)

    monkeypatch.setattr(mmtok.sft.build._Unit, "commit", signalling)
    capsys.readouterr()
    assert main([*argv, "--out", "after-own", "--rank", "0", "--world-size", "3", "--json"]) == STOPPED_EXIT
    result = json_result(capsys.readouterr())
    assert result["stopped"] == {"signal": "SIGUSR1", "item": 2} and result["taken_over"] == []
    assert [is_done(part_dir(root / "after-own", item)) for item in range(3)] == [True, False, False]
