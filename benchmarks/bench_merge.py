"""Merge throughput vs `cat` of the same `.bin` files.

    python benchmarks/bench_merge.py [--parts 8] [--mib-per-part 256] [--repeats 3] [--dir DIR]

Writes --parts finished parts (PartWriter, int32 tokens of random lengths 64..8192) under DIR, then
times, alternating and --repeats times each:
  cat       `cat parts/*/tokens.bin > cat.bin` (GNU coreutils; copy_file_range where the kernel allows)
  cat+fsync the same, then fsync: durable like the merge's outputs (atomic writes fsync before rename)
  concat    the merge's data path: `mmtok.formats.megatron.concatenate` (bytes copied with
            copy_file_range, pointers rebuilt, fsynced and renamed into place); also timed with
            fsync disabled, to show the copy path alone against `cat`
  merge     `mmtok.merge.merge(OUT)`: concatenate + provenance + stats + megatron-core verification
            (the verification's one-off import of megatron-core is timed separately and excluded)
Throughput is GB of tokens.bin per second, best of the repeats (page cache warm for all: the files
were just written). Markdown on stdout.
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

from mmtok.formats.commitlog import PartWriter, part_dir, part_prefix
from mmtok.formats.megatron import bin_path, concatenate
from mmtok.merge import merge


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


def timed(function) -> float:
    started = time.perf_counter()
    function()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--mib-per-part", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-merge-", dir=args.dir))
    try:
        total = write_parts(work, args.parts, args.mib_per_part)
        bins = [str(bin_path(part_prefix(part_dir(work, n)))) for n in range(args.parts)]
        prefixes = [part_prefix(part_dir(work, n)) for n in range(args.parts)]
        import_seconds = timed(lambda: __import__("megatron.core.datasets.indexed_dataset"))

        def cat(durable: bool) -> None:
            with open(work / "cat.bin", "wb") as handle:
                subprocess.run(["cat", *bins], stdout=handle, check=True)
                if durable:
                    os.fsync(handle.fileno())

        def without_fsync(function):
            def run() -> None:
                real = os.fsync
                os.fsync = lambda fd: None
                try:
                    function()
                finally:
                    os.fsync = real
            return run

        actions = {"cat": lambda: cat(False), "cat+fsync": lambda: cat(True),
                   "concat, no fsync": without_fsync(lambda: concatenate(prefixes, work / "concat")),
                   "concat": lambda: concatenate(prefixes, work / "concat"), "merge": lambda: merge(work)}
        runs = {name: [] for name in actions}
        for _ in range(args.repeats):
            for name, action in actions.items():
                runs[name].append(timed(action))
                os.sync()
        best = {name: min(times) for name, times in runs.items()}
        gb = total / 1e9
        print(f"Merge of {args.parts} parts, {gb:.2f} GB of int32 tokens (best of {args.repeats}, warm page cache; "
              f"megatron-core import {import_seconds:.1f} s excluded)\n")
        print("| path | seconds | GB/s | vs cat | vs cat+fsync |\n|---|---:|---:|---:|---:|")
        for name in actions:
            print(f"| {name} | {best[name]:.2f} | {gb / best[name]:.2f} | {best['cat'] / best[name]:.0%} | "
                  f"{best['cat+fsync'] / best[name]:.0%} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
