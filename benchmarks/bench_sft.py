"""What making SFT conversations in their own ordered CPU pass (`mmtok sft`) costs, against merge's copy rate
and against rendering + tokenizing alone.

    python benchmarks/bench_sft.py [--conversations 5000] [--tars 4] [--repeats 5] [--dir DIR]   # ~2 min here

Builds, under DIR (default: a temporary directory), an SFT corpus and the encoded media `mmtok sft` reads,
written with mmtok's own writers instead of running codecs:
  TOK    tests/encodekit.py's `chat_tokenizer` (its Apertus chat template and special tokens), trained on the
         even-numbered half of Python's pydoc topics instead of its few sentences (about 7,400 ids)
  convs  --tars WebDataset tars of KEY.json conversations and their media members KEY.0.jpg, KEY.1.jpg,
         KEY.0.wav (a few bytes each: the pass reads tar headers and the json, never media bytes). Text is
         drawn from the other half of the topics. Each conversation: a system prompt (30%), a first user turn
         with 1-2 images and, for half, one audio clip (placeholders typed into the text, or OpenAI parts
         naming the members), answers with reasoning spans (`enable_thinking`, half), a tool call and its
         output (20%), then 0-2 text-only exchanges
  IMG    the image encode of a `--mode sft` plan: 2 finished parts of image items (`PartWriter.commit(...,
         items=...)`, records as the encoder writes them, shuffled within a part as shape-sorted batches
         scatter them), blocks of 16x16 to 32x32 codes (256-1024) made by `DocumentBuilder.image_block`
  AUD    an audio encode's token cache (`audio_cache.write_cache`, 4 parts in conversation order), clips of
         40-400 codes under the cut ids `audio_clip_id(C, 0)`; CONV a conversion output with no drops
and times, alternating, --repeats times each:
  sft     `mmtok sft convs/*.tar --text-tokenizer TOK --images IMG --audio AUD --converted CONV --out SFT`
          (one rank, a fresh SFT each time: tokenizer and media indexes loaded, both passes over the tars,
          a durable commit every 256 conversations)
  merge   `mmtok merge SFT` of that output (check, copy, provenance, verify; megatron-core imported before),
          and `mmtok merge SFT --strip-reasoning`
  floor   the same conversations, already parsed in memory: `ChatRenderer.render` + `split_media` + the text
          pieces tokenized and concatenated, no media at all -- the cost any SFT path pays, and what the
          encoder paid when it rendered conversations itself
Best wall and CPU seconds of the repeats (warm page cache). Then one more `mmtok sft` with timers around
ChatRenderer.render, the tokenizer's encode, the image and audio block lookups, reading the conversations
(both passes), loading the media indexes, listing/splitting/locating media references and the part's
commits: each one's share of that run's wall time. Markdown on stdout.

    python benchmarks/bench_sft.py --scale [--scale-media 1000000 ...] [--scale-conversations 20000 ...]
                                   [--baseline DIR]   # DIR: `git archive REV mmtok | tar -x -C DIR`

The scale mode runs each measure in a process of its own, with this checkout's mmtok and, side by side, the
--baseline tree's: (1) the media indexes `mmtok sft` keeps (`ImageIndex` of N x 80% image items on 4 parts,
`AudioClips` of N x 20% clips with source digests on 4 cache parts): build seconds, RSS kept per item and per
clip, RSS at the peak of the image index's build, and the indexes' own `nbytes`; (2) `mmtok sft` (one rank) over
the corpus above of M conversations: a first run, then a rerun of the lost part into the same --out (where the
count is kept): wall seconds and the process's peak RSS.

    python benchmarks/bench_sft.py --ranks 10000000 [...] [--world-size 800] [--media-share 0.1] [--baseline DIR]

The rank mode measures what one rank of a cluster job costs: N of the smallest realistic conversations (a
system prompt, a user turn, an answer; --media-share of them with one image placeholder) in chunks of 10,000
(a JSONL file of the text-only ones with `id`s, then a tar of those with an image and its items in IMG), then
`mmtok sft` as rank 0 of --world-size (first to start: it makes the conversation index), as the last rank into
the same OUT (it finds the index and reads only its range) and as the last rank alone in a fresh OUT (making
the index first), each a process of its own, for this checkout and, side by side, the --baseline tree: wall
and CPU seconds, peak RSS (VmHWM) and, sampled every 5 ms, its anonymous part and its mapped files' pages
(RssAnon, RssFile: an index memory-mapped from OUT is page cache, shared and reclaimable), conversations read
(counted in the child) and rendered.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from unittest import mock

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

import encodekit  # noqa: E402 (tests/encodekit.py: the Apertus-format chat tokenizer, the tar writer)
import mmtok.sft.build  # noqa: E402
from mmtok.cli import main as cli_main  # noqa: E402
from mmtok.documents import DocumentBuilder  # noqa: E402
from mmtok.formats import audio_cache  # noqa: E402
from mmtok.formats.chat import ChatRenderer, split_media  # noqa: E402
from mmtok.formats.commitlog import PartWriter  # noqa: E402
from mmtok.formats.conversations import Conversation, audio_clip_id, read_conversations  # noqa: E402
from mmtok.formats.items import CONTAINERS, media_digest  # noqa: E402
from mmtok.formats.manifest import container_identity  # noqa: E402
from mmtok.formats.partdir import part_dir  # noqa: E402
from mmtok.text import HFTokenizer, load_text_tokenizer  # noqa: E402
from mmtok.vocab import VocabLayout  # noqa: E402

IMAGE_SHAPES = [(16, 16), (16, 24), (24, 16), (20, 20), (16, 32), (32, 16), (24, 24), (24, 32), (32, 24), (32, 32)]
AUDIO_CODES = (40, 400)  # 1-10 s at 40 codes/s
IMAGE_PARTS = 2  # ranks of the image encode
AUDIO_PARTS = 4  # shards of the audio conversion
UNIT_ITEMS = 1024  # image items per committed unit
TOOLS = [{"type": "function", "function": {
    "name": "search_docs", "description": "Search the Python documentation and return the best passage.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}]


# -- the corpus -------------------------------------------------------------------------------------
def topic_words() -> tuple[list[str], np.ndarray]:
    """(training texts, held-out words): pydoc's topics split in two halves, whitespace collapsed."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    train = [" ".join(topics[name].split()) for name in names[::2]]
    held_out = np.array(" ".join(topics[name] for name in names[1::2]).split(), dtype=object)
    return train, held_out


def make_tokenizer(directory: Path, texts: list[str]) -> Path:
    """encodekit's chat tokenizer (template, special tokens, BPE recipe) trained on `texts`."""
    with mock.patch.object(encodekit, "TRAINING_TEXT", texts):
        return encodekit.chat_tokenizer(directory, vocab_size=32_768)


class Writer:
    """Text of n words: a run of consecutive held-out words from a random place."""

    def __init__(self, words: np.ndarray, rng: np.random.Generator):
        self.words, self.rng = words, rng

    def __call__(self, low: int, high: int) -> str:
        count = int(self.rng.integers(low, high + 1))
        start = int(self.rng.integers(0, len(self.words) - count))
        return " ".join(self.words[start:start + count])


def conversation(text: Writer, rng: np.random.Generator, key: str, images: int, audio: bool) -> dict:
    """One conversation record (see the module docstring for the mix)."""
    thinking = bool(rng.random() < 0.5)
    messages = []
    if rng.random() < 0.3:
        messages.append({"role": "system", "content": "You are a helpful assistant. " + text(10, 40)})
    question = text(5, 60)
    if rng.random() < 0.5:  # typed placeholders: the sample's members of each kind, in stored order
        content = "<|image|>\n" * images + ("<|audio|>\n" if audio else "") + question
    else:  # OpenAI-style parts naming the members
        content = [{"type": "image", "image": f"{i}.jpg"} for i in range(images)]
        content += [{"type": "audio", "audio": f"{key}.0.wav"}] if audio else []
        content.append({"type": "text", "text": question})
    messages.append({"role": "user", "content": content})

    def answer(low: int, high: int) -> dict:
        message = {"role": "assistant", "content": text(low, high)}
        if thinking:
            message["reasoning_content"] = text(30, 200)
        return message

    record = {"enable_thinking": thinking}
    if rng.random() < 0.2:
        record["tools"] = TOOLS
        call = {"type": "function", "function": {"name": "search_docs", "arguments": json.dumps({"query": text(3, 8)})}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call],
                      **({"reasoning_content": text(20, 80)} if thinking else {})},
                     {"role": "tool", "content": text(20, 120)}]
    messages.append(answer(40, 300))
    for _ in range(int(rng.integers(0, 3))):
        messages += [{"role": "user", "content": text(5, 60)}, answer(20, 250)]
    return {**record, "messages": messages}


def write_corpus(work: Path, conversations: int, tars: int, seed: int = 0) -> dict:
    """The tars, the tokenizer, the image items and the audio cache under `work`; returns what was built."""
    rng = np.random.default_rng(seed)
    train, held_out = topic_words()
    tok = make_tokenizer(work / "tok", train)
    tokenizer = load_text_tokenizer(str(tok))
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    builder = DocumentBuilder("sft", tokenizer, layout)
    text = Writer(held_out, rng)
    items: list[list[tuple[dict, np.ndarray]]] = [[] for _ in range(IMAGE_PARTS)]
    clips: list[dict] = []
    paths, built = [], Counter()
    for number in range(tars):
        path = (work / "convs" / f"convs-{number:04d}.tar").resolve()
        members = []
        for index in range(number * conversations // tars, (number + 1) * conversations // tars):
            key = f"{index:08d}"
            images, audio = int(rng.integers(1, 3)), bool(rng.random() < 0.5)
            members.append((f"{key}.json", json.dumps(conversation(text, rng, key, images, audio)).encode()))
            photos = [rng.bytes(16) for _ in range(images)]
            members += [(f"{key}.{i}.jpg", photo) for i, photo in enumerate(photos)]
            members += [(f"{key}.0.wav", rng.bytes(16))] if audio else []
            for i in range(images):
                height, width = IMAGE_SHAPES[int(rng.integers(len(IMAGE_SHAPES)))]
                block = builder.image_block(rng.integers(0, layout.image_codebook, (height, width)))
                items[int(rng.integers(IMAGE_PARTS))].append((
                    {"kind": "image", "key": key, "source": str(path), "container": "tar", "member": f"{key}.{i}.jpg",
                     "manifest_row": int(built["images"]), "document": index, "image_index": i,
                     "digest": media_digest(photos[i])}, block))  # what sft checks the member's bytes against
                built.update(images=1, image_tokens=block.size)
            if audio:
                codes = rng.integers(0, layout.audio_codebook, int(rng.integers(AUDIO_CODES[0], AUDIO_CODES[1] + 1)))
                cut = audio_clip_id(f"{path.name.removesuffix('.tar')}/{key}", 0)
                clips.append({"cut_id": cut, "source_id": cut, "clip": 0, "position": len(clips),
                              "duration": codes.size / 40, "language": None, "target_language": None,
                              "audio_ids": layout.audio_ids(codes), "text_ids": None})
                built.update(clips=1, audio_tokens=codes.size + 2)
        paths.append(encodekit.write_tar(path, members))
    write_image_items(work / "img", items, tokenizer, layout, rng, {str(p): container_identity(p) for p in paths})
    write_audio_cache(work / "aud", clips, tokenizer, layout)
    (work / "conv" / "dropped").mkdir(parents=True)  # what `mmtok audio convert` leaves when it dropped nothing
    return {"tars": paths, "tok": tok, "tokenizer": tokenizer, "layout": layout, **built}


def write_image_items(out: Path, items: list[list[tuple[dict, np.ndarray]]], tokenizer, layout: VocabLayout,
                      rng: np.random.Generator | None, containers: dict[str, dict]) -> None:
    """The finished parts of a `--mode sft` image encode holding `items` (the identity keys ImageItems checks),
    shuffled within each part unless `rng` is None."""
    for number, part_items in enumerate(items):
        identity = {"part": number, "num_parts": len(items), "modality": "image", "mode": "sft", CONTAINERS: containers,
                    "plan_fingerprint": "bench-sft", "codec": {"name": "emu3.5", "run": False},
                    "text_tokenizer": tokenizer.describe(),
                    "vocab": {"text_size": layout.text_size, "total_size": layout.total_size,
                              "image_offset": layout.image_offset, "audio_offset": layout.audio_offset}}
        shuffled = part_items if rng is None else [part_items[k] for k in rng.permutation(len(part_items))]
        with PartWriter(part_dir(out, number), identity) as part:
            for unit, start in enumerate(range(0, len(shuffled), UNIT_ITEMS)):
                chunk = shuffled[start:start + UNIT_ITEMS]
                part.commit(unit, [], [], {"deferred": len(chunk)}, items=chunk)
            part.finish({})


def write_audio_cache(out: Path, clips: list[dict], tokenizer, layout: VocabLayout) -> None:
    """AUDIO_PARTS cache parts of `clips`, in order (the metadata AudioClips checks)."""
    metadata = {"num_parts": AUDIO_PARTS, "vocab": layout.to_dict(), "text_tokenizer": tokenizer.describe(),
                "codec": {"name": "wavtokenizer", "run": False}, "trim": 5, "format": audio_cache.CACHE_FORMAT}
    for number in range(AUDIO_PARTS):
        rows = clips[number * len(clips) // AUDIO_PARTS:(number + 1) * len(clips) // AUDIO_PARTS]
        rows = [{**row, "part": number, "position": position} for position, row in enumerate(rows)]
        audio_cache.write_cache(audio_cache.cache_path(out, number), rows, {**metadata, "part": number})


# -- the paths ------------------------------------------------------------------------------------
def run_sft(work: Path, corpus: dict) -> dict:
    """`mmtok sft` into a fresh work/sft; returns the part's counts."""
    shutil.rmtree(work / "sft", ignore_errors=True)
    argv = ["sft", *map(str, corpus["tars"]), "--text-tokenizer", str(corpus["tok"]), "--images", str(work / "img"),
            "--audio", str(work / "aud"), "--converted", str(work / "conv"), "--out", str(work / "sft"),
            "--no-progress"]
    with contextlib.redirect_stderr(io.StringIO()) as said:
        code = cli_main(argv)
    if code:
        raise SystemExit(f"mmtok sft failed ({code}): {said.getvalue()}")
    return json.loads((part_dir(work / "sft", 0) / "stats.json").read_text())["counts"]


def run_merge(work: Path, *flags: str) -> None:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as said:
        code = cli_main(["merge", str(work / "sft"), "--no-progress", *flags])
    if code:
        raise SystemExit(f"mmtok merge failed ({code}): {said.getvalue()}")


def render_and_tokenize(records: list[dict], renderer: ChatRenderer, tokenizer) -> int:
    """The floor: every record rendered, cut at its placeholders, its text tokenized; returns the tokens."""
    tokens = 0
    for record in records:
        pieces = [np.asarray(tokenizer.encode(p), np.int32) for p in split_media(renderer.render(record))
                  if isinstance(p, str)]
        tokens += np.concatenate(pieces).size
    return tokens


def best_of(actions: dict, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Best wall and best CPU seconds (this process) of each action, run alternating `repeats` times."""
    wall = {name: [] for name in actions}
    cpu = {name: [] for name in actions}
    for _ in range(repeats):
        for name, action in actions.items():
            started, started_cpu = time.perf_counter(), time.process_time()
            action()
            wall[name].append(time.perf_counter() - started)
            cpu[name].append(time.process_time() - started_cpu)
    return {n: min(t) for n, t in wall.items()}, {n: min(t) for n, t in cpu.items()}


# -- where the sft pass spends its time --------------------------------------------------------------
class Timers:
    """Wall and CPU seconds spent inside wrapped functions, by name (the wrapped functions do not nest)."""

    def __init__(self):
        self.seconds: Counter = Counter()
        self.cpu: Counter = Counter()

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            started, started_cpu = time.perf_counter(), time.process_time()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[name] += time.perf_counter() - started
                self.cpu[name] += time.process_time() - started_cpu
        return timed

    def wrap_iterator(self, name: str, function):
        """`function`'s iterator, the time of each step counted (not the consumer's time between steps)."""
        def iterate(*args, **kwargs):
            iterator = iter(function(*args, **kwargs))
            while True:
                started, started_cpu = time.perf_counter(), time.process_time()
                try:
                    item = next(iterator)
                except StopIteration:
                    return
                finally:
                    self.seconds[name] += time.perf_counter() - started
                    self.cpu[name] += time.process_time() - started_cpu
                yield item
        return iterate


SHARES = {
    "render": "ChatRenderer.render_pieces (jinja2, split at the media slots)",
    "tokenize": "tokenizer.encode of the text pieces",
    "image lookup": "ImageItems.block (image item ids)",
    "audio lookup": "AudioClips.block (cache row -> audio block; cache parts read)",
    "references": "media references: list, locate",
    "read": "reading the conversations (tar headers + json): the index pass and the rank's range",
    "load": "loading the media indexes (image parts verified, cache index read)",
    "commit": "PartWriter commits + finish (durable writes)",
}


def profile_sft(work: Path, corpus: dict) -> tuple[tuple[float, float], Timers]:
    """One instrumented `mmtok sft`: ((its wall, its CPU seconds), the seconds inside each SHARES entry)."""
    timers = Timers()
    wrap = timers.wrap
    patches = [(ChatRenderer, "render_pieces", wrap("render", ChatRenderer.render_pieces)),
               (HFTokenizer, "encode", wrap("tokenize", HFTokenizer.encode)),
               (mmtok.sft.build.ImageItems, "block", wrap("image lookup", mmtok.sft.build.ImageItems.block)),
               (mmtok.sft.build.AudioClips, "block", wrap("audio lookup", mmtok.sft.build.AudioClips.block)),
               (mmtok.sft.build.ImageItems, "__init__", wrap("load", mmtok.sft.build.ImageItems.__init__)),
               (mmtok.sft.build.AudioClips, "__init__", wrap("load", mmtok.sft.build.AudioClips.__init__)),
               (Conversation, "media", wrap("references", Conversation.media)),
               (mmtok.sft.build, "locate", wrap("references", mmtok.sft.build.locate)),
               (mmtok.formats.conversation_index, "input_records",
                timers.wrap_iterator("read", mmtok.formats.conversation_index.input_records)),
               (PartWriter, "commit", wrap("commit", PartWriter.commit)),
               (PartWriter, "finish", wrap("commit", PartWriter.finish))]
    with contextlib.ExitStack() as stack:
        for owner, name, replacement in patches:
            stack.enter_context(mock.patch.object(owner, name, replacement))
        started, started_cpu = time.perf_counter(), time.process_time()
        run_sft(work, corpus)
        return (time.perf_counter() - started, time.process_time() - started_cpu), timers


# -- the report -----------------------------------------------------------------------------------
def bench(work: Path, conversations: int, tars: int, repeats: int) -> None:
    started = time.perf_counter()
    corpus = write_corpus(work, conversations, tars)
    built = time.perf_counter() - started
    tokenizer = corpus["tokenizer"]
    records = [c.record for c in read_conversations(corpus["tars"])]
    renderer = ChatRenderer.from_tokenizer(tokenizer)
    floor_tokens = render_and_tokenize(records[:200], renderer, tokenizer)  # warm: jinja2 and the BPE cache
    __import__("megatron.core.datasets.indexed_dataset")  # its one-off import is not merge work
    counts = {}

    def sft() -> None:
        counts.update(run_sft(work, corpus))

    def floor() -> None:
        nonlocal floor_tokens
        floor_tokens = render_and_tokenize(records, renderer, tokenizer)

    actions = {"sft": sft, "merge": lambda: run_merge(work),
               "merge, strip": lambda: run_merge(work, "--strip-reasoning"), "floor": floor}
    wall, cpu = best_of(actions, repeats)
    assert counts["documents_written"] == conversations, counts
    assert counts["images_written"] == corpus["images"] and counts["audio_written"] == corpus["clips"], counts
    merged = json.loads((work / "sft" / "merged.json").read_text())
    tokens = counts["tokens"]
    assert merged["tokens"] == tokens, (merged["tokens"], tokens)
    (profiled, profiled_cpu), inside = profile_sft(work, corpus)
    media = corpus["image_tokens"] + corpus["audio_tokens"]
    print(f"SFT assembly pass: {conversations:,} conversations in {tars} tars, {corpus['images']:,} images "
          f"({corpus['image_tokens']:,} tokens), {corpus['clips']:,} audio clips ({corpus['audio_tokens']:,} tokens); "
          f"{tokens:,} tokens written ({tokens / conversations:,.0f} a conversation, media {media / tokens:.0%}); "
          f"rendering + tokenizing alone gives {floor_tokens:,} text tokens. Text tokenizer: "
          f"{tokenizer.vocab_size:,} ids. Built in {built:.0f} s; best of {repeats}, alternating, warm page cache.\n")
    labels = {"sft": "`mmtok sft` (one rank: load, 2 passes over the tars, render, tokenize, media lookup, commit)",
              "merge": "`mmtok merge` of its output (check, copy, provenance, verify)",
              "merge, strip": "`mmtok merge --strip-reasoning` (the same + the no-reasoning copy)",
              "floor": "floor: render + split + tokenize the same conversations in memory, no media"}
    print("| path | wall s | conversations/s | M tokens/s | ns/token | vs merge (per token) | CPU s | "
          "CPU ns/token |\n|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, label in labels.items():
        count = floor_tokens if name == "floor" else tokens
        print(f"| {label} | {wall[name]:.2f} | {conversations / wall[name]:,.0f} | {count / wall[name] / 1e6:.2f} | "
              f"{1e9 * wall[name] / count:.0f} | {(wall[name] / count) / (wall['merge'] / tokens):.1f}x | "
              f"{cpu[name]:.2f} | {1e9 * cpu[name] / count:.0f} |")
    per_conversation = {name: (1e6 * wall[name] / conversations, 1e6 * cpu[name] / conversations)
                        for name in ("sft", "floor")}
    print(f"\nRatios: sft / merge per token {wall['sft'] / wall['merge']:.0f}x wall, "
          f"{cpu['sft'] / cpu['merge']:.0f}x CPU; sft / floor per conversation {wall['sft'] / wall['floor']:.2f}x "
          f"wall, {cpu['sft'] / cpu['floor']:.2f}x CPU (sft {per_conversation['sft'][0]:,.0f} us a conversation, "
          f"floor {per_conversation['floor'][0]:,.0f} us; CPU {per_conversation['sft'][1]:,.0f} vs "
          f"{per_conversation['floor'][1]:,.0f} us).\n")
    print(f"Where one more `mmtok sft` spends its time (timers around the functions; this run {profiled:.2f} s wall, "
          f"{profiled_cpu:.2f} s CPU; the best untimed run {wall['sft']:.2f} / {cpu['sft']:.2f} s):\n")
    print("| part of the pass | wall s | share | CPU s | share (CPU) | us per conversation (CPU) |\n"
          "|---|---:|---:|---:|---:|---:|")
    rows = [(label, inside.seconds[name], inside.cpu[name]) for name, label in SHARES.items()]
    rows.append(("the rest (tokenizer load, checks, concatenation, provenance and counts, CLI)",
                 profiled - sum(inside.seconds.values()), profiled_cpu - sum(inside.cpu.values())))
    for label, seconds, cpu_seconds in rows:
        print(f"| {label} | {seconds:.2f} | {seconds / profiled:.0%} | {cpu_seconds:.2f} | "
              f"{cpu_seconds / profiled_cpu:.0%} | {1e6 * cpu_seconds / conversations:,.0f} |")


# -- at scale: 10^7 conversations, 10^8 media ------------------------------------------------------
INDEX_CHILD = r"""
import json, sys, time
from pathlib import Path
import pyarrow.parquet  # imported before the first measure: its import is not the index's memory
from mmtok.formats.items import ImageIndex
from mmtok.sft.build import AudioClips
from mmtok.vocab import VocabLayout

def rss(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

images, audio, text_size = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
start, started = rss("VmRSS:"), time.perf_counter()
index = ImageIndex(sorted((images / "parts").glob("part-*")))
image_s, image_rss, image_peak = time.perf_counter() - started, rss("VmRSS:"), rss("VmHWM:")
started = time.perf_counter()
clips = AudioClips([audio], [], VocabLayout(text_size=text_size))
nbytes = [getattr(index, "nbytes", None), getattr(clips, "nbytes", None)]  # the code before has none
print(json.dumps({"nbytes": nbytes, "image_s": image_s, "image_kept": image_rss - start,
                  "image_peak": image_peak - start, "audio_s": time.perf_counter() - started,
                  "audio_kept": rss("VmRSS:") - image_rss, "peak": rss("VmHWM:")}))
"""
PASS_CHILD = r"""
import json, resource, sys, threading, time
import mmtok.formats.conversations as conversations
from mmtok.cli import main

peaks = {"RssAnon:": 0, "RssFile:": 0}  # sampled every 5 ms: the process's own memory apart from mapped files' pages


def sample():
    while True:
        for line in open("/proc/self/status"):
            if line.startswith(tuple(peaks)):
                field, kib = line.split()[:2]
                peaks[field] = max(peaks[field], int(kib) * 1024)
        time.sleep(0.005)


threading.Thread(target=sample, daemon=True).start()

read = [-1]  # records read, where the tree reads them through input_records (not before the conversation index)
if hasattr(conversations, "input_records"):
    import mmtok.formats.conversation_index as index
    read, plain = [0], conversations.input_records

    def counted(*args, **kwargs):
        for found in plain(*args, **kwargs):
            read[0] += 1
            yield found

    conversations.input_records = index.input_records = counted
code = main(sys.argv[1:])
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"peak": int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM:")).split()[1]) * 1024,
                  "cpu": usage.ru_utime + usage.ru_stime, "read": read[0], "anon": peaks["RssAnon:"],
                  "file": peaks["RssFile:"]}))
sys.exit(code)
"""
SCALE_TEXT_SIZE = 32_768
SCALE_ITEMS_PER_COMMIT = 1 << 16


def measured(argv: list[str], tree: Path) -> tuple[float, str]:
    """(wall seconds, stdout) of `argv` run with the mmtok of `tree` first on the path. (The child's own
    rusage would count the bench's pages it was forked with: each child reports its VmHWM itself.)"""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        process = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(tree)}, stdout=out, stderr=err,
                                   cwd=tempfile.gettempdir())  # not the checkout: its mmtok would come first
        status = process.wait()
        wall = time.perf_counter() - started
        out.seek(0)
        err.seek(0)
        if status:
            raise SystemExit(f"{' '.join(argv[:4])} ... failed ({status}): {err.read()[-2000:]}")
        return wall, out.read()


def write_scale_media(work: Path, images: int, clips: int) -> tuple[Path, Path]:
    """IMG: `images` image items (keys and members as a tar corpus names them, 4-id blocks) on 4 parts,
    written a chunk at a time; AUD: `clips` cache clips with source digests on 4 parts."""
    layout = VocabLayout(text_size=SCALE_TEXT_SIZE)
    identity = {"modality": "image", "mode": "sft", CONTAINERS: {}, "plan_fingerprint": "bench-sft-scale",
                "num_parts": IMAGE_PARTS * 2,
                "codec": {"name": "emu3.5", "run": False}}
    block = np.full(4, layout.image_offset, np.int32)
    for number in range(IMAGE_PARTS * 2):
        with PartWriter(part_dir(work / "img", number), {**identity, "part": number}) as part:
            span = range(number * images // (IMAGE_PARTS * 2), (number + 1) * images // (IMAGE_PARTS * 2))
            for unit, start in enumerate(range(span.start, span.stop, SCALE_ITEMS_PER_COMMIT)):
                chunk = [({"kind": "image", "key": f"{n // 10:09d}",
                           "source": f"/data/sft/convs-{n // 100_000:05d}.tar", "container": "tar",
                           "member": f"{n // 10:09d}.{n % 10}.jpg", "manifest_row": n,
                           "document": n // 10, "image_index": n % 10}, block)
                         for n in range(start, min(start + SCALE_ITEMS_PER_COMMIT, span.stop))]
                part.commit(unit, [], [], {"deferred": len(chunk)}, items=chunk)
            part.finish({})
    metadata = {"num_parts": AUDIO_PARTS, "vocab": layout.to_dict(), "codec": {"name": "wavtokenizer", "run": False},
                "trim": 5, "format": audio_cache.CACHE_FORMAT, "text_tokenizer": {"name": "bench"}}
    ids = layout.audio_ids(np.arange(4))
    for number in range(AUDIO_PARTS):
        rows = [{"cut_id": audio_clip_id(f"convs-{n // 100_000:05d}/{n:09d}", 0), "source_id": f"s{n}", "clip": 0,
                 "part": number, "position": position, "duration": 0.1, "language": None, "target_language": None,
                 "audio_ids": ids, "text_ids": None, "source_sha256": hashlib.sha256(b"%d" % n).hexdigest()}
                for position, n in enumerate(range(number * clips // AUDIO_PARTS, (number + 1) * clips // AUDIO_PARTS))]
        audio_cache.write_cache(audio_cache.cache_path(work / "aud", number), rows, {**metadata, "part": number})
    return work / "img", work / "aud"


def scale_indexes(work: Path, media: int, trees: dict[str, Path]) -> list[dict]:
    """The media indexes of `media` media (80% image items, 20% clips) built by each tree, in a process each."""
    images, clips = media * 4 // 5, media // 5
    started = time.perf_counter()
    img, aud = write_scale_media(work / f"media-{media}", images, clips)
    print(f"(media stores of {media:,} media written in {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    rows = []
    for name, tree in trees.items():
        wall, out = measured([sys.executable, "-c", INDEX_CHILD, str(img), str(aud), str(SCALE_TEXT_SIZE)], tree)
        rows.append({"tree": name, "media": media, "images": images, "clips": clips, "wall": wall, **json.loads(out)})
    shutil.rmtree(work / f"media-{media}", ignore_errors=True)
    return rows


def scale_pass(work: Path, conversations: int, trees: dict[str, Path]) -> list[dict]:
    """`mmtok sft` (one rank) over the bench corpus of `conversations` conversations, by each tree in a process of
    its own: a first run, then (where the tree keeps the count in OUT) a rerun of the lost part."""
    corpus_dir = work / f"pass-{conversations}"
    started = time.perf_counter()
    corpus = write_corpus(corpus_dir, conversations, max(1, conversations // 10_000))
    print(f"(corpus of {conversations:,} conversations written in {time.perf_counter() - started:.0f} s)",
          file=sys.stderr)
    rows = []
    for name, tree in trees.items():
        out = corpus_dir / f"sft-{name}"
        argv = [sys.executable, "-c", PASS_CHILD, "sft", *map(str, corpus["tars"]),
                "--text-tokenizer", str(corpus["tok"]), "--images", str(corpus_dir / "img"),
                "--audio", str(corpus_dir / "aud"), "--out", str(out), "--no-progress"]
        for run in ("first run", "rerun of the part"):
            shutil.rmtree(out / "parts", ignore_errors=True)
            wall, said = measured(argv, tree)
            rows.append({"tree": name, "run": run, "conversations": conversations, "wall": wall,
                         "peak": json.loads(said)["peak"], "media": corpus["images"] + corpus["clips"]})
    shutil.rmtree(corpus_dir, ignore_errors=True)
    return rows


def scale(work: Path, media: list[int], conversations: list[int], baseline: Path | None) -> None:
    trees = {"before": baseline, "after": REPO} if baseline else {"after": REPO}
    index_rows = [row for count in media for row in scale_indexes(work, count, trees)]
    print("| media | code | image items | clips | build s | kept B/image item | kept B/clip | peak of the image "
          "index B/item | index nbytes B/medium | process peak MiB |\n"
          "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for row in index_rows:
        nbytes = "" if row["nbytes"][0] is None else f"{sum(row['nbytes']) / row['media']:.0f}"
        print(f"| {row['media']:,} | {row['tree']} | {row['images']:,} | {row['clips']:,} | "
              f"{row['image_s'] + row['audio_s']:.1f} | {row['image_kept'] / row['images']:.0f} | "
              f"{row['audio_kept'] / row['clips']:.0f} | {row['image_peak'] / row['images']:.0f} | {nbytes} | "
              f"{row['peak'] / 2**20:,.0f} |")
    pass_rows = [row for count in conversations for row in scale_pass(work, count, trees)]
    print("\n| conversations | media | code | run | wall s | us/conversation | peak MiB |\n"
          "|---:|---:|---|---|---:|---:|---:|")
    for row in pass_rows:
        print(f"| {row['conversations']:,} | {row['media']:,} | {row['tree']} | {row['run']} | {row['wall']:.1f} | "
              f"{1e6 * row['wall'] / row['conversations']:,.0f} | {row['peak'] / 2**20:,.0f} |")


# -- one cluster rank of a 10^7-conversation job ---------------------------------------------------
RANK_CHUNK = 10_000  # conversations a chunk: one JSONL file of the text-only ones, one tar of those with an image
RANK_POOL = 4_096  # distinct conversation bodies, each written under many ids


def small_conversation(text: Writer, image: bool) -> dict:
    """The smallest realistic conversation: a system prompt, a user turn (an image placeholder first where
    `image`), one answer."""
    return {"messages": [{"role": "system", "content": "You are a helpful assistant. " + text(5, 20)},
                         {"role": "user", "content": ("<|image|>\n" if image else "") + text(5, 40)},
                         {"role": "assistant", "content": text(20, 120)}]}


def write_rank_corpus(work: Path, conversations: int, media_share: float, seed: int = 0) -> dict:
    """`conversations` small conversations in chunks of RANK_CHUNK: per chunk a JSONL file of the text-only
    ones (ids c<ordinal>, bodies drawn from a pool) then a tar of the `media_share` with one image each (4x4
    codes: the pass never reads media bytes, only the items' ids); the tokenizer and the image items."""
    import tarfile

    rng = np.random.default_rng(seed)
    train, held_out = topic_words()
    tok = make_tokenizer(work / "tok", train)
    tokenizer = load_text_tokenizer(str(tok))
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    text = Writer(held_out, rng)
    plain = [json.dumps(small_conversation(text, False))[1:] for _ in range(RANK_POOL)]
    with_image = [json.dumps(small_conversation(text, True)).encode() for _ in range(RANK_POOL)]
    block = DocumentBuilder("sft", tokenizer, layout).image_block(rng.integers(0, layout.image_codebook, (4, 4)))
    items: list[list[tuple[dict, np.ndarray]]] = [[] for _ in range(IMAGE_PARTS)]
    inputs, ordinal = [], 0
    (work / "convs").mkdir(parents=True)
    for chunk, start in enumerate(range(0, conversations, RANK_CHUNK)):
        size = min(RANK_CHUNK, conversations - start)
        media = int(size * media_share)
        path = (work / "convs" / f"c{chunk:05d}.jsonl").resolve()
        with open(path, "w") as lines:
            lines.writelines(f'{{"id": "c{n:09d}", {plain[n % RANK_POOL]}\n'
                             for n in range(start, start + size - media))
        inputs.append(path)
        path = (work / "convs" / f"c{chunk:05d}-media.tar").resolve()
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for n in range(media):
                key = f"{n:06d}"
                members = (f"{key}.json", with_image[(start + n) % RANK_POOL]), (f"{key}.0.jpg", b"\xff" * 16)
                for name, data in members:
                    info = tarfile.TarInfo(name)
                    info.size, info.mtime, info.mode = len(data), 1_700_000_000, 0o644
                    tar.addfile(info, io.BytesIO(data))
                items[ordinal % IMAGE_PARTS].append((
                    {"kind": "image", "key": key, "source": str(path), "container": "tar", "member": f"{key}.0.jpg",
                     "manifest_row": ordinal, "document": ordinal, "image_index": 0,
                     "digest": media_digest(b"\xff" * 16)}, block))
                ordinal += 1
        inputs.append(path)
    write_image_items(work / "img", items, tokenizer, layout, None,
                      {str(p): container_identity(p) for p in inputs if p.suffix == ".tar"})
    return {"inputs": inputs, "tok": tok, "images": ordinal}


def rank_runs(work: Path, conversations: int, world_size: int, media_share: float,
              trees: dict[str, Path]) -> list[dict]:
    """For each tree: `mmtok sft` as rank 0 (first to start: it makes the conversation index -- the baseline
    counted -- then its range), then as the last rank into the same OUT (it finds the index), then the last rank
    alone into a fresh OUT (making it first), each a process of its own. Records read are counted where the tree
    reads them through `input_records` (else the baseline's own rule: its count pass, then every record up to
    the end of its range)."""
    corpus_dir = work / f"ranks-{conversations}"
    started = time.perf_counter()
    corpus = write_rank_corpus(corpus_dir, conversations, media_share)
    print(f"(corpus of {conversations:,} conversations, {corpus['images']:,} with an image, written in "
          f"{time.perf_counter() - started:.0f} s)", file=sys.stderr)
    rows = []
    for name, tree in trees.items():
        items = "UNITS_PER_ITEM" in (tree / "mmtok" / "sft" / "build.py").read_text()  # work items (issue 44)
        final = _last_worker(conversations, world_size) if items else world_size - 1
        for rank, out, found in ((0, "sft", False), (final, "sft", True), (final, "sft-alone", False)):
            argv = [sys.executable, "-c", PASS_CHILD, "sft", *map(str, corpus["inputs"]), "--text-tokenizer",
                    str(corpus["tok"]), "--images", str(corpus_dir / "img"), "--out", str(corpus_dir / f"{name}-{out}"),
                    "--rank", str(rank), "--world-size", str(world_size), "--no-progress",
                    *(["--no-take-over"] if items else [])]  # the worker's own items only: what one rank costs
            wall, said = measured(argv, tree)
            parts = _worker_parts(corpus_dir / f"{name}-{out}", conversations, rank, world_size, items)
            stats = [json.loads((part / "stats.json").read_text()) for part in parts]
            begin, end = (min(unit * mmtok.sft.build.CONVERSATIONS_PER_UNIT, conversations)
                          for unit in (stats[0]["units"][0], stats[-1]["units"][1]))
            counts = Counter()
            for one in stats:
                counts.update(one["counts"])
            child = json.loads(said)
            if child["read"] < 0:
                child["read"] = (0 if found else conversations) + end
            rows.append({"tree": name, "conversations": conversations, "world_size": world_size, "rank": rank,
                         "wall": wall, "index": "found in OUT" if found else "made", "media": corpus["images"],
                         "rendered": end - begin, "written": dict(counts), **child})
            print(f"({name} rank {rank}: {wall:.0f} s)", file=sys.stderr)
    shutil.rmtree(corpus_dir, ignore_errors=True)
    return rows


def _last_worker(conversations: int, world_size: int) -> int:
    """The last worker of `world_size` that has a work item of its own (more workers than items leave some idle)."""
    return min(world_size, len(mmtok.sft.build.work_items(conversations))) - 1


def _worker_parts(out: Path, conversations: int, rank: int, world_size: int, items: bool) -> list[Path]:
    """The parts worker `rank` wrote: those of its own work items (`items`), else the rank's one part."""
    if not items:
        return [part_dir(out, rank)]
    from mmtok.ranks import worker_range

    units = mmtok.sft.build.work_items(conversations)
    return [part_dir(out, item) for item in worker_range(np.array([b - a for a, b in units], np.float64), world_size,
                                                         rank)]


def ranks(work: Path, conversations: list[int], world_size: int, media_share: float, baseline: Path | None) -> None:
    trees = {"before": baseline, "after": REPO} if baseline else {"after": REPO}
    rows = [row for count in conversations for row in rank_runs(work, count, world_size, media_share, trees)]
    print("| tree | conversations | with an image | world size | rank | index (count) | wall s | CPU s | peak MiB | "
          "anon peak MiB | file pages peak MiB | conversations read | rendered |\n"
          "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for row in rows:
        print(f"| {row['tree']} | {row['conversations']:,} | {row['media']:,} | {row['world_size']} | {row['rank']} | "
              f"{row['index']} | {row['wall']:.1f} | {row['cpu']:.1f} | {row['peak'] / 2**20:,.0f} | "
              f"{row['anon'] / 2**20:,.0f} | {row['file'] / 2**20:,.0f} | {row['read']:,} | {row['rendered']:,} |")
    for row in rows:
        print(f"{row['tree']} rank {row['rank']} ({row['index']}): {row['written']}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=5_000)
    parser.add_argument("--tars", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="work directory (default: a temporary one)")
    parser.add_argument("--scale", action="store_true",
                        help="the scale mode: media indexes of --scale-media media, "
                             "the pass over --scale-conversations")
    parser.add_argument("--scale-media", type=int, nargs="*", default=[1_000_000])
    parser.add_argument("--scale-conversations", type=int, nargs="*", default=[20_000])
    parser.add_argument("--ranks", type=int, nargs="*", default=None, metavar="N",
                        help="the rank mode: rank 0 and the last rank of --world-size over N small conversations")
    parser.add_argument("--world-size", type=int, default=800)
    parser.add_argument("--media-share", type=float, default=0.1, help="share of the conversations with an image")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="a tree of the mmtok to compare with, side by side (git archive REV | tar -x -C DIR)")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-sft-", dir=args.dir))
    try:
        if args.ranks:
            ranks(work, args.ranks, args.world_size, args.media_share, args.baseline)
        elif args.scale:
            scale(work, args.scale_media, args.scale_conversations, args.baseline)
        else:
            bench(work, args.conversations, args.tars, args.repeats)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
