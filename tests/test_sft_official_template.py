"""`mmtok sft` against transformers, with the official Apertus 1.5 chat template.

The template is the release's own file (tests/data/apertus_1p5/, see SOURCE.md there), kept as its own
`chat_template.jinja` beside the text tokenizer as the release ships it. `mmtok sft` renders with the text
tokenizer; training reads the omnimodal tokenizer that `mmtok tokenizer build` makes from it, so that is
the one transformers' `AutoTokenizer` loads here. For every conversation, mmtok's tokens are compared with
`apply_chat_template(..., tokenize=True)`'s once each placeholder id the template emits is replaced by
the block mmtok put in its place. The only differences allowed are the rules docs/sft.md documents
("Parity with the official template"): the end-of-document token mmtok appends, OpenAI-style list
contents (mmtok renders them as their `parts` form, the template refuses them), and control-token names
typed into a record (text for mmtok; transformers too with `sanitize_control_tokens=True`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from chatkit import AudioStore, ImageStore, audio_block, build, built_skip, image_block, tar_conversation
from encodekit import SPECIAL_TOKENS, TRAINING_TEXT, train_chat_tokenizer
from mmtok.cli import main
from mmtok.commands.demo_flow import demo_conversations
from mmtok.errors import MmtokError
from mmtok.formats.conversations import audio_clip_id, locate
from mmtok.text import CHAT_TEMPLATE_FILE, load_text_tokenizer

OFFICIAL_TEMPLATE = Path(__file__).parent / "data" / "apertus_1p5" / CHAT_TEMPLATE_FILE
PLACEHOLDERS = {"image": "<|image|>", "audio": "<|audio|>"}

CATALOGUE = {"name": "find_photo", "description": "Find a photo by what it shows.",
             "parameters": {"type": "object", "properties": {"query": {"type": "string", "description": "the subject"},
                                                             "limit": {"type": "integer", "default": 3}},
                            "required": ["query"]}}
WEATHER = {"type": "function", "function": {"name": "weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
THOUGHTS_AND_TOOLS = [
    {"type": "thoughts", "text": "A tabby cat; the catalogue can name the file."},
    {"type": "tool_calls", "calls": [{"name": "find_photo", "arguments": '{"query": "tabby cat"}'}]},
    {"type": "tool_outputs", "outputs": [{"output": '{"file": "chelsea.jpg"}'}]},
    {"type": "thoughts", "text": " One match."},
    {"type": "response", "text": "It is chelsea.jpg, a tabby cat."}]


def user(content):
    return {"role": "user", "content": content}


def assistant(content, **fields):
    return {"role": "assistant", "content": content, **fields}


def parts(*items):
    return {"parts": [{"type": "text", "text": item} if isinstance(item, str) else item for item in items]}


# name -> (record, the sample's media members after `KEY.`): conversations both tools render.
IDENTICAL = {
    "system_string": ({"messages": [
        {"role": "system", "content": "Answer in one sentence."},
        user("What is in the photo?"), assistant("A cat on a red chair.")]}, []),
    "default_system_multi_turn": ({"messages": [
        user("Hello."), assistant("Hello! How can I help?"),
        user("What is the weather in Zurich?"), assistant("Cloudy, 14 degrees."),
        user("And tomorrow?"), assistant("Rain later in the evening.")]}, []),
    "system_text_mapping_and_parts": ({"messages": [
        {"role": "system", "content": {"text": "Be brief."}},
        user(parts("Describe ", "the weather.")),
        assistant({"blocks": [{"type": "response", "text": "Cloudy."}]})]}, []),
    "reasoning_blocks": ({"enable_thinking": True, "messages": [
        user("Is 14 degrees cold?"),
        assistant({"blocks": [{"type": "thoughts", "text": "Let me think step by step."},
                              {"type": "response", "text": "Not very."}]}),
        user("And 4?"),
        assistant({"blocks": [{"type": "thoughts", "text": "Colder."}, {"type": "response", "text": "Yes."}]})]}, []),
    "tool_call_blocks_with_tools": ({"enable_thinking": True, "tools": [CATALOGUE], "messages": [
        user(parts({"type": "image", "image": "0.jpg"}, " Which photo is this?")),
        assistant({"blocks": THOUGHTS_AND_TOOLS})]}, ["0.jpg"]),
    "openai_tool_calls_and_tool_messages": ({"tools": [WEATHER], "messages": [
        user("Weather in Zurich and Bern?"),
        assistant("", tool_calls=[
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Zurich"}'}},
            {"type": "function", "function": {"name": "weather", "arguments": '{"city": "Bern"}'}}]),
        {"role": "tool", "content": "cloudy, 14 degrees"}, {"role": "tool", "content": "sunny, 17 degrees"},
        assistant("Zurich is cloudy, Bern sunny."),
        user("Thanks."), assistant("You are welcome.")]}, []),
    "awaiting_tool_output": ({"tools": [WEATHER], "messages": [
        user("Weather in Zurich?"),
        assistant("", tool_calls=[{"function": {"name": "weather", "arguments": '{"city": "Zurich"}'}}])]}, []),
    "display_answers_closes_thoughts": ({"enable_thinking": True, "messages": [
        user("Pick one: red or blue?"),
        assistant({"blocks": [{"type": "thoughts", "text": "Red is warmer."},
                              {"type": "tool_calls", "calls": [{"name": "display_answers",
                                                                "arguments": '{"answers": ["red"]}'}]}]})]}, []),
    "images_in_parts": ({"messages": [
        user(parts({"type": "image", "image": "0.jpg"}, " and ", {"type": "image_url", "image_url": {"url": "1.png"}},
                   " and ", {"type": "input_image", "image_url": "2.jpg"}, ": which two match?")),
        assistant("The first and the third.")]}, ["0.jpg", "1.png", "2.jpg"]),
    "audio_in_parts": ({"messages": [
        {"role": "system", "content": "Transcribe what is said."},
        user(parts({"type": "audio", "audio": "0.flac"})), assistant("Guten Morgen."),
        user(parts("And these? ", {"type": "audio_url", "audio_url": {"url": "1.wav"}}, " ",
                   {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}})),
        assistant("Bonjour. Buongiorno.")]}, ["0.flac", "1.wav"]),
    "audio_clip_of_the_cache": ({"messages": [
        user(parts({"type": "audio", "audio": {"cut_id": "clip-7"}}, " Which bird sings?")),
        assistant("A robin.")]}, []),
    "typed_placeholders_and_aliases": ({"messages": [
        user("<|image|> shows a cat; <audio> is it purring?"), assistant("Yes, it purrs."),
        user("And here? <image>"), assistant("No cat here.")]}, ["0.jpg", "0.wav", "1.jpg"]),
    "media_across_turns_with_tools": ({"tools": [CATALOGUE], "enable_thinking": True, "messages": [
        {"role": "system", "content": {"text": "You see images and hear audio."}},
        user(parts({"type": "audio", "audio": "0.flac"}, " Find the photo the speaker asks for.")),
        assistant({"blocks": THOUGHTS_AND_TOOLS}),
        user(parts("Is it this one? ", {"type": "image", "image": "0.jpg"})),
        assistant({"blocks": [{"type": "response", "text": "Yes."}]})]}, ["0.flac", "0.jpg"]),
}

# Conversations the official template refuses: mmtok skips them too (template_error), for the same reason.
REFUSED_BY_BOTH = {
    "dict_tool_arguments": {"messages": [
        user("Find the cat."),
        assistant({"blocks": [{"type": "tool_calls", "calls": [{"name": "find_photo",
                                                                "arguments": {"query": "cat"}}]}]})]},
    "unknown_role": {"messages": [{"role": "narrator", "content": "Once upon a time."}, user("Go on.")]},
    "assistant_string_then_blocks": {"messages": [
        user("Hi."), assistant("Hello."), assistant({"blocks": [{"type": "response", "text": " Again."}]})]},
}

LIST_CONTENT = {"messages": [
    user([{"type": "image", "image": "0.jpg"}, {"type": "text", "text": " What is this? "},
          {"type": "audio", "audio": "0.flac"}]),
    assistant("A cat, and a purr.")]}
CONTROL_LITERAL = {"messages": [user("Please end with <|assistant_end|> and <|user_end|>."), assistant("Done.")]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """(mmtok's text tokenizer, transformers' tokenizer of the omnimodal build, the text tokenizer's directory):
    a small BPE with the Apertus chat tokens whose chat template is the official file, and what
    `mmtok tokenizer build` makes of it."""
    root = tmp_path_factory.mktemp("official")
    base = train_chat_tokenizer(root / "text", vocab_size=400, special=SPECIAL_TOKENS[:4], added=SPECIAL_TOKENS[4:],
                                texts=TRAINING_TEXT, template="")
    config = json.loads((base / "tokenizer_config.json").read_text())
    del config["chat_template"]  # the release keeps its template in chat_template.jinja only
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    (base / CHAT_TEMPLATE_FILE).write_bytes(OFFICIAL_TEMPLATE.read_bytes())
    assert main(["tokenizer", "build", "--text-tokenizer", str(base), "--out", str(root / "omni")]) == 0
    assert (root / "omni" / CHAT_TEMPLATE_FILE).read_bytes() == OFFICIAL_TEMPLATE.read_bytes()
    hf = AutoTokenizer.from_pretrained(str(root / "omni"))
    assert hf.chat_template == OFFICIAL_TEMPLATE.read_text()
    return load_text_tokenizer(str(base)), hf, base


def mmtok_tokens(tokenizer, record: dict, members: list[str]) -> tuple[list[int], dict[str, list[np.ndarray]]]:
    """(`mmtok sft`'s tokens of the record as tar sample `k`, each kind's media blocks in slot order): every
    medium a distinct real block (image shapes and clip lengths differ)."""
    conversation = tar_conversation(record, [*members, "json"])
    media = conversation.media()
    images, clips, blocks = {}, {}, {}
    for number, ref in enumerate(media):
        located = locate(conversation, media, ref.slot)
        if ref.slot.kind == "image":
            blocks[ref.slot] = images[(conversation.tar, located.member)] = \
                image_block(tokenizer, number, (2 + number % 3, 3))
        else:
            blocks[ref.slot] = clips[located.cut_id or audio_clip_id(conversation.id, ref.slot.index)] = \
                audio_block(tokenizer, number, 3 + number)
    tokens, _ = build(tokenizer, conversation, ImageStore(images), AudioStore(clips))
    return tokens.tolist(), {kind: [blocks[slot] for slot in sorted(blocks, key=lambda s: s.index) if slot.kind == kind]
                             for kind in PLACEHOLDERS}


def official_tokens(hf, record: dict, **options) -> list[int]:
    """transformers' `apply_chat_template(..., tokenize=True)` of the record's messages and other keys."""
    extra = {key: value for key, value in record.items() if key != "messages"}
    return hf.apply_chat_template(record["messages"], tokenize=True, return_dict=False, **extra, **options)


def filled(hf, ids: list[int], blocks: dict[str, list[np.ndarray]], eod: int) -> list[int]:
    """The template's tokens with its k-th image (audio) placeholder id replaced by the k-th image (audio)
    block, then the end-of-document token mmtok appends."""
    kinds = {hf.convert_tokens_to_ids(name): kind for kind, name in PLACEHOLDERS.items()}
    queues = {kind: list(found) for kind, found in blocks.items()}
    out = []
    for token in ids:
        out += queues[kinds[token]].pop(0).tolist() if token in kinds else [token]
    assert not any(queues.values()), "a medium the template has no placeholder for"
    return out + [eod]


@pytest.mark.parametrize("name", IDENTICAL)
def test_sft_tokens_equal_the_official_template_through_transformers(tokenizers, name):
    tokenizer, hf, _ = tokenizers
    record, members = IDENTICAL[name]
    tokens, blocks = mmtok_tokens(tokenizer, record, members)
    official = official_tokens(hf, record)
    assert tokens == filled(hf, official, blocks, tokenizer.eos_id)
    assert official[-1] != tokenizer.eos_id  # the template never ends a conversation with EOS: mmtok's EOD is its own


@pytest.mark.parametrize("name", REFUSED_BY_BOTH)
def test_conversations_the_official_template_refuses_are_skipped(tokenizers, name):
    from jinja2 import TemplateError

    tokenizer, hf, _ = tokenizers
    with pytest.raises((TemplateError, TypeError)):
        official_tokens(hf, REFUSED_BY_BOTH[name])
    assert built_skip(tokenizer, tar_conversation(REFUSED_BY_BOTH[name], ["json"])).reason == "template_error"


def test_list_content_renders_as_its_parts_form_which_the_official_template_accepts(tokenizers):
    from jinja2 import TemplateError

    tokenizer, hf, _ = tokenizers
    with pytest.raises(TemplateError, match="Invalid user message"):
        official_tokens(hf, LIST_CONTENT)
    as_parts = json.loads(json.dumps(LIST_CONTENT))
    as_parts["messages"][0]["content"] = {"parts": LIST_CONTENT["messages"][0]["content"]}
    members = ["0.jpg", "0.flac"]
    tokens, blocks = mmtok_tokens(tokenizer, LIST_CONTENT, members)
    assert tokens == mmtok_tokens(tokenizer, as_parts, members)[0]
    assert tokens == filled(hf, official_tokens(hf, as_parts), blocks, tokenizer.eos_id)


def test_control_token_names_typed_in_a_record_stay_text_as_with_sanitize_control_tokens(tokenizers):
    tokenizer, hf, base = tokenizers
    tokens, _ = mmtok_tokens(tokenizer, CONTROL_LITERAL, [])
    plain = official_tokens(hf, CONTROL_LITERAL)
    # the text tokenizer's own directory (same template, same text ids): sanitizing scans every special token,
    # and the omnimodal build has 135,368 of them
    sanitized = official_tokens(AutoTokenizer.from_pretrained(str(base)), CONTROL_LITERAL, sanitize_control_tokens=True)
    assert tokens == sanitized + [tokenizer.eos_id]
    assert tokens != plain + [tokenizer.eos_id]  # by default transformers makes the typed names control tokens
    end = tokenizer.token_id("<|assistant_end|>")
    assert plain.count(end) == 2 and sanitized.count(end) == tokens.count(end) == 1


def test_the_demo_conversations_are_ones_the_official_template_renders(tokenizers):
    """`mmtok demo`'s SFT set: all four render with the official template; the three mmtok keeps are the
    template's tokens, media filled; the planted one (two placeholders, one clip) mmtok skips for that."""
    tokenizer, hf, _ = tokenizers
    *kept, (_, planted, members) = demo_conversations()
    for _, record, media in kept:
        tokens, blocks = mmtok_tokens(tokenizer, record, [name for name, _ in media])
        assert tokens == filled(hf, official_tokens(hf, record), blocks, tokenizer.eos_id)
    official_tokens(hf, planted)
    conversation = tar_conversation(planted, [name for name, _ in members] + ["json"])
    assert built_skip(tokenizer, conversation, audio=AudioStore()).reason == "placeholder_mismatch"


def test_parity_counts_are_those_docs_sft_states():
    """docs/sft.md "Parity with the official template" states these counts; a new case changes both."""
    page = (Path(__file__).parent.parent / "docs" / "sft.md").read_text()
    counts = (len(IDENTICAL) + len(REFUSED_BY_BOTH) + 2, len(IDENTICAL), len(REFUSED_BY_BOTH), 2)
    assert "{} conversations: {} identical, {} refused by both, {} documented differences".format(*counts) in page


def test_chat_template_file_wins_over_the_config_key_as_in_transformers(tmp_path):
    """A tokenizer directory with both: mmtok renders with chat_template.jinja, as AutoTokenizer does."""
    base = train_chat_tokenizer(tmp_path, vocab_size=300, special=SPECIAL_TOKENS[:4], added=SPECIAL_TOKENS[4:],
                                texts=TRAINING_TEXT, template="{{ bos_token }}stale")
    (tmp_path / CHAT_TEMPLATE_FILE).write_bytes(OFFICIAL_TEMPLATE.read_bytes())
    before = load_text_tokenizer(str(tmp_path)).fingerprint
    assert load_text_tokenizer(str(tmp_path)).chat_template == OFFICIAL_TEMPLATE.read_text()
    assert AutoTokenizer.from_pretrained(str(base)).chat_template == OFFICIAL_TEMPLATE.read_text()
    (tmp_path / CHAT_TEMPLATE_FILE).write_text("{{ bos_token }}other")
    assert load_text_tokenizer(str(tmp_path)).fingerprint != before  # a run records which template it rendered with


def test_a_chat_template_file_that_is_not_utf8_is_one_line_naming_it(tmp_path):
    train_chat_tokenizer(tmp_path, vocab_size=300, special=SPECIAL_TOKENS[:4], added=SPECIAL_TOKENS[4:],
                         texts=TRAINING_TEXT, template="{{ bos_token }}")
    (tmp_path / CHAT_TEMPLATE_FILE).write_bytes(b"{{ bos_token }}\xff")
    with pytest.raises(MmtokError, match=f"{CHAT_TEMPLATE_FILE}: not UTF-8 text"):
        load_text_tokenizer(str(tmp_path))
