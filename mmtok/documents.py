"""The token layouts of what mmtok writes: image documents per plan mode, and audio sequences (below).

Image documents per plan mode: a *template* of text ids and image slots, filled with image blocks.

A document is one sample (one key); it becomes one sequence. Templates are built in the loader
threads (text is tokenized there, off the device's critical path); `assemble` fills them with the
image blocks once every image of the document is encoded. Layouts:

  image        BOS block_0 .. block_n EOS
  image-text   BOS block_0 .. block_n caption EOS                 (image -> text)
  text-image   BOS caption block_0 .. block_n EOS                 (text -> image)
  interleaved  BOS segments in the json sidecar's order EOS       (OBELICS / MINT-1T `texts`/`images`
               parallel lists; a run of consecutive texts is joined with "\\n\\n" and tokenized once)
  sft          no document here: every image is committed as an item and `mmtok sft` makes the
               conversations (with their audio), see `mmtok.sft.build`

text-image puts no `<|img_generation_start|>` between caption and image: the Apertus caption
documents are `BOS caption block EOS`, which is also what the plan counts exactly. The caption is
`mmtok.text.caption_text(txt sidecar)`, the normalisation the plan counted.

Audio sequences, shared by encode and interleave.

With A(c) = <|audio_start|> audio ids of clip c <|audio_end|> and T(c) = the text ids of clip c:

  audio-only      BOS A(c) EOS
  transcription   BOS A(c) <|stt_transcribe|> T(c) EOS
  translation     BOS A(c) <|stt_translate|> T(c) EOS          (the clip's text is in its target language)
  interleaved     BOS s_0 sep s_1 sep ... s_k EOS              s_i alternate between A(.) and T(.);
                  sep is <|stt_continue|> before a text segment (speech -> text) and <|tts_continue|>
                  before an audio segment (text -> speech); s_k is always text.

Exactly one BOS (first token) and one EOS (last token) per sequence; none inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from mmtok.errors import Skip
from mmtok.formats.containers import json_value
from mmtok.formats.presets import CAPTION_MODES, MODES
from mmtok.text import TextTokenizer, caption_text
from mmtok.vocab import VocabLayout

# A template: text ids (int32 arrays) and image slots (the image_index of the block that goes there).
Template = list[Union[np.ndarray, int]]
TEXT_SEPARATOR = "\n\n"  # between consecutive text segments of an interleaved document


class DocumentError(Skip):
    """A document that cannot be built; `reason` is the counted skip reason (snake_case)."""


@dataclass(frozen=True)
class Sidecars:
    """The raw sidecar bytes of one sample (None where the sample has none)."""

    text: bytes | None = None
    json: bytes | None = None


class DocumentBuilder:
    """Builds templates and image blocks for one mode, tokenizer and vocabulary layout (thread-safe)."""

    def __init__(self, mode: str, tokenizer: TextTokenizer, layout: VocabLayout):
        self.mode = mode
        self.tokenizer = tokenizer
        self.layout = layout
        self._bos = np.array([tokenizer.bos_id], np.int32)
        self._eos = np.array([tokenizer.eos_id], np.int32)
        self._dims: dict[tuple[int, int], list[int]] = {}
        self._builders = {"image": self._image, "image-text": self._image_text, "text-image": self._text_image,
                          "interleaved": self._interleaved}
        if mode not in MODES:
            raise ValueError(f"unknown document mode {mode!r}; known: {list(MODES)}")

    @property
    def makes_documents(self) -> bool:
        """False for sft: its images are items only, the conversations are made by `mmtok sft`."""
        return self.mode != "sft"

    @property
    def needs_text(self) -> bool:
        return self.mode in CAPTION_MODES

    @property
    def needs_json(self) -> bool:
        return self.mode == "interleaved"

    def template(self, num_images: int, sidecars: Sidecars) -> Template:
        """The template of a document with `num_images` planned images; DocumentError if unusable."""
        return self._builders[self.mode](num_images, sidecars)

    def image_block(self, codes: np.ndarray) -> np.ndarray:
        """The full token block of one image's codes [h, w] (dimension digits tokenized once per shape)."""
        shape = (int(codes.shape[0]), int(codes.shape[1]))
        dims = self._dims.get(shape)
        if dims is None:
            dims = self._dims.setdefault(shape, self.tokenizer.encode(f"{shape[0]}*{shape[1]}"))
        return self.layout.image_block(codes, dims)

    def block_length(self, height: int, width: int) -> int:
        """Exact length of the block of an image of [height, width] codes."""
        dims = self.tokenizer.encode(f"{height}*{width}")
        return self.layout.image_block_length(height, width, len(dims))

    @staticmethod
    def assemble(template: Template, blocks: dict[int, np.ndarray]) -> np.ndarray:
        """Concatenate a template with each slot replaced by its image block."""
        return np.concatenate([blocks[part] if isinstance(part, int) else part for part in template])

    # -- per mode ---------------------------------------------------------------------------------
    def _text(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text), dtype=np.int32)

    def _image(self, num_images: int, sidecars: Sidecars) -> Template:
        return [self._bos, *range(num_images), self._eos]

    def _caption(self, sidecars: Sidecars) -> np.ndarray:
        if sidecars.text is None:
            raise DocumentError("missing_caption")
        try:
            text = caption_text(sidecars.text)
        except UnicodeDecodeError:
            raise DocumentError("caption_not_utf8") from None
        if not text:
            raise DocumentError("empty_caption")
        return self._text(text)

    def _image_text(self, num_images: int, sidecars: Sidecars) -> Template:
        return [self._bos, *range(num_images), self._caption(sidecars), self._eos]

    def _text_image(self, num_images: int, sidecars: Sidecars) -> Template:
        return [self._bos, self._caption(sidecars), *range(num_images), self._eos]

    def _interleaved(self, num_images: int, sidecars: Sidecars) -> Template:
        sample = _json(sidecars)
        texts, images = sample.get("texts"), sample.get("images")
        if not isinstance(texts, list) or not isinstance(images, list) or len(texts) != len(images):
            raise DocumentError("invalid_interleaved_json", "needs parallel `texts` and `images` lists")
        template: Template = [self._bos]
        run: list[str] = []
        slot = 0
        for text, image in zip(texts, images, strict=True):
            if text is not None:
                if not isinstance(text, str):
                    raise DocumentError("invalid_interleaved_json", f"text entry of type {type(text).__name__}")
                run.append(text)
            if image is not None:
                template, run = self._flush(template, run), []
                template.append(slot)
                slot += 1
        template = self._flush(template, run)
        if slot != num_images:
            raise DocumentError("image_count_mismatch", f"json names {slot} images, the plan has {num_images}")
        return [*template, self._eos]

    def _flush(self, template: Template, run: list[str]) -> Template:
        text = TEXT_SEPARATOR.join(run)
        return [*template, self._text(text)] if text else template

def pack_template(template: Template) -> tuple[np.ndarray, list[int]]:
    """(text ids, layout) of a template, for storing it: the layout lists each part in order -- a text
    piece as its length (>= 0), image slot k as -(k + 1)."""
    texts = [part for part in template if not isinstance(part, int)]
    layout = [-(part + 1) if isinstance(part, int) else int(part.size) for part in template]
    return (np.concatenate(texts).astype(np.int32) if texts else np.zeros(0, np.int32)), layout


def unpack_template(ids: np.ndarray, layout: list[int]) -> Template:
    """The template `pack_template` stored (`ids` may be a view of a memory map)."""
    template: Template = []
    at = 0
    for entry in layout:
        if entry < 0:
            template.append(-entry - 1)
        else:
            template.append(np.asarray(ids[at:at + entry], np.int32))
            at += entry
    if at != len(ids):
        raise ValueError(f"template layout covers {at} ids, the item has {len(ids)}")
    return template


def _json(sidecars: Sidecars) -> dict:
    if sidecars.json is None:
        raise DocumentError("missing_json")
    sample, skip = json_value(sidecars.json, "json sidecar")  # deep nesting and lone surrogates too
    if skip is not None:
        raise DocumentError(skip.reason, skip.detail)
    if not isinstance(sample, dict):
        raise DocumentError("invalid_json", f"top level is {type(sample).__name__}, not an object")
    return sample


AUDIO, TEXT = "audio", "text"


@dataclass(frozen=True)
class SequenceBuilder:
    """Builds the int32 sequences above from audio ids (already offset into the audio codebook range)."""

    layout: VocabLayout
    bos_id: int
    eos_id: int

    def _special(self, name: str) -> int:
        return self.layout.special_id(name)

    def audio_block(self, audio_ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(audio_ids, np.int32)
        return np.concatenate([[self._special("<|audio_start|>")], ids,
                               [self._special("<|audio_end|>")]]).astype(np.int32)

    def audio_only(self, audio_ids: np.ndarray) -> np.ndarray:
        return self._wrap([self.audio_block(audio_ids)])

    def transcription(self, audio_ids: np.ndarray, text_ids: np.ndarray, *, translate: bool = False) -> np.ndarray:
        task = self._special("<|stt_translate|>" if translate else "<|stt_transcribe|>")
        return self._wrap([self.audio_block(audio_ids), np.asarray([task], np.int32), np.asarray(text_ids, np.int32)])

    def interleaved(self, segments: list[tuple[str, np.ndarray]]) -> np.ndarray:
        """`segments` = [(AUDIO|TEXT, ids)], alternating, ending with TEXT (refused otherwise)."""
        if not segments or segments[-1][0] != TEXT:
            raise ValueError("an interleaved sequence must end with a text segment")
        parts: list[np.ndarray] = []
        for index, (kind, ids) in enumerate(segments):
            if index:
                if kind == segments[index - 1][0]:
                    raise ValueError("interleaved segments must alternate between audio and text")
                sep = "<|tts_continue|>" if kind == AUDIO else "<|stt_continue|>"
                parts.append(np.asarray([self._special(sep)], np.int32))
            parts.append(self.audio_block(ids) if kind == AUDIO else np.asarray(ids, np.int32))
        return self._wrap(parts)

    def _wrap(self, parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate([np.asarray([self.bos_id], np.int32), *parts,
                               np.asarray([self.eos_id], np.int32)]).astype(np.int32)

    @staticmethod
    def segment_length(kind: str, n_ids: int) -> int:
        """Tokens a segment adds (audio blocks carry their two markers)."""
        return n_ids + 2 if kind == AUDIO else n_ids

    @staticmethod
    def interleaved_length(segment_lengths: list[int]) -> int:
        """Length of an interleaved sequence from its segment lengths: BOS + EOS + separators."""
        return 2 + sum(segment_lengths) + max(len(segment_lengths) - 1, 0)

    def describe(self) -> dict:
        return {"bos_id": self.bos_id, "eos_id": self.eos_id,
                "special": {name: self._special(name) for name in (
                    "<|audio_start|>", "<|audio_end|>", "<|stt_transcribe|>", "<|stt_translate|>",
                    "<|stt_continue|>", "<|tts_continue|>")}}


def is_translation(language: str | None, target_language: str | None) -> bool:
    """A clip's text is a translation when it names a target language other than its own language."""
    return bool(target_language) and target_language != language
