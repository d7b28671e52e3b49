"""Merge the finished parts of an encode output into one Megatron dataset (and a no-reasoning copy).

`merge(out)` requires parts 0..num_parts-1 under `OUT/parts/` to be finished (DONE), joins them in
part order (bytes copied, pointers rebuilt) into `OUT/merged.bin/.idx`, concatenates their
provenance into `OUT/merged.provenance.jsonl`, then appends the documents of several images, assembled
from the parts' items in document order (`mmtok.merge.assemble`), sums the stats into `OUT/merged.json` (written
last: its presence means the merge completed) and verifies the result with megatron-core's
`IndexedDataset`. Before anything is copied every part is checked against the checksums of its
commit log (`commitlog.verify_part`): a damaged part is refused naming the part and the unit. The
parts' skip lists are joined into `OUT/merged.skipped.jsonl` (one `mmtok.formats.skips` record per input
that did not become tokens), counted by reason in merged.json. Parts without tokens
have no dataset and are left out; when no part has a token, no merged dataset is written (an empty
one would not open in megatron-core) and merged.json says `"dataset": false`. One merge writes an
output at a time (`OUT/.lock`). Parts hold contiguous ranges of a fixed global work order, so the merged bytes do
not depend on how many parts (ranks) produced them.

`strip_reasoning=True` also writes `OUT/merged_no_reasoning.*`: every reasoning span removed,
under these rules (ids looked up by name in the text tokenizer recorded in the parts):
  * a span runs from `<|inner_prefix|>` to the next `<|inner_suffix|>`, both markers included; a
    prefix inside an open span is part of that span (spans do not nest);
  * an orphan prefix (no suffix before the turn ends) removes everything up to, not including, the
    next `<|assistant_end|>` -- or, without one, up to the end of the sequence, keeping a final EOS;
  * an orphan suffix (no open span) is removed alone;
  * a sequence left with nothing but BOS/EOS is dropped and counted.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats import partdir
from mmtok.formats.items import refuse_changed_containers
from mmtok.formats.megatron import bin_path, concatenate, read_index, remove_dataset, verify_merged, write_index
from mmtok.formats.merged import (
    MERGED,
    NO_REASONING,
    PROVENANCE_SUFFIX,
    SKIPPED_SUFFIX,
    SUMMARY_FILE,
    AssembledFigures,
    MergeSummary,
)
from mmtok.formats.parts import Part, find_parts, read_part_json, shared_identity, timing_stats
from mmtok.fsutil import WriterLock, atomic_writer, copy_file_into, required
from mmtok.merge.assemble import assemble_documents

ASSEMBLED = ".assembled"  # the assembled documents' dataset, joined after the parts' sequences, then removed
REASONING_MARKERS = ("<|inner_prefix|>", "<|inner_suffix|>")
TURN_END = "<|assistant_end|>"
BLOCK_TOKENS = 1 << 24  # strip-reasoning works through the merged tokens in blocks of about this size


def merge(out: str | os.PathLike, *, strip_reasoning: bool = False, progress: bool = False) -> MergeSummary:
    """Merge the parts of `out`; returns the summary written to `OUT/merged.json`."""
    out = Path(out)
    with WriterLock(out, f"merge output {out}"):
        _refuse_sft_images(out)  # said before find_parts reads every byte of the parts
        parts = find_parts(out, progress)
        refuse_changed_containers([part.identity for part in parts])  # before anything is written
        # Whether the run can strip is decided before anything is written: a refusal keeps the last merge.
        ids = reasoning_ids(parts[0].identity, parts[0].directory / partdir.IDENTITY) if strip_reasoning else None
        SUMMARY_FILE.remove(out)
        counts, per_part = _part_figures(parts)
        prefixes = [partdir.part_prefix(part.directory) for part in parts if partdir.has_dataset(part.directory)]
        with atomic_writer(out / (MERGED + PROVENANCE_SUFFIX)) as provenance, \
                atomic_writer(out / (MERGED + SKIPPED_SUFFIX)) as skipped:
            _copy_files([part.directory / partdir.PROVENANCE for part in parts], provenance)
            _copy_files([part.directory / partdir.SKIPPED for part in parts], skipped)
            assembled = assemble_documents([part.directory for part in parts], out / ASSEMBLED, provenance, skipped,
                                           progress)
        if assembled.dataset:
            prefixes.append(out / ASSEMBLED)
        try:
            if prefixes:
                sequences = concatenate(prefixes, out / MERGED)
                verified_with = verify_merged(out / MERGED, prefixes)
            else:
                remove_dataset(out / MERGED)
                sequences, verified_with = 0, None
        finally:
            remove_dataset(out / ASSEMBLED)
        for key, value in assembled.counts.items():  # the assembly's counts are the run's too
            counts[key] = counts.get(key, 0) + value
        summary = MergeSummary(
            identity=shared_identity(parts[0].identity), num_parts=len(parts),
            tokens=sum(p["tokens"] for p in per_part) + assembled.counts.get("tokens", 0),
            counts=dict(sorted(counts.items())), parts=per_part,
            assembled=AssembledFigures(assembled.counts.get("documents_written", 0),
                                       assembled.counts.get("documents_skipped", 0), assembled.counts.get("tokens", 0)),
            skipped_file=MERGED + SKIPPED_SUFFIX, sequences=sequences, dataset=bool(prefixes),
            verified_with=verified_with,
            strip_reasoning=write_stripped(out, ids, bool(prefixes)) if strip_reasoning else None)
        SUMMARY_FILE.write(out, summary.to_json())
    return summary


def _refuse_sft_images(out: Path) -> None:
    """The images of a `--mode sft` plan are items for `mmtok sft`, not documents: say what to run."""
    first = next((d for _, d in partdir.part_directories(out) if (d / partdir.IDENTITY).is_file()), None)
    identity = read_part_json(first / partdir.IDENTITY, partdir.read_identity, first) if first else {}
    if identity.get("modality") == "image" and identity.get("mode") == "sft":
        raise MmtokError(f"{out} holds the encoded images of SFT conversations (plan mode sft); the conversations "
                         f"are made by `mmtok sft CONVERSATIONS --text-tokenizer DIR --images {out} [--audio ENC] "
                         "--out SFT`, then `mmtok merge SFT`")


def _copy_files(sources: list[Path], handle) -> None:
    for source in sources:
        if source.is_file():  # a part without skips may have no skip list
            copy_file_into(source, handle)


def _part_figures(parts: list[Part]) -> tuple[dict[str, int], list[dict]]:
    """(summed counters, per-part figures), from the checksummed commit records (not stats.json)."""
    counts: dict[str, int] = {}
    per_part = []
    for part in parts:
        part_records = part.records
        part_counts = part_records[-1]["counts"] if part_records else {}
        for key, value in part_counts.items():
            counts[key] = counts.get(key, 0) + value
        lengths = [n for record in part_records for n in record["lengths"]]
        per_part.append({"part": part.number, "sequences": len(lengths), "tokens": sum(lengths),
                         "dataset": partdir.has_dataset(part.directory),
                         **{k: v for k, v in timing_stats(part_counts).items() if k in ("wall_s", "device_busy_s")}})
    return counts, per_part


# -- strip reasoning ------------------------------------------------------------------------------
@dataclass(frozen=True)
class ReasoningIds:
    prefix: int
    suffix: int
    turn_end: int | None
    bos: int
    eos: int


def reasoning_ids(identity: dict, path: Path) -> ReasoningIds:
    """Marker ids recorded in a part identity (`path`) by encode (looked up by name in its text tokenizer)."""
    special = required(identity, "text_special_ids", dict, path, default={})
    tokenizer = required(identity, "text_tokenizer", dict, path, default={})
    absent = [name for name in REASONING_MARKERS if name not in special]
    if absent:
        raise MmtokError(f"--strip-reasoning: the text tokenizer of this run ({tokenizer.get('name', '?')}) has no "
                         f"{' / '.join(absent)} token, so its sequences cannot hold reasoning spans")
    return ReasoningIds(required(special, "<|inner_prefix|>", int, path),
                        required(special, "<|inner_suffix|>", int, path),
                        required(special, TURN_END, int, path, default=None), required(tokenizer, "bos_id", int, path),
                        required(tokenizer, "eos_id", int, path))


def strip_sequence(tokens: np.ndarray, ids: ReasoningIds, stats: dict[str, int]) -> np.ndarray:
    """A boolean keep-mask for one sequence under the module's rules; updates `stats`."""
    keep = np.ones(tokens.size, dtype=bool)
    open_at = None
    for position in np.flatnonzero(np.isin(tokens, [ids.prefix, ids.suffix, -1 if ids.turn_end is None
                                                    else ids.turn_end])):
        token = tokens[position]
        if token == ids.prefix and open_at is None:
            open_at = position
        elif token == ids.suffix and open_at is None:
            keep[position] = False
            stats["orphan_suffixes"] += 1
        elif token == ids.suffix:
            keep[open_at : position + 1] = False
            stats["spans_removed"] += 1
            open_at = None
        elif token == ids.turn_end and open_at is not None:
            keep[open_at:position] = False
            stats["orphan_prefixes"] += 1
            open_at = None
    if open_at is not None:
        end = tokens.size - 1 if tokens.size and tokens[-1] == ids.eos else tokens.size
        keep[open_at:end] = False
        stats["orphan_prefixes"] += 1
    return keep


def write_stripped(out: Path, ids: ReasoningIds, has_merged: bool = True) -> dict[str, int]:
    """Write `OUT/merged_no_reasoning.*` from `OUT/merged.*`; returns what was removed. Like the merged
    dataset, the copy is not written (and `dataset` is False) when no token is left."""
    if not has_merged:
        remove_dataset(out / NO_REASONING)
        _filter_lines(out / (MERGED + PROVENANCE_SUFFIX), out / (NO_REASONING + PROVENANCE_SUFFIX), np.zeros(0, bool))
        return {"sequences": 0, "dataset": False}
    dtype, lengths, pointers, _ = read_index(out / MERGED)
    stats = dict.fromkeys(("spans_removed", "orphan_prefixes", "orphan_suffixes", "reasoning_tokens_removed",
                           "sequences_changed", "dropped_empty_sequences"), 0)
    tokens = np.memmap(bin_path(out / MERGED), dtype=dtype, mode="r") if lengths.sum() else np.zeros(0, dtype)
    starts = pointers // dtype.itemsize
    kept_lengths, kept_sequences = [], []
    with atomic_writer(bin_path(out / NO_REASONING)) as handle:
        for first, last in _blocks(lengths):
            base = int(starts[first])
            block = np.asarray(tokens[base : int(starts[last - 1] + lengths[last - 1])])
            keep, block_lengths, block_kept = _strip_block(block, starts[first:last] - base, ids, stats)
            handle.write(block[keep].tobytes())
            kept_lengths.append(block_lengths)
            kept_sequences.append(block_kept + first)
    kept_lengths = np.concatenate(kept_lengths) if kept_lengths else np.zeros(0, np.int64)
    stats["dataset"] = bool(kept_lengths.sum())
    if stats["dataset"]:
        write_index(out / NO_REASONING, kept_lengths, dtype)
    else:
        remove_dataset(out / NO_REASONING)
    kept = np.zeros(lengths.size, dtype=bool)
    if kept_sequences:
        kept[np.concatenate(kept_sequences)] = True
    _filter_lines(out / (MERGED + PROVENANCE_SUFFIX), out / (NO_REASONING + PROVENANCE_SUFFIX), kept)
    stats["sequences"] = int(kept_lengths.size)
    return stats


def _blocks(lengths: np.ndarray) -> list[tuple[int, int]]:
    """[first, last) sequence ranges of about BLOCK_TOKENS tokens each (at least one sequence)."""
    ends = np.cumsum(lengths, dtype=np.int64)
    blocks, first = [], 0
    while first < lengths.size:
        budget = (ends[first - 1] if first else 0) + BLOCK_TOKENS
        last = max(first + 1, int(np.searchsorted(ends, budget, side="right")))
        blocks.append((first, last))
        first = last
    return blocks


def _strip_block(block: np.ndarray, offsets: np.ndarray, ids: ReasoningIds,
                 stats: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(token keep-mask, lengths of the kept sequences, local indices of the kept sequences)."""
    bounds = np.append(offsets, block.size).astype(np.int64)
    keep = np.ones(block.size, dtype=bool)
    marker_at = np.flatnonzero(np.isin(block, [ids.prefix, ids.suffix]))
    for local in np.unique(np.searchsorted(bounds, marker_at, side="right") - 1):
        lo, hi = bounds[local], bounds[local + 1]
        keep[lo:hi] = strip_sequence(block[lo:hi], ids, stats)
        stats["sequences_changed"] += 1
    stats["reasoning_tokens_removed"] += int(block.size - keep.sum())
    kept = _per_sequence(keep, bounds)
    content = _per_sequence(keep & ~np.isin(block, [ids.bos, ids.eos]), bounds)
    empty = np.flatnonzero(content == 0)
    for local in empty:
        keep[bounds[local] : bounds[local + 1]] = False
    stats["dropped_empty_sequences"] += int(empty.size)
    survivors = np.flatnonzero(content > 0)
    return keep, kept[survivors], survivors


def _per_sequence(mask: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Number of True entries of `mask` in each [bounds[i], bounds[i+1]) range."""
    cumulative = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    return cumulative[bounds[1:]] - cumulative[bounds[:-1]]


def _filter_lines(source: Path, target: Path, keep: np.ndarray) -> None:
    with open(source, "rb") as lines, atomic_writer(target) as handle:
        for index, line in enumerate(lines):
            if keep[index]:
                handle.write(line)
