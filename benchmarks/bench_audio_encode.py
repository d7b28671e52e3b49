"""Encode-stage device-busy fraction for audio with a stand-in device codec: pipeline vs serial loop.

    python benchmarks/bench_audio_encode.py [--workdir /tmp/mmtok-bench-audio-encode] [--rtf 100 300 1000] [--copies 3]

The stand-in "device" (`StandInAudioCodec`, below -- NOT a real codec) takes padded samples /
(24,000 x RTF) seconds per batch, waiting in `time.sleep`, which releases the GIL as a CUDA sync does;
RTF is its speed as a multiple of real time. Its codes are a deterministic function of the audio.
Input: --copies copies of every Debian asterisk-core-sounds-en prompt, converted by `mmtok audio
convert` into Shar shards of 200 cuts. Same run, same shards, for each RTF:
* pipeline: `mmtok.encode.audio.encode_audio_rank` -- DataLoader workers (--workers) decode, normalize and
  pad the next batches while the device encodes; commits and part assembly on a background thread;
* serial: the same steps one after another in one thread (load batch, encode, commit).
Busy = time inside `encode` / wall time of the encode loop; "steady" excludes the wait for the first
batch (worker start-up), which a long production run amortizes. Markdown on stdout.
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import time
from pathlib import Path

import torch

from mmtok.codecs.base import Codec, PrecisionContract
from mmtok.formats.shar import read_report
from mmtok.fsutil import sha256_file

ASTERISK = Path("/usr/share/asterisk/sounds/en")
HOP = 600


class StandInAudioCodec(Codec):
    """Simulated audio codec (24 kHz, hop 600, 4,096 codes); `rtf` sets the simulated device speed."""

    name = "standin-audio"
    modality = "audio"
    sample_rate = 24_000
    hop = HOP
    codebook_size = 4096
    precision = PrecisionContract(tf32_matmul=False, tf32_conv=False)

    def __init__(self, rtf: float):
        super().__init__()
        self.rtf = float(rtf)
        self.checkpoint_sha256 = hashlib.sha256(b"mmtok-standin-audio-v1").hexdigest()

    @torch.no_grad()
    def encode(self, wave: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        started = time.perf_counter()
        batch, samples = wave.shape
        # one sample per hop: cheap, so the simulated device time is what the host waits for
        codes = torch.clamp((wave[:, ::HOP].abs() * 4095).round(), 0, 4095).to(torch.int32)
        remaining = batch * samples / (self.sample_rate * self.rtf) - (time.perf_counter() - started)
        if remaining > 0:
            time.sleep(remaining)  # the simulated device is busy; the GIL is free
        return codes, -(-lengths // HOP)

    def describe(self) -> dict:
        return {**super().describe(), "sample_rate": self.sample_rate, "hop": HOP, "trim": 5, "rtf": self.rtf}


def make_shar(workdir: Path, copies: int) -> Path:
    from mmtok.audio.convert import ConvertOptions, convert

    out = workdir / f"shar-x{copies}"
    done = read_report(out)
    if not (done and done.complete):
        files = sorted(ASTERISK.rglob("*.wav"))
        if not files:
            raise SystemExit(f"no prompts under {ASTERISK}: apt-get install asterisk-core-sounds-en-wav")
        source = workdir / f"input-x{copies}"
        for copy in range(copies):
            for path in files:
                target = source / f"copy{copy}" / path.relative_to(ASTERISK)
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, target)
        convert([source], out, ConvertOptions(shard_size=200), workers=2, progress=False)
    return out


def pipeline(shar: Path, out: Path, codec, workers: int) -> dict:
    from mmtok.encode.audio import encode_audio_rank
    from mmtok.encode.audio_batches import Batching

    shutil.rmtree(out, ignore_errors=True)
    return encode_audio_rank(shar, out, codec, rank=0, world_size=1, batching=Batching(), num_workers=workers,
                             progress=False).run.to_json()


def serial(shar: Path, out: Path, codec) -> dict:
    """The naive loop: every step on the critical path."""
    from mmtok.encode import audio as enc
    from mmtok.encode.audio_batches import Batching
    from mmtok.encode.loop import Meter
    from mmtok.formats.shar import discover_shards
    from mmtok.progress import progress
    from mmtok.text import load_text_tokenizer

    shutil.rmtree(out, ignore_errors=True)
    shards, report = discover_shards(shar)
    batching = Batching()
    context = enc.build_context(out, codec, load_text_tokenizer(), "auto", batching, report)
    context.cache_metadata["num_parts"] = len(shards)
    work = enc.open_parts(shards, context, batching, len(shards), 5 * HOP)
    meter = Meter(progress(enabled=False), item="clip")  # (assemble_part commits the part's figures from it)
    started, busy, batches = time.perf_counter(), 0.0, 0
    for w in work:
        for request in w.requests:
            batch = enc.load_batch(request)
            tick = time.perf_counter()
            results = enc.encode_batch(codec, batch, torch.device("cpu"), 5, context.builder.layout)
            busy += time.perf_counter() - tick
            w.open().commit(request.unit, [], [], {}, carry=enc.pack_clips(results))
            batches += 1
        enc.assemble_part(w, context, {}, meter)
    enc.release_parts(work)
    wall = time.perf_counter() - started
    return {"wall_s": wall, "device_busy_s": busy, "batches": batches, "first_batch_s": 0.0, "loader_wait_s": 0.0}


def loader_capacity(shar: Path) -> float:
    """Seconds of audio one CPU-second of the loader (read member, FLAC decode, normalize, pad) delivers."""
    from lhotse import CutSet

    from mmtok.encode.audio import BatchRequest, load_batch
    from mmtok.encode.audio_batches import Batching, make_batches
    from mmtok.formats.shar import discover_shards, index_members

    shard = discover_shards(shar)[0][0]
    cuts = CutSet.from_file(shard.cuts_path).to_eager()
    members, _ = index_members(shard.recording_path)
    batching = Batching()
    started, audio = time.process_time(), 0
    for unit, positions in enumerate(make_batches(cuts, batching)):
        request = BatchRequest(0, unit, str(shard.recording_path), tuple(positions),
                               tuple(members[cuts[p].id] for p in positions),
                               tuple(float(cuts[p].duration) for p in positions), 5 * HOP,
                               batching.max_clip_duration)
        audio += int(load_batch(request)["lengths"].sum())
    return audio / 24_000 / (time.process_time() - started)


def row(name: str, rtf: float, stats: dict) -> str:
    busy = stats["device_busy_s"] / stats["wall_s"]
    steady = stats["device_busy_s"] / max(stats["wall_s"] - stats["first_batch_s"], 1e-9)
    return (f"| {name} | {rtf:g}x | {stats['batches']} | {stats['wall_s']:.1f} | {stats['device_busy_s']:.1f} | "
            f"{100 * busy:.1f}% | {100 * steady:.1f}% | {stats['loader_wait_s']:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/mmtok-bench-audio-encode"))
    parser.add_argument("--rtf", type=float, nargs="+", default=[100.0, 300.0, 1000.0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--copies", type=int, default=3,
                        help="copies of the prompt set (more audio amortizes start-up)")
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    shar = make_shar(args.workdir, args.copies)
    report = read_report(shar)
    print(f"input: {args.copies} x the asterisk prompts, {report.duration_written / 3600:.2f} h in "
          f"{len(report.shards)} Shar shards of 200 cuts; DataLoader workers: {args.workers}; loader capacity "
          f"{loader_capacity(shar):,.0f} s of audio per CPU-second\n")
    print("| loop | device speed (x real time) | batches | wall s | device busy s | busy | busy, steady | "
          "waited for loader s |")
    print("|---|---|---|---|---|---|---|---|")
    for rtf in args.rtf:
        codec = StandInAudioCodec(rtf)
        print(row(f"pipeline ({args.workers} workers)", rtf, pipeline(shar, args.workdir / "pipeline", codec,
                                                                        args.workers)), flush=True)
        print(row("serial", rtf, serial(shar, args.workdir / "serial", codec)), flush=True)
    same = all(sha256_file(p) == sha256_file(args.workdir / "serial" / p.relative_to(args.workdir / "pipeline"))
               for p in sorted((args.workdir / "pipeline").glob("parts/*/tokens.*")))
    print(f"\npipeline and serial part files identical: {same}")


if __name__ == "__main__":
    main()
