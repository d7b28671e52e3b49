"""Omni SFT rendering: every content form (typed placeholders, OpenAI parts, Apertus parts/blocks) marks
image and audio slots, and lists the media that go there.

The tokenizer and chat template (tests/chatkit.py) are the omni tests' own: a small byte-level BPE with the Apertus 1.5
chat special tokens plus `<|image|>`/`<|audio|>` (at ids unlike the real build), and a template in the
Apertus 1.5 layout written from its published facts (chat_templates/Apertus_1p5/chat_template.jinja
in swiss-ai/apertus-omni-tokenizer): BOS; system block (string or `{"text"}`, a default text when there
is no system message); developer block; user turns as strings or `{"parts"}`; assistant turns as strings
or `{"blocks"}` (thoughts -> <|inner_prefix|> .., response closes with <|inner_suffix|>, tool calls as
`[{"name": arguments}, ...]` in <|tools_prefix|>..<|tools_suffix|>, tool outputs joined with ", " in
<|tool_output_start|>..<|tool_output_end|>); no <|assistant_end|> while tool outputs are awaited.
Tools are listed as json lines (the real template writes TypeScript signatures; the token layout is
what these tests pin).

`mmtok.sft.build.ConversationBuilder` then fills each slot with its medium's block (fake stores, see tests/chatkit.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from chatkit import (
    CHAT_TOKENS,
    DEFAULT_SYSTEM,
    TEMPLATE,
    WEATHER_TOOL,
    AudioStore,
    ImageStore,
    audio_block,
    build,
    built_skip,
    image_block,
    tar_conversation,
)
from encodekit import train_chat_tokenizer
from mmtok.errors import Skip
from mmtok.formats.chat import (
    ChatRenderer,
    Control,
    ConversationError,
    MediaRef,
    MediaSlot,
    conversation_media,
    split_media,
)
from mmtok.formats.conversations import Conversation, audio_clip_id, locate
from mmtok.text import load_text_tokenizer

TRAINING_TEXT = [
    "Where is this photo taken? Listen to the clip and tell me which bird sings.",
    "The song is short and high; a robin, like the one in the photo.",
    "Zurich is cloudy today, 14 degrees, with rain later in the evening.",
    "You are a test assistant that sees images and hears audio. Be brief.",
    "Deliberation: enabled disabled. Tool Capabilities: weather lookup city song name.",
]

IMAGE = [MediaSlot("image", i) for i in range(3)]
AUDIO = [MediaSlot("audio", i) for i in range(3)]
PREAMBLE = ["<s>", "<|system_start|>", DEFAULT_SYSTEM, "<|system_end|>", "<|developer_start|>",
            "Deliberation: disabled\nTool Capabilities: disabled", "<|developer_end|>"]

TYPED = {"messages": [
    {"role": "user", "content": "<image> shows a cat; <|audio|> is it purring? <audio>"},
    {"role": "assistant", "content": "Yes, it purrs."}]}

OPENAI = {"tools": [WEATHER_TOOL], "messages": [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [
        {"type": "text", "text": "Where is this? "},
        {"type": "image_url", "image_url": {"url": "https://example.org/zurich.jpg"}},
        {"type": "text", "text": " Listen: "},
        {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}}]},
    {"role": "assistant", "content": "",
     "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": '{"city": "Zurich"}'}}]},
    {"role": "tool", "content": "cloudy, 14 degrees"},
    {"role": "assistant", "content": "Zurich, cloudy."}]}

APERTUS = {"enable_thinking": True, "messages": [
    {"role": "system", "content": {"text": "Be brief."}},
    {"role": "user", "content": {"parts": [
        {"type": "audio", "audio": {"cut_id": "clip-7"}},
        {"type": "text", "text": " Which bird sings, and is it this one? "},
        {"type": "image", "image": "c001.0.jpg"}]}},
    {"role": "assistant", "content": {"blocks": [
        {"type": "thoughts", "text": "The song is short and high."},
        {"type": "tool_calls", "calls": [{"name": "lookup", "arguments": '{"song": "short, high"}'}]},
        {"type": "tool_outputs", "outputs": [{"output": "robin"}]},
        {"type": "thoughts", "text": " A robin, like the photo."},
        {"type": "response", "text": "A robin, the one in the photo."}]}}]}

REFERENCES = {
    "typed": (TYPED, [
        *PREAMBLE, "<|user_start|>", IMAGE[0], " shows a cat; ", AUDIO[0], " is it purring? ", AUDIO[1],
        "<|user_end|>", "<|assistant_start|>", "Yes, it purrs.", "<|assistant_end|>"]),
    "openai": (OPENAI, [
        "<s>", "<|system_start|>", "Be brief.", "<|system_end|>", "<|developer_start|>",
        "Deliberation: disabled\nTool Capabilities:\n" + json.dumps(WEATHER_TOOL), "<|developer_end|>",
        "<|user_start|>", "Where is this? ", IMAGE[0], " Listen: ", AUDIO[0], "<|user_end|>",
        "<|assistant_start|>", "<|tools_prefix|>", '[{"weather": {"city": "Zurich"}}]', "<|tools_suffix|>",
        "<|tool_output_start|>", "cloudy, 14 degrees", "<|tool_output_end|>", "Zurich, cloudy.",
        "<|assistant_end|>"]),
    "apertus": (APERTUS, [
        "<s>", "<|system_start|>", "Be brief.", "<|system_end|>", "<|developer_start|>",
        "Deliberation: enabled\nTool Capabilities: disabled", "<|developer_end|>",
        "<|user_start|>", AUDIO[0], " Which bird sings, and is it this one? ", IMAGE[0], "<|user_end|>",
        "<|assistant_start|>", "<|inner_prefix|>", "The song is short and high.",
        "<|tools_prefix|>", '[{"lookup": {"song": "short, high"}}]', "<|tools_suffix|>",
        "<|tool_output_start|>", "robin", "<|tool_output_end|>", " A robin, like the photo.", "<|inner_suffix|>",
        "A robin, the one in the photo.", "<|assistant_end|>"]),
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = train_chat_tokenizer(tmp_path_factory.mktemp("omni-tok"), vocab_size=360,
                                     special=["<unk>", "<s>", "</s>"], added=CHAT_TOKENS, texts=TRAINING_TEXT,
                                     template=TEMPLATE)
    return load_text_tokenizer(str(directory))


@pytest.fixture(scope="module")
def renderer(tokenizer):
    return ChatRenderer.from_tokenizer(tokenizer)


def _reference(tokenizer, parts: list) -> list:
    """Hand-built: `<|name|>`/`<s>` strings looked up by name, other strings tokenized, slots kept."""
    ids: list = []
    for part in parts:
        if isinstance(part, MediaSlot):
            ids.append(part)
        elif part.startswith("<") and part.endswith(">") and " " not in part:
            ids.append(tokenizer.token_id(part))
        else:
            ids.extend(tokenizer.encode(part))
    return ids


def _tokens(tokenizer, pieces: list) -> list:
    """What an assembly stage starts from: each text piece tokenized, each control token by name, each slot kept."""
    return [x for piece in pieces for x in ([piece] if isinstance(piece, MediaSlot) else
                                            [tokenizer.token_id(piece.name)] if isinstance(piece, Control) else
                                            tokenizer.encode(piece))]


@pytest.mark.parametrize("form", sorted(REFERENCES))
def test_every_content_form_renders_to_the_reference_tokens(tokenizer, renderer, form):
    conversation, reference = REFERENCES[form]
    pieces = renderer.render_pieces(conversation).pieces
    assert _tokens(tokenizer, pieces) == _reference(tokenizer, reference)


@pytest.mark.parametrize("form", sorted(REFERENCES))
def test_listed_media_are_exactly_the_rendered_slots(renderer, form):
    conversation, _ = REFERENCES[form]
    slots = [piece for piece in split_media(renderer.render(conversation)) if isinstance(piece, MediaSlot)]
    assert [ref.slot for ref in conversation_media(conversation)] == slots


def test_media_parts_carry_their_payloads_as_references():
    assert conversation_media(OPENAI) == [
        MediaRef(IMAGE[0], "https://example.org/zurich.jpg"),
        MediaRef(AUDIO[0], {"data": "UklGRiQAAABXQVZF", "format": "wav"})]
    assert conversation_media(APERTUS) == [MediaRef(AUDIO[0], {"cut_id": "clip-7"}), MediaRef(IMAGE[0], "c001.0.jpg")]
    parts = [{"type": "input_image", "image_url": "data:image/png;base64,iVBO"}, {"type": "image", "path": "a/b.png"},
             {"type": "audio_url", "audio_url": {"url": "https://example.org/a.mp3"}}, {"type": "image"}]
    assert conversation_media({"messages": [{"role": "user", "content": parts}]}) == [
        MediaRef(IMAGE[0], "data:image/png;base64,iVBO"), MediaRef(IMAGE[1], "a/b.png"),
        MediaRef(AUDIO[0], "https://example.org/a.mp3"), MediaRef(IMAGE[2], None)]


def test_unreferenced_slots_take_the_record_list_entry_at_their_ordinal():
    assert conversation_media(TYPED) == [MediaRef(IMAGE[0], None), MediaRef(AUDIO[0], None),
                                         MediaRef(AUDIO[1], None)]
    listed = {**TYPED, "images": ["0.jpg"], "audios": ["0.wav", "1.flac"]}
    assert conversation_media(listed) == [MediaRef(IMAGE[0], "0.jpg"), MediaRef(AUDIO[0], "0.wav"),
                                          MediaRef(AUDIO[1], "1.flac")]
    own = {"images": ["listed.jpg", "second.jpg"], "messages": [{"role": "user", "content": [
        {"type": "image", "image": "own.jpg"}, {"type": "text", "text": " and <image>"}]}]}
    assert conversation_media(own) == [MediaRef(IMAGE[0], "own.jpg"), MediaRef(IMAGE[1], "second.jpg")]


def test_media_parts_become_placeholders_whatever_the_template_does_with_them():
    # This template would drop media parts: normalising them to text parts keeps every slot.
    drops_media = ("{% for m in messages %}{% for p in m.content.parts %}{% if p.type == 'text' %}{{ p.text }}"
                   "{% endif %}{% endfor %}{% endfor %}")
    conversation = {"messages": [{"role": "user", "content": {"parts": [
        {"type": "text", "text": "look "}, {"type": "input_image", "image_url": "x.jpg"},
        {"type": "text", "text": " hear "}, {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}}]}
    assert ChatRenderer(drops_media, "<s>", "</s>").render(conversation) == "look <|image|> hear <|audio|>"


@pytest.mark.parametrize("content, reason", [
    ([{"type": "video", "video": "v.mp4"}], "unknown_content_part"),
    ({"parts": [{"type": "text", "text": "hi"}, {"type": "file"}]}, "unknown_content_part"),
    ([{"text": "no type"}], "invalid_content_part"),
    ([{"type": "text", "text": 5}], "invalid_content_part"),
    ({"parts": "not a list"}, "invalid_content_part"),
])
def test_unusable_parts_are_named_before_the_template_sees_them(renderer, content, reason):
    conversation = {"messages": [{"role": "user", "content": content}]}
    for step in (renderer.render, conversation_media):
        with pytest.raises(ConversationError) as caught:
            step(conversation)
        assert caught.value.reason == reason, step


def test_blocks_the_template_does_not_know_are_template_errors(renderer):
    conversation = {"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": {"blocks": [{"type": "image", "image": "x.jpg"}]}}]}
    with pytest.raises(ConversationError) as caught:
        renderer.render(conversation)
    assert (caught.value.reason, caught.value.detail) == ("template_error", "assistant block image")


@pytest.mark.parametrize("record, reason", [
    ({**TYPED, "images": []}, "placeholder_mismatch"),  # one image placeholder, no listed image
    ({**TYPED, "audios": ["0.wav", "1.wav", "2.wav"]}, "placeholder_mismatch"),
    ({**TYPED, "audios": "0.wav"}, "invalid_media_list"),
])
def test_record_lists_must_name_every_medium_of_their_kind(record, reason):
    with pytest.raises(ConversationError) as caught:
        conversation_media(record)
    assert caught.value.reason == reason


# -- conversations built: each slot filled with its medium's block -----------------------------------
def _filled(tokenizer, parts: list, blocks: dict[MediaSlot, np.ndarray]) -> list[int]:
    """The hand-built reference with each slot's block in its place."""
    return [x for item in _reference(tokenizer, parts)
            for x in (blocks[item].tolist() if isinstance(item, MediaSlot) else [item])]


def _stores(conversation: Conversation, blocks: dict[MediaSlot, np.ndarray], clip_ids: list[str]):
    """An image store holding image slot k's block as the member slot k names, and an audio
    store holding audio slot k's block as clip `clip_ids[k]`."""
    media = conversation.media()  # slot k's block under the member slot k names (the tests assert `used` too)
    images = ImageStore({(conversation.tar, locate(conversation, media, slot).member): block
                         for slot, block in blocks.items() if slot.kind == "image"})
    return images, AudioStore({cut_id: blocks[AUDIO[k]] for k, cut_id in enumerate(clip_ids)})


def _blocks(tokenizer, images: int, audio: int) -> dict[MediaSlot, np.ndarray]:
    """Distinct blocks (shapes and lengths differ too) for the first `images` image and `audio` audio slots."""
    blocks = {IMAGE[k]: image_block(tokenizer, k, (2 + k, 3)) for k in range(images)}
    blocks.update({AUDIO[k]: audio_block(tokenizer, 10 + k, 3 + 2 * k) for k in range(audio)})
    return blocks


# The REFERENCES forms as tar samples whose media resolve: the OpenAI image names a member, the Apertus
# audio a clip of the pretraining cache. Form -> (conversation, what the sequence is made of).
OPENAI_IN_TAR = json.loads(json.dumps(OPENAI).replace("https://example.org/zurich.jpg", "0.jpg"))
BUILT = {
    "typed": (tar_conversation(TYPED, ["0.png", "0.wav", "1.wav", "json"], key="t1", tar="omni.tar"),
              {"image": ["omni.tar:t1.0.png"], "audio": ["omni/t1/audio-0", "omni/t1/audio-1"]}),
    "openai": (tar_conversation(OPENAI_IN_TAR, ["0.jpg", "json"], key="o1", tar="omni.tar"),
               {"image": ["omni.tar:o1.0.jpg"], "audio": ["omni/o1/audio-0"]}),
    "apertus": (tar_conversation(APERTUS, ["0.jpg", "json"], key="c001", tar="c.tar"),
                {"image": ["c.tar:c001.0.jpg"], "audio": ["clip-7"]}),
}


@pytest.mark.parametrize("form", sorted(BUILT))
def test_every_content_form_builds_to_the_reference_with_each_block_in_its_slot(tokenizer, form):
    conversation, expected_used = BUILT[form]
    blocks = _blocks(tokenizer, len(expected_used["image"]), len(expected_used["audio"]))
    tokens, used = build(tokenizer, conversation, *_stores(conversation, blocks, expected_used["audio"]))
    assert tokens.tolist() == _filled(tokenizer, [*REFERENCES[form][1], "</s>"], blocks)
    assert used == expected_used


@pytest.mark.parametrize("where", ["tar", "jsonl"])
def test_typed_audio_placeholders_alone_are_filled_with_their_clips(tokenizer, tmp_path, where):
    record = {"messages": [{"role": "user", "content": "Hear <|audio|> then <audio>."},
                           {"role": "assistant", "content": "Two birds."}]}
    if where == "tar":
        conversation = tar_conversation(record, ["0.wav", "1.flac", "json"])
    else:  # the record's `audios` list names the files, relative to the input's directory
        (tmp_path / "clips").mkdir()
        (tmp_path / "clips" / "a.wav").write_bytes(b"RIFF")
        (tmp_path / "b.flac").write_bytes(b"fLaC")
        conversation = Conversation(id="birds", origin=f"{tmp_path}/c.jsonl:line 1", input=0, base=str(tmp_path),
                                    record={**record, "audios": ["clips/a.wav", "b.flac"]})
    clip_ids = [audio_clip_id(conversation.id, k) for k in range(2)]
    blocks = _blocks(tokenizer, 0, 2)
    tokens, used = build(tokenizer, conversation, *_stores(conversation, blocks, clip_ids))
    assert tokens.tolist() == _filled(tokenizer, [
        *PREAMBLE, "<|user_start|>", "Hear ", AUDIO[0], " then ", AUDIO[1], ".", "<|user_end|>",
        "<|assistant_start|>", "Two birds.", "<|assistant_end|>", "</s>"], blocks)
    assert used == {"image": [], "audio": clip_ids}


INTERLEAVED = {"messages": [
    {"role": "user", "content": [
        {"type": "image", "image": "k.2.png"}, {"type": "text", "text": " then "},
        {"type": "audio", "audio": "1.wav"}, {"type": "text", "text": " and "},
        {"type": "image_url", "image_url": {"url": "0.png"}}]},
    {"role": "assistant", "content": "Seen and heard."},
    {"role": "user", "content": {"parts": [
        {"type": "input_audio", "input_audio": {"data": "UklGRiQAAABXQVZF", "format": "wav"}},
        {"type": "audio", "audio": {"cut_id": "pretrain-9"}}, {"type": "text", "text": " last: "},
        {"type": "image", "image": "k.1.png"}]}},
    {"role": "assistant", "content": {"blocks": [{"type": "response", "text": "Done."}]}}]}


def test_interleaved_images_and_audio_each_land_in_their_slot_in_order(tokenizer):
    conversation = tar_conversation(INTERLEAVED, ["0.png", "1.png", "2.png", "0.wav", "1.wav", "json"])
    clip_ids = ["t/k/audio-0", "t/k/audio-1", "pretrain-9"]  # a member, inline bytes, a cache clip
    blocks = _blocks(tokenizer, 3, 3)
    tokens, used = build(tokenizer, conversation, *_stores(conversation, blocks, clip_ids))
    assert tokens.tolist() == _filled(tokenizer, [
        *PREAMBLE, "<|user_start|>", IMAGE[0], " then ", AUDIO[0], " and ", IMAGE[1], "<|user_end|>",
        "<|assistant_start|>", "Seen and heard.", "<|assistant_end|>",
        "<|user_start|>", AUDIO[1], AUDIO[2], " last: ", IMAGE[2], "<|user_end|>",
        "<|assistant_start|>", "Done.", "<|assistant_end|>", "</s>"], blocks)
    assert used == {"image": ["t.tar:k.2.png", "t.tar:k.0.png", "t.tar:k.1.png"], "audio": clip_ids}


def test_image_sft_of_the_parts_form_fills_each_image_slot(tokenizer):
    # A bare image part takes the one image member no reference names.
    record = {"messages": [
        {"role": "user", "content": {"parts": [{"type": "image"}, {"type": "text", "text": " and "},
                                               {"type": "image_url", "image_url": {"url": "b.png"}}]}},
        {"role": "assistant", "content": {"blocks": [{"type": "response", "text": "Two photos."}]}}]}
    conversation = tar_conversation(record, ["a.png", "b.png", "json"])
    blocks = _blocks(tokenizer, 2, 0)
    tokens, used = build(tokenizer, conversation, *_stores(conversation, blocks, []))
    assert tokens.tolist() == _filled(tokenizer, [
        *PREAMBLE, "<|user_start|>", IMAGE[0], " and ", IMAGE[1], "<|user_end|>",
        "<|assistant_start|>", "Two photos.", "<|assistant_end|>", "</s>"], blocks)
    assert used == {"image": ["t.tar:k.a.png", "t.tar:k.b.png"], "audio": []}


@pytest.mark.parametrize("record, encoded_images, clip, reason, detail", [
    ({"messages": [{"role": "user", "content": "<image><image>"}]}, 1, None, "placeholder_mismatch",
     "the conversation has 2 image placeholder(s), the sample's encoded images are 1"),
    (APERTUS, 1, None, "missing_media", "clip-7 is not in the store"),
    (APERTUS, 1, Skip("media_skipped:silent", "clip clip-7: silent"), "media_skipped:silent", "clip clip-7: silent"),
])
def test_conversations_their_media_cannot_fill_are_skipped(tokenizer, record, encoded_images, clip, reason, detail):
    conversation = tar_conversation(record, ["0.jpg", "1.jpg", "json"], key="c001", tar="c.tar")
    images = ImageStore({("c.tar", "c001", k): image_block(tokenizer, k) for k in range(encoded_images)})
    skip = built_skip(tokenizer, conversation, images, AudioStore({"clip-7": clip} if clip else {}))
    assert (skip.reason, skip.detail) == (reason, detail)


@pytest.mark.parametrize("where, content, listed, images, detail", [
    ("jsonl", "<image>", {}, {}, "image 0: a placeholder without a reference"),
    ("jsonl", "<image>", {"images": ["photo.png"]}, {}, "images are encoded from tar members only"),
    ("jsonl", "<audio>", {"audios": ["gone.wav"]}, {}, "audio 0: 'gone.wav' is not a file ("),
    ("jsonl", [{"type": "audio_url", "audio_url": {"url": "https://example.org/a.mp3"}}], {}, {}, "is remote"),
    ("tar", "<image>", {}, None, "no --images was given"),
])
def test_media_that_resolve_to_nothing_encoded_are_missing_media(tokenizer, tmp_path, where, content, listed, images,
                                                                  detail):
    (tmp_path / "photo.png").write_bytes(b"png")  # a file, but not an image of a sample the image encode holds
    record = {**listed, "messages": [{"role": "user", "content": content}]}
    if where == "tar":
        conversation = tar_conversation(record, ["0.png", "json"])
    else:
        conversation = Conversation(id="c/1", origin="c.jsonl:line 1", input=0, record=record, base=str(tmp_path))
    skip = built_skip(tokenizer, conversation, None if images is None else ImageStore(images), AudioStore())
    assert skip.reason == "missing_media" and detail in skip.detail, skip
