"""The `tar` kind: WebDataset tars, one unit per tar; a sample's audio member is one clip, its txt/json
sidecars its metadata."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.audio.sources.units import (
    META_KEYS,
    Unit,
    clean_metadata,
    clip_spec,
    decode_audio,
    json_object,
    number_clips,
    skip_record,
)
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import NON_UTF8_NAME, MemberTruncated, read_tar_member
from mmtok.formats.webdataset import (
    AUDIO_SUFFIXES,
    DUPLICATE_KEY,
    TRUNCATED_MEMBER,
    Sample,
    duplicate_key_detail,
    read_samples,
    sample_key,
)
from mmtok.media.audio import AudioReason


@dataclass
class TarUnit(Unit):
    path: str = ""

    def payloads(self):
        tar_id = Path(self.path).name.removesuffix(".tar")
        samples, errors = audio_tar_members(self.path)
        yield from errors
        records, audio, problems = [], [], []
        for sample in samples:
            key = sample.key
            if sample.repeated:  # which members are whose is unknowable: no clip of this key is made
                ident = f"{tar_id}/{key}" + (f" (repeat {sample.occurrence})" if sample.occurrence > 1 else "")
                yield skip_record(ident, f"{self.path}:{key}", DUPLICATE_KEY, duplicate_key_detail(sample))
                continue
            members, foreign = _members(self.path, sample)
            for name in foreign:  # a member whose name is not UTF-8 beside another key's sample: no member of it
                yield skip_record(f"{tar_id}/{sample_key(name)[0]}", f"{self.path}:{name}", NON_UTF8_NAME,
                                  f"member {name}")
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
            yield loader, [clip_spec(record, number, origin, cut_segment=False)]


@dataclass
class _ByteRangeLoader:
    path: str
    offset: int
    size: int
    origin: str

    def __call__(self) -> tuple[np.ndarray, int, str | None]:
        try:
            data = read_tar_member(self.path, self.offset, self.size)
        except MemberTruncated:  # cut short since the tar was listed
            raise AudioReason("truncated_member", self.origin) from None
        return decode_audio(data, self.origin)


def audio_tar_members(path: str) -> tuple[list[Sample], list[SkipRecord]]:
    """The WebDataset samples of a tar (`mmtok.formats.webdataset.read_samples`) and a skip record
    for each damage the tar reader met (`truncated_tar`, `corrupt_header`, ...), in tar order. A sample the damage
    cut short keeps the members read before it: its audio member may be whole."""
    try:
        samples = read_samples(path)
    except OSError as err:
        return [], [skip_record(Path(path).name, path, "truncated_tar", str(err))]
    errors = [skip_record(Path(path).name, path, sample.damage.reason, sample.damage.describe())
              for sample in samples if sample.damage is not None]
    return [sample for sample in samples if sample.key is not None], errors


def _members(path: str, sample: Sample) -> tuple[list[tuple], list[str]]:
    """([(suffix, data offset, size, sidecar bytes or None, refusal, member name)] of a sample, in tar order; the
    names of the members whose name is not UTF-8 and names another key, which the sample holds refused but which
    are not its audio or sidecars). `refusal` is (reason, detail) for a member the tar reader refuses
    (`mmtok.formats.tar.Member`); `suffix` per `member_suffix`. Audio data is not read here (only its byte
    range); txt/json sidecars are."""
    members, foreign = [], []
    for entry in sample.members:
        key, ext = sample_key(entry.name)
        if key != sample.key:
            foreign.append(entry.name)
            continue
        ext = member_suffix(ext)
        refusal = (entry.reason, f"member {entry.name}") if entry.reason else None
        body = None
        if ext in ("txt", "json") and refusal is None:
            try:
                body = read_tar_member(path, entry.offset, entry.size)
            except OSError as err:  # cut short (or gone) since the tar was listed: this sample's reason
                refusal = (TRUNCATED_MEMBER, f"member {entry.name}: {err}")
        members.append((ext, entry.offset, entry.size, body, refusal, entry.name))
    return members, foreign


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
                loaded = json_object(body.decode("utf-8"))
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
