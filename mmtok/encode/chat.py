"""SFT conversations rendered with the text tokenizer's own chat template (jinja2, HF conventions).

The template is the `chat_template` of the tokenizer's `tokenizer_config.json`; it is rendered the
way Hugging Face's `apply_chat_template` does (sandboxed jinja2, `trim_blocks`/`lstrip_blocks`,
`tojson`, `raise_exception`), with the sidecar's `messages`, its other top-level keys (`tools`,
`enable_thinking`, ...), `bos_token`/`eos_token` and `add_generation_prompt=False`. Rendering never
reads the clock or the environment, so a conversation always renders to the same string.

Image placeholders `<|image|>` and its alias `<image>` (in message text, or rendered by the template
for OpenAI-style `{"type": "image"}` content parts) mark where image blocks go; `split_images`
cuts the rendered string at them.
"""

from __future__ import annotations

import json
import re
from typing import Any

from mmtok.errors import MmtokError, Skip

IMAGE_PLACEHOLDERS = ("<|image|>", "<image>")
_PLACEHOLDER = re.compile("|".join(re.escape(p) for p in IMAGE_PLACEHOLDERS))


class ConversationError(Skip):
    """A conversation that cannot be rendered; `reason` is the counted skip reason."""


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
        """The rendered string of one sidecar (`{"messages": [...], ...}`); ConversationError if unusable."""
        from jinja2 import TemplateError

        messages = conversation.get("messages") if isinstance(conversation, dict) else None
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ConversationError("no_messages", "the json sidecar has no `messages` list of objects")
        context = {k: v for k, v in conversation.items() if k != "messages"}
        context.update(messages=[_flatten_parts(m) for m in messages], bos_token=self.bos_token,
                       eos_token=self.eos_token, add_generation_prompt=False)
        try:
            return self._template.render(**context)
        except ConversationError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError) as err:
            raise ConversationError("template_error", f"{type(err).__name__}: {err}") from None


def _flatten_parts(message: dict) -> dict:
    """OpenAI-style content parts -> one string with `<|image|>` where image parts were.

    Content that is not a list of `{"type": "text"|"image"...}` parts is left to the template.
    """
    content = message.get("content")
    if not isinstance(content, list) or not all(isinstance(p, dict) and "type" in p for p in content):
        return message
    pieces = []
    for part in content:
        if part["type"] == "text":
            pieces.append(str(part.get("text", "")))
        elif part["type"] in ("image", "image_url"):
            pieces.append(IMAGE_PLACEHOLDERS[0])
        else:
            return message
    return {**message, "content": "".join(pieces)}


def split_images(text: str) -> list[str | None]:
    """Cut rendered text at image placeholders: text pieces, with None where each image goes."""
    pieces: list[str | None] = []
    position = 0
    for match in _PLACEHOLDER.finditer(text):
        pieces.extend([text[position : match.start()], None])
        position = match.end()
    pieces.append(text[position:])
    return [p for p in pieces if p != ""]
