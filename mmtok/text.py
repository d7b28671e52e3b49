"""Text tokenizers behind one small interface, loaded offline.

Two file formats are accepted:
* a Hugging Face `tokenizer.json` (or a directory holding it, plus `tokenizer_config.json` for the
  chat template and the BOS/EOS names) -- what production passes (Apertus, EuroLLM, ...);
* a Mistral "tekken" JSON, read with `mistral-common`. The built-in default `tekken` is the
  Mistral-NeMo tokenizer that ships inside mistral-common (131,072 ids, the Apertus 1.0 family),
  so the demo and tests run with no download.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Sequence

from mmtok.errors import MmtokError, brief
from mmtok.fsutil import read_json_object

BUILTIN_TEKKEN = "tekken"


class TextTokenizer:
    """Encodes text to ids without BOS/EOS; special tokens are looked up by name, never hard-coded."""

    def __init__(self, *, name: str, fingerprint: str, vocab_size: int, bos_id: int, eos_id: int,
                 chat_template: str | None = None):
        self.name = name
        self.fingerprint = fingerprint
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.chat_template = chat_template

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def token_id(self, name: str) -> int:
        raise NotImplementedError

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens shown by name (for inspection, not round-tripping)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What output metadata records about the tokenizer."""
        return {"name": self.name, "sha256": self.fingerprint, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}


class HFTokenizer(TextTokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        config_path = path.with_name("tokenizer_config.json")
        config = read_json_object(config_path) or {}
        self._tok = Tokenizer.from_file(str(path))
        digest = hashlib.sha256(path.read_bytes())
        if config_path.is_file():
            digest.update(config_path.read_bytes())
        self._tok.no_padding()
        self._tok.no_truncation()
        super().__init__(
            name=str(path),
            fingerprint=digest.hexdigest(),
            vocab_size=self._tok.get_vocab_size(with_added_tokens=True),
            bos_id=self._lookup(_token_name(config.get("bos_token"), "<s>")),
            eos_id=self._lookup(_token_name(config.get("eos_token"), "</s>")),
            chat_template=config.get("chat_template"),
        )

    def _lookup(self, name: str) -> int:
        token_id = self._tok.token_to_id(name)
        if token_id is None:
            raise MmtokError(f"text tokenizer {self.__dict__.get('name', '')} has no token {brief(repr(name))}")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def token_id(self, name: str) -> int:
        return self._lookup(name)

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


class TekkenTokenizer(TextTokenizer):
    def __init__(self, path: Path):
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        self._tok = Tekkenizer.from_file(str(path))
        super().__init__(
            name=path.name,
            fingerprint=hashlib.sha256(path.read_bytes()).hexdigest(),
            vocab_size=self._tok.n_words,
            bos_id=self._tok.bos_id,
            eos_id=self._tok.eos_id,
        )

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, bos=False, eos=False)

    def token_id(self, name: str) -> int:
        try:
            return self._tok.get_special_token(name)
        except Exception:
            raise MmtokError(f"text tokenizer {self.name} has no special token {brief(repr(name))}") from None

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_piece(token_id)

    def decode(self, ids: Sequence[int]) -> str:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        return self._tok.decode([int(i) for i in ids], special_token_policy=SpecialTokenPolicy.KEEP)


def builtin_tekken_path() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"


def load_text_tokenizer(spec: str = BUILTIN_TEKKEN) -> TextTokenizer:
    """Load `tekken` (built in), a tekken JSON, an HF `tokenizer.json`, or a directory holding one."""
    path = builtin_tekken_path() if spec == BUILTIN_TEKKEN else Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise MmtokError(f"text tokenizer not found: {spec} (pass `tekken`, a tokenizer.json, or its directory)")
    with open(path, "rb") as handle:
        head = handle.read(4096)
    try:
        if b'"config"' in head and b'"pattern"' in head:  # tekken files open with their config block
            return TekkenTokenizer(path)
        return HFTokenizer(path)
    except MmtokError:
        raise
    except Exception as err:  # the tokenizers/mistral-common loaders raise plain Exceptions for a bad file
        raise MmtokError(f"{path}: not a text tokenizer this tool can read ({brief(err)}); pass `tekken`, an HF "
                         "tokenizer.json (or its directory) or a tekken JSON") from None


def _token_name(value, default: str) -> str:
    if isinstance(value, dict):
        return value.get("content", default)
    return value or default


def caption_text(raw: bytes) -> str:
    """The caption string of a txt sidecar: UTF-8 (strict), surrounding whitespace removed.

    Raises UnicodeDecodeError for bytes that are not UTF-8.
    """
    return raw.decode("utf-8").strip()
