"""The omnimodal vocabulary layout (the Apertus 1.5 ids, see docs/formats.md) and the token-block builders.

The layout is data derived from the text vocabulary size: text ids first, then a block of 200
omni-special ids (16 named, the rest reserved), then the image codebook, then the audio codebook.
For Apertus 1.5 (131,072 text ids) this gives <|img_start|> = 131,073, image code 0 = 131,272 and
audio code 0 = 262,344; a 128,000-token base (EuroLLM) shifts every block by the same amount.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from mmtok.errors import MmtokError

# Omni-special tokens in id order, starting at the end of the text vocabulary.
OMNI_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|omni_reserved_0|>",
    "<|img_start|>",
    "<|img_end|>",
    "<|img_token_start|>",
    "<|img_end_of_row|>",
    "<|img_end_of_frame|>",
    "<|img_generation_start|>",
    "<|image|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|stt_transcribe|>",
    "<|stt_continue|>",
    "<|tts_continue|>",
    "<|audio|>",
    "<|stt_translate|>",
    "<|audio_annotate|>",
)
TOKEN_ALIASES = {"<image>": "<|image|>", "<audio>": "<|audio|>"}
# Structure tokens per modality: slots 1-7 vision, 8-15 audio (the slot allocation of the public
# swiss-ai/apertus-omni-tokenizer); (name, start token, end token, structure tokens) in offset order.
MODALITY_TOKENS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("vision", "<|img_start|>", "<|img_end|>", OMNI_SPECIAL_TOKENS[1:8]),
    ("audio", "<|audio_start|>", "<|audio_end|>", OMNI_SPECIAL_TOKENS[8:16]),
)
OMNI_SPECIAL_BLOCK = 200  # named tokens + reserved slots before the image codebook
IMAGE_CODEBOOK = 131_072  # Emu3.5 IBQ
AUDIO_CODEBOOK = 4_096  # WavTokenizer 40 Hz


@dataclass(frozen=True)
class VocabLayout:
    """Where every modality's ids live, given the size of the text vocabulary."""

    text_size: int = 131_072
    image_codebook: int = IMAGE_CODEBOOK
    audio_codebook: int = AUDIO_CODEBOOK

    def __post_init__(self) -> None:
        if self.text_size <= 0:
            raise ValueError(f"text vocabulary size must be positive, got {self.text_size}")

    @property
    def special_offset(self) -> int:
        return self.text_size

    @property
    def image_offset(self) -> int:
        return self.text_size + OMNI_SPECIAL_BLOCK

    @property
    def audio_offset(self) -> int:
        return self.image_offset + self.image_codebook

    @property
    def total_size(self) -> int:
        return self.audio_offset + self.audio_codebook

    def special_id(self, name: str) -> int:
        """Id of an omni-special token by name (aliases such as `<image>` accepted)."""
        name = TOKEN_ALIASES.get(name, name)
        try:
            return self.special_offset + OMNI_SPECIAL_TOKENS.index(name)
        except ValueError:
            raise KeyError(f"{name!r} is not an omni-special token; known: {OMNI_SPECIAL_TOKENS}") from None

    def special_ids(self) -> dict[str, int]:
        """Every named omni-special token with its id."""
        return {name: self.special_offset + i for i, name in enumerate(OMNI_SPECIAL_TOKENS)}

    def image_ids(self, codes: np.ndarray) -> np.ndarray:
        """Image codes -> vocabulary ids (int32); refuses codes outside the codebook."""
        return _offset_codes(codes, self.image_offset, self.image_codebook, "image")

    def audio_ids(self, codes: np.ndarray) -> np.ndarray:
        """Audio codes -> vocabulary ids (int32); refuses codes outside the codebook."""
        return _offset_codes(codes, self.audio_offset, self.audio_codebook, "audio")

    def image_block(self, codes: np.ndarray, dim_ids: Sequence[int]) -> np.ndarray:
        """The token block of one image.

        `codes` is [H, W] in code units; `dim_ids` are the text-token ids of the string "H*W".
        Layout: <|img_start|> dims <|img_token_start|> (W codes <|img_end_of_row|>) x H
        <|img_end_of_frame|> <|img_end|>.
        """
        codes = np.asarray(codes)
        if codes.ndim != 2:
            raise ValueError(f"image codes must be [H, W], got shape {codes.shape}")
        height, width = codes.shape
        grid = np.empty((height, width + 1), dtype=np.int32)
        grid[:, :width] = self.image_ids(codes)
        grid[:, width] = self.special_id("<|img_end_of_row|>")
        head = [self.special_id("<|img_start|>"), *dim_ids, self.special_id("<|img_token_start|>")]
        tail = [self.special_id("<|img_end_of_frame|>"), self.special_id("<|img_end|>")]
        return np.concatenate([np.asarray(head, np.int32), grid.ravel(), np.asarray(tail, np.int32)])

    @staticmethod
    def image_block_length(height: int, width: int, n_dim_tokens: int) -> int:
        """Exact token count of an image block of [height, width] codes (see `image_block`)."""
        return height * (width + 1) + n_dim_tokens + 4

    def audio_block(self, codes: np.ndarray) -> np.ndarray:
        """<|audio_start|> audio ids <|audio_end|>."""
        ids = self.audio_ids(np.asarray(codes).ravel())
        start, end = self.special_id("<|audio_start|>"), self.special_id("<|audio_end|>")
        return np.concatenate([np.asarray([start], np.int32), ids, np.asarray([end], np.int32)])

    def split_sequence(self, tokens: np.ndarray) -> list[tuple]:
        """Parse a token sequence into segments, checking every block's structure.

        Returns ("text", ids), ("image", codes [H, W], dim_ids) and ("audio", codes) tuples in order;
        the ids of block markers are consumed, every other id lands in a text segment. Raises
        ValueError on a malformed block (ragged rows, missing end markers, codes out of place).
        """
        tokens = np.asarray(tokens, dtype=np.int64)
        ids = self.special_ids()
        segments: list[tuple] = []
        text: list[int] = []
        i = 0
        while i < len(tokens):
            token = int(tokens[i])
            if token == ids["<|img_start|>"]:
                segment, i = self._parse_image(tokens, i)
            elif token == ids["<|audio_start|>"]:
                segment, i = self._parse_audio(tokens, i)
            else:
                if self.image_offset <= token < self.total_size:
                    raise ValueError(f"codec id {token} outside a block at position {i}")
                text.append(token)
                i += 1
                continue
            if text:
                segments.append(("text", np.asarray(text, np.int64)))
                text = []
            segments.append(segment)
        if text:
            segments.append(("text", np.asarray(text, np.int64)))
        return segments

    def _parse_image(self, tokens: np.ndarray, start: int) -> tuple[tuple, int]:
        ids = self.special_ids()
        body_start = _find(tokens, ids["<|img_token_start|>"], start, "<|img_token_start|>")
        frame_end = _find(tokens, ids["<|img_end_of_frame|>"], body_start, "<|img_end_of_frame|>")
        if frame_end + 1 >= len(tokens) or tokens[frame_end + 1] != ids["<|img_end|>"]:
            raise ValueError(f"image block at {start}: <|img_end_of_frame|> not followed by <|img_end|>")
        body = tokens[body_start + 1 : frame_end]
        row_ends = np.flatnonzero(body == ids["<|img_end_of_row|>"])
        if len(row_ends) == 0:
            raise ValueError(f"image block at {start}: no rows")
        width = int(row_ends[0])
        if (len(body) != len(row_ends) * (width + 1)
                or not np.all(row_ends == np.arange(len(row_ends)) * (width + 1) + width)):
            raise ValueError(f"image block at {start}: ragged rows")
        codes = body.reshape(len(row_ends), width + 1)[:, :width] - self.image_offset
        if codes.size and (codes.min() < 0 or codes.max() >= self.image_codebook):
            raise ValueError(f"image block at {start}: a non-image id among the codes")
        return ("image", codes, tokens[start + 1 : body_start].copy()), frame_end + 2

    def _parse_audio(self, tokens: np.ndarray, start: int) -> tuple[tuple, int]:
        end = _find(tokens, self.special_id("<|audio_end|>"), start, "<|audio_end|>")
        codes = tokens[start + 1 : end] - self.audio_offset
        if codes.size and (codes.min() < 0 or codes.max() >= self.audio_codebook):
            raise ValueError(f"audio block at {start}: a non-audio id among the codes")
        return ("audio", codes), end + 1

    def omnimodal_config(self, *, structure: bool = False) -> dict:
        """The `base_vocab_size` + `omnimodal_config` fields of tokenizer_config.json.

        Modalities are sorted by offset. By default each has `name`, `offset` and `vocab_size`: what
        the swiss-ai Megatron-LM fork reads, and what dataset metadata records (so it stays stable).
        `structure=True` adds `start_token`, `end_token` and `structure_token_ids` (name -> id), the
        full contract of swiss-ai/apertus-omni-tokenizer's docs/omnimodal_config.md.
        """
        sizes = {"vision": (self.image_offset, self.image_codebook), "audio": (self.audio_offset, self.audio_codebook)}
        modalities = []
        for name, start, end, tokens in MODALITY_TOKENS:
            entry = {"name": name, "offset": sizes[name][0], "vocab_size": sizes[name][1]}
            if structure:
                entry.update(start_token=self.special_id(start), end_token=self.special_id(end),
                             structure_token_ids={token: self.special_id(token) for token in tokens})
            modalities.append(entry)
        modalities.sort(key=lambda entry: entry["offset"])
        return {"base_vocab_size": self.text_size,
                "omnimodal_config": {"omni_special_token_offset": self.special_offset, "modalities": modalities}}

    def offsets(self) -> dict:
        """The sizes and offsets a part identity records (what a resume and a merge must agree on)."""
        return {"text_size": self.text_size, "total_size": self.total_size, "image_offset": self.image_offset,
                "audio_offset": self.audio_offset}

    def to_dict(self) -> dict:
        """Everything a consumer needs to interpret the ids; recorded in output metadata."""
        return {
            "text_size": self.text_size,
            "total_size": self.total_size,
            "special_tokens": self.special_ids(),
            "image_offset": self.image_offset,
            "image_codebook": self.image_codebook,
            "audio_offset": self.audio_offset,
            "audio_codebook": self.audio_codebook,
            **self.omnimodal_config(),
        }


def _find(tokens: np.ndarray, token: int, start: int, name: str) -> int:
    hits = np.flatnonzero(tokens[start:] == token)
    if len(hits) == 0:
        raise ValueError(f"block at {start}: missing {name}")
    return start + int(hits[0])


class IdsOutOfRange(MmtokError, ValueError):
    """Ids outside their modality's range: a damaged store or a codec that does not fit the layout."""


def check_ids_in_range(ids: np.ndarray, low: int, high: int, what: str) -> None:
    """Refuse (IdsOutOfRange naming `what`, the range and the offending values) unless every id is in
    [low, high): the last guard before ids of a modality are committed, whatever produced them."""
    ids = np.asarray(ids)
    if ids.size and (ids.min() < low or ids.max() >= high):
        bad = ids[(ids < low) | (ids >= high)]
        raise IdsOutOfRange(f"{what}: {bad.size} id(s) outside [{low}, {high}) (min {ids.min()}, max {ids.max()}); "
                            "the codes do not belong to this vocabulary layout -- nothing was written for them")


def _offset_codes(codes: np.ndarray, offset: int, size: int, what: str) -> np.ndarray:
    codes = np.asarray(codes)
    check_ids_in_range(codes, 0, size, f"{what} codes")
    return (codes.astype(np.int64) + offset).astype(np.int32)
