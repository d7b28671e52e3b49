"""The input containers: one rule for what a file is, one JSON Lines reader, one JSON parser of untrusted
text, and a tar member's bytes checked before they are copied (`mmtok.formats.containers`, `formats.tar`)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from encodekit import chat_tokenizer, real_images, write_tar
from mmtok.audio.sources import parquet as parquet_source
from mmtok.audio.sources.lhotse import lhotse_units
from mmtok.audio.sources.parquet import table_units
from mmtok.audio.sources.units import decode_audio
from mmtok.documents import DocumentBuilder, DocumentError, Sidecars
from mmtok.errors import Skip
from mmtok.formats import containers
from mmtok.formats.conversations import input_kind, read_conversations
from mmtok.formats.manifest import Manifest
from mmtok.formats.tar import MemberTruncated, open_range
from mmtok.media.audio import AudioReason, decode_bytes
from mmtok.scan.scanner import ScanOptions, describe, document_order, run_scan
from mmtok.sft.pack import pack_conversation
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout


def _container_files(tmp_path: Path) -> dict[str, tuple[Path, list]]:
    """A file of each container holding records a0..a5, and what `where` each record must have."""
    values = [{"id": f"a{n}", "n": n} for n in range(6)]
    pq.write_table(pa.Table.from_pylist(values), tmp_path / "t.parquet", row_group_size=4)
    with pa.ipc.new_file(str(tmp_path / "t.arrow"), pa.Table.from_pylist(values).schema) as sink:
        for first in (0, 2, 5):  # record batches of 2, 3, 1 rows
            sink.write_table(pa.Table.from_pylist(values[first:{0: 2, 2: 5, 5: 6}[first]]))
    lines = "".join(json.dumps(v) + "\n" + ("\n" if v["n"] == 2 else "") for v in values)  # a blank line: no record
    (tmp_path / "t.jsonl").write_text(lines)
    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as handle:
        handle.write(lines)
    tar = write_tar(tmp_path / "t.tar", [(f"{v['id']}.json", json.dumps(v).encode()) for v in values])
    line_where = [f"line {n}" for n in (1, 2, 3, 5, 6, 7)]
    return {"table": (tmp_path / "t.parquet", [f"row {n}" for n in range(6)]),
            "arrow": (tmp_path / "t.arrow", [f"row {n}" for n in range(6)]),
            "jsonl": (tmp_path / "t.jsonl", line_where), "jsonl.gz": (tmp_path / "t.jsonl.gz", line_where),
            "tar": (tar, [f"a{n}" for n in range(6)])}


@pytest.mark.parametrize("kind", ["table", "arrow", "jsonl", "jsonl.gz", "tar"])
def test_every_container_gives_its_records_in_order_through_one_interface_and_resumes_at_any(tmp_path, kind):
    """One `Container.records` per container: records numbered from 0 in the file's order, each saying where it is;
    a reader started at any record (`Start`, with the line offset a JSON Lines record names) gives the same tail."""
    from mmtok.formats.readers import reader

    path, where = _container_files(tmp_path)[kind]
    name = containers.container_named(path) if kind != "arrow" else containers.ARROW
    container = reader(containers.TABLE if name == containers.PARQUET else name)
    records = list(container.records(path))
    assert [r.number for r in records] == list(range(6)) and [r.where for r in records] == where
    if kind == "tar":
        members = [[(m.name, m.size) for m in r.value.members] for r in records]
        sizes = [len(json.dumps({"id": f"a{n}", "n": n})) for n in range(6)]
        assert members == [[(f"a{n}.json", size)] for n, size in enumerate(sizes)]
        assert not any(r.value.repeated for r in records)
    else:
        assert [r.value["id"] for r in records] == [f"a{n}" for n in range(6)]
    for first in range(7):
        at = records[first] if first < 6 else None
        start = containers.Start(first, *(at.seek if at is not None and kind.startswith("jsonl") else (-1, 0)))
        assert list(container.records(path, start)) == records[first:]


def test_a_damaged_table_or_line_is_named_by_the_container_reader(tmp_path):
    from mmtok.formats.readers import reader
    from mmtok.formats.tables import UNREADABLE_TABLE

    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not a table PAR1")
    with pytest.raises(Skip) as damaged:
        list(reader(containers.TABLE).records(tmp_path / "bad.parquet"))
    assert damaged.value.reason == UNREADABLE_TABLE
    (tmp_path / "t.jsonl").write_bytes(b'{"a": 1}\n[1, \n"\\ud800"\n')
    records = list(reader(containers.JSONL).records(tmp_path / "t.jsonl"))
    assert [(r.value, r.error.reason if r.error else None) for r in records] == [
        ({"a": 1}, None), (None, "invalid_json"), (None, "invalid_json")]
    assert records[1].error.detail.startswith("line 2: ") and "lone surrogate" in records[2].error.detail


def test_every_stage_tells_a_files_container_by_content_and_by_name_the_same_way(tmp_path):
    table = pa.table({"image": [b"x"]})
    pq.write_table(table, tmp_path / "t.bin")
    with pa.ipc.new_file(tmp_path / "a.bin", table.schema) as writer:
        writer.write_table(table)
    with pa.ipc.new_stream(tmp_path / "s.bin", table.schema) as writer:
        writer.write_table(table)
    write_tar(tmp_path / "w.bin", [("k.txt", b"hi")])
    found = {name: containers.container_of(str(tmp_path / name)) for name in ("t.bin", "a.bin", "s.bin", "w.bin")}
    assert found == {"t.bin": "parquet", "a.bin": "arrow", "s.bin": "arrow", "w.bin": "tar"}  # content, not name
    assert [containers.manifest_container(kind) for kind in found.values()] == ["parquet", "parquet", "parquet", "tar"]
    named = {name: containers.container_named(Path(name))
             for name in ("x.TAR", "x.parquet", "x.arrow", "x.jsonl", "x.JSONL.GZ", "x.json", "x")}
    assert named == {"x.TAR": "tar", "x.parquet": "parquet", "x.arrow": "arrow", "x.jsonl": "jsonl",
                     "x.JSONL.GZ": "jsonl", "x.json": None, "x": None}
    assert input_kind(Path("c.jsonl")) == "jsonl"
    with pytest.raises(Exception, match="not a conversation input"):
        input_kind(Path("c.jsonl.gz"))  # a conversation is resumed at a byte offset: plain text only


def test_json_lines_give_the_same_lines_plain_and_gzipped_and_resume_at_a_lines_offset(tmp_path):
    text = b'{"a": 1}\n\n  \n{"b": 2}\r\n{"c": 3}'
    (tmp_path / "m.jsonl").write_bytes(text)
    (tmp_path / "m.jsonl.gz").write_bytes(gzip.compress(text))
    plain = list(containers.json_lines(tmp_path / "m.jsonl"))
    assert [(n, at) for n, at, _ in plain] == [(1, 0), (4, 13), (5, 23)]  # blank lines hold no record
    assert all(text[at:].startswith(raw) for _, at, raw in plain)
    assert list(containers.json_lines(tmp_path / "m.jsonl.gz")) == plain
    assert list(containers.json_lines(tmp_path / "m.jsonl", 13, 4)) == plain[1:]


RAW_SURROGATE = (b'{"messages": [{"role": "user", "content": "lone \xed\xa0\x80"}, '
                 b'{"role": "assistant", "content": "x"}]}')


def test_a_lone_surrogate_as_raw_bytes_is_invalid_json_in_every_reader(tmp_path):
    # json.loads decodes bytes with "surrogatepass": ED A0 80 (U+D800 as UTF-8 would encode it) gets through
    assert json.loads(RAW_SURROGATE)["messages"][0]["content"].endswith("\ud800")
    value, skip = containers.json_value(RAW_SURROGATE, "line 1")
    assert value is None and skip.reason == "invalid_json" and "lone surrogate" in skip.detail
    assert containers.json_value('{"a": "\\ud800"}', "cell")[1].reason == "invalid_json"  # escaped, in a str
    assert containers.json_value(b'{"a": "\\ud83d\\ude00 \xf0\x9f\x98\x80"}', "line")[1] is None  # pairs are text
    for encoding in ("utf-16", "utf-16-le", "utf-32"):  # JSON json.loads also takes: its text is checked the same
        assert containers.json_value('{"a": "\\ud800"}'.encode(encoding), "m")[1].reason == "invalid_json"
        assert containers.json_value('{"a": "lone \ud800"}'.encode(encoding, "surrogatepass"), "m")[1] is not None
        assert containers.json_value('{"a": "hi \U0001F600"}'.encode(encoding), "m") == ({"a": "hi \U0001F600"}, None)
    conversations = tmp_path / "c.jsonl"
    conversations.write_bytes(RAW_SURROGATE + b"\n")
    (conversation,) = read_conversations([conversations])
    assert conversation.error.reason == "invalid_json"
    manifest = tmp_path / "recordings.jsonl"
    recording = {"id": "r\xed\xa0\x80", "sources": [{"type": "file", "source": "a.wav", "channels": [0]}],
                 "sampling_rate": 16000, "num_samples": 16000, "duration": 1.0}
    manifest.write_bytes(json.dumps(recording).replace("\\u00ed\\u00a0\\u0080", "\xed\xa0\x80").encode("latin-1"))
    units, dropped = lhotse_units([manifest])
    assert not units and [(d.reason, d.key) for d in dropped] == [("bad_manifest_row", "recordings.jsonl:1")]


def test_pack_skips_a_medium_whose_tar_was_cut_after_its_members_were_listed(tmp_path):
    image = real_images()["horse.png"].read_bytes()
    record = {"messages": [{"role": "user", "content": "<image> What animal is this?"},
                           {"role": "assistant", "content": "A horse."}]}
    tar = write_tar(tmp_path / "chats.tar", [("s0.json", json.dumps(record).encode()), ("s0.png", image)])
    with tarfile.open(tar) as archive:
        start = archive.getmember("s0.png").offset_data
    (conversation,) = read_conversations([tar])  # its members listed while the tar was whole
    with open(tar, "r+b") as handle:
        handle.truncate(start + 100)
    with pytest.raises(Skip) as skipped:
        pack_conversation(conversation, "000000000")
    assert skipped.value.reason == "truncated_member" and f"({100:,} of {len(image):,} bytes)" in skipped.value.detail
    with pytest.raises(MemberTruncated):
        open_range(tar, start, len(image))
    with open_range(tar, start, 100) as handle:
        assert handle.read() == image[:100]
    with open_range(tar, start + 1000, 0) as handle:  # nothing to copy: no byte is missing, wherever it is
        assert handle.read(1) == b""


def test_a_parquet_conversation_input_is_opened_once_whatever_its_row_groups(tmp_path, monkeypatch):
    # One footer parse a file: opening it per row group cost 100x at 5,000 groups (the footer grows with them).
    path = tmp_path / "c.parquet"
    turns = [[{"role": "user", "content": f"q{n}"}, {"role": "assistant", "content": "a"}] for n in range(40)]
    rows = [json.dumps(messages) for messages in turns]
    pq.write_table(pa.table({"messages": rows}), path, row_group_size=4)
    opened = []
    real = pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    conversations = list(read_conversations([path]))
    assert [c.record["messages"][0]["content"] for c in conversations] == [f"q{n}" for n in range(40)]
    assert len(opened) == 1


def test_a_conversation_parquet_input_is_parquet_by_its_name_and_needs_messages_even_empty(tmp_path):
    """A .parquet input is read as Parquet, whatever its first bytes (an Arrow file so named would be memory-mapped:
    a SIGBUS if cut while read), and a table without `messages` is refused before any row, an empty one too."""
    from mmtok.errors import MmtokError

    table = pa.table({"messages": ['[{"role": "user", "content": "q"}]']})
    with pa.ipc.new_file(str(tmp_path / "arrow.parquet"), table.schema) as sink:
        sink.write_table(table)
    with pytest.raises(MmtokError, match=r"arrow\.parquet: unreadable Parquet \(.*magic bytes"):
        list(read_conversations([tmp_path / "arrow.parquet"]))
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(MmtokError, match=r"empty\.parquet: no `messages` column \(columns: \['text'\]\)"):
        list(read_conversations([tmp_path / "empty.parquet"]))


def test_an_audio_table_is_opened_once_for_its_row_groups_and_again_once_it_changed(tmp_path, monkeypatch):
    # A unit per row group, each read by whichever convert process is free: reopened per unit, the footer (which
    # grows with the row groups) was parsed once per row group -- 49 s at 5,000 of them.
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"audio": [b"not audio %d" % n for n in range(10)]}), path, row_group_size=1)
    units, _ = table_units(path, "audio", "text")
    opened, real = [], pq.ParquetFile
    monkeypatch.setattr(pq, "ParquetFile", lambda *a, **k: opened.append(a[0]) or real(*a, **k))
    parquet_source._opened.cache_clear()
    payloads = [[payload for payload, _ in unit.payloads()] for unit in units]
    assert len(payloads) == 10 and all(len(found) == 1 for found in payloads) and len(opened) == 1
    pq.write_table(pa.table({"audio": [b"x"] * 20}), path, row_group_size=2)  # rewritten: 2 rows a group
    skips = [record for record in units[3].payloads()]
    assert len(opened) == 2 and skips[0].reason == "unreadable_row_group" and "changed during the run" in \
        skips[0].detail
    stamp, before = parquet_source._stamp(str(path)), path.stat()
    time.sleep(0.05)  # past the file system's clock tick (ctime is coarse)
    path.write_bytes(path.read_bytes())  # rewritten in place, the same size, its mtime set back (rsync -t --inplace)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert parquet_source._stamp(str(path)) != stamp  # (its ctime: a file changed is never taken for the one cached)


def test_a_parquet_input_cut_short_while_it_is_read_is_an_error_not_a_crash(tmp_path):
    # Kept open for the whole input (one footer parse), a memory-mapped file cut short kills the process (SIGBUS):
    # the read runs in a child so that this test reports it instead of dying with it.
    path = tmp_path / "c.parquet"
    turns = [[{"role": "user", "content": f"q{n:04d}" * 50}, {"role": "assistant", "content": "a"}] for n in range(400)]
    pq.write_table(pa.table({"messages": [json.dumps(t) for t in turns]}), path, row_group_size=20, compression="none")
    script = ("import os, sys\nfrom pathlib import Path\nfrom mmtok.formats.conversations import read_conversations\n"
              f"path = Path({str(path)!r})\nrecords = read_conversations([path])\nnext(records)\n"
              "os.truncate(path, path.stat().st_size // 4)\n"
              "try:\n    sum(1 for _ in records)\nexcept Exception as err:\n    print(type(err).__name__, err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("MmtokError") and "is unreadable" in done.stdout


def test_a_parquet_image_input_cut_short_while_encode_reads_it_is_a_short_read_not_a_crash(tmp_path):
    # encode's loader threads read image cells through MemberReader; a memory-mapped file cut short under them
    # killed the whole encode with SIGBUS. The read runs in a child so that this test reports a crash, not dies of it.
    path = tmp_path / "images.parquet"
    jpeg = real_images()["rocket.jpg"].read_bytes()
    pq.write_table(pa.table({"jpg": [jpeg] * 400, "txt": [f"caption {n}" for n in range(400)]}), path,
                   row_group_size=50, compression="none")
    script = ("import os\nfrom mmtok.formats.manifest import MemberReader, ShortRead\n"
              f"path = {str(path)!r}\nreader = MemberReader()\n"
              "assert reader.read_member('parquet', path, 'jpg', 0, 0)[:2] == b'\\xff\\xd8'\n"
              "os.truncate(path, os.path.getsize(path) // 3)\n"
              "try:\n    reader.read_member('parquet', path, 'jpg', 350, 0)\nexcept ShortRead as err:\n"
              "    print('ShortRead', err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parent.parent)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert done.stdout.startswith("ShortRead")


def test_a_table_cell_that_no_longer_decodes_is_a_short_read_not_a_crash(tmp_path, monkeypatch):
    # A table changed in place after the scan: pyarrow may say so with ArrowInvalid (a ValueError, "Index not in
    # dictionary bounds"), which escaped the loader thread and stopped the encode.
    from mmtok.formats import tables
    from mmtok.formats.manifest import MemberReader, ShortRead

    path = tmp_path / "images.parquet"
    pq.write_table(pa.table({"jpg": [b"\xff\xd8 not read"] * 4, "txt": ["a caption"] * 4}), path)

    def damaged(self, column, row):
        raise pa.ArrowInvalid("Index not in dictionary bounds")

    monkeypatch.setattr(tables.TableRows, "_cell", damaged)
    reader = MemberReader()
    with pytest.raises(ShortRead, match="dictionary bounds"):
        reader.read_member("parquet", str(path), "jpg", 1, 0)
    with pytest.raises(ShortRead, match="dictionary bounds"):
        reader.read_text("parquet", str(path), 1, 100, "txt")


def test_an_arrow_stream_of_many_batches_reads_every_cell_through_table_rows(tmp_path):
    # Record batches of 3, 0, 5, 1 and 4 rows (save_to_disk writes the stream format): each cell from its batch.
    from mmtok.formats.tables import TableRows

    path, sizes = tmp_path / "data-00000-of-00001.arrow", [3, 0, 5, 1, 4]
    schema = pa.schema([("jpg", pa.binary()), ("txt", pa.string())])
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        row = 0
        for size in sizes:
            writer.write_batch(pa.record_batch([[b"image %d" % (row + i) for i in range(size)],
                                                [f"text {row + i}" for i in range(size)]], schema=schema))
            row += size
    rows = TableRows(str(path))
    assert [rows.image_bytes("jpg", n) for n in range(row)] == [b"image %d" % n for n in range(row)]
    assert [rows.text_bytes("txt", n, 6) for n in reversed(range(row))] == [f"text {n}".encode()[:6]
                                                                           for n in reversed(range(row))]
    with pytest.raises(OSError, match="past the end"):
        rows.image_bytes("jpg", row)


def test_a_decode_error_says_the_same_words_on_every_run():
    # libsndfile names an in-memory file by its address: a skip record that held it would differ run to run
    details = set()
    for _ in range(3):
        with pytest.raises(AudioReason) as caught:
            decode_bytes(b"RIFF not really a wave file")
        details.add(caught.value.detail)
        with pytest.raises(AudioReason) as caught:
            decode_audio(b"junk", "x.wav")
        details.add(caught.value.detail)
    assert len(details) == 2 and not any(" at 0x" in detail for detail in details), details


def test_a_damaged_table_file_is_an_unreadable_parquet_input_of_the_scan(tmp_path):
    # pyarrow says a footer is damaged with ArrowInvalid, a ValueError: once taken for a bug (`scan_failed`) in a tar
    table = tmp_path / "t.parquet"
    pq.write_table(pa.table({"image": [b"x" * 100] * 10}), table)
    data = table.read_bytes()
    table.write_bytes(data[: len(data) // 2] + b"PAR1")  # the footer's length now points past the file's start
    scanned = run_scan([describe(str(table))], tmp_path / "out", ScanOptions(), workers=1, progress=False)
    rows = Manifest.open(tmp_path / "out").read(columns=["container", "reason"]).to_pylist()
    assert rows == [{"container": "parquet", "reason": "unreadable_shard"}]
    assert "ArrowInvalid" in scanned.first_errors["unreadable_shard"].detail
    [record] = Manifest.open(tmp_path / "out").skip_records()
    assert (record.reason, record.source, record.container) == ("unreadable_shard", str(table), "parquet")
    assert "ArrowInvalid" in record.detail


def test_an_interleaved_json_sidecar_too_deep_for_the_parser_is_invalid_json_not_a_crash(tmp_path):
    # json.loads raises RecursionError there, which a loader thread did not catch: the encode stopped
    tokenizer = load_text_tokenizer(str(chat_tokenizer(tmp_path / "tok")))
    builder = DocumentBuilder("interleaved", tokenizer, VocabLayout(text_size=tokenizer.vocab_size))
    for sidecar in (b"[" * 100_000 + b"]" * 100_000, b'{"texts": ["lone \xed\xa0\x80"], "images": [null]}'):
        with pytest.raises(DocumentError) as caught:
            builder.template(1, Sidecars(text=None, json=sidecar))
        assert caught.value.reason == "invalid_json" and caught.value.detail.startswith("json sidecar: ")


def test_a_json_sidecar_too_deep_for_the_parser_costs_the_scan_its_order_not_the_shard():
    # RecursionError escaped document_order, and the whole shard became one scan_failed row
    ignored = Counter()
    order = document_order(["k.1.jpg", "k.0.jpg"], "k", b"[" * 100_000 + b"]" * 100_000, ignored)
    assert order == [1, 0] and ignored == {"(unreadable json sidecar)": 1}
