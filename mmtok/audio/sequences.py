"""Token layouts of the audio sequences (DESIGN.md §4), shared by encode and interleave.

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

import numpy as np

from mmtok.vocab import VocabLayout

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
        return np.concatenate([[self._special("<|audio_start|>")], ids, [self._special("<|audio_end|>")]]).astype(np.int32)

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
