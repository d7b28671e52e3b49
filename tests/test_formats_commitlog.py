"""PartWriter: durable per-unit commits, resume after a kill at any instant, identity checks."""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from mmtok.errors import MmtokError
from mmtok.formats import skips
from mmtok.formats.commitlog import PartWriter, read_commits, read_provenance, read_skipped, verify_part
from mmtok.formats.items import ItemLocations, read_items
from mmtok.formats.partdir import COMMITS, has_dataset, is_done, part_dir, part_prefix
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import sha256_file

IDENTITY = {"part": 0, "num_parts": 1, "modality": "image", "plan_fingerprint": "abc",
            "codec": {"name": "x", "precision": {"tf32_matmul": True, "dtype": "float32"}}}

# A writer whose every unit is a pure function of the unit number (as encode's are); the parent
# kills it with SIGKILL at random instants and restarts it until it finishes. Units 1, 2 (mod 3) also
# commit items (some of them with no ids, as a failed image has).
WRITER = r"""
import os, signal, sys, threading, numpy as np
from mmtok.formats.commitlog import PartWriter
directory, units, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
kill_after, delay = (int(sys.argv[4]), float(sys.argv[5])) if len(sys.argv) > 5 else (None, 0.0)
shard = PartWriter(directory, {"part": 0, "num_parts": 1, "fingerprint": "f"})
if not shard.done:
    for unit in range(shard.next_unit, units):
        if unit - 1 == kill_after:  # SIGKILL itself `delay` s into the next unit's work (data, record, fsyncs)
            threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        rng = np.random.default_rng(unit)
        seqs = [rng.integers(0, 266440, rng.integers(1, size), dtype=np.int32) for _ in range(3)]
        carry = rng.bytes(1000) if unit % 4 else b""
        items = [({"kind": "image", "document": unit, "image_index": k},
                  rng.integers(0, 266440, rng.integers(0, size // 4), dtype=np.int32)) for k in range(unit % 3)]
        shard.commit(unit, seqs, [{"unit": unit, "i": i} for i in range(3)], {"written": 3},
                     carry=carry, carry_done=unit % 4 == 0, items=items)
    shard.finish({"note": "done"})
"""


def _units(shard: PartWriter, units: range, rng_seed: int = 0) -> list[list[np.ndarray]]:
    written = []
    for unit in units:
        rng = np.random.default_rng(rng_seed + unit)
        seqs = [rng.integers(0, 266440, rng.integers(1, 50), dtype=np.int32) for _ in range(unit % 3 + 1)]
        shard.commit(unit, seqs, [{"unit": unit, "seq": i} for i in range(len(seqs))], {"written": len(seqs)})
        written.append(seqs)
    return written


def test_finished_part_reads_back_with_megatron_core(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    shard = PartWriter(tmp_path / "p", IDENTITY)
    written = [s for unit in _units(shard, range(5)) for s in unit]
    shard.finish({"wall_s": 1.0})
    assert is_done(tmp_path / "p")
    dataset = IndexedDataset(str(part_prefix(tmp_path / "p")))
    assert len(dataset) == len(written)
    for i, seq in enumerate(written):
        np.testing.assert_array_equal(dataset[i], seq)
    provenance = list(read_provenance(tmp_path / "p"))
    assert [p["unit"] for p in provenance] == [u for u in range(5) for _ in range(u % 3 + 1)]
    stats = json.loads((tmp_path / "p" / "stats.json").read_text())
    assert stats["counts"] == {"written": len(written)} and stats["sequences"] == len(written)


@pytest.mark.parametrize("done", [b"[1]\n", b"{\"identity_crc\": 1}\n", b"not json"])
def test_a_damaged_done_record_is_named_not_a_traceback(tmp_path, done):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(2))
    shard.finish({})
    (tmp_path / "p" / "DONE").write_bytes(done)
    with pytest.raises(MmtokError, match=r"DONE: damaged .*Delete .* and re-encode this part"):
        verify_part(tmp_path / "p")


def test_resume_continues_after_last_commit_and_restores_counts(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(3))
    shard.close()
    resumed = PartWriter(tmp_path / "p", IDENTITY)
    assert resumed.next_unit == 3
    assert resumed.counts == {"written": 1 + 2 + 3}
    assert not resumed.done


def test_torn_tails_are_truncated_and_final_bytes_match_clean_run(tmp_path):
    clean = PartWriter(tmp_path / "clean", IDENTITY)
    _units(clean, range(6))
    clean.finish({})

    torn = PartWriter(tmp_path / "torn", IDENTITY)
    _units(torn, range(4))
    torn.close()
    # A kill after the data of unit 4 was appended but in the middle of its commit record.
    directory = tmp_path / "torn"
    with open(directory / "tokens.bin", "ab") as handle:
        handle.write(b"\x01" * 123)
    with open(directory / "provenance.jsonl", "ab") as handle:
        handle.write(b'{"unit": 4, "se')
    with open(directory / COMMITS, "ab") as handle:
        handle.write(b'{"unit":4,"lengths":[1')
    resumed = PartWriter(directory, IDENTITY)
    assert resumed.next_unit == 4
    _units(resumed, range(4, 6))
    resumed.finish({})
    for name in ("tokens.bin", "tokens.idx", "provenance.jsonl"):
        assert sha256_file(directory / name) == sha256_file(tmp_path / "clean" / name), name


def test_resume_refuses_a_different_identity_naming_the_key(tmp_path):
    PartWriter(tmp_path / "p", IDENTITY).close()
    changed = json.loads(json.dumps(IDENTITY))
    changed["codec"]["precision"]["tf32_matmul"] = False
    with pytest.raises(MmtokError, match=r"codec\.precision\.tf32_matmul \(recorded True, now False\)"):
        PartWriter(tmp_path / "p", changed)
    with pytest.raises(MmtokError, match=r"plan_fingerprint \(recorded 'abc', now 'xyz'\)"):
        PartWriter(tmp_path / "p", {**IDENTITY, "plan_fingerprint": "xyz"})


def test_corrupt_record_before_intact_ones_is_refused(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(3))
    shard.close()
    log = tmp_path / "p" / COMMITS
    lines = log.read_bytes().splitlines(keepends=True)
    lines[0] = lines[0].replace(b'"unit":0', b'"unit":9')
    log.write_bytes(b"".join(lines))
    with pytest.raises(MmtokError, match="corrupt but later records are intact"):
        PartWriter(tmp_path / "p", IDENTITY)


RECORD_DAMAGE = [
    (lambda record: record.update(lengths=["x"]), "(record 2): every entry of key 'lengths' must be an integer"),
    (lambda record: record.update(lengths=[-4]), "(record 2): key 'lengths' holds a length below 0"),
    (lambda record: record.pop("unit"), "(record 2): no key 'unit'"),
    (lambda record: record.update(counts="x"), "(record 2): key 'counts' must be an object"),
    (lambda record: record["counts"].update(written=-1), "(record 2.counts): key 'written' must be >= 0"),
    (lambda record: record.pop("crc"), "(record 2): no key 'crc'"),
    (lambda record: record["crc"].update({"tokens.bin": "0"}), "(record 2.crc): key 'tokens.bin' must be an integer"),
    (lambda record: record.update(tokens_bytes=1.5), "(record 2): key 'tokens_bytes' must be an integer"),
    (lambda record: record["lengths"].__setitem__(0, 2 ** 63), "(record 2): lengths 9223372036854775808 is past what"),
    (lambda record: record["counts"].update(written=10 ** 400), "(record 2): counts.written 1000"),
    (lambda record: record.update(carry_live=10 ** 30), "(record 2): carry_live 100000000000000 "),
    (lambda record: record.update(unit=0), "(record 2): unit 0 does not follow the unit before it, 0"),
    (lambda record: record.update(provenance_bytes=0), "(record 2): key 'provenance_bytes' is 0, below the"),
    (lambda record: record["lengths"].append(3), "(record 2): its lengths hold"),
]


@pytest.mark.parametrize("damage,expected", RECORD_DAMAGE, ids=[str(i) for i in range(len(RECORD_DAMAGE))])
def test_a_commit_record_of_another_shape_is_refused_naming_the_record_and_the_key(tmp_path, capsys, damage, expected):
    """A CRC-32 shows a record was written whole, not that mmtok wrote it (parts come from other jobs, and a CRC is
    easy to redo): a record of the wrong shape is one line naming the log, the record and the key -- for a resume,
    for merge and for status -- never a traceback in the code that sums its lengths or counts."""
    import zlib

    from mmtok.cli import main

    shard = PartWriter(part_dir(tmp_path / "out", 0), IDENTITY)
    _units(shard, range(3))
    shard.finish({})
    log = part_dir(tmp_path / "out", 0) / COMMITS
    lines = log.read_bytes().splitlines(keepends=True)
    record = json.loads(lines[1].rpartition(b"\t")[0])
    damage(record)
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode()
    lines[1] = body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"  # a CRC that matches
    log.write_bytes(b"".join(lines))
    with pytest.raises(MmtokError, match=re.escape(expected) + ".*delete .* to re-encode this part"):
        read_commits(part_dir(tmp_path / "out", 0))  # what a resume, merge, status and sft read first
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("mmtok merge: error: ") and expected in err, err
    assert main(["status", str(tmp_path / "out"), "--json"]) == 0
    [part] = json.loads(capsys.readouterr().out)["parts"]
    assert part["state"] == "damaged" and expected in part["detail"], part


def test_a_record_nested_too_deep_is_a_corrupt_record_not_a_traceback(tmp_path):
    import zlib

    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(3))
    shard.close()
    log = tmp_path / "p" / COMMITS
    lines = log.read_bytes().splitlines(keepends=True)
    body = b"[" * 200_000 + b"]" * 200_000
    lines[1] = body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"
    log.write_bytes(b"".join(lines))
    with pytest.raises(MmtokError, match="commit record 2 of 3 is corrupt but later records are intact"):
        read_commits(tmp_path / "p")


def test_data_shorter_than_its_commit_is_refused(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(2))
    shard.close()
    with open(tmp_path / "p" / "tokens.bin", "r+b") as handle:
        handle.truncate(4)
    with pytest.raises(MmtokError, match="tokens.bin: 4 bytes but the last commit record says"):
        PartWriter(tmp_path / "p", IDENTITY)


def test_units_must_increase_and_done_parts_take_no_commits(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(2))
    with pytest.raises(ValueError, match="out of order"):
        shard.commit(1, [], [], {})
    shard.finish({})
    again = PartWriter(tmp_path / "p", IDENTITY)
    assert again.done and again.next_unit == 2
    with pytest.raises(MmtokError, match="finished"):
        again.commit(2, [], [], {})


def test_carry_survives_resume_until_declared_done(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [], [], {}, carry=b"abc")
    shard.commit(1, [], [], {}, carry=b"def")
    shard.close()
    resumed = PartWriter(tmp_path / "p", IDENTITY)
    assert resumed.carry() == b"abcdef"
    resumed.commit(2, [], [], {}, carry_done=True)
    assert resumed.carry() == b""
    assert (tmp_path / "p" / "carry.bin").stat().st_size == 0
    resumed.commit(3, [], [], {}, carry=b"gh")
    resumed.close()
    assert PartWriter(tmp_path / "p", IDENTITY).carry() == b"gh"


def test_carry_reset_interrupted_before_next_commit_resumes_empty(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [], [], {}, carry=b"abc")
    shard.commit(1, [], [], {}, carry_done=True)  # record says carry_live == carry_bytes == 3; file emptied
    with open(tmp_path / "p" / "carry.bin", "ab") as handle:  # a kill mid-append of unit 2's carry
        handle.write(b"zz")
    shard.close()
    resumed = PartWriter(tmp_path / "p", IDENTITY)
    assert resumed.carry() == b"" and resumed.next_unit == 2
    resumed.commit(2, [], [], {}, carry=b"x")
    assert resumed.carry() == b"x"


def _skip(key: str, reason: str) -> SkipRecord:
    return SkipRecord(key=key, source="a.tar", reason=reason, stage="encode")


def test_part_without_tokens_finishes_without_a_dataset(tmp_path):
    # megatron-core cannot mmap an empty .bin: such a part has no tokens.bin/.idx, and says so
    shard = PartWriter(part_dir(tmp_path, 3), {**IDENTITY, "part": 3})
    shard.commit(0, [], [], {"skipped:decode_error": 1}, skipped=[_skip("a", "decode_error")])
    shard.finish({})
    directory = part_dir(tmp_path, 3)
    assert directory.name == "part-00003" and is_done(directory) and not has_dataset(directory)
    assert not (directory / "tokens.bin").exists() and not (directory / "tokens.idx").exists()
    assert json.loads((directory / "stats.json").read_text())["dataset"] is False
    assert [r.key for r in read_skipped(directory)] == ["a"]
    verify_part(directory)


def test_skip_records_are_durable_with_their_unit_and_cut_back_with_it(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [np.arange(3)], [{"u": 0}], {}, skipped=[_skip("k0", "decode_error")])
    shard.close()
    with open(tmp_path / "p" / "skipped.jsonl", "ab") as handle:  # a kill after the data, before the record
        handle.write(skips.to_line(_skip("k1", "decode_error")))
    assert [r.key for r in read_skipped(tmp_path / "p")] == ["k0"]  # a reader (`mmtok status`) before the resume
    with open(tmp_path / "p" / "skipped.jsonl", "ab") as handle:  # and a line torn by that kill
        handle.write(b'{"key":"k1b","sou')
    assert [r.key for r in read_skipped(tmp_path / "p")] == ["k0"]
    resumed = PartWriter(tmp_path / "p", IDENTITY)
    assert [r.key for r in read_skipped(tmp_path / "p")] == ["k0"]
    resumed.commit(1, [np.arange(2)], [{"u": 1}], {}, skipped=[_skip("k2", "short_read")])
    resumed.finish({})
    assert [r.key for r in read_skipped(tmp_path / "p")] == ["k0", "k2"]


def _item(document: int, image_index: int, length: int) -> tuple[dict, np.ndarray]:
    return ({"kind": "image", "document": document, "image_index": image_index},
            np.arange(length, dtype=np.int32) + 1000 * document + 100 * image_index)


def test_items_read_back_with_their_lengths_and_offsets_across_units(tmp_path):
    units = [[_item(3, 0, 4), _item(3, 1, 0)], [], [_item(5, 0, 7)], [_item(3, 2, 2), _item(5, 1, 1)]]
    shard = PartWriter(tmp_path / "p", IDENTITY)
    for unit, items in enumerate(units):
        shard.commit(unit, [np.arange(unit + 1)] if unit % 2 else [], [{"u": unit}] if unit % 2 else [], {},
                     items=items)
    shard.finish({})
    verify_part(tmp_path / "p")
    records, ids = read_items(tmp_path / "p")
    committed = [item for items in units for item in items]
    assert [r["length"] for r in records] == [4, 0, 7, 2, 1]
    assert [r["offset"] for r in records] == [0, 4, 4, 11, 13]
    assert ids.dtype == np.int32 and ids.size == 14
    for record, (given, given_ids) in zip(records, committed, strict=True):
        assert {k: v for k, v in record.items() if k not in ("length", "offset")} == given
        np.testing.assert_array_equal(ids[record["offset"]:record["offset"] + record["length"]], given_ids)
    assert "length" not in committed[0][0]  # the caller's record is not changed


def test_item_locations_keep_where_each_indexed_item_is_and_where_each_parts_ids_end(tmp_path):
    """The one loop that indexes items (ImageIndex, merge's assembly): part, offset, length, whether it failed and
    its record's line, for every record not dropped; each part's end counts the dropped ones' ids too."""
    failed = ({**_item(3, 1, 0)[0], "skip": "decode_error"}, _item(3, 1, 0)[1])
    for name, items in (("a", [_item(3, 0, 4), failed, _item(5, 0, 7)]), ("b", [_item(6, 0, 2)]), ("c", [])):
        with PartWriter(tmp_path / name, IDENTITY) as part:
            part.commit(0, [], [], {}, items=items)
    locations, ends = ItemLocations(), []
    for number, name in enumerate("abc"):
        for record in locations.read_part(number, tmp_path / name):
            if record["document"] == 5:  # (a template, say: not indexed)
                locations.drop()
        ends.append(locations.end)
    lines = [0, (tmp_path / "a" / "items.jsonl").read_bytes().index(b"\n") + 1]  # where its first two lines start
    assert {name: column.tolist() for name, column in locations.columns().items()} == {
        "part": [0, 0, 1], "offset": [0, 4, 0], "length": [4, 0, 2], "has_skip": [0, 1, 0], "line": [*lines, 0]}
    assert ends == [11, 2, 0]


def test_a_part_of_items_only_finishes_without_a_dataset_and_keeps_its_items(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [], [], {"images_deferred": 1}, items=[_item(1, 0, 5)])
    shard.finish({})
    assert not has_dataset(tmp_path / "p")
    assert json.loads((tmp_path / "p" / "stats.json").read_text())["dataset"] is False
    verify_part(tmp_path / "p")
    records, ids = read_items(tmp_path / "p")
    assert [r["document"] for r in records] == [1] and ids.tolist() == _item(1, 0, 5)[1].tolist()


def test_a_part_without_items_reads_back_no_items(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(2))
    shard.finish({})
    records, ids = read_items(tmp_path / "p")
    assert records == [] and ids.size == 0


def test_item_bytes_are_cut_back_with_their_unit_and_match_a_clean_run(tmp_path):
    clean = PartWriter(tmp_path / "clean", IDENTITY)
    clean.commit(0, [np.arange(3)], [{"u": 0}], {}, items=[_item(1, 0, 3)])
    clean.commit(1, [], [], {}, items=[_item(1, 1, 2)])
    clean.finish({})

    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [np.arange(3)], [{"u": 0}], {}, items=[_item(1, 0, 3)])
    shard.close()
    with open(tmp_path / "p" / "items.ids", "ab") as handle:  # a kill after the data, before the record
        handle.write(np.arange(9, dtype=np.int32).tobytes())
    with open(tmp_path / "p" / "items.jsonl", "ab") as handle:
        handle.write(b'{"kind":"image","document":9,"len')
    resumed = PartWriter(tmp_path / "p", IDENTITY)
    assert resumed.next_unit == 1
    assert [r["document"] for r in read_items(tmp_path / "p")[0]] == [1]
    resumed.commit(1, [], [], {}, items=[_item(1, 1, 2)])
    resumed.finish({})
    for name in ("items.ids", "items.jsonl", "DONE"):
        assert sha256_file(tmp_path / "p" / name) == sha256_file(tmp_path / "clean" / name), name


def test_a_truncated_items_file_of_a_finished_part_is_refused(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [np.arange(3)], [{"u": 0}], {}, items=[_item(1, 0, 3), _item(1, 1, 2)])
    shard.finish({})
    path = tmp_path / "p" / "items.ids"
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(MmtokError, match=r"items.ids: 16 bytes but the commit log records 20"):
        verify_part(tmp_path / "p")


@pytest.mark.damages_datasets
@pytest.mark.parametrize("name", ["tokens.bin", "provenance.jsonl", "skipped.jsonl", "items.ids", "items.jsonl"])
def test_a_flipped_byte_in_a_committed_unit_is_refused_naming_the_unit(tmp_path, name):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    for unit in range(4):
        shard.commit(unit, [np.full(5, unit + 7)], [{"unit": unit}], {}, skipped=[_skip(f"k{unit}", "x")],
                     items=[({"kind": "image", "document": unit}, np.full(3, unit + 100, np.int32))])
    shard.close()
    path = tmp_path / "p" / name
    data = bytearray(path.read_bytes())
    records, _ = read_commits(tmp_path / "p")
    size_key = {"tokens.bin": "tokens_bytes", "provenance.jsonl": "provenance_bytes",
                "skipped.jsonl": "skipped_bytes", "items.ids": "item_ids_bytes", "items.jsonl": "items_bytes"}[name]
    data[records[1][size_key] + 1] ^= 0x01  # a byte of unit 2
    path.write_bytes(bytes(data))
    with pytest.raises(MmtokError, match=rf"{name}: the bytes of unit 2 do not match their checksum"):
        PartWriter(tmp_path / "p", IDENTITY)  # resume
    with pytest.raises(MmtokError, match="unit 2"):
        verify_part(tmp_path / "p")  # what merge runs


@pytest.mark.damages_datasets
def test_a_flipped_byte_in_a_finished_part_index_is_refused(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    _units(shard, range(3))
    shard.finish({})
    index = tmp_path / "p" / "tokens.idx"
    data = bytearray(index.read_bytes())
    data[-20] ^= 0x10
    index.write_bytes(bytes(data))
    with pytest.raises(MmtokError, match="tokens.idx: missing or does not match the commit log"):
        verify_part(tmp_path / "p")


def test_carried_bytes_are_checked_before_use(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    shard.commit(0, [], [], {}, carry=b"abcdef")
    shard.close()
    with open(tmp_path / "p" / "carry.bin", "r+b") as handle:
        handle.seek(2)
        handle.write(b"X")
    with pytest.raises(MmtokError, match="carried bytes do not match their checksum"):
        PartWriter(tmp_path / "p", IDENTITY).carry()


HOLDER = r"""
import sys
from mmtok.formats.commitlog import PartWriter
shard = PartWriter(sys.argv[1], {"part": 0, "num_parts": 1, "fingerprint": "f"})
print("holding", flush=True)
sys.stdin.read()  # hold the part until the parent closes our stdin (or kills us)
"""


def _hold(directory: Path) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "holding"
    return holder


def test_a_second_writer_of_a_part_is_refused_naming_the_holder(tmp_path):
    holder = _hold(tmp_path / "p")
    try:
        with pytest.raises(MmtokError, match=rf"being written by another process \(host .*, pid {holder.pid}, since"):
            PartWriter(tmp_path / "p", {"part": 0, "num_parts": 1, "fingerprint": "f"})
    finally:
        holder.stdin.close()
        holder.wait()
    PartWriter(tmp_path / "p", {"part": 0, "num_parts": 1, "fingerprint": "f"}).close()  # free once it has exited


def test_a_writer_killed_with_sigkill_never_blocks_the_next(tmp_path):
    holder = _hold(tmp_path / "p")
    holder.kill()
    holder.wait()
    shard = PartWriter(tmp_path / "p", {"part": 0, "num_parts": 1, "fingerprint": "f"})
    shard.finish({})
    assert is_done(tmp_path / "p")


def test_one_process_cannot_open_a_part_twice(tmp_path):
    shard = PartWriter(tmp_path / "p", IDENTITY)
    with pytest.raises(MmtokError, match="already being written by this process"):
        PartWriter(tmp_path / "p", IDENTITY)
    shard.close()
    PartWriter(tmp_path / "p", IDENTITY).close()


def _run_writer(directory: Path, units: int, size: int, kill: tuple[int, float] | None = None) -> subprocess.Popen:
    """The writer subprocess; with `kill` = (unit, delay) it SIGKILLs itself `delay` seconds after committing
    `unit` (from a timer thread, so the kill lands wherever the writer is then, whatever the machine's load)."""
    extra = [str(kill[0]), repr(kill[1])] if kill else []
    return subprocess.Popen([sys.executable, "-c", WRITER, str(directory), str(units), str(size), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_sigkill_at_random_instants_leaves_bytes_identical_to_a_clean_run(tmp_path):
    # Kills are placed by the writer's progress, not by the clock (a loaded machine only slows it down): the
    # writer kills itself at 12 increasing units, each at a random instant within the next unit's work --
    # before, during or after its data, its commit record or its fsyncs. (A kill between a unit's data and its
    # record is made for sure in test_torn_tails_are_truncated_and_final_bytes_match_clean_run.)
    units, size = 300, 200_000
    started = time.monotonic()
    clean = _run_writer(tmp_path / "clean", units, size)
    assert clean.wait() == 0, clean.stderr.read().decode()
    seconds_per_unit = (time.monotonic() - started) / units
    rng = random.Random(1234)
    targets = [20 * k + rng.randrange(10) for k in range(1, 13)]  # units 20..249, at least 10 apart
    progress = [-1]
    for target in targets:
        proc = _run_writer(tmp_path / "killed", units, size, (target, rng.uniform(0, seconds_per_unit)))
        assert proc.wait() == -signal.SIGKILL, proc.stderr.read().decode()
        records, _ = read_commits(tmp_path / "killed")
        progress.append(records[-1]["unit"] if records else -1)
        assert target <= progress[-1] < units - 1, progress  # killed after its target, before the end
    proc = _run_writer(tmp_path / "killed", units, size)
    assert proc.wait() == 0, proc.stderr.read().decode()
    assert len(set(progress)) > len(targets), f"kills did not land at different points: {progress}"
    for name in ("tokens.bin", "tokens.idx", "provenance.jsonl", "items.ids", "items.jsonl"):
        assert sha256_file(tmp_path / "killed" / name) == sha256_file(tmp_path / "clean" / name), name
    done = [json.loads((tmp_path / run / "DONE").read_text()) for run in ("killed", "clean")]
    assert done[0] == done[1]
    records, ids = read_items(tmp_path / "killed")
    assert [(r["document"], r["image_index"]) for r in records] == [(u, k) for u in range(units) for k in range(u % 3)]
    assert sum(r["length"] for r in records) == ids.size
