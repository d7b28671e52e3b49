"""Small real-speech corpora for the audio tests, built fresh in a temporary folder.

Speech: asterisk's spoken digits (8 kHz, known words), alsa-utils' "Front Center" (48 kHz) and
espeak-ng sentences with known text in several languages (22,050 Hz). Planted bad inputs: digital
silence, a NaN sample, a zero-length WAV, undecodable bytes and an over-long clip.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import soundfile

from realmedia import ASTERISK_DIR, alsa_sounds, espeak

DIGITS = {"1": "one", "2": "two", "3": "three", "4": "four", "5": "five", "6": "six", "7": "seven", "8": "eight"}
STORY = [  # one recording, four consecutive clips (espeak English)
    "The ship left the harbour at dawn.",
    "By noon the wind had turned against it.",
    "The crew lowered the sails and waited.",
    "At dusk they saw the lighthouse again.",
]
MULTILINGUAL = [("de", "Guten Morgen, wie geht es dir?"), ("fr", "Le chat dort sur la chaise.")]
PLANTED = {"silent.wav": "silent", "nan.wav": "non_finite", "empty.wav": "zero_length",
           "broken.wav": "decode_error", "long.wav": "too_long"}


def digit(word_key: str) -> Path:
    return ASTERISK_DIR / "digits" / f"{word_key}.wav"


def read(path: Path) -> tuple[np.ndarray, int]:
    samples, rate = soundfile.read(path, dtype="float32", always_2d=False)
    return samples, rate


def write_formats(folder: Path) -> dict[str, str]:
    """Digits 1-4 in WAV, FLAC, OGG/Opus and MP3 (8 kHz sources); returns file name -> text."""
    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    for key, (ext, fmt, subtype) in zip("1234", [("wav", "WAV", "PCM_16"), ("flac", "FLAC", "PCM_16"),
                                                  ("opus", "OGG", "OPUS"), ("mp3", "MP3", "MPEG_LAYER_III")],
                                        strict=True):
        samples, rate = read(digit(key))
        name = f"digit{key}.{ext}"
        soundfile.write(folder / name, samples, rate, format=fmt, subtype=subtype)
        texts[name] = DIGITS[key]
    return texts


def write_story(folder: Path, sentences: int = len(STORY)) -> list[tuple[str, str]]:
    """The first `sentences` STORY sentences as story/partN.wav (espeak-ng, 22,050 Hz); (name, text) in order."""
    (folder / "story").mkdir(parents=True, exist_ok=True)
    names = []
    for index, sentence in enumerate(STORY[:sentences]):
        name = f"story/part{index}.wav"
        espeak(sentence, folder / name, "en")
        names.append((name, sentence))
    return names


def write_planted(folder: Path) -> None:
    """The bad inputs of PLANTED (long.wav is twelve spoken digits back to back, about 10 s)."""
    folder.mkdir(parents=True, exist_ok=True)
    soundfile.write(folder / "silent.wav", np.zeros(16_000, np.float32), 16_000, subtype="PCM_16")
    speech, rate = read(digit("5"))
    speech = speech.astype(np.float32)
    speech[len(speech) // 2] = np.nan
    soundfile.write(folder / "nan.wav", speech, rate, subtype="FLOAT")
    soundfile.write(folder / "empty.wav", np.zeros(0, np.float32), 16_000, subtype="PCM_16")
    (folder / "broken.wav").write_bytes(b"RIFF\x10\x00\x00\x00WAVEjunk" + bytes(range(256)) * 4)
    long = np.concatenate([read(digit(k))[0] for k in "678567812345"])
    soundfile.write(folder / "long.wav", long, 8000, subtype="PCM_16")


def build_directory_corpus(root: Path) -> tuple[Path, Path, dict]:
    """A directory source + its TSV transcript table; returns (dir, table, expected) where expected
    maps cut id -> {"text", "rate", "language", "target_language", "source_id", "clip"}."""
    root.mkdir(parents=True, exist_ok=True)
    expected: dict[str, dict] = {}
    alsa = next(p for p in alsa_sounds() if p.name == "Front_Center.wav")
    (root / "Front_Center.wav").write_bytes(alsa.read_bytes())
    expected["Front_Center"] = {"text": None, "rate": 48_000, "source_id": "Front_Center", "clip": 0}
    rows = []
    for name, text in write_formats(root).items():
        stem = name.rsplit(".", 1)[0]
        rows.append({"path": name, "text": text, "language": "en"})
        expected[stem] = {"text": text, "rate": 8000, "language": "en", "source_id": stem, "clip": 0}
    for index, (name, text) in enumerate(write_story(root)):
        rows.append({"path": name, "text": text, "recording_id": "story", "clip": str(index), "language": "en"})
        expected[name.rsplit(".", 1)[0]] = {"text": text, "rate": 22_050, "language": "en", "source_id": "story",
                                           "clip": index}
    for voice, text in MULTILINGUAL:
        name = f"speech_{voice}.wav"
        espeak(text, root / name, voice)
        rows.append({"path": name, "text": "Translated: " + text, "language": voice, "target_language": "en"})
        expected[f"speech_{voice}"] = {"text": "Translated: " + text, "rate": 22_050, "language": voice,
                                       "target_language": "en", "source_id": f"speech_{voice}", "clip": 0}
    write_planted(root / "bad")
    table = root.parent / f"{root.name}.tsv"
    columns = ["path", "text", "recording_id", "clip", "start", "end", "language", "target_language"]
    lines = ["\t".join(columns)] + ["\t".join(str(row.get(c, "")) for c in columns) for row in rows]
    table.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return root, table, expected


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_audio_by_content(folder: Path) -> tuple[dict[str, str], dict[str, int]]:
    """Spoken digits whose names do not say "audio" (`.oga`, Ogg and WAV without extension, `.WAV`,
    `.aiff`) next to files that are not audio (text, random bytes, a `.vox` name libsndfile would read
    as headerless raw). Returns (audio file name -> spoken word, non-audio files by extension)."""
    folder.mkdir(parents=True, exist_ok=True)
    audio = {"one.oga": ("1", "OGG", "VORBIS"), "two": ("2", "OGG", "VORBIS"), "THREE.WAV": ("3", "WAV", "PCM_16"),
             "four.aiff": ("4", "AIFF", "PCM_16"), "five": ("5", "WAV", "PCM_16")}
    for name, (key, fmt, subtype) in audio.items():
        samples, rate = read(digit(key))
        soundfile.write(folder / name, samples, rate, format=fmt, subtype=subtype)
    (folder / "notes.txt").write_text("recorded on a Tuesday\n", encoding="utf-8")
    (folder / "LICENSE").write_text("public domain\n", encoding="utf-8")
    (folder / "cover.jpg").write_bytes(bytes(range(256)) * 8)
    (folder / "speech.vox").write_text("not audio either\n", encoding="utf-8")
    ignored = {"txt": 1, "(no extension)": 1, "jpg": 1, "vox": 1}
    return {name: DIGITS[key] for name, (key, _, _) in audio.items()}, ignored
