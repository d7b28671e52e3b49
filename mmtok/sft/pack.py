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
import tarfile
from collections import Counter
from collections.abc import Sequence
from contextlib import ExitStack
from pathlib import Path

from mmtok.formats.chat import ConversationError, with_media_names
from mmtok.formats.conversations import (KIND_SUFFIXES, Conversation, check_inputs, check_media_roots,
                                         input_fingerprint, locate, read_conversations)
from mmtok.errors import MmtokError, Skip
from mmtok.formats import skips
from mmtok.fsutil import WriterLock, atomic_write_json, atomic_writer

SAMPLES_PER_TAR = 1000
REPORT = "pack.json"
SKIPPED = "skipped.jsonl"
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


def pack_conversation(conversation: Conversation, key: str) -> tuple[list[tuple[str, bytes]], Counter]:
    """(the members of one conversation's sample, json last; media packed by kind); Skip naming why it
    cannot be packed."""
    try:
        media = conversation.media()
    except ConversationError as err:
        raise Skip(err.reason, err.detail) from None
    members, names, counts = [], {}, Counter()
    for ref in media:
        located = locate(conversation, media, ref.slot)
        if located.kind == "cut":
            names[ref.slot] = {"cut_id": located.cut_id}
            continue
        try:
            data = located.read()
        except OSError as err:
            raise Skip("missing_media", f"{ref.slot.kind} {ref.slot.index}: {located.where}: {err}") from None
        name = located.member or (located.where if located.kind == "file" else None)  # the name it was given
        try:
            ext = extension(ref.slot.kind, data, name)
        except Skip as skip:
            raise Skip(skip.reason, f"{ref.slot.kind} {ref.slot.index}: {located.where}: {skip.detail}") from None
        member = f"{key}.{counts[ref.slot.kind]}.{ext}"
        counts[ref.slot.kind] += 1
        names[ref.slot] = member
        members.append((member, data))
    record = with_media_names(conversation.record, names)
    record["id"] = conversation.id
    members.append((f"{key}.json", _json_bytes(record)))
    return members, counts


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


def pack(inputs: list[Path], out: Path, *, samples_per_tar: int = SAMPLES_PER_TAR, progress: bool = True,
         media_roots: Sequence[Path] = ()) -> dict:
    """Pack every conversation of `inputs` into OUT, reading media files only inside each input's directory or
    `media_roots`; returns the report written to OUT/pack.json."""
    from mmtok.progress import progress as progress_bar

    check_inputs(inputs)  # before OUT is touched: a mistyped input must not unfinish an earlier pack
    roots = check_media_roots(media_roots)
    inside = [p for p in inputs if Path(p).resolve().is_relative_to(out.resolve())]
    if inside:
        raise MmtokError(f"{inside[0]} is inside --out {out}, which pack rewrites; pack into another directory")
    out.mkdir(parents=True, exist_ok=True)
    with WriterLock(out, f"pack output {out}"):
        (out / REPORT).unlink(missing_ok=True)  # until rewritten, the output is not a finished pack
        for stale in out.glob(".conversations-*.tar.tmp-*"):
            stale.unlink()  # what a killed pack was writing (the lock is ours: no live writer owns it)
        counts: Counter = Counter()
        skipped = []
        bar = progress_bar(desc="pack", unit="conv", enabled=progress)
        with _Tars(out, samples_per_tar) as tars:
            for ordinal, conversation in enumerate(read_conversations(inputs, media_roots)):
                if conversation.whole_file:
                    counts[skips.file_count_key(conversation.error.reason)] += 1
                    skipped.append(conversation.skip_record(conversation.error, "pack"))
                    continue
                counts["conversations"] += 1
                try:
                    members, kinds = pack_conversation(conversation, f"{ordinal:09d}")
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
        for stale in sorted(out.glob("conversations-*.tar")):
            if stale.name not in tars.names:
                stale.unlink()  # an earlier pack into OUT had more tars
        report = {"format": "mmtok-pack/1", "inputs": input_fingerprint(inputs), "tars": tars.names,
                  "counts": dict(sorted(counts.items())), **({"media_roots": list(roots)} if roots else {})}
        atomic_write_json(out / REPORT, report)
    return report


class _Tars:
    """The output tars, each written atomically as its samples come (a sample's media are held, not a tar's),
    member metadata fixed (no clock, no owner): the same inputs give the same bytes."""

    def __init__(self, out: Path, samples_per_tar: int):
        self.out, self.samples_per_tar = out, samples_per_tar
        self.names: list[str] = []
        self._stack = ExitStack()
        self._archive, self._samples = None, 0

    def add(self, members: list[tuple[str, bytes]]) -> None:
        if self._archive is None or self._samples == self.samples_per_tar:
            self._next()
        for member, data in members:
            info = tarfile.TarInfo(member)
            info.size, info.mtime, info.mode = len(data), 0, 0o644
            self._archive.addfile(info, io.BytesIO(data))
        self._samples += 1

    def _next(self) -> None:
        self._stack.close()  # the previous tar: closed, fsynced, renamed into place
        self._stack = ExitStack()
        self.names.append(f"conversations-{len(self.names):06d}.tar")
        handle = self._stack.enter_context(atomic_writer(self.out / self.names[-1]))
        self._archive = self._stack.enter_context(tarfile.open(fileobj=handle, mode="w", format=tarfile.GNU_FORMAT))
        self._samples = 0

    def __enter__(self) -> "_Tars":
        return self

    def __exit__(self, *exc) -> None:
        if exc[0] is None and not self.names:
            self._next()  # nothing packed: one empty tar, so the later stages have their input
        self._stack.__exit__(*exc)


def refuse_foreign(out: Path) -> None:
    """OUT must be empty or an earlier pack output: pack replaces its tars."""
    if not out.exists() or (out / REPORT).is_file() or any(out.glob("conversations-*.tar")):
        return
    own = (WriterLock.NAME, ".conversations-", f".{SKIPPED}.tmp-", f".{REPORT}.tmp-")  # a stopped pack leaves these
    if any(not p.name.startswith(own) for p in out.iterdir()):
        raise MmtokError(f"{out} exists and is not an earlier `mmtok pack` output; pass another --out")
