"""`mmtok demo`: the whole flow, once, on the real media bundled in mmtok/data/demo.

Images: WebDataset tar shards are built from the bundled photos and captions (plus one truncated JPEG,
to show how a bad file is counted, and one sample whose caption loops), then scan -> curation (hash, and dedup
against a one-image benchmark holding a half-size copy of a bundled photo, with the caption checks and the
report: the copy and the looping caption are dropped by sample id) -> plan --exclude (2 ranks) -> encode rank 0
and rank 1 -> merge.
Audio: the bundled speech clips -> convert (Lhotse Shar) -> encode -> merge -> interleave.
SFT: a tar of chat conversations about the bundled photos and speech (an image with a spoken clip, a
speech-only exchange, a tool call with reasoning, and one whose placeholders outnumber its clips, to show a
named skip) -> scan -> plan --mode sft -> encode (images) -> audio convert --kind conversations -> encode
(audio) -> sft -> merge --strip-reasoning, with the bundled chat tokenizer (mmtok/data/demo/chat-tokenizer,
made by benchmarks/make_demo_chat_tokenizer.py). It needs the audio flow's codec, so --no-audio leaves it out.
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

from mmtok.commands.report import print_summary
from mmtok.errors import MmtokError
from mmtok.formats import skips
from mmtok.formats.merged import SUMMARY_FILE as MERGE_SUMMARY
from mmtok.fsutil import atomic_write_json, read_json_object, read_regular_file, refuse_out_overlapping

DEMO_DATA = Path(__file__).resolve().parents[1] / "data" / "demo"
CHAT_TOKENIZER = DEMO_DATA / "chat-tokenizer"  # a small BPE with an Apertus 1.5-format chat template
SOURCES = Path(__file__).resolve().parents[2] / "manifests"  # the checkout's source declarations
MARKER = "MMTOK_DEMO"  # the demo's ownership record: which names in --out it wrote
MARKER_FORMAT = "mmtok-demo/1"
LEGACY_MARKER = b"written by `mmtok demo`; safe to delete\n"
WRITES = ("checkpoints", "shards", "manifest", "curation", "plan", "encoded", "audio", "sft")  # every name in --out
LEGACY_WRITES = ("checkpoints", "shards", "manifest", "plan", "encoded", "audio", "sft")  # what LEGACY_MARKER owns
POLICY = DEMO_DATA / "curation-policy.yaml"
BENCH_IMAGE = "rocket.jpg"  # the bundled photo the demo benchmark holds a half-size copy of
LOOPING_CAPTION = "A galaxy field a galaxy field a galaxy field a galaxy field a galaxy field a galaxy field."


def run_demo(out: Path, *, world_size: int = 2, image_checkpoint: str | None = None,
             audio_checkpoint: str | None = None, audio: bool = True) -> dict:
    """Run the demo into `out` (an earlier demo's output there is replaced, nothing else) and return its
    summary."""
    from mmtok.codecs import registry

    started = time.monotonic()
    _prepare(out, [image_checkpoint, audio_checkpoint if audio else None])
    random_weights = not (image_checkpoint and (audio_checkpoint or not audio))
    if image_checkpoint is None:
        image = registry.plugin("emu3.5")
        image_checkpoint = str(image.write_random_checkpoint(out / "checkpoints" / "emu3.5-tiny-random"))
    summary = {"images": _image_flow(out, world_size, image_checkpoint)}
    if audio:
        if audio_checkpoint is None:
            sound = registry.plugin("wavtokenizer")
            audio_checkpoint = str(sound.write_random_checkpoint(out / "checkpoints" / "wavtokenizer-tiny-random"))
        summary["audio"] = _audio_flow(out, world_size, audio_checkpoint)
        summary["sft"] = _sft_flow(out, world_size, image_checkpoint, audio_checkpoint)
    summary["seconds"] = round(time.monotonic() - started, 1)
    _print_summary(out, summary, random_weights)
    return summary


def _prepare(out: Path, inputs: list[str | None]) -> None:
    """Make `out` ready for a new demo, deleting only what an earlier demo wrote there (the names its
    MARKER lists); what else is in `out` stays. An `out` that holds an input, or that is not empty and not an
    earlier demo output, is refused before anything is touched."""
    if not SOURCES.is_dir():
        raise MmtokError(f"the demo needs the source checkout's manifests/ ({SOURCES}); install with "
                         "`pip install -e .` from the repository")
    refuse_out_overlapping(out, inputs)
    owned = _owned(out)
    foreign = [name for name in WRITES if (out / name).is_symlink() or
               ((out / name).exists() and name not in owned)]
    if foreign:
        raise MmtokError(f"{out} holds {', '.join(foreign)}, which no earlier demo wrote there; the demo writes "
                         f"{', '.join(WRITES)}: move them or pass another --out")
    for name in owned & set(WRITES):
        if (out / name).is_dir():
            shutil.rmtree(out / name)
        else:
            (out / name).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    # Claimed before anything is written: from here on, these names in `out` are the demo's.
    atomic_write_json(out / MARKER, {"format": MARKER_FORMAT, "written_by": "mmtok demo; safe to delete",
                                     "wrote": list(WRITES)})


def _owned(out: Path) -> set[str]:
    """The top-level names an earlier demo wrote into `out` (its MARKER says which); refuses an `out` that
    holds something else and no MARKER."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return set()
    if not (out / MARKER).is_file():
        raise MmtokError(f"{out} exists and is not an earlier demo output; pass another --out")
    marker = read_regular_file(out / MARKER)
    if marker == LEGACY_MARKER:  # a demo before the list: it wrote exactly these
        return set(LEGACY_WRITES)
    record = read_json_object(out / MARKER)
    if record.get("format") != MARKER_FORMAT or not isinstance(record.get("wrote"), list):
        raise MmtokError(f"{out / MARKER}: not a demo marker this version reads; pass another --out")
    return {name for name in record["wrote"] if isinstance(name, str)}


def _mmtok(*argv: str) -> None:
    """Run one mmtok command in this process, echoing it like a shell would."""
    from mmtok.cli import main

    print(f"\n$ mmtok {' '.join(argv)}", flush=True)  # the transcript is stdout, with the inspect views
    status = main(list(argv))
    if status != 0:
        raise MmtokError(f"demo step `mmtok {' '.join(argv)}` failed with exit status {status}")


def build_image_shards(directory: Path) -> list[Path]:
    """Two WebDataset shards of the bundled photos (jpg/png + txt caption); shard 1 ends with a sample whose
    caption loops (a crop of a photo) and a truncated JPEG."""
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
                _add(tar, "looping_caption.jpg", _jpeg(_photo("hubble_deep_field.jpg", crop=True)))
                _add(tar, "looping_caption.txt", LOOPING_CAPTION.encode())
                damaged = (DEMO_DATA / "images" / "astronaut.jpg").read_bytes()
                _add(tar, "truncated_download.jpg", damaged[: len(damaged) // 3])
                _add(tar, "truncated_download.txt", b"A download that stopped a third of the way through.")
        shards.append(path)
    return shards


def build_benchmark_shard(directory: Path) -> Path:
    """A benchmark of one image: a half-size copy of a bundled photo (its bytes differ, its pHash does not by
    much), as a benchmark's test image scraped into a training set would be."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "bench-000000.tar"
    image = _photo(BENCH_IMAGE)
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, "question-0017.jpg", _jpeg(image.resize((image.width // 2, image.height // 2))))
        _add(tar, "question-0017.txt", b"What is launching in this picture?")
    return path


def _photo(name: str, crop: bool = False):
    from PIL import Image

    with Image.open(DEMO_DATA / "images" / name) as image:
        image = image.convert("RGB")
    return image.crop((0, 0, image.width // 2, image.height // 2)) if crop else image


def _jpeg(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=90)
    return buffer.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), 0, 0o644
    tar.addfile(info, io.BytesIO(data))


def _image_flow(out: Path, world_size: int, checkpoint: str) -> dict:
    build_image_shards(out / "shards")
    _mmtok("scan", "--source", str(SOURCES / "demo-images.yaml"), "--root", str(out), "--out", str(out / "manifest"))
    curation = _curation(out / "curation", out / "manifest")
    _mmtok("plan", str(out / "manifest"), "--preset", "demo", "--world-size", str(world_size),
           "--exclude", str(out / "curation" / "dedup"), "--out", str(out / "plan"))
    for rank in range(world_size):
        _mmtok("encode", "--plan", str(out / "plan"), "--codec", "emu3.5", "--checkpoint", checkpoint,
               "--out", str(out / "encoded"), "--rank", str(rank), "--world-size", str(world_size),
               "--loader-threads", "2")
    _mmtok("merge", str(out / "encoded"))
    _mmtok("inspect", str(out / "encoded" / "merged"), "--limit", "2")
    return {**MERGE_SUMMARY.read(out / "encoded"), "curation": curation}


def _curation(curation: Path, manifest: Path) -> dict:
    """Hash the images (and measure their captions), hash the benchmark's, and list what to drop, with the
    report (curation/dedup/report/index.md); returns the list's counts of the demo's source."""
    tar = build_benchmark_shard(curation / "benchmark")
    _mmtok("scan", str(tar), "--out", str(curation / "benchmark-manifest"), "--no-progress")
    _mmtok("hash", str(manifest), "--source", "demo-images", "--out", str(curation / "demo-images.h"),
           "--workers", "1", "--no-progress")
    _mmtok("hash", str(curation / "benchmark-manifest"), "--source", "demo-bench", "--out",
           str(curation / "demo-bench.h"), "--workers", "1", "--no-progress")
    _mmtok("dedup", str(curation / "demo-images.h"), "--policy", str(POLICY), "--against",
           str(curation / "demo-bench.h"), "--report", "--out", str(curation / "dedup"))
    return read_json_object(curation / "dedup" / "dedup.json")["counts"]["demo-images"]


def _audio_flow(out: Path, world_size: int, checkpoint: str) -> dict:
    audio = out / "audio"
    _mmtok("audio", "convert", "--source", str(SOURCES / "demo-speech.yaml"), "--out", str(audio / "shar"),
           "--no-progress")
    for rank in range(world_size):
        _mmtok("encode", "--modality", "audio", "--shar", str(audio / "shar"), "--codec", "wavtokenizer",
               "--checkpoint", checkpoint, "--out", str(audio / "encoded"), "--rank", str(rank),
               "--world-size", str(world_size), "--num-workers", "0", "--no-progress")
    _mmtok("merge", str(audio / "encoded"))
    _mmtok("audio", "interleave", str(audio / "encoded"), "--out", str(audio / "interleaved"), "--no-progress")
    _mmtok("inspect", str(audio / "encoded" / "merged"), "--limit", "1")
    return MERGE_SUMMARY.read(audio / "encoded")


# -- SFT conversations --------------------------------------------------------------------------------
def bundled_table(name: str, key: str, value: str) -> dict[str, str]:
    """{row[key]: row[value]} of a bundled jsonl table (captions.jsonl, audio/transcripts.jsonl), in file order."""
    return {row[key]: row[value] for row in map(json.loads, (DEMO_DATA / name).read_text("utf-8").splitlines())}


def demo_conversations() -> list[tuple[str, dict, list[tuple[str, Path]]]]:
    """The demo's SFT conversations: (sample key, KEY.json record, media members as (name after `KEY.`,
    bundled file)), in tar order. The answers quote the bundled captions and transcripts, so what the
    assistant says is true of the media. Every one is in a form the official Apertus 1.5 chat template renders
    too (Apertus `parts`/`blocks` or strings, tool-call arguments as JSON text). The last one types two audio
    placeholders for one clip: `mmtok sft` skips it as placeholder_mismatch."""
    captions = bundled_table("captions.jsonl", "file", "caption")
    speech = bundled_table("audio/transcripts.jsonl", "path", "text")
    images, audio = DEMO_DATA / "images", DEMO_DATA / "audio"
    catalogue = {"name": "find_photo", "description": "Find a bundled demo photo by what it shows.",
                 "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
    return [
        ("photo_and_speech", {"messages": [  # Apertus parts: an image and a spoken clip, both tar members
            {"role": "user", "content": {"parts": [
                {"type": "image", "image": "0.jpg"},
                {"type": "text", "text": " What does the speaker say, and what is in this photo? "},
                {"type": "audio", "audio": "1.flac"}]}},
            {"role": "assistant", "content": f"The speaker says: \"{speech['talk_en_00.flac']}\" "
                                             f"The photo: {captions['astronaut.jpg']}"}]},
         [("0.jpg", images / "astronaut.jpg"), ("1.flac", audio / "talk_en_00.flac")]),
        ("speech_only", {"messages": [  # typed placeholders: the sample's clips in stored order
            {"role": "system", "content": "Transcribe what is said, in its language."},
            {"role": "user", "content": "<|audio|>"},
            {"role": "assistant", "content": speech["talk_de_00.flac"]},
            {"role": "user", "content": "And this one? <|audio|>"},
            {"role": "assistant", "content": speech["talk_fr_00.flac"]}]},
         [("0.flac", audio / "talk_de_00.flac"), ("1.flac", audio / "talk_fr_00.flac")]),
        ("tool_and_thoughts", {"enable_thinking": True, "tools": [catalogue], "messages": [  # Apertus parts/blocks
            {"role": "user", "content": {"parts": [
                {"type": "image", "image": "0.jpg"},
                {"type": "text", "text": " Which of the demo photos is this? Check the catalogue."}]}},
            {"role": "assistant", "content": {"blocks": [
                {"type": "thoughts", "text": "A tabby cat looking to the side; the catalogue can name the file."},
                {"type": "tool_calls", "calls": [  # arguments as JSON text: the official template joins strings
                    {"name": "find_photo", "arguments": json.dumps({"query": "tabby cat"})}]},
                {"type": "tool_outputs", "outputs": [
                    {"output": json.dumps({"file": "chelsea.jpg", "caption": captions["chelsea.jpg"]})}]},
                {"type": "thoughts", "text": " One match, and its caption fits the photo."},
                {"type": "response", "text": f"It is chelsea.jpg: {captions['chelsea.jpg']}"}]}}]},
         [("0.jpg", images / "chelsea.jpg")]),
        ("two_placeholders_one_clip", {"messages": [
            {"role": "user", "content": "Is this the same voice twice? <|audio|> <|audio|>"},
            {"role": "assistant", "content": "Yes."}]},
         [("0.flac", audio / "talk_it_00.flac")]),
    ]


def build_conversation_shard(directory: Path) -> Path:
    """One WebDataset tar of the demo's conversations: KEY.json + KEY.<name> media members per sample."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "demo-chat-000000.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for key, record, media in demo_conversations():
            _add(tar, f"{key}.json", json.dumps(record, ensure_ascii=False).encode())
            for name, file in media:
                _add(tar, f"{key}.{name}", file.read_bytes())
    return path


def _sft_flow(out: Path, world_size: int, image_checkpoint: str, audio_checkpoint: str) -> dict:
    sft, tokenizer = out / "sft", str(CHAT_TOKENIZER)
    conversations = str(build_conversation_shard(sft / "convs"))
    _mmtok("scan", conversations, "--out", str(sft / "manifest"), "--workers", "1", "--no-progress")
    _mmtok("plan", str(sft / "manifest"), "--preset", "demo", "--mode", "sft", "--text-tokenizer", tokenizer,
           "--world-size", str(world_size), "--out", str(sft / "plan"), "--quiet")
    for rank in range(world_size):
        _mmtok("encode", "--plan", str(sft / "plan"), "--codec", "emu3.5", "--checkpoint", image_checkpoint,
               "--out", str(sft / "images"), "--rank", str(rank), "--world-size", str(world_size),
               "--loader-threads", "2", "--no-progress")
    _mmtok("audio", "convert", "--kind", "conversations", conversations, "--text-tokenizer", tokenizer,
           "--out", str(sft / "converted"), "--workers", "1", "--no-progress")
    _mmtok("encode", "--modality", "audio", "--shar", str(sft / "converted"), "--codec", "wavtokenizer",
           "--checkpoint", audio_checkpoint, "--text-tokenizer", tokenizer, "--out", str(sft / "audio"),
           "--num-workers", "0", "--no-progress")
    _mmtok("sft", conversations, "--text-tokenizer", tokenizer, "--images", str(sft / "images"),
           "--audio", str(sft / "audio"), "--converted", str(sft / "converted"), "--out", str(sft / "dataset"),
           "--no-progress")
    _mmtok("merge", str(sft / "dataset"), "--strip-reasoning")
    _mmtok("inspect", str(sft / "dataset" / "merged"), "--text-tokenizer", tokenizer, "--limit", "3")
    return MERGE_SUMMARY.read(sft / "dataset")


def _print_summary(out: Path, summary: dict, random_weights: bool) -> None:
    lines = [f"done in {summary['seconds']} s", _images_line(summary["images"])]
    if "audio" in summary:
        lines += [_audio_line(summary["audio"]), _sft_line(summary["sft"])]
    lines.append(_curation_line(summary["images"]["curation"], out / "curation" / "dedup" / "report" / "index.md"))
    lines.append(f"image dataset: {out / 'encoded' / 'merged'}.bin/.idx  (Megatron --data-path "
                 f"{out / 'encoded' / 'merged'})")
    if "audio" in summary:
        lines.append(f"audio dataset: {out / 'audio' / 'encoded' / 'merged'}.bin/.idx; interleaved: "
                     f"{out / 'audio' / 'interleaved'}")
    if "sft" in summary:
        sft = out / "sft" / "dataset"
        lines.append(f"sft dataset: {sft / 'merged'}.bin/.idx; without reasoning: {sft / 'merged_no_reasoning'}"
                     f".bin/.idx; skips named in {sft / 'merged.skipped.jsonl'}")
    if random_weights:
        lines.append("note: the codecs were tiny random-weight checkpoints (real formats, meaningless tokens); pass "
                     "--image-checkpoint / --audio-checkpoint with the official Emu3.5 and WavTokenizer files for "
                     "real tokens.")
    print_summary("demo", lines)


def _skipped(counts: dict, unit: str) -> str:
    """`skipped N UNIT(s): reason n, ...` of a merge's counts, or `none skipped`."""
    reasons = dict(sorted(skips.by_reason(counts).items()))
    total = sum(reasons.values())
    if not total:
        return f"no {unit} skipped"
    return f"{total} {unit}{'s' if total != 1 else ''} skipped ({', '.join(f'{k} {v}' for k, v in reasons.items())})"


def _images_line(merged: dict) -> str:
    counts = merged["counts"]
    return (f"images: {counts.get('images_written', 0)} images in {counts.get('documents_written', 0)} caption "
            f"documents, {merged['tokens']:,} tokens; {_skipped(counts, 'image')}")


def _curation_line(counts: dict, report: Path) -> str:
    by_rule = counts["by_rule"]
    flagged = sum(n for rule, n in by_rule.items() if rule.startswith("caption_"))
    duplicates = counts["dropped"] - by_rule["benchmark"] - flagged
    return (f"curation: of {counts['hashed']} images hashed, dropped before the GPUs: {by_rule['benchmark']} matching "
            f"the benchmark, {flagged} flagged by its caption, {duplicates} duplicates; see {report}")


def _audio_line(merged: dict) -> str:
    counts = merged["counts"]
    return (f"audio: {counts.get('encoded', 0)} of {counts.get('clips', 0)} clips encoded, {merged['sequences']} "
            f"sequences, {merged['tokens']:,} tokens; {_skipped(counts, 'clip')}")


def _sft_line(merged: dict) -> str:
    counts = merged["counts"]
    return (f"sft: {counts.get('documents_written', 0)} of {counts.get('conversations', 0)} conversations written "
            f"({counts.get('images_written', 0)} images, {counts.get('audio_written', 0)} audio clips), "
            f"{merged['tokens']:,} tokens; {_skipped(counts, 'conversation')}")
