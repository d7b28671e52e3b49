"""SFT end to end: conversations rendered with the tokenizer's chat template, images expanded, merge
--strip-reasoning removing exactly the reasoning spans."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from encodekit import SFT_SAMPLES, chat_tokenizer, parse_block, real_images, sft_corpus, write_tar
from mmtok.cli import main
from mmtok.codecs import emu35
from mmtok.formats.megatron import read_sequences
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout

DEVELOPER = {False: "Deliberation: disabled\nTool Capabilities: disabled",
             True: "Deliberation: enabled\nTool Capabilities: disabled"}
IMAGE = object()  # where an image block goes in a reference rendering


def _reference(key: str) -> list:
    """The Apertus rendering of SFT_SAMPLES[key], written out by hand: special tokens by name, text, images."""
    if key == "c000":
        return ["<s>", "<|system_start|>", "<|system_end|>", "<|developer_start|>", DEVELOPER[True],
                "<|developer_end|>", "<|user_start|>", IMAGE, "\nWhat is in this image?", "<|user_end|>",
                "<|assistant_start|>", "<|inner_prefix|>", "Let me think step by step about the cat.",
                "<|inner_suffix|>", "A cat sitting on a red chair.", "<|assistant_end|>", "</s>"]
    if key == "c001":
        tools = json.dumps({"name": "get_weather", "parameters": {"city": "string"}})
        calls = json.dumps([{"name": "get_weather", "arguments": {"city": "Zurich"}}])
        return ["<s>", "<|system_start|>", "Be brief.", "<|system_end|>", "<|developer_start|>",
                "Deliberation: disabled\nTool Capabilities:\n" + tools, "<|developer_end|>", "<|user_start|>", IMAGE,
                " and ", IMAGE, ": the weather in Zurich?", "<|user_end|>", "<|assistant_start|>", "<|inner_prefix|>",
                "The rocket waits on the launch pad.", "<|inner_suffix|>", "<|tools_prefix|>", calls,
                "<|tools_suffix|>", "<|tool_output_start|>", "cloudy, 14 degrees", "<|tool_output_end|>",
                "Cloudy, 14 degrees.", "<|assistant_end|>", "</s>"]
    return ["<s>", "<|system_start|>", "<|system_end|>", "<|developer_start|>", DEVELOPER[False], "<|developer_end|>",
            "<|user_start|>", "Describe ", IMAGE, "<|user_end|>", "<|assistant_start|>", "<|inner_prefix|>",
            "Only reasoning here.", "<|inner_suffix|>", "<|assistant_end|>", "</s>"]


def _ids(parts: list, tokenizer, blocks: list) -> list[int]:
    ids, images = [], iter(blocks)
    for part in parts:
        if part is IMAGE:
            ids.extend(next(images).tolist())
        elif part.startswith("<") and part.endswith(">") and " " not in part:
            ids.append(tokenizer.token_id(part))
        else:
            ids.extend(tokenizer.encode(part))
    return ids


def _without_reasoning(parts: list) -> list:
    out, inside = [], False
    for part in parts:
        if part is not IMAGE and part == "<|inner_prefix|>":
            inside = True
        elif part is not IMAGE and part == "<|inner_suffix|>":
            inside = False
        elif not inside:
            out.append(part)
    return out


def _sft_pipeline(data: Path, work: Path, text: Path, checkpoint: Path, *merge: str) -> Path:
    """scan, plan (mode sft), encode, sft and merge the tars in `data` under `work`; returns the sft output."""
    assert main(["scan", str(data / "*.tar"), "--out", str(work / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    assert main(["plan", str(work / "manifest"), "--out", str(work / "plan"), "--quiet", "--mode", "sft",
                 "--text-tokenizer", str(text), "--min-pixels", "1024", "--max-pixels", "2304",
                 "--token-budget", "40", "--max-batch-images", "2"]) == 0
    assert main(["encode", "--plan", str(work / "plan"), "--checkpoint", str(checkpoint), "--out", str(work / "images"),
                 "--device", "cpu", "--no-progress"]) == 0
    assert main(["sft", *map(str, sorted(data.glob("*.tar"))), "--text-tokenizer", str(text), "--images",
                 str(work / "images"), "--out", str(work / "out"), "--no-progress"]) == 0
    assert main(["merge", str(work / "out"), *merge]) == 0
    return work / "out"


@pytest.fixture(scope="module")
def sft_inputs(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(a scratch directory, the chat tokenizer's directory, a random emu3.5 checkpoint)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sft")
    return root, chat_tokenizer(root / "tokenizer"), emu35.write_random_checkpoint(root / "ckpt")


@pytest.fixture(scope="module")
def sft_run(sft_inputs):
    root, text, checkpoint = sft_inputs
    sft_corpus(root / "data")
    return _sft_pipeline(root / "data", root, text, checkpoint, "--strip-reasoning"), load_text_tokenizer(str(text))


def test_sft_tokens_equal_the_reference_rendering(sft_run):
    out, tokenizer = sft_run
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    keys = [json.loads(x)["conversation"].split("/")[-1]
            for x in (out / "merged.provenance.jsonl").read_text().splitlines()]
    assert keys == [key for key, _, _ in SFT_SAMPLES]  # in input order
    for key, tokens in zip(keys, read_sequences(out / "merged"), strict=True):
        starts = np.flatnonzero(tokens == layout.special_id("<|img_start|>"))
        blocks = []
        for start in starts:
            _, end = parse_block(tokens, int(start), layout, tokenizer)
            blocks.append(tokens[start:end])
        assert tokens.tolist() == _ids(_reference(key), tokenizer, blocks), key


def test_stripped_copy_has_no_reasoning_and_everything_else_intact(sft_run):
    out, tokenizer = sft_run
    layout = VocabLayout(text_size=tokenizer.vocab_size)
    markers = [tokenizer.token_id("<|inner_prefix|>"), tokenizer.token_id("<|inner_suffix|>")]
    keys = [json.loads(x)["conversation"].split("/")[-1]
            for x in (out / "merged.provenance.jsonl").read_text().splitlines()]
    merged = list(read_sequences(out / "merged"))
    stripped = list(read_sequences(out / "merged_no_reasoning"))
    assert len(stripped) == len(merged) == len(SFT_SAMPLES)
    for key, full, short in zip(keys, merged, stripped, strict=True):
        assert not np.isin(short, markers).any()
        starts = np.flatnonzero(full == layout.special_id("<|img_start|>"))
        blocks = [full[s : parse_block(full, int(s), layout, tokenizer)[1]] for s in starts]
        assert short.tolist() == _ids(_without_reasoning(_reference(key)), tokenizer, blocks), key
    summary = json.loads((out / "merged.json").read_text())["strip_reasoning"]
    assert summary["spans_removed"] == 3 and summary["dropped_empty_sequences"] == 0
    stripped_keys = (out / "merged_no_reasoning.provenance.jsonl").read_text().splitlines()
    assert [json.loads(x)["conversation"].split("/")[-1] for x in stripped_keys] == keys


def test_merged_rows_follow_the_order_the_messages_reference_the_images(sft_inputs):
    root, text, checkpoint = sft_inputs
    images = real_images()
    parts = [{"type": "image_url", "image_url": "1.png"}, {"type": "text", "text": " or "},
             {"type": "image_url", "image_url": {"url": "0.png"}}]
    conversation = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Both."}]}
    write_tar(root / "refs" / "data" / "refs-0.tar", [
        ("r000.0.png", images["coffee.png"].read_bytes()), ("r000.1.png", images["astronaut.png"].read_bytes()),
        ("r000.json", json.dumps(conversation).encode())])
    out = _sft_pipeline(root / "refs" / "data", root / "refs", text, checkpoint)
    (document,) = [json.loads(x) for x in (out / "merged.provenance.jsonl").read_text().splitlines()]
    assert [m.rsplit(":", 1)[1] for m in document["image"]] == ["r000.1.png", "r000.0.png"]  # referenced order
