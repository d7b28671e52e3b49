"""The conversation index of an `mmtok sft` run: where each unit of conversations starts, so that a rank reads
only its own range (writer and reader side by side; the one module that knows this layout).

```
OUT/conversations.json        format, the inputs' identities (path, size, mtime, blake2b of the first bytes:
                              `mmtok.formats.manifest.container_identity`), the conversation count, the unit
                              size, the repeats' count and the sha256 of the arrays file
OUT/conversations.index.npz   starts      int64 [units, 4]: for conversation u * unit_size, its input number,
                                          its record number in that input, and for a .jsonl input the byte
                                          offset of its line and the lines before it (else -1, 0)
                              duplicates  int64, sorted: the ordinals of the records whose id an earlier record
                                          of the inputs has (`duplicate_conversation`)
```

The first rank to start (or a rerun that finds no index) reads every record once to make it; every rank then
starts its range at its first unit's entry: a .jsonl input is entered by seeking to the byte offset, a
Parquet input by skipping whole row groups, a tar by listing its headers (records are per tar). So a rank's
start-up time and memory depend on its range and on one input's size, not on the corpus. Repeated ids are found
once, in the index pass, from 16-byte blake2b digests of the ids sorted with NumPy (not a set of every id
string: 10^8 ids would take ~10 GB), first occurrence kept -- the rule `read_conversations` applies.

An index is used only for the inputs it was made of: a changed input (size, mtime or first bytes), another
input list, a damaged arrays file or another unit size is refused in one line with the fix, never served from
stale offsets. Writes are atomic (arrays first, then the JSON naming their sha256), so ranks may race to make
it.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.errors import DamagedFile, MmtokError
from mmtok.formats.containers import Start
from mmtok.formats.conversations import (
    Conversation,
    check_inputs,
    duplicate,
    input_records,
    is_checked_for_repeats,
)
from mmtok.formats.keys import key_digest, repeated_positions
from mmtok.formats.manifest import container_identity
from mmtok.formats.partdir import parts_root
from mmtok.fsutil import atomic_write_bytes, atomic_write_json, read_json_object, required, shown_path

INDEX_FORMAT = "mmtok-conversation-index/1"
META_FILE = "conversations.json"
ARRAYS_FILE = "conversations.index.npz"
REFRESH = "delete {meta} and {arrays} and the parts under {parts}, then rerun"


@dataclass(frozen=True)
class ConversationIndex:
    """The conversations of a list of inputs: `total` records, where every `unit_size`-th starts, which repeat."""

    total: int
    unit_size: int
    starts: np.ndarray  # int64 [units, 4]: input, record in input, byte offset (.jsonl; else -1), lines before
    duplicates: np.ndarray  # int64, sorted ordinals

    def read(self, inputs: list[Path], first: int, last: int, media_roots: tuple[str, ...] = ()
             ) -> Iterator[tuple[int, Conversation]]:
        """(ordinal, conversation) for ordinals first..last-1 (first a multiple of `unit_size`), repeats marked as
        `read_conversations` marks them; MmtokError when the inputs end before `last` (changed while read)."""
        if first >= last:
            return
        number, record, offset, line = (int(v) for v in self.starts[first // self.unit_size])
        repeats = set(self.duplicates[np.searchsorted(self.duplicates, first):
                                      np.searchsorted(self.duplicates, last)].tolist())
        ordinal = first
        for _, _, conversation in input_records(inputs, media_roots, number, Start(record, offset, line)):
            yield ordinal, duplicate(conversation) if ordinal in repeats else conversation
            ordinal += 1
            if ordinal >= last:  # before the next record is read
                return
        if ordinal < last:
                raise MmtokError(f"the inputs hold {ordinal:,} conversations now, fewer than the {self.total:,} their "
                             "index counted: were they changed while mmtok sft ran? rerun it")


def identities(inputs: Sequence[Path]) -> list[dict]:
    """What the index records of each input, to refuse it for inputs that changed since."""
    return [{"path": shown_path(Path(path).resolve()), **container_identity(path)} for path in inputs]


def build(inputs: list[Path], unit_size: int) -> ConversationIndex:
    """Read every record of `inputs` once: the unit starts, the count and the repeated ids."""
    starts: list[tuple[int, int, int, int]] = []
    digests = bytearray()
    checked: list[int] = []  # ordinals whose id takes part in the repeat check (in digest order)
    total = 0
    for number, record, conversation in input_records(inputs):
        if total % unit_size == 0:
            starts.append((number, record, *conversation.seek))
        if is_checked_for_repeats(conversation):
            digests += key_digest(conversation.id)
            checked.append(total)
        total += 1
    repeats = repeated_positions(bytes(digests))
    return ConversationIndex(total, unit_size, np.asarray(starts, np.int64).reshape(-1, 4),
                             np.sort(np.asarray(checked, np.int64)[repeats]))


def load_or_build(inputs: list[Path], out: Path, unit_size: int) -> ConversationIndex:
    """The index of `inputs` kept in OUT (checked against the inputs and its own sha256), else made and kept."""
    check_inputs(inputs)
    recorded = identities(inputs)
    index = load(out, recorded, unit_size)
    if index is None:
        index = build(inputs, unit_size)
        write(out, recorded, index)
    return index


def write(out: Path, recorded: list[dict], index: ConversationIndex) -> None:
    buffer = io.BytesIO()
    np.savez(buffer, starts=index.starts, duplicates=index.duplicates)
    data = buffer.getvalue()
    Path(out).mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(Path(out) / ARRAYS_FILE, data)
    atomic_write_json(Path(out) / META_FILE, {
        "format": INDEX_FORMAT, "inputs": recorded, "conversations": index.total, "unit_size": index.unit_size,
        "duplicates": int(index.duplicates.size), "arrays_sha256": hashlib.sha256(data).hexdigest()})


def load(out: Path, recorded: list[dict], unit_size: int) -> ConversationIndex | None:
    """The index kept in OUT; None when there is none (or one of an older mmtok, which only counted); MmtokError
    naming the difference when it was made of other inputs or files that changed since, or is damaged."""
    meta_path, arrays_path = Path(out) / META_FILE, Path(out) / ARRAYS_FILE
    meta = read_json_object(meta_path)
    if meta is None or meta.get("format") != INDEX_FORMAT:
        return None
    fix = REFRESH.format(meta=meta_path, arrays=arrays_path, parts=parts_root(out))
    _refuse_other_inputs(meta_path, required(meta, "inputs", list, meta_path), recorded, fix)
    if required(meta, "unit_size", int, meta_path) != unit_size:
        raise MmtokError(f"{meta_path}: made for units of {meta['unit_size']} conversations, this mmtok uses "
                         f"{unit_size}; {fix}")
    try:
        data = arrays_path.read_bytes()
    except OSError as err:
        raise MmtokError(f"{arrays_path}: cannot read the conversation index ({err.strerror or err}); {fix}") from None
    if hashlib.sha256(data).hexdigest() != required(meta, "arrays_sha256", str, meta_path):
        raise DamagedFile(f"{arrays_path}: its bytes do not match the sha256 in {meta_path.name} (damaged or "
                          f"changed); {fix}")
    with np.load(io.BytesIO(data), allow_pickle=False) as arrays:
        starts, duplicates = arrays["starts"], arrays["duplicates"]
    total = required(meta, "conversations", int, meta_path)
    if len(starts) != -(-total // unit_size) or starts.ndim != 2 or starts.shape[1] != 4:
        raise DamagedFile(f"{meta_path}: {total} conversations do not fit its {len(starts)} unit starts; {fix}")
    return ConversationIndex(total, unit_size, starts, duplicates)


def _refuse_other_inputs(meta_path: Path, made: list, recorded: list[dict], fix: str) -> None:
    if [entry.get("path") if isinstance(entry, dict) else None for entry in made] != [r["path"] for r in recorded]:
        raise MmtokError(f"{meta_path}: the conversation index of other inputs ({len(made)} files, first "
                         f"{made[0].get('path') if made and isinstance(made[0], dict) else '?'}); give each input "
                         f"list its own --out, or {fix}")
    for was, now in zip(made, recorded, strict=True):
        changed = [key for key in ("size", "mtime_ns", "head") if was.get(key) != now[key]]
        if changed:
            raise MmtokError(f"{now['path']} changed since the conversation index in {meta_path.parent} was made "
                             f"({', '.join(changed)} differ): its offsets are not this file's; {fix}")
