"""Conversion throughput of `mmtok audio convert` (hours of audio per hour per core) vs plain lhotse.

    python benchmarks/bench_audio_convert.py [--workdir /tmp/mmtok-bench-audio] [--copies 2]

Input: every Debian asterisk-core-sounds-en prompt (8 kHz WAV, 568 files, 0.42 h), repeated --copies
times under different names, with a transcript table (the file name as text). Same run, same input:
* mmtok, --workers 0 (all in the main process), 1 and 2: decode, validate, soxr-VHQ resample to
  24 kHz, tokenize, 24-bit FLAC, lhotse SharWriter shards of 5,000 cuts, report;
* baseline: plain lhotse, one process -- `Recording.from_file` for each file, `CutSet.resample(24000)`,
  `CutSet.to_shar(fields={"recording": "flac"})` (16-bit FLAC, no validation, no text).
Figures: hours of audio per wall-clock hour per process, and (single-process runs) per CPU hour, which
stays meaningful on a shared, loaded machine. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

ASTERISK = Path("/usr/share/asterisk/sounds/en")


def build_input(workdir: Path, copies: int) -> tuple[Path, Path, float]:
    import soundfile

    files = sorted(ASTERISK.rglob("*.wav"))
    if not files:
        raise SystemExit(f"no prompts under {ASTERISK}: apt-get install asterisk-core-sounds-en-wav")
    source = workdir / "input"
    shutil.rmtree(source, ignore_errors=True)
    rows, seconds = ["path\ttext"], 0.0
    for copy in range(copies):
        for path in files:
            rel = Path(f"copy{copy}") / path.relative_to(ASTERISK)
            (source / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, source / rel)
            rows.append(f"{rel}\t{path.stem.replace('-', ' ')}")
            seconds += soundfile.info(path).duration
    table = workdir / "transcripts.tsv"
    table.write_text("\n".join(rows) + "\n")
    return source, table, seconds / 3600


def run_mmtok(source: Path, table: Path, out: Path, workers: int) -> tuple[float, float, dict]:
    """(wall s, CPU s of this process, report)."""
    from mmtok.audio.convert import ConvertOptions, convert

    shutil.rmtree(out, ignore_errors=True)
    started, cpu = time.perf_counter(), time.process_time()
    report = convert([source], out, ConvertOptions(), transcripts=table, workers=workers, progress=False)
    return time.perf_counter() - started, time.process_time() - cpu, report


def run_lhotse(source: Path, out: Path) -> tuple[float, float]:
    """(wall s, CPU s)."""
    from lhotse import CutSet, Recording, RecordingSet

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started, cpu = time.perf_counter(), time.process_time()
    recordings = RecordingSet.from_recordings(Recording.from_file(p) for p in sorted(source.rglob("*.wav")))
    cuts = CutSet.from_manifests(recordings=recordings).resample(24_000)
    cuts.to_shar(out, fields={"recording": "flac"}, shard_size=5000)
    return time.perf_counter() - started, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmtok-bench-audio"))
    parser.add_argument("--copies", type=int, default=2)
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    source, table, hours = build_input(args.workdir, args.copies)
    print(f"input: {args.copies} x 568 asterisk prompts, {hours:.3f} h of 8 kHz audio; {os.cpu_count()} CPUs\n")
    print("| converter | processes | wall s | CPU s (one process) | h audio / wall h / process | h audio / CPU h |")
    print("|---|---|---|---|---|---|")
    wall, cpu = run_lhotse(source, args.workdir / "lhotse")
    print(f"| plain lhotse (resample + to_shar, 16-bit FLAC, no checks, no text) | 1 | {wall:.1f} | {cpu:.1f} | "
          f"{hours * 3600 / wall:,.0f} | {hours * 3600 / cpu:,.0f} |")
    for workers in (0, 1, 2):
        wall, cpu, report = run_mmtok(source, table, args.workdir / f"mmtok-{workers}", workers)
        processes = max(workers, 1)
        per_cpu = f"{hours * 3600 / cpu:,.0f}" if workers == 0 else "- (workers not counted)"
        print(f"| mmtok audio convert --workers {workers} ({report.report.counts['written']} clips) | {processes} | "
              f"{wall:.1f} | {cpu:.1f} | {hours * 3600 / wall / processes:,.0f} | {per_cpu} |")

if __name__ == "__main__":
    main()
