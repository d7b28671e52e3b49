"""The five kinds of audio source `mmtok audio convert` reads, as lists of picklable work units.

A *work unit* is one decode task handed to a worker process; `Unit.payloads()` yields, in a fixed
order, each audio payload of the unit with the clips cut from it (or a skip record for what
could not be read). Kinds and their units:

  dir            a directory of audio files (+ optional transcript table)   one unit per audio file
  tar            WebDataset tars: audio members + txt/json sidecars          one unit per tar
  lhotse         Lhotse recording (+ supervision) manifests                  one unit per recording
  parquet        Parquet files with an audio-bytes column                    one unit per row group
  conversations  SFT conversations (`mmtok.formats.conversations`: KEY.json samples  up to CONVERSATION_UNIT_CLIPS
                 of tars, .jsonl lines, .parquet rows), never auto-detected  clips of one input

A conversation's audio slot k is one whole clip `<conversation id>/audio-<k>` without text (its text
is the conversation, which `mmtok sft` assembles later). A slot that names a clip already in an audio
token cache (`{"cut_id": ...}`) is no clip of the input: it is neither converted nor counted in `in`;
nor is a conversation without audio. A slot that cannot be located is skipped with its clip id, a
conversation whose media cannot be listed with its conversation id.

Clip metadata uses one vocabulary everywhere: `text`, `recording_id` (the *source id*: clips of one
recording form runs for interleaving), `clip` (the clip number in its recording), `start`/`end`
(seconds), `language`, `target_language`, `id` (the cut id). In a transcript table and in Lhotse
supervisions `start`/`end` cut a segment out of the audio; in tars and Parquet each audio payload
*is* one clip and `start` only orders clips of a recording that carry no explicit `clip` number.
Clip numbers are assigned before any clip is validated, so a dropped clip leaves a gap (which the
interleave builder treats as a break in the run); a record whose metadata cannot be read (a bad table
row, an unreadable json sidecar) takes no number.

What is audio is decided by content: a directory file with a known audio extension is decoded (a
broken one is a `decode_error`), any other file is audio when libsndfile opens its header, and what is
left is counted by extension (`ignored`), never dropped silently.
"""

from __future__ import annotations

import io
import math
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable, Iterator, NamedTuple, Sequence

import numpy as np

from mmtok.errors import MmtokError, Skip
from mmtok.formats.chat import ConversationError
from mmtok.formats.conversations import (
    AUDIO_SUFFIXES,
    Conversation,
    Located,
    audio_clip_id,
    json_value,
    locate,
    read_conversations,
    sample_key,
)
from mmtok.formats.shar import CUTS_GLOB, source_digest
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import NON_UTF8_NAME, Damage, MemberTruncated, read_member, read_members
from mmtok.fsutil import (
    DUPLICATE_INPUT,
    OUTSIDE_ROOT,
    not_a_regular_file,
    outside,
    read_regular_file,
    same_file_as,
    shown_path,
)
from mmtok.media.audio import AudioReason, to_mono

KINDS = ("dir", "tar", "lhotse", "parquet", "conversations")
CONVERSATION_UNIT_CLIPS = 64  # clips per conversation unit: a worker's task, small enough for many tasks
META_KEYS = ("text", "recording_id", "clip", "start", "end", "language", "target_language", "id")
NO_EXTENSION = "(no extension)"


@dataclass
class ClipSpec:
    """One clip to cut from a decoded payload; `start`/`end` in seconds of that payload (None: whole)."""

    id: str
    source_id: str
    clip: int
    origin: str
    text: str | None = None
    language: str | None = None
    target_language: str | None = None
    start: float | None = None
    end: float | None = None
    channel: int | None = None  # pick one channel of a multi-channel payload (else downmix)


def skip_record(key: str, origin: str, reason: str, detail: str = "") -> SkipRecord:
    """The skip record of something (a clip id, a file, a table row) that did not become a clip."""
    return SkipRecord(key=key, source=origin, reason=reason, detail=detail, stage="convert")


# A payload loader returns (samples [T] or [T, C] float32, sampling rate, sha256 of the bytes they were
# decoded from -- None when lhotse read them --) or raises AudioReason. The digest binds each clip to its
# bytes (`mmtok.formats.shar.SOURCE_DIGEST`), so a medium changed since the conversion is never given old tokens.
Loader = Callable[[], tuple[np.ndarray, int, str | None]]


@dataclass
class Unit:
    """One work unit (picklable). Subclasses yield (loader, clips) pairs or skip records."""

    origin: str

    def payloads(self) -> Iterator[tuple[Loader, list[ClipSpec]] | SkipRecord]:
        raise NotImplementedError


def decode_audio(data: bytes | str, origin: str) -> tuple[np.ndarray, int, str]:
    """Decode a file path or encoded bytes with soundfile (WAV, FLAC, OGG/Opus, MP3) -> ([T] or [T, C], rate,
    sha256 of the bytes): the bytes are read once, for the digest and the decoder."""
    import soundfile

    try:
        data = data if isinstance(data, bytes) else Path(data).read_bytes()
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=False)
    except Exception as err:  # libsndfile reports every malformed input as a generic error
        raise AudioReason("decode_error", f"{origin}: {err}") from None
    return samples, int(rate), source_digest(data)


# --- clip numbering -------------------------------------------------------------------------------

def number_clips(records: list[dict]) -> list[int]:
    """Clip number of each record: its explicit `clip`, else its rank by (start, position) in its recording.

    `records` are metadata dicts with `recording_id` set, values as `clean_metadata` leaves them; the
    result follows their order.
    """
    numbers: list[int | None] = [None] * len(records)
    pending: dict[str, list[tuple[float, int]]] = {}
    for position, record in enumerate(records):
        if record.get("clip") not in (None, ""):
            numbers[position] = int(record["clip"])
        else:
            start = _float_or_none(record.get("start"))
            pending.setdefault(record["recording_id"], []).append((-1.0 if start is None else start, position))
    for entries in pending.values():
        for rank, (_, position) in enumerate(sorted(entries)):
            numbers[position] = rank
    return [int(n) for n in numbers]


def clean_metadata(record: dict) -> dict:
    """`record` with `clip`/`channel` as non-negative ints and `start`/`end` as finite non-negative
    seconds (None when absent or empty), its names checked to be strings (ids: or integers), so that
    numbering and cutting cannot fail on it.

    Raises ValueError naming the first field whose value is none of these (say "clip='abc' ...").
    """
    cleaned = dict(record)
    for key, kind in (("clip", int), ("channel", int), ("start", float), ("end", float)):
        cleaned[key] = _number(key, record.get(key), kind)
    for key in ("text", "language", "target_language", "id", "recording_id"):
        value = record.get(key)
        allowed = (str, int) if key in ("id", "recording_id") else (str,)
        if value is not None and (isinstance(value, bool) or not isinstance(value, allowed)):
            raise ValueError(f"{key}={value!r} is not a string")
    return cleaned


def _number(key: str, value, kind: type) -> int | float | None:
    if value is None or value == "":
        return None
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float) and not value.is_integer()):
            raise ValueError
        number = kind(value.strip() if isinstance(value, str) else value)
    except (TypeError, ValueError, OverflowError):
        number = None
    if number is None or not math.isfinite(number) or number < 0:
        noun = "integer" if kind is int else "number of seconds"
        raise ValueError(f"{key}={value!r} is not a non-negative {noun}")
    return number


def _float_or_none(value) -> float | None:
    if value is None or value == "":
        return None
    return float(value)


def _text_or_none(value) -> str | None:
    return None if value is None or value == "" else str(value)


def _spec(record: dict, clip: int, origin: str, *, cut_segment: bool) -> ClipSpec:
    return ClipSpec(
        id=str(record["id"]), source_id=str(record["recording_id"]), clip=clip, origin=origin,
        text=_text_or_none(record.get("text")), language=_text_or_none(record.get("language")),
        target_language=_text_or_none(record.get("target_language")),
        start=_float_or_none(record.get("start")) if cut_segment else None,
        end=_float_or_none(record.get("end")) if cut_segment else None,
        channel=record.get("channel"),
    )


# --- (a) directory of audio files + transcript table ------------------------------------------------

@dataclass
class FileUnit(Unit):
    path: str = ""
    clips: list[ClipSpec] = field(default_factory=list)

    def payloads(self):
        yield (lambda: decode_audio(self.path, self.origin)), self.clips


def read_transcript_table(path: Path) -> tuple[list[dict], list[SkipRecord]]:
    """Rows of a TSV (header line) or JSONL transcript table, values checked by `clean_metadata`.

    Every line that cannot be read as a row (not UTF-8, not a JSON object, a wrong number of TSV
    fields, no `path`, a bad field value) is skipped as `bad_table_row` naming the file and line; the
    other rows are returned with their line number in `_line`. A TSV header without a `path`
    column is a user error.
    """
    rows, dropped = [], []
    lines = _table_lines(path)
    if not lines:
        return rows, dropped
    parse = _json_row if path.suffix.lower() in (".jsonl", ".json") else _tsv_parser(path, lines)
    for line, text in lines:
        try:
            if text is None:
                raise ValueError("not UTF-8 text")
            row = clean_metadata(parse(text))
            if not isinstance(row.get("path"), str) or not row["path"]:
                raise ValueError("no `path` value")
        except ValueError as err:
            dropped.append(skip_record(f"{path.name}:{line}", f"{path}:{line}", "bad_table_row",
                                   f"{err}; fix or remove line {line}"))
            continue
        rows.append({**row, "_line": line})
    return rows, dropped


def _table_lines(path: Path) -> list[tuple[int, str | None]]:
    """(line number, text or None where the line is not UTF-8) of every non-blank line."""
    lines = []
    for number, raw in enumerate(path.read_bytes().split(b"\n"), 1):
        raw = raw.removesuffix(b"\r")
        try:
            # a UTF-8 byte-order mark (spreadsheet exports) is not part of the first field
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")
        except UnicodeDecodeError:
            text = None
        if text is None or text.strip():
            lines.append((number, text))
    return lines


def _json_row(text: str) -> dict:
    row, error = json_value(text, "json")  # deep nesting and lone surrogates too, as every reader
    if error is not None:
        raise ValueError(error.detail)
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    return row


def _tsv_parser(path: Path, lines: list[tuple[int, str | None]]) -> Callable[[str], dict]:
    """Take the header off `lines` and return the row parser it defines (tab-separated, no quoting)."""
    line, header = lines.pop(0)
    columns = (header or "").split("\t")
    if header is None or "path" not in columns:
        raise MmtokError(f"{path}:{line}: the header line names no `path` column (got {columns[:8]}); the first "
                         "line of a TSV transcript table names its tab-separated columns, one of them `path`")

    def parse(text: str) -> dict:
        fields = text.split("\t")
        if len(fields) != len(columns):
            raise ValueError(f"{len(fields)} tab-separated fields, the header has {len(columns)}")
        return dict(zip(columns, fields, strict=True))

    return parse


def is_audio_file(path: Path) -> bool:
    """True when the extension is a known audio one or libsndfile opens the file by its content.

    Only the header is read. A headerless RAW guess (libsndfile's reading of `.vox`, `.gsm`, ...
    by extension alone) does not count: any bytes would pass.
    """
    if extension_of(path.name) in AUDIO_SUFFIXES:
        return True
    import soundfile

    try:
        return soundfile.info(os.fsencode(path)).format != "RAW"  # bytes: a name that is not UTF-8 too
    except Exception:  # libsndfile reports every unrecognised input as a generic error
        return False


def extension_of(name: str) -> str:
    """The lower-case extension without its dot, or NO_EXTENSION: the key non-audio files are counted by."""
    return PurePosixPath(name).suffix.lower().lstrip(".") or NO_EXTENSION


def scan_directory(root: Path, named: set[str], skip: Path | None,
                   exclude: Path | None = None) -> tuple[list[str], Counter, dict[str, str]]:
    """(audio files under `root` as sorted relative paths, other files counted by extension, the files and
    linked directories whose real path leaves `root` -- a symlink elsewhere -- as relative path -> real path).

    A file the transcript table names is audio whatever its content (its decoder decides); `skip`
    (the table itself) is neither; nothing under `exclude` (the conversion's own output, when it lies
    inside the input) is looked at -- opening its `.lock` would drop the writer lock. A file that leaves
    `root` is never opened: it is `outside_root`, as a conversation's reference to it is.
    """
    audio, ignored, escaped = [], Counter(), {}
    skip = skip.resolve() if skip else None
    exclude = exclude.resolve() if exclude else None
    for path in root.rglob("*"):
        if exclude is not None and path.resolve().is_relative_to(exclude):
            continue
        rel, real = path.relative_to(root).as_posix(), outside(path, root)
        if real is not None and (path.is_file() or path.is_symlink()):  # rglob does not descend a linked directory
            escaped[rel] = real
        elif not path.is_file():
            continue
        elif rel in named or is_audio_file(path):
            audio.append(rel)
        elif skip is None or path.resolve() != skip:
            ignored[shown_path(extension_of(rel))] += 1
    return sorted(audio), ignored, escaped


def directory_units(root: Path, table: Path | None,
                    exclude: Path | None = None) -> tuple[list[Unit], list[SkipRecord], Counter]:
    """One unit per audio file under `root` (sorted by relative path); table rows define its clips.

    A file without table rows is one clip without text. A table row may name a segment
    (`start`/`end`); its default recording id is the file's relative path without its extension, its
    default cut id the same (plus `/NNNNN`, the row's index among the file's rows, when the file has
    several). Also returns the non-audio files counted by extension.
    """
    rows, dropped = read_transcript_table(table) if table else ([], [])
    by_file: dict[str, list[dict]] = {}
    for row in rows:
        rel = _relative_to(Path(row["path"]), root)
        by_file.setdefault(rel, []).append(row)
    files, ignored, escaped = scan_directory(root, set(by_file), table, exclude)
    for rel, real in sorted(escaped.items()):  # named once per file, whatever the table says of it
        detail = f"resolves to {shown_path(real)}, outside the input directory {shown_path(root)}: never read"
        dropped.append(skip_record(shown_path(rel), shown_path(rel), OUTSIDE_ROOT, detail))
        by_file.pop(rel, None)
    for rel in files:  # a clip id is text: a name that is not UTF-8 is refused as in a tar (shown escaped)
        if shown_path(rel) != rel:
            dropped.append(skip_record(shown_path(rel), shown_path(rel), NON_UTF8_NAME, "a file name that is not "
                                       "UTF-8 (shown with \\xNN escapes): rename it (e.g. `convmv`)"))
    files = [rel for rel in files if shown_path(rel) == rel]
    records: list[dict] = []
    owners: list[str] = []
    for rel in sorted(set(files) | set(by_file)):
        file_rows = by_file.get(rel) or [{}]
        stem = rel[: len(rel) - len(PurePosixPath(rel).suffix)]
        for index, row in enumerate(file_rows):
            default_id = stem if len(file_rows) == 1 else f"{stem}/{index:05d}"
            records.append({**row, "id": row.get("id") or default_id, "recording_id": row.get("recording_id") or stem})
            owners.append(rel)
    numbers = number_clips(records)
    units: list[Unit] = []
    present = set(files)
    for rel in sorted(set(owners)):
        mine = [(r, n) for r, n, o in zip(records, numbers, owners, strict=True) if o == rel]
        if rel not in present:
            real = outside(root / rel, root)  # a row naming a file outside DIR (`..`, an absolute path, a link)
            reason, detail = (OUTSIDE_ROOT, f"{rel} resolves to {shown_path(real)}, outside the input directory "
                              f"{shown_path(root)}") if real is not None else ("missing_file", rel)
            dropped.extend(skip_record(str(r["id"]), f"{table}:{r['_line']}", reason, detail) for r, _ in mine)
            continue
        clips = [_spec(r, n, f"{rel}" + (f" ({table.name}:{r['_line']})" if "_line" in r else ""), cut_segment=True)
                 for r, n in mine]
        units.append(FileUnit(origin=rel, path=str(root / rel), clips=clips))
    return units, dropped, ignored


def _relative_to(path: Path, root: Path) -> str:
    if path.is_absolute():
        try:
            return path.relative_to(root).as_posix()
        except ValueError:
            return path.as_posix()
    return path.as_posix()


# --- (b) WebDataset tars ------------------------------------------------------------------------

@dataclass
class TarUnit(Unit):
    path: str = ""

    def payloads(self):
        tar_id = Path(self.path).name.removesuffix(".tar")
        samples, errors = audio_tar_members(self.path)
        yield from errors
        records, audio, problems = [], [], []
        for key, members in samples.items():
            audio_members = [m for m in members if m[0] in AUDIO_SUFFIXES]
            if not audio_members:
                yield skip_record(f"{tar_id}/{key}", f"{self.path}:{key}", "no_audio_member",
                              ", ".join(m[0] for m in members))
                continue
            for extra in audio_members[1:]:
                yield skip_record(f"{tar_id}/{key}", f"{self.path}:{extra[5]}", "extra_audio_member",
                                  f"sample {key} holds {len(audio_members)} audio members; {KEY_RULE}")
            meta, problem = _sidecar_metadata(members)
            problem = _refusal(audio_members[0], members) or problem
            records.append({**meta, "id": meta.get("id") or f"{tar_id}/{key}",
                            "recording_id": meta.get("recording_id") or f"{tar_id}/{key}"})
            audio.append(audio_members[0])
            problems.append(problem)
        numbers = number_clips(records)  # before dropping bad sidecars: a dropped clip leaves a gap
        for record, number, (_, offset, size, _, _, name), problem in zip(records, numbers, audio, problems,
                                                                          strict=True):
            origin = f"{self.path}:{name}"
            if problem is not None:
                yield skip_record(str(record["id"]), origin, *problem)
                continue
            loader = _ByteRangeLoader(self.path, offset, size, origin)
            yield loader, [_spec(record, number, origin, cut_segment=False)]


@dataclass
class _ByteRangeLoader:
    path: str
    offset: int
    size: int
    origin: str

    def __call__(self) -> tuple[np.ndarray, int, str | None]:
        try:
            data = read_member(self.path, self.offset, self.size)
        except MemberTruncated:  # cut short since the tar was listed
            raise AudioReason("truncated_member", self.origin) from None
        return decode_audio(data, self.origin)


def audio_tar_members(path: str) -> tuple[dict[str, list[tuple]], list[SkipRecord]]:
    """Group tar members by WebDataset key -> [(suffix, data offset, size, sidecar bytes or None, refusal, member
    name)], in tar order; `refusal` is (reason, detail) for a member the tar reader refuses
    (`mmtok.formats.tar.Member`); `suffix` per `member_suffix`.

    Audio data is not read here (only its byte range); txt/json sidecars are. A damaged tar keeps the
    members the reader finds and reports each damage with its reason (`truncated_tar`, `corrupt_header`, ...).
    """
    samples: dict[str, list[tuple]] = {}
    errors: list[SkipRecord] = []
    try:
        for entry in read_members(path):
            if isinstance(entry, Damage):
                errors.append(skip_record(Path(path).name, path, entry.reason, entry.describe()))
                continue
            named = sample_key(entry.name)
            if named is None:
                continue
            key, ext = named[0], member_suffix(named[1])
            refusal = (entry.reason, f"member {entry.name}") if entry.reason else None
            body = None
            if ext in ("txt", "json") and refusal is None:
                body = read_member(path, entry.offset, entry.size)
            samples.setdefault(key, []).append((ext, entry.offset, entry.size, body, refusal, entry.name))
    except OSError as err:
        errors.append(skip_record(Path(path).name, path, "truncated_tar", str(err)))
    return samples, errors


def member_suffix(ext: str) -> str:
    """What a member is, from its extension after the key (scan's rule for images): `flac` of `x.flac`, and the
    last part of a dotted one (`wav` of `laion.v2.000001.wav`, whose key is `laion`)."""
    ext = ext.lower()
    return ext if ext in AUDIO_SUFFIXES or ext in ("txt", "json") else ext.rpartition(".")[2]


KEY_RULE = ("a WebDataset sample key ends at the first dot of a member's name, so `laion.v2.000001.wav` and "
            "`laion.v2.000002.wav` are both sample `laion`: rename such members (docs/audio.md)")


def _refusal(audio_member: tuple, members: list[tuple]) -> tuple[str, str] | None:
    """Why a sample's clip cannot be made from what the tar reader refused: its audio member, else a sidecar."""
    sidecars = (m for m in members if m[0] in ("txt", "json"))
    return next((m[4] for m in (audio_member, *sidecars) if m[4] is not None), None)


def _sidecar_metadata(members: list[tuple]) -> tuple[dict, tuple[str, str] | None]:
    """(metadata from the json sidecar, its text else the txt sidecar's; (reason, detail) or None).

    A sidecar that is not UTF-8 is `bad_text_encoding` (never decoded with replacement characters);
    a json sidecar that is not an object or has a bad field value is `bad_metadata`. The metadata
    then holds what could be read, so the clip still takes its number.
    """
    meta: dict = {}
    sidecars = [m for m in members if m[0] == "json"][:1]  # the first, as for txt (a dotted key's others: its samples')
    for _, _, _, body, *_ in sidecars:
        if body is not None:
            try:
                loaded = _json_row(body.decode("utf-8"))
            except UnicodeDecodeError as err:
                return meta, ("bad_text_encoding", f"json sidecar: {err}")
            except ValueError as err:
                return meta, ("bad_metadata", f"json sidecar: {err}")
            picked = {k: loaded[k] for k in META_KEYS if k in loaded}
            try:
                meta.update(clean_metadata(picked))
            except ValueError as err:
                return {}, ("bad_metadata", f"json sidecar: {err}")
    for ext, _, _, body, *_ in members:
        if ext == "txt" and body is not None and not meta.get("text"):
            try:
                meta["text"] = body.decode("utf-8").strip()
            except UnicodeDecodeError as err:
                return meta, ("bad_text_encoding", f"txt sidecar: {err}")
    return meta, None


# --- (c) Lhotse manifests ------------------------------------------------------------------------

@dataclass
class RecordingUnit(Unit):
    recording: dict = field(default_factory=dict)
    clips: list[ClipSpec] = field(default_factory=list)

    def payloads(self):
        yield _RecordingLoader(self.recording, self.origin), self.clips


@dataclass
class _RecordingLoader:
    recording: dict
    origin: str

    def __call__(self) -> tuple[np.ndarray, int, str | None]:
        from lhotse import Recording

        try:
            recording = Recording.from_dict(dict(self.recording))  # from_dict pops keys: keep the unit's intact
            samples = recording.load_audio()  # [C, T] at the recording's own rate
        except Exception as err:  # lhotse wraps every backend failure differently
            raise AudioReason("decode_error", f"{self.origin}: {err}") from None
        return np.ascontiguousarray(samples.T), int(recording.sampling_rate), None


SOURCE_TYPES = ("file", "command", "url", "memory", "shar")  # lhotse.audio.AudioSource.type
UNSAFE_SOURCE_TYPES = ("command", "url")  # a shell command run as the user; a fetch over the network
RECORDING_KEYS = {"id": str, "sources": list, "sampling_rate": int, "num_samples": int, "duration": (int, float)}
SUPERVISION_KEYS = {"id": str, "recording_id": str, "start": (int, float), "duration": (int, float)}
CUT_KEYS = {"id": str, "start": (int, float), "duration": (int, float), "recording": dict}
ROW_KEYS = {"recording": RECORDING_KEYS, "supervision": SUPERVISION_KEYS}


def lhotse_units(manifests: list[Path], allow_command_sources: bool = False) -> tuple[list[Unit], list[SkipRecord]]:
    """One unit per recording (manifest order); its supervisions (sorted by start) are its clips. The
    cuts of a CutSet manifest (`cuts.jsonl.gz`, MonoCuts with their recording inside) are clips too: one
    unit per recording they cut (order of first cut), each cut one clip (see `_cut_clips`).

    A recording without supervisions is one clip without text; a supervision whose recording is
    in none of the manifests is skipped (`missing_recording`). A manifest line that is no recording,
    supervision or MonoCut (not a JSON object, a missing key, a value of the wrong type) is
    `bad_manifest_row` naming the file and line. Every clip of a recording read by a `command` or `url`
    source is `unsafe_source` unless `allow_command_sources`, and of one whose `file` source is a FIFO,
    device, socket or directory `not_a_file`: such a source is never run, fetched or opened.
    """
    recordings, supervisions, cuts, dropped = _manifest_rows(manifests)
    if not recordings and not cuts and not dropped:  # bad rows: the run ends naming each (no clip written)
        raise MmtokError(f"no Lhotse recordings or cuts found in {', '.join(map(str, manifests))}: pass the "
                         "recordings manifest (JSONL with `sources`) together with the supervisions manifest, "
                         "or a CutSet manifest")
    by_recording: dict[str, list[dict]] = {}
    for sup in supervisions:
        by_recording.setdefault(sup["recording_id"], []).append(sup)
    known = {r["id"] for r in recordings}
    dropped += [skip_record(s["id"], f"supervision {s['id']}", "missing_recording", s["recording_id"])
                for s in supervisions if s["recording_id"] not in known]
    clipped = []
    for rec in recordings:
        sups = sorted(by_recording.get(rec["id"], []), key=lambda s: (s["start"], s["id"]))
        clips = [_supervision_clip(rec["id"], s, n) for n, s in enumerate(sups)]
        if not sups:
            clips = [ClipSpec(id=rec["id"], source_id=rec["id"], clip=0, origin=f"recording {rec['id']}")]
        clipped.append((rec, clips))
    units: list[Unit] = []

    def add(rec: dict, clips: list[ClipSpec]) -> None:
        refusal = _source_refusal(rec, allow_command_sources)
        if refusal is not None:
            dropped.extend(skip_record(clip.id, clip.origin, *refusal) for clip in clips)
        else:
            units.append(RecordingUnit(origin=f"recording {rec['id']}", recording=rec, clips=clips))

    for rec, clips in clipped:
        add(rec, clips)
    cuts, conflicting = _one_recording_per_id(cuts, {r["id"] for r in recordings})
    dropped += conflicting
    for rec, clips in _cut_clips(cuts):
        add(rec, clips)
    return units, dropped


def _one_recording_per_id(cuts: list[dict], listed: set[str]) -> tuple[list[dict], list[SkipRecord]]:
    """The cuts whose recording is the one their recording id first named, and a `bad_manifest_row` for each other:
    a cut holding another recording under that id (other sources), or one of a recording the recordings manifest
    also lists (its clips would be numbered twice)."""
    first: dict[str, dict] = {}
    kept, dropped = [], []
    for cut in cuts:
        rec = cut["recording"]
        problem = None
        if rec["id"] in listed:
            problem = f"recording {rec['id']!r} is also in a recordings manifest: pass the cuts or the manifests"
        elif first.setdefault(rec["id"], rec) != rec:
            problem = f"recording {rec['id']!r} differs from the one an earlier cut holds under that id"
        if problem:
            dropped.append(skip_record(cut["id"], f"cut {cut['id']}", "bad_manifest_row", problem))
        else:
            kept.append(cut)
    return kept, dropped


def _cut_clips(cuts: list[dict]) -> list[tuple[dict, list[ClipSpec]]]:
    """(recording, its clips) of a CutSet manifest's MonoCuts, recordings in order of their first cut. A cut
    is one clip, its segment [start, start + duration) of its recording; its clips are numbered by start
    time. Its text is its supervisions' texts in start order joined by one space, its language and
    target language the first supervision's (the rule `encode --shar` applies to a Shar's cuts)."""
    by_recording: dict[str, tuple[dict, list[dict]]] = {}
    for cut in cuts:
        by_recording.setdefault(cut["recording"]["id"], (cut["recording"], []))[1].append(cut)
    out = []
    for rec, members in by_recording.values():
        clips = []
        for number, cut in enumerate(sorted(members, key=lambda c: (c["start"], c["id"]))):
            sups = sorted((s for s in cut.get("supervisions") or [] if isinstance(s, dict)),
                          key=lambda s: (_float_or_none(s.get("start")) or 0.0, str(s.get("id"))))
            texts = [t for t in (_text_or_none(s.get("text")) for s in sups) if t]
            first = sups[0] if sups else {}
            channel = cut.get("channel")
            clips.append(ClipSpec(
                id=cut["id"], source_id=rec["id"], clip=number, origin=f"cut {cut['id']}",
                text=" ".join(texts) or None, language=_text_or_none(first.get("language")),
                target_language=_text_or_none((first.get("custom") or {}).get("target_language")),
                start=float(cut["start"]), end=float(cut["start"]) + float(cut["duration"]),
                channel=channel if isinstance(channel, int) and not isinstance(channel, bool) else None))
        out.append((rec, clips))
    return out


def _manifest_rows(manifests: list[Path]) -> tuple[list[dict], list[dict], list[dict], list[SkipRecord]]:
    """(recordings, supervisions, cuts, bad_manifest_row records) of the manifests' lines: a row with a
    `type` ending in "Cut" (or a `recording` object) is a cut, one with `sources` (or a `sampling_rate`,
    which no supervision has) a recording, any other a supervision; each checked to hold the keys mmtok and
    lhotse need."""
    rows: dict[str, list[dict]] = {"recording": [], "supervision": [], "cut": []}
    dropped = []
    for path in manifests:
        for line, row in _jsonl_rows(path):
            kind = _row_kind(row)
            problem = _cut_problem(row) if kind == "cut" else _row_problem(row, ROW_KEYS[kind], kind)
            if problem is None and kind in ("recording", "cut"):
                recording = row if kind == "recording" else row["recording"]
                problem = next(filter(None, map(_source_problem, recording["sources"])), None)
            if problem is not None:
                dropped.append(skip_record(f"{path.name}:{line}", f"{path}:{line}", "bad_manifest_row",
                                           f"{problem}; fix or remove line {line}"))
            else:
                rows[kind].append(row)
    return rows["recording"], rows["supervision"], rows["cut"], dropped


def _row_kind(row) -> str:
    if not isinstance(row, dict):
        return "supervision"  # _row_problem names what it is instead
    if str(row.get("type", "")).endswith("Cut") or isinstance(row.get("recording"), dict):
        return "cut"
    return "recording" if "sources" in row or "sampling_rate" in row else "supervision"


def _cut_problem(cut: dict) -> str | None:
    """Why a cut row is no MonoCut mmtok can cut its clip from (None when it is one)."""
    if cut.get("type", "MonoCut") != "MonoCut":
        return (f"a {_shown(cut.get('type'))} (a mix or padding of several cuts); mmtok converts MonoCuts: "
                "convert the cuts before mixing them")
    return (_row_problem(cut, CUT_KEYS, "cut") or _row_problem(cut["recording"], RECORDING_KEYS, "recording")
            or _supervisions_problem(cut.get("supervisions")))


def _supervisions_problem(supervisions) -> str | None:
    """Why a cut's `supervisions` are not a list of supervision objects whose fields mmtok reads are typed
    (None when they are; absent or null is no supervision)."""
    if supervisions is None:
        return None
    if not isinstance(supervisions, list):
        return f"cut `supervisions`={_shown(supervisions)} is not a list"
    for sup in supervisions:
        if not isinstance(sup, dict):
            return f"a cut supervision that is not a JSON object but {type(sup).__name__}"
        start, custom = sup.get("start", 0), sup.get("custom")
        if isinstance(start, bool) or not isinstance(start, (int, float)) or not math.isfinite(start):
            return f"cut supervision `start`={_shown(start)} is not a finite number"
        if custom is not None and not isinstance(custom, dict):
            return f"cut supervision `custom`={_shown(custom)} is not a JSON object"
        for key in ("text", "language"):
            if sup.get(key) is not None and not isinstance(sup[key], str):
                return f"cut supervision `{key}`={_shown(sup[key])} is not a string"
    return None


def _jsonl_rows(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed JSON or a ValueError) of every non-blank line of a .jsonl[.gz] manifest."""
    import gzip

    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rb") as handle:
            for number, raw in enumerate(handle, 1):
                if raw.strip():
                    value, skip = json_value(raw, f"line {number}")
                    yield number, ValueError(f"not JSON ({skip.detail})") if skip else value
    except (OSError, EOFError) as err:  # unreadable, or a damaged gzip stream
        raise MmtokError(f"{path}: cannot read the Lhotse manifest ({err})") from None


_KIND_NAMES = {str: "a non-empty string", list: "a non-empty list", int: "an integer", dict: "a JSON object"}


def _row_problem(row, keys: dict[str, type | tuple], noun: str) -> str | None:
    """Why `row` is not a row with `keys` of their types (None when it is)."""
    if isinstance(row, ValueError):
        return str(row)
    if not isinstance(row, dict):
        return f"not a JSON object but {type(row).__name__}"
    for key, kind in keys.items():
        value = row.get(key)
        if value is None:
            return f"a {noun} without `{key}`"
        if isinstance(value, bool) or not isinstance(value, kind) or value in ("", []):
            return f"{noun} `{key}`={_shown(value)} is not {_KIND_NAMES.get(kind, 'a number')}"
        if isinstance(value, (int, float)) and not (math.isfinite(value) and value >= 0):
            return f"{noun} `{key}`={_shown(value)} is not a finite non-negative number"
    return None


def _source_problem(source) -> str | None:
    """Why one entry of a recording's `sources` is no lhotse AudioSource (None when it is one)."""
    if not isinstance(source, dict):
        return f"a source that is not a JSON object but {type(source).__name__}"
    if source.get("type") not in SOURCE_TYPES:
        return f"source `type`={_shown(source.get('type'))} is none of {', '.join(SOURCE_TYPES)}"
    if not isinstance(source.get("source"), str) or not isinstance(source.get("channels"), list):
        return "a source without a `source` string and a `channels` list"
    if source["type"] == "shar":
        return ("a cut of a Lhotse Shar, whose audio is in the recording tar beside its manifest: encode the Shar "
                "directory with `mmtok encode --modality audio --shar DIR`")
    return None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _source_refusal(recording: dict, allow_command_sources: bool) -> tuple[str, str] | None:
    """(reason, detail) when a source of `recording` must not be read: a command or URL (unless allowed), a
    `file` source that is no regular file; None when every source may be read."""
    for source in recording["sources"]:
        kind, where = source["type"], source["source"]
        if kind in UNSAFE_SOURCE_TYPES and not allow_command_sources:
            verb = "runs a shell command" if kind == "command" else "fetches a URL"
            return "unsafe_source", (f"a `{kind}` source {verb} ({_shown(where)}); not read unless "
                                     "--allow-command-sources")
        if kind == "file":
            try:
                what = not_a_regular_file(where)
            except (OSError, ValueError):
                continue  # not there (or no path): lhotse's decode_error says so when it is read
            if what is not None:
                return "not_a_file", f"the `file` source {_shown(where)} is {what}; mmtok opens only regular files"
    return None


def _supervision_clip(recording_id: str, sup: dict, number: int) -> ClipSpec:
    custom = sup.get("custom") or {}
    channel = sup.get("channel")
    return ClipSpec(
        id=sup["id"], source_id=recording_id, clip=number, origin=f"supervision {sup['id']}",
        text=_text_or_none(sup.get("text")), language=_text_or_none(sup.get("language")),
        target_language=_text_or_none(custom.get("target_language")),
        start=float(sup["start"]), end=float(sup["start"]) + float(sup["duration"]),
        channel=channel if isinstance(channel, int) else None,
    )


# --- (d) Parquet with an audio-bytes column ------------------------------------------------------

@dataclass
class ParquetUnit(Unit):
    path: str = ""
    row_group: int = 0
    first_row: int = 0
    audio_column: str = "audio"
    clips: list[ClipSpec | SkipRecord] = field(default_factory=list)  # one per row; a skip record: bad metadata
    file_format: str = "parquet"  # or "arrow" (`mmtok.formats.tables.sniff_format`)

    def payloads(self):
        from mmtok.formats.tables import read_group

        try:
            table = read_group(self.path, self.file_format, self.row_group, [self.audio_column])
            if table.num_rows != len(self.clips):  # the file changed since its rows were listed
                raise ValueError(f"row group {self.row_group} holds {table.num_rows} rows, {len(self.clips)} when "
                                 "listed: the file changed during the run")
        except Exception as err:  # pyarrow raises several types for damaged files
            for clip in self.clips:
                unreadable = skip_record(clip.id, clip.origin, "unreadable_row_group", str(err))
                yield clip if isinstance(clip, SkipRecord) else unreadable
            return
        for clip, value in zip(self.clips, table.column(0).to_pylist(), strict=True):
            if isinstance(clip, SkipRecord):
                yield clip
                continue
            data = value.get("bytes") if isinstance(value, dict) else value  # HF `Audio` struct or raw bytes
            path = value.get("path") if isinstance(value, dict) else None
            if not data and isinstance(path, str) and path:  # {bytes: null, path}: HF to_parquet() of local files
                yield _cell_file(path, Path(self.path).parent, clip)
                continue
            if not data:
                yield skip_record(clip.id, clip.origin, "no_audio_bytes", "the cell holds neither bytes nor a path")
                continue
            yield (lambda d=data, o=clip.origin: decode_audio(d, o)), [clip]


def _cell_file(path: str, directory: Path, clip: ClipSpec):
    """The payload of a cell that names a file instead of holding its bytes (what Hugging Face's
    Dataset.to_parquet() writes for audio loaded from local files): the file, when its real path lies in the
    Parquet file's directory (the root rule of every input), read as a regular file; else its skip record."""
    candidate = Path(path) if os.path.isabs(path) else directory / path
    real = outside(candidate, directory)
    if real is not None:
        return skip_record(clip.id, clip.origin, OUTSIDE_ROOT, f"the cell's path {shown_path(path)} resolves to "
                           f"{shown_path(real)}, outside {shown_path(directory)}, the Parquet file's directory")

    def load():
        try:
            data = read_regular_file(candidate)
        except OSError as err:
            raise AudioReason("missing_file", f"{clip.origin}: the cell's path {shown_path(path)}: "
                              f"{err.strerror or err}") from None
        return decode_audio(data, clip.origin)

    return load, [clip]


def parquet_units(path: Path, audio_column: str, text_column: str, stem: str | None = None
                  ) -> tuple[list[Unit], list[SkipRecord]]:
    """One unit per row group (an Arrow file's record batch: Hugging Face `save_to_disk`); metadata columns (by
    their standard names) are read here to number clips."""
    from mmtok.formats.tables import group_sizes, read_columns, read_schema, sniff_format

    what = not_a_regular_file(path) if path.exists() else None
    if what is not None:  # a FIFO would block the open
        return [], [skip_record(path.name, str(path), "not_a_file", f"{shown_path(path)} is {what}")]
    try:
        file_format = sniff_format(str(path))
        names = set(read_schema(str(path), file_format).names)
        sizes = group_sizes(str(path), file_format)
    except Exception as err:  # pyarrow raises several types for damaged files
        return [], [skip_record(path.name, str(path), "unreadable_parquet", str(err))]
    if audio_column not in names:
        raise MmtokError(f"{path}: no audio column {audio_column!r} (columns: {sorted(names)}); pass --audio-column")
    wanted = {key: (text_column if key == "text" else key) for key in META_KEYS}
    columns = [c for c in wanted.values() if c in names]
    meta = read_columns(str(path), file_format, columns).to_pylist() if columns else [{} for _ in range(sum(sizes))]
    stem = stem or path.name.removesuffix(".parquet").removesuffix(".arrow")
    records, problems = [], []
    for row_index, row in enumerate(meta):
        try:
            record, problem = clean_metadata({key: row.get(col) for key, col in wanted.items()}), None
        except ValueError as err:
            record, problem = {}, str(err)
        record["id"] = record.get("id") or f"{stem}/{row_index:08d}"
        record["recording_id"] = record.get("recording_id") or record["id"]
        records.append(record)
        problems.append(problem)
    numbers = number_clips(records)
    units, first = [], 0
    for group, count in enumerate(sizes):
        clips = [_spec(records[i], numbers[i], f"{path}:row {i}", cut_segment=False) if problems[i] is None
                 else skip_record(str(records[i]["id"]), f"{path}:row {i}", "bad_metadata", problems[i])
                 for i in range(first, first + count)]
        units.append(ParquetUnit(origin=f"{path}:row group {group}", path=str(path), row_group=group,
                                 first_row=first, audio_column=audio_column, clips=clips, file_format=file_format))
        first += count
    return units, []


def table_units(path: Path, audio_column: str, text_column: str) -> tuple[list[Unit], list[SkipRecord]]:
    """`parquet_units` of a table file, or of each Arrow file of a `save_to_disk` directory in its order."""
    from mmtok.formats.tables import saved_dataset_files

    files = saved_dataset_files(path) if path.is_dir() else None
    units: list[Unit] = []
    dropped: list[SkipRecord] = []
    for file in files or [path]:
        # splits share file names: an id keeps the folders, from the one given (`train/data-00000-of-00001`)
        stem = f"{path.name}/{file.relative_to(path).as_posix().removesuffix('.arrow')}" if files else None
        real = outside(file, path) if files else None
        if real is not None:
            dropped.append(skip_record(file.name, str(file), OUTSIDE_ROOT, f"leads to {shown_path(real)}, outside "
                                       f"{shown_path(path)}"))
            continue
        found = parquet_units(file, audio_column, text_column, stem)
        units += found[0]
        dropped += found[1]
    return units, dropped


# --- (e) SFT conversations --------------------------------------------------------------------------

@dataclass
class ConversationUnit(Unit):
    clips: list[tuple[_LocatedLoader, ClipSpec]] = field(default_factory=list)

    def payloads(self):
        for loader, spec in self.clips:
            yield loader, [spec]


@dataclass
class _LocatedLoader:
    located: Located  # plain data, so the loader pickles to a worker

    def __call__(self) -> tuple[np.ndarray, int, str | None]:
        try:
            data = self.located.read()
        except OSError as err:  # located at collection, gone or cut short since
            raise AudioReason("missing_media", f"cannot read the audio ({err})") from None
        return decode_audio(data, self.located.where)


def conversation_units(inputs: list[Path], media_roots: Sequence[Path] = ()) -> tuple[list[Unit], list[SkipRecord]]:
    """The audio clips of every conversation of `inputs` (read together: ids are unique across them), in
    input, conversation and slot order, as units of at most CONVERSATION_UNIT_CLIPS clips of one input;
    and what could not be located or listed, as skip records. Audio files resolve only inside each
    input's directory or `media_roots` (`mmtok.formats.conversations.locate`)."""
    units: list[ConversationUnit] = []
    dropped: list[SkipRecord] = []
    unit_input = None
    for conversation in read_conversations(inputs, media_roots):
        for item in _conversation_clips(conversation):
            if isinstance(item, SkipRecord):
                dropped.append(item)
                continue
            if conversation.input != unit_input or len(units[-1].clips) == CONVERSATION_UNIT_CLIPS:
                units.append(ConversationUnit(origin=conversation.origin))
                unit_input = conversation.input
            units[-1].clips.append(item)
    return units, dropped


def _conversation_clips(conversation: Conversation) -> Iterator[tuple[_LocatedLoader, ClipSpec] | SkipRecord]:
    """(loader, whole-payload clip) of each audio slot in media order; a slot that names a cache clip
    (`cut`) yields nothing, one that cannot be located the skip record of its clip id; a conversation whose
    media cannot be listed is one skip record of its conversation id."""
    try:
        media = conversation.media()
    except ConversationError as err:
        yield skip_record(conversation.id, conversation.origin, err.reason, err.detail)
        return
    for ref in media:
        if ref.slot.kind != "audio":
            continue
        clip_id = audio_clip_id(conversation.id, ref.slot.index)
        try:
            located = locate(conversation, media, ref.slot)
        except Skip as skip:
            yield skip_record(clip_id, conversation.origin, skip.reason, skip.detail)
            continue
        if located.kind == "cut":
            continue  # encoded already, by the pretraining conversion
        yield _LocatedLoader(located), ClipSpec(id=clip_id, source_id=conversation.id, clip=ref.slot.index,
                                                origin=located.where)


# --- all inputs ----------------------------------------------------------------------------------

def detect_kind(path: Path) -> str:
    """dir / tar / parquet / lhotse from what the input is (an Arrow file, or a Hugging Face `save_to_disk`
    directory of them, is a table like Parquet)."""
    from mmtok.formats.tables import saved_dataset_files

    if path.is_dir() and saved_dataset_files(path) is not None:
        return "parquet"
    if path.is_dir():
        if any(path.glob(CUTS_GLOB)):  # converting a Shar again would give 0 clips: its audio is in tars
            raise MmtokError(f"{path}: a Lhotse Shar directory ({CUTS_GLOB} + recording tars), which is what `audio "
                             f"convert` writes: encode it directly with `mmtok encode --modality audio --shar {path}`")
        return "dir"
    name = path.name.lower()
    if name.endswith(".tar"):
        return "tar"
    if name.endswith((".parquet", ".arrow")):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "lhotse"
    raise MmtokError(f"{path}: cannot tell the source kind (a directory, .tar, .parquet, or Lhotse .jsonl[.gz]); "
                     "pass --kind")


# Kinds whose inputs are read together, at the first one's position: a supervision's recording may be in
# any manifest; conversation ids are unique across the inputs.
READ_TOGETHER = ("lhotse", "conversations")


class Collected(NamedTuple):
    """What the inputs hold before decoding: work units, records skipped already, ignored files by extension."""

    units: list[Unit]
    skipped: list[SkipRecord]
    ignored: Counter


def collect_units(inputs: list[Path], *, kind: str = "auto", transcripts: Path | None = None,
                  audio_column: str = "audio", text_column: str = "text", exclude: Path | None = None,
                  allow_command_sources: bool = False, media_roots: Sequence[Path] = ()) -> Collected:
    """Every work unit of every input, in input order (Lhotse manifests are read together, as are
    conversation inputs, at the first one's position); nothing under `exclude` (the output directory)
    is an input. Lhotse `command`/`url` sources are read only with `allow_command_sources`; conversation
    audio files only inside each input's directory or `media_roots`. An input that is an earlier one under
    another path is one `duplicate_input` record."""
    for path in inputs:
        if not path.exists():
            raise MmtokError(f"input not found: {path}")
    units: list[Unit] = []
    dropped: list[SkipRecord] = []
    ignored: Counter = Counter()
    earlier = same_file_as(inputs)  # one file (or directory) under two paths is read once
    for path, first in zip(inputs, earlier, strict=True):
        if first is not None:
            dropped.append(skip_record(path.name, str(path), DUPLICATE_INPUT, f"the same file as {inputs[first]} "
                                       "(one device and inode: a link or a mount); read once"))
    inputs = [path for path, first in zip(inputs, earlier, strict=True) if first is None]
    kinds = [detect_kind(p) if kind == "auto" else kind for p in inputs]
    if transcripts is not None and "dir" not in kinds:
        raise MmtokError("--transcripts applies to a directory input; none was given")
    for position, (path, this_kind) in enumerate(zip(inputs, kinds, strict=True)):
        if this_kind == "dir":
            *found, files_ignored = directory_units(path, transcripts, exclude)
            ignored.update(files_ignored)
        elif this_kind == "tar":
            found = ([TarUnit(origin=str(path), path=str(path))], [])
        elif this_kind == "parquet":
            found = table_units(path, audio_column, text_column)
        elif this_kind in READ_TOGETHER:
            if position != kinds.index(this_kind):
                continue  # read with the first input of its kind
            together = [p for p, k in zip(inputs, kinds, strict=True) if k == this_kind]
            found = (lhotse_units(together, allow_command_sources) if this_kind == "lhotse"
                     else conversation_units(together, media_roots))
        else:
            raise MmtokError(f"unknown source kind {this_kind!r}; known: {', '.join(KINDS)}")
        units.extend(found[0])
        dropped.extend(found[1])
    return Collected(units, dropped, ignored)


def pick_channel(samples: np.ndarray, channel: int | None) -> np.ndarray:
    """[T, C] -> one channel when asked for (Lhotse supervision channel), else downmix to mono."""
    if channel is not None and samples.ndim == 2 and 0 <= channel < samples.shape[1]:
        return np.ascontiguousarray(samples[:, channel])
    return to_mono(samples)
