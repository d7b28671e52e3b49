"""`mmtok audio interleave`: per-clip token cache -> interleaved speech/text Megatron datasets.

Definition (every rule here is tested):
* Clips are grouped by source id (recording); sources are taken in order of their first clip in the
  cache (part order, then cut order), a source's clips in clip-number order. A clip number seen
  twice in one source keeps its first clip (`duplicate_clip` for the others).
* Usable as text: a clip with text ids that are a transcript (not a translation). Clips without
  text are skipped (`no_text`); a translation clip becomes one translation sequence.
* A *run* is a maximal stretch of usable clips c_0 .. c_{m-1} with consecutive clip numbers; any gap
  (a dropped, skipped or translation clip) ends the run.
* m = 1: one transcription sequence. m = 2: two transcription sequences (two copies that both end
  with text cannot be built from two clips without dropping one clip's text).
* m >= 3: copy 1 alternates A(c_0) T(c_1) A(c_2) ... and copy 2 starts one clip apart in the
  alternation, T(c_0) A(c_1) T(c_2) ..., so every clip is audio in one copy and text in the other.
  Each copy ends with text, so the copy in which c_{m-1} would be audio stops at c_{m-2}; that
  leftover clip c_{m-1} gets a transcription sequence (its audio appears there, its text appears
  both there and in the other copy). Output order per run: copy 1, copy 2, leftover.
* Token layout and BOS/EOS placement: see mmtok.documents (one BOS first, one EOS last).
* Routing: a sequence of at most --stage-max-tokens goes to OUT/stage; a longer one to
  OUT/long-context. A sequence over --max-tokens is first split greedily at clip boundaries into
  pieces of at most --max-tokens that each end with text (each piece is a sequence with its own
  BOS/EOS and is routed by its own length). A segment that cannot end any piece within the limit is
  skipped (`over_max_tokens`).
* A set that receives no sequence is not written (megatron-core cannot open an empty dataset): no
  OUT/<set>.bin/.idx, a stale one from an earlier run is removed, and interleave.json's
  `datasets[<set>]` says `"written": false` with the reason. When neither set gets a sequence the
  command fails (MmtokError naming the skips) and leaves OUT as it was.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from mmtok import __version__
from mmtok.documents import AUDIO, TEXT, SequenceBuilder, is_translation
from mmtok.formats import skips
from mmtok.formats.audio_cache import find_cache_parts, read_cache_index, read_metadata, read_tokens, recorded_sha256
from mmtok.formats.interleave import (
    LONG_MAX_TOKENS,
    METADATA_FILE,
    STAGE_MAX_TOKENS,
    DatasetEntry,
    InterleaveSummary,
)
from mmtok.formats.megatron import DatasetWriter, remove_dataset
from mmtok.vocab import VocabLayout

STAGE, LONG = "stage", "long-context"
FIXES = {"no_text": "convert the clips with their text (--transcripts, a text column or sidecar)",
         "over_max_tokens": "raise --max-tokens"}


@dataclass(frozen=True)
class ClipRef:
    """Where a clip's tokens are (cache part, row) and what the plan needs to know about it."""

    part: int
    row: int
    source_id: str
    clip: int
    audio_length: int
    text_length: int  # -1: no text
    translation: bool


@dataclass
class Planned:
    """One sequence to build: 'interleaved' segments, or a single-clip 'transcription'/'translation'."""

    kind: str
    segments: list[tuple[str, ClipRef]]


def load_clips(parts: list[Path]) -> list[ClipRef]:
    clips = []
    for part, path in enumerate(parts):
        table = read_cache_index(path).to_pydict()
        for row in range(len(table["cut_id"])):
            clips.append(ClipRef(part, row, table["source_id"][row], int(table["clip"][row]),
                                 int(table["audio_length"][row]), int(table["text_length"][row]),
                                 is_translation(table["language"][row], table["target_language"][row])))
    return clips


def runs_of(source_clips: list[ClipRef], counts: Counter) -> Iterator[list[ClipRef] | ClipRef]:
    """A source's runs (lists) and its single translation clips, in clip-number order."""
    run: list[ClipRef] = []
    seen: set[int] = set()
    for clip in sorted(source_clips, key=lambda c: c.clip):
        if clip.clip in seen:
            counts[skips.count_key("duplicate_clip")] += 1
            continue
        seen.add(clip.clip)
        if clip.text_length <= 0:
            counts[skips.count_key("no_text")] += 1
            continue
        if clip.translation:
            yield clip
            continue
        if run and clip.clip != run[-1].clip + 1:
            yield run
            run = []
        run.append(clip)
    if run:
        yield run


def plan_run(run: list[ClipRef]) -> list[Planned]:
    """The sequences of one run (see the module docstring)."""
    if len(run) <= 2:
        return [Planned("transcription", [(AUDIO, c), (TEXT, c)]) for c in run]
    m = len(run)
    copy1 = [(AUDIO if i % 2 == 0 else TEXT, run[i]) for i in range(m if m % 2 == 0 else m - 1)]
    copy2 = [(TEXT if i % 2 == 0 else AUDIO, run[i]) for i in range(m if m % 2 == 1 else m - 1)]
    leftover = run[-1]
    return [Planned("interleaved", copy1), Planned("interleaved", copy2),
            Planned("transcription", [(AUDIO, leftover), (TEXT, leftover)])]


def plan(clips: list[ClipRef], counts: Counter) -> Iterator[Planned]:
    """Every planned sequence, sources in first-appearance order."""
    sources: OrderedDict[str, list[ClipRef]] = OrderedDict()
    for clip in clips:
        sources.setdefault(clip.source_id, []).append(clip)
    for source_clips in sources.values():
        for item in runs_of(source_clips, counts):
            if isinstance(item, ClipRef):
                counts["translations"] += 1
                yield Planned("translation", [(AUDIO, item), (TEXT, item)])
                continue
            counts[f"runs_of_{min(len(item), 3)}{'+' if len(item) >= 3 else ''}"] += 1
            yield from plan_run(item)


def segment_length(segment: tuple[str, ClipRef]) -> int:
    kind, clip = segment
    return SequenceBuilder.segment_length(kind, clip.audio_length if kind == AUDIO else clip.text_length)


def split_greedy(segments: list[tuple[str, ClipRef]], max_tokens: int, counts: Counter) -> list[list]:
    """Pieces of an interleaved segment list, each ending with text and at most `max_tokens` long."""
    lengths = [segment_length(s) for s in segments]
    pieces, start = [], 0
    while start < len(segments):
        best, total = None, 2  # BOS + EOS
        for end in range(start, len(segments)):
            total += lengths[end] + (end > start)
            if total > max_tokens:
                break
            if segments[end][0] == TEXT:
                best = end
        if best is None:
            counts[skips.count_key("over_max_tokens")] += 1
            start += 1
            continue
        pieces.append(segments[start:best + 1])
        start = best + 1
    return pieces


class TokenSource:
    """Token arrays of cache rows, keeping a few parts in memory (runs rarely span more than two)."""

    def __init__(self, parts: list[Path], layout: VocabLayout, keep: int = 4):
        self.parts, self.layout, self.keep = parts, layout, keep
        self.loaded: OrderedDict[int, tuple[list, list]] = OrderedDict()

    def get(self, clip: ClipRef) -> tuple[np.ndarray, np.ndarray | None]:
        if clip.part not in self.loaded:
            self.loaded[clip.part] = read_tokens(self.parts[clip.part], self.layout)  # ids checked: the last guard
            if len(self.loaded) > self.keep:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(clip.part)
        audio, text = self.loaded[clip.part]
        return audio[clip.row], text[clip.row]


def build(planned: Planned, builder: SequenceBuilder, tokens: TokenSource) -> np.ndarray:
    if planned.kind == "interleaved":
        segments = []
        for kind, clip in planned.segments:
            audio, text = tokens.get(clip)
            segments.append((kind, audio if kind == AUDIO else text))
        return builder.interleaved(segments)
    clip = planned.segments[0][1]
    audio, text = tokens.get(clip)
    return builder.transcription(audio, text, translate=planned.kind == "translation")


def interleave(encoded: Path, out: Path, *, stage_max_tokens: int = STAGE_MAX_TOKENS,
               max_tokens: int = LONG_MAX_TOKENS,
               progress: bool = True) -> InterleaveSummary:
    """Write OUT/stage and OUT/long-context (Megatron) from ENCODED's token cache; returns the summary.

    Only sets that receive a sequence are written (see the module docstring); with no sequence at
    all nothing in OUT is touched and MmtokError says why.
    """
    from mmtok.errors import MmtokError
    from mmtok.progress import progress as progress_bar

    if not 0 < stage_max_tokens <= max_tokens:
        raise MmtokError(f"need 0 < --stage-max-tokens ({stage_max_tokens}) <= --max-tokens ({max_tokens})")
    parts = find_cache_parts(encoded)
    meta = read_metadata(parts[0])
    layout = VocabLayout(meta["vocab"]["text_size"])
    builder = SequenceBuilder(layout, meta["text_tokenizer"]["bos_id"], meta["text_tokenizer"]["eos_id"])
    clips = load_clips(parts)
    counts: Counter = Counter(clips=len(clips))
    tokens = TokenSource(parts, layout)
    writers: dict[str, DatasetWriter] = {}  # opened by a set's first sequence: an empty set leaves no file
    try:
        for planned in progress_bar(plan(clips, counts), desc="audio interleave", unit="seq", enabled=progress):
            pieces = [planned.segments]
            if planned.kind == "interleaved":
                total = SequenceBuilder.interleaved_length([segment_length(s) for s in planned.segments])
                if total > max_tokens:
                    pieces = split_greedy(planned.segments, max_tokens, counts)
                    counts["split_sequences"] += 1
            for piece in pieces:
                sequence = build(Planned(planned.kind, piece), builder, tokens)
                target = STAGE if sequence.size <= stage_max_tokens else LONG
                if target not in writers:
                    writers[target] = DatasetWriter(out / target)
                writers[target].add(sequence)
                counts[f"{target}:{planned.kind}"] += 1
                counts[f"{target}:tokens"] += int(sequence.size)
    except BaseException:
        for writer in writers.values():
            writer.abort()
        raise
    if not writers:
        raise MmtokError(_nothing_message(encoded, out, counts))
    datasets = {name: _dataset_entry(name, counts, stage_max_tokens, name in writers) for name in (STAGE, LONG)}
    METADATA_FILE.remove(out)
    for writer in writers.values():
        writer.close()
    for name in (STAGE, LONG):
        if name not in writers:
            remove_dataset(out / name)  # a stale set from an earlier run must not look like this run's
    summary = InterleaveSummary(
        tool=f"mmtok {__version__}", input=str(encoded.resolve()),
        cache=[{"part": i, "sha256": recorded_sha256(p)} for i, p in enumerate(parts)],  # verified
        parameters={"stage_max_tokens": stage_max_tokens, "max_tokens": max_tokens}, vocab=meta["vocab"],
        text_tokenizer=meta["text_tokenizer"], codec=meta["codec"], sequences=builder.describe(), datasets=datasets,
        counts=dict(sorted(counts.items())))
    METADATA_FILE.write(out, summary.to_json())
    return summary


def _dataset_entry(name: str, counts: Counter, stage_max_tokens: int, written: bool) -> DatasetEntry:
    """The entry of set `name`: whether OUT/name.bin/.idx exists, its size, or why not."""
    sequences = sum(v for k, v in counts.items() if k.startswith(f"{name}:") and not k.endswith(":tokens"))
    limit = f"{stage_max_tokens:,} tokens"
    reason = None if written else f"no sequence over {limit}" if name == LONG else f"no sequence of at most {limit}"
    return DatasetEntry(written, sequences, counts.get(f"{name}:tokens", 0), reason)


def _nothing_message(encoded: Path, out: Path, counts: Counter) -> str:
    skipped = skips.by_reason(counts)
    if not counts["clips"]:
        why = "its token cache holds no clips"
    else:
        why = f"none of its {counts['clips']} clips gave a sequence (skipped: " + ", ".join(
            f"{k}={v}" for k, v in skipped.items()) + ")"
    fixes = [FIXES[k] for k in skipped if k in FIXES]
    return (f"{encoded}: no sequence to interleave: {why}; nothing written to {out}"
            + (f"; to fix: {'; '.join(fixes)}" if fixes else ""))
