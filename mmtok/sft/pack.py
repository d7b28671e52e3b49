"""`mmtok pack`: conversations and their media -> WebDataset tars, the layout every SFT stage reads.

Why a copy: the image path (scan -> plan -> encode) reads images as tar members by byte range, so the
images of a JSONL line or a Parquet row -- files by path, table cells, base64 -- have nowhere to be read
from. `pack` writes each conversation of the inputs (`mmtok.formats.conversations`, in input order) as one sample:

  OUT/conversations-NNNNNN.tar   (SAMPLES_PER_TAR samples each) KEY = the conversation's 9-digit ordinal
      KEY.json                   the record, `id` = its conversation id (kept through the later stages),
                                 every medium named by its member (`mmtok.formats.chat.with_media_names`); a clip
                                 referenced as {"cut_id": ...} stays that reference (it is encoded already)
      KEY.<k>.<ext>              the k-th image / audio medium, its bytes as they were (ext from the file
                                 name, else from the bytes' signature)
  OUT/skipped.jsonl              every conversation not packed, a skip record each (`mmtok.formats.skips`):
                                 key = its id, reason `missing_media` (a reference that resolves to nothing
                                 or to bytes of no known format), `outside_root` / `not_a_file` (a file path
                                 outside the roots or no regular file: `conversations.locate`) or the
                                 record's own reasons
  OUT/pack.json                  the inputs and counts (written last: its presence means the pack completed)

Bytes are copied unchanged, so a packed medium decodes to the same pixels and samples as the original and
its tokens equal the pretraining path's. Every tar is written atomically with fixed member metadata: the
output depends only on the inputs.
"""

from __future__ import annotations

import io
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from mmtok.errors import MmtokError, Skip
from mmtok.formats import skips
from mmtok.formats.chat import ConversationError, with_media_names
from mmtok.formats.conversations import (
    SAMPLES_PER_TAR,
    TAR_NAME,
    Conversation,
    ConversationTars,
    Located,
    PackedMember,
    check_inputs,
    check_media_roots,
    close_members,
    input_fingerprint,
    json_member_name,
    locate,
    media_member_name,
    read_conversations,
)
from mmtok.formats.tar import MemberTruncated
from mmtok.formats.webdataset import KIND_SUFFIXES, TRUNCATED_MEMBER
from mmtok.fsutil import WriterLock, atomic_write_json, atomic_writer, read_json_object, refuse_out_overlapping

REPORT = "pack.json"
PACK_FORMAT = "mmtok-pack/1"  # pack.json's `format`
SKIPPED = "skipped.jsonl"
OWNED = ".pack-owned.json"  # the tars a running (or killed) pack wrote, until pack.json names them
MAX_MEDIA_BYTES = 1 << 30  # one medium above this is `media_too_large` (--max-media-bytes)
# Leading bytes of the formats the codecs read (checked in order): an extension for media without a name.
SIGNATURES = {"image": ((b"\xff\xd8\xff", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"),
                        (b"II*\x00", "tif"), (b"MM\x00*", "tif")),
              "audio": ((b"fLaC", "flac"), (b"OggS", "ogg"), (b"ID3", "mp3"), (b"\xff\xfb", "mp3"),
                        (b"\xff\xf3", "mp3"), (b"\xff\xf2", "mp3"))}
RIFF = {"image": (b"WEBP", "webp"), "audio": (b"WAVE", "wav")}  # RIFF containers: the form type at byte 8


def extension(kind: str, data: bytes, name: str | None) -> str:
    """The member extension of a medium: its name's when that is a known one of its kind, else its signature's."""
    if name and (suffix := name.rsplit(".", 1)[-1].lower()) in KIND_SUFFIXES[kind] and "." in name:
        return suffix
    if (ext := _signature(kind, data)) is not None:
        return ext
    other = "audio" if kind == "image" else "image"
    looks = f"; they look like {ext} {other}" if (ext := _signature(other, data)) else ""
    # never the bytes themselves: a skip record must not copy a file's content out of the input
    raise Skip("missing_media", f"{kind} bytes of no format mmtok reads (it reads {', '.join(KIND_SUFFIXES[kind])})"
               + looks)


def _signature(kind: str, data: bytes) -> str | None:
    """The extension of the `kind` format whose signature `data` starts with, else None."""
    if data[:4] == b"RIFF" and data[8:12] == RIFF[kind][0]:
        return RIFF[kind][1]
    return next((ext for signature, ext in SIGNATURES[kind] if data.startswith(signature)), None)


def pack_conversation(conversation: Conversation, key: str,
                      max_media_bytes: int = MAX_MEDIA_BYTES) -> tuple[list[PackedMember], Counter]:
    """(the members of one conversation's sample, json last; media packed by kind); Skip naming why it
    cannot be packed (`media_too_large`: a medium above `max_media_bytes`). The caller closes the members'
    streams (`close_members`); on a Skip they are closed here."""
    try:
        media = conversation.media()
    except ConversationError as err:
        raise Skip(err.reason, err.detail) from None
    members, names, counts = [], {}, Counter()
    try:
        for ref in media:
            located = locate(conversation, media, ref.slot)
            if located.kind == "cut":
                names[ref.slot] = {"cut_id": located.cut_id}
                continue
            slot = f"{ref.slot.kind} {ref.slot.index}"
            member = _media_member(located, slot, max_media_bytes, members)
            ext = _extension(ref.slot.kind, slot, member, located)
            member.name = media_member_name(key, counts[ref.slot.kind], ext)
            counts[ref.slot.kind] += 1
            names[ref.slot] = member.name
        record = with_media_names(conversation.record, names)
        record["id"] = conversation.id
        data = _json_bytes(record)
    except BaseException:
        close_members(members)
        raise
    members.append(PackedMember(json_member_name(key), len(data), io.BytesIO(data)))
    return members, counts


def _media_member(located: Located, slot: str, max_media_bytes: int, members: list[PackedMember]) -> PackedMember:
    """The medium opened as a member (appended to `members`, so it is closed with them), its size bounded."""
    try:
        stream, size = located.open()
    except MemberTruncated as err:  # the tar was cut short since its members were listed
        raise Skip(TRUNCATED_MEMBER, f"{slot}: {err}") from None
    except OSError as err:
        raise Skip("missing_media", f"{slot}: {located.where}: {err}") from None
    members.append(PackedMember("", size, stream))
    if size > max_media_bytes:
        raise Skip("media_too_large", f"{slot}: {located.where}: {size:,} bytes, above --max-media-bytes "
                   f"{max_media_bytes:,}; raise it to pack this medium")
    return members[-1]


def _extension(kind: str, slot: str, member: PackedMember, located: Located) -> str:
    """The member extension of a medium from its name or its first bytes (read, then the stream is put back)."""
    head = member.stream.read(16)
    member.stream.seek(-len(head), io.SEEK_CUR)
    name = located.member or (located.where if located.kind == "file" else None)  # the name it was given
    try:
        return extension(kind, head, name)
    except Skip as skip:
        raise Skip(skip.reason, f"{slot}: {located.where}: {skip.detail}") from None


def _json_bytes(record: dict) -> bytes:
    """KEY.json's bytes; Skip `invalid_json` naming the first field (a Parquet column) with no JSON form."""
    try:
        return json.dumps(record, sort_keys=True).encode("ascii")  # ASCII escapes: a lone surrogate is still JSON
    except (TypeError, ValueError):
        for name, value in sorted(record.items()):
            try:
                json.dumps(value)
            except (TypeError, ValueError) as err:
                raise Skip("invalid_json", f"field {name!r} has no JSON form ({err}); drop or convert that "
                           "column before packing") from None
        raise


@dataclass(frozen=True)
class PackReport:
    """What `mmtok pack` did, as OUT/pack.json holds it (`to_json`): the inputs' fingerprints, the tars written in
    order, the counts (conversations = packed + skipped, media packed by kind) and the media roots, if any."""

    inputs: list[dict]
    tars: list[str]
    counts: dict[str, int]
    media_roots: list[str]

    def to_json(self) -> dict:
        return {"format": PACK_FORMAT, "inputs": self.inputs, "tars": self.tars, "counts": self.counts,
                **({"media_roots": self.media_roots} if self.media_roots else {})}


def pack(inputs: list[Path], out: Path, *, samples_per_tar: int = SAMPLES_PER_TAR,
         max_media_bytes: int = MAX_MEDIA_BYTES, progress: bool = True,
         media_roots: Sequence[Path] = ()) -> PackReport:
    """Pack every conversation of `inputs` into OUT, reading media files only inside each input's directory or
    `media_roots`; returns the report written to OUT/pack.json.

    Only files pack's own metadata names are replaced or removed: a foreign file at a target name is an
    MmtokError naming it, raised before anything is written."""
    from mmtok.progress import progress as progress_bar

    check_inputs(inputs)  # before OUT is touched: a mistyped input must not unfinish an earlier pack
    roots = check_media_roots(media_roots)
    refuse_out_overlapping(out, [*inputs, *media_roots])
    owned = refuse_foreign(out)
    out.mkdir(parents=True, exist_ok=True)
    with WriterLock(out, f"pack output {out}"):
        _record_owned(out, owned)  # before pack.json goes: a killed pack must still know which tars are its
        (out / REPORT).unlink(missing_ok=True)  # until rewritten, the output is not a finished pack
        for stale in out.glob(".conversations-*.tar.tmp-*"):
            stale.unlink()  # what a killed pack was writing (the lock is ours: no live writer owns it)
        counts: Counter = Counter()
        skipped = []
        bar = progress_bar(desc="pack", unit="conv", enabled=progress)
        with ConversationTars(out, samples_per_tar, lambda name: _owns(out, owned, name)) as tars:
            for ordinal, conversation in enumerate(read_conversations(inputs, media_roots)):
                if conversation.whole_file:
                    counts[skips.file_count_key(conversation.error.reason)] += 1
                    skipped.append(conversation.skip_record(conversation.error, "pack"))
                    continue
                counts["conversations"] += 1
                try:
                    members, kinds = pack_conversation(conversation, f"{ordinal:09d}", max_media_bytes)
                except Skip as skip:
                    counts[skips.count_key(skip.reason)] += 1
                    skipped.append(conversation.skip_record(skip, "pack"))
                else:
                    tars.add(members)
                    counts["packed"] += 1
                    counts.update({f"{kind}_packed": n for kind, n in kinds.items()})
                bar.update(1)
        bar.close()
        with atomic_writer(out / SKIPPED) as handle:
            skips.append(handle, skipped)
        for stale in sorted(owned - set(tars.names)):
            (out / stale).unlink(missing_ok=True)  # an earlier pack into OUT wrote more tars
        report = PackReport(input_fingerprint(inputs), tars.names, dict(sorted(counts.items())), list(roots))
        atomic_write_json(out / REPORT, report.to_json())
        (out / OWNED).unlink(missing_ok=True)  # pack.json names the tars now
    return report


def _owns(out: Path, owned: set[str], name: str) -> None:
    """Record that this pack writes tar `name` into OUT, before the tar can appear."""
    if name not in owned:
        owned.add(name)
        _record_owned(out, owned)


def _record_owned(out: Path, owned: set[str]) -> None:
    atomic_write_json(out / OWNED, {"format": "mmtok-pack-owned/1", "tars": sorted(owned)})


def _owned(out: Path) -> set[str] | None:
    """The tars pack's own metadata says it wrote into OUT (pack.json's, and those of a pack stopped before
    it wrote pack.json); None when OUT holds no pack metadata."""
    found = None
    for name in (REPORT, OWNED):
        meta = read_json_object(out / name)
        if meta is None:
            continue
        tars = meta.get("tars")
        if not isinstance(tars, list) or not all(isinstance(t, str) and TAR_NAME.fullmatch(t) for t in tars):
            raise MmtokError(f"{out / name}: `tars` is not a list of conversations-NNNNNN.tar names; pass another "
                             "--out (or restore the file)")
        found = (found or set()) | set(tars)
    return found


def refuse_foreign(out: Path) -> set[str]:
    """The tars of an earlier pack in OUT (which this pack may replace); MmtokError naming the first file
    pack did not write when OUT is not empty and holds no pack metadata, or holds a tar at a target name
    (conversations-NNNNNN.tar) that no pack metadata names."""
    if not out.exists():
        return set()
    owned = _owned(out)
    if owned is None:
        own = (WriterLock.NAME, ".conversations-", f".{SKIPPED}.tmp-", f".{REPORT}.tmp-", f".{OWNED}.tmp-")
        foreign = sorted(p.name for p in out.iterdir() if not p.name.startswith(own))  # what a stopped pack leaves
        if foreign:
            raise MmtokError(f"{out / foreign[0]} was not written by `mmtok pack` ({out} holds no pack.json); pack "
                             "replaces the files in --out: pass another --out")
        owned = set()
    foreign = sorted(p.name for p in out.glob("conversations-*.tar") if p.name not in owned)
    if foreign:
        raise MmtokError(f"{out / foreign[0]} was not written by `mmtok pack` (its pack.json does not name it), and "
                         "pack writes and removes files of that name: move it away or pass another --out")
    return owned
