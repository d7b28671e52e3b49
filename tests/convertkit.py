"""Test support for `mmtok audio convert`: small inputs (tars, re-encoded audio files) and what a conversion
wrote, read back (its cuts, report, shard bytes and drop records)."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from dataclasses import asdict
from pathlib import Path

import soundfile

from audio_corpus import read
from mmtok.formats import skips


def load_cuts(out: Path) -> list:
    from lhotse import CutSet

    return list(CutSet.from_shar(in_dir=out / "shar"))


def report(out: Path) -> dict:
    return json.loads((out / "conversion.json").read_text())


def stored_bytes(out: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted((out / "shar").iterdir()):
        opener = gzip.open if path.suffix == ".gz" else open
        with opener(path, "rb") as handle:
            files[path.name] = handle.read()
    return files


def make_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as archive:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return path


def encoded(path: Path, fmt: str = "FLAC") -> bytes:
    samples, rate = read(path)
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt)
    return buffer.getvalue()


def dropped_records(out: Path) -> list[dict]:
    """The skip records of a conversion's dropped/ lists, read by the one reader of skip files."""
    return [asdict(record) for path in sorted((out / "dropped").glob("*.jsonl")) for record in skips.read(path)]


def assert_counts_add_up(counts: dict) -> None:
    skipped = sum(v for k, v in counts.items() if k.startswith(("skipped:", "ignored:")))
    assert counts["in"] == counts.get("written", 0) + skipped, counts
