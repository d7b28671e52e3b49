"""Test support for encode/merge: a small HF tokenizer in the Apertus chat format, and tar shards.

`chat_tokenizer(dir)` trains a byte-level BPE (the `tokenizers` library) on a few sentences, adds the
Apertus chat special tokens as added tokens (at ids that differ from the real Apertus build, so a
hard-coded id would be caught) and saves tokenizer.json + tokenizer_config.json with a jinja chat
template in the Apertus format (docs/encode.md).
"""

from __future__ import annotations

import contextlib
import io
import json
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np

SPECIAL_TOKENS = [
    "<unk>", "<s>", "</s>", "<pad>",
    "<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>",
    "<|user_start|>", "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|tools_prefix|>", "<|tools_suffix|>", "<|tool_output_start|>", "<|tool_output_end|>",
    "<|inner_prefix|>", "<|inner_suffix|>",
]

# The Apertus chat format: BOS; a system block (empty when there is no system message); a developer
# block with `Deliberation:` and `Tool Capabilities:`; user turns; assistant turns holding reasoning
# (<|inner_prefix|>..<|inner_suffix|>), tool calls (<|tools_prefix|>..<|tools_suffix|>) and tool
# outputs (<|tool_output_start|>..<|tool_output_end|>) until the next user turn.
APERTUS_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if messages[0].role == 'system' -%}"
    "{{- '<|system_start|>' ~ messages[0].content ~ '<|system_end|>' -}}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{{- '<|system_start|><|system_end|>' -}}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{{- '<|developer_start|>Deliberation: ' ~ ('enabled' if enable_thinking else 'disabled') ~ '\\n' -}}"
    "{%- if tools -%}"
    "{{- 'Tool Capabilities:\\n' -}}"
    "{%- for tool in tools -%}{{- tool | tojson -}}{%- if not loop.last -%}{{- '\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- else -%}"
    "{{- 'Tool Capabilities: disabled' -}}"
    "{%- endif -%}"
    "{{- '<|developer_end|>' -}}"
    "{%- set ns = namespace(in_assistant=false) -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message.role == 'user' -%}"
    "{%- if ns.in_assistant -%}{{- '<|assistant_end|>' -}}{%- set ns.in_assistant = false -%}{%- endif -%}"
    "{{- '<|user_start|>' ~ message.content ~ '<|user_end|>' -}}"
    "{%- elif message.role == 'assistant' -%}"
    "{%- if not ns.in_assistant -%}{{- '<|assistant_start|>' -}}{%- set ns.in_assistant = true -%}{%- endif -%}"
    "{%- if message.reasoning_content -%}"
    "{{- '<|inner_prefix|>' ~ message.reasoning_content ~ '<|inner_suffix|>' -}}"
    "{%- endif -%}"
    "{%- if message.content -%}{{- message.content -}}{%- endif -%}"
    "{%- if message.tool_calls -%}"
    "{{- '<|tools_prefix|>' ~ (message.tool_calls | tojson) ~ '<|tools_suffix|>' -}}"
    "{%- endif -%}"
    "{%- elif message.role == 'tool' -%}"
    "{{- '<|tool_output_start|>' ~ message.content ~ '<|tool_output_end|>' -}}"
    "{%- else -%}"
    "{{- raise_exception('unknown role ' ~ message.role) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if ns.in_assistant -%}{{- '<|assistant_end|>' -}}{%- endif -%}"
)

TRAINING_TEXT = [
    "A photo of a cat sitting on a red chair in the afternoon sun.",
    "The astronaut floats above the earth; the rocket waits on the launch pad.",
    "What is in this image? Describe the colours, the objects and the weather.",
    "Let me think step by step about the question before I answer it.",
    "The weather in Zurich is cloudy with a chance of rain, 14 degrees.",
    "Deliberation: enabled disabled. Tool Capabilities: get_weather city name.",
    "0 1 2 3 4 5 6 7 8 9 10 12 16 24 32 48 64 * x",
]


def chat_tokenizer(directory: Path, vocab_size: int = 400) -> Path:
    """Train and save the test tokenizer; returns its directory."""
    return train_chat_tokenizer(directory, vocab_size=vocab_size, special=SPECIAL_TOKENS[:4], added=SPECIAL_TOKENS[4:],
                                texts=TRAINING_TEXT, template=APERTUS_TEMPLATE, indent=2)


def train_chat_tokenizer(directory: Path, *, vocab_size: int, special: list[str], added: list[str], texts: list[str],
                         template: str, indent: int | None = None) -> Path:
    """A byte-level BPE trained on `texts` (x4) with `special` tokens, then `added` tokens, and an HF
    tokenizer_config.json holding `template` as its chat_template; returns `directory`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts * 4, trainer)
    tokenizer.add_special_tokens(added)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=indent))
    return directory


def write_tar(path: Path, members: list[tuple[str, bytes]]) -> Path:
    """A POSIX tar with the given (name, bytes) members in order (deterministic headers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            info.mtime = 1_700_000_000
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
    return path


# -- corpora of real images in tar shards -----------------------------------------------------------
def real_images() -> dict[str, Path]:
    """Small real images of every PIL mode the loaders must handle (RGB, L, RGBA, P/GIF, LA, JPEG, PNG)."""
    from realmedia import mate_photos, skimage_images

    wanted = {"astronaut.png", "camera.png", "chelsea.png", "coffee.png", "coins.png", "color.png", "horse.png",
              "logo.png", "microaneurysms.png", "moon.png", "page.png", "rocket.jpg", "text.png", "phantom.png",
              "no_time_for_that_tiny.gif", "chessboard_RGB.png", "clock_motion.png", "hubble_deep_field.jpg",
              "FreshFlower.jpg", "GreenMeadow.jpg", "Stripes.png"}
    found = {p.name: p for p in skimage_images() + mate_photos() if p.name in wanted}
    assert set(found) == wanted, f"missing test images: {sorted(wanted - set(found))}"
    return found


def caption_corpus(directory: Path, corrupt: bool = False) -> list[Path]:
    """Three tar shards of captioned samples: single images, two-image samples whose images have
    different shapes (so they land in different batches), and -- with `corrupt` -- images whose
    headers are valid but whose pixel data is damaged."""
    images = real_images()
    names = sorted(images)
    in_pairs = ("horse.png", "rocket.jpg", "page.png", "moon.png")
    singles = [(n, images[n].read_bytes()) for n in names if n not in in_pairs]
    singles += converted_images(images)
    shards: list[list[tuple[str, bytes]]] = [[], [], []]
    for i, (name, data) in enumerate(singles):
        key = f"s{i:03d}"
        shards[i % 3] += [(f"{key}.{name.rsplit('.', 1)[1]}", data),
                          (f"{key}.txt", f"  {name.split('.')[0]} in the afternoon sun\n".encode())]
    for i, (first, second) in enumerate([("horse.png", "rocket.jpg"), ("page.png", "moon.png")]):
        key = f"m{i:03d}"
        shards[1] += [(f"{key}.0.{first.rsplit('.', 1)[1]}", images[first].read_bytes()),
                      (f"{key}.1.{second.rsplit('.', 1)[1]}", images[second].read_bytes()),
                      (f"{key}.txt", f"{first} and {second}".encode())]
    if corrupt:
        jpeg, png = images["rocket.jpg"].read_bytes(), images["coffee.png"].read_bytes()
        shards[2] += [("c000.jpg", damaged_jpeg(jpeg)), ("c000.txt", b"a damaged jpeg"),
                      ("c001.png", damaged_png(png)), ("c001.txt", b"a damaged png"),
                      ("c002.0.png", png), ("c002.1.jpg", damaged_jpeg(jpeg)), ("c002.txt", b"one good, one bad")]
    return [write_tar(directory / f"shard-{i}.tar", members) for i, members in enumerate(shards)]


def converted_images(images: dict[str, Path]) -> list[tuple[str, bytes]]:
    """Real photos stored the ways the loaders must undo: EXIF-rotated JPEG (orientation 6: displayed
    sideways, so width and height swap), CMYK JPEG and 16-bit grayscale PNG."""
    from PIL import Image

    def save(image, fmt: str, **options) -> bytes:
        buffer = io.BytesIO()
        image.save(buffer, fmt, **options)
        return buffer.getvalue()

    chelsea = Image.open(images["chelsea.png"]).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to display
    coffee = Image.open(images["coffee.png"]).convert("CMYK")
    camera = Image.fromarray((np.asarray(Image.open(images["camera.png"]).convert("L"), np.uint16) * 257))
    return [("chelsea_rotated.jpg", save(chelsea, "JPEG", quality=90, exif=exif)),
            ("coffee_cmyk.jpg", save(coffee, "JPEG", quality=90)),
            ("camera_16bit.png", save(camera, "PNG"))]


def damaged_jpeg(data: bytes) -> bytes:
    """A JPEG whose headers (SOI..SOS) are intact but whose entropy-coded data stops a third of the way."""
    scan = data.index(b"\xff\xda")
    return data[: scan + (len(data) - scan) // 3]


def damaged_png(data: bytes) -> bytes:
    """A PNG whose IHDR is intact but whose first IDAT chunk has flipped bytes (CRC no longer matches)."""
    idat = data.index(b"IDAT")
    damaged = bytearray(data)
    for i in range(idat + 20, idat + 60):
        damaged[i] ^= 0x5A
    return bytes(damaged)


def interleaved_corpus(directory: Path) -> list[Path]:
    """OBELICS-style samples: a json sidecar with parallel `texts`/`images` lists naming the members."""
    images = real_images()
    samples = [
        ("w000", ["A cat sat on the chair.", None, "Then it slept.", "It woke at noon.", None],
         [None, "0.png", None, None, "1.jpg"], ["chelsea.png", "rocket.jpg"]),
        ("w001", [None, "The astronaut floats above the earth."], ["0.png", None], ["astronaut.png"]),
        ("w002", ["Coins and coffee:", None, None, "That was all."], [None, "1.png", "0.png", None],
         ["coins.png", "coffee.png"]),
    ]
    members = []
    for key, texts, listed, files in samples:
        for index, name in enumerate(files):
            members.append((f"{key}.{index}.{name.rsplit('.', 1)[1]}", images[name].read_bytes()))
        members.append((f"{key}.json", json.dumps({"texts": texts, "images": listed}).encode()))
    return [write_tar(directory / "web-0.tar", members)]


SFT_SAMPLES = [
    ("c000", ["chelsea.png"], {
        "enable_thinking": True,
        "messages": [
            {"role": "user", "content": "<image>\nWhat is in this image?"},
            {"role": "assistant", "reasoning_content": "Let me think step by step about the cat.",
             "content": "A cat sitting on a red chair."}]}),
    ("c001", ["rocket.jpg", "astronaut.png"], {
        "tools": [{"name": "get_weather", "parameters": {"city": "string"}}],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": " and "}, {"type": "image"},
                                         {"type": "text", "text": ": the weather in Zurich?"}]},
            {"role": "assistant", "reasoning_content": "The rocket waits on the launch pad.",
             "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zurich"}}]},
            {"role": "tool", "content": "cloudy, 14 degrees"},
            {"role": "assistant", "content": "Cloudy, 14 degrees."}]}),
    ("c002", ["coffee.png"], {
        "messages": [
            {"role": "user", "content": "Describe <|image|>"},
            {"role": "assistant", "reasoning_content": "Only reasoning here."}]}),
]


def sft_corpus(directory: Path) -> list[Path]:
    images = real_images()
    members = []
    for key, files, conversation in SFT_SAMPLES:
        for index, name in enumerate(files):
            members.append((f"{key}.{index}.{name.rsplit('.', 1)[1]}", images[name].read_bytes()))
        members.append((f"{key}.json", json.dumps(conversation).encode()))
    return [write_tar(directory / "sft-0.tar", members)]


# -- reading documents back -------------------------------------------------------------------------
def parse_block(tokens, start: int, layout, tokenizer):
    """Parse the image block at tokens[start:]; returns (codes [h, w], end). Asserts the image block layout
    (docs/formats.md):
    <|img_start|> "H*W" <|img_token_start|> (W codes <|img_end_of_row|>) x H <|img_end_of_frame|> <|img_end|>."""
    import numpy as np

    special = layout.special_ids()
    tokens = np.asarray(tokens)
    assert tokens[start] == special["<|img_start|>"]
    token_start = start + int(np.flatnonzero(tokens[start:] == special["<|img_token_start|>"])[0])
    frame_end = token_start + int(np.flatnonzero(tokens[token_start:] == special["<|img_end_of_frame|>"])[0])
    width = int(np.flatnonzero(tokens[token_start + 1 : frame_end] == special["<|img_end_of_row|>"])[0])
    grid = tokens[token_start + 1 : frame_end]
    height = grid.size // (width + 1)
    assert grid.size == height * (width + 1)
    grid = grid.reshape(height, width + 1)
    assert (grid[:, width] == special["<|img_end_of_row|>"]).all()
    assert tokens[start + 1 : token_start].tolist() == tokenizer.encode(f"{height}*{width}")
    assert tokens[frame_end + 1] == special["<|img_end|>"]
    codes = grid[:, :width] - layout.image_offset
    assert codes.min() >= 0 and codes.max() < layout.image_codebook
    return codes, frame_end + 2


# One image per batch at 32-48 px: many small batches (many commits), a fast tiny codec.
ONE_IMAGE_BATCHES = ["--min-pixels", "1024", "--max-pixels", "2304", "--min-source-pixels", "100", "--token-budget",
                     "40", "--max-batch-images", "1", "--window-rows", "9", "--mode", "image-text"]


def planned_job(root: Path, corrupt: bool = False):
    """caption_corpus -> scan -> plan (ONE_IMAGE_BATCHES, the small HF tokenizer) under `root`, and a tiny
    random Emu3.5 checkpoint. Returns (plan directory, checkpoint directory)."""
    from mmtok.cli import main
    from mmtok.codecs import emu35

    caption_corpus(root / "data", corrupt=corrupt)
    checkpoint = emu35.write_random_checkpoint(root / "ckpt")
    assert main(["scan", str(root / "data" / "*.tar"), "--out", str(root / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    text = chat_tokenizer(root / "tokenizer")  # loads in milliseconds: restarts stay cheap
    assert main(["plan", str(root / "manifest"), "--out", str(root / "plan"), "--quiet", *ONE_IMAGE_BATCHES,
                 "--text-tokenizer", str(text)]) == 0
    return root / "plan", checkpoint


def planned_items(root: Path, items: int):
    """`planned_job`, planned again into about `items` work items of several batches each (`--item-seconds`).
    Returns (plan directory, checkpoint directory)."""
    from mmtok.cli import main
    from mmtok.formats.plan import Plan

    plan_dir, checkpoint = planned_job(root)
    whole = Plan.open(plan_dir)
    seconds = whole.item_costs().sum() * whole.meta.parameters["cost_model"]["seconds_per_unit"] / items
    plan = root / "plan-items"
    assert main(["plan", str(root / "manifest"), "--out", str(plan), "--quiet", *ONE_IMAGE_BATCHES,
                 "--text-tokenizer", str(root / "tokenizer"), "--item-seconds", str(seconds)]) == 0
    return plan, checkpoint


# -- the caption pipeline on CPU: scan -> plan -> encode -> merge ------------------------------------
# Tiny targets (at most 48x48 pixels = 3x3 codes) and small batches/windows keep the suite fast while
# giving many batches, several shapes, windows, and multi-image documents split across batches.
PLAN_FLAGS = ["--min-pixels", "1024", "--max-pixels", "2304", "--min-source-pixels", "100", "--token-budget", "60",
              "--max-batch-images", "3", "--window-rows", "9"]


@contextlib.contextmanager
def one_torch_thread():
    """The loader threads share this 2-core machine with the CPU "device": OpenMP spinning on a second
    thread makes the tiny codec tens of times slower, so the device gets one thread."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def caption_env(root: Path) -> SimpleNamespace:
    """Under `root`: the tiny random Emu3.5 checkpoint, caption_corpus scanned into a manifest, and the
    small chat tokenizer (`root`, `checkpoint`, `manifest`, `text`): what `plan` and `encode_all` need."""
    from mmtok.cli import main
    from mmtok.codecs import emu35

    checkpoint = emu35.write_random_checkpoint(root / "ckpt")
    caption_corpus(root / "captions")
    assert main(["scan", str(root / "captions" / "*.tar"), "--out", str(root / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    return SimpleNamespace(root=root, checkpoint=checkpoint, manifest=root / "manifest",
                           text=chat_tokenizer(root / "tokenizer"))


def plan(env, name: str, *flags: str, manifest: Path | None = None) -> Path:
    """`mmtok plan` of env's manifest (or `manifest`) with PLAN_FLAGS and env's text tokenizer, then `flags`."""
    from mmtok.cli import main

    out = env.root / name
    assert main(["plan", str(manifest or env.manifest), "--out", str(out), "--quiet", *PLAN_FLAGS,
                 "--text-tokenizer", str(env.text), *flags]) == 0
    return out


def encode_all(env, plan_dir: Path, out: Path, world_size: int, threads: int = 2, extra: tuple = ()) -> Path:
    """Every rank of `plan_dir` encoded on CPU with env's checkpoint into `out`, then merged; returns `out`. The
    ranks run one after another, each on its own items only (--no-take-over: else the first would take them all)."""
    from mmtok.cli import main

    for rank in range(world_size):
        assert main(["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out", str(out),
                     "--rank", str(rank), "--world-size", str(world_size), "--loader-threads", str(threads),
                     "--device", "cpu", "--no-progress", "--no-take-over", *extra]) == 0
    assert main(["merge", str(out)]) == 0
    return out


def gpt_dataset(blend: tuple[list[str], list[float] | None], tokenizer, sequence_length: int, num_samples: int,
                cache: Path, split: str = "100,0,0"):
    """The train split that megatron-core's BlendedMegatronDatasetBuilder builds on CPU for `blend`
    (prefixes, weights or None), as Megatron-LM's pretrain_gpt configures it with default flags."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig

    config = GPTDatasetConfig(random_seed=1234, sequence_length=sequence_length, blend=blend, split=split,
                              tokenizer=tokenizer, reset_position_ids=False, reset_attention_mask=False,
                              eod_mask_loss=False, path_to_cache=str(cache / "gpt-cache"))
    other = None if blend[1] is None else 0  # with weights, Megatron needs a size for every split
    train, _, _ = BlendedMegatronDatasetBuilder(GPTDataset, [num_samples, other, other], lambda: True, config).build()
    return train


def image_items(images: Path) -> dict:
    """(tar name, sample key, image index) -> the image block (int32 array), from the committed image items of
    an image encode output (failed images left out)."""
    import numpy as np

    from mmtok.formats.items import read_items

    items = {}
    for directory in sorted((images / "parts").glob("part-*")):
        records, ids = read_items(directory)
        for record in records:
            if record.get("kind") == "image" and "skip" not in record:
                key = (Path(record["source"]).name, record["key"], int(record["image_index"]))
                items[key] = np.array(ids[record["offset"]:record["offset"] + record["length"]])
    return items


# A sitecustomize.py for the `mmtok encode` processes a test starts (PYTHONPATH): the codec's GATE_AT-th encode
# call of the process (GATE_AT=load: its model load) announces itself (file `arrived` in GATE_DIR) and waits for
# the file `release`, so a signal or another writer lands at a known place, whatever the machine's speed.
GATE = '''
import os, time

def _wait():
    open(os.path.join(os.environ["GATE_DIR"], "arrived"), "w").close()
    while not os.path.exists(os.path.join(os.environ["GATE_DIR"], "release")):
        time.sleep(0.01)

if os.environ.get("GATE_AT"):
    from mmtok.codecs import emu35
    _encode, _load, _calls = emu35.Emu35Codec.encode, emu35.load, [0]

    def _gated(self, pixels):
        _calls[0] += 1
        if _calls[0] == int(os.environ["GATE_AT"]):
            _wait()
        return _encode(self, pixels)

    def _gated_load(*args, **kwargs):  # GATE_AT=load: the signal lands while the model loads
        if os.environ["GATE_AT"] == "load":
            _wait()
        return _load(*args, **kwargs)

    emu35.Emu35Codec.encode, emu35.load = _gated, _gated_load
'''
