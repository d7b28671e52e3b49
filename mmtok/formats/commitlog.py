"""The commit log of a part: what a part appends per work unit, made durable and checksummed after every unit.

A part directory and its files are `mmtok.formats.partdir`'s (the layout is there); this module appends
tokens.bin, provenance.jsonl, skipped.jsonl, items.ids, items.jsonl and carry.bin through `PartWriter`, and
commits each unit with one record in commits.log.

Lock-free writing (file systems whose locks are node-local or missing): each writer writes its own copy of
a part, with `partdir.NoLock`, and publishes it finished by one atomic rename (`mmtok.formats.private_parts`).

Durability protocol of `commit`: the unit's tokens, provenance, skip and item lines, item ids and
carry bytes are appended
and fdatasync'ed, *then* the commit record is appended and fdatasync'ed. A record names the size
every file had after its unit, so a process killed at any instant resumes from the last complete
record: files are truncated back to that record's sizes and a torn (partial or corrupt) last record
is dropped. Everything a unit writes is a deterministic function of the unit, so the finished files
are byte-identical to those of an uninterrupted run.

Checked bytes: each record holds the CRC-32 of the bytes its unit appended to tokens.bin,
provenance.jsonl, skipped.jsonl, items.ids and items.jsonl, and the CRC-32 of the live carry.
`verify_part` re-reads a part against its records (on every resume and by merge), so bit rot or a
damaged copy is refused naming the part and the unit instead of being merged.
"""

from __future__ import annotations

import json
import os
import zlib
from array import array
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mmtok.errors import DamagedFile, MmtokError, brief
from mmtok.formats import skips
from mmtok.formats.megatron import TOKEN_DTYPE, check_tokens_fit, encode_index, idx_path, write_index
from mmtok.formats.partdir import (
    CARRY,
    COMMITS,
    DONE,
    IDENTITY,
    ITEM_IDS,
    ITEMS,
    PART_FORMAT,
    PROVENANCE,
    SKIPPED,
    STATS,
    TOKENS_BIN,
    NoLock,
    check_identity,
    is_done,
    lock_part,
    normalized,
    part_prefix,
    read_done,
    write_finished,
    write_identity,
)
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import (
    RESTORE,
    WriterLock,
    fsync_dir,
    required,
    required_count,
    required_counts,
    required_list,
    sync,
    with_filename,
    within,
)


def _encode_record(record: dict) -> bytes:
    body = json.dumps(record, sort_keys=True, separators=(",", ":")).encode("utf-8")
    return body + b"\t" + f"{zlib.crc32(body):08x}".encode() + b"\n"


def _decode_record(line: bytes) -> dict | None:
    """A commit record, or None for a torn/corrupt line."""
    if not line.endswith(b"\n"):
        return None
    body, _, crc = line[:-1].rpartition(b"\t")
    try:
        if int(crc, 16) != zlib.crc32(body):
            return None
        return json.loads(body)
    except (ValueError, RecursionError):  # RecursionError: nested too deep to be a record
        return None


def read_commits(directory: str | os.PathLike) -> tuple[list[dict], int]:
    """(complete records, byte length they span) of a part's commit log.

    Only the last line may be torn (a kill during its append); a bad record followed by good
    ones means the log was damaged by something other than a crash, and is refused.
    """
    path = Path(directory) / COMMITS
    if not path.is_file():
        return [], 0
    records: list[dict] = []
    good_bytes = 0
    lines = path.read_bytes().splitlines(keepends=True)
    for number, line in enumerate(lines):
        record = _decode_record(line)
        if record is None:
            if number != len(lines) - 1:
                raise MmtokError(f"{path}: commit record {number + 1} of {len(lines)} is corrupt but later records "
                                 "are intact (not a crash); delete the part directory to re-encode this part")
            break
        try:
            records.append(_follows(_checked(record, path, number + 1), records[-1] if records else None,
                                    within(path, f"record {number + 1}")))
        except DamagedFile as err:  # a part is not restored: it is encoded again
            raise DamagedFile(str(err).replace(RESTORE, f"delete {path.parent} to re-encode this part")) from None
        good_bytes += len(line)
    return records, good_bytes


def _fits(record) -> bool:
    """Whether a record has every key readers take, of its type, >= 0: the common case, checked fast (a status of a
    large job reads millions of records); `_checked` says what is wrong otherwise."""
    if type(record) is not dict:
        return False
    for key in _COUNTED:
        value = record.get(key)
        if type(value) is not int or not 0 <= value < _LIMIT:
            return False
    lengths, counts, crc = record.get("lengths"), record.get("counts"), record.get("crc")
    return (type(lengths) is list and type(counts) is dict and type(crc) is dict
            and all(type(n) is int and 0 <= n < _LIMIT for n in lengths)
            and all(type(n) is int and 0 <= n < _LIMIT for n in counts.values())
            and all(type(crc.get(name)) is int and 0 <= crc[name] < _LIMIT for name in APPENDED))


def _checked(record, path: Path, number: int) -> dict:
    """Commit record `number` (from 1) as every reader takes it: a unit number, the sequence lengths, the counts,
    the size of every file after its unit, their CRC-32s and the identity's -- all of them written by every part of
    this format. A CRC-32 shows a record was written whole, not that mmtok wrote it (parts come from other jobs):
    a record of another shape is DamagedFile naming the part's log, the record and the key."""
    if _fits(record):
        return record
    where = within(path, f"record {number}")
    if not isinstance(record, dict):
        raise DamagedFile(f"{where}: a JSON {type(record).__name__}, not a commit record; {RESTORE}")
    required_count(record, "unit", where)
    if any(n < 0 for n in required_list(record, "lengths", int, where)):
        raise DamagedFile(f"{where}: key 'lengths' holds a length below 0; {RESTORE}")
    required_counts(record, "counts", where)
    for key in _COUNTED[1:]:
        required_count(record, key, where)
    crc = required(record, "crc", dict, where)
    for name in APPENDED:
        required_count(crc, name, within(where, "crc"))
    numbers = [*((key, record[key]) for key in _COUNTED), *(("lengths", n) for n in record["lengths"]),
               *((f"counts.{key}", n) for key, n in record["counts"].items())]
    for key, value in numbers:
        if value >= _LIMIT:
            raise DamagedFile(f"{where}: {key} {brief(value, 30)} is past what an int64 holds; {RESTORE}")
    return record


def _follows(record: dict, previous: dict | None, where: str) -> dict:
    """`record`, after checking it against the record before it: a later unit, no appended file shorter than
    before, and tokens.bin longer by exactly the tokens of its lengths (a unit's sequences are its tokens)."""
    if previous is not None and record["unit"] <= previous["unit"]:
        raise DamagedFile(f"{where}: unit {record['unit']} does not follow the unit before it, {previous['unit']}; "
                          f"{RESTORE}")
    for key in APPENDED.values():
        before = previous[key] if previous is not None else 0
        if record[key] < before:
            raise DamagedFile(f"{where}: key {key!r} is {record[key]}, below the {before} of the record before; "
                              f"{RESTORE}")
    added = record["tokens_bytes"] - (previous["tokens_bytes"] if previous is not None else 0)
    tokens = sum(record["lengths"])
    if added != tokens * TOKEN_DTYPE.itemsize:
        raise DamagedFile(f"{where}: its lengths hold {tokens:,} tokens but tokens.bin grew by {added:,} bytes "
                          f"({TOKEN_DTYPE.itemsize} a token); {RESTORE}")
    return record


# Appended files of a part: name -> the commit-record key of its size. Their bytes are checksummed
# per unit; carry.bin is not (it is emptied when nothing in it is live) -- its live bytes have a
# running checksum instead (`carry_crc`).
APPENDED = {TOKENS_BIN: "tokens_bytes", PROVENANCE: "provenance_bytes", SKIPPED: "skipped_bytes",
            ITEM_IDS: "item_ids_bytes", ITEMS: "items_bytes"}
# The keys of a commit record that hold a count, size or CRC-32 (an integer >= 0), unit first
_COUNTED = ("unit", *APPENDED.values(), "carry_bytes", "carry_live", "carry_crc", "identity_crc")
_LIMIT = 1 << 63  # every number of a record fits an int64: what its readers' arrays, seeks and sums take


def _json_lines(records: list[dict]) -> bytes:
    return b"".join(json.dumps(r, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
                    for r in records)


def item_lines(records: list[dict], ids: list[np.ndarray]) -> bytes:
    """items.jsonl's lines: each item's record with the `length` of its ids in items.ids (read by `item_record`)."""
    return _json_lines([{**record, "length": int(found.size)} for record, found in zip(records, ids, strict=True)])


# The record of one line of items.jsonl (`item_lines`), its `length` included: json.loads itself, not a wrapper,
# since the item-index loop (`items.ItemLocations`) calls it once per item.
item_record = json.loads


def verify_part(directory: str | os.PathLike, records: list[dict] | None = None) -> list[dict]:
    """Check a part's files against its commit records: every unit's bytes by CRC-32, sizes,
    identity.json, and (when finished) tokens.idx. Raises MmtokError naming the part, the file and
    the unit on any damage; returns the records (the checked source of a part's counts and lengths)."""
    directory = Path(directory)
    if records is None:
        records, _ = read_commits(directory)
    _verify_identity(directory, records)
    for name, size_key in APPENDED.items():
        path = directory / name
        expected = records[-1].get(size_key, 0) if records else 0
        have = path.stat().st_size if path.exists() else 0
        if have < expected or (is_done(directory) and have != expected):
            raise MmtokError(f"{path}: {have} bytes but the commit log records {expected}; the part was damaged "
                             f"after it was written. Delete {directory} and re-encode this part.")
        if not expected:
            continue
        with open(path, "rb") as handle:
            start = 0
            for record in records:
                end = record[size_key]
                data = handle.read(end - start)
                if zlib.crc32(data) != record["crc"][name]:
                    raise MmtokError(f"{path}: the bytes of unit {record['unit']} do not match their checksum "
                                     f"(bit rot or a damaged copy). Delete {directory} and re-encode this part.")
                start = end
    if is_done(directory) and records and records[-1].get("tokens_bytes"):
        lengths = np.fromiter((n for record in records for n in record["lengths"]), np.int64)
        index = idx_path(part_prefix(directory))
        if not index.is_file() or index.read_bytes() != encode_index(lengths, TOKEN_DTYPE):
            raise MmtokError(f"{index}: missing or does not match the commit log. Delete {directory} and "
                             "re-encode this part.")
    return records


def part_verified_files(directory: str | os.PathLike) -> list[Path]:
    """The files `verify_part` checks: a record of their paths, sizes and mtimes taken before a verification
    stands for it while they are unchanged (`mmtok sft`'s kept image index)."""
    directory = Path(directory)
    return [directory / name for name in (IDENTITY, COMMITS, DONE, STATS, *APPENDED)] + [
        idx_path(part_prefix(directory))]


def _crc_of(path: Path) -> int:
    try:
        return zlib.crc32(path.read_bytes())
    except FileNotFoundError:
        raise MmtokError(f"{path}: missing; the part is damaged. Delete {path.parent} and re-encode this "
                         "part.") from None


def _verify_identity(directory: Path, records: list[dict]) -> None:
    """identity.json must be the bytes the commits (and DONE) were made under; a finished part's
    stats.json the bytes DONE records."""
    recorded = [r["identity_crc"] for r in records[-1:]]
    if is_done(directory):
        try:
            done = read_done(directory)
            recorded.append(done["identity_crc"])
            stats_crc = done["stats_crc"]
        except (ValueError, KeyError) as err:
            raise MmtokError(f"{directory / DONE}: damaged ({err}). Delete {directory} and re-encode this "
                             "part.") from None
        if stats_crc != _crc_of(directory / STATS):
            raise MmtokError(f"{directory / STATS}: does not match its checksum in DONE (bit rot or a damaged copy). "
                             f"Delete {directory} and re-encode this part.")
    if recorded and set(recorded) != {_crc_of(directory / IDENTITY)}:
        raise MmtokError(f"{directory / IDENTITY}: does not match its checksum in the commit log (bit rot or a "
                         f"damaged copy). Delete {directory} and re-encode this part.")


class PartWriter:
    """A part's output directory, created fresh or resumed from its last commit, written by one
    process at a time (a second writer is refused naming the holder; see `WriterLock`).

    `identity` must be JSON-serializable; on resume it must equal the recorded one (else an
    MmtokError names the first differing key) and the committed bytes must match their checksums.
    After construction:
      next_unit  first work unit not yet committed (last committed unit + 1; 0 when none)
      counts     running totals of the counters passed to `commit` (restored on resume)
      done       True when `finish` completed earlier (nothing more may be committed)
    The lock is taken here and held until `close` (or the end of a `with` block), unless the caller
    passes a `lock` it already holds for this directory (and releases itself), or `NoLock()` for a private
    copy no other process writes (lock-free writing: `private_part_dir`, `publish_part`).
    """

    def __init__(self, directory: str | os.PathLike, identity: dict, lock: WriterLock | NoLock | None = None):
        self.directory = Path(directory)
        self._handles: dict[str, Any] = {}
        self._own_lock = lock is None
        self._lock = lock or lock_part(self.directory)
        try:
            self._open(identity)
        except BaseException:
            self.close()
            raise

    def _open(self, identity: dict) -> None:
        self.identity = normalized({**identity, "format": PART_FORMAT})
        self._check_identity()
        self._identity_crc = _crc_of(self.directory / IDENTITY)
        self.done = is_done(self.directory)
        records, log_bytes = read_commits(self.directory)
        last = records[-1] if records else {}
        self.next_unit = last["unit"] + 1 if records else 0
        self.counts: dict[str, int] = dict(last.get("counts", {}))
        self.lengths = array("q", (n for record in records for n in record["lengths"]))
        self._sizes = {key: last.get(key, 0) for key in (*APPENDED.values(), "carry_bytes")}
        self._carry_live = last.get("carry_live", 0)
        self._carry_crc = last.get("carry_crc", 0)
        if not self.done:
            self._recover(log_bytes)
            verify_part(self.directory, records)

    # -- resume ---------------------------------------------------------------------------------
    def _check_identity(self) -> None:
        if not (self.directory / IDENTITY).is_file():
            write_identity(self.directory, self.identity)
            return
        check_identity(self.directory, self.identity)

    def _recover(self, log_bytes: int) -> None:
        """Cut every file back to the last complete commit and open them for appending."""
        if self._carry_live == self._sizes["carry_bytes"]:
            self._sizes["carry_bytes"] = self._carry_live = 0  # nothing live: the file may have been reset
        files = {COMMITS: log_bytes, CARRY: self._sizes["carry_bytes"],
                 **{name: self._sizes[key] for name, key in APPENDED.items()}}
        for name, size in files.items():
            path = self.directory / name
            have = path.stat().st_size if path.exists() else 0
            if have < size:
                raise MmtokError(f"{path}: {have} bytes but the last commit record says {size}; the part directory "
                                 "was modified after writing. Delete it to re-encode this part.")
            with open(path, "ab") as handle:  # creates missing files
                handle.truncate(size)
                sync(handle)
            self._handles[name] = open(path, "ab", buffering=0)
        fsync_dir(self.directory)

    def carry(self) -> bytes:
        """The carry bytes committed since the last `carry_done=True` commit (empty when none)."""
        path = self.directory / CARRY
        if self._sizes["carry_bytes"] == self._carry_live:
            return b""
        with open(path, "rb") as handle:
            handle.seek(self._carry_live)
            data = handle.read(self._sizes["carry_bytes"] - self._carry_live)
        if zlib.crc32(data) != self._carry_crc:
            raise MmtokError(f"{path}: the carried bytes do not match their checksum (bit rot or a damaged copy). "
                             f"Delete {self.directory} and re-encode this part.")
        return data

    # -- writing --------------------------------------------------------------------------------
    def commit(self, unit: int, sequences: list[np.ndarray], provenance: list[dict], counts: dict[str, int],
               *, carry: bytes = b"", carry_done: bool = False, skipped: list[SkipRecord] = (),
               items: list[tuple[dict, np.ndarray]] = ()) -> None:
        """Durably append one unit's sequences (one per document), provenance lines and skip records.

        `counts` are this unit's increments (added to `self.counts`). `skipped` names each input of
        the unit that did not become tokens (one JSON line each in skipped.jsonl). `items` are
        (record, int32 ids) pairs for a later stage (`mmtok.formats.partdir`); each record gets its
        `length`. `carry` bytes are
        appended to the carry file; `carry_done=True` declares that nothing carried so far (this
        unit's `carry` included) is needed any more. Units must increase strictly. Returns once the
        unit is durable.
        """
        if self.done:
            raise MmtokError(f"{self.directory}: part is finished (DONE); nothing more can be committed")
        if unit < self.next_unit:
            raise ValueError(f"unit {unit} committed out of order (next expected unit >= {self.next_unit})")
        if len(sequences) != len(provenance):
            raise ValueError(f"{len(sequences)} sequences but {len(provenance)} provenance records")
        if carry_done and carry:
            raise ValueError("carry bytes passed together with carry_done=True would be dropped at once")
        arrays = [check_tokens_fit(np.asarray(s), TOKEN_DTYPE) for s in sequences]
        item_arrays = [check_tokens_fit(np.asarray(ids), TOKEN_DTYPE) for _, ids in items]
        data = {TOKENS_BIN: np.concatenate(arrays).tobytes() if arrays else b"",
                PROVENANCE: _json_lines(provenance), SKIPPED: skips.to_lines(skipped),
                ITEM_IDS: np.concatenate(item_arrays).tobytes() if item_arrays else b"",
                ITEMS: item_lines([record for record, _ in items], item_arrays)}
        for name, size_key in APPENDED.items():
            self._append(name, size_key, data[name])
        self._append(CARRY, "carry_bytes", carry)
        self._carry_crc = 0 if carry_done else zlib.crc32(carry, self._carry_crc)
        if carry_done:
            self._carry_live = self._sizes["carry_bytes"]
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + int(value)
        lengths = [int(a.size) for a in arrays]
        record = {"unit": int(unit), "lengths": lengths, "counts": self.counts, "carry_live": self._carry_live,
                  "carry_crc": self._carry_crc, "crc": {name: zlib.crc32(data[name]) for name in APPENDED},
                  "identity_crc": self._identity_crc,
                  **self._sizes}
        self._write_all(COMMITS, _encode_record(record))
        self.lengths.extend(lengths)
        self.next_unit = int(unit) + 1
        if carry_done and self._sizes["carry_bytes"]:
            self._reset_carry()

    def _append(self, name: str, size_key: str, data: bytes) -> None:
        if data:
            self._write_all(name, data)
            self._sizes[size_key] += len(data)

    def _write_all(self, name: str, data: bytes) -> None:
        """Append all of `data` (unbuffered writes may be short) and make it durable."""
        handle = self._handles[name]
        view = memoryview(data)
        try:
            while view:
                view = view[handle.write(view):]
            sync(handle, data_only=True)
        except OSError as err:  # e.g. a full disk: name the file; what was appended is cut on resume
            raise with_filename(err, self.directory / name) from None

    def _reset_carry(self) -> None:
        """Empty the carry file once a durable record says nothing in it is live (see `_recover`)."""
        handle = self._handles[CARRY]
        handle.truncate(0)
        self._sizes["carry_bytes"] = self._carry_live = 0

    def finish(self, stats: dict) -> None:
        """Write tokens.idx, stats.json (counts and totals merged into `stats`) and the DONE marker.

        A part without tokens gets no dataset at all (megatron-core cannot open an empty one): its
        empty tokens.bin is removed and stats/DONE say `"dataset": false`.
        """
        if self.done:
            raise MmtokError(f"{self.directory}: part is already finished")
        self._close_files()
        lengths = np.frombuffer(self.lengths, dtype=np.int64) if self.lengths else np.zeros(0, np.int64)
        has_dataset = bool(lengths.sum())
        if has_dataset:
            write_index(part_prefix(self.directory), lengths)
        else:
            (self.directory / TOKENS_BIN).unlink(missing_ok=True)
        summary = {"sequences": int(lengths.size), "tokens": int(lengths.sum()), "counts": dict(self.counts),
                   "last_unit": self.next_unit - 1, "dataset": has_dataset, "identity_crc": self._identity_crc}
        write_finished(self.directory, {**stats, **summary, "identity": self.identity}, summary)
        self.done = True
        self.close()  # nothing more can be written: the lock goes with the files

    def _close_files(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def close(self) -> None:
        """Close the files and release the writer lock (if this object took it)."""
        self._close_files()
        if self._own_lock:
            self._lock.release()

    def __enter__(self) -> "PartWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_provenance(directory: str | os.PathLike) -> Iterator[dict]:
    """The provenance records of a part, one per sequence, in sequence order."""
    with open(Path(directory) / PROVENANCE, "rb") as handle:
        for line in handle:
            yield json.loads(line)


def read_skipped(directory: str | os.PathLike) -> Iterator[SkipRecord]:
    """The committed skip records of a part (inputs that did not become tokens), in commit order: the bytes its last
    commit record covers. A writer may be appending the next unit's, or was killed while it did (its resume cuts
    them off); those are not read."""
    records, _ = read_commits(directory)
    end = int(records[-1].get(APPENDED[SKIPPED], 0)) if records else 0
    if end:
        yield from skips.read(Path(directory) / SKIPPED, limit=end)
