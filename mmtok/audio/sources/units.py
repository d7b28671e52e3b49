"""What every audio source kind yields: work units of clips, each clip's metadata checked and numbered.

A *work unit* is one decode task handed to a worker process; `Unit.payloads()` yields, in a fixed
order, each audio payload of the unit with the clips cut from it (or a skip record for what
could not be read). Each kind (`mmtok.audio.sources`) subclasses `Unit` and builds its clips with
`clip_spec` from metadata that `clean_metadata` checked and `number_clips` numbered.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from mmtok.formats.containers import json_value
from mmtok.formats.shar import source_digest
from mmtok.formats.skips import SkipRecord
from mmtok.media.audio import AudioReason, decode_bytes, to_mono

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
    try:
        data = data if isinstance(data, bytes) else Path(data).read_bytes()
        samples, rate = decode_bytes(data)
    except AudioReason as err:
        raise AudioReason(err.reason, f"{origin}: {err.detail}") from None
    except (OSError, ValueError) as err:  # the file is unreadable
        raise AudioReason("decode_error", f"{origin}: {err}") from None
    return samples, rate, source_digest(data)


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
            start = float_or_none(record.get("start"))
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


def float_or_none(value) -> float | None:
    if value is None or value == "":
        return None
    return float(value)


def text_or_none(value) -> str | None:
    return None if value is None or value == "" else str(value)


def clip_spec(record: dict, clip: int, origin: str, *, cut_segment: bool) -> ClipSpec:
    """The clip a cleaned, numbered record names; only a cut segment (a table row) keeps its start and end."""
    return ClipSpec(
        id=str(record["id"]), source_id=str(record["recording_id"]), clip=clip, origin=origin,
        text=text_or_none(record.get("text")), language=text_or_none(record.get("language")),
        target_language=text_or_none(record.get("target_language")),
        start=float_or_none(record.get("start")) if cut_segment else None,
        end=float_or_none(record.get("end")) if cut_segment else None,
        channel=record.get("channel"),
    )


def json_object(text: str) -> dict:
    """A JSON object from one line of text (a table row, a json sidecar); ValueError says why it is not one."""
    row, error = json_value(text, "json")  # deep nesting and lone surrogates too, as every reader
    if error is not None:
        raise ValueError(error.detail)
    if not isinstance(row, dict):
        raise ValueError(f"not a JSON object but {type(row).__name__}")
    return row


def pick_channel(samples: np.ndarray, channel: int | None) -> np.ndarray:
    """[T, C] -> one channel when asked for (Lhotse supervision channel), else downmix to mono."""
    if channel is not None and samples.ndim == 2 and 0 <= channel < samples.shape[1]:
        return np.ascontiguousarray(samples[:, channel])
    return to_mono(samples)
