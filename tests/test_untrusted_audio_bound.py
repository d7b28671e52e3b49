"""Issue 21 §3, audio side: tokens always belong to the bytes they claim.

Every store one audio stage writes and another reads (Shar shards, the carry, the audio token cache) is
checksummed and verified by its reader -- a flipped bit is one line naming the file, exit 2 --, every audio
id is checked against the audio ids before it is committed, and a clip is bound to the bytes it was
converted from, so `mmtok sft` never gives a changed audio file its old tokens (`stale_media`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from audio_corpus import digit
from encodekit import chat_tokenizer
from mmtok.audio.convert import ConvertOptions, convert
from mmtok.cli import main
from mmtok.codecs.registry import load_codec
from mmtok.encode.audio import encode_audio_rank, pack_clips, unpack_clips
from mmtok.encode.audio_batches import Batching
from mmtok.errors import MmtokError
from mmtok.formats import audio_cache, partdir
from mmtok.formats.audio_cache import cache_path, write_cache
from mmtok.formats.commitlog import PartWriter
from mmtok.formats.megatron import read_sequences
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout, check_ids_in_range

BATCHING = Batching(max_duration=4.0, num_buckets=2, seed=0)
WORDS = {"a": "1", "b": "2", "c": "3"}  # conversation -> the spoken digit its audio file holds


def _one_line_refusal(capsys, *names: str) -> str:
    """The stderr of a refused command: one line naming each of `names`."""
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert all(name in err for name in names), err
    return err


def _flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


# -- the pipeline: conversations' audio -> Shar -> the audio token cache ------------------------------------
@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """Three conversations, each asking about one spoken digit file, converted (--kind conversations) and
    encoded with a tiny random WavTokenizer, all with the chat tokenizer that `mmtok sft` uses."""
    from mmtok.codecs.wavtokenizer import write_random_checkpoint

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("bound")
    (root / "media").mkdir()
    lines = []
    for name, key in WORDS.items():
        (root / "media" / f"{name}.wav").write_bytes(digit(key).read_bytes())
        lines.append({"id": name, "messages": [
            {"role": "user", "content": [{"type": "audio", "audio": f"media/{name}.wav"},
                                         {"type": "text", "text": " Which digit?"}]},
            {"role": "assistant", "content": "A digit."}]})
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = chat_tokenizer(root / "tok")
    checkpoint = write_random_checkpoint(root / "wavtokenizer")
    convert([chat], root / "conv", ConvertOptions(shard_size=2, text_tokenizer=str(tokenizer)),
            kind="conversations", workers=0, progress=False)
    codec = load_codec("wavtokenizer", checkpoint, "cpu")
    encode_audio_rank(root / "conv", root / "enc", codec, rank=0, world_size=1, batching=BATCHING, num_workers=0,
                      text_tokenizer=str(tokenizer), progress=False)
    return root, codec, tokenizer, checkpoint


def _copy(pipeline, tmp_path: Path, *names: str) -> Path:
    root = pipeline[0]
    for name in names:
        shutil.copytree(root / name, tmp_path / name)
    return tmp_path


def _encode(pipeline, shar: Path, out: Path) -> None:
    _, codec, tokenizer, _ = pipeline
    encode_audio_rank(shar, out, codec, rank=0, world_size=1, batching=BATCHING, num_workers=0,
                      text_tokenizer=str(tokenizer), progress=False)


def _encode_command(pipeline, shar: Path, out: Path) -> int:
    _, _, tokenizer, checkpoint = pipeline
    return main(["encode", "--modality", "audio", "--shar", str(shar), "--checkpoint", str(checkpoint), "--out",
                 str(out), "--text-tokenizer", str(tokenizer), "--device", "cpu", "--num-workers", "0",
                 "--no-progress"])


def _sft(pipeline, root: Path, out: Path) -> int:
    tokenizer = pipeline[2]
    return main(["sft", str(root / "chat.jsonl"), "--text-tokenizer", str(tokenizer), "--audio", str(root / "enc"),
                 "--converted", str(root / "conv"), "--out", str(out), "--no-progress"])


# -- a clip is bound to the bytes it came from ------------------------------------------------------------
def test_a_converted_clip_records_the_digest_of_the_bytes_it_came_from(pipeline):
    from lhotse import CutSet

    root = pipeline[0]
    cuts = {cut.id: cut for cut in CutSet.from_shar(in_dir=root / "conv" / "shar")}
    for name in WORDS:
        want = hashlib.sha256((root / "media" / f"{name}.wav").read_bytes()).hexdigest()
        assert cuts[f"{name}/audio-0"].custom["source_sha256"] == want
    rows = {}
    for path in audio_cache.find_cache_parts(root / "enc"):
        table = audio_cache.read_cache_index(path).to_pydict()
        rows.update(zip(table["cut_id"], table["source_sha256"], strict=True))
    assert rows == {cut_id: cut.custom["source_sha256"] for cut_id, cut in cuts.items()}


def test_an_audio_file_changed_after_conversion_is_stale_media_not_its_old_tokens(pipeline, tmp_path, capsys):
    root = _copy(pipeline, tmp_path, "media", "conv", "enc")
    shutil.copy(pipeline[0] / "chat.jsonl", root / "chat.jsonl")
    (root / "media" / "b.wav").write_bytes(digit("7").read_bytes())  # another recording, same name
    capsys.readouterr()
    assert _sft(pipeline, root, root / "sft") == 0
    skipped = [json.loads(line) for part in sorted((root / "sft" / "parts").iterdir())
               for line in (part / "skipped.jsonl").read_text().splitlines()]
    assert [(s["key"], s["reason"]) for s in skipped] == [("b", "stale_media")]
    assert "b.wav" in skipped[0]["detail"]
    stats = json.loads((root / "sft" / "parts" / "part-00000" / "stats.json").read_text())
    assert stats["counts"]["skipped:stale_media"] == 1 and stats["sequences"] == 2


# -- every store is checksummed and verified by its reader -----------------------------------------------
def test_a_flipped_bit_in_a_shar_recording_tar_is_a_one_line_refusal_naming_it(pipeline, tmp_path, capsys):
    root = _copy(pipeline, tmp_path, "conv")
    tar = root / "conv" / "shar" / "recording.000000.tar"
    _flip_bit(tar, 512 + 200)  # inside the first member's FLAC frames (after its 512-byte tar header)
    capsys.readouterr()
    assert _encode_command(pipeline, root / "conv", root / "enc") == 2
    _one_line_refusal(capsys, str(tar))
    assert not (root / "enc" / "audio-cache").exists()


def test_a_flipped_bit_in_a_shar_cuts_manifest_is_a_one_line_refusal_naming_it(pipeline, tmp_path, capsys):
    root = _copy(pipeline, tmp_path, "conv")
    cuts = root / "conv" / "shar" / "cuts.000001.jsonl.gz"
    _flip_bit(cuts, cuts.stat().st_size // 2, 3)
    capsys.readouterr()
    assert _encode_command(pipeline, root / "conv", root / "enc") == 2
    _one_line_refusal(capsys, str(cuts))


def test_a_conversion_from_before_shard_checksums_is_refused_with_what_to_rerun(pipeline, tmp_path, capsys):
    root = _copy(pipeline, tmp_path, "conv")
    report = json.loads((root / "conv" / "conversion.json").read_text())
    report["format"] = "mmtok-audio-convert/1"
    for shard in report["shards"]:
        del shard["recording_sha256"]
    (root / "conv" / "conversion.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert _encode_command(pipeline, root / "conv", root / "enc") == 2
    assert "mmtok audio convert" in _one_line_refusal(capsys, "conversion.json")


@pytest.mark.parametrize(("damage", "key"), [
    (lambda report: report["shards"][0].update(duration="12.5"), "duration"),
    (lambda report: report["shards"][1].pop("recording_sha256"), "recording_sha256"),
    (lambda report: report.update(shards={"0": {}}), "shards"),
    (lambda report: report["cursor"].update(unit=None), "unit"),
    (lambda report: report.update(complete="yes"), "complete"),
    (lambda report: report["counts"].update(written=[2]), "written"),
    (lambda report: report["shards"][0].update(duration=10 ** 400), "duration"),
    (lambda report: report.update(duration_written=float("nan")), "duration_written"),
    (lambda report: report["shards"][0].update(cuts=-1), "cuts"),
    (lambda report: report["shards"][1].update(index=5), "shards"),
    (lambda report: report["identity"].update(text_tokenizer="tekken"), "text_tokenizer"),
])
def test_a_conversion_report_of_the_wrong_shape_is_refused_naming_the_key(pipeline, tmp_path, capsys, damage, key):
    """conversion.json is read back (encode trusts its shard digests, a resumed conversion its cursor): a report
    that parses but has the wrong shape is one line naming the file and the key, never a traceback."""
    root = _copy(pipeline, tmp_path, "conv")
    report = json.loads((root / "conv" / "conversion.json").read_text())
    damage(report)
    (root / "conv" / "conversion.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert _encode_command(pipeline, root / "conv", root / "enc") == 2
    _one_line_refusal(capsys, "conversion.json", repr(key))


def test_shards_a_complete_report_does_not_record_are_refused_not_encoded_unverified(pipeline, tmp_path, capsys):
    """Encode verifies each shard by the digests its report records: a report that records fewer shards than the
    Shar holds must not let the others through unchecked."""
    root = _copy(pipeline, tmp_path, "conv")
    report = json.loads((root / "conv" / "conversion.json").read_text())
    report["shards"], report["duration_written"] = report["shards"][:1], report["shards"][0]["duration"]
    (root / "conv" / "conversion.json").write_text(json.dumps(report))
    capsys.readouterr()
    assert _encode_command(pipeline, root / "conv", root / "enc") == 2
    _one_line_refusal(capsys, "holds shards 0..1 but conversion.json records 0..0")


@pytest.mark.parametrize(("cursor", "words"), [({"unit": 10 ** 6, "skip": 0}, "cursor is at unit 1,000,000 of 1"),
                                               ({"unit": 0, "skip": 9}, "cursor skips 9 results of unit 0")])
def test_a_resumed_conversion_whose_cursor_is_past_its_inputs_is_refused(pipeline, tmp_path, cursor, words):
    """A cursor past the inputs (or past a unit's results) would mark work done that was never written."""
    root = _copy(pipeline, tmp_path, "conv")
    report = json.loads((root / "conv" / "conversion.json").read_text())
    report.update(complete=False, cursor=cursor)
    (root / "conv" / "conversion.json").write_text(json.dumps(report))
    with pytest.raises(MmtokError, match=words):
        convert([pipeline[0] / "chat.jsonl"], root / "conv",
                ConvertOptions(shard_size=2, text_tokenizer=str(pipeline[2])), kind="conversations", workers=0,
                progress=False)


def test_a_flipped_bit_in_the_carry_is_refused_naming_the_part(tmp_path):
    ids = np.arange(262_344, 262_354, dtype=np.int32)
    with PartWriter(tmp_path / "part-00000", {"modality": "audio"}) as part:
        part.commit(0, [], [], {}, carry=pack_clips([(0, "", ids), (1, "silent: digital silence", None)]))
    _flip_bit(tmp_path / "part-00000" / partdir.CARRY, 30)
    with PartWriter(tmp_path / "part-00000", {"modality": "audio"}) as part:
        with pytest.raises(MmtokError, match=r"part-00000/carry.bin: the carried bytes do not match"):
            list(unpack_clips(part.carry()))


LAYOUT = VocabLayout(131_072)
META = {"num_parts": 1, "vocab": LAYOUT.to_dict(), "codec": {"name": "test"}, "trim": 5, "part": 0,
        "text_tokenizer": {"name": "test", "bos_id": 1, "eos_id": 2}}


def _row(number: int, audio_ids: np.ndarray) -> dict:
    return {"cut_id": f"s-{number}", "source_id": "s", "clip": number, "part": 0, "position": number,
            "duration": 1.0, "language": "en", "target_language": None, "audio_ids": audio_ids,
            "text_ids": np.full(4, 1000 + number, np.int32), "source_sha256": None}


def _cache(out: Path, rows: list[dict]) -> Path:
    path = cache_path(out, 0)
    write_cache(path, rows, {**META, "format": audio_cache.CACHE_FORMAT})
    return path


def _interleave(encoded: Path, out: Path) -> int:
    return main(["audio", "interleave", str(encoded), "--out", str(out), "--no-progress"])


def _silently_changed_copy(path: Path) -> tuple[int, int]:
    """(byte, bit) of a flip that pyarrow reads back without an error but with other audio ids: the kind of
    damage no Parquet reader notices (the first such bit of the audio_ids column chunk)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = path.read_bytes()
    original = pq.read_table(pa.BufferReader(data)).column("audio_ids").to_pylist()
    chunk = pq.ParquetFile(path).metadata.row_group(0).column(audio_cache.COLUMNS.index("audio_ids"))
    first = chunk.dictionary_page_offset or chunk.data_page_offset
    for offset in range(first, first + chunk.total_compressed_size):
        for bit in range(8):
            damaged = bytearray(data)
            damaged[offset] ^= 1 << bit
            try:
                if pq.read_table(pa.BufferReader(bytes(damaged))).column("audio_ids").to_pylist() != original:
                    return offset, bit
            except Exception:  # noqa: BLE001 -- pyarrow noticed this one
                continue
    raise AssertionError("no silent flip found")


def test_a_flipped_bit_in_the_audio_token_cache_is_a_one_line_refusal_naming_it(tmp_path, capsys):
    path = _cache(tmp_path / "enc", [_row(n, LAYOUT.audio_ids(np.arange(20) * 7 + n)) for n in range(3)])
    _flip_bit(path, *_silently_changed_copy(path))
    capsys.readouterr()
    assert _interleave(tmp_path / "enc", tmp_path / "out") == 2
    _one_line_refusal(capsys, str(path))
    assert not list(tmp_path.glob("out/*.bin"))


def test_a_cache_that_does_not_parse_is_a_one_line_refusal_not_a_pyarrow_traceback(tmp_path, capsys):
    path = _cache(tmp_path / "enc", [_row(n, LAYOUT.audio_ids(np.arange(20))) for n in range(3)])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    capsys.readouterr()
    assert _interleave(tmp_path / "enc", tmp_path / "out") == 2
    _one_line_refusal(capsys, str(path))


def test_a_cache_from_before_its_checksum_is_refused_with_what_to_rerun(tmp_path, capsys):
    path = _cache(tmp_path / "enc", [_row(n, LAYOUT.audio_ids(np.arange(20))) for n in range(3)])
    audio_cache.checksum_path(path).unlink()
    capsys.readouterr()
    assert _interleave(tmp_path / "enc", tmp_path / "out") == 2
    assert "mmtok encode --modality audio" in _one_line_refusal(capsys, str(path))


# -- the last guard: every audio id is an audio id ---------------------------------------------------------
def test_an_audio_id_past_the_vocabulary_is_never_written_by_interleave(tmp_path, capsys):
    bad = LAYOUT.audio_ids(np.arange(20))
    bad[5] = LAYOUT.total_size + 3  # a cache with a sound checksum, made wrong by its writer
    path = _cache(tmp_path / "enc", [_row(0, LAYOUT.audio_ids(np.arange(20))), _row(1, bad)])
    capsys.readouterr()
    assert _interleave(tmp_path / "enc", tmp_path / "out") == 2
    assert str(LAYOUT.total_size + 3) in _one_line_refusal(capsys, str(path))
    assert not list(tmp_path.glob("out/*.bin"))


def test_an_audio_id_out_of_range_is_refused_by_sft_in_one_line(tmp_path):
    from mmtok.sft.build import AudioClips

    bad = LAYOUT.audio_ids(np.arange(20))
    bad[0] = LAYOUT.image_offset  # an image id where an audio id belongs
    _cache(tmp_path / "enc", [_row(0, bad)])
    clips = AudioClips([tmp_path / "enc"], [], LAYOUT)
    with pytest.raises(MmtokError, match=r"part-00000.parquet: audio ids: \d+ id\(s\) outside") as refused:
        clips.block("s-0")
    assert "\n" not in str(refused.value)


def test_every_encoded_audio_id_is_an_audio_id_and_the_guard_names_the_bad_one(pipeline):
    layout = VocabLayout(load_text_tokenizer(str(pipeline[2])).vocab_size)
    for path in audio_cache.find_cache_parts(pipeline[0] / "enc"):
        audio, _ = audio_cache.read_tokens(path, layout)
        check_ids_in_range(np.concatenate(audio), layout.audio_offset, layout.total_size, str(path))
    with pytest.raises(MmtokError, match=r"^the ids: 1 id\(s\) outside \[10, 20\) \(min 7, max 19\)"):
        check_ids_in_range(np.array([12, 7, 19]), 10, 20, "the ids")


def test_sequences_read_back_from_a_verified_cache_are_unchanged(tmp_path):
    rows = [_row(n, LAYOUT.audio_ids(np.arange(20) * 3 + n)) for n in range(3)]
    _cache(tmp_path / "enc", rows)
    assert _interleave(tmp_path / "enc", tmp_path / "out") == 0
    written = list(read_sequences(tmp_path / "out" / "stage"))
    assert sum(int(np.sum((s >= LAYOUT.audio_offset) & (s < LAYOUT.total_size))) for s in written) >= 60
