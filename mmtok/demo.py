"""`mmtok demo`: the whole flow, once, on the real media bundled in mmtok/data/demo.

Images: WebDataset tar shards are built from the bundled photos and captions (plus one truncated JPEG,
to show how a bad file is counted), then scan -> plan (2 ranks) -> encode rank 0 and rank 1 -> merge.
Audio: the bundled speech clips -> convert (Lhotse Shar) -> encode -> merge -> interleave.
Every step is a real `mmtok` command, printed before it runs. Without --image-checkpoint /
--audio-checkpoint the codecs are tiny RANDOM-weight checkpoints in the official formats: the
files are real, the tokens carry no meaning.
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
import time
from pathlib import Path

from mmtok.errors import MmtokError

DEMO_DATA = Path(__file__).resolve().parent / "data" / "demo"
SOURCES = Path(__file__).resolve().parent.parent / "manifests"  # the checkout's source declarations
MARKER = "MMTOK_DEMO"


def run_demo(out: Path, *, world_size: int = 2, image_checkpoint: str | None = None,
             audio_checkpoint: str | None = None, audio: bool = True) -> dict:
    """Run the demo into `out` (recreated if it holds an earlier demo) and return its summary."""
    started = time.monotonic()
    _prepare(out)
    summary = {"images": _image_flow(out, world_size, image_checkpoint)}
    if audio:
        summary["audio"] = _audio_flow(out, world_size, audio_checkpoint)
    summary["seconds"] = round(time.monotonic() - started, 1)
    _print_summary(out, summary, random_weights=not (image_checkpoint and (audio_checkpoint or not audio)))
    return summary


def _prepare(out: Path) -> None:
    if not SOURCES.is_dir():
        raise MmtokError(f"the demo needs the source checkout's manifests/ ({SOURCES}); install with "
                         "`pip install -e .` from the repository")
    if out.exists() and any(out.iterdir()):
        if not (out / MARKER).exists():
            raise MmtokError(f"{out} exists and is not an earlier demo output; pass another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True)
    (out / MARKER).write_text("written by `mmtok demo`; safe to delete\n")


def _mmtok(*argv: str) -> None:
    """Run one mmtok command in this process, echoing it like a shell would."""
    from mmtok.cli import main

    print(f"\n$ mmtok {' '.join(argv)}", flush=True)
    status = main(list(argv))
    if status != 0:
        raise MmtokError(f"demo step `mmtok {' '.join(argv)}` failed with exit status {status}")


def build_image_shards(directory: Path) -> list[Path]:
    """Two WebDataset shards of the bundled photos (jpg/png + txt caption); shard 1 ends with a truncated JPEG."""
    rows = [json.loads(line) for line in (DEMO_DATA / "captions.jsonl").read_text().splitlines()]
    directory.mkdir(parents=True, exist_ok=True)
    half = (len(rows) + 1) // 2
    shards = []
    for number, chunk in enumerate((rows[:half], rows[half:])):
        path = directory / f"demo-{number:06d}.tar"
        with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
            for row in chunk:
                image = DEMO_DATA / "images" / row["file"]
                _add(tar, f"{row['name']}{image.suffix}", image.read_bytes())
                _add(tar, f"{row['name']}.txt", row["caption"].encode())
            if number == 1:
                damaged = (DEMO_DATA / "images" / "astronaut.jpg").read_bytes()
                _add(tar, "truncated_download.jpg", damaged[: len(damaged) // 3])
                _add(tar, "truncated_download.txt", b"A download that stopped a third of the way through.")
        shards.append(path)
    return shards


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def _image_flow(out: Path, world_size: int, checkpoint: str | None) -> dict:
    from mmtok.codecs import emu35

    build_image_shards(out / "shards")
    if checkpoint is None:
        checkpoint = str(emu35.write_random_checkpoint(out / "checkpoints" / "emu3.5-tiny-random"))
    _mmtok("scan", "--source", str(SOURCES / "demo-images.yaml"), "--root", str(out), "--out", str(out / "manifest"))
    _mmtok("plan", str(out / "manifest"), "--preset", "demo", "--world-size", str(world_size),
           "--out", str(out / "plan"))
    for rank in range(world_size):
        _mmtok("encode", "--plan", str(out / "plan"), "--codec", "emu3.5", "--checkpoint", checkpoint,
               "--out", str(out / "encoded"), "--rank", str(rank), "--world-size", str(world_size),
               "--loader-threads", "2")
    _mmtok("merge", str(out / "encoded"))
    _mmtok("inspect", str(out / "encoded" / "merged"), "--limit", "2")
    return json.loads((out / "encoded" / "merged.json").read_text())


def _audio_flow(out: Path, world_size: int, checkpoint: str | None) -> dict:
    from mmtok.codecs import wavtokenizer

    audio = out / "audio"
    if checkpoint is None:
        checkpoint = str(wavtokenizer.write_random_checkpoint(out / "checkpoints" / "wavtokenizer-tiny-random"))
    _mmtok("audio", "convert", "--source", str(SOURCES / "demo-speech.yaml"), "--out", str(audio / "shar"),
           "--no-progress")
    for rank in range(world_size):
        _mmtok("encode", "--modality", "audio", "--shar", str(audio / "shar"), "--codec", "wavtokenizer",
               "--checkpoint", checkpoint, "--out", str(audio / "encoded"), "--rank", str(rank),
               "--world-size", str(world_size), "--num-workers", "0", "--no-progress")
    _mmtok("merge", str(audio / "encoded"))
    _mmtok("audio", "interleave", str(audio / "encoded"), "--out", str(audio / "interleaved"), "--no-progress")
    _mmtok("inspect", str(audio / "encoded" / "merged"), "--limit", "1")
    return json.loads((audio / "encoded" / "merged.json").read_text())


def _print_summary(out: Path, summary: dict, random_weights: bool) -> None:
    print("\n=== mmtok demo: done in", summary["seconds"], "s ===")
    for name, merged in summary.items():
        if not isinstance(merged, dict):
            continue
        counts = merged.get("counts", merged)
        shown = {k: v for k, v in sorted(counts.items()) if isinstance(v, (int, float))}
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in shown.items()))
    print(f"image dataset: {out / 'encoded' / 'merged'}.bin/.idx  (Megatron --data-path {out / 'encoded' / 'merged'})")
    if "audio" in summary:
        print(f"audio dataset: {out / 'audio' / 'encoded' / 'merged'}.bin/.idx; interleaved: {out / 'audio' / 'interleaved'}")
    if random_weights:
        print("note: the codecs were tiny random-weight checkpoints (real formats, meaningless tokens); pass "
              "--image-checkpoint / --audio-checkpoint with the official Emu3.5 and WavTokenizer files for real tokens.")
