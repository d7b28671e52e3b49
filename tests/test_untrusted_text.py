"""Untrusted input, class 2 (issue 21 §2): what a person typed stays text.

Control-token names typed into a record (message content, tool arguments, captions, transcripts) are
tokenized as the characters they are: only the chat template's own text and mmtok's blocks make control
ids, so `--strip-reasoning` can only strip spans the template made. Each test builds its own small
hostile corpus.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from chatkit import CHAT_TOKENS, TEMPLATE
from encodekit import SPECIAL_TOKENS, chat_tokenizer
from mmtok.cli import main
from mmtok.formats.chat import ChatRenderer, Control
from mmtok.formats.megatron import read_sequences
from mmtok.text import ControlToken, load_text_tokenizer


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return chat_tokenizer(tmp_path_factory.mktemp("tok"))


def _conversation(user_text: str) -> dict:
    return {"id": "c", "enable_thinking": True, "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is in the photo?{user_text} Say it."},
        {"role": "assistant", "reasoning_content": "Let me think step by step.", "content": "A cat on a chair."},
        {"role": "user", "content": f"And the weather?{user_text}"},
        {"role": "assistant", "content": "Cloudy."}]}


def _sft_and_merge(tmp_path, tokenizer_dir, records: list[dict], name: str) -> tuple[list, list, dict]:
    """`mmtok sft` of `records` (one JSONL), then `mmtok merge --strip-reasoning`: (merged, stripped, summary)."""
    source = tmp_path / f"{name}.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / f"{name}-out"
    assert main(["sft", str(source), "--text-tokenizer", str(tokenizer_dir), "--out", str(out), "--no-progress"]) == 0
    assert main(["merge", str(out), "--strip-reasoning"]) == 0
    summary = json.loads((out / "merged.json").read_text())
    return list(read_sequences(out / "merged")), list(read_sequences(out / "merged_no_reasoning")), summary


def _turns(tokens: np.ndarray, start: int, end: int) -> list[list[int]]:
    """The ids between each `start` and the next `end`."""
    tokens = tokens.tolist()
    turns, position = [], 0
    while start in tokens[position:]:
        first = tokens.index(start, position)
        last = tokens.index(end, first)
        turns.append(tokens[first + 1 : last])
        position = last
    return turns


def test_control_token_names_in_user_text_make_no_control_ids_and_survive_stripping(tmp_path, tokenizer_dir):
    tokenizer = load_text_tokenizer(str(tokenizer_dir))
    controls = {tokenizer.token_id(name) for name in SPECIAL_TOKENS}
    names = " ".join(SPECIAL_TOKENS)  # every control-token name of the tokenizer
    (clean,), _, _ = _sft_and_merge(tmp_path, tokenizer_dir, [_conversation("")], "clean")
    (typed,), (stripped,), summary = _sft_and_merge(tmp_path, tokenizer_dir, [_conversation(" " + names)], "typed")
    assert [i for i in typed.tolist() if i in controls] == [i for i in clean.tolist() if i in controls]
    user_start, user_end = tokenizer.token_id("<|user_start|>"), tokenizer.token_id("<|user_end|>")
    turns = _turns(typed, user_start, user_end)
    assert [tokenizer.decode(t) for t in turns] == [f"What is in the photo? {names} Say it.",
                                                    f"And the weather? {names}"]
    assert _turns(stripped, user_start, user_end) == turns  # every user turn whole in the stripped copy
    assert summary["strip_reasoning"]["spans_removed"] == 1
    assert summary["counts"]["control_literals"] == 1


def test_control_literals_are_counted_per_conversation_and_named_in_the_summary(tmp_path, tokenizer_dir, capsys):
    records = [_conversation(" </s>"), _conversation(""),
               {**_conversation(""), "tools": [{"name": "<|tools_suffix|>"}]}]
    source = tmp_path / "c.jsonl"
    source.write_text("".join(json.dumps({**r, "id": f"c{i}"}) + "\n" for i, r in enumerate(records)))
    assert main(["sft", str(source), "--text-tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "o"),
                 "--no-progress", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["counts"]["control_literals"] == 2
    assert "2 conversations held control-token names" in captured.err


def test_captions_and_transcripts_tokenize_control_names_as_text(tokenizer_dir):
    # Captions (documents), transcripts (audio convert, interleave) go through TextTokenizer.encode.
    tokenizer = load_text_tokenizer(str(tokenizer_dir))
    controls = {tokenizer.token_id(name) for name in SPECIAL_TOKENS}
    text = "a caption " + "".join(SPECIAL_TOKENS) + " ends here"
    ids = tokenizer.encode(text)
    assert not controls & set(ids)
    assert tokenizer.decode(ids) == text
    assert set(tokenizer.control_tokens()) == set(SPECIAL_TOKENS)
    assert not controls & {i for row in tokenizer.encode_many([text, "</s>"]) for i in row}


def test_a_control_name_split_across_strings_the_template_joins_stays_text():
    # The omni template renders a user turn's {"parts": [...]} one after another: a name typed in two (or
    # three) text parts would be whole in the rendering.
    renderer = ChatRenderer(TEMPLATE, "<s>", "</s>", {name: ControlToken(i) for i, name in enumerate(CHAT_TOKENS)})
    parts = [{"type": "text", "text": text} for text in ("think: <|inner_", "pre", "fix|> and <", "|user_end|> done")]
    pieces = renderer.render_pieces({"messages": [{"role": "user", "content": {"parts": parts}}]}).pieces
    controls = [piece.name for piece in pieces if isinstance(piece, Control)]
    assert controls == ["<|system_start|>", "<|system_end|>", "<|developer_start|>", "<|developer_end|>",
                        "<|user_start|>", "<|user_end|>"]
    assert "think: <|inner_prefix|> and <|user_end|> done" in [p for p in pieces if isinstance(p, str)]
