"""`mmtok sft`: SFT conversations with any mix of images and audio -> Megatron parts (then `mmtok merge`).

Media are encoded where they are best encoded -- images by `mmtok encode` over a `--mode sft` plan of
the conversation tars (each image a checksummed *item* of its part, see `mmtok.encode.runner`), audio by
`mmtok audio convert --kind conversations` + `mmtok encode --modality audio` (each clip a row of the
per-clip token cache) -- and this stage is the one place conversations are made, in one ordered CPU
pass: every conversation of the inputs (`mmtok.formats.conversations`), in input order, is rendered with the
text tokenizer's chat template (`mmtok.formats.chat.ChatRenderer`), cut at its media placeholders, and each
placeholder replaced by its medium's block, in order:

  image slot k of tar sample (T, KEY)   the image item of the member the slot's reference names (or, for
                                        a bare placeholder, the sample's k-th unnamed image member)
  audio slot k of conversation C        the cache clip `{"cut_id": ID}` names, else the clip
                                        `mmtok.formats.conversations.audio_clip_id(C, k)` that the conversion made:
                                        <|audio_start|> its ids <|audio_end|>, the pretraining clip's block

A conversation is written once, only when every medium it references encoded; otherwise it is a skip
record naming it: `missing_media` (a reference that resolves to nothing, or a medium no encode output
holds), `placeholder_mismatch` (the media placeholders name and the sample's differ in number; a member
named twice is one image, whose block fills both),
`media_skipped:<reason>` (the medium was dropped by its conversion or its encode, with that reason),
`stale_media` (its tar changed since it was scanned: its image items belong to other bytes), or
a rendering reason (`template_error`, `invalid_json`, ...). BOS is prepended / EOS appended unless the
rendering starts / ends with them; a conversation over --max-tokens is `document_too_long` (text that
certainly is -- `TextTokenizer.max_token_bytes` -- before it is tokenized). Only the template's own
control tokens become control ids (`ChatRenderer.render_pieces`): a control-token name in the record is
text, and the conversation counts as `control_literals`.

Work items: the conversations, in input order, are cut into units of CONVERSATIONS_PER_UNIT and the units
into work items of UNITS_PER_ITEM (`conversation_items`: the inputs alone decide them, never the number of
workers). Each item is one part, OUT/parts/part-<item>, committed after every unit (resumable, see
`mmtok.formats.commitlog.PartWriter`); worker w of W starts with a contiguous, even range of items and then
takes over any item no process has finished or holds (`mmtok.workers.items_to_take`), so a slow or
killed worker's items are finished by the others, and a job resumes with any number of workers. A worker
reads only its items' conversations: the first to start makes the conversation index
(`mmtok.formats.conversation_index`: where each unit starts, which ids repeat) in OUT, and every item seeks
to its first unit from there. An item's files depend only on its conversations and the encoded media, so
the parts, and the bytes `mmtok merge OUT` gives, are the same for any number of workers of this stage or of
the encodes before it.
"""

from __future__ import annotations

import os
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok import __version__
from mmtok.errors import DamagedFile, MmtokError, Skip
from mmtok.formats import audio_cache, commitlog, conversation_index, kept, partdir, shar, skips
from mmtok.formats.chat import ChatRenderer, Control, ConversationError, MediaSlot, recorded_special_ids
from mmtok.formats.commitlog import PartWriter
from mmtok.formats.conversations import (
    Conversation,
    Located,
    audio_clip_id,
    check_media_roots,
    input_fingerprint,
    locate,
)
from mmtok.formats.items import KEPT_DIR, ImageIndex, media_digest
from mmtok.formats.keys import KeyTable, key_digest
from mmtok.formats.parts import find_parts, refuse_other_run
from mmtok.fsutil import required
from mmtok.launch import stop_check
from mmtok.ranks import worker_range
from mmtok.text import TextTokenizer, load_text_tokenizer, tokenizer_difference
from mmtok.vocab import VocabLayout
from mmtok.workers import ItemDone, ItemStop, WorkerRun, take_items

CLIPS_FORMAT = "mmtok-clip-index/2"
CLIPS_DIR = "clip-index"  # OUT/clip-index/: the audio clips' index one rank built, for the others (formats/kept.py)
CONVERSATIONS_PER_UNIT = 256  # one commit per unit: a kill loses at most this many conversations' work
# A work item, one part: 16,384 conversations, about 30 s of one core (benchmarks/RESULTS.md: 458 a second on the
# 2-core VM); short enough that workers that finish first take over a slow one's tail, long enough that a
# million conversations are 62 parts, not thousands.
UNITS_PER_ITEM = 64
DEFAULT_MAX_TOKENS = 1 << 20
# A data-quality count: written conversations whose text held control-token names (tokenized as text).
CONTROL_LITERALS = "control_literals"


@dataclass(frozen=True)
class SftOptions:
    max_tokens: int = DEFAULT_MAX_TOKENS
    progress: bool = True
    take_over: bool = True  # once its own items are done, take any item nobody finished or holds
    stop: object = None  # a `mmtok.launch.StopRequest` (or any object with is_set() and name); None: never stop


# -- encoded images ---------------------------------------------------------------------------------
class ImageItems:
    """The image items of a finished image encode output (a `--mode sft` plan), by (tar, member): the block's
    ids, or why the image failed. Every part is checked against its checksums first (here, or by the rank that
    kept the index: `ImageIndex.cached`)."""

    def __init__(self, out: Path, layout: VocabLayout, tokenizer: TextTokenizer, kept: Path | None = None):
        """`kept`: where the index is kept for the other ranks (`ImageIndex.cached`); None: built here only."""
        self.out = out
        parts = find_parts(out, check_bytes=kept is None)  # else checked by the rank that keeps the index (`cached`)
        self.identity, self.identity_file = parts[0].identity, parts[0].directory / partdir.IDENTITY
        _check_image_run(out, self.identity, self.identity_file, layout, tokenizer)
        directories = [part.directory for part in parts]
        self._index = ImageIndex.cached(directories, kept) if kept is not None else ImageIndex(directories)

    def images_of(self, tar: str, key: str) -> int:
        """How many images sample `key` of `tar` has; Skip `stale_media` when the tar changed since its encode."""
        self._check_current(tar)
        return self._index.images_of(tar, key)

    def _check_current(self, tar: str) -> None:
        stale = self._index.stale(tar)
        if stale is not None:  # its items were made from other bytes at this path: never lend them
            raise Skip("stale_media", stale)

    def block(self, tar: str, member: str, source: Located) -> np.ndarray:
        """The image block of tar member `member`, whose bytes are now at `source`; Skip if it did not encode, or
        if the tar (or those bytes) changed since."""
        self._check_current(tar)
        found = self._index.find(tar, member)
        if found is None and not self._index.holds_tar(tar):
            tars = self._index.tars
            raise Skip("missing_media", f"image {member}: {self.out} holds no image of {tar} (its images come from "
                       f"{', '.join(tars[:3])}{' ...' if len(tars) > 3 else ''}); was this tar "
                       "scanned, or moved since the scan?")
        if found is None:
            raise Skip("missing_media", f"image {member} of {tar} is not in {self.out} (not scanned, or dropped by "
                       "the plan: see `mmtok plan --explain` and the plan's dropped.parquet)")
        if found.skip is not None:
            raise Skip(f"media_skipped:{found.skip.reason}", f"image {member}: {found.skip.detail}")
        self._check_bytes(tar, member, found, source)
        return self._index.ids(found)

    @staticmethod
    def _check_bytes(tar: str, member: str, found, source: Located) -> None:
        """Skip `stale_media` unless the member's bytes are those the encode decoded: a tar re-packed with its
        size, mtime and first 8 KiB kept (tar pads to 10 KiB records; `touch -r` restores a time) passes the
        tar's identity check with another image inside."""
        try:
            digest = media_digest(source.read())
        except OSError as err:
            raise Skip("missing_media", f"image {member}: cannot read {source.where} ({err})") from None
        if digest != found.digest:
            recorded = "no digest" if found.digest is None else f"digest {found.digest[:12]}..."
            raise Skip("stale_media", f"image {member} of {tar}: its bytes are not those `mmtok encode` decoded "
                       f"(digest {digest[:12]}..., encoded: {recorded}); re-run scan, plan and encode on this tar")


def _check_image_run(out: Path, identity: dict, path: Path, layout: VocabLayout, tokenizer: TextTokenizer) -> None:
    """The image run (its identity read from `path`) was made for this tokenizer and layout."""
    if identity.get("modality") != "image" or identity.get("mode") != "sft":
        raise MmtokError(f"{out}: not the image encode of a `--mode sft` plan (modality {identity.get('modality')}, "
                         f"mode {identity.get('mode')}); plan the conversation tars with `mmtok plan --mode sft`")
    difference = tokenizer_difference(required(identity, "text_tokenizer", dict, path), tokenizer.describe())
    if difference:
        raise MmtokError(f"{out}: its image blocks were made with another text tokenizer: {difference}; pass the "
                         "plan's --text-tokenizer")
    vocab = required(identity, "vocab", dict, path)
    if vocab.get("total_size") != layout.total_size or vocab.get("text_size") != layout.text_size:
        raise MmtokError(f"{out}: its vocabulary layout {vocab} differs from this tokenizer's")


# -- encoded audio ----------------------------------------------------------------------------------
class AudioClips:
    """The clips of audio token caches (`mmtok encode --modality audio` outputs) by cut id, and why clips
    their encodes skipped or their conversions (`converted`) dropped are missing."""

    def __init__(self, outs: list[Path], converted: list[Path], layout: VocabLayout, kept_in: Path | None = None):
        """`kept_in`: where the clip index is kept for the other ranks (`mmtok.formats.kept`); None: built here."""
        self.layout = layout
        self._paths: list[Path] = []
        self._why: dict[str, Skip] = {}  # the clips that were dropped or failed: few
        self._loaded: OrderedDict[int, list[np.ndarray]] = OrderedDict()
        self.describe = []
        for out in outs:
            # (without check_bytes: checked where the index is made)
            paths = audio_cache.find_cache_parts(out, check_bytes=kept_in is None)
            metadata = audio_cache.read_metadata(paths[0])
            if metadata["vocab"] != layout.to_dict():
                raise MmtokError(f"{out}: its audio ids were made for vocabulary {metadata['vocab']}, not this "
                                 f"tokenizer's {layout.to_dict()}; re-encode the audio with `--text-tokenizer` = the "
                                 "sft tokenizer")
            self.describe.append({"out": os.path.realpath(out), "codec": metadata["codec"], "trim": metadata["trim"],
                                  "num_parts": metadata["num_parts"]})
            self._paths += paths
            for _, directory in partdir.part_directories(out):
                for record in commitlog.read_skipped(directory):
                    self._why.setdefault(record.key, record.skip())
        if kept_in is None:
            arrays = self._index()
        else:  # as the image index (`ImageIndex.cached`): the rank that makes it checks every cache part first
            def check() -> None:
                for path in self._paths:
                    audio_cache.verify(path)

            inputs = [file for path in self._paths for file in audio_cache.cache_verified_files(path)]
            arrays = kept.load_or_keep(kept_in, inputs, CLIPS_FORMAT, check, lambda: (self._index(), {}))[0]
        self._clips = KeyTable(arrays["clips_high"], arrays["clips_low"], None)
        self._part, self._row, self._digests = arrays["part"], arrays["row"], arrays["digests"]
        self.converted = [os.path.realpath(c) for c in converted]  # named in the identity: a resume needs the same
        for conversion in converted:
            self._read_dropped(Path(conversion))

    def _index(self) -> dict[str, np.ndarray]:
        """By cut id, 56 bytes a clip: the first cache (in --audio order, then part order) that holds a clip
        gives it."""
        keys, digests, parts, rows = bytearray(), bytearray(), array("i"), array("i")
        for number, path in enumerate(self._paths):
            index = audio_cache.read_cache_index(path)
            for row, (cut_id, digest) in enumerate(zip(index.column("cut_id").to_pylist(),
                                                       index.column("source_sha256").to_pylist(), strict=True)):
                keys += key_digest(cut_id)
                digests += _source_digest(digest, path)
                parts.append(number)
                rows.append(row)
        clips, chosen = KeyTable.of(keys)
        high, low = clips.halves()
        return {"clips_high": high, "clips_low": low, "part": np.frombuffer(parts, np.int32)[chosen],
                "row": np.frombuffer(rows, np.int32)[chosen],
                "digests": np.frombuffer(digests, np.uint8).reshape(-1, SHA256_BYTES)[chosen]}  # zeros: none recorded

    def _read_dropped(self, conversion: Path) -> None:
        for path in shar.skip_lists(conversion):
            for record in skips.read(path):
                self._why.setdefault(record.key, record.skip())

    def block(self, cut_id: str, source: Located | None = None) -> np.ndarray:
        """<|audio_start|> the clip's ids <|audio_end|>; Skip when no cache holds the clip, or when `source`
        (the medium the conversation references) is no longer the bytes the clip was converted from."""
        found = self._clips.find(cut_id)
        if found < 0:
            why = self._why.get(cut_id)
            if why is not None:
                raise Skip(f"media_skipped:{why.reason}", f"clip {cut_id}: {why.detail}")
            raise Skip("missing_media", f"clip {cut_id} is in no audio token cache given (--audio)"
                       + ("" if self._paths else ": none was given"))
        recorded = self._digests[found].tobytes()
        if source is not None and source.kind != "cut" and recorded != NO_DIGEST:
            self._check_source(cut_id, source, recorded.hex())
        ids = self._part_ids(int(self._part[found]))[int(self._row[found])]  # checked to be audio ids when read
        return self.layout.audio_block(ids - self.layout.audio_offset)

    @property
    def nbytes(self) -> int:
        """Bytes the clip index keeps (the skip reasons of dropped clips not counted)."""
        return self._clips.nbytes + self._part.nbytes + self._row.nbytes + self._digests.nbytes

    def _check_source(self, cut_id: str, source: Located, converted: str) -> None:
        """Skip `stale_media` when the medium's bytes differ from those clip `cut_id` was converted from."""
        try:
            digest = shar.source_digest(source.read())
        except OSError as err:
            raise Skip("missing_media", f"clip {cut_id}: cannot read {source.where} ({err})") from None
        if digest != converted:
            raise Skip("stale_media", f"clip {cut_id}: {source.where} changed since `mmtok audio convert` read it "
                       f"(sha256 {digest[:12]}..., converted {converted[:12]}...); rerun the conversion "
                       "and the audio encode")

    def _part_ids(self, part: int) -> list[np.ndarray]:
        """One cache part's audio ids (the last few parts kept: conversations visit them in order)."""
        if part not in self._loaded:
            self._loaded[part] = audio_cache.read_tokens(self._paths[part], self.layout)[0]
            if len(self._loaded) > 4:
                self._loaded.popitem(last=False)
        self._loaded.move_to_end(part)
        return self._loaded[part]


SHA256_BYTES = 32
NO_DIGEST = bytes(SHA256_BYTES)  # a clip whose source bytes were not recorded (a pretraining clip by cut id)


def _source_digest(digest: str | None, path: Path) -> bytes:
    """The 32 bytes of a cache row's source_sha256 (hex), NO_DIGEST for none; DamagedFile for another value."""
    if digest is None:
        return NO_DIGEST
    try:
        raw = bytes.fromhex(digest)
    except ValueError:
        raw = b""
    if len(raw) != SHA256_BYTES or raw == NO_DIGEST:
        raise DamagedFile(f"{path}: source_sha256 {digest[:80]!r} is not a sha256; re-encode this audio part")
    return raw


# -- one conversation ---------------------------------------------------------------------------------
class ConversationBuilder:
    """Conversation -> its token sequence (or a Skip), from the rendering and the encoded media."""

    def __init__(self, tokenizer: TextTokenizer, images: ImageItems | None, audio: AudioClips, max_tokens: int):
        self.tokenizer = tokenizer
        self.renderer = ChatRenderer.from_tokenizer(tokenizer)
        self.images = images
        self.audio = audio
        self.max_tokens = max_tokens
        self._controls = {name: control.id for name, control in tokenizer.control_tokens().items()}
        # Text of more UTF-8 bytes than this has more than max_tokens tokens (TextTokenizer.max_token_bytes):
        # refused before the tokenizer sees it. None: the tokenizer gives no such bound.
        self._max_text_bytes = None if tokenizer.max_token_bytes is None else max_tokens * tokenizer.max_token_bytes
        self._bos = np.array([tokenizer.bos_id], np.int32)
        self._eos = np.array([tokenizer.eos_id], np.int32)

    def build(self, conversation: Conversation) -> tuple[np.ndarray, dict]:
        """(tokens, what went into them); Skip naming the first problem."""
        try:
            media = conversation.media()
            rendering = self.renderer.render_pieces(conversation.record, self._max_text_bytes)
        except ConversationError as err:
            raise Skip(err.reason, err.detail) from None
        pieces = rendering.pieces
        slots = [p for p in pieces if isinstance(p, MediaSlot)]
        if sorted(slots, key=_slot_order) != sorted((m.slot for m in media), key=_slot_order):
            raise Skip("placeholder_mismatch", f"the rendering has {_kinds(slots)} placeholders, the messages "
                       f"reference {_kinds([m.slot for m in media])}")
        self._check_image_count(conversation, media, slots)
        self._check_text_size(pieces)
        parts, used = [], {"image": [], "audio": []}
        for piece in pieces:
            if isinstance(piece, str):
                parts.append(np.asarray(self.tokenizer.encode(piece), np.int32))
            elif isinstance(piece, Control):
                parts.append(np.array([self._controls[piece.name]], np.int32))
            else:
                block, reference = self._block(conversation, piece, locate(conversation, media, piece))
                parts.append(block)
                used[piece.kind].append(reference)
        if rendering.control_literals:  # counted by the rank (`control_literals`), not part of the provenance
            used[CONTROL_LITERALS] = True
        if not (parts and parts[0].size and parts[0][0] == self._bos[0]):
            parts.insert(0, self._bos)
        if not (parts[-1].size and parts[-1][-1] == self._eos[0]):
            parts.append(self._eos)
        tokens = np.concatenate(parts).astype(np.int32)
        if tokens.size > self.max_tokens:
            raise Skip("document_too_long", f"{tokens.size:,} tokens > --max-tokens {self.max_tokens:,}")
        return tokens, used

    def _check_text_size(self, pieces: list) -> None:
        if self._max_text_bytes is None:
            return
        size = sum(len(p.encode("utf-8", "surrogatepass")) for p in pieces if isinstance(p, str))
        if size > self._max_text_bytes:
            raise Skip("document_too_long", f"{size:,} bytes of text are more than --max-tokens {self.max_tokens:,} "
                       f"tokens of at most {self.tokenizer.max_token_bytes} bytes each")

    def _check_image_count(self, conversation: Conversation, media: list, slots: list[MediaSlot]) -> None:
        """The sample's encoded images are the members its image slots name: a member named by two slots is
        one image (it fills both), a member no slot names is a mismatch."""
        if conversation.tar is None or self.images is None:
            return
        have = self.images.images_of(conversation.tar, conversation.key)
        placeholders = [slot for slot in slots if slot.kind == "image"]
        images = {_image_of(conversation, media, slot) for slot in placeholders}
        if have and have != len(images):
            named = f" naming {len(images)} image(s)" if len(images) != len(placeholders) else ""
            raise Skip("placeholder_mismatch", f"the conversation has {len(placeholders)} image placeholder(s)"
                       f"{named}, the sample's encoded images are {have}")

    def _block(self, conversation: Conversation, slot: MediaSlot, located: Located) -> tuple[np.ndarray, str]:
        """(the medium's block, what provenance names it by: the cut id of a clip, the member of an image)."""
        if slot.kind == "audio":
            cut_id = located.cut_id or audio_clip_id(conversation.id, slot.index)
            return self.audio.block(cut_id, located), cut_id
        if located.kind != "member" or self.images is None:
            where = "no --images was given" if self.images is None else \
                "images are encoded from tar members only: `mmtok pack` the conversations into tars first"
            raise Skip("missing_media", f"image {slot.index} ({located.where}): {where}")
        return self.images.block(conversation.tar, located.member, located), located.where


def _image_of(conversation: Conversation, media: list, slot: MediaSlot) -> str | MediaSlot:
    """The sample member an image slot names, or the slot itself where it names none (counted on its own:
    the fill then says what is missing)."""
    try:
        located = locate(conversation, media, slot)
    except Skip:
        return slot
    return located.member if located.kind == "member" else slot


def _slot_order(slot: MediaSlot) -> tuple[str, int]:
    return slot.kind, slot.index


def _kinds(slots: list[MediaSlot]) -> str:
    counts = Counter(slot.kind for slot in slots)
    return " + ".join(f"{counts[k]} {k}" for k in ("image", "audio")) if slots else "no"


# -- the worker -------------------------------------------------------------------------------------
def conversation_items(total: int) -> list[tuple[int, int]]:
    """[start, end) units of every work item of `total` conversations: UNITS_PER_ITEM units each (the last
    fewer), at least one item (an input of no conversations is one empty part). The inputs alone decide them."""
    units = -(-total // CONVERSATIONS_PER_UNIT)
    return [(start, min(start + UNITS_PER_ITEM, units)) for start in range(0, units, UNITS_PER_ITEM)] or [(0, 0)]


def assemble_worker(inputs: list[Path], out: Path, *, text_tokenizer: str, images: Path | None = None,
                    audio: list[Path] = (), converted: list[Path] = (), rank: int = 0, world_size: int = 1,
                    options: SftOptions = SftOptions(), media_roots: Sequence[Path] = ()) -> WorkerRun:
    """Worker `rank` of `world_size`: assemble its work items (a contiguous, even range of `conversation_items`), each
    into OUT/parts/part-<item>, then (with `options.take_over`) every item no process has finished or holds
    (`mmtok.workers.items_to_take`); returns what it did, summed over its items. A finished item is left as
    it is, a half-done one resumes from its commit log, whichever worker started it. Once `options.stop` is
    set, the unit in hand is committed and the worker returns (`stopped`). A medium given as a file path
    resolves only inside its input's directory or one of `media_roots`."""
    tokenizer = load_text_tokenizer(text_tokenizer)
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    image_items = (ImageItems(Path(images), layout, tokenizer, kept=Path(out) / KEPT_DIR) if images is not None
                   else None)
    clips = AudioClips([Path(a) for a in audio], [Path(c) for c in converted], layout,
                       kept_in=Path(out) / CLIPS_DIR if audio else None)
    builder = ConversationBuilder(tokenizer, image_items, clips, options.max_tokens)
    index = conversation_index.load_or_build(inputs, out, CONVERSATIONS_PER_UNIT)  # made by the first worker
    items = conversation_items(index.total)
    own = worker_range(np.array([b - a for a, b in items], np.float64), world_size, rank)
    shared = _identity(inputs, tokenizer, layout, image_items, clips, options, items)
    roots = check_media_roots(media_roots)
    if roots:  # they decide which file references resolve: a resume must use the same
        shared["media_roots"] = list(roots)
    existing = partdir.part_directories(out)
    if existing:  # an encode's parts first, named as such; then any other run's (key by key)
        _refuse_other_parts(existing[0][1])
    refuse_other_run(out, shared, "mmtok sft")
    work = _Work(inputs, out, index, builder, roots, options, stop_check(options.stop))
    run = take_items(out, len(items), own, options.take_over, work.stopping,
                     lambda item: work.item(item, items[item], {**shared, "part": item, "part_units": [*items[item]]}))
    stopped = None if run.stopped is None else ItemStop(signal=options.stop.name, item=run.stopped)
    return WorkerRun.of(run, own, len(items), out, stopped)


@dataclass
class _Work:
    """What every item of one worker reads: the inputs and their conversation index, the builder."""

    inputs: list[Path]
    out: Path
    index: conversation_index.ConversationIndex
    builder: ConversationBuilder
    roots: list[Path]
    options: SftOptions
    stopping: object  # `mmtok.launch.stop_check` of the options' stop request

    def item(self, item: int, units: tuple[int, int], identity: dict) -> ItemDone:
        """Assemble (or resume, or find finished) work item `item` (`units`) into its part."""
        from mmtok.progress import progress as progress_bar

        with PartWriter(partdir.part_dir(self.out, item), identity) as part:
            if part.done:
                return _item_done(part, already_done=True)
            first = max(units[0], part.next_unit) * CONVERSATIONS_PER_UNIT
            last = min(units[1] * CONVERSATIONS_PER_UNIT, self.index.total)
            bar = progress_bar(total=last - first, desc=f"sft item {item}", unit="conv",
                               enabled=self.options.progress)
            pending = _Unit(first // CONVERSATIONS_PER_UNIT)
            try:
                for ordinal, conversation in self.index.read(self.inputs, first, last, self.roots):  # this item only
                    if ordinal // CONVERSATIONS_PER_UNIT != pending.unit:
                        pending.commit(part)
                        if self.stopping():  # the unit read is committed; the part stays unfinished
                            return _item_done(part, stopped=True, next_unit=part.next_unit)
                        pending = _Unit(ordinal // CONVERSATIONS_PER_UNIT)
                    pending.add(conversation, self.builder)
                    bar.update(1)
                if pending.conversations:
                    pending.commit(part)
            finally:
                bar.close()
            part.finish({"tool_version": __version__, "item": item, "units": list(units),
                         "conversations": self.index.total})
            return _item_done(part)


def _item_done(part: PartWriter, **fields) -> ItemDone:
    """What the item's part holds (`dataset` is left out: only image encode reports it)."""
    return ItemDone(part_dir=str(part.directory), counts=dict(part.counts), sequences=len(part.lengths), **fields)


@dataclass
class _Unit:
    """One unit's sequences, provenance, skip records and counts, committed together."""

    unit: int
    conversations: int = 0

    def __post_init__(self):
        self.sequences, self.provenance, self.skipped, self.counts = [], [], [], Counter()
        self.started = time.perf_counter()

    def add(self, conversation: Conversation, builder: ConversationBuilder) -> None:
        self.conversations += 1
        if conversation.whole_file:
            self.counts[skips.file_count_key(conversation.error.reason)] += 1
            self.skipped.append(conversation.skip_record(conversation.error, "sft"))
            return
        self.counts["conversations"] += 1
        try:
            tokens, used = builder.build(conversation)
        except Skip as skip:
            self.counts[skips.count_key(skip.reason)] += 1
            self.counts["documents_skipped"] += 1
            self.skipped.append(conversation.skip_record(skip, "sft"))
            return
        if used.pop(CONTROL_LITERALS, False):
            self.counts[CONTROL_LITERALS] += 1
        self.sequences.append(tokens)
        self.provenance.append({"conversation": conversation.id, "origin": conversation.origin, **used})
        self.counts.update(documents_written=1, tokens=int(tokens.size), images_written=len(used["image"]),
                           audio_written=len(used["audio"]))

    def commit(self, part: PartWriter) -> None:
        wall_ms = round((time.perf_counter() - self.started) * 1000)  # `mmtok status` reads it (rates, ETA)
        part.commit(self.unit, self.sequences, self.provenance, {**self.counts, "wall_ms": wall_ms},
                    skipped=self.skipped)


def _identity(inputs, tokenizer, layout, images, clips, options, items: list[tuple[int, int]]) -> dict:
    """What every part (work item) of one run shares; each part adds its `part` and `part_units`."""
    special = recorded_special_ids(tokenizer)
    image_run = None if images is None else {
        "out": os.path.realpath(images.out),
        "plan_fingerprint": required(images.identity, "plan_fingerprint", str, images.identity_file),
        "codec": required(images.identity, "codec", dict, images.identity_file)}
    return {"num_parts": len(items), "modality": "sft", "mode": "sft",
            "work_items": {"count": len(items), "units_per_item": UNITS_PER_ITEM, "units": items[-1][1]},
            "inputs": input_fingerprint(inputs), "conversations_per_unit": CONVERSATIONS_PER_UNIT,
            "max_tokens": options.max_tokens, "text_tokenizer": tokenizer.describe(), "text_special_ids": special,
            "vocab": layout.offsets(), "images": image_run, "audio": clips.describe, "converted": clips.converted}


def _refuse_other_parts(directory: Path) -> None:
    """An --out that holds an encode's parts (`directory`: one of them) is not this stage's to resume (or to
    delete)."""
    if (directory / partdir.IDENTITY).is_file():
        modality = partdir.read_identity(directory).get("modality")
        if modality != "sft":
            raise MmtokError(f"{directory} is a part of an {modality} encode, not of `mmtok sft`; pass another --out")
