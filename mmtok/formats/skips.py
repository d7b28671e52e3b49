"""Skip records: one line for each input that did not become tokens, the same schema in every stage.

Every skip file holds them, one JSON object a line, keys in `SkipRecord`'s field order:

  MANIFEST/skipped.jsonl                        `mmtok scan`: its error rows (`Manifest.skip_records`)
  H/skipped.jsonl                               `mmtok hash`
  OUT/parts/part-NNNNN/skipped.jsonl            encode (images, audio) and `mmtok sft`, per part
  OUT/merged.skipped.jsonl                      merge: the parts' lists joined, then the assembled documents'
  PACKED/skipped.jsonl                          `mmtok pack`
  CONV/dropped/dropped.{inputs,NNNNNN,tail}.jsonl  `mmtok audio convert`

The plan's drops are the one exception on disk: PLAN/dropped.parquet keeps only the manifest row, reason and
keeper of each (10^8 rows), and `Plan.skip_records` reads them as these records. `mmtok status OUT --plan
PLAN --skipped` lists a job's records of every stage, in this schema.

The counters of those inputs are `skipped:<reason>` in every stage's counts; `count_key` makes such a
key and `reason_of` reads it back. This is the only module that knows the line layout or the key form.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import IO, Iterable, Iterator

from mmtok.errors import MmtokError, Skip
from mmtok.fsutil import check_recorded

SKIPPED = "skipped:"  # the counter prefix: skipped:<reason>
ITEM_FAILED = "items_failed:"  # an image item that failed (its document is skipped later, by merge or sft)
FILE_SKIPPED = "files_skipped:"  # an input file with no input in it (an empty tar): its record, no input counted


@dataclass(frozen=True, kw_only=True)
class SkipRecord:
    """One input that did not become tokens, and why.

    key        the input's own id: the sample key (images), cut id (audio encode), clip id (audio
               convert) or conversation id (sft, pack)
    source     where it lives: the tar / table / Shar recording tar path, the conversation's origin
               ("a.tar:KEY", "b.jsonl:line 12"), or convert's origin of the clip ("a.tar:KEY", "t.tsv:3")
    container  the kind of `source`: "tar", "parquet", "shar", "conversation"; None where the stage has none
    member     the member of `source` that holds it (tar member, cut id, conversation id); None if none
    position   its row in the stage's input: the manifest row (images), its position in the Shar shard
               (audio); None where the stage has none
    reason     the counted snake_case reason (`skipped:<reason>` in the stage's counts)
    detail     what people need to find and fix it ("" when the reason says it all)
    stage      the stage that decided the skip: "encode", "merge", "sft", "pack", "convert"
    """

    key: str
    source: str
    container: str | None = None
    member: str | None = None
    position: int | None = None
    reason: str
    detail: str = ""
    stage: str

    @classmethod
    def of(cls, skip: Skip, *, stage: str, **where) -> "SkipRecord":
        """The record of `skip` (its reason and detail) at `where` (key, source, ...)."""
        return cls(**where, reason=skip.reason, detail=skip.detail, stage=stage)

    def skip(self) -> Skip:
        """The Skip this record was made from (reason and detail)."""
        return Skip(self.reason, self.detail)


FIELDS = tuple(f.name for f in fields(SkipRecord))
# The JSON types each field may hold; a record read back is checked against them before anything uses it.
_TYPES = {"key": (str,), "source": (str,), "container": (str, type(None)), "member": (str, type(None)),
          "position": (int, type(None)), "reason": (str,), "detail": (str,), "stage": (str,)}


# -- writer ------------------------------------------------------------------------------------------
def to_line(record: SkipRecord) -> bytes:
    """One record as one JSON line, keys in field order, every field present (None as null). ASCII, with
    escapes: a key or detail may hold a lone surrogate (a tar member name that is not UTF-8), which no
    UTF-8 line can."""
    fields_ = {name: getattr(record, name) for name in FIELDS}  # (not asdict: its deep copy is 3x the cost)
    return json.dumps(fields_, separators=(",", ":")).encode("ascii") + b"\n"


def to_lines(records: Iterable[SkipRecord]) -> bytes:
    return b"".join(to_line(r) for r in records)


def append(handle: IO[bytes], records: Iterable[SkipRecord]) -> None:
    """Append `records` to the open binary skip file `handle`."""
    handle.write(to_lines(records))


# -- reader ------------------------------------------------------------------------------------------
def read(path: str | os.PathLike, limit: int | None = None) -> Iterator[SkipRecord]:
    """The records of the skip file `path`, in file order (with `limit`, those of its first `limit` bytes: what a
    writer committed); a line that is not a record is an MmtokError naming the file and the line."""
    with open(path, "rb") as handle:
        taken = 0
        for number, line in enumerate(handle, 1):
            taken += len(line)
            if limit is not None and taken > limit:
                return
            yield _parse(line, path, number)


def read_recorded(path: Path, recorded_sha256: str | None, rerun: str) -> Iterator[SkipRecord]:
    """The records of the skip file `path` another stage wrote, after checking its bytes against the sha256
    that stage recorded: one MmtokError line naming the file and the command to `rerun` when it is unreadable or
    changed since."""
    check_recorded(path, recorded_sha256, rerun)
    return read(path)


def _parse(line: bytes, path: str | os.PathLike, number: int) -> SkipRecord:
    try:
        record = json.loads(line)
        if not isinstance(record, dict):
            raise ValueError(f"a JSON {type(record).__name__}, not an object")
        if tuple(record) != FIELDS:
            raise ValueError(f"keys {list(record)}, not {list(FIELDS)}")
        wrong = [name for name, value in record.items()
                 if not isinstance(value, _TYPES[name]) or isinstance(value, bool)]
        if wrong:
            raise ValueError(f"wrong type for {', '.join(wrong)}")
        return SkipRecord(**record)
    except ValueError as err:  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors too
        raise MmtokError(f"{Path(path)}:{number}: not a skip record of this mmtok ({err}); the file is damaged or "
                         "from another mmtok version -- rerun the stage that wrote it into a fresh output") from None


# -- counters ----------------------------------------------------------------------------------------
def count_key(reason: str) -> str:
    """The counter of the inputs skipped for `reason`."""
    return f"{SKIPPED}{reason}"


def item_failed_key(reason: str) -> str:
    """The counter of the image items that failed for `reason`."""
    return f"{ITEM_FAILED}{reason}"


def file_count_key(reason: str) -> str:
    """The counter of the input files skipped whole for `reason` (they hold no input to count)."""
    return f"{FILE_SKIPPED}{reason}"


def files_by_reason(counts: dict[str, int]) -> dict[str, int]:
    """The whole-file skip counters of `counts` as {reason: count}, by reason."""
    return _by_prefix(counts, FILE_SKIPPED)


def reason_of(key: str) -> str | None:
    """The reason a `count_key` counter counts; None for any other counter."""
    return key[len(SKIPPED):] if key.startswith(SKIPPED) else None


def by_reason(counts: dict[str, int]) -> dict[str, int]:
    """The skip counters of `counts` as {reason: count}, by reason."""
    return _by_prefix(counts, SKIPPED)


def items_failed_by_reason(counts: dict[str, int]) -> dict[str, int]:
    """The failed-item counters of `counts` as {reason: count}, by reason."""
    return _by_prefix(counts, ITEM_FAILED)


def _by_prefix(counts: dict[str, int], prefix: str) -> dict[str, int]:
    return {key[len(prefix):]: counts[key] for key in sorted(counts) if key.startswith(prefix)}


def total(counts: dict[str, int], *, failed_items: bool = False) -> int:
    """How many inputs `counts` counts as skipped (and, with `failed_items`, image items as failed)."""
    return sum(by_reason(counts).values()) + (sum(items_failed_by_reason(counts).values()) if failed_items else 0)
