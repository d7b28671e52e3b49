"""A part directory: one resumable Megatron dataset per encode *part*, its layout and its small files.

An output directory holds `OUT/parts/part-00003/`, one per part (image encode and `mmtok sft`: part = work
item; audio encode: part = input Shar shard). A part directory contains

  identity.json     what the part is made from (plan/input fingerprints, codec incl. precision, text
                    tokenizer, part number, ...); written once, compared on every resume
  tokens.bin        int32 tokens, one sequence per document, appended per unit
  provenance.jsonl  one JSON line per sequence (line i describes sequence i), appended per unit
  skipped.jsonl     one skip record per input that did not become tokens (`mmtok.formats.skips`),
                    appended per unit
  items.ids         int32 ids of *items*: pieces a later stage assembles into sequences (the image
                    blocks and text templates of documents with several images, which merge
                    assembles); appended per unit
  items.jsonl       one JSON line per item (what it is, its `length` in items.ids), appended per unit
  carry.bin         opaque bytes the writer carries between units (the audio encoder: a shard's encoded
                    clips until the shard is assembled, `mmtok.encode.audio.pack_clips`); see
                    `mmtok.formats.commitlog.PartWriter.carry`
  commits.log       one record per committed unit: `<json>\\t<crc32 hex>\\n`
  tokens.idx        written by `PartWriter.finish` (atomic) -- only when the part has tokens: megatron-core
                    cannot open an empty dataset, so a part without sequences has no tokens.bin/.idx
                    and its stats say `"dataset": false`
  stats.json        written by `finish` (atomic)
  DONE              written last by `finish` (atomic)
  .lock             the writer lock (`mmtok.fsutil.WriterLock`): one process writes a part at a time

The one place that knows this layout: the names of a part's files, where parts live (`part_dir`), the
identity a part is made from (`identity.json`, written once and compared on every resume), the finished part's
`stats.json` and `DONE`, and the writer lock. What is appended and committed unit by unit, and checked against
its checksums, is `mmtok.formats.commitlog`'s; the finished parts of one run are listed by `mmtok.formats.parts`.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path
from typing import Any

from mmtok.errors import DamagedFile, MmtokError, brief
from mmtok.formats.megatron import bin_path, idx_path
from mmtok.fsutil import WriterLock, atomic_write_bytes, atomic_write_json, read_json_object, required

PART_FORMAT = "mmtok-part/3"  # /2: per-unit checksums, skipped.jsonl, no empty dataset; /3: items
TOKENS = "tokens"  # dataset prefix inside a part directory: tokens.bin / tokens.idx
TOKENS_BIN = bin_path(TOKENS).name
IDENTITY = "identity.json"
PROVENANCE = "provenance.jsonl"
SKIPPED = "skipped.jsonl"
ITEM_IDS = "items.ids"
ITEMS = "items.jsonl"
CARRY = "carry.bin"
COMMITS = "commits.log"
STATS = "stats.json"
DONE = "DONE"
PARTS_DIR = "parts"  # OUT/parts/part-00003: see part_dir
PART_NAME = "part-"


# -- where parts live -----------------------------------------------------------------------------------------------
def parts_root(out: str | os.PathLike) -> Path:
    """`OUT/parts`, where every part of an output lives."""
    return Path(out) / PARTS_DIR


def part_dir(out: str | os.PathLike, part: int) -> Path:
    """`OUT/parts/part-00003` for part 3."""
    return parts_root(out) / f"{PART_NAME}{part:05d}"


def part_directories(out: str | os.PathLike) -> list[tuple[int, Path]]:
    """(part number, directory) of every `part-NNNNN` directory of `out`, finished or not, in part order."""
    found = []
    for directory in parts_root(out).glob(f"{PART_NAME}*"):
        number = directory.name[len(PART_NAME):]
        if directory.is_dir() and number.isdigit():
            found.append((int(number), directory))
    return sorted(found)


def part_prefix(directory: str | os.PathLike) -> Path:
    """The Megatron dataset prefix of a part (`.bin`/`.idx` appended by the format module)."""
    return Path(directory) / TOKENS


# -- one writer per part --------------------------------------------------------------------------------------------
def lock_part(directory: str | os.PathLike) -> WriterLock:
    """The writer lock of a part directory (see `mmtok.formats.commitlog.PartWriter`)."""
    return WriterLock(directory, f"part {directory}")


def check_part_free(directory: str | os.PathLike) -> None:
    """Refuse at once when another process writes the part (see WriterLock.check_free)."""
    WriterLock.check_free(directory, f"part {directory}")


class NoLock:
    """The lock of a part only one process can know: a lock-free writer's private copy (see `PartWriter`)."""

    def release(self) -> None:
        pass


# -- identity.json: what a part is made from ------------------------------------------------------------------------
def write_identity(directory: str | os.PathLike, identity: dict) -> None:
    """identity.json, once, when a part is started (atomic)."""
    atomic_write_json(Path(directory) / IDENTITY, identity)


def read_identity(directory: str | os.PathLike) -> dict:
    """A part's identity.json: an object whose `part` and `num_parts` (what every reader needs before the
    part's checksums are verified) are integers, whose `modality` (when there) is a string and whose
    `part_batches` (when there) is [start, end] of batch numbers; DamagedFile naming the file and the key
    otherwise."""
    path = Path(directory) / IDENTITY
    identity = _read_object(path)
    for key in ("part", "num_parts"):
        required(identity, key, int, path)
    required(identity, "modality", str, path, default=None)
    span = required(identity, "part_batches", list, path, default=None)
    if span is not None and not (len(span) == 2 and all(type(b) is int and b >= 0 for b in span)
                                 and span[0] <= span[1]):
        raise DamagedFile(f"{path}: key 'part_batches' must be [start, end] of batch numbers, not "
                          f"{brief(json.dumps(span), 60)}; restore the file or rerun the stage that wrote it")
    return identity


def check_identity(directory: str | os.PathLike, identity: dict) -> None:
    """Refuse (naming the first differing key) when the part in `directory` was made from anything other
    than `identity` -- also for a finished part, so a rerun with other settings is never silently a no-op."""
    directory = Path(directory)
    try:
        recorded = json.loads((directory / IDENTITY).read_text("utf-8"))
    except (OSError, ValueError) as err:
        raise MmtokError(f"{directory / IDENTITY}: unreadable ({err}); delete {directory} to re-encode this "
                         "part") from None
    difference = identity_difference(recorded, normalized({**identity, "format": PART_FORMAT}))
    if difference:
        raise MmtokError(
            f"{directory}: refusing to resume: {difference}. This part was started with different "
            f"inputs or settings; rerun with the original ones, or use another --out (or delete "
            f"{directory}) to start over."
        )


def identity_difference(recorded: Any, current: Any, path: str = "") -> str | None:
    """The first key path where two identities differ with both values, or None when equal."""
    if isinstance(recorded, dict) and isinstance(current, dict):
        for key in sorted(set(recorded) | set(current), key=str):
            where = f"{path}.{key}" if path else str(key)
            if key not in recorded or key not in current:
                have = "absent" if key not in recorded else repr(recorded[key])
                now = "absent" if key not in current else repr(current[key])
                return f"{where} (recorded {have}, now {now})"
            found = identity_difference(recorded[key], current[key], where)
            if found:
                return found
        return None
    if recorded != current:
        return f"{path or 'identity'} (recorded {recorded!r}, now {current!r})"
    return None


def normalized(obj: Any) -> Any:
    """JSON round trip: tuples become lists, keys strings, so identities compare as stored."""
    return json.loads(json.dumps(obj, sort_keys=True))


# -- a finished part: stats.json and DONE ---------------------------------------------------------------------------
def write_finished(directory: str | os.PathLike, stats: dict, done: dict) -> None:
    """stats.json, then DONE: `done` with the CRC-32 of stats.json's bytes (`stats_crc`). DONE is written last
    (atomic): a part is finished once it is there (`is_done`)."""
    directory = Path(directory)
    atomic_write_json(directory / STATS, stats)
    done = {**done, "stats_crc": zlib.crc32((directory / STATS).read_bytes())}
    atomic_write_bytes(directory / DONE, (json.dumps(done, sort_keys=True) + "\n").encode())


def is_done(directory: str | os.PathLike) -> bool:
    return (Path(directory) / DONE).is_file()


def read_done(directory: str | os.PathLike) -> dict:
    """A finished part's DONE record (ValueError when it is not a JSON object)."""
    done = json.loads((Path(directory) / DONE).read_text("utf-8"))
    if not isinstance(done, dict):
        raise ValueError(f"a JSON {type(done).__name__}, not an object")
    return done


def read_stats(directory: str | os.PathLike) -> dict:
    """A finished part's stats.json: an object whose `counts` (when there) is an object and `dataset` (when
    there) a boolean; DamagedFile naming the file and the key otherwise."""
    path = Path(directory) / STATS
    stats = _read_object(path)
    required(stats, "counts", dict, path, default={})
    required(stats, "dataset", bool, path, default=True)
    return stats


def _read_object(path: Path) -> dict:
    """`read_json_object` of a file that must be there (FileNotFoundError names it otherwise)."""
    value = read_json_object(path)
    if value is None:
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    return value


def has_dataset(directory: str | os.PathLike) -> bool:
    """Whether a finished part has a tokens.bin/.idx (a part without tokens has none)."""
    return idx_path(part_prefix(directory)).is_file()
