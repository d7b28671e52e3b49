"""Text tokenizers behind one small interface, loaded offline.

Two file formats are accepted:
* a Hugging Face `tokenizer.json` (or a directory holding it, plus `tokenizer_config.json` for the
  BOS/EOS names and the chat template, and `chat_template.jinja`, which holds the chat template instead
  where there is one -- as transformers reads them) -- what production passes (Apertus, EuroLLM, ...);
* a Mistral "tekken" JSON, read with `mistral-common`. The built-in default `tekken` is the
  Mistral-NeMo tokenizer that ships inside mistral-common (131,072 ids, the Apertus 1.0 family),
  so the demo and tests run with no download.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from mmtok.errors import MmtokError, brief
from mmtok.fsutil import own_file, read_json_object, read_regular_file

BUILTIN_TEKKEN = "tekken"
CONFIG_JSON = "tokenizer_config.json"  # beside an HF tokenizer.json: roles, chat template
# Beside tokenizer.json: the chat template as its own file (transformers' save_pretrained, the Apertus 1.5
# release); where it exists, transformers' AutoTokenizer takes it over tokenizer_config.json's chat_template.
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TextTokenizer:
    """Encodes text to ids without BOS/EOS; special tokens are looked up by name, never hard-coded.

    `encode` takes text as text: a control token's name typed into it (`<|user_end|>`, `</s>`) is
    tokenized as the characters it is, never as the control id -- what a person or a web page wrote
    cannot end a turn or open a reasoning span. Control ids come only from `token_id` (the chat
    template's structure, mmtok's own blocks).
    """

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

    def _in_vocabulary(self, ids: list[int]) -> list[int]:
        """`ids` when each is a text id (< vocab_size), the last guard before they reach a commit of any stage;
        MmtokError otherwise (ids are checked contiguous at load, so this means a tokenizer that lied)."""
        if ids and (max(ids) >= self.vocab_size or min(ids) < 0):
            bad = max(ids) if max(ids) >= self.vocab_size else min(ids)
            raise MmtokError(f"text tokenizer {self.name} gave id {bad}, outside its {self.vocab_size:,} text ids; "
                             "nothing with it was written")
        return ids

    def control_tokens(self) -> dict[str, "ControlToken"]:
        """The tokenizer's control (special) tokens by name: what `encode` never produces from text."""
        return {}

    @property
    def max_token_bytes(self) -> int | None:
        """An upper bound on the UTF-8 bytes one token of `encode` covers (None: no sound bound known).

        So text of more than `max_tokens * max_token_bytes` bytes has more than `max_tokens` tokens, and
        is refused before the tokenizer spends ~300 bytes of memory per character on it."""
        return None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids`, special tokens shown by name (for inspection, not round-tripping)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What output metadata records about the tokenizer."""
        return {"name": self.name, "sha256": self.fingerprint, "vocab_size": self.vocab_size,
                "bos_id": self.bos_id, "eos_id": self.eos_id}


@dataclass(frozen=True)
class ControlToken:
    """One control token: its id, and whether it takes the whitespace to its left / right with it (the HF
    added-token `lstrip` / `rstrip` flags, kept where mmtok cuts a rendering at the token itself)."""

    id: int
    lstrip: bool = False
    rstrip: bool = False


class HFTokenizer(TextTokenizer):
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        config = read_json_object(tokenizer_file(path.with_name(CONFIG_JSON))) or {}
        self._tok = Tokenizer.from_file(str(path))
        template = read_chat_template(path.with_name(CHAT_TEMPLATE_FILE))
        chat_template = config.get("chat_template") if template is None else template
        ids = self._tok.get_vocab(with_added_tokens=True).values()
        check_contiguous(ids, self._tok.get_vocab_size(with_added_tokens=True), str(path))
        promoted = _structure_tokens(self._tok, chat_template, config)
        if promoted:  # made special in memory only: the fingerprint is of the files as they are
            self._tok = Tokenizer.from_str(_with_special(self._tok.to_str(), promoted))
        self._tok.no_padding()
        self._tok.no_truncation()
        self._tok.encode_special_tokens = True  # special tokens' names in text stay text (see TextTokenizer)
        super().__init__(
            name=str(path),
            fingerprint=hf_fingerprint(path),
            vocab_size=self._tok.get_vocab_size(with_added_tokens=True),
            bos_id=self._lookup(_token_name(config.get("bos_token"), "<s>")),
            eos_id=self._lookup(_token_name(config.get("eos_token"), "</s>")),
            chat_template=chat_template,
        )
        self.promoted_controls = sorted(promoted)

    def _lookup(self, name: str) -> int:
        token_id = self._tok.token_to_id(name)
        if token_id is None:
            raise MmtokError(f"text tokenizer {self.__dict__.get('name', '')} has no token {brief(repr(name))}")
        return token_id

    def encode(self, text: str) -> list[int]:
        return self._in_vocabulary(self._tok.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        return [self._in_vocabulary(enc.ids) for enc in self._tok.encode_batch(list(texts), add_special_tokens=False)]


    def token_id(self, name: str) -> int:
        return self._lookup(name)

    def control_tokens(self) -> dict[str, ControlToken]:
        return {token.content: ControlToken(token_id, token.lstrip, token.rstrip)
                for token_id, token in self._tok.get_added_tokens_decoder().items() if token.special}

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        # A vocab entry's UTF-8 length bounds the input bytes its token covers: exact for plain BPE/WordPiece
        # pieces, an overestimate for byte-level pieces (one input byte is a 1-2 byte alphabet character) and
        # SentencePiece's 3-byte `▁` -- too high is safe, it only refuses less. Not sound when a normalizer may
        # delete text or unknown characters fuse into one <unk>: no bound then.
        model = json.loads(self._tok.to_str()).get("model", {})
        if self._tok.normalizer is not None or model.get("fuse_unk"):
            return None
        return max(len(piece.encode("utf-8")) for piece in self._tok.get_vocab(with_added_tokens=False))

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
        return self._in_vocabulary(self._tok.encode(text, bos=False, eos=False))

    def token_id(self, name: str) -> int:
        try:
            return self._tok.get_special_token(name)
        except Exception:
            raise MmtokError(f"text tokenizer {self.name} has no special token {brief(repr(name))}") from None

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_piece(token_id)

    @functools.cached_property
    def max_token_bytes(self) -> int | None:
        # tekken pieces are byte strings (tiktoken); its special tokens are never produced from text.
        return max(len(self._tok.id_to_byte_piece(i)) for i in range(self._tok.num_special_tokens, self._tok.n_words))

    def decode(self, ids: Sequence[int]) -> str:
        from mistral_common.tokens.tokenizers.base import SpecialTokenPolicy

        return self._tok.decode([int(i) for i in ids], special_token_policy=SpecialTokenPolicy.KEEP)


def check_contiguous(ids, vocab_size: int, name: str) -> None:
    """MmtokError unless `ids` are exactly 0 … vocab_size-1: the text range of the omnimodal layout is
    [0, vocab_size), and a token whose id lies past it would put typed text among the image or audio codes."""
    ids = list(ids)
    if len(ids) != vocab_size or max(ids) != vocab_size - 1 or len(set(ids)) != vocab_size:
        raise MmtokError(f"text tokenizer {name}: its ids are not contiguous ({len(ids):,} tokens, highest id "
                         f"{max(ids):,}); mmtok's layout needs ids 0 … N-1 (text ids past N would land among the "
                         "image and audio codes) -- use the tokenizer the model was trained with")


def _structure_tokens(tokenizer, chat_template, config: dict) -> set[str]:
    """The added tokens flagged `"special": false` that are structure all the same: named in the chat template's
    text, or by tokenizer_config.json's role keys (bos, eos, ...), or tokens mmtok emits itself. Real releases
    ship some control tokens unflagged; left so, a user's message could type its way into a turn marker or a
    reasoning span. From the template, only marker-shaped tokens count (_MARKER)."""
    from mmtok.vocab import OMNI_SPECIAL_TOKENS, TOKEN_ALIASES

    templates = [chat_template] if isinstance(chat_template, str) else \
        [t.get("template") for t in chat_template or [] if isinstance(t, dict)]
    source = "\n".join(t for t in templates if isinstance(t, str))
    named = {_token_name(config.get(role), "") for role in ("bos_token", "eos_token", "unk_token", "pad_token")}
    named |= {*OMNI_SPECIAL_TOKENS, *TOKEN_ALIASES}
    return {token.content for token in tokenizer.get_added_tokens_decoder().values()
            if not token.special and (token.content in named or
                                      (_MARKER.fullmatch(token.content) and token.content in source))}


# A control marker's shape (`<|user_end|>`, `<think>`, `[INST]`): a plain word the template's code happens to hold
# (`role`, `Capabilities`) stays text, tokenized as the library does.
_MARKER = re.compile(r"<[^<>\s]+>|\[[^\[\]\s]+\]")


def _with_special(serialized: str, names: set[str]) -> str:
    """A tokenizer.json text with the added tokens `names` flagged special (ids and everything else unchanged)."""
    state = json.loads(serialized)
    for token in state.get("added_tokens", []):
        if token.get("content") in names:
            token["special"] = True
    return json.dumps(state)


def hf_fingerprint(path: Path) -> str:
    """The sha256 of an HF tokenizer: its tokenizer.json at `path`, then the tokenizer_config.json and the
    chat_template.jinja beside it (where they exist)."""
    digest = hashlib.sha256(tokenizer_file(path).read_bytes())
    config_path = tokenizer_file(path.with_name(CONFIG_JSON))
    if config_path.is_file():
        digest.update(config_path.read_bytes())
    template = read_chat_template(path.with_name(CHAT_TEMPLATE_FILE))
    if template is not None:
        digest.update(template.encode("utf-8"))
    return digest.hexdigest()


def tokenizer_difference(recorded: dict, current: dict) -> str | None:
    """How the tokenizer `current` differs from `recorded` (both `describe()` records): None when they are the
    same files. When both are HF tokenizers whose files are still where their records name them, unchanged,
    and their tokenizer.json are byte-identical, the clause names the tokenizer_config.json keys that differ
    (another chat template, other role tokens); otherwise it names both tokenizers and their sha256."""
    if recorded.get("sha256") == current.get("sha256"):
        return None
    keys = _config_only_difference(recorded, current)
    if keys is None:
        return (f"{recorded.get('name')} (sha256 {str(recorded.get('sha256'))[:12]}...), not {current.get('name')} "
                f"(sha256 {str(current.get('sha256'))[:12]}...)")
    template = CHAT_TEMPLATE_FILE in keys
    keys = [key for key in keys if key != CHAT_TEMPLATE_FILE]
    parts = ([f"tokenizer_config.json differs in {', '.join(keys)}"] if keys else []) + \
        ([f"the {CHAT_TEMPLATE_FILE} beside it differs"] if template else [])
    which = " and ".join(parts) or "tokenizer_config.json differs only in formatting"
    return f"the same tokenizer.json, but {which} ({current.get('name')} vs {recorded.get('name')})"


def _config_only_difference(recorded: dict, current: dict) -> list[str] | None:
    """The top-level tokenizer_config.json keys in which two recorded HF tokenizers differ, or None unless both
    records' files are still there as recorded and their tokenizer.json bytes are equal."""
    paths = [Path(str(record.get("name"))) for record in (recorded, current)]
    if not all(path.name == "tokenizer.json" and path.is_file() for path in paths):
        return None  # a tekken record names its file only; an HF directory may be gone
    if any(hf_fingerprint(path) != record.get("sha256")
           for path, record in zip(paths, (recorded, current), strict=True)):
        return None  # changed since it was recorded: what the run used is no longer on disk
    if read_regular_file(paths[0]) != read_regular_file(paths[1]):
        return None
    old, new = (read_json_object(tokenizer_file(path.with_name(CONFIG_JSON))) or {} for path in paths)
    keys = sorted(key for key in old.keys() | new.keys() if old.get(key) != new.get(key))
    templates = [read_chat_template(path.with_name(CHAT_TEMPLATE_FILE)) for path in paths]
    return keys + ([CHAT_TEMPLATE_FILE] if templates[0] != templates[1] else [])


def builtin_tekken_path() -> Path:
    import mistral_common

    return Path(mistral_common.__file__).parent / "data" / "tekken_240718.json"


def load_text_tokenizer(spec: str = BUILTIN_TEKKEN) -> TextTokenizer:
    """Load `tekken` (built in), a tekken JSON, an HF `tokenizer.json`, or a directory holding one."""
    path = builtin_tekken_path() if spec == BUILTIN_TEKKEN else Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not tokenizer_file(path).is_file():
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


def tokenizer_file(path: Path) -> Path:
    """`path`, a file of a tokenizer directory (tokenizer.json, tokenizer_config.json, chat_template.jinja, ...),
    when it lies in that directory (`fsutil.own_file`); MmtokError otherwise."""
    return own_file(path, "text tokenizer file")


def read_chat_template(path: Path) -> str | None:
    """The text of a chat_template.jinja, or None where there is none."""
    if not tokenizer_file(path).exists():
        return None
    try:
        return read_regular_file(path).decode("utf-8")
    except UnicodeDecodeError as err:
        raise MmtokError(f"{path}: not UTF-8 text ({brief(err)}); a chat template is a jinja text file") from None


def _token_name(value, default: str) -> str:
    if isinstance(value, dict):
        return value.get("content", default)
    return value or default


def caption_text(raw: bytes) -> str:
    """The caption string of a txt sidecar: UTF-8 (strict), surrounding whitespace removed.

    Raises UnicodeDecodeError for bytes that are not UTF-8.
    """
    return raw.decode("utf-8").strip()
