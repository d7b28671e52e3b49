"""Part shards: one resumable Megatron dataset per encode *part*, made durable after every work unit.

An encode output directory holds `OUT/parts/part-00003/`, one per part (images: part = rank; audio:
part = input Shar shard). A part directory contains

  identity.json     what the part is made from (plan/input fingerprints, codec incl. precision, text
                    tokenizer, part number, ...); written once, compared on every resume
  tokens.bin        int32 tokens, one sequence per document, appended per unit
  provenance.jsonl  one JSON line per sequence (line i describes sequence i), appended per unit
  carry.bin         opaque bytes the writer carries between units (e.g. codes of images whose
                    multi-image document is not complete yet); see `PartShard.carry`
  commits.log       one record per committed unit: `<json>\\t<crc32 hex>\\n`
  tokens.idx        written by `finish` (atomic)
  stats.json        written by `finish` (atomic)
  DONE              written last by `finish` (atomic)

Durability protocol of `commit`: the unit's tokens, provenance lines and carry bytes are appended
and fdatasync'ed, *then* the commit record is appended and fdatasync'ed. A record names the size
every file had after its unit, so a process killed at any instant resumes from the last complete
record: files are truncated back to that record's sizes and a torn (partial or corrupt) last record
is dropped. Everything a unit writes is a deterministic function of the unit, so the finished files
are byte-identical to those of an uninterrupted run.

This is the only module that knows the layout of a part directory.
"""

from __future__ import annotations

import json
import os
import zlib
from array import array
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.megatron import TOKEN_DTYPE, bin_path, check_tokens_fit, write_index
from mmtok.fsutil import atomic_write_bytes, atomic_write_json, fsync_dir

PART_FORMAT = "mmtok-part/1"
TOKENS = "tokens"  # dataset prefix inside a part directory: tokens.bin / tokens.idx
TOKENS_BIN = bin_path(TOKENS).name
IDENTITY = "identity.json"
PROVENANCE = "provenance.jsonl"
CARRY = "carry.bin"
COMMITS = "commits.log"
STATS = "stats.json"
DONE = "DONE"


def part_dir(out: str | os.PathLike, part: int) -> Path:
    """`OUT/parts/part-00003` for part 3."""
    return Path(out) / "parts" / f"part-{part:05d}"


def part_prefix(directory: str | os.PathLike) -> Path:
    """The Megatron dataset prefix of a part (`.bin`/`.idx` appended by the format module)."""
    return Path(directory) / TOKENS


def read_identity(directory: str | os.PathLike) -> dict:
    return json.loads((Path(directory) / IDENTITY).read_text("utf-8"))


def is_done(directory: str | os.PathLike) -> bool:
    return (Path(directory) / DONE).is_file()


def read_stats(directory: str | os.PathLike) -> dict:
    return json.loads((Path(directory) / STATS).read_text("utf-8"))


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


def _normalize(obj: Any) -> Any:
    """JSON round trip: tuples become lists, keys strings, so identities compare as stored."""
    return json.loads(json.dumps(obj, sort_keys=True))


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
    except ValueError:
        return None


def read_commits(directory: str | os.PathLike) -> tuple[list[dict], int]:
    """(complete records, byte length they span) of a part's commit log.

    Only the last line may be torn (a kill during its append); a bad record followed by good
    ones means the log was damaged by something other than a crash, and is refused.
    """
    path = Path(directory) / COMMITS
    if not path.is_file():
        return [], 0
    records, good_bytes = [], 0
    lines = path.read_bytes().splitlines(keepends=True)
    for number, line in enumerate(lines):
        record = _decode_record(line)
        if record is None:
            if number != len(lines) - 1:
                raise MmtokError(f"{path}: commit record {number + 1} of {len(lines)} is corrupt but later records "
                                 "are intact (not a crash); delete the part directory to re-encode this part")
            break
        records.append(record)
        good_bytes += len(line)
    return records, good_bytes


class PartShard:
    """A part's output directory, created fresh or resumed from its last commit.

    `identity` must be JSON-serializable; on resume it must equal the recorded one (else an
    MmtokError names the first differing key). After construction:
      next_unit  first work unit not yet committed (last committed unit + 1; 0 when none)
      counts     running totals of the counters passed to `commit` (restored on resume)
      done       True when `finish` completed earlier (nothing more may be committed)
    """

    def __init__(self, directory: str | os.PathLike, identity: dict):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.identity = _normalize({**identity, "format": PART_FORMAT})
        self._check_identity()
        self.done = is_done(self.directory)
        records, log_bytes = read_commits(self.directory)
        last = records[-1] if records else {}
        self.next_unit = last["unit"] + 1 if records else 0
        self.counts: dict[str, int] = dict(last.get("counts", {}))
        self.lengths = array("q", (n for record in records for n in record["lengths"]))
        self._sizes = {name: last.get(name, 0) for name in ("tokens_bytes", "provenance_bytes", "carry_bytes")}
        self._carry_live = last.get("carry_live", 0)
        self._handles: dict[str, Any] = {}
        if not self.done:
            self._recover(log_bytes)

    # -- resume ---------------------------------------------------------------------------------
    def _check_identity(self) -> None:
        path = self.directory / IDENTITY
        if not path.is_file():
            atomic_write_json(path, self.identity)
            return
        recorded = json.loads(path.read_text("utf-8"))
        difference = identity_difference(recorded, self.identity)
        if difference:
            raise MmtokError(
                f"{self.directory}: refusing to resume: {difference}. This part was started with different "
                f"inputs or settings; rerun with the original ones, or use another --out (or delete "
                f"{self.directory}) to start over."
            )

    def _recover(self, log_bytes: int) -> None:
        """Cut every file back to the last complete commit and open them for appending."""
        if self._carry_live == self._sizes["carry_bytes"]:
            self._sizes["carry_bytes"] = self._carry_live = 0  # nothing live: the file may have been reset
        files = {COMMITS: log_bytes, TOKENS_BIN: self._sizes["tokens_bytes"],
                 PROVENANCE: self._sizes["provenance_bytes"], CARRY: self._sizes["carry_bytes"]}
        for name, size in files.items():
            path = self.directory / name
            have = path.stat().st_size if path.exists() else 0
            if have < size:
                raise MmtokError(f"{path}: {have} bytes but the last commit record says {size}; the part directory "
                                 "was modified after writing. Delete it to re-encode this part.")
            with open(path, "ab") as handle:  # creates missing files
                handle.truncate(size)
                os.fsync(handle.fileno())
            self._handles[name] = open(path, "ab", buffering=0)
        fsync_dir(self.directory)

    def carry(self) -> bytes:
        """The carry bytes committed since the last `carry_done=True` commit (empty when none)."""
        path = self.directory / CARRY
        if self._sizes["carry_bytes"] == self._carry_live:
            return b""
        with open(path, "rb") as handle:
            handle.seek(self._carry_live)
            return handle.read(self._sizes["carry_bytes"] - self._carry_live)

    # -- writing --------------------------------------------------------------------------------
    def commit(self, unit: int, sequences: list[np.ndarray], provenance: list[dict], counts: dict[str, int],
               *, carry: bytes = b"", carry_done: bool = False) -> None:
        """Durably append one unit's sequences (one per document) and provenance lines.

        `counts` are this unit's increments (added to `self.counts`). `carry` bytes are appended to
        the carry file; `carry_done=True` declares that nothing carried so far (this unit's `carry`
        included) is needed any more. Units must increase strictly. Returns once the unit is durable.
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
        token_bytes = np.concatenate(arrays).tobytes() if arrays else b""
        lines = b"".join(json.dumps(p, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
                         for p in provenance)
        self._append(TOKENS_BIN, "tokens_bytes", token_bytes)
        self._append(PROVENANCE, "provenance_bytes", lines)
        self._append(CARRY, "carry_bytes", carry)
        if carry_done:
            self._carry_live = self._sizes["carry_bytes"]
        for key, value in counts.items():
            self.counts[key] = self.counts.get(key, 0) + int(value)
        lengths = [int(a.size) for a in arrays]
        record = {"unit": int(unit), "lengths": lengths, "counts": self.counts, "carry_live": self._carry_live,
                  **self._sizes}
        log = self._handles[COMMITS]
        log.write(_encode_record(record))
        os.fdatasync(log.fileno())
        self.lengths.extend(lengths)
        self.next_unit = int(unit) + 1
        if carry_done and self._sizes["carry_bytes"]:
            self._reset_carry()

    def _append(self, name: str, size_key: str, data: bytes) -> None:
        if not data:
            return
        handle = self._handles[name]
        view = memoryview(data)
        while view:  # unbuffered writes may be short
            view = view[handle.write(view):]
        os.fdatasync(handle.fileno())
        self._sizes[size_key] += len(data)

    def _reset_carry(self) -> None:
        """Empty the carry file once a durable record says nothing in it is live (see `_recover`)."""
        handle = self._handles[CARRY]
        handle.truncate(0)
        self._sizes["carry_bytes"] = self._carry_live = 0

    def finish(self, stats: dict) -> None:
        """Write tokens.idx, stats.json (counts and totals merged into `stats`) and the DONE marker."""
        if self.done:
            raise MmtokError(f"{self.directory}: part is already finished")
        self.close()
        lengths = np.frombuffer(self.lengths, dtype=np.int64) if self.lengths else np.zeros(0, np.int64)
        write_index(part_prefix(self.directory), lengths)
        summary = {"sequences": int(lengths.size), "tokens": int(lengths.sum()), "counts": dict(self.counts),
                   "last_unit": self.next_unit - 1}
        atomic_write_json(self.directory / STATS, {**stats, **summary, "identity": self.identity})
        atomic_write_bytes(self.directory / DONE, (json.dumps(summary, sort_keys=True) + "\n").encode())
        self.done = True

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> "PartShard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_provenance(directory: str | os.PathLike) -> Iterator[dict]:
    """The provenance records of a part, one per sequence, in sequence order."""
    with open(Path(directory) / PROVENANCE, "rb") as handle:
        for line in handle:
            yield json.loads(line)


class CommitThread:
    """Runs commit jobs on one background thread, in submission order, so the device never waits for fsync.

    `submit` blocks once `depth` jobs are queued (the producer cannot run far ahead of durability);
    the first job error is re-raised in the producer by `submit`/`check`/`close`, and later jobs
    are dropped (a commit after a failed one would leave a gap).
    """

    def __init__(self, depth: int = 2):
        import queue
        import threading

        self._jobs: queue.Queue = queue.Queue(depth)
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="mmtok-commit", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            if self.error is None:
                try:
                    job()
                except BaseException as err:  # re-raised in the producer thread
                    self.error = err

    def submit(self, job) -> None:
        self.check()
        self._jobs.put(job)

    def check(self) -> None:
        if self.error is not None:
            raise self.error

    def close(self) -> None:
        """Wait for every submitted job; re-raise the first error."""
        self._jobs.put(None)
        self._thread.join()
        self.check()
