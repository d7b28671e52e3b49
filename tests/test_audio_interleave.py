"""`mmtok audio interleave`: runs, the two copies, leftovers, routing and splitting, exact token layout."""

from __future__ import annotations

import json
from collections import Counter
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from mmtok.audio.interleave import LONG, STAGE, interleave
from mmtok.cli import main
from mmtok.errors import MmtokError
from mmtok.formats.audio_cache import CACHE_FORMAT, cache_path, checksum_path, write_cache
from mmtok.formats.interleave import DatasetEntry
from mmtok.formats.megatron import read_sequences
from mmtok.fsutil import sha256_file
from mmtok.vocab import VocabLayout

LAYOUT = VocabLayout(131_072)
BOS, EOS = 1, 2
SPECIAL = LAYOUT.special_ids()
A_START, A_END = SPECIAL["<|audio_start|>"], SPECIAL["<|audio_end|>"]
STT_CONT, TTS_CONT = SPECIAL["<|stt_continue|>"], SPECIAL["<|tts_continue|>"]
TRANSCRIBE, TRANSLATE = SPECIAL["<|stt_transcribe|>"], SPECIAL["<|stt_translate|>"]

# source -> [(clip number, audio length, text length (-1 = no text), target language)]
SOURCES = {
    "five": [(c, 30 + c, 5 + c, None) for c in range(5)],
    "pair": [(0, 20, 4, None), (1, 21, 4, None)],
    "single": [(0, 25, 6, None)],
    "gappy": [(c, 12, 3, None) for c in (0, 1, 2, 4, 5, 6, 7)],       # runs of 3 and 4
    "untexted": [(0, 10, 3, None), (1, 10, -1, None), (2, 10, 3, None)],  # no-text clip splits the run
    "translated": [(0, 15, 5, "en"), (1, 15, 5, None), (2, 15, 5, None)],  # translation breaks the run
    "long": [(c, 400, 50, None) for c in range(6)],
}


def clip_key(index: int) -> int:
    """Each clip gets its own audio code and text id, so sequences can be parsed back to clips."""
    return index


def make_cache(out: Path, sources: dict = SOURCES, split: int = 9) -> dict[int, tuple[str, int]]:
    """Two cache parts split after row `split` (for SOURCES: inside `gappy`); returns key -> (source, clip number)."""
    rows, keys = [], {}
    for source, clips in sources.items():
        for number, audio_length, text_length, target in clips:
            key = len(keys)
            keys[key] = (source, number)
            rows.append({"cut_id": f"{source}-{number}", "source_id": source, "clip": number, "part": 0,
                         "position": 0, "duration": audio_length / 40, "language": "de" if target else "en",
                         "target_language": target,
                         "audio_ids": LAYOUT.audio_ids(np.full(audio_length, key)),
                         "text_ids": None if text_length < 0 else np.full(text_length, 1000 + key, np.int32)})
    meta = {"num_parts": 2, "vocab": LAYOUT.to_dict(), "format": CACHE_FORMAT, "codec": {"name": "test"},
            "text_tokenizer": {"name": "test", "bos_id": BOS, "eos_id": EOS}, "trim": 5}
    for part, chunk in enumerate((rows[:split], rows[split:])):
        for position, row in enumerate(chunk):
            row.update(part=part, position=position)
        write_cache(cache_path(out, part), chunk, {**meta, "part": part})
    return keys


def parse(sequence: np.ndarray) -> list[tuple[str, int]]:
    """A sequence -> [(kind, clip key)] with kind audio/text/transcribe-text/translate-text; checks the
    BOS/EOS placement and the separators exactly."""
    tokens = sequence.tolist()
    assert tokens[0] == BOS and tokens[-1] == EOS
    assert BOS not in tokens[1:] and EOS not in tokens[:-1]
    body, segments, i = tokens[1:-1], [], 0
    while i < len(body):
        if body[i] == A_START:
            end = body.index(A_END, i)
            codes = set(body[i + 1:end])
            assert len(codes) == 1
            segments.append(("audio", codes.pop() - LAYOUT.audio_offset))
            i = end + 1
        elif body[i] in (STT_CONT, TTS_CONT, TRANSCRIBE, TRANSLATE):
            segments.append(("sep", body[i]))
            i += 1
        else:
            run = i
            while run < len(body) and body[run] == body[i]:
                run += 1
            segments.append(("text", body[i] - 1000))
            i = run
    for (kind, value), (next_kind, _) in pairwise(segments):
        if kind == "sep":
            assert next_kind == ("audio" if value == TTS_CONT else "text")
        elif next_kind != "sep":
            raise AssertionError(f"two segments without a separator: {segments}")
    return segments


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("interleave")
    keys = make_cache(root / "enc")
    summary = interleave(root / "enc", root / "out", stage_max_tokens=300, max_tokens=900, progress=False)
    sequences = {name: list(read_sequences(root / "out" / name)) for name in (STAGE, LONG)}
    return root, keys, summary, sequences


def usable(keys) -> set[int]:
    texted = {(s, c) for s, clips in SOURCES.items() for c, _, t, target in clips if t >= 0}
    return {k for k, sc in keys.items() if sc in texted}


def test_every_clip_is_audio_exactly_once_and_every_sequence_ends_with_text(built):
    _, keys, _, sequences = built
    audio, text = Counter(), Counter()
    for sequence in sequences[STAGE] + sequences[LONG]:
        segments = parse(sequence)
        assert segments[-1][0] == "text"
        for kind, key in segments:
            (audio if kind == "audio" else text if kind == "text" else Counter())[key] += 1
    assert set(audio) == usable(keys) and set(audio.values()) == {1}
    leftovers = {max(k for k in run) for run in runs(keys) if len(run) >= 3}
    assert {k: n for k, n in text.items() if n != 1} == {k: 2 for k in leftovers}
    assert set(text) == usable(keys)


def runs(keys) -> list[list[int]]:
    """The runs the module docstring defines, computed independently from SOURCES."""
    found = []
    for source, clips in SOURCES.items():
        current = []
        for number, _, text_length, target in clips:
            key = next(k for k, sc in keys.items() if sc == (source, number))
            breaks = text_length < 0 or bool(target) or (current and keys[current[-1]][1] != number - 1)
            if breaks and current:
                found.append(current)
                current = []
            if text_length >= 0 and not target:
                current.append(key)
        if current:
            found.append(current)
    return found


def key_of(keys, source: str, number: int) -> int:
    return next(k for k, sc in keys.items() if sc == (source, number))


def test_run_of_three_gives_two_shifted_copies_and_a_transcribed_leftover(built):
    _, keys, _, sequences = built
    c0, c1, c2 = (key_of(keys, "gappy", n) for n in (0, 1, 2))

    def audio(key):
        return [A_START, *[LAYOUT.audio_offset + key] * 12, A_END]

    def text(key):
        return [1000 + key] * 3

    expected = [
        [BOS, *audio(c0), STT_CONT, *text(c1), EOS],
        [BOS, *text(c0), TTS_CONT, *audio(c1), STT_CONT, *text(c2), EOS],
        [BOS, *audio(c2), TRANSCRIBE, *text(c2), EOS],
    ]
    stage = [s.tolist() for s in sequences[STAGE]]
    start = stage.index(expected[0])
    assert stage[start:start + 3] == expected


def test_translation_clips_get_the_translate_token_and_break_runs(built):
    _, keys, summary, sequences = built
    key = key_of(keys, "translated", 0)
    translated = [parse(s) for s in sequences[STAGE] if TRANSLATE in s.tolist()]
    assert translated == [[("audio", key), ("sep", TRANSLATE), ("text", key)]]
    assert summary.counts["translations"] == 1 and summary.counts["skipped:no_text"] == 1


def test_sequences_are_routed_by_length_and_long_ones_split_at_clip_boundaries(built):
    _, keys, summary, sequences = built
    assert all(s.size <= 300 for s in sequences[STAGE])
    assert sequences[LONG] and all(300 < s.size <= 900 for s in sequences[LONG])
    long_keys = {key_of(keys, "long", n) for n in range(6)}
    pieces = [parse(s) for s in sequences[LONG]]
    assert all({k for kind, k in p if kind != "sep"} <= long_keys for p in pieces)
    assert summary.counts["split_sequences"] == 2  # both copies of the 6-clip run exceed 900 tokens
    assert all(p[-1][0] == "text" for p in pieces)


def test_output_is_deterministic(built, tmp_path):
    root, _, _, _ = built
    interleave(root / "enc", tmp_path, stage_max_tokens=300, max_tokens=900, progress=False)
    for name in (STAGE, LONG):
        for suffix in (".bin", ".idx"):
            assert sha256_file(tmp_path / f"{name}{suffix}") == sha256_file(root / "out" / f"{name}{suffix}")


def test_missing_cache_part_is_refused(built, tmp_path):
    root, _, _, _ = built
    (tmp_path / "audio-cache").mkdir()
    for source in (cache_path(root / "enc", 0), checksum_path(cache_path(root / "enc", 0))):
        (tmp_path / "audio-cache" / source.name).write_bytes(source.read_bytes())
    with pytest.raises(MmtokError, match="part-00001"):
        interleave(tmp_path, tmp_path / "out", progress=False)


SHORT = {name: SOURCES[name] for name in ("five", "pair", "single", "untexted")}  # nothing over 300 tokens


def dataset_files(out: Path, name: str) -> list[str]:
    """Every file of set `name` in `out`, temporary ones included."""
    return sorted(p.name for p in out.glob(f"*{name}.*")) if out.exists() else []


def opens_in_megatron_core(prefix: Path) -> int:
    from mmtok.formats.megatron import import_indexed_dataset

    return len(import_indexed_dataset()(str(prefix)))


def test_a_set_without_sequences_is_not_written_and_the_metadata_says_so(tmp_path, capsys):
    make_cache(tmp_path / "enc", SHORT, split=4)
    assert main(["audio", "interleave", str(tmp_path / "enc"), "--out", str(tmp_path / "out"), "--stage-max-tokens",
                 "300", "--max-tokens", "900", "--no-progress"]) == 0
    assert dataset_files(tmp_path / "out", LONG) == []
    recorded = json.loads((tmp_path / "out" / "interleave.json").read_text())
    assert recorded["datasets"][LONG] == {"written": False, "sequences": 0, "tokens": 0,
                                          "reason": "no sequence over 300 tokens"}
    stage = recorded["datasets"][STAGE]
    assert stage["written"] and stage["sequences"] == opens_in_megatron_core(tmp_path / "out" / STAGE) > 0
    assert stage["tokens"] == recorded["counts"]["stage:tokens"]
    captured = capsys.readouterr()
    assert captured.err.startswith("mmtok audio interleave: ") and captured.out == ""
    assert "long-context: no sequence over 300 tokens -- not written" in captured.err


def test_a_stale_set_from_an_earlier_run_is_removed_when_the_new_run_has_none(built, tmp_path):
    root, _, _, _ = built
    interleave(root / "enc", tmp_path / "out", stage_max_tokens=300, max_tokens=900, progress=False)
    assert dataset_files(tmp_path / "out", LONG) == ["long-context.bin", "long-context.idx"]
    make_cache(tmp_path / "enc", SHORT, split=4)
    interleave(tmp_path / "enc", tmp_path / "out", stage_max_tokens=300, max_tokens=900, progress=False)
    assert dataset_files(tmp_path / "out", LONG) == []
    assert not json.loads((tmp_path / "out" / "interleave.json").read_text())["datasets"][LONG]["written"]


def test_only_long_sequences_leave_the_stage_set_unwritten(tmp_path):
    make_cache(tmp_path / "enc", {"long": SOURCES["long"]}, split=3)
    summary = interleave(tmp_path / "enc", tmp_path / "out", stage_max_tokens=300, max_tokens=900, progress=False)
    assert dataset_files(tmp_path / "out", STAGE) == []
    assert summary.datasets[STAGE] == DatasetEntry(False, 0, 0, "no sequence of at most 300 tokens")
    assert summary.to_json()["datasets"][STAGE] == json.loads((tmp_path / "out" / "interleave.json").read_text())[
        "datasets"][STAGE] == {"written": False, "sequences": 0, "tokens": 0,
                               "reason": "no sequence of at most 300 tokens"}
    assert summary.datasets[LONG].sequences == opens_in_megatron_core(tmp_path / "out" / LONG) > 0


def test_a_corpus_without_text_fails_naming_the_skips_and_writes_nothing(tmp_path, capsys):
    untexted = {"quiet": [(c, 20, -1, None) for c in range(4)], "silent": [(0, 30, -1, None)]}
    make_cache(tmp_path / "enc", untexted, split=2)
    argv = ["audio", "interleave", str(tmp_path / "enc"), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert "no sequence to interleave" in error and "skipped: no_text=5" in error and "--transcripts" in error
    assert not (tmp_path / "out").exists()
    with pytest.raises(MmtokError, match="none of its 5 clips gave a sequence"):
        interleave(tmp_path / "enc", tmp_path / "out", progress=False)


def test_inspect_of_an_unwritten_set_says_why(tmp_path):
    from mmtok.tools.inspect import inspect_path

    make_cache(tmp_path / "enc", SHORT, split=4)
    interleave(tmp_path / "enc", tmp_path / "out", stage_max_tokens=300, max_tokens=900, progress=False)
    with pytest.raises(MmtokError, match="no sequence over 300 tokens, so `mmtok audio interleave` did not write"):
        inspect_path(str(tmp_path / "out" / LONG))
