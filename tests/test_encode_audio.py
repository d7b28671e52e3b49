"""`mmtok encode --modality audio`: rank-independent merged output, exact sequences, kill -9 + resume."""

from __future__ import annotations

import json
import math
import random
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from audio_corpus import DIGITS, digit, write_story
from mmtok.audio.convert import ConvertOptions, convert
from mmtok.audio.interleave import LONG, STAGE, interleave
from mmtok.codecs.registry import load_codec
from mmtok.encode.audio import encode_audio_rank, load_clip
from mmtok.encode.audio_batches import Batching
from mmtok.formats.audio_cache import cache_path, read_tokens
from mmtok.formats.megatron import read_sequences
from mmtok.formats.shar import discover_shards, index_members
from mmtok.fsutil import sha256_file
from mmtok.merge.merge import merge
from mmtok.ranks import assign_shards
from mmtok.vocab import VocabLayout
from realmedia import REPO, alsa_sounds, espeak
from summaries import json_result, summary_lines

LAYOUT = VocabLayout(131_072)
SPECIAL = LAYOUT.special_ids()
BATCHING = Batching(max_duration=4.0, num_buckets=3, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from mmtok.codecs.wavtokenizer import write_random_checkpoint

    return write_random_checkpoint(tmp_path_factory.mktemp("wavtokenizer"))


@pytest.fixture(scope="module")
def codec(checkpoint):
    return load_codec("wavtokenizer", checkpoint, "cpu")


@pytest.fixture(scope="module")
def shar(tmp_path_factory):
    """About 11 s of real speech in 3 shards: spoken digits, a three-clip story, a German clip with an
    English translation, and alsa's 48 kHz "Front Center" without text."""
    root = tmp_path_factory.mktemp("speech")
    source = root / "in"
    source.mkdir()
    rows = ["path\ttext\trecording_id\tclip\tlanguage\ttarget_language"]
    for key in "1234":
        (source / f"digit{key}.wav").write_bytes(digit(key).read_bytes())
        rows.append(f"digit{key}.wav\t{DIGITS[key]}\t\t\ten\t")
    for index, (name, text) in enumerate(write_story(source, 3)):
        rows.append(f"{name}\t{text}\tstory\t{index}\ten\t")
    espeak("Guten Morgen, wie geht es dir?", source / "greeting.wav", "de")
    rows.append("greeting.wav\tGood morning, how are you?\t\t\tde\ten")
    (source / "front.wav").write_bytes(next(p for p in alsa_sounds() if p.name == "Front_Center.wav").read_bytes())
    (root / "t.tsv").write_text("\n".join(rows) + "\n")
    convert([source], root / "shar", ConvertOptions(shard_size=3), transcripts=root / "t.tsv", workers=0,
            progress=False)
    return root / "shar"


def encode_all(shar: Path, out: Path, codec, world_size: int, batching: Batching = BATCHING) -> Path:
    for rank in range(world_size):
        encode_audio_rank(shar, out, codec, rank=rank, world_size=world_size, batching=batching, num_workers=1,
                          progress=False, take_over=False)  # each rank its own shards: the split itself is tested
    merge(out)
    return out


def fingerprint(out: Path) -> dict[str, str]:
    files = [out / "merged.bin", out / "merged.idx", out / "merged.provenance.jsonl",
             *sorted((out / "audio-cache").glob("*.parquet"))]
    return {f.name: sha256_file(f) for f in files}


@pytest.fixture(scope="module")
def one_rank(shar, codec, tmp_path_factory):
    return encode_all(shar, tmp_path_factory.mktemp("one_rank"), codec, 1)


def test_merged_output_does_not_depend_on_the_number_of_ranks(shar, codec, one_rank, tmp_path):
    shards, _ = discover_shards(shar)
    assert len(shards) == 3 and all(len(r) for r in assign_shards([s.duration for s in shards], 3))
    assert fingerprint(encode_all(shar, tmp_path, codec, 3)) == fingerprint(one_rank)


def test_merged_output_does_not_depend_on_batch_composition(shar, codec, one_rank, tmp_path):
    single_clip_batches = Batching(max_duration=0.5, num_buckets=3, seed=5)  # every batch holds one clip
    assert fingerprint(encode_all(shar, tmp_path, codec, 1, single_clip_batches)) == fingerprint(one_rank)


def sequences_with_provenance(out: Path) -> list[tuple[np.ndarray, dict]]:
    lines = (out / "merged.provenance.jsonl").read_text().splitlines()
    return list(zip(read_sequences(out / "merged"), map(json.loads, lines), strict=True))


def test_sequences_have_the_exact_token_layout_in_cut_order(shar, one_rank):
    from lhotse import CutSet

    cuts = {c.id: c for c in CutSet.from_shar(in_dir=shar / "shar")}
    pairs = sequences_with_provenance(one_rank)
    assert [(p["shard"], p["position"]) for _, p in pairs] == sorted((p["shard"], p["position"]) for _, p in pairs)
    kinds = {p["cut_id"]: p["kind"] for _, p in pairs}
    assert kinds["front"] == "audio" and kinds["greeting"] == "translation" and kinds["digit1"] == "transcription"
    assert len(kinds) == len(cuts) == len(pairs)
    for tokens, prov in pairs:
        cut = cuts[prov["cut_id"]]
        n_codes = math.ceil(cut.num_samples / 600) - 5
        tokens = tokens.tolist()
        assert tokens[:2] == [1, SPECIAL["<|audio_start|>"]] and tokens[-1] == 2
        audio = tokens[2:2 + n_codes]
        assert all(LAYOUT.audio_offset <= t < LAYOUT.total_size for t in audio)
        tail = tokens[2 + n_codes:-1]
        if prov["kind"] == "audio":
            assert tail == [SPECIAL["<|audio_end|>"]]
        else:
            task = "<|stt_translate|>" if prov["kind"] == "translation" else "<|stt_transcribe|>"
            assert tail == [SPECIAL["<|audio_end|>"], SPECIAL[task], *cut.custom["text_tokens"]]


def test_clip_tokens_equal_the_codec_output_for_the_clip_alone(shar, codec, one_rank):
    shards, _ = discover_shards(shar)
    pairs = sequences_with_provenance(one_rank)
    for tokens, prov in pairs[:3]:
        shard = shards[prov["shard"]]
        member = index_members(shard.recording_path)[0][prov["cut_id"]]
        with open(shard.recording_path, "rb") as handle:
            wave = load_clip(handle, member, 1.0, SimpleNamespace(min_samples=3000, max_clip_duration=600.0))
        codes, counts = codec.encode(torch.from_numpy(wave[None]), torch.tensor([wave.size]))
        alone = LAYOUT.audio_ids(codes[0, :int(counts[0]) - 5].numpy())
        assert tokens[2:2 + alone.size].tolist() == alone.tolist()


def test_token_cache_matches_the_sequences(one_rank):
    pairs = sequences_with_provenance(one_rank)
    by_cut = {p["cut_id"]: tokens for tokens, p in pairs}
    import pyarrow.parquet as pq

    for part in sorted((one_rank / "audio-cache").glob("*.parquet")):
        table = pq.read_table(part).to_pylist()
        audio, text = read_tokens(part)
        for row, audio_ids, text_ids in zip(table, audio, text, strict=True):
            tokens = by_cut[row["cut_id"]].tolist()
            assert tokens[2:2 + audio_ids.size] == audio_ids.tolist()
            if text_ids is not None:
                assert tokens[-1 - text_ids.size:-1] == text_ids.tolist()


def test_interleave_of_encoded_story_alternates_real_clips(shar, one_rank, tmp_path):
    summary = interleave(one_rank, tmp_path, progress=False)
    assert summary.counts["runs_of_3+"] == 1 and summary.counts["translations"] == 1
    stage = list(read_sequences(tmp_path / STAGE))
    assert not (tmp_path / f"{LONG}.idx").exists() and not (tmp_path / f"{LONG}.bin").exists()  # no empty dataset
    with_continue = [s for s in stage if SPECIAL["<|stt_continue|>"] in s.tolist()]
    assert len(with_continue) == 2  # the two copies of the story run
    assert all(s[-2] < LAYOUT.special_offset for s in stage)  # every sequence ends with text, then EOS


def encode_command(shar: Path, checkpoint: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "mmtok", "encode", "--modality", "audio", "--checkpoint", str(checkpoint),
            "--shar", str(shar), "--out", str(out), "--max-duration", str(BATCHING.max_duration),
            "--num-buckets", str(BATCHING.num_buckets), "--bucket-seed", str(BATCHING.seed), "--num-workers", "1",
            "--no-progress", "--device", "cpu"]


def committed_units(out: Path) -> int:
    return sum(len(p.read_bytes().splitlines()) for p in out.glob("parts/*/commits.log"))


def test_kill_9_at_random_points_then_resume_gives_identical_bytes(shar, checkpoint, one_rank, tmp_path):
    """Kill the rank after a random number of commits plus a random delay (so kills also land inside
    commits, assemblies and loader start-up), resume, repeat; the final bytes must not change."""
    command = encode_command(shar, checkpoint, tmp_path)
    total = committed_units(one_rank)  # same batching -> same units
    rng = random.Random(20251130)
    targets = sorted(rng.sample(range(1, total), 3))
    mid_run_kills = 0
    for target in targets:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        while process.poll() is None and committed_units(tmp_path) < target:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.5))
        if process.poll() is None:
            process.send_signal(signal.SIGKILL)
            mid_run_kills += 1
        process.wait()
    assert mid_run_kills >= 2
    subprocess.run(command, check=True, cwd=REPO, capture_output=True)
    assert committed_units(tmp_path) == total
    merge(tmp_path)
    assert fingerprint(tmp_path) == fingerprint(one_rank)


def test_shards_go_largest_first_to_the_least_loaded_rank():
    # 1 (9) -> r0, 3 (9) -> r1, 0 (5) -> r0 (tie: lower rank), 4 (4) -> r1, 2 (2) -> r1, 5 (1) -> r0
    assert assign_shards([5.0, 9.0, 2.0, 9.0, 4.0, 1.0], 2) == [[0, 1, 5], [2, 3, 4]]
    assert assign_shards([1.0, 1.0, 1.0], 5) == [[0], [1], [2], [], []]


def test_foreign_shar_text_is_tokenized_and_silent_clips_are_skipped(codec, tmp_path):
    import io

    import soundfile
    from lhotse import CutSet, MonoCut, Recording, SupervisionSegment
    from lhotse.audio import AudioSource
    from lhotse.shar import SharWriter

    from mmtok.text import load_text_tokenizer

    speech, rate = soundfile.read(digit("7"), dtype="float32")
    waves = {"seven": np.interp(np.arange(int(speech.size * 3)) / 3, np.arange(speech.size), speech).astype(np.float32),
             "quiet": np.zeros(24_000, np.float32)}
    (tmp_path / "shar").mkdir()
    with SharWriter(tmp_path / "shar", fields={"recording": "flac"}, shard_size=10) as writer:
        for name, wave in waves.items():
            buffer = io.BytesIO()
            soundfile.write(buffer, wave, 24_000, format="FLAC", subtype="PCM_24")
            recording = Recording(name, [AudioSource("memory", [0], buffer.getvalue())], 24_000, wave.size,
                                  wave.size / 24_000)
            sup = SupervisionSegment(name, name, 0.0, wave.size / 24_000, text=name)
            writer.write(MonoCut(name, 0.0, wave.size / 24_000, 0, recording=recording, supervisions=[sup]))
    assert len(CutSet.from_shar(in_dir=tmp_path / "shar")) == 2
    encode_audio_rank(tmp_path / "shar", tmp_path / "out", codec, rank=0, world_size=1, batching=BATCHING,
                      num_workers=0, progress=False)
    summary = merge(tmp_path / "out")
    assert summary.counts["skipped:silent"] == 1 and summary.sequences == 1
    (tokens,) = read_sequences(tmp_path / "out" / "merged")
    assert tokens[-1 - len(load_text_tokenizer().encode("seven")):-1].tolist() == load_text_tokenizer().encode("seven")
    assert cache_path(tmp_path / "out", 0).is_file()


def lhotse_recipe_shar(root: Path) -> Path:
    """What a lhotse recipe writes: one long recording (three story sentences with silence between them),
    its supervisions, `trim_to_supervisions`, then `CutSet.to_shar` (which stores each cut's own audio with
    start 0). The supervision ids sort against time order, so an order by id would show."""
    import soundfile
    from lhotse import CutSet, Recording, RecordingSet, SupervisionSegment, SupervisionSet

    (root / "in").mkdir(parents=True)
    pieces, texts = [], []
    for name, text in write_story(root / "in", 3):
        wave, rate = soundfile.read(root / "in" / name, dtype="float32")
        pieces += [wave, np.zeros(rate // 4, np.float32)]
        texts.append(text)
    long = np.concatenate(pieces)
    soundfile.write(root / "long.wav", long, rate, subtype="PCM_16")
    recording = Recording.from_file(root / "long.wav", recording_id="talk")
    sups, start = [], 0.0
    for index, (piece, text) in enumerate(zip(pieces[::2], texts, strict=True)):
        sups.append(SupervisionSegment(f"talk-{'cba'[index]}", "talk", start, piece.size / rate, text=text,
                                       language="en"))
        start += (piece.size + rate // 4) / rate
    cuts = CutSet.from_manifests(RecordingSet.from_recordings([recording]),
                                 SupervisionSet.from_segments(sups)).trim_to_supervisions(keep_overlapping=False)
    (root / "shar").mkdir()
    cuts.to_shar(root / "shar", fields={"recording": "flac"}, shard_size=10)
    return root / "shar"


def test_a_lhotse_recipe_shar_keeps_recording_identity_and_interleaves_in_time_order(codec, tmp_path):
    # lhotse's own to_shar output: the clips are the recording's (not one source per cut), numbered in
    # the recipe's cut order (to_shar sets every start to 0), so interleave builds the story's run as it
    # does for mmtok's own Shar. A Shar's cuts manifest given to `audio convert` points to encode --shar.
    import pyarrow.parquet as pq

    from mmtok.cli import main

    shar = lhotse_recipe_shar(tmp_path)
    encode_audio_rank(shar, tmp_path / "enc", codec, rank=0, world_size=1, batching=BATCHING, num_workers=0,
                      progress=False)
    rows = pq.read_table(cache_path(tmp_path / "enc", 0)).to_pylist()
    assert [(r["cut_id"], r["source_id"], r["clip"]) for r in rows] == [("talk-c", "talk", 0), ("talk-b", "talk", 1),
                                                                         ("talk-a", "talk", 2)]
    summary = interleave(tmp_path / "enc", tmp_path / "il", progress=False)
    assert summary.counts["runs_of_3+"] == 1
    out = tmp_path / "converted"
    assert main(["audio", "convert", str(shar / "cuts.000000.jsonl.gz"), "--out", str(out), "--no-progress"]) == 2
    details = [json.loads(line)["detail"] for path in (out / "dropped").iterdir() for line in path.open()]
    assert len(details) == 3 and all("encode the Shar directory with `mmtok encode --modality audio --shar" in d
                                     for d in details)
    assert sum(SPECIAL["<|stt_continue|>"] in s.tolist() for s in read_sequences(tmp_path / "il" / STAGE)) == 2


def test_a_cut_with_two_supervisions_joins_their_texts_in_start_order():
    from lhotse import MonoCut, SupervisionSegment

    from mmtok.encode.audio import clip_text
    from mmtok.text import load_text_tokenizer

    tokenizer = load_text_tokenizer()
    sups = [SupervisionSegment("b", "r", 1.0, 1.0, text="world", language="de"),
            SupervisionSegment("a", "r", 0.0, 1.0, text="hello", language="en")]
    ids, language, _ = clip_text(MonoCut("c", 0.0, 2.0, 0, supervisions=sups), tokenizer)
    assert ids.tolist() == tokenizer.encode("hello world") and language == "en"


def test_a_clip_too_long_to_encode_is_a_named_skip_and_the_rank_finishes(shar, codec, one_rank, tmp_path):
    # The memory bound: a clip over --max-clip-duration is never loaded or encoded (a 2-hour recording
    # would need ~22 GB); it is counted, named in the merged skip list, and every other clip is written.
    from lhotse import CutSet

    cuts = {c.id: c.duration for shard in discover_shards(shar)[0] for c in CutSet.from_file(shard.cuts_path)}
    limit = sorted(cuts.values())[-2] - 1e-3  # the two longest clips are over the limit
    over = sorted(k for k, d in cuts.items() if d > limit)
    out = tmp_path / "out"
    encode_audio_rank(shar, out, codec, rank=0, world_size=1, num_workers=1, progress=False,
                      batching=Batching(max_duration=4.0, num_buckets=3, seed=0, max_clip_duration=limit))
    summary = merge(out)
    assert summary.counts["skipped:too_long"] == len(over) == 2
    skipped = [json.loads(line) for line in (out / "merged.skipped.jsonl").read_text().splitlines()]
    assert sorted(s["key"] for s in skipped if s["reason"] == "too_long") == over
    assert all("--max-clip-duration" in s["detail"] and s["source"].endswith(".tar") for s in skipped)
    assert summary.counts["encoded"] == len(cuts) - 2


def test_a_rerun_with_other_settings_is_refused_even_when_every_part_is_finished(shar, codec, one_rank):
    from mmtok.errors import MmtokError

    with pytest.raises(MmtokError, match=r"a part of another run: sequences \(recorded 'auto', now 'both'\)"):
        encode_audio_rank(shar, one_rank, codec, rank=0, world_size=1, batching=BATCHING, sequences="both",
                          num_workers=0, progress=False)


def test_the_cli_summary_goes_to_stderr_and_json_prints_the_rank_result(shar, checkpoint, one_rank, tmp_path, capsys):
    from mmtok.cli import main

    command = ["encode", "--modality", "audio", "--shar", str(shar), "--checkpoint", str(checkpoint), "--out",
               str(tmp_path), "--device", "cpu", "--world-size", "3", "--num-workers", "0", "--no-progress",
               "--no-take-over"]
    capsys.readouterr()
    assert main([*command, "--rank", "0"]) == 0
    headline, job_view = summary_lines(capsys.readouterr(), "encode (audio)")
    assert headline.startswith("mmtok encode (audio): rank 0/3: 1 own shard (1 to do), ") and "mmtok status" in job_view
    for rank in (1, 2):
        assert main([*command, "--rank", str(rank), "--json"]) == 0
        result = json_result(capsys.readouterr())
        assert set(result) == {  # the --json contract: a key renamed or lost breaks a user's script
            "rank", "world_size", "shards", "shards_to_do", "batches", "clips", "skipped", "flagged:uniform_codes",
            "wall_s", "device_busy_s", "loader_wait_s", "first_batch_s", "unfinished", "stopped", "taken_over",
            "held_by_others", "unfinished_failed", "take_over_failed"}
        assert (result["rank"], result["world_size"], len(result["shards"])) == (rank, 3, 1) and result["clips"] > 0
    merge(tmp_path)
    assert fingerprint(tmp_path) == fingerprint(one_rank)  # the command writes what the library call does


def test_another_text_tokenizer_than_the_conversions_is_refused_naming_both(shar, codec, tmp_path):
    from encodekit import chat_tokenizer
    from mmtok.errors import MmtokError

    other = chat_tokenizer(tmp_path / "chat")
    with pytest.raises(MmtokError, match=r"tokenized with another text tokenizer than --text-tokenizer: "
                                         r"tekken_240718\.json \(sha256 \w{12}\.\.\.\), not .*chat/tokenizer\.json"):
        encode_audio_rank(shar, tmp_path / "out", codec, rank=0, world_size=1, batching=BATCHING, num_workers=0,
                          text_tokenizer=str(other), progress=False)


def test_odd_custom_clip_fields_of_a_foreign_shar_are_numbered_as_foreign_cuts():
    from lhotse import MonoCut

    from mmtok.encode.audio import FOREIGN_CLIP_BASE, clip_numbers

    cuts = [MonoCut("a", 0.0, 1.0, 0, custom={"source_id": "s", "clip": 3}),
            MonoCut("b", 0.0, 1.0, 0, custom={"source_id": "s", "clip": "abc"}),
            MonoCut("c", 1.0, 1.0, 0, custom={"source_id": 7, "clip": None})]
    assert clip_numbers(cuts, 2) == [("s", 3), ("b", 2 * FOREIGN_CLIP_BASE), ("c", 2 * FOREIGN_CLIP_BASE)]


def test_a_rank_that_finished_its_shards_takes_over_the_others_and_a_stop_commits_and_exits_75(
        shar, checkpoint, one_rank, tmp_path, capsys, monkeypatch):
    # the stop is requested by the rank's own first encoded batch (SIGUSR1 to itself, handled on this thread
    # before the device loop takes the next batch): exactly one batch is committed, on every run
    import os

    import mmtok.encode.audio
    from mmtok.cli import main
    from mmtok.formats.partdir import is_done, part_dir
    from mmtok.launch import STOPPED_EXIT

    command = ["encode", "--modality", "audio", "--shar", str(shar), "--checkpoint", str(checkpoint), "--out",
               str(tmp_path), "--device", "cpu", "--world-size", "3", "--num-workers", "0", "--no-progress",
               "--max-duration", str(BATCHING.max_duration), "--num-buckets", str(BATCHING.num_buckets),
               "--bucket-seed", str(BATCHING.seed)]
    encode_batch, encoded = mmtok.encode.audio.encode_batch, []

    def signalling(*args):
        encoded.append(1)
        if len(encoded) == 1:
            os.kill(os.getpid(), signal.SIGUSR1)
        return encode_batch(*args)

    monkeypatch.setattr(mmtok.encode.audio, "encode_batch", signalling)
    capsys.readouterr()
    assert main([*command, "--rank", "1", "--json"]) == STOPPED_EXIT
    captured = capsys.readouterr()
    result = json_result(captured)
    (own,) = result["shards"]
    assert result["stopped"] == {"signal": "SIGUSR1", "shards": [own]} and len(encoded) == 1
    assert committed_units(tmp_path) == 1 and not is_done(part_dir(tmp_path, own))
    assert f"stopped on SIGUSR1 before finishing shard(s) {own} " in captured.err
    monkeypatch.setattr(mmtok.encode.audio, "encode_batch", encode_batch)
    assert main([*command, "--rank", "0", "--json"]) == 0  # its own shard, then the others from the last
    result = json_result(capsys.readouterr())
    others = sorted({0, 1, 2} - set(result["shards"]))
    assert sorted(result["taken_over"]) == others and result["stopped"] is None
    assert all(is_done(part_dir(tmp_path, index)) for index in range(3))
    merge(tmp_path)
    assert fingerprint(tmp_path) == fingerprint(one_rank)  # the stopped shard resumed from its commit


SLOW_LOADER = """
import sys, time
import mmtok.encode.audio as audio
load = audio.load_batch
audio.load_batch = lambda request: (time.sleep(1.0), load(request))[1]  # a loader slower than the device
from mmtok.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_stopped_while_its_loader_workers_are_busy_exits_75_and_leaves_no_worker(shar, checkpoint, tmp_path):
    # found by an attack: loader workers that ignored SIGTERM kept the stopped process from exiting (the
    # DataLoader ends its workers with SIGTERM); the signal lands after the first commit, with a loader process
    # busy on the next batch
    command = [sys.executable, "-c", SLOW_LOADER, *encode_command(shar, checkpoint, tmp_path)[3:]]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while committed_units(tmp_path) < 1:
        assert process.poll() is None and time.monotonic() < deadline, process.stderr.read()
        time.sleep(0.05)
    process.send_signal(signal.SIGUSR1)
    try:
        _, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError("the stopped rank did not exit") from None
    assert process.returncode == 75 and "stopped on SIGUSR1" in err and "Traceback" not in err, err
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout  # a loader worker
    assert left == ""


def test_the_carried_clips_keep_their_byte_layout_and_read_back():
    """carry.bin of a part begun by an earlier mmtok must resume: position (int64), a 0 (int32), the number of ids
    (int32), the skip text's length (uint16), the text, the ids -- little-endian, clip after clip."""
    from mmtok.encode.audio import MAX_SKIP_TEXT, pack_clips, unpack_clips

    ids = np.array([262_400, 262_401], np.int32)
    packed = pack_clips([(7, "", ids), (8, "silent: digital silence", None)])
    assert packed == (struct.pack("<qiiH", 7, 0, 2, 0) + ids.astype("<i4").tobytes()
                      + struct.pack("<qiiH", 8, 0, 0, 23) + b"silent: digital silence")
    back = list(unpack_clips(packed + pack_clips([(9, "decode_error: " + "é" * MAX_SKIP_TEXT, None)])))
    assert [(position, skip) for position, skip, _ in back[:2]] == [(7, ""), (8, "silent: digital silence")]
    assert back[0][2].tolist() == ids.tolist() and back[1][2].size == 0
    assert len(back[2][1].encode()) <= MAX_SKIP_TEXT and back[2][1].startswith("decode_error: é")  # cut whole


def test_a_stopped_device_loop_waits_for_the_prefetch_thread_before_it_goes_on():
    # Left running, the prefetch thread could still be inside the DataLoader at interpreter exit: the process then
    # aborted (exit 134) after a stop had committed everything. Closing the batches now waits for its batch in flight.
    import threading

    from mmtok.encode import audio

    slow = threading.Event()

    def batches():
        yield {"unit": 0}
        yield {"unit": 1}
        slow.wait(1.0)  # a batch still loading when the device loop stops
        yield {"unit": 2}

    loop = audio.prefetched(batches())
    assert next(loop) == {"unit": 0}
    loop.close()
    assert not [t for t in threading.enumerate() if t.name == "mmtok-prefetch" and t.is_alive()]
