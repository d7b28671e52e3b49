"""The `lhotse` kind: Lhotse recording and supervision manifests, or CutSet manifests of MonoCuts; one unit
per recording. Every row is checked before lhotse sees it, and a source that would run a command, fetch a URL
or open a non-regular file is refused."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from mmtok.audio.sources.units import ClipSpec, Unit, float_or_none, skip_record, text_or_none
from mmtok.errors import MmtokError
from mmtok.formats.containers import JSONL
from mmtok.formats.readers import reader
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import not_a_regular_file
from mmtok.media.audio import AudioReason


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
                          key=lambda s: (float_or_none(s.get("start")) or 0.0, str(s.get("id"))))
            texts = [t for t in (text_or_none(s.get("text")) for s in sups) if t]
            first = sups[0] if sups else {}
            channel = cut.get("channel")
            clips.append(ClipSpec(
                id=cut["id"], source_id=rec["id"], clip=number, origin=f"cut {cut['id']}",
                text=" ".join(texts) or None, language=text_or_none(first.get("language")),
                target_language=text_or_none((first.get("custom") or {}).get("target_language")),
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
    try:
        for record in reader(JSONL).records(path):
            line = record.seek[1] + 1  # the lines before it, and this one
            yield line, ValueError(f"not JSON ({record.error.detail})") if record.error else record.value
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
        text=text_or_none(sup.get("text")), language=text_or_none(sup.get("language")),
        target_language=text_or_none(custom.get("target_language")),
        start=float(sup["start"]), end=float(sup["start"]) + float(sup["duration"]),
        channel=channel if isinstance(channel, int) else None,
    )
