"""SFT conversations -> tokens (`mmtok.sft.build.ConversationBuilder`): the tokenizer's jinja chat template
(Apertus format), each placeholder filled with its medium's block from the image / audio stores.

The stores are fakes (tests/chatkit.py) with the methods the builder calls on `mmtok.sft.build.ImageItems`
and `mmtok.sft.build.AudioClips`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from chatkit import AudioStore, ImageStore, audio_block, build, built_skip, image_block, tar_conversation
from encodekit import chat_tokenizer, write_tar
from mmtok.errors import MmtokError, Skip
from mmtok.formats.chat import ChatRenderer, MediaSlot, split_media
from mmtok.formats.conversations import Conversation, audio_clip_id, read_conversations
from mmtok.sft.build import DEFAULT_MAX_TOKENS, ConversationBuilder
from mmtok.text import load_text_tokenizer

CONVERSATION = {
    "enable_thinking": True,
    "tools": [{"name": "get_weather", "parameters": {"city": "string"}}],
    "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "<image>\nWhat is in this image? And the weather in Zurich?"},
        {"role": "assistant", "reasoning_content": "Let me think step by step.", "content": "A cat.",
         "tool_calls": [{"name": "get_weather", "arguments": {"city": "Zurich"}}]},
        {"role": "tool", "content": "cloudy, 14 degrees"},
        {"role": "assistant", "content": "Cloudy, 14 degrees."},
        {"role": "user", "content": [{"type": "text", "text": "And this one? "}, {"type": "image"}]},
        {"role": "assistant", "reasoning_content": "A rocket on the pad.", "content": "A rocket."},
    ],
}
NO_TOOLS = ["<|developer_start|>", "Deliberation: disabled\nTool Capabilities: disabled", "<|developer_end|>"]


# -----------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tokenizer_directory(tmp_path_factory) -> Path:
    return chat_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tokenizer(tokenizer_directory):
    return load_text_tokenizer(str(tokenizer_directory))


def _reference(tokenizer, parts) -> list[int]:
    """Hand-built ids: `<|name|>` strings are looked up by name, other strings tokenized, arrays kept."""
    ids: list[int] = []
    for part in parts:
        if isinstance(part, np.ndarray):
            ids.extend(part.tolist())
        elif part.startswith("<") and part.endswith(">") and " " not in part:
            ids.append(tokenizer.token_id(part))
        else:
            ids.extend(tokenizer.encode(part))
    return ids


def test_sft_rendering_equals_a_reference_rendering(tokenizer):
    blocks = [image_block(tokenizer, 0, (2, 3)), image_block(tokenizer, 1, (3, 2))]
    images = ImageStore({("t.tar", "k", 0): blocks[0], ("t.tar", "k", 1): blocks[1]})
    tokens, used = build(tokenizer, tar_conversation(CONVERSATION, ["0.png", "1.png", "json"]), images)
    tools = json.dumps(CONVERSATION["tools"][0])
    calls = json.dumps(CONVERSATION["messages"][2]["tool_calls"])
    expected = _reference(tokenizer, [
        "<s>", "<|system_start|>", "Be brief.", "<|system_end|>",
        "<|developer_start|>", "Deliberation: enabled\nTool Capabilities:\n" + tools, "<|developer_end|>",
        "<|user_start|>", blocks[0], "\nWhat is in this image? And the weather in Zurich?", "<|user_end|>",
        "<|assistant_start|>", "<|inner_prefix|>", "Let me think step by step.", "<|inner_suffix|>", "A cat.",
        "<|tools_prefix|>", calls, "<|tools_suffix|>",
        "<|tool_output_start|>", "cloudy, 14 degrees", "<|tool_output_end|>", "Cloudy, 14 degrees.",
        "<|assistant_end|>",
        "<|user_start|>", "And this one? ", blocks[1], "<|user_end|>",
        "<|assistant_start|>", "<|inner_prefix|>", "A rocket on the pad.", "<|inner_suffix|>", "A rocket.",
        "<|assistant_end|>", "</s>",
    ])
    assert tokens.dtype == np.int32 and tokens.tolist() == expected
    assert used == {"image": ["t.tar:k.0.png", "t.tar:k.1.png"], "audio": []}


def test_conversation_without_system_message_gets_an_empty_system_block(tokenizer, tmp_path):
    record = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    conversation = Conversation(id="c/00000001", origin="c.jsonl:line 1", input=0, record=record, base=str(tmp_path))
    tokens, used = build(tokenizer, conversation)
    expected = _reference(tokenizer, [
        "<s>", "<|system_start|>", "<|system_end|>", *NO_TOOLS,
        "<|user_start|>", "Hi", "<|user_end|>", "<|assistant_start|>", "Hello", "<|assistant_end|>", "</s>"])
    assert tokens.tolist() == expected
    assert used == {"image": [], "audio": []}


def test_special_tokens_come_from_the_tokenizer_not_constants(tokenizer):
    # The test tokenizer puts the reasoning markers elsewhere than Apertus' 32/33.
    assert tokenizer.token_id("<|inner_prefix|>") not in (32, 33)
    assert tokenizer.token_id("<|inner_suffix|>") == tokenizer.token_id("<|inner_prefix|>") + 1


@pytest.mark.parametrize("sidecar, reason", [
    (None, "missing_json"),
    (b"{not json", "invalid_json"),
    (b"[1, 2]", "invalid_json"),
    (json.dumps({"messages": []}).encode(), "no_messages"),
    (json.dumps({"messages": [{"role": "robot", "content": "x"}]}).encode(), "template_error"),
    (json.dumps({"messages": [{"role": "user", "content": "<|image|> and <image>"}]}).encode(),
     "placeholder_mismatch"),
    (json.dumps({"messages": [{"role": "user", "content": [{"type": "video"}]}]}).encode(), "unknown_content_part"),
])
def test_unusable_conversations_are_skipped_with_a_reason(tokenizer, tmp_path, sidecar, reason):
    members = [("k.0.png", b"png")] + ([("k.json", sidecar)] if sidecar is not None else [])
    tar = write_tar(tmp_path / "t.tar", members)
    [conversation] = read_conversations([tar])
    images = ImageStore({(str(tar), "k", 0): image_block(tokenizer, 0)})
    assert built_skip(tokenizer, conversation, images).reason == reason


def test_sft_needs_a_tokenizer_with_a_chat_template():
    tekken = load_text_tokenizer("tekken")
    with pytest.raises(MmtokError, match="needs a chat template"):
        ChatRenderer.from_tokenizer(tekken)
    with pytest.raises(MmtokError, match="needs a chat template"):
        ConversationBuilder(tekken, None, AudioStore(), DEFAULT_MAX_TOKENS)


def test_audio_placeholders_are_filled_from_the_audio_store(tokenizer):
    record = {"messages": [{"role": "user", "content": "<image> <|audio|> and <audio>"}]}
    conversation = tar_conversation(record, ["0.png", "0.wav", "1.wav", "json"])
    picture = image_block(tokenizer, 0)
    clips = [audio_block(tokenizer, 1, 4), audio_block(tokenizer, 2, 7)]
    audio = AudioStore({audio_clip_id("t/k", 0): clips[0], audio_clip_id("t/k", 1): clips[1]})
    tokens, used = build(tokenizer, conversation, ImageStore({("t.tar", "k", 0): picture}), audio)
    expected = _reference(tokenizer, [
        "<s>", "<|system_start|>", "<|system_end|>", *NO_TOOLS,
        "<|user_start|>", picture, " ", clips[0], " and ", clips[1], "<|user_end|>", "</s>"])
    assert tokens.tolist() == expected
    assert used == {"image": ["t.tar:k.0.png"], "audio": ["t/k/audio-0", "t/k/audio-1"]}


@pytest.mark.parametrize("kind, stored", [
    ("audio", None),  # the store lacks the clip: its own missing_media
    ("audio", Skip("media_skipped:silent", "clip t/k/audio-1: every sample is below the silence threshold")),
    ("image", None),
    ("image", Skip("media_skipped:decode_error", "image 0: truncated PNG")),
])
def test_a_medium_the_store_cannot_give_is_the_skip_the_store_raised(tokenizer, kind, stored):
    record = {"messages": [{"role": "user", "content": "<image> <|audio|> and <audio>"}]}
    conversation = tar_conversation(record, ["0.png", "0.wav", "1.wav"])
    images = {("t.tar", "k", 0): image_block(tokenizer, 0)}
    audio = {audio_clip_id("t/k", 0): audio_block(tokenizer, 1), audio_clip_id("t/k", 1): audio_block(tokenizer, 2)}
    store, where = (audio, audio_clip_id("t/k", 1)) if kind == "audio" else (images, ("t.tar", "k", 0))
    del store[where]
    if stored is not None:
        store[where] = stored
    expected = stored or Skip("missing_media", f"{where} is not in the store")
    skip = built_skip(tokenizer, conversation, ImageStore(images, counts={("t.tar", "k"): 1}), AudioStore(audio))
    assert (skip.reason, skip.detail) == (expected.reason, expected.detail)


def test_a_different_number_of_encoded_images_is_a_placeholder_mismatch(tokenizer):
    blocks = {("t.tar", "k", i): image_block(tokenizer, i) for i in range(2)}
    images = ImageStore(blocks, counts={("t.tar", "k"): 3})
    skip = built_skip(tokenizer, tar_conversation(CONVERSATION, ["0.png", "1.png"]), images)
    assert (skip.reason, skip.detail) == ("placeholder_mismatch", ("the conversation has 2 image placeholder(s), "
                                                                   "the sample's encoded images are 3"))


def test_a_conversation_over_max_tokens_is_document_too_long(tokenizer):
    record = {"messages": [{"role": "user", "content": "<image> and <audio>"}, {"role": "assistant", "content": "Hi"}]}
    conversation = tar_conversation(record, ["0.png", "0.wav"])
    images = ImageStore({("t.tar", "k", 0): image_block(tokenizer, 0)})
    audio = AudioStore({audio_clip_id("t/k", 0): audio_block(tokenizer, 1)})
    tokens, _ = build(tokenizer, conversation, images, audio)
    assert build(tokenizer, conversation, images, audio, max_tokens=tokens.size)[0].tolist() == tokens.tolist()
    skip = built_skip(tokenizer, conversation, images, audio, max_tokens=tokens.size - 1)
    assert (skip.reason, skip.detail) == ("document_too_long",
                                          f"{tokens.size:,} tokens > --max-tokens {tokens.size - 1:,}")


@pytest.mark.parametrize("template", [
    "{% for m in messages %}{{ m.content }}{% endfor %}",
    "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}",
    "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}",
], ids=["neither", "bos", "eos", "both"])
def test_bos_and_eos_are_added_once_whether_or_not_the_template_renders_them(tokenizer_directory, tmp_path,
                                                                              template):
    # The rendering starts with an image and ends with a clip, so an added BOS/EOS borders a block.
    shutil.copy(tokenizer_directory / "tokenizer.json", tmp_path)
    config = json.loads((tokenizer_directory / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    tokenizer = load_text_tokenizer(str(tmp_path))
    record = {"messages": [{"role": "user", "content": "<image> Hi <audio>"}]}
    picture, clip = image_block(tokenizer, 0), audio_block(tokenizer, 1)
    tokens, _ = build(tokenizer, tar_conversation(record, ["0.png", "0.wav"]),
                      ImageStore({("t.tar", "k", 0): picture}), AudioStore({audio_clip_id("t/k", 0): clip}))
    assert tokens.tolist() == _reference(tokenizer, ["<s>", picture, " Hi ", clip, "</s>"])


@pytest.mark.parametrize("members, record, allowed", [
    # typed placeholders, the sample's images stored out of their numeric order: which image is slot 0 is
    # the rule's choice (tar order or numeric), but the block there must be the one provenance names
    (["1.png", "0.png"], {"messages": [{"role": "user", "content": "<image> and <image>"}]},
     [["t.tar:k.0.png", "t.tar:k.1.png"], ["t.tar:k.1.png", "t.tar:k.0.png"]]),
    # a bare image part (the one image no reference names) before a named one
    (["a.png", "b.png"], {"messages": [{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": " and "}, {"type": "image", "image": "b.png"}]}]},
     [["t.tar:k.a.png", "t.tar:k.b.png"]]),
])
def test_each_image_slot_gets_the_block_of_the_member_it_names(tokenizer, members, record, allowed):
    """The block in slot k is the image item of the member that provenance names for slot k."""
    names = [f"k.{m}" for m in members]
    blocks = {name: image_block(tokenizer, seed) for seed, name in enumerate(names)}
    images = ImageStore({("t.tar", name): blocks[name] for name in names}, counts={("t.tar", "k"): len(names)})
    tokens, used = build(tokenizer, tar_conversation(record, members), images)
    assert used["image"] in allowed
    named = [blocks[where.removeprefix("t.tar:")] for where in used["image"]]
    assert tokens.tolist() == _reference(tokenizer, [
        "<s>", "<|system_start|>", "<|system_end|>", *NO_TOOLS,
        "<|user_start|>", named[0], " and ", named[1], "<|user_end|>", "</s>"])


def test_split_media_accepts_both_spellings_and_numbers_each_kind():
    assert split_media("a<image>b<|audio|><|image|><audio>") == [
        "a", MediaSlot("image", 0), "b", MediaSlot("audio", 0), MediaSlot("image", 1), MediaSlot("audio", 1)]
    assert split_media("no media") == ["no media"]


def test_a_tokenizer_differing_only_in_its_config_is_named_by_the_differing_keys(tokenizer_directory, tmp_path):
    """Same tokenizer.json, another chat template: the refusal names the config key, not two tokenizer names."""
    from mmtok.sft.build import _check_image_run
    from mmtok.vocab import VocabLayout

    recorded = load_text_tokenizer(str(tokenizer_directory))
    other = shutil.copytree(tokenizer_directory, tmp_path / "other-template")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] += "{# edited #}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    layout = VocabLayout(recorded.vocab_size)
    identity = {"modality": "image", "mode": "sft", "text_tokenizer": recorded.describe(), "vocab": layout.to_dict()}
    with pytest.raises(MmtokError) as refused:
        _check_image_run(tmp_path / "images", identity, tmp_path / "identity.json", layout,
                         load_text_tokenizer(str(other)))
    message = str(refused.value)
    assert "the same tokenizer.json" in message and "tokenizer_config.json differs in chat_template" in message
    assert "made with text tokenizer" not in message
