"""The four kinds of audio source `mmtok audio convert` reads, as lists of picklable work units.

A *work unit* is one decode task handed to a worker process; `Unit.payloads()` yields, in a fixed
order, each audio payload of the unit with the clips cut from it (or a `Dropped` record for what
could not be read). Kinds and their units:

  dir      a directory of audio files (+ optional transcript table)     one unit per audio file
  tar      WebDataset tars: audio members + txt/json sidecars            one unit per tar
  lhotse   Lhotse recording (+ supervision) manifests                    one unit per recording
  parquet  Parquet files with an audio-bytes column                      one unit per row group

Clip metadata uses one vocabulary everywhere: `text`, `recording_id` (the *source id*: clips of one
recording form runs for interleaving), `clip` (the clip number in its recording), `start`/`end`
(seconds), `language`, `target_language`, `id` (the cut id). In a transcript table and in Lhotse
supervisions `start`/`end` cut a segment out of the audio; in tars and Parquet each audio payload
*is* one clip and `start` only orders clips of a recording that carry no explicit `clip` number.
Clip numbers are assigned before any clip is validated, so a dropped clip leaves a gap (which the
interleave builder treats as a break in the run).
"""

from __future__ import annotations

import csv
import io
import json
import tarfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from mmtok.audio.preprocess import AudioReason, to_mono
from mmtok.errors import MmtokError

AUDIO_EXTENSIONS = ("wav", "flac", "ogg", "opus", "mp3")
KINDS = ("dir", "tar", "lhotse", "parquet")
META_KEYS = ("text", "recording_id", "clip", "start", "end", "language", "target_language", "id")


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


@dataclass
class Dropped:
    """Something that did not become a clip, with a counted reason."""

    id: str
    origin: str
    reason: str
    detail: str = ""


# A payload loader returns (samples [T] or [T, C] float32, sampling rate) or raises AudioReason.
Loader = Callable[[], tuple[np.ndarray, int]]


@dataclass
class Unit:
    """One work unit (picklable). Subclasses yield (loader, clips) pairs or Dropped records."""

    origin: str

    def payloads(self) -> Iterator[tuple[Loader, list[ClipSpec]] | Dropped]:
        raise NotImplementedError


def decode_audio(data: bytes | str, origin: str) -> tuple[np.ndarray, int]:
    """Decode a file path or encoded bytes with soundfile (WAV, FLAC, OGG/Opus, MP3) -> ([T] or [T, C], rate)."""
    import soundfile

    try:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        samples, rate = soundfile.read(source, dtype="float32", always_2d=False)
    except Exception as err:  # libsndfile reports every malformed input as a generic error
        raise AudioReason("decode_error", f"{origin}: {err}") from None
    return samples, int(rate)


# --- clip numbering -------------------------------------------------------------------------------

def number_clips(records: list[dict]) -> list[int]:
    """Clip number of each record: its explicit `clip`, else its rank by (start, position) in its recording.

    `records` are metadata dicts with `recording_id` set; the result follows their order.
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


def read_transcript_table(path: Path) -> tuple[list[dict], list[Dropped]]:
    """Rows of a TSV (header line) or JSONL transcript table; rows without `path` are Dropped."""
    rows, dropped = [], []
    with open(path, encoding="utf-8", newline="") as handle:
        if path.suffix.lower() in (".jsonl", ".json"):
            raw = [(n, json.loads(line)) for n, line in enumerate(handle, 1) if line.strip()]
        else:
            reader = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
            raw = [(n, row) for n, row in enumerate(reader, 2)]
    for line, row in raw:
        if not isinstance(row, dict) or not row.get("path"):
            dropped.append(Dropped(f"{path.name}:{line}", f"{path}:{line}", "bad_table_row", "no `path` value"))
            continue
        rows.append({**row, "_line": line})
    return rows, dropped


def directory_units(root: Path, table: Path | None) -> tuple[list[Unit], list[Dropped]]:
    """One unit per audio file under `root` (sorted by relative path); table rows define its clips.

    A file without table rows is one clip without text. A table row may name a segment
    (`start`/`end`); its default recording id is the file's relative path, its default cut id the
    relative path (plus `/NNNNN`, the row's index among the file's rows, when the file has several).
    """
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*")
                   if p.is_file() and p.suffix.lower().lstrip(".") in AUDIO_EXTENSIONS)
    rows, dropped = read_transcript_table(table) if table else ([], [])
    by_file: dict[str, list[dict]] = {}
    for row in rows:
        rel = _relative_to(Path(row["path"]), root)
        by_file.setdefault(rel, []).append(row)
    records: list[dict] = []
    owners: list[str] = []
    for rel in sorted(set(files) | set(by_file)):
        file_rows = by_file.get(rel) or [{}]
        stem = rel.rsplit(".", 1)[0]
        for index, row in enumerate(file_rows):
            default_id = stem if len(file_rows) == 1 else f"{stem}/{index:05d}"
            records.append({**row, "id": row.get("id") or default_id, "recording_id": row.get("recording_id") or stem})
            owners.append(rel)
    numbers = number_clips(records)
    units: list[Unit] = []
    present = set(files)
    for rel in sorted(set(owners)):
        mine = [(r, n) for r, n, o in zip(records, numbers, owners) if o == rel]
        if rel not in present:
            dropped.extend(Dropped(str(r["id"]), f"{table}:{r['_line']}", "missing_file", rel) for r, _ in mine)
            continue
        clips = [_spec(r, n, f"{rel}" + (f" ({table.name}:{r['_line']})" if "_line" in r else ""), cut_segment=True)
                 for r, n in mine]
        units.append(FileUnit(origin=rel, path=str(root / rel), clips=clips))
    return units, dropped


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
        samples, errors = scan_tar(self.path)
        yield from errors
        records, audio = [], []
        for key, members in samples.items():
            audio_members = [m for m in members if m[0] in AUDIO_EXTENSIONS]
            if not audio_members:
                yield Dropped(f"{tar_id}/{key}", f"{self.path}:{key}", "no_audio_member",
                              ", ".join(m[0] for m in members))
                continue
            for extra in audio_members[1:]:
                yield Dropped(f"{tar_id}/{key}", f"{self.path}:{key}.{extra[0]}", "extra_audio_member")
            meta = _sidecar_metadata(members)
            records.append({**meta, "id": meta.get("id") or f"{tar_id}/{key}",
                            "recording_id": meta.get("recording_id") or f"{tar_id}/{key}"})
            audio.append(audio_members[0])
        numbers = number_clips(records)
        for record, number, (ext, offset, size, _) in zip(records, numbers, audio):
            origin = f"{self.path}:{record['id']}.{ext}"
            loader = _ByteRangeLoader(self.path, offset, size, origin)
            yield loader, [_spec(record, number, origin, cut_segment=False)]


@dataclass
class _ByteRangeLoader:
    path: str
    offset: int
    size: int
    origin: str

    def __call__(self) -> tuple[np.ndarray, int]:
        with open(self.path, "rb") as handle:
            handle.seek(self.offset)
            data = handle.read(self.size)
        if len(data) != self.size:
            raise AudioReason("truncated_member", self.origin)
        return decode_audio(data, self.origin)


def scan_tar(path: str) -> tuple[dict[str, list[tuple]], list[Dropped]]:
    """Group tar members by WebDataset key -> [(ext, data offset, size, sidecar bytes or None)], in tar order.

    Audio data is not read here (only its byte range); txt/json sidecars are. A damaged tar keeps
    what was read before the damage and reports `truncated_tar`.
    """
    samples: dict[str, list[tuple]] = {}
    errors: list[Dropped] = []
    try:
        with tarfile.open(path, "r:") as archive:
            for member in archive:
                if not member.isfile():
                    continue
                directory, _, base = member.name.rpartition("/")
                stem, dot, ext = base.partition(".")
                if not dot:
                    continue
                key = f"{directory}/{stem}" if directory else stem
                ext = ext.lower()
                body = None
                if ext in ("txt", "json"):
                    body = archive.extractfile(member).read()
                samples.setdefault(key, []).append((ext, member.offset_data, member.size, body))
    except (tarfile.TarError, OSError, EOFError) as err:
        errors.append(Dropped(Path(path).name, path, "truncated_tar", str(err)))
    return samples, errors


def _sidecar_metadata(members: list[tuple]) -> dict:
    meta: dict = {}
    for ext, _, _, body in members:
        if ext == "json" and body is not None:
            try:
                loaded = json.loads(body)
            except ValueError:
                continue
            if isinstance(loaded, dict):
                meta.update({k: loaded[k] for k in META_KEYS if k in loaded})
    for ext, _, _, body in members:
        if ext == "txt" and body is not None and not meta.get("text"):
            meta["text"] = body.decode("utf-8", errors="replace").strip()
    return meta


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

    def __call__(self) -> tuple[np.ndarray, int]:
        from lhotse import Recording

        try:
            recording = Recording.from_dict(self.recording)
            samples = recording.load_audio()  # [C, T] at the recording's own rate
        except Exception as err:  # lhotse wraps every backend failure differently
            raise AudioReason("decode_error", f"{self.origin}: {err}") from None
        return np.ascontiguousarray(samples.T), int(recording.sampling_rate)


def lhotse_units(manifests: list[Path]) -> tuple[list[Unit], list[Dropped]]:
    """One unit per recording (manifest order); its supervisions (sorted by start) are its clips.

    A recording without supervisions is one clip without text; a supervision whose recording is
    in none of the manifests is Dropped (`missing_recording`).
    """
    from lhotse.serialization import load_jsonl

    recordings: list[dict] = []
    supervisions: list[dict] = []
    for path in manifests:
        for item in load_jsonl(path):
            (recordings if "sources" in item else supervisions).append(item)
    if not recordings:
        raise MmtokError(f"no Lhotse recordings found in {', '.join(map(str, manifests))}: pass the recordings "
                         "manifest (JSONL with `sources`) together with the supervisions manifest")
    by_recording: dict[str, list[dict]] = {}
    for sup in supervisions:
        by_recording.setdefault(sup["recording_id"], []).append(sup)
    known = {r["id"] for r in recordings}
    dropped = [Dropped(s["id"], f"supervision {s['id']}", "missing_recording", s["recording_id"])
               for s in supervisions if s["recording_id"] not in known]
    units: list[Unit] = []
    for rec in recordings:
        sups = sorted(by_recording.get(rec["id"], []), key=lambda s: (s["start"], s["id"]))
        clips = [_supervision_clip(rec["id"], s, n) for n, s in enumerate(sups)]
        if not sups:
            clips = [ClipSpec(id=rec["id"], source_id=rec["id"], clip=0, origin=f"recording {rec['id']}")]
        units.append(RecordingUnit(origin=f"recording {rec['id']}", recording=rec, clips=clips))
    return units, dropped


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
    clips: list[ClipSpec] = field(default_factory=list)

    def payloads(self):
        import pyarrow.parquet as pq

        try:
            table = pq.ParquetFile(self.path).read_row_group(self.row_group, columns=[self.audio_column])
        except Exception as err:  # pyarrow raises several types for damaged files
            for clip in self.clips:
                yield Dropped(clip.id, clip.origin, "unreadable_row_group", str(err))
            return
        for clip, value in zip(self.clips, table.column(0).to_pylist()):
            data = value.get("bytes") if isinstance(value, dict) else value  # HF `Audio` struct or raw bytes
            if not data:
                yield Dropped(clip.id, clip.origin, "no_audio_bytes")
                continue
            yield (lambda d=data, o=clip.origin: decode_audio(d, o)), [clip]


def parquet_units(path: Path, audio_column: str, text_column: str) -> tuple[list[Unit], list[Dropped]]:
    """One unit per row group; metadata columns (by their standard names) are read here to number clips."""
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as err:
        return [], [Dropped(path.name, str(path), "unreadable_parquet", str(err))]
    names = set(handle.schema_arrow.names)
    if audio_column not in names:
        raise MmtokError(f"{path}: no audio column {audio_column!r} (columns: {sorted(names)}); pass --audio-column")
    wanted = {key: (text_column if key == "text" else key) for key in META_KEYS}
    columns = [c for c in wanted.values() if c in names]
    meta = handle.read(columns=columns).to_pylist() if columns else [{} for _ in range(handle.metadata.num_rows)]
    stem = path.name.removesuffix(".parquet")
    records = []
    for row_index, row in enumerate(meta):
        record = {key: row.get(col) for key, col in wanted.items()}
        record["id"] = record["id"] or f"{stem}/{row_index:08d}"
        record["recording_id"] = record["recording_id"] or record["id"]
        records.append(record)
    numbers = number_clips(records)
    units, first = [], 0
    for group in range(handle.num_row_groups):
        count = handle.metadata.row_group(group).num_rows
        clips = [_spec(records[i], numbers[i], f"{path}:row {i}", cut_segment=False) for i in range(first, first + count)]
        units.append(ParquetUnit(origin=f"{path}:row group {group}", path=str(path), row_group=group,
                                 first_row=first, audio_column=audio_column, clips=clips))
        first += count
    return units, []


# --- all inputs ----------------------------------------------------------------------------------

def detect_kind(path: Path) -> str:
    """dir / tar / parquet / lhotse from what the input is."""
    if path.is_dir():
        return "dir"
    name = path.name.lower()
    if name.endswith(".tar"):
        return "tar"
    if name.endswith(".parquet"):
        return "parquet"
    if name.endswith((".jsonl", ".jsonl.gz")):
        return "lhotse"
    raise MmtokError(f"{path}: cannot tell the source kind (a directory, .tar, .parquet, or Lhotse .jsonl[.gz]); "
                     "pass --kind")


def collect_units(inputs: list[Path], *, kind: str = "auto", transcripts: Path | None = None,
                  audio_column: str = "audio", text_column: str = "text") -> tuple[list[Unit], list[Dropped]]:
    """Every work unit of every input, in input order (Lhotse manifests are read together)."""
    for path in inputs:
        if not path.exists():
            raise MmtokError(f"input not found: {path}")
    units: list[Unit] = []
    dropped: list[Dropped] = []
    kinds = [detect_kind(p) if kind == "auto" else kind for p in inputs]
    if transcripts is not None and "dir" not in kinds:
        raise MmtokError("--transcripts applies to a directory input; none was given")
    lhotse_inputs = [p for p, k in zip(inputs, kinds) if k == "lhotse"]
    for path, this_kind in zip(inputs, kinds):
        if this_kind == "dir":
            found = directory_units(path, transcripts)
        elif this_kind == "tar":
            found = ([TarUnit(origin=str(path), path=str(path))], [])
        elif this_kind == "parquet":
            found = parquet_units(path, audio_column, text_column)
        elif this_kind == "lhotse":
            if path != lhotse_inputs[0]:
                continue  # all manifests are read together at the first one's position
            found = lhotse_units(lhotse_inputs)
        else:
            raise MmtokError(f"unknown source kind {this_kind!r}; known: {', '.join(KINDS)}")
        units.extend(found[0])
        dropped.extend(found[1])
    return units, dropped


def pick_channel(samples: np.ndarray, channel: int | None) -> np.ndarray:
    """[T, C] -> one channel when asked for (Lhotse supervision channel), else downmix to mono."""
    if channel is not None and samples.ndim == 2 and 0 <= channel < samples.shape[1]:
        return np.ascontiguousarray(samples[:, channel])
    return to_mono(samples)
