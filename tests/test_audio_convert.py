"""`mmtok audio convert`: every source kind -> Lhotse Shar that lhotse reads back, with exact audio,
text tokens and drop reasons; deterministic and restartable."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from audio_corpus import (
    DIGITS,
    PLANTED,
    STORY,
    build_directory_corpus,
    digit,
    read,
    write_audio_by_content,
    write_jsonl,
    write_story,
)
from convertkit import assert_counts_add_up, dropped_records, encoded, load_cuts, make_tar, report, stored_bytes
from mmtok.audio import convert as convert_module
from mmtok.audio.convert import ConvertOptions, convert
from mmtok.audio.sources import parquet as parquet_source
from mmtok.audio.sources.units import number_clips
from mmtok.cli import main as cli_main
from mmtok.media.audio import resample, to_mono
from mmtok.text import load_text_tokenizer
from summaries import summary_lines

LSB24 = 2.0**-23  # one step of 24-bit PCM


@pytest.fixture(scope="module")
def tokenizer():
    return load_text_tokenizer("tekken")


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_directory_corpus(tmp_path_factory.mktemp("corpus") / "audio")


@pytest.fixture(scope="module")
def converted(corpus, tmp_path_factory):
    root, table, _ = corpus
    out = tmp_path_factory.mktemp("converted")
    code = cli_main(["audio", "convert", str(root), "--transcripts", str(table), "--out", str(out),
                     "--max-duration", "6", "--shard-size", "4", "--workers", "2"])
    assert code == 0
    return out


def expected_wave(path: Path, start: float | None = None, end: float | None = None) -> np.ndarray:
    samples, rate = read(path)
    mono = to_mono(samples)
    if start is not None:
        mono = mono[int(round(start * rate)): int(round(end * rate))]
    return resample(mono, rate)


def assert_same_audio(stored: np.ndarray, expected: np.ndarray) -> None:
    assert stored.shape == expected.shape
    assert np.max(np.abs(stored - expected)) <= LSB24


def test_directory_source_reads_back_with_lhotse_at_24khz_with_text_tokens(corpus, converted, tokenizer):
    root, _, expected = corpus
    cuts = {cut.id: cut for cut in load_cuts(converted)}
    assert set(cuts) == set(expected)
    for cut_id, want in expected.items():
        cut = cuts[cut_id]
        assert cut.sampling_rate == 24_000 and cut.recording.sampling_rate == 24_000
        assert cut.custom["original_sampling_rate"] == want["rate"]
        assert (cut.custom["source_id"], cut.custom["clip"]) == (want["source_id"], want["clip"])
        assert cut.custom.get("language") == want.get("language")
        assert cut.custom.get("target_language") == want.get("target_language")
        if want["text"] is None:
            assert "text_tokens" not in cut.custom and not cut.supervisions
        else:
            assert cut.custom["text_tokens"] == tokenizer.encode(want["text"])
            assert cut.supervisions[0].text == want["text"]
        source = next(root.rglob(cut_id + ".*"))
        assert_same_audio(cut.load_audio()[0], expected_wave(source))


def test_invalid_clips_are_dropped_with_their_reasons(converted):
    counts = report(converted)["counts"]
    assert {k: v for k, v in counts.items() if k.startswith("skipped:")} == {
        f"skipped:{reason}": 1 for reason in PLANTED.values()}
    dropped = dropped_records(converted)
    assert {d["stage"] for d in dropped} == {"convert"}
    assert sorted((d["key"], d["reason"]) for d in dropped) == sorted(
        (f"bad/{name.removesuffix('.wav')}", reason) for name, reason in PLANTED.items())


def test_shards_hold_the_configured_number_of_cuts_in_input_order(converted):
    shards = report(converted)["shards"]
    sizes = [s["cuts"] for s in shards]
    assert sizes[:-1] == [4] * (len(sizes) - 1) and 0 < sizes[-1] <= 4
    ids = [cut.id for cut in load_cuts(converted)]
    assert ids == sorted(ids)  # directory units follow sorted relative paths


def test_output_is_identical_with_and_without_worker_processes(corpus, converted, tmp_path):
    root, table, _ = corpus
    options = ConvertOptions(max_duration=6.0, shard_size=4)
    convert([root], tmp_path, options, transcripts=table, workers=0, progress=False)
    assert stored_bytes(tmp_path) == stored_bytes(converted)


def test_killed_conversion_resumes_without_redoing_finished_shards(corpus, converted, tmp_path, monkeypatch):
    root, table, _ = corpus
    options = ConvertOptions(max_duration=6.0, shard_size=4)
    real_write = convert_module.write_shar_shard
    written = []

    def dying_write(out, index, clips):
        if len(written) == 2:
            raise KeyboardInterrupt  # a kill between shards
        written.append(index)
        return real_write(out, index, clips)

    monkeypatch.setattr(convert_module, "write_shar_shard", dying_write)
    with pytest.raises(KeyboardInterrupt):
        convert([root], tmp_path, options, transcripts=table, workers=0, progress=False)
    assert not report(tmp_path)["complete"] and len(report(tmp_path)["shards"]) == 2
    first = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "shar").iterdir()}
    redone = []
    monkeypatch.setattr(convert_module, "write_shar_shard", lambda out, index, clips: redone.append(index) or
                        real_write(out, index, clips))
    convert([root], tmp_path, options, transcripts=table, workers=0, progress=False)
    assert redone and min(redone) == 2
    assert all((tmp_path / "shar" / name).stat().st_mtime_ns == mtime for name, mtime in first.items())
    assert stored_bytes(tmp_path) == stored_bytes(converted)
    assert report(tmp_path)["counts"] == report(converted)["counts"]


def test_resume_with_other_settings_is_refused(corpus, tmp_path, capsys):
    root, table, _ = corpus
    convert([root / "story"], tmp_path, ConvertOptions(shard_size=2), workers=0, progress=False)
    code = cli_main(["audio", "convert", str(root / "story"), "--out", str(tmp_path), "--shard-size", "3"])
    err = capsys.readouterr().err
    assert code == 2 and "refusing to resume" in err and "options.shard_size" in err
    assert report(tmp_path)["identity"]["options"]["shard_size"] == 2


def test_clipping_source_is_stored_below_full_scale_with_its_gain(tmp_path):
    loud, rate = read(digit("3"))
    loud = loud / np.max(np.abs(loud)) * 1.5  # a float source over full scale
    (tmp_path / "in").mkdir()
    soundfile.write(tmp_path / "in" / "loud.wav", loud.astype(np.float32), rate, subtype="FLOAT")
    convert([tmp_path / "in"], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    (cut,) = load_cuts(tmp_path / "out")
    with tarfile.open(tmp_path / "out" / "shar" / "recording.000000.tar") as archive:
        assert soundfile.info(io.BytesIO(archive.extractfile("loud.flac").read())).subtype == "PCM_24"
    gain = cut.custom["gain"]
    expected = resample(loud.astype(np.float32), rate) * np.float32(gain)
    assert gain < 1 / 1.5 and np.max(np.abs(expected)) < 1.0
    assert_same_audio(cut.load_audio()[0], expected)


def test_webdataset_tar_source_with_txt_and_json_sidecars(tmp_path, tokenizer):
    meta = {"text": "seven", "recording_id": "call-1", "clip": 4, "language": "en"}
    tar = make_tar(tmp_path / "calls.tar", [
        ("s1.flac", encoded(digit("6"))), ("s1.txt", b"six\n"),
        ("s2.wav", encoded(digit("7"), "WAV")), ("s2.json", json.dumps(meta).encode()),
        ("s3.txt", b"no audio here"),
        ("s4.wav", b"not audio at all"),
    ])
    convert([tar], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    cuts = {cut.id: cut for cut in load_cuts(tmp_path / "out")}
    assert list(cuts) == ["calls/s1", "calls/s2"]
    assert cuts["calls/s1"].custom["text_tokens"] == tokenizer.encode("six")
    assert (cuts["calls/s1"].custom["source_id"], cuts["calls/s1"].custom["clip"]) == ("calls/s1", 0)
    two = cuts["calls/s2"].custom
    assert (two["text_tokens"], two["source_id"], two["clip"], two["language"]) == (
        tokenizer.encode("seven"), "call-1", 4, "en")
    assert_same_audio(cuts["calls/s2"].load_audio()[0], expected_wave(digit("7")))
    assert report(tmp_path / "out")["counts"] == {"skipped:decode_error": 1, "skipped:no_audio_member": 1, "written": 2,
                                                  "in": 4}


def test_truncated_tar_keeps_the_samples_before_the_damage(tmp_path):
    full = make_tar(tmp_path / "full.tar", [("a.flac", encoded(digit("1"))), ("b.flac", encoded(digit("2")))])
    data = full.read_bytes()
    cut_at = data.index(b"fLaC", data.index(b"b.flac")) + 100  # inside member b's data
    (tmp_path / "damaged.tar").write_bytes(data[:cut_at])
    convert([tmp_path / "damaged.tar"], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    assert [cut.id for cut in load_cuts(tmp_path / "out")] == ["damaged/a"]
    dropped = {k: v for k, v in report(tmp_path / "out")["counts"].items() if k.startswith("skipped:")}
    assert dropped.get("skipped:truncated_member", 0) + dropped.get("skipped:truncated_tar", 0) >= 1


def test_lhotse_manifests_cut_supervised_segments_in_start_order(tmp_path, tokenizer):
    from lhotse import Recording

    pieces = [read(tmp_path / name)[0] for name, _ in write_story(tmp_path)]
    rate = 22_050
    gap = np.zeros(rate // 2, np.float32)  # half a second of digital silence between sentences
    audio = np.concatenate([pieces[0], gap, pieces[1], gap, gap, pieces[2], gap, pieces[3]])
    soundfile.write(tmp_path / "story.wav", audio, rate, subtype="FLOAT")
    starts, position = [], 0
    for piece, after in zip(pieces, [1, 2, 1, 0], strict=True):
        starts.append((position / rate, (position + len(piece)) / rate))
        position += len(piece) + after * len(gap)
    silence_start = (len(pieces[0]) + len(gap) + len(pieces[1])) / rate
    segments = [(s, e, STORY[i]) for i, (s, e) in enumerate(starts)]
    segments.insert(2, (silence_start, silence_start + 0.9, "nothing"))  # a silent supervision -> gap
    sups = [{"id": f"sup{i}", "recording_id": "story", "start": s, "duration": e - s, "channel": 0, "text": t,
             "language": "en"} for i, (s, e, t) in enumerate(segments)]
    recordings = [Recording.from_file(tmp_path / "story.wav", recording_id="story").to_dict(),
                  Recording.from_file(digit("8"), recording_id="eight").to_dict()]
    write_jsonl(tmp_path / "recordings.jsonl", recordings)
    write_jsonl(tmp_path / "supervisions.jsonl", list(reversed(sups)))  # manifest order must not matter
    convert([tmp_path / "recordings.jsonl", tmp_path / "supervisions.jsonl"], tmp_path / "out", ConvertOptions(),
            workers=0, progress=False)
    cuts = load_cuts(tmp_path / "out")
    assert [c.id for c in cuts] == ["sup0", "sup1", "sup3", "sup4", "eight"]
    assert [c.custom["clip"] for c in cuts[:4]] == [0, 1, 3, 4]  # the silent clip 2 leaves a gap
    assert {c.custom["source_id"] for c in cuts[:4]} == {"story"}
    for cut, (start, end, text) in zip(cuts[:4], [segments[i] for i in (0, 1, 3, 4)], strict=True):
        assert cut.custom["text_tokens"] == tokenizer.encode(text)
        assert_same_audio(cut.load_audio()[0], expected_wave(tmp_path / "story.wav", start, end))
    assert report(tmp_path / "out")["counts"] == {"skipped:silent": 1, "written": 5, "in": 6}


def test_parquet_source_with_audio_bytes_column(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"audio": {"bytes": encoded(digit(k)), "path": f"{k}.flac"}, "text": word, "recording_id": "count",
             "start": float(i)} for i, (k, word) in enumerate([("2", "two"), ("1", "one"), ("3", "three")])]
    rows.append({"audio": {"bytes": b"\x00" * 64, "path": "x.flac"}, "text": "junk", "recording_id": "junk",
                 "start": 0.0})
    rows.append({"audio": None, "text": "missing", "recording_id": "none", "start": 0.0})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "speech.parquet", row_group_size=2)
    convert([tmp_path / "speech.parquet"], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    assert parquet_source._opened.cache_info().currsize == 0  # in process: no table file is left open after it
    cuts = load_cuts(tmp_path / "out")
    assert [c.id for c in cuts] == ["speech/00000000", "speech/00000001", "speech/00000002"]
    assert [c.custom["clip"] for c in cuts] == [0, 1, 2]  # numbered by start within the recording
    assert [c.custom["text_tokens"] for c in cuts] == [tokenizer.encode(w) for w in ("two", "one", "three")]
    assert_same_audio(cuts[1].load_audio()[0], expected_wave(digit("1")))
    assert report(tmp_path / "out")["counts"] == {"skipped:decode_error": 1, "skipped:no_audio_bytes": 1,
                                                  "written": 3, "in": 5}


def test_clip_numbers_prefer_explicit_numbers_then_start_times():
    records = [{"recording_id": "a", "start": 5.0}, {"recording_id": "a", "start": 1.0},
               {"recording_id": "b", "clip": 7}, {"recording_id": "a", "start": 3.0}, {"recording_id": "b"}]
    assert number_clips(records) == [2, 0, 7, 1, 0]


def test_table_rows_for_missing_files_and_without_paths_are_counted(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.wav").write_bytes(digit("1").read_bytes())
    table = tmp_path / "t.jsonl"
    write_jsonl(table, [{"path": "one.wav", "text": "one"}, {"path": "gone.wav", "text": "gone"}, {"text": "x"}])
    convert([tmp_path / "in"], tmp_path / "out", ConvertOptions(), transcripts=table, workers=0, progress=False)
    assert report(tmp_path / "out")["counts"] == {"skipped:bad_table_row": 1, "skipped:missing_file": 1,
                                                  "written": 1, "in": 3}


# --- trust under real operating conditions (issue 12) ---------------------------------------------

def test_audio_files_are_recognised_by_content_not_by_extension(tmp_path, tokenizer):
    words, ignored = write_audio_by_content(tmp_path / "in")
    table = write_jsonl(tmp_path / "t.jsonl", [{"path": "one.oga", "text": "one"}])
    convert([tmp_path / "in"], tmp_path / "out", ConvertOptions(), transcripts=table, workers=0, progress=False)
    cuts = {cut.id: cut for cut in load_cuts(tmp_path / "out")}
    assert sorted(cuts) == sorted(name.split(".")[0] for name in words)
    assert cuts["one"].custom["text_tokens"] == tokenizer.encode("one")  # named by the table, not missing_file
    for name in words:
        assert_same_audio(cuts[name.split(".")[0]].load_audio()[0], expected_wave(tmp_path / "in" / name))
    counts = report(tmp_path / "out")["counts"]
    assert counts == {"in": len(words) + sum(ignored.values()), "written": len(words),
                      **{f"ignored:{ext}": n for ext, n in ignored.items()}}


TSV_TABLE = [  # (line, is it a good row); line 7 is blank
    (b"path\ttext\tclip\tstart", None),
    (b"one.wav\tone\t\t", True),
    (b"one.wav\t\xff\xfe latin-1 bytes \xe9\t\t", False),
    (b"two.wav\ttwo\t\t", True),
    (b"two.wav\ttwo\tabc\t", False),
    (b"two.wav\ttwo", False),
    (b"", None),
    (b"three.wav\tthree\t\tnan", False),
    (b"three.wav\tthree\t\t", True),
]
JSONL_TABLE = [
    (b'{"path": "one.wav", "text": "one"}', True),
    (b'{"path": "one.wav", "text": "\xff"}', False),
    (b'{"path": "two.wav", "text": "two"}', True),
    (b'{"path": "two.wav", "clip": "abc"}', False),
    (b'{"path": "two.wav", "text": ', False),
    (b'["two.wav", "two"]', False),
    (b'{"path": 7, "text": "seven"}', False),
    (b'{"path": "three.wav", "start": -1}', False),
    (b'{"path": "three.wav", "text": "three"}', True),
]


@pytest.mark.parametrize("suffix, lines", [(".tsv", TSV_TABLE), (".jsonl", JSONL_TABLE)])
def test_bad_transcript_rows_are_counted_by_file_and_line_and_the_rest_convert(tmp_path, tokenizer, suffix, lines):
    (tmp_path / "in").mkdir()
    for key, word in (("1", "one"), ("2", "two"), ("3", "three")):
        (tmp_path / "in" / f"{word}.wav").write_bytes(digit(key).read_bytes())
    table = tmp_path / f"t{suffix}"
    table.write_bytes(b"\n".join(line for line, _ in lines) + b"\n")
    convert([tmp_path / "in"], tmp_path / "out", ConvertOptions(), transcripts=table, workers=0, progress=False)
    cuts = load_cuts(tmp_path / "out")
    words = ("one", "three", "two")  # sorted by file name
    assert [(c.id, c.custom["text_tokens"]) for c in cuts] == [(w, tokenizer.encode(w)) for w in words]
    bad = [number for number, (_, good) in enumerate(lines, 1) if good is False]
    assert sorted((d["source"], d["reason"]) for d in dropped_records(tmp_path / "out")) == sorted(
        (f"{table}:{n}", "bad_table_row") for n in bad)
    assert report(tmp_path / "out")["counts"] == {"in": 3 + len(bad), "written": 3, "skipped:bad_table_row": len(bad)}


def test_tsv_table_without_a_path_column_is_refused_naming_the_file(tmp_path, capsys):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.wav").write_bytes(digit("1").read_bytes())
    (tmp_path / "t.tsv").write_text("file\ttext\none.wav\tone\n", encoding="utf-8")
    code = cli_main(["audio", "convert", str(tmp_path / "in"), "--transcripts", str(tmp_path / "t.tsv"),
                     "--out", str(tmp_path / "out"), "--workers", "0", "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and f"{tmp_path / 't.tsv'}:1" in err and "`path` column" in err


def test_tar_sidecars_that_are_not_utf8_or_not_valid_are_counted_not_replaced(tmp_path):
    tar = make_tar(tmp_path / "t.tar", [
        ("s1.flac", encoded(digit("1"))), ("s1.txt", "café".encode("latin-1")),
        ("s2.flac", encoded(digit("2"))), ("s2.txt", b"two"),
        ("s3.flac", encoded(digit("3"))), ("s3.json", b'{"text": "three", "clip": "abc"}'),
        ("s4.flac", encoded(digit("4"))), ("s4.json", b'{"text": "four",'),
    ])
    convert([tar], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    assert [c.id for c in load_cuts(tmp_path / "out")] == ["t/s2"]
    assert sorted((d["key"], d["reason"]) for d in dropped_records(tmp_path / "out")) == [
        ("t/s1", "bad_text_encoding"), ("t/s3", "bad_metadata"), ("t/s4", "bad_metadata")]
    assert report(tmp_path / "out")["counts"] == {"in": 4, "written": 1, "skipped:bad_text_encoding": 1,
                                                  "skipped:bad_metadata": 2}


def test_parquet_rows_with_bad_metadata_are_counted(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"audio": encoded(digit(k)), "text": DIGITS[k], "clip": clip} for k, clip in (("1", "0"), ("2", "abc"))]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    convert([tmp_path / "p.parquet"], tmp_path / "out", ConvertOptions(), workers=0, progress=False)
    assert [c.id for c in load_cuts(tmp_path / "out")] == ["p/00000000"]
    assert [(d["source"], d["reason"]) for d in dropped_records(tmp_path / "out")] == [
        (f"{tmp_path / 'p.parquet'}:row 1", "bad_metadata")]


def test_counts_add_up_to_every_clip_record_and_file_of_the_inputs(converted, tmp_path, capsys):
    assert report(converted)["counts"]["in"] == 16  # the corpus: 11 good files + 5 planted bad ones
    assert_counts_add_up(report(converted)["counts"])
    (tmp_path / "in").mkdir()
    for name, key in (("one.wav", "1"), ("two.wav", "2")):
        (tmp_path / "in" / name).write_bytes(digit(key).read_bytes())
    (tmp_path / "in" / "broken.wav").write_bytes(b"RIFF junk")  # decode_error
    (tmp_path / "in" / "notes.txt").write_text("not audio\n")  # ignored:txt
    table = tmp_path / "t.jsonl"
    table.write_bytes(b'{"path": "one.wav", "text": "one"}\n{"path": "gone.wav"}\n{"path": \n')
    tar = make_tar(tmp_path / "t.tar", [
        ("s1.flac", encoded(digit("3"))), ("s1.txt", b"three"),
        ("s2.txt", b"no audio"),  # no_audio_member
        ("s3.flac", encoded(digit("4"))), ("s3.wav", encoded(digit("4"), "WAV")),  # written + extra_audio_member
        ("s4.flac", encoded(digit("5"))), ("s4.txt", b"\xff"),  # bad_text_encoding
    ])
    assert cli_main(["audio", "convert", str(tmp_path / "in"), str(tar), "--out", str(tmp_path / "out"),
                     "--transcripts", str(table), "--workers", "0", "--no-progress"]) == 0
    counts = report(tmp_path / "out")["counts"]
    assert counts == {"in": 11, "written": 4, "ignored:txt": 1, "skipped:decode_error": 1,
                      "skipped:missing_file": 1, "skipped:bad_table_row": 1, "skipped:no_audio_member": 1,
                      "skipped:extra_audio_member": 1, "skipped:bad_text_encoding": 1}
    assert_counts_add_up(counts)
    [summary] = summary_lines(capsys.readouterr(), "audio convert")
    assert summary.startswith("mmtok audio convert: in 11: 4 clips") and "skipped 6 (" in summary
    assert "ignored non-audio files 1 (txt: 1)" in summary
    assert cli_main(["audio", "convert", str(tmp_path / "in"), str(tar), "--out", str(tmp_path / "out"),
                     "--transcripts", str(table), "--workers", "0", "--no-progress"]) == 0
    assert capsys.readouterr().err.startswith("mmtok audio convert: already complete: in 11: 4 clips")


def test_a_tar_key_naming_two_samples_makes_no_clip_as_in_scan_and_sft(tmp_path):
    """One WebDataset grouping for every stage (mmtok.formats.webdataset): a key that names two samples of a
    tar (`s1` before and after `s2`) is `duplicate_key` for each of them, the repeat named as sft names it;
    the clips were once merged into one sample, taking the first audio and another sample's text."""
    tar = make_tar(tmp_path / "t.tar", [
        ("s1.flac", encoded(digit("1"))), ("s1.txt", b"one"),
        ("s2.flac", encoded(digit("2"))), ("s2.txt", b"two"),
        ("s1.wav", encoded(digit("3"), "WAV")), ("s1.json", b'{"text": "three"}'),
    ])
    assert cli_main(["audio", "convert", str(tar), "--out", str(tmp_path / "out"), "--workers", "0",
                     "--no-progress"]) == 0
    assert [(c.id, c.supervisions[0].text) for c in load_cuts(tmp_path / "out")] == [("t/s2", "two")]
    dropped = dropped_records(tmp_path / "out")
    assert [(r["key"], r["reason"]) for r in dropped] == [("t/s1", "duplicate_key"),
                                                          ("t/s1 (repeat 2)", "duplicate_key")]
    assert all(r["detail"].startswith("2 samples of this tar are named 's1'") for r in dropped)
    counts = report(tmp_path / "out")["counts"]
    assert counts == {"in": 3, "written": 1, "skipped:duplicate_key": 2}
    assert_counts_add_up(counts)



def _raw_tar(path: Path, members: list[tuple[str, bytes]], corrupt: str | None = None) -> Path:
    """A ustar of `members` (names with surrogate escapes are written as their raw bytes); the header of member
    `corrupt` gets a byte flipped, so its checksum fails and the reader resyncs after it."""
    from tarkit import regular

    blocks = [regular(name, data) for name, data in members]
    if corrupt is not None:
        at = [name for name, _ in members].index(corrupt)
        broken = bytearray(blocks[at])
        broken[0] ^= 0x20  # the name's first byte: a wrong checksum
        blocks[at] = bytes(broken)
    path.write_bytes(b"".join(blocks) + bytes(1024))
    return path


def test_a_member_whose_name_is_not_utf8_costs_the_sample_beside_it_nothing(tmp_path):
    """The sample grouping puts such a member (\\xff.txt) with the open sample, refused (sft: only a reference
    would read it); audio convert names it on its own and makes the clips of both its neighbours."""
    tar = _raw_tar(tmp_path / "t.tar", [("a.wav", digit("1").read_bytes()), ("a.txt", b"one"),
                                        ("\udcff.txt", b"?"), ("b.wav", digit("2").read_bytes()),
                                        ("b.txt", b"two")])
    assert cli_main(["audio", "convert", str(tar), "--out", str(tmp_path / "out"), "--workers", "0",
                     "--no-progress"]) == 0
    assert [(c.id, c.supervisions[0].text) for c in load_cuts(tmp_path / "out")] == [("t/a", "one"), ("t/b", "two")]
    assert [(r["key"], r["reason"], r["source"].rsplit(":", 1)[1]) for r in dropped_records(tmp_path / "out")] == [
        ("t/\\xff", "non_utf8_name", "\\xff.txt")]


def test_a_sidecar_after_a_corrupt_header_stays_its_samples(tmp_path):
    """Members of the damaged sample's key found after the resync are that sample's: its json sidecar still gives
    the clip its text, and the damage is named."""
    tar = _raw_tar(tmp_path / "t.tar", [("a.wav", digit("1").read_bytes()), ("a.txt", b"lost"),
                                        ("a.json", b'{"text": "from json"}'), ("b.wav", digit("2").read_bytes())],
                   corrupt="a.txt")
    assert cli_main(["audio", "convert", str(tar), "--out", str(tmp_path / "out"), "--workers", "0",
                     "--no-progress"]) == 0
    texts = {c.id: c.supervisions[0].text if c.supervisions else None for c in load_cuts(tmp_path / "out")}
    assert texts == {"t/a": "from json", "t/b": None}
    assert [r["reason"] for r in dropped_records(tmp_path / "out")] == ["corrupt_header"]

# --- processes: workers die with the run, one writer per output ------------------------------------

def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time in clock ticks) of a live process, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every living descendant of process `root`."""
    stats = {int(p.name): proc_stat(int(p.name)) for p in Path("/proc").iterdir() if p.name.isdigit()}
    found, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, stat in stats.items():
            if stat is not None and stat[1] == parent and stat[0] != "Z" and pid not in found:
                found[pid] = stat[2]
                frontier.append(pid)
    return found


def alive(pid: int, started: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] != "Z" and stat[2] == started  # a reused pid is another process


BLOCKED_CONVERT = """
import sys, threading
from mmtok.audio import convert
def blocked(*args):  # the first shard is ready: workers have decoded; hold the run here until killed
    print("writing", flush=True)
    threading.Event().wait()
convert.write_shar_shard = blocked
from mmtok.cli import main
sys.exit(main(sys.argv[1:]))
"""


def wait_for_line(proc, expected: str, timeout: float, stderr: Path) -> None:
    import select

    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    line = proc.stdout.readline() if ready else ""
    assert line == expected + "\n", f"no {expected!r} from the child: {stderr.read_text()[-3000:]}"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")
def test_killed_conversion_leaves_no_worker_processes(tmp_path):
    import os
    import signal
    import subprocess
    import sys
    import time

    (tmp_path / "in").mkdir()
    for key in "1234":
        (tmp_path / "in" / f"{key}.wav").write_bytes(digit(key).read_bytes())
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        proc = subprocess.Popen([sys.executable, "-c", BLOCKED_CONVERT, "audio", "convert", str(tmp_path / "in"),
                                 "--out", str(tmp_path / "out"), "--workers", "2", "--shard-size", "1",
                                 "--no-progress"], stdout=subprocess.PIPE, stderr=err, text=True)
    children: dict[int, int] = {}
    try:
        wait_for_line(proc, "writing", 300, stderr)
        children = descendants(proc.pid)
        assert len(children) >= 2, children  # two decode workers (and multiprocessing's helpers)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(pid, t) for pid, t in children.items()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid, t in children.items() if alive(pid, t)], "workers outlived the killed convert"
    finally:
        for pid, started in children.items():  # leave no orphan behind when the test fails
            if alive(pid, started):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()


HOLD_LOCK = """
import sys
from mmtok.fsutil import WriterLock
lock = WriterLock(sys.argv[1], what="test holder")
print("held", flush=True)
sys.stdin.read()
"""


def test_second_conversion_into_the_same_output_is_refused_naming_the_holder(tmp_path, capsys):
    import subprocess
    import sys

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one.wav").write_bytes(digit("1").read_bytes())
    args = ["audio", "convert", str(tmp_path / "in"), "--out", str(tmp_path / "out"), "--workers", "0", "--no-progress"]
    stderr = tmp_path / "stderr.txt"
    with open(stderr, "w") as err:
        holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(tmp_path / "out")], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        wait_for_line(holder, "held", 120, stderr)
        code = cli_main(args)
        message = capsys.readouterr().err
        assert code != 0 and f"pid {holder.pid}," in message and "conversion output" in message
        assert not (tmp_path / "out" / "conversion.json").exists()  # refused before doing anything
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
        holder.stdout.close()
    assert cli_main(args) == 0 and report(tmp_path / "out")["complete"]  # the lock dies with its holder


def test_an_output_inside_the_input_is_not_read_as_input_and_keeps_its_lock(tmp_path, monkeypatch):
    # Opening OUT/.lock in the writing process (e.g. to sniff whether it is audio) would drop its
    # POSIX lock; OUT's own files must not count as inputs either.
    from mmtok.audio.sources import directory

    source = tmp_path / "in"
    source.mkdir()
    (source / "one.wav").write_bytes(digit("1").read_bytes())
    probed = []
    real = directory.is_audio_file
    monkeypatch.setattr(directory, "is_audio_file", lambda path: probed.append(path) or real(path))
    for _ in range(2):  # the rerun finds the first run's output inside its input
        assert cli_main(["audio", "convert", str(source), "--out", str(source / "out"), "--workers", "0",
                         "--no-progress"]) == 0
    assert probed and not [p for p in probed if "out" in p.relative_to(source).parts]
    assert not report(source / "out")["counts"].get("ignored:(no extension)")


def test_a_conversion_that_writes_no_clip_exits_2_with_its_counts(tmp_path, capsys):
    """Issue 49.3: as scan and interleave do, a stage that writes nothing usable from its inputs fails."""
    from mmtok.cli import main

    source = tmp_path / "in"
    source.mkdir()
    (source / "silence.wav").write_bytes(encoded_silence())
    assert main(["audio", "convert", str(source), "--out", str(tmp_path / "out"), "--workers", "1",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "in 1: 0 clips" in err and "skipped 1" in err and "no clip was written" in err


def encoded_silence() -> bytes:
    import io

    import numpy as np
    import soundfile

    buffer = io.BytesIO()
    soundfile.write(buffer, np.zeros(24_000, np.float32), 24_000, format="WAV")
    return buffer.getvalue()


def test_a_shar_directory_given_to_convert_points_to_encode(tmp_path, capsys):
    """Issue 49.2: a Shar (what lhotse's CutSet.to_shar or an earlier convert wrote) is encoded directly."""
    from mmtok.cli import main

    shar = tmp_path / "shar"
    shar.mkdir()
    (shar / "cuts.000000.jsonl.gz").write_bytes(b"")
    assert main(["audio", "convert", str(shar), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert f"encode it directly with `mmtok encode --modality audio --shar {shar}`" in capsys.readouterr().err


def test_hugging_face_audio_cells_that_hold_only_a_path_are_read_inside_the_directory(tmp_path, capsys):
    """Issue 49.1: `Dataset.to_parquet()` of audio loaded from local files stores {bytes: null, path} cells
    (the `Audio` feature's struct, written here with pyarrow); they were `no_audio_bytes` with no detail. A path
    inside the Parquet file's directory is read; one that leaves it is outside_root."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from audio_corpus import digit
    from convertkit import dropped_records, load_cuts
    from mmtok.cli import main

    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    (data / "clips").mkdir(parents=True)
    elsewhere.mkdir()
    (data / "clips" / "one.wav").write_bytes(digit("1").read_bytes())
    (elsewhere / "two.wav").write_bytes(digit("2").read_bytes())
    cells = [{"bytes": None, "path": "clips/one.wav"}, {"bytes": None, "path": str(elsewhere / "two.wav")},
             {"bytes": None, "path": None}]
    audio = pa.array(cells, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"audio": audio, "text": ["one", "two", "none"]}), data / "train.parquet")
    out = tmp_path / "out"
    assert main(["audio", "convert", str(data / "train.parquet"), "--out", str(out), "--workers", "1",
                 "--no-progress"]) == 0
    assert len(load_cuts(out)) == 1
    reasons = sorted((record["reason"], record["detail"][:40]) for record in dropped_records(out))
    assert [reason for reason, _ in reasons] == ["no_audio_bytes", "outside_root"]
    assert reasons[0][1] == "the cell holds neither bytes nor a path"


def test_a_lhotse_cutset_manifest_converts_one_clip_per_cut(tmp_path, tokenizer, capsys):
    """Issue 49.2: lhotse users often have only `cuts.jsonl.gz` (`CutSet.to_file` of trimmed cuts, each with its
    recording inside). Each MonoCut is one clip cut out of its recording, numbered by start time; a cut with
    two supervisions joins their texts in start order; a MixedCut is a named bad_manifest_row."""
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    from mmtok.cli import main

    pieces = [read(tmp_path / name)[0] for name, _ in write_story(tmp_path, 3)]
    rate, gap = 22_050, np.zeros(22_050 // 4, np.float32)
    soundfile.write(tmp_path / "talk.wav", np.concatenate([pieces[0], gap, pieces[1], gap, pieces[2]]), rate,
                    subtype="FLOAT")
    sups, start = [], 0.0
    for index, piece in enumerate(pieces):
        sups.append(SupervisionSegment(f"s{index}", "talk", start, len(piece) / rate, text=STORY[index],
                                       language="en"))
        start += (len(piece) + len(gap)) / rate
    recording = Recording.from_file(tmp_path / "talk.wav", recording_id="talk")
    cuts = CutSet.from_manifests(RecordingSet.from_recordings([recording]),
                                 SupervisionSet.from_segments(sups)).trim_to_supervisions(keep_overlapping=False)
    cuts = list(cuts)
    two = cuts[1].append(cuts[2])  # a MixedCut
    merged = cuts[0].truncate(duration=cuts[0].duration)  # a MonoCut that also holds the next supervision:
    merged = merged.with_id("s0+s1")  # same start as s0: ordered after it by id
    merged.duration = sups[1].end - merged.start
    merged.supervisions = [sups[1].with_offset(-merged.start), sups[0].with_offset(-merged.start)]
    CutSet.from_cuts(list(reversed(cuts)) + [two, merged]).to_file(tmp_path / "cuts.jsonl.gz")
    out = tmp_path / "out"
    assert main(["audio", "convert", str(tmp_path / "cuts.jsonl.gz"), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    written = load_cuts(out)
    by_id = {c.custom["clip"]: c for c in written}
    assert [by_id[n].id for n in sorted(by_id)] == [cuts[0].id, "s0+s1", cuts[1].id, cuts[2].id]
    assert {c.custom["source_id"] for c in written} == {"talk"}
    assert by_id[1].custom["text_tokens"] == tokenizer.encode(f"{STORY[0]} {STORY[1]}")
    for cut, index in ((by_id[0], 0), (by_id[2], 1), (by_id[3], 2)):
        assert cut.custom["text_tokens"] == tokenizer.encode(STORY[index])
        assert_same_audio(cut.load_audio()[0], expected_wave(tmp_path / "talk.wav", sups[index].start,
                                                             sups[index].end))
    (mixed,) = dropped_records(out)
    assert mixed["reason"] == "bad_manifest_row" and "MixedCut" in mixed["detail"]


def test_cutset_rows_with_odd_supervisions_or_a_reused_recording_id_are_named(tmp_path):
    """A cut whose supervisions are no list of typed objects, or that holds another recording under an id an
    earlier cut used (its audio would be the first one's), is a named bad_manifest_row; the others convert."""
    from lhotse import MonoCut, Recording, SupervisionSegment

    from mmtok.cli import main

    def cut(ident: str, key: str, recording_id: str = "r1") -> dict:
        recording = Recording.from_file(digit(key), recording_id=recording_id)
        sup = SupervisionSegment(ident, recording_id, 0.0, recording.duration, text=DIGITS[key])
        return MonoCut(ident, 0.0, recording.duration, 0, recording=recording, supervisions=[sup]).to_dict()

    good, other = cut("good", "1"), cut("other", "2")  # `other` holds digit 2's file under r1
    rows = [good, other, {**cut("ints", "3", "r3"), "supervisions": 5}]
    bad_start = cut("start", "4", "r4")
    bad_start["supervisions"][0]["start"] = "zz"
    bad_custom = cut("custom", "5", "r5")
    bad_custom["supervisions"][0]["custom"] = "x"
    write_jsonl(tmp_path / "cuts.jsonl", rows + [bad_start, bad_custom])
    out = tmp_path / "out"
    assert main(["audio", "convert", str(tmp_path / "cuts.jsonl"), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    assert [c.id for c in load_cuts(out)] == ["good"]
    details = sorted(r["detail"] for r in dropped_records(out))
    assert [r["reason"] for r in dropped_records(out)] == ["bad_manifest_row"] * 4
    assert any("`supervisions`=5 is not a list" in d for d in details)
    assert any("`start`='zz' is not a finite number" in d for d in details)
    assert any("`custom`='x' is not a JSON object" in d for d in details)
    assert any("differs from the one an earlier cut holds under that id" in d for d in details)


def test_a_row_group_that_changed_since_its_rows_were_listed_skips_its_clips_by_name(tmp_path):
    # the rows of a row group are listed when the units are made and read again when they convert: a file
    # rewritten in between gives every clip of the group a named skip, never a clip paired with another row
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmtok.audio.sources.parquet import ParquetUnit
    from mmtok.audio.sources.units import ClipSpec

    path = tmp_path / "clips.parquet"
    pq.write_table(pa.table({"audio": [b"a", b"b", b"c"]}), path)
    clips = [ClipSpec(id=f"r{n}", source_id=f"r{n}", clip=0, origin=f"{path}:{n}") for n in range(2)]
    out = list(ParquetUnit(origin=str(path), path=str(path), clips=clips).payloads())
    assert [(o.key, o.reason) for o in out] == [("r0", "unreadable_row_group"), ("r1", "unreadable_row_group")]
    assert "holds 3 rows, 2 when listed" in out[0].detail
