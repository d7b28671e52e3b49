"""SFT conversations rendered with the text tokenizer's own chat template (jinja2, HF conventions).

The template is the `chat_template` of the tokenizer's `tokenizer_config.json`; it is rendered the
way Hugging Face's `apply_chat_template` does (sandboxed jinja2, `trim_blocks`/`lstrip_blocks`,
`tojson`, `raise_exception`), with the sidecar's `messages`, its other top-level keys (`tools`,
`enable_thinking`, ...), `bos_token`/`eos_token` and `add_generation_prompt=False`. Rendering never
reads the clock or the environment, so a conversation always renders to the same string.

Media. Placeholders mark where media blocks go: `<|image|>` (alias `<image>`) and `<|audio|>` (alias
`<audio>`). A message's `content` references media in one of these forms:

  * a string, with placeholders typed into it;
  * an OpenAI-style list of parts -- `text`, images `image`/`image_url`/`input_image`, audio
    `audio`/`audio_url`/`input_audio` -- flattened to one string before rendering (the Apertus template
    reads strings and mappings, not lists);
  * the Apertus mappings: `{"parts": [...]}` (user turns; the same part types) and `{"blocks": [...]}`
    (assistant turns: `thoughts`, `response`, `tool_calls`, `tool_outputs`), left to the template.

Before rendering, each media part becomes one canonical placeholder (in the `parts` form, a text part
holding it). The rendering then has exactly one placeholder per media part whatever the template would
do with a media part of its own -- spell it differently, wrap it in its own tokens, not know `input_audio`
-- so `split_media` finds the slots that `conversation_media` lists, and the media block mmtok puts
there is the only structure around the media. Blocks carry no media parts, only text, so they reach the
template as they are. A part type outside those above is a skip (`unknown_content_part`) rather than a
question for the template: its media could not be listed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mmtok.errors import MmtokError, Skip

MEDIA_KINDS = ("image", "audio")
CANONICAL_PLACEHOLDER = {"image": "<|image|>", "audio": "<|audio|>"}
PLACEHOLDER_KIND = {"<|image|>": "image", "<image>": "image", "<|audio|>": "audio", "<audio>": "audio"}
# The record-level lists that name a conversation's media in order (docs/encode.md "SFT format").
RECORD_LISTS = {"image": "images", "audio": "audios"}
# Each media part type: its kind, and the keys that may hold its reference (the first one present wins).
MEDIA_PARTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "image": ("image", ("image", "url", "path")),
    "image_url": ("image", ("image_url",)),
    "input_image": ("image", ("image_url", "file_id")),
    "audio": ("audio", ("audio", "url", "path")),
    "audio_url": ("audio", ("audio_url",)),
    "input_audio": ("audio", ("input_audio",)),
}
# The chat template's special tokens recorded (id by name) in a part identity when the tokenizer has
# them: merge --strip-reasoning and inspection tools read them from there.
RECORDED_SPECIAL_TOKENS = (
    "<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>", "<|user_start|>",
    "<|user_end|>", "<|assistant_start|>", "<|assistant_end|>", "<|inner_prefix|>", "<|inner_suffix|>",
    "<|tools_prefix|>", "<|tools_suffix|>", "<|tool_output_start|>", "<|tool_output_end|>",
)
_PLACEHOLDER = re.compile("|".join(re.escape(p) for p in PLACEHOLDER_KIND))


class ConversationError(Skip):
    """A conversation that cannot be rendered; `reason` is the counted skip reason."""


@dataclass(frozen=True)
class MediaSlot:
    """Where one medium goes in a rendering: its kind and its ordinal among that kind's placeholders."""

    kind: str
    index: int


@dataclass(frozen=True)
class MediaRef:
    """What goes into one slot: the part's payload as the sidecar has it (a member name, path or URL, an
    `input_audio` `{"data", "format"}`, a `{"cut_id": ...}`), or None where the conversation says only
    "a medium of this kind here" -- then the sample's media of that kind are taken in their stored order."""

    slot: MediaSlot
    source: Any


def recorded_special_ids(tokenizer) -> dict[str, int]:
    """{name: id} of the RECORDED_SPECIAL_TOKENS the text tokenizer has."""
    special = {}
    for name in RECORDED_SPECIAL_TOKENS:
        try:
            special[name] = tokenizer.token_id(name)
        except MmtokError:
            pass
    return special


def _raise_exception(message: str) -> None:
    raise ConversationError("template_error", message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class ChatRenderer:
    """Compiles a chat template once; `render(conversation)` is thread-safe and deterministic."""

    def __init__(self, template: str, bos_token: str, eos_token: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=["jinja2.ext.loopcontrols"])
        environment.filters["tojson"] = _tojson
        environment.globals["raise_exception"] = _raise_exception
        try:
            self._template = environment.from_string(template)
        except TemplateError as err:
            raise MmtokError(f"the text tokenizer's chat_template does not compile: {err}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatRenderer":
        if not tokenizer.chat_template:
            raise MmtokError(f"mode sft needs a chat template, but the text tokenizer {tokenizer.name} has none: pass "
                             "an HF tokenizer directory whose tokenizer_config.json has `chat_template`")
        template = tokenizer.chat_template
        if isinstance(template, list):  # HF allows named templates: [{"name": "default", "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()))
        return cls(template, tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id))

    def render(self, conversation: dict) -> str:
        """The rendered string of one sidecar (`{"messages": [...], ...}`), one canonical placeholder
        where each media part was; ConversationError if unusable."""
        from jinja2 import TemplateError

        messages = _messages(conversation)
        context = {k: v for k, v in conversation.items() if k != "messages"}
        context.update(messages=[_for_template(m, i) for i, m in enumerate(messages)], bos_token=self.bos_token,
                       eos_token=self.eos_token, add_generation_prompt=False)
        try:
            return self._template.render(**context)
        except ConversationError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:
            raise ConversationError("template_error", f"{type(err).__name__}: {err}") from None


def split_media(text: str) -> list[str | MediaSlot]:
    """Cut rendered text at media placeholders (either spelling): the non-empty text pieces in order,
    with a MediaSlot where each placeholder was."""
    pieces: list[str | MediaSlot] = []
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    position = 0
    for match in _PLACEHOLDER.finditer(text):
        kind = PLACEHOLDER_KIND[match.group()]
        pieces.extend([text[position : match.start()], MediaSlot(kind, counts[kind])])
        counts[kind] += 1
        position = match.end()
    pieces.append(text[position:])
    return [p for p in pieces if p != ""]


def conversation_media(conversation: dict) -> list[MediaRef]:
    """The media the messages' contents reference, in order: one MediaRef per slot that `split_media`
    finds in the rendering, for a template that renders each message's content once and in message order
    (chat templates do). Placeholders a template renders from elsewhere (`tools`, reasoning fields) are
    not media references and have no MediaRef.

    A slot without a reference of its own (a typed placeholder, a bare `{"type": "image"}`) takes the
    entry at its ordinal in the record's `images` / `audios` list when there is one; such a list must
    name exactly as many media as the messages reference (`placeholder_mismatch` otherwise).
    """
    messages = _messages(conversation)
    listed = {kind: _record_list(conversation, kind) for kind in MEDIA_KINDS}
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    media: list[MediaRef] = []
    for position, message in enumerate(messages):
        for kind, source in _content_media(message.get("content"), position):
            index = counts[kind]
            counts[kind] += 1
            if source is None and listed[kind] is not None and index < len(listed[kind]):
                source = listed[kind][index]
            media.append(MediaRef(MediaSlot(kind, index), source))
    for kind, names in listed.items():
        if names is not None and len(names) != counts[kind]:
            raise ConversationError("placeholder_mismatch", f"the messages reference {counts[kind]} {kind}(s), "
                                    f"the record's `{RECORD_LISTS[kind]}` list names {len(names)}")
    return media


def with_media_names(conversation: dict, names: dict[MediaSlot, str]) -> dict:
    """A copy of the record whose every medium is referenced by the name `names` gives its slot: each media
    part becomes `{"type": KIND, KIND: name}` and the record's `images` / `audios` lists name every slot of
    their kind in order (what typed placeholders take). The slots are those `conversation_media` lists."""
    media = conversation_media(conversation)  # validates, and fixes the slot order
    record = {**conversation, "messages": [dict(m) for m in _messages(conversation)]}
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    for position, message in enumerate(record["messages"]):
        parts = _parts(message.get("content"), position)
        if parts is None:
            for text in _strings(message.get("content")):
                for kind, _ in _typed(text):
                    counts[kind] += 1
            continue
        renamed = []
        for part in parts:
            kind = _part_kind(part, position)
            if kind == "text":
                for typed, _ in _typed(part["text"]):
                    counts[typed] += 1
                renamed.append(part)
            else:
                renamed.append({"type": kind, kind: names[MediaSlot(kind, counts[kind])]})
                counts[kind] += 1
        content = message["content"]
        message["content"] = renamed if isinstance(content, list) else {**content, "parts": renamed}
    for kind in MEDIA_KINDS:
        slots = [ref.slot for ref in media if ref.slot.kind == kind]
        if slots:
            record[RECORD_LISTS[kind]] = [names[slot] for slot in slots]
        else:
            record.pop(RECORD_LISTS[kind], None)
    return record


# -- content forms ----------------------------------------------------------------------------------
def _messages(conversation: dict) -> list[dict]:
    messages = conversation.get("messages") if isinstance(conversation, dict) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ConversationError("no_messages", "the json sidecar has no `messages` list of objects")
    return messages


def _parts(content: Any, position: int) -> list | None:
    """The content parts of an OpenAI list or an Apertus `{"parts": [...]}`; None for other content."""
    if isinstance(content, dict) and "parts" in content:
        content = content["parts"]
        if not isinstance(content, list):
            raise ConversationError("invalid_content_part", f"message {position}: `parts` is not a list")
    return content if isinstance(content, list) else None


def _part_kind(part: Any, position: int) -> str:
    """"text", "image" or "audio" for a valid part; ConversationError naming the message otherwise."""
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ConversationError("invalid_content_part", f"message {position}: a content part without a `type`")
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise ConversationError("invalid_content_part", f"message {position}: a text part without a string "
                                    "`text`")
        return "text"
    if part["type"] not in MEDIA_PARTS:
        raise ConversationError("unknown_content_part", f"message {position}: content part type {part['type']!r}; "
                                f"known: text, {', '.join(MEDIA_PARTS)}")
    return MEDIA_PARTS[part["type"]][0]


def _for_template(message: dict, position: int) -> dict:
    """The message as the template sees it: each media part replaced by its canonical placeholder."""
    content = message.get("content")
    parts = _parts(content, position)
    if parts is None:
        return message
    kinds = [_part_kind(part, position) for part in parts]
    if isinstance(content, list):
        text = "".join(p["text"] if k == "text" else CANONICAL_PLACEHOLDER[k] for p, k in zip(parts, kinds))
        return {**message, "content": text}
    parts = [p if k == "text" else {"type": "text", "text": CANONICAL_PLACEHOLDER[k]} for p, k in zip(parts, kinds)]
    return {**message, "content": {**content, "parts": parts}}


def _content_media(content: Any, position: int) -> Iterator[tuple[str, Any]]:
    """(kind, reference or None) of each medium one message's content references, in order."""
    parts = _parts(content, position)
    if parts is None:  # a string, `{"blocks": [...]}`, `{"text": ...}`: only typed placeholders
        for text in _strings(content):
            yield from _typed(text)
        return
    for part in parts:
        kind = _part_kind(part, position)
        if kind == "text":
            yield from _typed(part["text"])
        else:
            yield kind, _source(part)


def _typed(text: str) -> Iterator[tuple[str, None]]:
    return ((PLACEHOLDER_KIND[match.group()], None) for match in _PLACEHOLDER.finditer(text))


def _source(part: dict) -> Any:
    """A media part's reference; an OpenAI `{"url": ...}` wrapper is unwrapped, other payloads kept whole."""
    for key in MEDIA_PARTS[part["type"]][1]:
        value = part.get(key)
        if value is not None:
            return value["url"] if isinstance(value, dict) and "url" in value else value
    return None


def _strings(value: Any) -> Iterator[str]:
    """Every string inside a json value, in document order."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)


def _record_list(conversation: dict, kind: str) -> list | None:
    names = conversation.get(RECORD_LISTS[kind])
    if names is not None and not isinstance(names, list):
        raise ConversationError("invalid_media_list", f"`{RECORD_LISTS[kind]}` is a {type(names).__name__}, not a "
                                "list of references")
    return names
