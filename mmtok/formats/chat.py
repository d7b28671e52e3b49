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

import functools
import json
import re
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

from mmtok.errors import MmtokError, Skip, brief

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


@dataclass(frozen=True)
class Control:
    """A control token the template's own text made (never one typed into the record): cut out of the
    rendering by name, so the text tokenizer only ever sees text."""

    name: str


@dataclass(frozen=True)
class Rendering:
    """One conversation rendered: text pieces, template-made control tokens and media slots, in order;
    `control_literals` says the record's text held control-token names (kept as text)."""

    pieces: list[str | Control | MediaSlot]
    control_literals: bool


class ChatRenderer:
    """Compiles a chat template once; `render(conversation)` is thread-safe and deterministic.

    `controls` are the tokenizer's control tokens by name (`TextTokenizer.control_tokens()`); `render_pieces`
    keeps those a record's text holds as text. Each rendering is bounded (see RENDER_STEPS): a template that
    loops away or builds huge strings is that conversation's `template_error` / `document_too_long`.
    """

    def __init__(self, template: str, bos_token: str, eos_token: str, controls: Mapping[str, Any] | None = None):
        from jinja2 import TemplateError

        self._environment = _bounded_environment()
        try:
            self._template = self._environment.from_string(_counting_loops(self._environment.parse(template)))
        except (TemplateError, RecursionError) as err:
            raise MmtokError(f"the text tokenizer's chat_template does not compile: {_short_error(err)}") from None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._controls = {name: c for name, c in (controls or {}).items() if name not in PLACEHOLDER_KIND}
        self._literal = _alternation(self._controls)  # None: no control token to keep out of the text
        self._edges = _Edges(self._controls)
        self._cut = _alternation([*self._controls, *PLACEHOLDER_KIND])
        self._template_chars = frozenset(template)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> "ChatRenderer":
        template = _template_source(tokenizer)
        return cls(template, tokenizer.token_text(tokenizer.bos_id), tokenizer.token_text(tokenizer.eos_id),
                   tokenizer.control_tokens())

    def render(self, conversation: dict, max_chars: int | None = None) -> str:
        """The rendered string of one sidecar (`{"messages": [...], ...}`), one canonical placeholder
        where each media part was; ConversationError if unusable."""
        return self._render(self._context(conversation), max_chars)

    def render_pieces(self, conversation: dict, max_chars: int | None = None) -> Rendering:
        """The rendering cut into text, template-made control tokens and media slots. Control-token names
        inside the record's strings are hidden from the template behind characters the record and the
        template do not use, and put back as text after the cut: only the template's own text makes a
        Control. `max_chars` bounds the rendering (`document_too_long` above it)."""
        context = self._context(conversation)
        record = {k: v for k, v in context.items() if k not in _RENDERER_KEYS}  # what the record brought
        size = sum(map(len, _texts(record)))
        if max_chars is not None and size > max_chars:  # characters <= UTF-8 bytes: certainly too long
            raise ConversationError("document_too_long", f"the record holds {size:,} characters of text, more than "
                                    f"--max-tokens can hold ({max_chars:,})")
        hidden = _hidden_literals(self._literal, self._edges, record, self._template_chars)
        if hidden:
            context.update(_replaced(record, lambda text: self._hide(text, hidden)))
        rendered = self._render(context, max_chars)
        restore = {ord(marker): name for name, marker in hidden.items()}
        return Rendering(self._cut_at_controls(rendered, restore), any(hidden))

    def _hide(self, text: str, hidden: dict[str, str]) -> str:
        """`text` with each control name replaced by its marker, and fenced by the separator where it
        could join its neighbour into a name."""
        text = self._literal.sub(lambda m: hidden[m.group()], text)
        separator = hidden.get("")
        if separator is not None:
            text = (separator if self._edges.starts(text) else "") + text + \
                (separator if self._edges.ends(text) else "")
        return text

    def _context(self, conversation: dict) -> dict:
        messages = _messages(conversation)
        context = {k: v for k, v in conversation.items() if k != "messages"}
        context.update(messages=[_for_template(m, i) for i, m in enumerate(messages)], bos_token=self.bos_token,
                       eos_token=self.eos_token, add_generation_prompt=False)
        return context

    def _render(self, context: dict, max_chars: int | None) -> str:
        limit = max_chars or MAX_RENDER_CHARS
        token = _BUDGET.set(_Budget(RENDER_STEPS, limit))
        try:
            chunks, size = [], 0
            for chunk in self._template.generate(**context):
                size += len(chunk)
                if size > limit:
                    raise ConversationError("document_too_long", f"the rendering passes {limit:,} characters, more "
                                            "than --max-tokens can hold")
                chunks.append(chunk)
            return "".join(chunks)
        except ConversationError:
            raise
        except Exception as err:  # a template is untrusted code: whatever it raises is this conversation's
            raise ConversationError("template_error", _short_error(err)) from None
        finally:
            _BUDGET.reset(token)

    def _cut_at_controls(self, rendered: str, restore: dict[int, str]) -> list[str | Control | MediaSlot]:
        return [p for p in self._stripped(_cut(rendered, self._cut, restore)) if p != ""]

    def _stripped(self, pieces: list) -> list:
        """HF's `lstrip`/`rstrip` added-token flags: the token takes the whitespace beside it, as the
        tokenizer would have done had it seen the whole rendering."""
        out = list(pieces)
        for i, piece in enumerate(out):
            control = self._controls.get(piece.name) if isinstance(piece, Control) else None
            if control is None:
                continue
            if getattr(control, "lstrip", False) and i > 0 and isinstance(out[i - 1], str):
                out[i - 1] = out[i - 1].rstrip()
            if getattr(control, "rstrip", False) and i + 1 < len(out) and isinstance(out[i + 1], str):
                out[i + 1] = out[i + 1].lstrip()
        return out


def _template_source(tokenizer) -> str:
    """The tokenizer's chat template: a string, or HF's list of named ones (`default`, else the first);
    anything else is refused at start-up, naming the tokenizer."""
    template = tokenizer.chat_template
    if not template:
        raise MmtokError(f"mode sft needs a chat template, but the text tokenizer {tokenizer.name} has none: pass "
                         "an HF tokenizer directory with a chat_template.jinja or a `chat_template` in its "
                         "tokenizer_config.json")
    if isinstance(template, list) and all(isinstance(t, dict) and isinstance(t.get("template"), str)
                                          for t in template):
        named = {t.get("name"): t["template"] for t in template}
        template = named.get("default") or next(iter(named.values()))
    if not isinstance(template, str):
        raise MmtokError(f"text tokenizer {tokenizer.name}: `chat_template` is a {type(template).__name__}, not a "
                         "string or a list of {\"name\": ..., \"template\": string}; fix its tokenizer_config.json")
    return template


def _short_error(err: BaseException) -> str:
    """What a template (or its compiler) raised, as `errors.brief` quotes any library's message."""
    return brief(f"{type(err).__name__}: {err}", 300)


# -- control-token names in the record's text --------------------------------------------------------
def _alternation(names) -> re.Pattern | None:
    names = sorted(names, key=len, reverse=True)  # the longest name first: `<|image_start|>` before `<|image|>`
    return re.compile("|".join(re.escape(n) for n in names)) if names else None


_RENDERER_KEYS = ("bos_token", "eos_token", "add_generation_prompt")


def _hidden_literals(literal: re.Pattern | None, edges: "_Edges", record: dict,
                     template_chars: frozenset) -> dict[str, str]:
    """{control name the record's strings hold: the one character that hides it while rendering}, and
    under "" the character that keeps apart two strings the template may join into a name (`<|inner_` +
    `prefix|>`: one ends with a name's beginning, the other starts with its end). The characters are
    private-use code points that neither those strings nor the template contain, so putting the names
    back (and taking the separators out) after the cut is exact."""
    if literal is None:
        return {}
    strings = list(_texts(record))
    found = sorted({m.group() for text in strings for m in literal.finditer(text)})
    if any(edges.touches(text) for text in strings):
        found.append("")
    if not found:
        return {}
    used = set(template_chars).union(*map(set, strings))
    free = (chr(c) for c in (*range(0x10FFFD, 0xFFFFF, -1), *range(0xFFFFD, 0xEFFFF, -1)) if chr(c) not in used)
    markers = dict(zip(found, free, strict=False))  # one free character each, while they last (checked next)
    if len(markers) < len(found):
        raise ConversationError("unrenderable_text", "the record uses every private-use character: no character "
                                "is left to keep its control-token names as text")
    return markers


class _Edges:
    """Whether a string starts with the end of a control name or ends with its beginning (a proper part)."""

    def __init__(self, names):
        self._lengths = range(1, max(map(len, names), default=1))
        self._heads = {name[:k] for name in names for k in range(1, len(name))}
        self._tails = {name[k:] for name in names for k in range(1, len(name))}

    def starts(self, text: str) -> bool:
        return any(text[:k] in self._tails for k in self._lengths if k <= len(text))

    def ends(self, text: str) -> bool:
        return any(text[-k:] in self._heads for k in self._lengths if k <= len(text))

    def touches(self, text: str) -> bool:
        return self.starts(text) or self.ends(text)


def _texts(value: Any) -> Iterator[str]:
    """Every string of a json-like value, mapping keys included."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _texts(key)
            yield from _texts(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _texts(item)


def _replaced(value: Any, change) -> Any:
    """A json-like value with every string (mapping keys too) passed through `change`."""
    if isinstance(value, str):
        return change(value)
    if isinstance(value, dict):
        return {_replaced(k, change): _replaced(v, change) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_replaced(v, change) for v in value]
    return value


# -- bounded rendering ------------------------------------------------------------------------------
# Why steps, not seconds: a deadline would make whether a conversation is kept depend on the machine's
# load, and a resumed part must hold the same conversations as an uninterrupted one. So every unit of
# template work is charged one step -- each loop iteration (every `for` iterates through `_steps`, put
# in at compile time), attribute or item lookup, call (macros, methods, filters) and arithmetic
# operation -- and each of those is bounded in size (no value or argument above the output bound), so
# RENDER_STEPS bounds the time: about a second of one core (a loop step costs ~0.7 us, a macro call ~10 us,
# so it is charged MACRO_STEPS). A real template spends some tens of steps per message.
RENDER_STEPS = 1_000_000
MACRO_STEPS = 10
MAX_RENDER_CHARS = 1 << 28  # the output bound when the caller gives none
_BUDGET: ContextVar["_Budget"] = ContextVar("mmtok_chat_budget")


class _AtRenderTime(Exception):
    """Raised to jinja's compiler, which then evaluates the expression when rendering, under a budget."""


@dataclass
class _Budget:
    steps: int
    max_size: int


def _charge(*values: Any, ints: bool = False, steps: int = 1) -> None:
    """`steps` of the budget; refuse a value above the output bound (with `ints`: an int that would size
    one, a call's `center(10**9)`)."""
    budget = _BUDGET.get(None)
    if budget is None:  # jinja folding a constant while compiling: make it wait for the rendering's budget
        raise _AtRenderTime()
    budget.steps -= steps
    if budget.steps < 0:
        raise ConversationError("template_error", f"the chat template ran more than {RENDER_STEPS:,} steps")
    for value in values:
        if isinstance(value, (str, bytes, list, tuple, dict)):
            size = len(value)
        elif ints and isinstance(value, int) and not isinstance(value, bool):
            size = abs(value)
        else:
            continue
        if size > budget.max_size:
            raise ConversationError("template_error", f"the chat template made a value of size {size:,}, above the "
                                    f"rendering's bound ({budget.max_size:,}: what --max-tokens can hold)")


def _steps(iterable: Any) -> Iterator[Any]:
    for item in iterable:
        _charge()
        yield item


def _bounded_call(function):
    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def call(*args, **kwargs):
        _charge(*args, *kwargs.values(), ints=True)
        result = function(*args, **kwargs)
        _charge(result)
        return result

    return call


_WIDE_FORMAT = re.compile(r"\d{7}")  # a width or precision of a million or more in a format string


def _bounded_environment():
    from jinja2.runtime import Macro
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})

        def call(self, context, obj, /, *args, **kwargs):  # positional-only: a macro may take `obj=`
            _charge(*args, *kwargs.values(), ints=True, steps=MACRO_STEPS if isinstance(obj, Macro) else 1)
            result = super().call(context, obj, *args, **kwargs)
            _charge(result)
            return result

        def getattr(self, obj, attribute):
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                _check_format(obj)
            result = super().getattr(obj, attribute)
            _charge(result)  # a namespace string doubled in a loop is refused here, before it doubles again
            return result

        def getitem(self, obj, argument):
            result = super().getitem(obj, argument)
            _charge(result)
            return result

        def call_binop(self, context, operator, left, right):
            _charge(left, right)
            if operator == "*":  # a sequence repeated: its size before it is made
                for sequence, times in ((left, right), (right, left)):
                    if hasattr(sequence, "__len__") and isinstance(times, int):
                        _charge(len(sequence) * times, ints=True)
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                _charge(left.bit_length() * right // 8, ints=True)  # the power's size in bytes
            if operator == "%" and isinstance(left, str):
                _check_format(left)
            result = super().call_binop(context, operator, left, right)
            _charge(result)
            return result

    # optimized=False: jinja's optimizer would evaluate constant expressions (`'x' | center(10**9)`) while
    # compiling, outside any budget.
    environment = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"],
                          optimized=False)
    environment.filters = {name: _bounded_call(f) for name, f in environment.filters.items()}
    environment.filters.update(tojson=_bounded_call(_tojson), _mmtok_steps=_steps)
    environment.globals["raise_exception"] = _raise_exception
    return environment


def _check_format(text: str) -> None:
    if _WIDE_FORMAT.search(text):
        raise ConversationError("template_error", "a format string with a width or precision of a million or more")


def _counting_loops(ast):
    """The template's syntax tree with every `for` loop iterating through `_steps`."""
    from jinja2 import nodes

    for loop in ast.find_all(nodes.For):
        loop.iter = nodes.Filter(loop.iter, "_mmtok_steps", [], [], None, None, lineno=loop.lineno)
    return ast


def split_media(text: str) -> list[str | MediaSlot]:
    """Cut rendered text at media placeholders (either spelling): the non-empty text pieces in order,
    with a MediaSlot where each placeholder was."""
    return [p for p in _cut(text, _PLACEHOLDER, {}) if p != ""]


def _cut(text: str, pattern: re.Pattern, restore: dict[int, str]) -> list[str | Control | MediaSlot]:
    """`text` cut at each match of `pattern`: a MediaSlot for a placeholder (numbered per kind), a Control
    for any other name; the text between, with `restore` applied (str.translate), kept empty or not."""
    pieces: list[str | Control | MediaSlot] = []
    counts = dict.fromkeys(MEDIA_KINDS, 0)
    position = 0
    for match in pattern.finditer(text):
        pieces.append(text[position : match.start()].translate(restore))
        name = match.group()
        if name in PLACEHOLDER_KIND:
            kind = PLACEHOLDER_KIND[name]
            pieces.append(MediaSlot(kind, counts[kind]))
            counts[kind] += 1
        else:
            pieces.append(Control(name))
        position = match.end()
    pieces.append(text[position:].translate(restore))
    return pieces


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
        text = "".join(p["text"] if k == "text" else CANONICAL_PLACEHOLDER[k]
                       for p, k in zip(parts, kinds, strict=True))
        return {**message, "content": text}
    parts = [p if k == "text" else {"type": "text", "text": CANONICAL_PLACEHOLDER[k]}
             for p, k in zip(parts, kinds, strict=True)]
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
