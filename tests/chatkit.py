"""Test support for SFT conversations: fake media stores for `mmtok.sft.build.ConversationBuilder`, and the
omni chat tokenizer's pieces (its special tokens and a chat template in the Apertus 1.5 layout).

The stores have the methods the builder calls on `mmtok.sft.build.ImageItems` and `mmtok.sft.build.AudioClips`.
The template is written from the published Apertus 1.5 template's facts; `test_formats_chat.py` says what it
renders and pins its token layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mmtok.errors import Skip
from mmtok.formats.conversations import Conversation
from mmtok.sft.build import DEFAULT_MAX_TOKENS, ConversationBuilder
from mmtok.text import TextTokenizer
from mmtok.vocab import VocabLayout


# -- fake media stores ---------------------------------------------------------------------------
class ImageStore:
    """A fake image encode output: a block, or the Skip to raise, per (tar, sample key, image index). A
    sample's image count is its number of entries unless `counts` says otherwise."""

    def __init__(self, blocks: dict[tuple[str, str, int], np.ndarray | Skip],
                 counts: dict[tuple[str, str], int] | None = None):
        self.blocks = blocks
        self.counts = counts or {}

    def images_of(self, tar: str, key: str) -> int:
        return self.counts.get((tar, key), sum(entry[:2] == (tar, key) for entry in self.blocks if len(entry) == 3))

    def block(self, tar: str, member: str, source=None) -> np.ndarray:
        """By (tar, member) when the store names the member, else member KEY.N.ext as (tar, KEY, N); `source`
        (where its bytes are now) is not checked: this store has no bytes."""
        if (tar, member) in self.blocks:
            return _stored(self.blocks, (tar, member))
        key, number, _ = member.split(".", 2)
        return _stored(self.blocks, (tar, key, int(number)))


class AudioStore:
    """A fake audio token cache: a block, or the Skip to raise, per cut id."""

    def __init__(self, blocks: dict[str, np.ndarray | Skip] | None = None):
        self.blocks = blocks or {}

    def block(self, cut_id: str, source=None) -> np.ndarray:
        return _stored(self.blocks, cut_id)


def _stored(blocks: dict, where) -> np.ndarray:
    found = blocks.get(where)
    if found is None:
        raise Skip("missing_media", f"{where} is not in the store")
    if isinstance(found, Skip):
        raise found
    return found


def image_block(tokenizer: TextTokenizer, seed: int, shape: tuple[int, int] = (2, 3)) -> np.ndarray:
    """A real image block (random codes) in the tokenizer's vocabulary layout."""
    codes = np.random.default_rng(seed).integers(0, 1000, shape)
    return VocabLayout(text_size=tokenizer.vocab_size).image_block(codes, tokenizer.encode(f"{shape[0]}*{shape[1]}"))


def audio_block(tokenizer: TextTokenizer, seed: int, length: int = 5) -> np.ndarray:
    """A real audio block (random codes) in the tokenizer's vocabulary layout."""
    codes = np.random.default_rng(seed).integers(0, 4096, length)
    return VocabLayout(text_size=tokenizer.vocab_size).audio_block(codes)


def tar_conversation(record: dict, members: list[str], key: str = "k", tar: str = "t.tar") -> Conversation:
    """The conversation of sample `key` of `tar` whose members are `key.` + each of `members`, in order."""
    return Conversation(id=f"{tar.removesuffix('.tar')}/{key}", origin=f"{tar}:{key}", input=0, record=record,
                        tar=tar, key=key, members={f"{key}.{m}": (10 * i, 10) for i, m in enumerate(members)})


def build(tokenizer, conversation, images=None, audio=None, max_tokens=DEFAULT_MAX_TOKENS):
    return ConversationBuilder(tokenizer, images, audio or AudioStore(), max_tokens).build(conversation)


def built_skip(tokenizer, conversation, images=None, audio=None, max_tokens=DEFAULT_MAX_TOKENS) -> Skip:
    with pytest.raises(Skip) as caught:
        build(tokenizer, conversation, images, audio, max_tokens)
    return caught.value


# -- the omni chat tokenizer -----------------------------------------------------------------------
CHAT_TOKENS = [
    "<|user_start|>", "<|user_end|>", "<|audio|>", "<|assistant_start|>", "<|assistant_end|>",
    "<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>", "<|image|>",
    "<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>", "<|tools_suffix|>",
    "<|tool_output_start|>", "<|tool_output_end|>",
]
DEFAULT_SYSTEM = "You are a test assistant that sees images and hears audio."
WEATHER_TOOL = {"name": "weather", "parameters": {"city": "string"}}

TEMPLATE = r"""
{{- bos_token -}}
{%- if messages[0].role == 'system' -%}
  {%- set system = messages[0].content -%}
  {%- if system is mapping and 'text' in system -%}{%- set system = system.text -%}{%- endif -%}
  {%- if system is not string -%}{{- raise_exception('system content: a string or {"text": ...}') -}}{%- endif -%}
  {%- set turns = messages[1:] -%}
{%- else -%}
  {%- set system = '""" + DEFAULT_SYSTEM + r"""' -%}
  {%- set turns = messages -%}
{%- endif -%}
{{- '<|system_start|>' ~ system ~ '<|system_end|>' -}}
{{- '<|developer_start|>Deliberation: ' ~ ('enabled' if enable_thinking else 'disabled') ~ '\n' -}}
{%- if tools -%}
  {{- 'Tool Capabilities:\n' -}}
  {%- for tool in tools -%}{{- tool | tojson -}}{%- if not loop.last -%}{{- '\n' -}}{%- endif -%}{%- endfor -%}
{%- else -%}
  {{- 'Tool Capabilities: disabled' -}}
{%- endif -%}
{{- '<|developer_end|>' -}}
{%- macro calls(list) -%}
  {{- '<|tools_prefix|>[' -}}
  {%- for call in list -%}
    {%- set call = call.function if call.function else call -%}
    {{- '{"' ~ call.name ~ '": ' ~ call.arguments ~ '}' -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
  {%- endfor -%}
  {{- ']<|tools_suffix|>' -}}
{%- endmacro -%}
{%- set turn = namespace(assistant=false, tool=false, thinking=false, awaiting=false) -%}
{%- for message in turns -%}
  {%- if message.role == 'user' -%}
    {%- if turn.tool -%}{{- '<|tool_output_end|>' -}}{%- set turn.tool = false -%}{%- endif -%}
    {%- if turn.assistant -%}{{- '<|assistant_end|>' -}}{%- set turn.assistant = false -%}{%- endif -%}
    {%- set turn.thinking = false -%}
    {{- '<|user_start|>' -}}
    {%- if message.content is string -%}
      {{- message.content -}}
    {%- elif message.content is mapping and 'parts' in message.content -%}
      {%- for part in message.content.parts -%}
        {%- if part.type == 'text' -%}{{- part.text -}}
        {%- elif part.type in ('image', 'image_url', 'input_image') -%}{{- '<|image|>' -}}
        {%- elif part.type in ('audio', 'audio_url', 'input_audio') -%}{{- '<|audio|>' -}}
        {%- else -%}{{- raise_exception('user part ' ~ part.type) -}}{%- endif -%}
      {%- endfor -%}
    {%- else -%}
      {{- raise_exception('user content: a string or {"parts": [...]}') -}}
    {%- endif -%}
    {{- '<|user_end|>' -}}
  {%- elif message.role == 'assistant' -%}
    {%- if not turn.assistant -%}{{- '<|assistant_start|>' -}}{%- set turn.assistant = true -%}{%- endif -%}
    {%- if turn.tool -%}{{- '<|tool_output_end|>' -}}{%- set turn.tool = false -%}{%- endif -%}
    {%- if message.content is string -%}
      {{- message.content -}}
    {%- elif message.content is mapping and 'blocks' in message.content -%}
      {%- for block in message.content.blocks -%}
        {%- if block.type == 'thoughts' -%}
          {%- if not turn.thinking -%}{{- '<|inner_prefix|>' -}}{%- set turn.thinking = true -%}{%- endif -%}
          {{- block.text -}}
        {%- elif block.type == 'response' -%}
          {%- if turn.thinking -%}{{- '<|inner_suffix|>' -}}{%- set turn.thinking = false -%}{%- endif -%}
          {{- block.text -}}
        {%- elif block.type == 'tool_calls' -%}
          {{- calls(block.calls) -}}{%- set turn.awaiting = true -%}
        {%- elif block.type == 'tool_outputs' -%}
          {{- '<|tool_output_start|>' -}}
          {%- for output in block.outputs -%}
            {{- output.output -}}{%- if not loop.last -%}{{- ', ' -}}{%- endif -%}
          {%- endfor -%}
          {{- '<|tool_output_end|>' -}}{%- set turn.awaiting = false -%}
        {%- else -%}
          {{- raise_exception('assistant block ' ~ block.type) -}}
        {%- endif -%}
      {%- endfor -%}
    {%- else -%}
      {{- raise_exception('assistant content: a string or {"blocks": [...]}') -}}
    {%- endif -%}
    {%- if message.tool_calls -%}{{- calls(message.tool_calls) -}}{%- set turn.awaiting = true -%}{%- endif -%}
  {%- elif message.role == 'tool' -%}
    {%- if not turn.assistant -%}{{- raise_exception('tool output outside an assistant turn') -}}{%- endif -%}
    {{- ', ' if turn.tool else '<|tool_output_start|>' -}}
    {{- message.content -}}
    {%- set turn.tool = true -%}{%- set turn.awaiting = false -%}
  {%- else -%}
    {{- raise_exception('role ' ~ message.role) -}}
  {%- endif -%}
{%- endfor -%}
{%- if turn.tool -%}{{- '<|tool_output_end|>' -}}{%- endif -%}
{%- if turn.assistant and not turn.awaiting -%}{{- '<|assistant_end|>' -}}{%- endif -%}
"""


# -- a small `mmtok sft` job without codecs ------------------------------------------------------------
def sft_job(root: Path, tokenizer_dir: Path) -> list[str]:
    """Under `root` (the working directory, so every recorded path is relative): two conversation tars and a
    .jsonl in convs/, the finished image items of a `--mode sft` image encode in img/ (one image failed, one
    never encoded), an audio token cache in aud/ (one clip missing); returns the `mmtok sft` arguments before
    --out. Every file has a fixed mtime, so the job's outputs are the same bytes on every run."""
    from encodekit import write_tar
    from mmtok.formats import audio_cache
    from mmtok.formats.commitlog import PartWriter
    from mmtok.formats.conversations import audio_clip_id
    from mmtok.formats.items import CONTAINERS, image_item, media_digest
    from mmtok.formats.manifest import container_identity
    from mmtok.formats.partdir import part_dir
    from mmtok.text import load_text_tokenizer

    tokenizer = load_text_tokenizer(str(tokenizer_dir))
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    rng = np.random.default_rng(24)
    items, clips, tars = [[], []], [], []
    for stem in ("alpha", "beta"):
        tar, members = f"convs/{stem}.tar", []
        for number in range(7):
            key = f"s{number:02d}"
            images, audio = number % 3, number % 2 == 1
            content = "".join(["<|image|>"] * images + ["<|audio|>"] * audio) + f" Describe sample {number} of {stem}."
            record = {"messages": [{"role": "user", "content": content},
                                   {"role": "assistant", "content": f"It is sample {number}, seen and heard."}]}
            members.append((f"{key}.json", json.dumps(record).encode()))
            photos = [rng.bytes(8) for _ in range(images)]
            members += [(f"{key}.{i}.jpg", photo) for i, photo in enumerate(photos)]
            members += [(f"{key}.0.wav", rng.bytes(8))] * audio
            for i in range(images):
                if (stem, number, i) == ("beta", 4, 1):
                    continue  # never encoded: missing_media
                failure = Skip("decode_error", "truncated JPEG") if (stem, number, i) == ("alpha", 5, 0) else None
                sample = {"key": key, "source": tar, "container": "tar", "member": f"{key}.{i}.jpg",
                          "manifest_row": len(items[0]) + len(items[1]), "document": number, "image_index": i}
                block = None if failure else image_block(tokenizer, int(rng.integers(1 << 30)), (2, 2 + i))
                items[number % 2].append(image_item(sample, failure, block, media_digest(photos[i])))
            if audio and (stem, number) != ("alpha", 3):  # alpha/s03's clip is missing
                codes = rng.integers(0, layout.audio_codebook, 6 + number)
                cut = audio_clip_id(f"{stem}/{key}", 0)
                clips.append({"cut_id": cut, "source_id": cut, "clip": 0, "part": 0, "position": len(clips),
                              "duration": codes.size / 40, "language": None, "target_language": None,
                              "audio_ids": layout.audio_ids(codes), "text_ids": None})
        tars.append(write_tar(root / tar, members))
    jsonl = root / "convs" / "gamma.jsonl"
    jsonl.write_text("".join(json.dumps({"id": ident, "messages": [{"role": "user", "content": f"Say {ident}."},
                                                                    {"role": "assistant", "content": ident}]}) + "\n"
                             for ident in ("g1", "g2", "g1", "g3")) + "not json\n")
    for path in (*tars, jsonl):
        os.utime(path, ns=(1_700_000_000_000_000_000,) * 2)
    containers = {tar: container_identity(root / tar) for tar in ("convs/alpha.tar", "convs/beta.tar")}
    for number, part_items in enumerate(items):
        identity = {"part": number, "num_parts": 2, "modality": "image", "mode": "sft", "plan_fingerprint": "job",
                    "codec": {"name": "emu3.5"}, "text_tokenizer": tokenizer.describe(),
                    "vocab": {"text_size": layout.text_size, "total_size": layout.total_size}, CONTAINERS: containers}
        with PartWriter(part_dir(root / "img", number), identity) as part:
            part.commit(0, [], [], {"deferred": len(part_items)}, items=part_items[::-1])
            part.finish({})
    metadata = {"num_parts": 1, "vocab": layout.to_dict(), "text_tokenizer": tokenizer.describe(), "part": 0,
                "codec": {"name": "wavtokenizer"}, "trim": 5, "format": audio_cache.CACHE_FORMAT}
    audio_cache.write_cache(audio_cache.cache_path(root / "aud", 0), clips, metadata)
    return ["sft", "convs/alpha.tar", "convs/beta.tar", "convs/gamma.jsonl", "--text-tokenizer", str(tokenizer_dir),
            "--images", "img", "--audio", "aud", "--no-progress"]
