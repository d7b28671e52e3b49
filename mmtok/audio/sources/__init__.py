"""The five kinds of audio source `mmtok audio convert` reads, as lists of picklable work units.

A *work unit* is one decode task handed to a worker process; `Unit.payloads()` yields, in a fixed
order, each audio payload of the unit with the clips cut from it (or a skip record for what
could not be read). One module per kind (`units` holds what they share: the clip spec, metadata
checks, clip numbering, decoding); this one detects an input's kind and collects every unit in order:

  dir            directory.py       a directory of audio files (+ transcript table)  one unit per audio file
  tar            tar.py             WebDataset tars: audio members + txt/json sidecars  one unit per tar
  lhotse         lhotse.py          Lhotse recording (+ supervision) or cut manifests  one unit per recording
  parquet        parquet.py         Parquet/Arrow tables with an audio-bytes column    one unit per row group
  conversations  conversations.py   SFT conversations (`mmtok.formats.conversations`:  up to CONVERSATION_UNIT_CLIPS
                                    KEY.json samples of tars, .jsonl lines, .parquet    clips of one input
                                    rows), never auto-detected

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

from collections import Counter
from pathlib import Path
from typing import NamedTuple, Sequence

from mmtok.audio.sources.conversations import conversation_units
from mmtok.audio.sources.directory import directory_units
from mmtok.audio.sources.lhotse import lhotse_units
from mmtok.audio.sources.parquet import table_units
from mmtok.audio.sources.tar import TarUnit
from mmtok.audio.sources.units import Unit, skip_record
from mmtok.errors import MmtokError
from mmtok.formats.containers import ARROW, JSONL, PARQUET, TAR, container_named
from mmtok.formats.shar import CUTS_GLOB
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import DUPLICATE_INPUT, same_file_as

KINDS = ("dir", "tar", "lhotse", "parquet", "conversations")


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
    kind = {TAR: "tar", PARQUET: "parquet", ARROW: "parquet", JSONL: "lhotse"}.get(container_named(path))
    if kind is not None:
        return kind
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
