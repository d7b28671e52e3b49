"""The `dir` kind: a directory of audio files, one unit per file, and an optional transcript table (TSV or
JSONL) whose rows name clips of those files."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Callable

from mmtok.audio.sources.units import (
    ClipSpec,
    Unit,
    clean_metadata,
    clip_spec,
    decode_audio,
    json_object,
    number_clips,
    skip_record,
)
from mmtok.errors import MmtokError
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import NON_UTF8_NAME
from mmtok.formats.webdataset import AUDIO_SUFFIXES
from mmtok.fsutil import OUTSIDE_ROOT, outside, shown_path

NO_EXTENSION = "(no extension)"


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
    parse = json_object if path.suffix.lower() in (".jsonl", ".json") else _tsv_parser(path, lines)
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
        clips = [clip_spec(r, n, f"{rel}" + (f" ({table.name}:{r['_line']})" if "_line" in r else ""), cut_segment=True)
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
