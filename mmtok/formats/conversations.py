"""SFT conversation records and where their media are: the one reader that `mmtok audio convert
--kind conversations` (their audio becomes clips) and `mmtok sft` (conversations become sequences) share.

Inputs and the id each conversation gets (ids are unique across the inputs; a repeat is skipped as
`duplicate_conversation`):

  KEY.json in a WebDataset tar    its `id` (a string), else `<tar stem>/<KEY>`; its media are the
                                  sample's members
  a line of a .jsonl file         its `id` (a string), else `<file stem>/<content id>`
  a row of a .parquet file        its `id` column, else `<file stem>/<content id>`; the row's columns
                                  are the record (`messages` may be a JSON string)

A content id is the first 16 hex digits of the SHA-256 of the record (`content_id`), not its line or row
number: the audio a conversion made for a record stays that record's when lines are added or removed
before `mmtok sft` reads the file (identical records share an id: the second is a duplicate). Two inputs
with the same file stem are refused (their ids would collide); one file given under two paths (a link, a
mount) is read once, the second path one `duplicate_input` record of its own.

A medium's reference (`mmtok.formats.chat.MediaRef.source`) is resolved by `locate`:

  {"cut_id": ID}                  a clip already in an audio token cache (Lhotse cut id)
  {"data": BASE64, ...}           inline bytes (`input_audio`); also `data:...;base64,` URLs
  {"bytes": ..., "path": ...}     a Hugging Face `Audio`/`Image` cell: its bytes, else its path
  bytes                           inline bytes (a Parquet cell)
  a string                        in a tar: a member of the sample (full name, `KEY.` + name, or base
                                  name); otherwise (or if no member matches) a file path (`file://` is
                                  stripped; http(s) is refused), resolved by `_located_file`
  none (a typed placeholder)      in a tar: the sample's members of that kind no other reference names,
                                  by the N of KEY.N.ext, then by name (the scan's order)

A file path is untrusted: it resolves only inside the *roots*, the input's own directory and each
`--media-root` (`read_conversations(..., media_roots=)`). A relative path is looked for under each root in
that order; an absolute one must lie inside one. Symlinks and `..` are resolved first, so one whose target
leaves every root is `outside_root`, as is an absolute path elsewhere; a FIFO, device, socket or directory
is `not_a_file` and never opened (`mmtok.fsutil.read_regular_file`).

What cannot be resolved otherwise is `missing_media` naming the slot and what was looked for.

The writer of conversation tars is here too, beside their reader: `ConversationTars` (what `mmtok pack`
writes: samples of `KEY.json` and `KEY.<k>.<ext>` members, named by `json_member_name` and
`media_member_name`, which `mmtok.formats.webdataset.sample_key` reads back).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from mmtok.errors import MmtokError, Skip
from mmtok.formats.chat import ConversationError, MediaRef, MediaSlot, conversation_media
from mmtok.formats.containers import (
    FROM_FIRST,
    JSONL,
    PARQUET,
    TAR,
    Record,
    Start,
    container_named,
    is_compressed,
    json_value,
)
from mmtok.formats.readers import reader
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import Damage, open_range, read_tar_member
from mmtok.formats.webdataset import (
    DUPLICATE_KEY,
    KIND_SUFFIXES,
    NO_SAMPLES,
    TRUNCATED_MEMBER,
    Sample,
    duplicate_key_detail,
)
from mmtok.fsutil import (
    DUPLICATE_INPUT,
    OUTSIDE_ROOT,
    atomic_writer,
    inside,
    not_a_regular_file,
    open_regular_file,
    read_regular_file,
    same_file_as,
    shown_path,
)


@dataclass(frozen=True)
class Conversation:
    """One conversation record: `record` parsed, or `error` saying why it cannot be used."""

    id: str
    origin: str  # where it is, for people: "a.tar:KEY", "b.jsonl:line 12", "c.parquet:row 3"
    input: int   # which input (position in the inputs)
    record: dict | None = None
    error: Skip | None = None
    tar: str | None = None  # the tar of a tar sample
    key: str | None = None  # its WebDataset sample key
    members: dict[str, tuple[int, int]] = field(default_factory=dict)  # member name -> (data offset, size)
    refused: dict[str, str] = field(default_factory=dict)  # member name -> the tar reader's reason (also in members)
    base: str = "."  # directory that relative paths are relative to: the input's own, the first root
    media_roots: tuple[str, ...] = ()  # the further roots a file path may resolve into (real paths)
    # the record of an input without a conversation (an empty tar): counted as no conversation
    whole_file: bool = False
    # a .jsonl record: (byte offset of its line, lines before it), where a reader may start
    seek: tuple[int, int] = (-1, 0)

    def media(self) -> list[MediaRef]:
        """The media its messages reference, in order (ConversationError when they cannot be listed)."""
        if self.error is not None:
            raise ConversationError(self.error.reason, self.error.detail)
        return conversation_media(self.record)

    def skip_record(self, skip: Skip, stage: str) -> SkipRecord:
        """The skip record of this conversation (of its input file when `whole_file`), skipped by `stage` for `skip`."""
        if self.whole_file:
            return SkipRecord.of(skip, stage=stage, key=self.id, source=self.origin,
                                 container=TAR if self.tar is not None else None)
        return SkipRecord.of(skip, stage=stage, key=self.id, source=self.origin, container="conversation",
                             member=self.id)


@dataclass(frozen=True)
class Located:
    """Where one medium's bytes are: a tar member, a file, inline bytes, or a clip of an audio cache."""

    kind: str  # "member" | "file" | "bytes" | "cut"
    where: str  # for people
    path: str | None = None
    offset: int = 0
    size: int = -1
    data: bytes | None = None
    cut_id: str | None = None
    member: str | None = None  # the tar member's name (kind "member")

    def read(self) -> bytes:
        """The medium's bytes (not for "cut"); OSError when the file cannot be read."""
        if self.data is not None:
            return self.data
        if self.kind == "member":
            return read_tar_member(self.path, self.offset, self.size)
        return read_regular_file(self.path)

    def open(self) -> tuple[IO[bytes], int]:
        """(a binary stream positioned at the medium's first byte, the medium's size in bytes), so a caller
        can bound the size before reading and copy the bytes in pieces, never all at once (not for "cut");
        OSError when the file cannot be opened, MemberTruncated when a tar no longer holds the member. The caller
        closes the stream."""
        if self.data is not None:
            return io.BytesIO(self.data), len(self.data)
        if self.kind == "member":
            return open_range(self.path, self.offset, self.size), self.size
        handle = open_regular_file(self.path)  # as `read`: never a FIFO, device or directory
        return handle, os.fstat(handle.fileno()).st_size


def audio_clip_id(conversation_id: str, index: int) -> str:
    """The cut id `mmtok audio convert --kind conversations` gives a conversation's audio slot `index`."""
    return f"{conversation_id}/audio-{index}"


def content_id(record: dict) -> str:
    """16 hex digits of the SHA-256 of a record's canonical JSON (bytes values by their own SHA-256)."""
    def default(value):
        if isinstance(value, (bytes, bytearray)):
            return {"sha256": hashlib.sha256(value).hexdigest()}
        raise TypeError(f"{type(value).__name__} in a conversation record")

    text = json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=default)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def _own_id(record: dict | None) -> str | None:
    """A record's own `id`: a non-empty string, or an integer written in decimal."""
    ident = record.get("id") if record is not None else None
    if isinstance(ident, int) and not isinstance(ident, bool):
        return str(ident)
    return ident if isinstance(ident, str) and ident else None


def _record_id(record: dict | None, stem: str, fallback: str) -> str:
    """A record's own string `id`, else `<stem>/<content id>` (else, for an unreadable record, the fallback)."""
    ident = _own_id(record)
    if ident is not None:
        return ident
    try:
        return f"{stem}/{content_id(record)}" if record is not None else f"{stem}/{fallback}"
    except (TypeError, ValueError):
        return f"{stem}/{fallback}"


def input_kind(path: Path) -> str:
    """The container of a conversation input, by its name: TAR, JSONL (not compressed) or PARQUET."""
    kind = container_named(path)
    if kind in (TAR, JSONL, PARQUET) and not is_compressed(path):
        return kind
    raise MmtokError(f"{path}: not a conversation input (a WebDataset .tar with KEY.json samples, a .jsonl file "
                     "with one conversation per line, or a .parquet file with a `messages` column)")


def read_conversations(inputs: list[Path], media_roots: Sequence[Path] = ()) -> Iterator[Conversation]:
    """Every conversation of `inputs`, in input order (a tar's samples in tar order, lines and rows in order),
    its file references resolving inside its input's directory or one of `media_roots`. The inputs and
    roots are checked now (MmtokError), before the first conversation is asked for."""
    check_inputs(inputs)
    return _conversations(inputs, check_media_roots(media_roots))


def check_media_roots(media_roots: Sequence[Path]) -> tuple[str, ...]:
    """The real paths of `media_roots`, each an existing directory (else MmtokError naming it)."""
    for root in media_roots:
        if not Path(root).is_dir():
            raise MmtokError(f"--media-root {root}: not a directory; pass a directory that holds the media")
    return tuple(os.path.realpath(root) for root in media_roots)


def check_inputs(inputs: list[Path]) -> None:
    """Each input exists, is of a known kind, and no two share a file stem (their ids would collide);
    an input that is an earlier one under another path is read once (`duplicate_input`), not checked."""
    stems: dict[str, Path] = {}
    for path, first in zip(inputs, same_file_as(inputs), strict=True):
        if not path.is_file():
            raise MmtokError(f"conversation input not found (or not a file): {path}")
        if first is not None:
            continue
        stem = input_stem(path)
        if stem in stems:
            raise MmtokError(f"inputs {stems[stem]} and {path} share the name {stem!r}: their conversation ids would "
                             "collide; rename one (ids are <file stem>/<key or content id>)")
        stems[stem] = path


def _conversations(inputs: list[Path], media_roots: tuple[str, ...]) -> Iterator[Conversation]:
    seen: set[str] = set()
    for _, _, conversation in input_records(inputs, media_roots):
        if is_checked_for_repeats(conversation):
            if conversation.id in seen:
                conversation = duplicate(conversation)
            seen.add(conversation.id)
        yield conversation


def input_records(inputs: list[Path], media_roots: tuple[str, ...] = (), first_input: int = 0,
                  start: Start = FROM_FIRST) -> Iterator[tuple[int, int, Conversation]]:
    """(input number, record number in that input, record) of every record of `inputs` from input `first_input`
    at `start`, in input order, before any repeat of an id is marked (`_conversations` and the conversation
    index mark them). A file given under two paths is one `duplicate_input` record at its second path."""
    earlier = same_file_as(inputs)
    for number in range(first_input, len(inputs)):
        path, first = inputs[number], earlier[number]
        if first is not None:  # its conversations would repeat under the ids of another stem
            if number > first_input or start.record == 0:
                yield number, 0, Conversation(path.name, str(path), number, whole_file=True, error=Skip(
                    DUPLICATE_INPUT, f"the same file as {inputs[first]} (one device and inode: a link or a mount)"))
            continue
        at = start if number == first_input else FROM_FIRST
        for record, conversation in enumerate(_input_conversations(path, number, at), at.record):
            if media_roots:
                conversation = replace(conversation, media_roots=media_roots)
            yield number, record, conversation


def is_checked_for_repeats(conversation: Conversation) -> bool:
    """Every record but the `duplicate_input` one of a file read under another path has an id no other may use."""
    return not (conversation.whole_file and conversation.error is not None
                and conversation.error.reason == DUPLICATE_INPUT)


def duplicate(conversation: Conversation) -> Conversation:
    """The record of a conversation whose id an earlier record of the inputs has."""
    return Conversation(conversation.id, conversation.origin, conversation.input, error=Skip(
        "duplicate_conversation", f"id {conversation.id!r} was used by an earlier conversation"))


def input_stem(path: Path) -> str:
    """The file name without its kind's suffix: the first part of its conversations' ids."""
    name = path.name
    return name[: -len(name.lower().rsplit(".", 1)[-1]) - 1] if input_kind(path) else name


def _parsed(data: bytes | str, what: str) -> tuple[dict | None, Skip | None]:
    """A json record (an object), or the `invalid_json` Skip naming `what`."""
    return _object(*json_value(data, what), what)


def _object(value, error: Skip | None, what: str) -> tuple[dict | None, Skip | None]:
    """A parsed json value that is an object, or the `invalid_json` Skip naming `what`."""
    if error is None and not isinstance(value, dict):
        return None, Skip("invalid_json", f"{what}: top level is {type(value).__name__}, not an object")
    return value, error


def _input_conversations(path: Path, number: int, start: Start) -> Iterator[Conversation]:
    """The conversations of one input from record `start.record`: its container's records
    (`mmtok.formats.containers.Container`), each made one conversation. The container is the one the name says
    (`input_kind`): a .parquet file is read as Parquet, whatever its first bytes."""
    kind = input_kind(path)
    if kind == TAR:
        yield from _tar_conversations(path, number, start)
        return
    stem = input_stem(path)
    if kind == JSONL:
        try:
            for record in reader(JSONL).records(path, start):
                yield _line_conversation(path, number, stem, record)
        except OSError as err:
            raise MmtokError(f"{path}: cannot read ({err.strerror or err})") from None
        return
    from mmtok.formats.tables import UNREADABLE_ROW_GROUP, UNREADABLE_TABLE, TableRecords  # (pyarrow: when needed)

    try:
        for record in TableRecords(PARQUET, required=("messages",)).records(path, start):
            yield _row_conversation(path, number, stem, record)
    except Skip as damaged:  # a table that does not open, without `messages`, or a row group whose pages do not parse
        what = {UNREADABLE_TABLE: f"unreadable Parquet ({damaged.detail})",
                UNREADABLE_ROW_GROUP: f"{damaged.detail}; check the file"}.get(damaged.reason, damaged.detail)
        raise MmtokError(f"{path}: {what}") from None


def _tar_conversations(path: Path, number: int, start: Start) -> Iterator[Conversation]:
    """A conversation per record of a WebDataset tar (`mmtok.formats.webdataset`) from `start.record`: a sample and
    its KEY.json member, or damage met outside a sample. The whole header list is read first (which keys repeat is
    known before any sample is used); only the samples from `start.record` on are made (their json read).

    Where the tar is damaged, the sample being read may have lost members: it is one record of the damage's
    reason (a member the file ends inside: `truncated_member`, as the scan says). Damage where no sample is
    open is a record of its own (`<stem>/(damaged tar at byte N)`); the reader goes on after it. A tar without
    a single sample (empty, compressed, no tar, no KEY.EXT member) is one `whole_file` record, no conversation.
    """
    try:
        records = list(reader(TAR).records(path))  # headers only
    except OSError as err:
        raise MmtokError(f"{path}: cannot read ({err.strerror or err})") from None
    if not any(record.value.key is not None for record in records):
        damage = next((record.value.damage for record in records), None)
        skip = (Skip(damage.reason, damage.describe()) if damage else
                Skip(NO_SAMPLES, "no member is named KEY.EXT (a WebDataset sample's member)"))
        if start.record == 0:
            yield Conversation(path.name, str(path), number, error=skip, tar=str(path), whole_file=True)
        return
    stem = input_stem(path)
    for record in records[start.record:]:
        sample = record.value
        if sample.key is None:
            yield _damage_record(path, stem, number, sample.damage)
        elif sample.repeated:
            yield _duplicate_key(path, stem, number, sample)
        else:
            yield _tar_sample(path, stem, number, sample)


def _duplicate_key(path: Path, stem: str, number: int, sample: Sample) -> Conversation:
    key = sample.key
    ident = f"{stem}/{key}" if sample.occurrence == 1 else f"{stem}/{key} (repeat {sample.occurrence})"  # unique
    return Conversation(ident, f"{path}:{key}", number, error=Skip(DUPLICATE_KEY, duplicate_key_detail(sample)),
                        tar=str(path), key=key)


def _damage_record(path: Path, stem: str, number: int, damage: Damage) -> Conversation:
    """The record of damage met where no sample was open: what it cut belongs to no sample read."""
    return Conversation(f"{stem}/(damaged tar at byte {damage.offset})", str(path), number,
                        error=Skip(damage.reason, damage.describe()))


def _tar_sample(path: Path, stem: str, number: int, sample: Sample) -> Conversation:
    """The conversation of one sample's members; its error is the first of: the damage that cut it short,
    a member the file ends inside, a refused or missing json member, a json that does not parse."""
    key, damage = sample.key, sample.damage
    origin, json_name = f"{path}:{key}", f"{key}.json"
    members = {entry.name: (entry.offset, entry.size) for entry in sample.members}
    refused = {entry.name: entry.reason for entry in sample.members if entry.reason}
    fields = {"tar": str(path), "key": key, "members": members, "refused": refused}
    cut = next((name for name, reason in refused.items() if reason == TRUNCATED_MEMBER), None)
    if damage is not None:
        error = Skip(damage.reason, damage.describe())
    elif cut is not None:
        error = Skip(TRUNCATED_MEMBER, f"the tar ends inside member {cut}: the sample's later members are lost")
    elif json_name in refused:
        error = Skip(refused[json_name], f"member {json_name}")
    elif json_name not in members:
        error = Skip("missing_json", f"sample {key} has no json member")
    else:
        record, error = _parsed(read_tar_member(path, *members[json_name]), json_name)
        ident = _own_id(record) or f"{stem}/{key}"  # `mmtok pack` keeps ids this way
        return Conversation(ident, origin, number, record, error, base=str(path.parent), **fields)
    return Conversation(f"{stem}/{key}", origin, number, error=error, **fields)


# -- Writing conversation tars (`mmtok pack`): samples `_tar_conversations` reads back ----------------------

SAMPLES_PER_TAR = 1000
TAR_NAME = re.compile(r"conversations-\d{6}\.tar")


def json_member_name(key: str) -> str:
    """The member holding a sample's conversation record."""
    return f"{key}.json"


def media_member_name(key: str, index: int, ext: str) -> str:
    """The member holding a sample's `index`-th medium of its kind (`sample_key` reads KEY back)."""
    return f"{key}.{index}.{ext}"


@dataclass
class PackedMember:
    """One member of a packed sample: its name, its size, and its bytes as an open stream (copied into the tar
    in pieces, so a medium is never held in memory whole)."""

    name: str
    size: int
    stream: IO[bytes]


def close_members(members: list[PackedMember]) -> None:
    for member in members:
        member.stream.close()


class ConversationTars:
    """Conversation tars `conversations-NNNNNN.tar` in OUT, `samples_per_tar` samples each, each tar written
    atomically as its samples come (a sample's media are streamed, never held whole), member metadata fixed (no
    clock, no owner): the same samples give the same bytes. `claim(name)` is called before a tar can appear
    (`mmtok pack` records it as its own). With no sample, one empty tar, so the later stages have an input."""

    def __init__(self, out: Path, samples_per_tar: int, claim: Callable[[str], None]):
        self.out, self.samples_per_tar, self.claim = out, samples_per_tar, claim
        self.names: list[str] = []
        self._stack = ExitStack()
        self._archive, self._samples = None, 0

    def add(self, members: list[PackedMember]) -> None:
        if self._archive is None or self._samples == self.samples_per_tar:
            self._next()
        try:
            for member in members:
                info = tarfile.TarInfo(member.name)
                info.size, info.mtime, info.mode = member.size, 0, 0o644
                self._archive.addfile(info, member.stream)  # copies `size` bytes in pieces
        finally:
            close_members(members)
        self._samples += 1

    def _next(self) -> None:
        self._stack.close()  # the previous tar: closed, fsynced, renamed into place
        self._stack = ExitStack()
        self.names.append(f"conversations-{len(self.names):06d}.tar")
        self.claim(self.names[-1])
        handle = self._stack.enter_context(atomic_writer(self.out / self.names[-1]))
        self._archive = self._stack.enter_context(tarfile.open(fileobj=handle, mode="w", format=tarfile.GNU_FORMAT))
        self._samples = 0

    def __enter__(self) -> "ConversationTars":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and not self.names:
            self._next()  # nothing packed: one empty tar, so the later stages have their input
        self._stack.__exit__(*exc)


def _line_conversation(path: Path, number: int, stem: str, record: Record) -> Conversation:
    """The conversation of a .jsonl line (`record.seek`: where a reader may start)."""
    value, error = _object(record.value, record.error, record.where)
    ident = _record_id(value, stem, record.where.replace(" ", "-"))
    return Conversation(ident, f"{path}:{record.where}", number, value, error, base=str(path.parent),
                        seek=record.seek)


def _row_conversation(path: Path, number: int, stem: str, record: Record) -> Conversation:
    """The conversation of a .parquet row: its columns are the record (`messages` may be a JSON string)."""
    row, error = record.value, None
    if isinstance(row["messages"], (str, bytes)):  # a JSON column: the list of messages as text
        row["messages"], error = json_value(row["messages"], f"{record.where} `messages`")
    ident = _record_id(None if error else row, stem, record.where.replace(" ", "-"))
    return Conversation(ident, f"{path}:{record.where}", number, None if error else row, error,
                        base=str(path.parent))


# -- references ----------------------------------------------------------------------------------
def locate(conversation: Conversation, media: list[MediaRef], slot: MediaSlot) -> Located:
    """Where the medium of `slot` is (`media` = conversation.media()); Skip `missing_media` if nowhere."""
    ref = next(m for m in media if m.slot == slot)
    what = f"{slot.kind} {slot.index}"
    source = ref.source
    if source is None:
        return _stored(conversation, media, slot)
    inline = f"{conversation.origin} {what} (inline)"
    if isinstance(source, dict):
        if isinstance(source.get("cut_id"), str):
            return Located("cut", f"cut {source['cut_id']}", cut_id=source["cut_id"])
        if isinstance(source.get("data"), str):
            return Located("bytes", inline, data=_base64(source["data"], what))
        if source.get("bytes") is not None:
            return _located_bytes(source["bytes"], what, inline)
        if isinstance(source.get("path"), str):
            source = source["path"]
        else:
            raise Skip("missing_media", f"{what}: a reference without cut_id, data, bytes or path: {_short(source)}")
    if isinstance(source, (bytes, bytearray)):
        return _located_bytes(source, what, inline)
    if not isinstance(source, str):
        raise Skip("missing_media", f"{what}: reference of type {type(source).__name__}")
    if source.startswith("data:"):
        header, _, payload = source.partition(",")
        if not header.endswith(";base64"):
            raise Skip("missing_media", f"{what}: a data URL that is not base64")
        return Located("bytes", inline, data=_base64(payload, what))
    if source.startswith(("http://", "https://")):
        raise Skip("missing_media", f"{what}: {source} is remote; mmtok reads no network -- fetch it first")
    if conversation.tar is not None and (member := _member(conversation, source)) is not None:
        return _located_member(conversation, member, what)
    return _located_file(conversation, source, what)


def _located_file(conversation: Conversation, source: str, what: str) -> Located:
    """A file path reference, inside the roots (the input's directory, then each media root): the first
    root under which it names something decides; Skip `outside_root` where its real path (symlinks and `..`
    resolved) lies in no root, `not_a_file` for what is no regular file, `missing_media` where nothing is."""
    reference = source.removeprefix("file://")
    bases = (conversation.base, *conversation.media_roots)
    roots = tuple(map(os.path.realpath, bases))
    outside = None
    for candidate in [reference] if os.path.isabs(reference) else [os.path.join(base, reference) for base in bases]:
        try:
            real = os.path.realpath(candidate)
            if not any(inside(real, root) for root in roots):
                outside = outside or real
                continue
            kind = not_a_regular_file(real)
        except (FileNotFoundError, NotADirectoryError):
            continue
        except (OSError, ValueError) as err:  # a name too long, a NUL byte, an I/O error: this medium, not the run
            raise Skip("missing_media", f"{what}: {source[:200]!r} cannot be checked ({err})") from None
        if kind is not None:
            raise Skip("not_a_file", f"{what}: {source[:200]!r} is {kind}; mmtok opens only regular files")
        return Located("file", str(Path(candidate)), real)
    if outside is not None:
        raise Skip(OUTSIDE_ROOT, f"{what}: {source[:200]!r} resolves to {outside[:200]}, outside "
                   f"{' and '.join(roots)}; a medium must lie in the input's directory or a --media-root DIR")
    what_not = f"neither a member of sample {conversation.origin} nor a file" if conversation.tar else "not a file"
    raise Skip("missing_media", f"{what}: {source!r} is {what_not} (looked in {' and '.join(roots)})")


def _stored(conversation: Conversation, media: list[MediaRef], slot: MediaSlot) -> Located:
    """A slot without a reference: in a tar, the sample's members of its kind in stored order."""
    if conversation.tar is None:
        raise Skip("missing_media", f"{slot.kind} {slot.index}: a placeholder without a reference (name the "
                   f"medium in a content part or the record's `{slot.kind}s` list)")
    named = {member for m in media if m.slot.kind == slot.kind and isinstance(m.source, str)
             and (member := _member(conversation, m.source)) is not None}
    stored = [name for name in kind_members(conversation, slot.kind) if name not in named]
    slots = sum(1 for m in media if m.slot.kind == slot.kind and m.source is None)
    if len(stored) != slots:
        raise Skip("placeholder_mismatch", f"{slots} {slot.kind} placeholder(s) without a reference, the sample "
                   f"has {len(stored)} {slot.kind} member(s)")
    unnamed = [m.slot for m in media if m.slot.kind == slot.kind and m.source is None]
    return _located_member(conversation, stored[unnamed.index(slot)], f"{slot.kind} {slot.index}")


def _located_member(conversation: Conversation, member: str, what: str) -> Located:
    """A sample member's byte range; Skip with the tar reader's reason for a member it refuses."""
    if member in conversation.refused:
        raise Skip(conversation.refused[member], f"{what}: the tar reader refuses member {member} of "
                   f"{conversation.tar}")
    offset, size = conversation.members[member]
    return Located("member", f"{conversation.tar}:{member}", conversation.tar, offset, size, member=member)


def kind_members(conversation: Conversation, kind: str) -> list[str]:
    """The sample's members of `kind` ("image"/"audio") by suffix, in the scan's order for members no
    reference names: the N of `KEY.N.ext`, then the name, then tar order (mmtok.scan.scanner.document_order)."""
    suffixes = KIND_SUFFIXES[kind]
    names = [name for name in conversation.members if name.rsplit(".", 1)[-1].lower() in suffixes]

    def order(item: tuple[int, str]) -> tuple:
        position, name = item
        suffix = name[len(conversation.key) + 1:] if name.startswith(f"{conversation.key}.") else name
        number = suffix.split(".", 1)[0]
        return (0, int(number), "", position) if number.isdigit() and "." in suffix else (1, 0, name, position)

    return [name for _, name in sorted(enumerate(names), key=order)]


def _member(conversation: Conversation, name: str) -> str | None:
    for candidate in (name, f"{conversation.key}.{name}"):
        if candidate in conversation.members:
            return candidate
    matches = [m for m in conversation.members if m.rsplit("/", 1)[-1] == name]
    return matches[0] if len(matches) == 1 else None


def _located_bytes(value, what: str, where: str) -> Located:
    if not isinstance(value, (bytes, bytearray)) or not value:
        raise Skip("missing_media", f"{what}: empty or non-bytes inline data")
    return Located("bytes", where, data=bytes(value))


def _base64(text: str, what: str) -> bytes:
    try:
        data = base64.b64decode("".join(text.split()), validate=True)  # line-wrapped base64 is still base64
    except (binascii.Error, ValueError) as err:
        raise Skip("missing_media", f"{what}: inline data is not base64 ({err})") from None
    if not data:
        raise Skip("missing_media", f"{what}: empty inline data")
    return data


def _short(value) -> str:
    text = json.dumps(value, default=str)
    return text if len(text) <= 80 else text[:77] + "..."


def input_fingerprint(inputs: list[Path]) -> list[dict]:
    """What identifies the inputs for a resume: path, size and mtime of each."""
    out = []
    for path in inputs:
        stat = os.stat(path)
        out.append({"path": shown_path(Path(path).resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns})
    return out
