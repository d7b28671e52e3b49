"""Merge throughput vs `cat` of the same `.bin` files, and the cost of assembling multi-image documents.

    python benchmarks/bench_merge.py [--parts 8] [--mib-per-part 256] [--repeats 3] [--dir DIR]
                                     [--documents 30000] [--document-parts 3]     # ~3.5 min here

Writes --parts finished parts (PartWriter, int32 tokens of random lengths 64..8192) under DIR, then
times, alternating and --repeats times each:
  cat       `cat parts/*/tokens.bin > cat.bin` (GNU coreutils; copy_file_range where the kernel allows)
  cat+fsync the same, then fsync: durable like the merge's outputs (atomic writes fsync before rename)
  concat    the merge's data path: `mmtok.formats.megatron.concatenate` (bytes copied with
            copy_file_range, pointers rebuilt, fsynced and renamed into place); also timed with
            fsync disabled, to show the copy path alone against `cat`
  merge     `mmtok.merge.merge.merge(OUT)`: concatenate + provenance + stats + megatron-core verification
            (the verification's one-off import of megatron-core is timed separately and excluded)
Throughput is GB of tokens.bin per second, best of the repeats (page cache warm for all: the files
were just written).

Assembly vs copy: --documents interleaved documents of 2-20 images (uniform), each image a real
Emu3.5 512² block (32x32 codes + row separators + dimension digits: 1,065 tokens with tekken; one of
64 built from random codes), and 16-256 text tokens before every image and after the last, written
twice over --document-parts parts:
  items     as encode writes them now: each image an image item (`kind: image` + the sample fields)
            on a random part, shuffled within the part as shape-sorted batches scatter them, and the
            document's template item (`kind: template`, `layout` from `pack_template`) on the part of
            its first image; no part has a token of its own -- merge assembles every document
  plain     the same documents already assembled, one sequence each, in document order (what merge
            copies when encode wrote whole documents)
and timed, alternating, --repeats times each: `mmtok.merge.assemble.assemble_documents` (items -> one
dataset, durable) vs `concatenate` of the plain parts (the copy path, durable), both also with fsync
disabled, and `merge` of each output. Tokens per second of the same tokens, and their ratio, by wall
time and by this process's CPU time (user + system: copy_file_range runs in the kernel on the
process's behalf), each the best of the repeats. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from mmtok.documents import DocumentBuilder, pack_template
from mmtok.formats.commitlog import PartWriter
from mmtok.formats.megatron import bin_path, concatenate
from mmtok.formats.partdir import part_dir, part_prefix
from mmtok.merge.assemble import assemble_documents
from mmtok.merge.merge import merge

IMAGE_CODES = (32, 32)  # a 512² image under Emu3.5's 16x IBQ
UNIT_ITEMS = 1024  # items per committed unit of an item part (a few batches: fewer fsyncs while writing;
                  # merge reads items.jsonl and items.ids whole, so the unit size does not change its cost)
DISTINCT_BLOCKS = 64  # real image blocks drawn from (building one per image would dominate the setup time)


def write_parts(out: Path, parts: int, mib: int, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    total = 0
    for number in range(parts):
        shard = PartWriter(part_dir(out, number), {"part": number, "num_parts": parts, "bench": True})
        remaining = mib << 18  # int32 tokens
        unit = 0
        while remaining > 0:
            lengths = rng.integers(64, 8192, 256)
            lengths = lengths[np.cumsum(lengths) <= remaining] if lengths.sum() > remaining else lengths
            if not lengths.size:
                break
            tokens = rng.integers(0, 266_440, int(lengths.sum()), dtype=np.int32)
            sequences = np.split(tokens, np.cumsum(lengths)[:-1])
            shard.commit(unit, sequences, [{"n": i} for i in range(len(sequences))], {"written": len(sequences)})
            remaining -= int(lengths.sum())
            unit += 1
        shard.finish({})
        total += bin_path(part_prefix(shard.directory)).stat().st_size
    return total


def write_document_parts(items_out: Path, plain_out: Path, parts: int, documents: int,
                         seed: int = 0) -> tuple[int, int]:
    """The same multi-image documents as two encode outputs (see the module docstring): item parts
    under `items_out`, parts of whole sequences under `plain_out`. Returns (tokens, images)."""
    from mmtok.text import load_text_tokenizer
    from mmtok.vocab import VocabLayout

    rng = np.random.default_rng(seed)
    tokenizer = load_text_tokenizer("tekken")
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    dims = tokenizer.encode(f"{IMAGE_CODES[0]}*{IMAGE_CODES[1]}")
    bos, eos = np.array([tokenizer.bos_id], np.int32), np.array([tokenizer.eos_id], np.int32)
    pool = [layout.image_block(rng.integers(0, layout.image_codebook, IMAGE_CODES), dims)
            for _ in range(DISTINCT_BLOCKS)]
    identity = {"num_parts": parts, "bench": True}
    item_parts = [PartWriter(part_dir(items_out, n), {**identity, "part": n}) for n in range(parts)]
    plain_parts = [PartWriter(part_dir(plain_out, n), {**identity, "part": n}) for n in range(parts)]
    item_units, plain_units = [0] * parts, [0] * parts
    tokens = images = row = 0
    chunk = 512  # documents generated at a time; each part's items of a chunk are shuffled, then committed
    for first in range(0, documents, chunk):
        items: list[list[tuple[dict, np.ndarray]]] = [[] for _ in range(parts)]
        sequences: list[list[tuple[np.ndarray, dict]]] = [[] for _ in range(parts)]  # with provenance
        for document in range(first, min(first + chunk, documents)):
            count = int(rng.integers(2, 21))
            texts = [rng.integers(1000, tokenizer.vocab_size, int(n), dtype=np.int32)
                     for n in rng.integers(16, 257, count + 1)]
            template = [bos, *[piece for i in range(count) for piece in (texts[i], i)], texts[-1], eos]
            blocks = {i: pool[k] for i, k in enumerate(rng.integers(0, DISTINCT_BLOCKS, count))}
            home = rng.integers(0, parts, count)
            sample = {"key": f"{document:010d}", "source": "/data/shards/shard-000000.tar", "container": "tar"}
            for i, block in blocks.items():
                items[home[i]].append(({"kind": "image", **sample, "member": f"{document:010d}.{i}.jpg",
                                        "manifest_row": row + i, "document": document, "image_index": i}, block))
            ids, packed = pack_template(template)
            items[home[0]].append(({"kind": "template", "document": document, "key": sample["key"],
                                    "tar": sample["source"], "num_images": count, "layout": packed}, ids))
            sequence = DocumentBuilder.assemble(template, blocks)
            sequences[document * parts // documents].append((sequence, {
                "document": document, "key": sample["key"], "tar": sample["source"],
                "rows": list(range(row, row + count))}))
            tokens, images, row = tokens + sequence.size, images + count, row + count
        for number in range(parts):
            if sequences[number]:
                arrays, provenance = zip(*sequences[number], strict=True)
                plain_parts[number].commit(plain_units[number], list(arrays), list(provenance),
                                           {"written": len(arrays)})
                plain_units[number] += 1
            shuffled = [items[number][k] for k in rng.permutation(len(items[number]))]
            for start in range(0, len(shuffled), UNIT_ITEMS):
                unit = shuffled[start:start + UNIT_ITEMS]
                item_parts[number].commit(item_units[number], [], [], {"deferred": len(unit)}, items=unit)
                item_units[number] += 1
    for part in item_parts + plain_parts:
        part.finish({})
    return tokens, images


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def without_fsync(function):
    """`function` with os.fsync a no-op while it runs (the copy or assembly path alone)."""
    def run() -> None:
        real = os.fsync
        os.fsync = lambda fd: None
        try:
            function()
        finally:
            os.fsync = real
    return run


def best_of(actions: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall seconds and best CPU seconds (this process) of each action, run alternating `repeats` times."""
    wall = {name: [] for name in actions}
    cpu = {name: [] for name in actions}
    for _ in range(repeats):
        for name, action in actions.items():
            started = time.process_time()
            wall[name].append(timed(action))
            cpu[name].append(time.process_time() - started)
            os.sync()
    return {name: min(times) for name, times in wall.items()}, {name: min(times) for name, times in cpu.items()}


def bench_copy(work: Path, parts: int, mib: int, repeats: int) -> None:
    total = write_parts(work, parts, mib)
    bins = [str(bin_path(part_prefix(part_dir(work, n)))) for n in range(parts)]
    prefixes = [part_prefix(part_dir(work, n)) for n in range(parts)]
    import_seconds = timed(lambda: __import__("megatron.core.datasets.indexed_dataset"))

    def cat(durable: bool) -> None:
        with open(work / "cat.bin", "wb") as handle:
            subprocess.run(["cat", *bins], stdout=handle, check=True)
            if durable:
                os.fsync(handle.fileno())

    actions = {"cat": lambda: cat(False), "cat+fsync": lambda: cat(True),
               "concat, no fsync": without_fsync(lambda: concatenate(prefixes, work / "concat")),
               "concat": lambda: concatenate(prefixes, work / "concat"), "merge": lambda: merge(work)}
    best, _ = best_of(actions, repeats)  # cat runs in a child process: wall time only
    gb = total / 1e9
    print(f"Merge of {parts} parts, {gb:.2f} GB of int32 tokens (best of {repeats}, warm page cache; "
          f"megatron-core import {import_seconds:.1f} s excluded)\n")
    print("| path | seconds | GB/s | vs cat | vs cat+fsync |\n|---|---:|---:|---:|---:|")
    for name in actions:
        print(f"| {name} | {best[name]:.2f} | {gb / best[name]:.2f} | {best['cat'] / best[name]:.0%} | "
              f"{best['cat+fsync'] / best[name]:.0%} |")


def bench_assembly(work: Path, parts: int, documents: int, repeats: int) -> None:
    items_out, plain_out = work / "items", work / "plain"
    started = time.perf_counter()
    tokens, images = write_document_parts(items_out, plain_out, parts, documents)
    written = time.perf_counter() - started
    item_dirs = [part_dir(items_out, n) for n in range(parts)]
    plain = [part_prefix(part_dir(plain_out, n)) for n in range(parts)]
    __import__("megatron.core.datasets.indexed_dataset")  # its one-off import is not merge work

    def assemble() -> None:
        with open(os.devnull, "wb") as provenance, open(os.devnull, "wb") as skipped:
            assemble_documents(item_dirs, work / "assembled", provenance, skipped)

    actions = {"assemble": assemble, "copy": lambda: concatenate(plain, work / "concat"),
               "assemble, no fsync": without_fsync(assemble),
               "copy, no fsync": without_fsync(lambda: concatenate(plain, work / "concat")),
               "merge, item parts": lambda: merge(items_out), "merge, plain parts": lambda: merge(plain_out)}
    best, cpu = best_of(actions, repeats)
    names = {"assemble": "assemble_documents (item parts -> one dataset)",
             "copy": "concatenate of the plain parts (merge's copy path)",
             "assemble, no fsync": "assemble_documents, fsync disabled",
             "copy, no fsync": "concatenate, fsync disabled",
             "merge, item parts": "`mmtok merge` of the item parts (check, assemble, copy, verify)",
             "merge, plain parts": "`mmtok merge` of the plain parts (check, copy, verify)"}
    reference = {"assemble": "copy", "copy": "copy", "assemble, no fsync": "copy, no fsync",
                 "copy, no fsync": "copy, no fsync", "merge, item parts": "merge, plain parts",
                 "merge, plain parts": "merge, plain parts"}
    print(f"\nAssembly vs copy: {documents:,} documents of 2-20 images ({images:,} images of "
          f"{IMAGE_CODES[0]}x{IMAGE_CODES[1]} codes), {tokens:,} tokens = {4 * tokens / 1e9:.2f} GB of int32, "
          f"on {parts} parts (written in {written:.0f} s); best of {repeats}, warm page cache\n")
    print("| path | wall s | M tokens/s | GB/s | ns/token | vs plain parts | CPU s | ns/token (CPU) | "
          "vs plain parts (CPU) |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, label in names.items():
        seconds = best[name]
        print(f"| {label} | {seconds:.2f} | {tokens / seconds / 1e6:.0f} | {4 * tokens / seconds / 1e9:.2f} | "
              f"{1e9 * seconds / tokens:.2f} | {best[reference[name]] / seconds:.0%} | {cpu[name]:.2f} | "
              f"{1e9 * cpu[name] / tokens:.2f} | {cpu[reference[name]] / cpu[name]:.0%} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--mib-per-part", type=int, default=256, help="0: skip the copy-vs-cat case")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--documents", type=int, default=30_000, help="multi-image documents (0: skip assembly)")
    parser.add_argument("--document-parts", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-merge-", dir=args.dir))
    try:
        if args.mib_per_part:
            bench_copy(work / "copy", args.parts, args.mib_per_part, args.repeats)
            shutil.rmtree(work / "copy")
        if args.documents:
            bench_assembly(work / "assembly", args.document_parts, args.documents, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
