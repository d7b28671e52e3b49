"""SFT rendering: the tokenizer's jinja chat template (Apertus format), placeholders -> image blocks."""

from __future__ import annotations

import json

import numpy as np
import pytest
from encodekit import chat_tokenizer

from mmtok.chat import MediaSlot, split_media
from mmtok.encode.documents import DocumentError, DocumentBuilder, Sidecars
from mmtok.errors import MmtokError
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout

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


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_text_tokenizer(str(chat_tokenizer(tmp_path_factory.mktemp("tok"))))


@pytest.fixture(scope="module")
def documents(tokenizer):
    return DocumentBuilder("sft", tokenizer, VocabLayout(text_size=tokenizer.vocab_size))


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


def _blocks(documents, shapes):
    rng = np.random.default_rng(0)
    return {i: documents.image_block(rng.integers(0, 1000, shape)) for i, shape in enumerate(shapes)}


def test_sft_rendering_equals_a_reference_rendering(tokenizer, documents):
    template = documents.template(2, Sidecars(json=json.dumps(CONVERSATION).encode()))
    blocks = _blocks(documents, [(2, 3), (3, 2)])
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
    assert documents.assemble(template, blocks).tolist() == expected


def test_conversation_without_system_message_gets_an_empty_system_block(tokenizer, documents):
    conversation = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}
    ids = documents.assemble(documents.template(0, Sidecars(json=json.dumps(conversation).encode())), {})
    expected = _reference(tokenizer, [
        "<s>", "<|system_start|>", "<|system_end|>", "<|developer_start|>",
        "Deliberation: disabled\nTool Capabilities: disabled", "<|developer_end|>",
        "<|user_start|>", "Hi", "<|user_end|>", "<|assistant_start|>", "Hello", "<|assistant_end|>", "</s>"])
    assert ids.tolist() == expected


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
def test_unusable_conversations_are_skipped_with_a_reason(documents, sidecar, reason):
    with pytest.raises(DocumentError) as caught:
        documents.template(1, Sidecars(json=sidecar))
    assert caught.value.reason == reason


def test_sft_needs_a_tokenizer_with_a_chat_template():
    tekken = load_text_tokenizer("tekken")
    with pytest.raises(MmtokError, match="needs a chat template"):
        DocumentBuilder("sft", tekken, VocabLayout(text_size=tekken.vocab_size))


def test_audio_placeholders_are_missing_media_in_an_image_run(documents):
    conversation = {"messages": [{"role": "user", "content": "<image> <|audio|> and <audio>"}]}
    with pytest.raises(DocumentError) as caught:
        documents.template(1, Sidecars(json=json.dumps(conversation).encode()))
    assert (caught.value.reason, caught.value.detail) == (
        "missing_media", "2 audio placeholders but this run has no audio source")


def test_split_media_accepts_both_spellings_and_numbers_each_kind():
    assert split_media("a<image>b<|audio|><|image|><audio>") == [
        "a", MediaSlot("image", 0), "b", MediaSlot("audio", 0), MediaSlot("image", 1), MediaSlot("audio", 1)]
    assert split_media("no media") == ["no media"]
