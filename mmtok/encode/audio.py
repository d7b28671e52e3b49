"""`mmtok encode --modality audio`: per-rank bucketed encoding of Lhotse Shar shards.

Work split: each rank takes whole Shar shards (`mmtok.ranks.assign_shards`, by total duration); ranks never
communicate. Each shard is one *part* (`OUT/parts/part-NNNNN`, part = shard index, num_parts = shard
count), so the merged output does not depend on how shards were spread over ranks.

Inside a part:
* units 0..B-1 are the bucketed batches (`shards.make_batches`). CPU DataLoader workers read each
  clip's FLAC member straight from the recording tar (byte range, no tar iteration), peak-normalize
  it to -3 dBFS and pad the batch, while the device encodes the previous batch. After encoding, each
  clip keeps ceil(n/600) - 5 codes (the codec's uniform trim, so its tokens never depend on its
  batch). A batch is committed as *carry* bytes of the part (per clip: cut position, reason,
  audio ids) -- durable, but not yet sequences.
* unit B assembles the part: all carried clips in the shard's cut order become the part's sequences
  (see `sequences_for`), the per-clip token cache (mmtok.formats.audio_cache) is written, and the part is
  finished. Sequence order therefore follows cut order and never batch composition; a kill at any
  instant resumes from the last durable commit and ends with the same bytes.

The batches run through the rank loop every modality shares (`mmtok.encode.loop`): a prefetch
thread takes them from the DataLoader, the device encodes, the committer commits and assembles.
"""

from __future__ import annotations

import queue
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from mmtok import __version__
from mmtok.documents import SequenceBuilder, is_translation
from mmtok.encode.audio_batches import Batching, make_batches
from mmtok.encode.loop import UNIFORM_CODES, Meter, run_device, uniform_codes
from mmtok.errors import MmtokError, Skip
from mmtok.formats import skips
from mmtok.formats.audio_cache import CACHE_FORMAT
from mmtok.formats.partdir import check_identity, is_done, lock_part, part_dir
from mmtok.formats.parts import refuse_other_run, timing_stats
from mmtok.formats.shar import (
    SOURCE_DIGEST,
    ConversionReport,
    SharShard,
    discover_shards,
    index_members,
    shard_fingerprint,
    verify_shard,
)
from mmtok.formats.skips import SkipRecord
from mmtok.formats.tar import MemberTruncated, read_range
from mmtok.fsutil import LockHeld
from mmtok.launch import stop_check
from mmtok.media.audio import (
    PEAK_DBFS,
    RESAMPLER,
    TARGET_SAMPLE_RATE,
    AudioReason,
    decode_bytes,
    peak_normalize,
    resample,
    to_mono,
)
from mmtok.ranks import assign_shards
from mmtok.text import tokenizer_difference
from mmtok.vocab import check_ids_in_range
from mmtok.workers import TakeOver, take_items

SEQUENCE_MODES = ("auto", "audio", "transcription", "both")
DEFAULT_SEQUENCES = "auto"
DEFAULT_TRIM = 5  # codes dropped at the end of every clip (WavTokenizer's look-ahead; the codec reports its own)


# --- data loading (DataLoader worker side) --------------------------------------------------------

@dataclass(frozen=True)
class BatchRequest:
    """What a worker needs to load one batch: where each clip's audio member lies in the tar."""

    shard: int
    unit: int
    recording_path: str
    positions: tuple[int, ...]
    # (offset, size) per clip; "reason: detail" = the tar reader refused the member, or it lies past damage;
    # None = no audio member
    members: tuple[tuple[int, int] | str | None, ...]
    durations: tuple[float, ...]  # seconds per clip, from the cuts
    min_samples: int  # clips with at most this many samples keep no code after the trim
    max_clip_duration: float  # longer clips are not loaded (see Batching.max_clip_duration)


class BatchDataset:
    """Map-style dataset over BatchRequests (the sampler hands the requests themselves as indices)."""

    def __getitem__(self, request: BatchRequest) -> dict:
        return load_batch(request)


def load_clip(handle, member: tuple[int, int] | str | None, duration: float, request: BatchRequest) -> np.ndarray:
    """Read, decode, check and peak-normalize one clip; raises AudioReason."""


    if member is None:
        raise AudioReason("missing_audio", "no audio member in the recording tar")
    if isinstance(member, str):
        raise AudioReason.parse(member)
    if duration > request.max_clip_duration:  # checked before reading: a 2-hour clip would need ~22 GB to encode
        raise AudioReason("too_long", f"{duration:.1f} s > --max-clip-duration {request.max_clip_duration:g} s")
    try:
        data = read_range(handle.fileno(), member[0], member[1], handle.name)
    except MemberTruncated as err:  # the shard changed since it was verified
        raise AudioReason("truncated_member", str(err)) from None
    samples, rate = decode_bytes(data)
    wave = resample(to_mono(samples), rate, TARGET_SAMPLE_RATE)
    wave = peak_normalize(wave)  # zero_length / non_finite / silent
    if wave.size <= request.min_samples:
        raise AudioReason("too_short", f"{wave.size} samples keep no code after the trim")
    return wave


def load_batch(request: BatchRequest) -> dict:
    """Padded float32 [B, T] waves of the loadable clips, their lengths and positions, and the skipped ones."""
    import torch

    waves, positions, skipped = [], [], []
    with open(request.recording_path, "rb") as handle:
        for position, member, duration in zip(request.positions, request.members, request.durations, strict=True):
            try:
                waves.append(load_clip(handle, member, duration, request))
                positions.append(position)
            except AudioReason as err:
                skipped.append((position, str(err)))
    batch = np.zeros((len(waves), max((w.size for w in waves), default=0)), dtype=np.float32)
    for row, wave in zip(batch, waves, strict=True):
        row[: wave.size] = wave
    return {"shard": request.shard, "unit": request.unit, "wave": torch.from_numpy(batch),
            "lengths": torch.tensor([w.size for w in waves], dtype=torch.int64), "positions": positions,
            "skipped": skipped}


def _worker_init(_worker_id: int) -> None:
    import signal

    import torch

    torch.set_num_threads(1)  # workers decode; the device (or the main process on CPU) computes
    # USR1 asks the main process to stop (a `kill -USR1` of the process group must not kill the loader under it).
    # SIGTERM keeps its default: the DataLoader ends its workers with it at shutdown, and one that ignored it would
    # keep the stopped process from exiting (found by an attack); a TERM for every process of the step (scancel)
    # ends the loader, which the main process, stopping on the same signal, does not need any more.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


# --- assembling a part -------------------------------------------------------------------------------

@dataclass
class Context:
    """Everything shared by the parts of one encode run."""

    out: Path
    builder: SequenceBuilder
    tokenizer: object
    sequences: str
    identity: dict          # shared part identity (part-specific keys are added per part)
    cache_metadata: dict


def clip_text(cut, tokenizer) -> tuple[np.ndarray | None, str | None, str | None]:
    """(text ids, language, target language) of a cut: the ids tokenized at conversion, else the
    supervision text tokenized now; None for the ids when there is no text (or it has no tokens)."""
    custom = cut.custom or {}
    language, target = custom.get("language"), custom.get("target_language")
    if "text_tokens" in custom:
        ids = custom["text_tokens"]
    else:
        # The join rule (docs/audio.md): a cut's supervisions in start order, texts joined by one space;
        # the first supervision's language is the clip's.
        supervisions = sorted(cut.supervisions, key=lambda s: (s.start, s.id))
        texts = [s.text for s in supervisions if s.text]
        language = language or (supervisions[0].language if supervisions else None)
        ids = tokenizer.encode(" ".join(texts)) if texts else []
    return (np.asarray(ids, np.int32) if len(ids) else None), language, target


FOREIGN_CLIP_BASE = 10**9  # a foreign cut's clip number: shard index * FOREIGN_CLIP_BASE + its rank in the shard


def clip_numbers(cuts, shard_index: int) -> list[tuple[str, int]]:
    """(source id, clip number) of each cut, in cut order. mmtok's own cuts carry both in `custom`. A cut
    another producer wrote (lhotse's `to_shar` of trimmed cuts) belongs to its recording, and its number is
    its rank by (start, position in the shard) among that recording's cuts in this shard (skipped cuts
    included, so they leave a gap), after `shard_index * FOREIGN_CLIP_BASE`. `to_shar` stores each cut's
    own audio and sets its start to 0, so there the recipe's cut order decides; a run ends where the
    recording crosses into another shard (cuts in two shards cannot be ordered without reading both)."""
    numbers: list[tuple[str, int] | None] = []
    foreign: dict[str, list[tuple[float, int]]] = {}
    for position, cut in enumerate(cuts):
        custom = cut.custom if isinstance(cut.custom, dict) else {}
        clip = custom.get("clip", 0)
        if isinstance(custom.get("source_id"), str) and isinstance(clip, int) and not isinstance(clip, bool):
            numbers.append((custom["source_id"], clip))
            continue  # else (a foreign Shar's odd custom fields) numbered as another producer's cut
        numbers.append(None)
        recording = getattr(cut, "recording_id", None) or cut.id
        foreign.setdefault(str(recording), []).append((float(cut.start), position))
    for recording, members in foreign.items():
        for rank, (_, position) in enumerate(sorted(members)):
            numbers[position] = (recording, shard_index * FOREIGN_CLIP_BASE + rank)
    return numbers


def sequences_for(mode: str, builder: SequenceBuilder, audio_ids: np.ndarray, text_ids: np.ndarray | None,
                  translate: bool) -> list[tuple[str, np.ndarray]]:
    """(kind, tokens) of the sequences one clip contributes, in output order."""
    task = "translation" if translate else "transcription"
    out = []
    if mode in ("audio", "both") or (mode == "auto" and text_ids is None):
        out.append(("audio", builder.audio_only(audio_ids)))
    if mode in ("auto", "transcription", "both") and text_ids is not None:
        out.append((task, builder.transcription(audio_ids, text_ids, translate=translate)))
    return out


# -- what a part carries between its batches (its carry.bin, `PartWriter.carry`) ------------------------
# Per clip: its cut position, a 0 (an unused sub-key, kept so a part begun by an earlier mmtok resumes), the
# number of its int32 ids, the bytes of its skip text ("reason: detail", "" when encoded); then that text and
# the ids. Only this module writes and reads it; the part's commit records checksum it (`carry_crc`).
_CARRIED_CLIP = struct.Struct("<qiiH")
MAX_SKIP_TEXT = 4000  # bytes of "reason: detail" kept per clip


def pack_clips(results: Iterable[tuple[int, str, np.ndarray | None]]) -> bytes:
    """The carry bytes of a batch's clips: (cut position, skip text or "", audio ids or None) each."""
    chunks = []
    for position, skip, ids in results:
        ids = np.zeros(0, np.int32) if ids is None else np.asarray(ids, np.int32)
        text = skip.encode()[:MAX_SKIP_TEXT].decode("utf-8", "ignore").encode()
        chunks += [_CARRIED_CLIP.pack(position, 0, ids.size, len(text)), text, ids.tobytes()]
    return b"".join(chunks)


def unpack_clips(data: bytes) -> Iterator[tuple[int, str, np.ndarray]]:
    """(cut position, skip text, audio ids) of every clip in `pack_clips` output (concatenated packs), in order."""
    offset = 0
    while offset < len(data):
        position, _, count, length = _CARRIED_CLIP.unpack_from(data, offset)
        offset += _CARRIED_CLIP.size
        skip = data[offset: offset + length].decode()
        offset += length
        yield position, skip, np.frombuffer(data, np.int32, count, offset).copy()
        offset += 4 * count


def assemble_part(w: "PartWork", context: Context, stats: dict, meter: Meter) -> None:
    """The part's last unit (= its number of batches): carried clips -> sequences in cut order, the
    token cache, then finish. Runs on the commit thread, after every batch of the part."""
    from lhotse import CutSet

    from mmtok.formats.audio_cache import cache_path, write_cache

    part, shard, unit = w.open(), w.shard, w.num_batches
    stats = {**stats, "shard": shard.index, "duration": shard.duration}
    if part.next_unit > unit:  # assembled and committed before a kill; the cache was written before that commit
        w.finish({**stats, **timing_stats(part.counts)})
        return
    cuts = CutSet.from_file(shard.cuts_path).to_eager()
    carried = {position: (skip, ids) for position, skip, ids in unpack_clips(part.carry())}
    missing = [i for i in range(len(cuts)) if i not in carried]
    if missing:
        raise MmtokError(f"{part.directory}: clips {missing[:10]} were never committed; the part directory is "
                         "damaged -- delete it to re-encode this shard")
    sequences, provenance, rows, skipped = [], [], [], []
    counts = {"clips": len(cuts), "encoded": 0}

    def skip_clip(position: int, cut, skip: Skip) -> None:
        key = skips.count_key(skip.reason)
        counts[key] = counts.get(key, 0) + 1
        skipped.append(SkipRecord.of(skip, stage="encode", key=cut.id, source=str(shard.recording_path),
                                     container="shar", member=cut.id, position=position))

    numbers = clip_numbers(cuts, shard.index)
    for position, cut in enumerate(cuts):
        reason, audio_ids = carried[position]
        if reason:
            skip_clip(position, cut, Skip.parse(reason))
            continue
        counts["encoded"] += 1
        text_ids, language, target = clip_text(cut, context.tokenizer)
        check_clip_ids(context.builder.layout, audio_ids, text_ids, f"{part.directory}: clip {cut.id}")
        custom = cut.custom or {}
        made = sequences_for(context.sequences, context.builder, audio_ids, text_ids, is_translation(language, target))
        if not made:
            skip_clip(position, cut, Skip("no_text", f"--sequences {context.sequences}"))
        for kind, tokens in made:
            sequences.append(tokens)
            provenance.append({"cut_id": cut.id, "shard": shard.index, "position": position, "kind": kind,
                               "audio_tokens": int(audio_ids.size),
                               "text_tokens": None if text_ids is None else int(text_ids.size)})
            counts[f"sequences:{kind}"] = counts.get(f"sequences:{kind}", 0) + 1
        source_id, clip = numbers[position]
        rows.append({"cut_id": cut.id, "source_id": source_id, "clip": clip, "part": shard.index, "position": position,
                     "duration": float(cut.duration), "language": language, "target_language": target,
                     "audio_ids": audio_ids, "text_ids": text_ids, "source_sha256": custom.get(SOURCE_DIGEST)})
    write_cache(cache_path(context.out, shard.index), rows, {**context.cache_metadata, "part": shard.index})
    timing = meter.committed(0, sum(int(t.size) for t in sequences))
    part.commit(unit, sequences, provenance, {**counts, **timing}, carry_done=True, skipped=skipped)
    w.finish({**stats, **timing_stats(part.counts)})


def check_clip_ids(layout, audio_ids: np.ndarray, text_ids: np.ndarray | None, what: str) -> None:
    """The last guard before a clip's ids are committed: audio ids are audio ids, text ids (which a
    foreign Shar's `text_tokens` may hold) text ids; MmtokError naming the clip otherwise."""
    check_ids_in_range(audio_ids, layout.audio_offset, layout.total_size, f"{what}: audio ids")
    if text_ids is not None:
        check_ids_in_range(text_ids, 0, layout.text_size, f"{what}: text ids")


# --- the rank loop ------------------------------------------------------------------------------------

@dataclass
class PartWork:
    """One part still to do: its batches as loader requests, its writer lock (held for the whole run,
    so no other process writes the part meanwhile), and its PartWriter, which is opened only while the
    commit thread works on it (a rank may hold hundreds of shards: one descriptor each, not five)."""

    shard: SharShard
    directory: Path
    identity: dict
    num_batches: int
    requests: list[BatchRequest]
    lock: object
    part: object = None

    def open(self):
        from mmtok.formats.commitlog import PartWriter

        if self.part is None:
            self.part = PartWriter(self.directory, self.identity, lock=self.lock)
        return self.part

    def finish(self, stats: dict) -> None:
        self.open().finish(stats)
        self.close()

    def close(self) -> None:
        if self.part is not None:
            self.part.close()
            self.part = None


def open_parts(shards: list[SharShard], context: Context, batching: Batching, num_parts: int,
               min_samples: int) -> list[PartWork]:
    """Create or resume the part of each shard and list its remaining batches; finished parts are left out.
    Each listed part is locked until `release_parts` (a second process for the same part is refused)."""
    work: list[PartWork] = []
    try:
        for shard in shards:
            directory = part_dir(context.out, shard.index)
            if is_done(directory):  # finished: nothing to do, but only if made with these very settings
                check_identity(directory, audio_part_identity(shard, context, num_parts))
                continue
            lock = lock_part(directory)
            if is_done(directory):  # finished by another process just before we took the lock
                lock.release()
                continue
            work.append(_part_work(shard, directory, lock, context, batching, num_parts, min_samples))
    except BaseException:
        release_parts(work)
        raise
    return work


def release_parts(work: list[PartWork]) -> None:
    for w in work:
        w.close()
        w.lock.release()


def audio_part_identity(shard: SharShard, context: Context, num_parts: int) -> dict:
    """What the part of `shard` is made from (see PartWriter)."""
    return {**context.identity, "part": shard.index, "num_parts": num_parts, "part_shard": shard_fingerprint(shard)}


def _part_work(shard: SharShard, directory: Path, lock, context: Context, batching: Batching, num_parts: int,
               min_samples: int) -> PartWork:
    from lhotse import CutSet

    w = PartWork(shard, directory, None, 0, [], lock)
    try:
        verify_shard(shard)  # before any of its bytes is trusted: a changed shard is refused, naming the file
        w.identity = audio_part_identity(shard, context, num_parts)
        cuts = CutSet.from_file(shard.cuts_path).to_eager()
        batches = make_batches(cuts, batching)
        w.num_batches = len(batches)
        next_unit = w.open().next_unit  # checks the identity and the checksums, recovers from a kill
        w.close()
        members, damage = index_members(shard.recording_path)
        w.requests = [BatchRequest(shard.index, unit, str(shard.recording_path), tuple(positions),
                                   tuple(members.get(cuts[p].id, damage) for p in positions),
                                   tuple(float(cuts[p].duration) for p in positions), min_samples,
                                   batching.max_clip_duration)
                      for unit, positions in enumerate(batches) if unit >= next_unit]
    except BaseException:
        w.close()
        lock.release()
        raise
    return w


def build_context(out: Path, codec, tokenizer, sequences: str, batching: Batching,
                  report: ConversionReport | None) -> Context:
    from mmtok.vocab import VocabLayout

    if report is not None:
        difference = tokenizer_difference(report.identity["text_tokenizer"], tokenizer.describe())
        if difference:
            raise MmtokError(f"the Shar text was tokenized with another text tokenizer than --text-tokenizer: "
                             f"{difference}; pass the conversion's tokenizer")
    layout = VocabLayout(tokenizer.vocab_size)
    builder = SequenceBuilder(layout, tokenizer.bos_id, tokenizer.eos_id)
    preprocess = {"sample_rate": TARGET_SAMPLE_RATE, "peak_dbfs": PEAK_DBFS, "resampler": RESAMPLER,
                  "trim": trim_of(codec)}
    identity = {"modality": "audio", "tool": f"mmtok {__version__}", "codec": codec.describe(),
                "text_tokenizer": tokenizer.describe(), "vocab": layout.to_dict(), "sequences": sequences,
                "sequence_layout": builder.describe(), "batching": batching.to_dict(), "preprocess": preprocess,
                "conversion": None if report is None else {k: report.identity[k] for k in ("options", "storage")}}
    cache_metadata = {"num_parts": None, "vocab": layout.to_dict(), "text_tokenizer": tokenizer.describe(),
                      "codec": codec.describe(), "trim": trim_of(codec), "format": CACHE_FORMAT}
    return Context(out, builder, tokenizer, sequences, identity, cache_metadata)


def trim_of(codec) -> int:
    return int(codec.describe().get("trim", DEFAULT_TRIM))


@dataclass(frozen=True)
class AudioRun:
    """What `run_parts` did with some parts (a rank's own shards, or one shard it took over)."""

    batches: int
    clips: int
    skipped: dict[str, int]  # clips skipped, by reason
    uniform_codes: int  # batches whose every code was one value (`mmtok.encode.loop.uniform_codes`)
    wall_s: float
    device_busy_s: float
    loader_wait_s: float
    first_batch_s: float
    shards_to_do: int = 0  # the parts it was given
    unfinished: tuple[int, ...] = ()  # of those, the shards a stop request left unfinished

    @property
    def stopped(self) -> bool:
        return bool(self.unfinished)

    @property
    def already_done(self) -> bool:
        """Never: `take_items` offers no finished shard, and an own shard found finished is counted as encoded."""
        return False

    def plus(self, more: AudioRun) -> AudioRun:
        """Both summed (the rank's own `shards_to_do` and first batch kept)."""
        skipped = Counter(self.skipped) + Counter(more.skipped)
        return replace(self, batches=self.batches + more.batches, clips=self.clips + more.clips,
                       skipped=dict(sorted(skipped.items())), uniform_codes=self.uniform_codes + more.uniform_codes,
                       wall_s=self.wall_s + more.wall_s, device_busy_s=self.device_busy_s + more.device_busy_s,
                       loader_wait_s=self.loader_wait_s + more.loader_wait_s,
                       unfinished=self.unfinished + more.unfinished)

    def to_json(self) -> dict:
        return {"batches": self.batches, "clips": self.clips, "skipped": self.skipped,
                UNIFORM_CODES: self.uniform_codes, "wall_s": self.wall_s, "device_busy_s": self.device_busy_s,
                "loader_wait_s": self.loader_wait_s, "first_batch_s": self.first_batch_s,
                "shards_to_do": self.shards_to_do, "unfinished": list(self.unfinished)}


@dataclass(frozen=True)
class ShardStop:
    """Where a stop request left an audio rank: the signal and the shards it left unfinished."""

    signal: str
    shards: list[int]

    def to_json(self) -> dict:
        return {"signal": self.signal, "shards": self.shards}


@dataclass(frozen=True)
class AudioWorkerRun:
    """What an audio rank did (`encode_audio_rank`): its own shards' and the ones it took over, summed."""

    run: AudioRun
    rank: int
    world_size: int
    shards: list[int]  # its own (`assign_shards`)
    stopped: ShardStop | None
    take_over: TakeOver

    def to_json(self) -> dict:
        return {**self.run.to_json(), "rank": self.rank, "world_size": self.world_size, "shards": self.shards,
                "stopped": None if self.stopped is None else self.stopped.to_json(), **self.take_over.to_json()}


def encode_audio_rank(shar: Path, out: Path, codec, *, rank: int, world_size: int, batching: Batching,
                      sequences: str = DEFAULT_SEQUENCES, num_workers: int = 2, text_tokenizer: str = "tekken",
                      progress: bool = True, take_over: bool = True, stop=None) -> AudioWorkerRun:
    """Encode this rank's shards of `shar` (`assign_shards`) into OUT/parts (+ OUT/audio-cache), a part per shard;
    then, with `take_over`, every shard no process has finished or holds, one after another from the last
    (`mmtok.workers.take_items`): a shard is a work item. An own shard another process holds is left to
    it (without take-over: the error naming the holder). Once `stop` (a `mmtok.launch.StopRequest`) is set, the
    batches on the device are committed and the rank returns with those parts unfinished (`stopped`)."""
    from mmtok.text import load_text_tokenizer

    if sequences not in SEQUENCE_MODES:
        raise MmtokError(f"--sequences must be one of {', '.join(SEQUENCE_MODES)}, got {sequences!r}")
    if int(codec.sample_rate) != TARGET_SAMPLE_RATE:
        raise MmtokError(f"codec {codec.name} runs at {codec.sample_rate} Hz; Shar audio is {TARGET_SAMPLE_RATE} Hz")
    shards, report = discover_shards(shar)
    mine = assign_shards([s.duration for s in shards], world_size)[rank]
    context = build_context(out, codec, load_text_tokenizer(text_tokenizer), sequences, batching, report)
    context.cache_metadata["num_parts"] = len(shards)
    refuse_other_run(out, {**context.identity, "num_parts": len(shards)})
    stopping = stop_check(stop)
    min_samples = trim_of(codec) * int(codec.hop)

    def encode_parts(work: list[PartWork]) -> AudioRun:
        summary = run_parts(work, codec, context, num_workers=num_workers, progress=progress, stop=stopping)
        unfinished = tuple(w.shard.index for w in work if not is_done(w.directory))
        return replace(summary, shards_to_do=len(work), unfinished=unfinished)

    def open_shard(index: int) -> list[PartWork]:
        return open_parts([shards[index]], context, batching, len(shards), min_samples)

    own, held = [], []
    try:
        for index in mine:  # an own shard another process holds is its (take-over), else the error naming it
            try:
                own += open_shard(index)
            except LockHeld:
                if not take_over:
                    raise
                held.append(index)
    except BaseException:
        release_parts(own)
        raise
    summary = encode_parts(own)
    run = take_items(out, len(shards), [], take_over and not summary.stopped, stopping,
                     lambda index: encode_parts(open_shard(index)))
    for result in run.done:
        summary = summary.plus(result)
    stopped = None
    if summary.unfinished or run.stopped is not None:  # the shards it left unfinished, or the next it would take
        stopped = ShardStop(signal=stop.name,
                            shards=sorted({*summary.unfinished, *([] if run.stopped is None else [run.stopped])}))
    run.taken = [index for index in run.taken if index not in mine]  # an own shard freed by its holder is its own
    run.held += held
    return AudioWorkerRun(run=summary, rank=rank, world_size=world_size, shards=mine, stopped=stopped,
                          take_over=run.take_over(out))


def run_parts(work: list[PartWork], codec, context: Context, *, num_workers: int, progress: bool,
              stop=None) -> AudioRun:
    """Every remaining batch of `work` through the rank loop (mmtok.encode.loop): DataLoader workers
    load, the device encodes, the committer commits each batch's clips and assembles each finished part.
    Once `stop()` says so, no further batch is encoded (those encoded are committed)."""
    import torch

    from mmtok.progress import progress as progress_bar

    trim = trim_of(codec)
    requests = [r for w in work for r in w.requests]
    by_shard = {w.shard.index: w for w in work}
    device = codec.device
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before pinning: the pinned buffers' context belongs on this GPU
    loader = torch.utils.data.DataLoader(
        BatchDataset(), sampler=requests, batch_size=None, num_workers=num_workers,
        pin_memory=device.type == "cuda", worker_init_fn=_worker_init if num_workers else None,
        prefetch_factor=4 if num_workers else None)
    batches = iter(loader)  # forks the workers before any other thread of ours exists
    bar = progress_bar(total=sum(len(r.positions) for r in requests), unit="clip", desc="encode audio",
                       enabled=progress)
    meter, skipped, stats = Meter(bar, item="clip"), Counter(), {"num_workers": num_workers}
    flagged = Counter()

    def encode(batch: dict) -> list:
        results = encode_batch(codec, batch, device, trim, context.builder.layout)
        skipped.update(Skip.parse(reason).reason for _, reason, _ in results if reason)
        return results

    def commit(batch: dict, results: list) -> None:
        w = by_shard[batch["shard"]]
        flag = uniform_codes([ids for _, _, ids in results])
        flagged.update(flag)
        w.open().commit(batch["unit"], [], [], {**meter.committed(len(results), 0), **flag},
                        carry=pack_clips(results))
        if batch["unit"] == w.num_batches - 1:
            assemble_part(w, context, stats, meter)

    try:
        for w in work:  # parts whose batches were all committed before a kill: assemble right away
            if not w.requests:
                assemble_part(w, context, stats, meter)
        try:
            run_device(prefetched(batches), encode, commit, meter, depth=4, stop=stop)
        except Exception:
            if stop is None or not stop():
                raise  # a stop's TERM may have reached the loader's workers first: what was committed stands
    finally:
        bar.close()
        release_parts(work)
    wall = time.perf_counter() - meter.started
    return AudioRun(batches=len(requests), clips=meter.items, skipped=dict(sorted(skipped.items())),
                    uniform_codes=flagged[UNIFORM_CODES], wall_s=wall, device_busy_s=meter.busy,
                    loader_wait_s=meter.waited, first_batch_s=meter.fill_seconds)


PREFETCH_JOIN_S = 10.0  # how long a stopped device loop waits for the prefetch thread's batch in flight


def prefetched(batches, depth: int = 2) -> Iterator[dict]:
    """The batches, taken from the DataLoader by a thread (unpickling, shared-memory rebuild and pinning
    overlap the device's work); the loader's exception is re-raised here."""
    ready: queue.Queue = queue.Queue(depth)
    closed = threading.Event()  # the device loop stopped early (a stop request, an error): stop filling

    def put(item) -> None:
        while not closed.is_set():
            try:
                ready.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def fill() -> None:
        try:
            for batch in batches:
                put(batch)
                if closed.is_set():
                    return  # the loader (and its worker processes) can go now
        except BaseException as err:  # handed to the device loop, which re-raises it
            put(err)
            return
        put(None)

    filler = threading.Thread(target=fill, name="mmtok-prefetch", daemon=True)
    filler.start()
    try:
        while (batch := ready.get()) is not None:
            if isinstance(batch, BaseException):
                raise batch
            yield batch
    finally:
        closed.set()
        # The filler ends once the batch it is loading arrives. Left running, it may still be inside the loader's C++
        # code when the interpreter exits, which then aborts (exit 134, "terminate called without an active
        # exception") after a stop had committed everything: wait for it, a bounded time (a stop has a deadline).
        filler.join(PREFETCH_JOIN_S)


def encode_batch(codec, batch: dict, device, trim: int, layout) -> list[tuple[int, str, np.ndarray | None]]:
    """Encode one loaded batch; (position, reason, audio ids) for every clip of the batch."""
    results = [(position, reason, None) for position, reason in batch["skipped"]]
    if batch["positions"]:
        wave = batch["wave"].to(device, non_blocking=True)
        codes, counts = codec.encode(wave, batch["lengths"].to(device))
        codes, counts = codes.cpu().numpy(), counts.cpu().numpy()
        for row, position in enumerate(batch["positions"]):
            keep = int(counts[row]) - trim
            check_ids_in_range(codes[row, :keep], 0, codec.codebook_size, f"codec {codec.name}: the codes of a clip")
            results.append((position, "", layout.audio_ids(codes[row, :keep])))
    return results
