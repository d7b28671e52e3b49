"""The `parquet` kind: Parquet or Arrow tables (and Hugging Face `save_to_disk` directories of them) with an
audio-bytes column; one unit per row group, each row one clip."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path

from mmtok.audio.sources.units import (
    META_KEYS,
    ClipSpec,
    Unit,
    clean_metadata,
    clip_spec,
    decode_audio,
    number_clips,
    skip_record,
)
from mmtok.errors import MmtokError
from mmtok.formats.containers import container_of
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import OUTSIDE_ROOT, not_a_regular_file, outside, read_regular_file, shown_path
from mmtok.media.audio import AudioReason


@dataclass
class ParquetUnit(Unit):
    path: str = ""
    row_group: int = 0
    first_row: int = 0
    audio_column: str = "audio"
    clips: list[ClipSpec | SkipRecord] = field(default_factory=list)  # one per row; a skip record: bad metadata
    file_format: str = "parquet"  # or "arrow" (`mmtok.formats.containers.container_of`)

    def payloads(self):
        try:
            table = _opened(self.path, self.file_format, _stamp(self.path)).read_group(self.row_group,
                                                                                       [self.audio_column])
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


@functools.lru_cache(maxsize=2)
def _opened(path: str, file_format: str, stamp: tuple[int, int, int, int]):
    """The table file of a unit, opened once per process for all the units of it that the process reads: a footer
    of N row groups parsed once, not N times (quadratic: 49 s of footer parsing at 5,000 row groups). `stamp` makes
    a file changed since it was opened another entry (`payloads` then finds its rows changed)."""
    from mmtok.formats.tables import TableFile

    return TableFile(path, file_format)


def close_tables() -> None:
    """Close the table files this process keeps open for its units (`_opened`): an in-process conversion's,
    when it ends (a worker process's close with it)."""
    _opened.cache_clear()


def _stamp(path: str) -> tuple[int, int, int, int]:
    status = os.stat(path)  # ctime too: a rewrite in place whose mtime was set back (rsync -t --inplace) is seen
    return status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns


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
    from mmtok.formats.tables import TableFile

    what = not_a_regular_file(path) if path.exists() else None
    if what is not None:  # a FIFO would block the open
        return [], [skip_record(path.name, str(path), "not_a_file", f"{shown_path(path)} is {what}")]
    try:
        file_format = container_of(str(path))
        table = TableFile(str(path), file_format)
        names, sizes = set(table.schema.names), table.group_sizes()
    except Exception as err:  # pyarrow raises several types for damaged files
        return [], [skip_record(path.name, str(path), "unreadable_parquet", str(err))]
    if audio_column not in names:
        raise MmtokError(f"{path}: no audio column {audio_column!r} (columns: {sorted(names)}); pass --audio-column")
    wanted = {key: (text_column if key == "text" else key) for key in META_KEYS}
    columns = [c for c in wanted.values() if c in names]
    meta = table.read_columns(columns).to_pylist() if columns else [{} for _ in range(sum(sizes))]
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
        clips = [clip_spec(records[i], numbers[i], f"{path}:row {i}", cut_segment=False) if problems[i] is None
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
