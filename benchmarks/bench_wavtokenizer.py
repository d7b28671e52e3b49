"""WavTokenizer benchmark: encoder throughput, resampling cost, and the padding reach, in one run.

    python benchmarks/bench_wavtokenizer.py [--seconds 120] [--batch 8] [--golden SET_DIR]

1. Encoder throughput on CPU (seconds of audio per second), batch 1 vs batched, same clips, same run,
   with the official-size SEANet encoder and 4,096 x 512 codebook (random weights; the encoder size is
   fixed by the official EncodecFeatures, so a random checkpoint has exactly the official encoder).
2. Resampling cost per minute of real 48 kHz (alsa-utils) and 8 kHz (asterisk prompts) speech: soxr VHQ
   (the pipeline's resampler) vs torchaudio.functional.resample (its default windowed sinc), same run;
   skipped when torchaudio is not installed (mmtok does not depend on it).
3. Padding reach on real speech: each clip encoded alone vs inside zero-padded batches; how many trailing
   codes actually differ (max over clips), and whether the ceil(n/600) - 5 kept codes ever differ.
4. CUDA (only when torch.cuda.is_available()): seconds of audio per second at batch 1/16/64, and the
   fraction of codes that change when TF32 is switched on for matmul, cuDNN conv and cuDNN RNN.
Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from goldenkit import COMPACT_ROOT, expand  # noqa: E402
from mmtok.codecs import wavtokenizer as wt  # noqa: E402
from mmtok.media.audio import load_audio, peak_normalize, resample  # noqa: E402
from realmedia import alsa_sounds, asterisk_prompts  # noqa: E402

SPEECH_ALSA = ("Front_Center", "Front_Left", "Front_Right", "Rear_Center", "Rear_Left", "Rear_Right",
               "Side_Left", "Side_Right")


def speech_24k(limit: int) -> list[np.ndarray]:
    """Real speech at 24 kHz (shared resampler, peak-normalized): alsa clips, then asterisk prompts."""
    paths = [p for p in alsa_sounds() if p.stem in SPEECH_ALSA] + asterisk_prompts()
    clips = []
    for path in paths:
        wave, _ = load_audio(str(path))
        if wave.size > wt.TRIM * wt.HOP and np.abs(wave).max() > 1e-3:
            clips.append(peak_normalize(wave))
        if len(clips) == limit:
            break
    return clips


def fixed_length_clips(speech: list[np.ndarray], seconds: float, count: int) -> list[np.ndarray]:
    """`count` clips of `seconds` each, cut from the concatenated speech (repeated as needed)."""
    stream = np.concatenate(speech)
    size = int(seconds * wt.SAMPLE_RATE)
    stream = np.tile(stream, math.ceil(size * count / stream.size))
    return [stream[i * size:(i + 1) * size] for i in range(count)]


def timed(function, repeats: int) -> tuple[float, float]:
    """Median (wall seconds, process CPU seconds) of `repeats` calls, after one warm-up call.

    CPU seconds are reported next to wall seconds because a shared machine's other load inflates
    wall time but not the CPU time this process itself needs."""
    function()
    walls, cpus = [], []
    for _ in range(repeats):
        wall, cpu = time.perf_counter(), time.process_time()
        function()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def encoder_throughput(codec, clips: list[np.ndarray], batch: int, device: str, repeats: int) -> tuple[float, float]:
    """Seconds of audio per (wall second, CPU second) encoding `clips` in batches of `batch`."""
    waves = torch.from_numpy(np.stack(clips)).to(device)
    lengths = torch.full((len(clips),), waves.shape[1], device=device)

    def run() -> None:
        for start in range(0, len(clips), batch):
            codec.encode(waves[start:start + batch], lengths[start:start + batch])
        if device == "cuda":
            torch.cuda.synchronize()

    audio = waves.numel() / wt.SAMPLE_RATE
    wall, cpu = timed(run, repeats)
    return audio / wall, audio / cpu


def bench_cpu_encoder(codec, speech, seconds: float, batch: int, repeats: int) -> None:
    clips = fixed_length_clips(speech, 10.0, max(batch, round(seconds / 10)))
    total = sum(c.size for c in clips) / wt.SAMPLE_RATE
    single = encoder_throughput(codec, clips, 1, "cpu", repeats)
    batched = encoder_throughput(codec, clips, batch, "cpu", repeats)
    print(f"\n### Encoder throughput, CPU ({torch.get_num_threads()} threads), {len(clips)} clips x 10 s "
          f"= {total:.0f} s of audio, median of {repeats}\n")
    print("| batch | audio s per wall s | audio s per CPU s | wall: x batch 1 | CPU: x batch 1 |")
    print("|---|---|---|---|---|")
    for size, (wall, cpu) in ((1, single), (batch, batched)):
        print(f"| {size} | {wall:.1f} | {cpu:.1f} | {wall / single[0]:.2f} | {cpu / single[1]:.2f} |")


def one_minute(paths, rate: int) -> np.ndarray:
    """60 s of real speech at its native rate (mono float32), concatenated and repeated as needed."""
    import soundfile

    parts = [soundfile.read(str(p), dtype="float32", always_2d=True) for p in paths]
    stream = np.concatenate([data.mean(axis=1) for data, native in parts if native == rate])
    return np.tile(stream, math.ceil(60 * rate / stream.size))[: 60 * rate].astype(np.float32)


def bench_resampling(repeats: int) -> None:
    try:
        import torchaudio.functional as AF
    except ImportError:  # mmtok does not depend on torchaudio: it must match the installed torch exactly
        print("\n### Resampling: skipped (torchaudio is not installed; install the torchaudio release built for "
              "this torch to compare soxr with it)\n")
        return

    print(f"\n### Resampling 60 s of real speech to 24 kHz, median of {repeats} (single process)\n")
    print("| source | soxr VHQ wall s/min | torchaudio wall s/min | ratio | soxr CPU s/min | torchaudio CPU s/min "
          "| ratio | max abs diff (0.1 s edges excluded) |\n|---|---|---|---|---|---|---|---|")
    for label, paths, rate in (("alsa-utils 48 kHz", [p for p in alsa_sounds() if p.stem in SPEECH_ALSA], 48_000),
                               ("asterisk 8 kHz", asterisk_prompts()[:60], 8_000)):
        minute = one_minute(paths, rate)
        tensor = torch.from_numpy(minute)
        soxr_s = timed(partial(resample, minute, rate), repeats)
        torchaudio_s = timed(partial(AF.resample, tensor, rate, wt.SAMPLE_RATE), repeats)
        ours, theirs = resample(minute, rate), AF.resample(tensor, rate, wt.SAMPLE_RATE).numpy()
        edge, size = wt.SAMPLE_RATE // 10, min(ours.size, theirs.size)  # edges: each library pads differently
        diff = float(np.abs(ours[edge:size - edge] - theirs[edge:size - edge]).max())
        print(f"| {label} | {soxr_s[0]:.4f} | {torchaudio_s[0]:.4f} | {torchaudio_s[0] / soxr_s[0]:.2f} | "
              f"{soxr_s[1]:.4f} | {torchaudio_s[1]:.4f} | {torchaudio_s[1] / soxr_s[1]:.2f} | {diff:.2e} |")


def trailing_span(alone: np.ndarray, batched: np.ndarray) -> int:
    differing = np.flatnonzero(alone != batched)
    return 0 if differing.size == 0 else alone.size - int(differing[0])


def bench_padding_reach(codec, speech: list[np.ndarray], batch: int) -> None:
    """Alone vs padded batches: trailing codes that differ, and kept-code mismatches (must be 0)."""
    rng = np.random.default_rng(0)
    clips = [c[: rng.integers(wt.TRIM * wt.HOP + 1, c.size + 1)] if i % 2 else c for i, c in enumerate(speech)]
    alone = [codec.encode(torch.from_numpy(c)[None], [c.size])[0][0].numpy() for c in clips]
    spans, kept_mismatch, placements = [], 0, 0
    by_length = np.argsort([c.size for c in clips], kind="stable")  # as a duration bucketing sampler would
    for order in (by_length, rng.permutation(len(clips))):
        for start in range(0, len(clips), batch):
            group = order[start:start + batch]
            padded = np.zeros((len(group), max(clips[i].size for i in group)), np.float32)
            for row, i in enumerate(group):
                padded[row, : clips[i].size] = clips[i]
            codes, counts = codec.encode(torch.from_numpy(padded), [clips[i].size for i in group])
            for row, i in enumerate(group):
                counted = codes[row, : int(counts[row])].numpy()
                spans.append(trailing_span(alone[i], counted))
                kept = wt.trimmed_count(clips[i].size)
                kept_mismatch += int((counted[:kept] != alone[i][:kept]).any())
                placements += 1
    histogram = {span: spans.count(span) for span in sorted(set(spans))}
    print(f"\n### Padding reach on real speech: {len(clips)} clips (half cut at random points), "
          f"{placements} placements in zero-padded batches of up to {batch}\n")
    print(f"- max trailing codes that differ from the clip encoded alone: **{max(spans)}** (bound: {wt.TRIM})")
    print(f"- placements by trailing span (codes from the end: count): {histogram}")
    print(f"- placements whose kept ceil(n/600) - {wt.TRIM} codes differ: **{kept_mismatch}**")


def bench_cuda(codec_dir: Path, speech: list[np.ndarray]) -> None:
    codec = wt.load(codec_dir, "cuda")
    clips = fixed_length_clips(speech, 10.0, 128)
    print("\n### Encoder on CUDA (strict fp32 contract), 128 clips x 10 s, median of 3\n")
    print("| batch | audio s per wall s |\n|---|---|")
    for batch in (1, 16, 64):
        print(f"| {batch} | {encoder_throughput(codec, clips, batch, 'cuda', 3)[0]:.0f} |")
    waves = torch.from_numpy(np.stack(clips[:64])).cuda()
    lengths = torch.full((64,), waves.shape[1], device="cuda")
    strict = codec.encode(waves, lengths)[0]
    codec.precision = dataclasses.replace(codec.precision, tf32_matmul=True, tf32_conv=True, tf32_rnn=True)
    tf32 = codec.encode(waves, lengths)[0]
    codec.precision = wt.PRECISION
    cpu = wt.load(codec_dir, "cpu").encode(waves.cpu(), lengths.cpu())[0]
    print(f"\n- codes changed by TF32 (matmul + cuDNN conv + cuDNN RNN) vs strict fp32: "
          f"{(strict != tf32).float().mean().item():.4%} of {strict.numel()}")
    print(f"- CUDA strict fp32 vs CPU codes: {(strict.cpu() != cpu).float().mean().item():.4%} differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=120.0, help="audio per throughput measurement")
    parser.add_argument("--batch", type=int, default=8, help="batch size of the batched CPU run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--clips", type=int, default=48, help="real speech clips for the padding reach")
    parser.add_argument("--golden", type=Path, default=None,
                        help="an original golden set folder whose checkpoint is used for the padding reach "
                             "(default: the repository's tests/golden/wavtokenizer, expanded)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads, "
          f"load average {os.getloadavg()[0]:.1f}")
    speech = speech_24k(args.clips)
    with tempfile.TemporaryDirectory() as tmp:
        random_dir = wt.write_random_checkpoint(Path(tmp) / "random")
        codec = wt.load(random_dir)
        bench_cpu_encoder(codec, speech, args.seconds, args.batch, args.repeats)
        bench_resampling(args.repeats)
        golden = args.golden or expand(COMPACT_ROOT / "wavtokenizer", Path(tmp) / "golden")
        print("\n(padding reach with the golden checkpoint)")
        bench_padding_reach(wt.load(golden / "checkpoint"), speech, args.batch)
        if torch.cuda.is_available():
            bench_cuda(random_dir, speech)
        else:
            print("\n(CUDA section skipped: torch.cuda.is_available() is False)")
    print(f"\nload average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
