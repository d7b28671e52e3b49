"""Untrusted input, class 2 bounds (issue 21 §4): a chat template, a record's text and a json cell take
bounded time and memory, and whatever goes wrong is that record's named skip, never a crash or a hang.

A chat template comes with a tokenizer from a model release: it is untrusted code. Each test builds its own
small hostile template, record or table.
"""

from __future__ import annotations

import json
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from chatkit import built_skip, tar_conversation
from encodekit import chat_tokenizer
from mmtok.audio.sources.directory import read_transcript_table
from mmtok.cli import main
from mmtok.formats.chat import ChatRenderer, ConversationError
from mmtok.formats.conversations import read_conversations
from mmtok.text import load_text_tokenizer

CONVERSATION = {"messages": [{"role": "user", "content": "What is in the photo?"}]}


def _refusal(template: str, max_chars: int | None = 1 << 16, record: dict = CONVERSATION) -> ConversationError:
    renderer = ChatRenderer(template, "<s>", "</s>")
    with pytest.raises(ConversationError) as caught:
        renderer.render(record, max_chars)
    return caught.value


@pytest.mark.parametrize("template, error", [
    ("{{ 1 / 0 }}", "ZeroDivisionError"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    ("{{ 10.0 ** 1000 }}", "OverflowError"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ range(1, 5, 0) | list }}", "ValueError"),
])
def test_any_exception_a_template_raises_is_that_conversations_template_error(template, error):
    refusal = _refusal(template)
    assert refusal.reason == "template_error"
    assert refusal.detail.startswith(error)


@pytest.mark.parametrize("template", [
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% set x = range(100000) | list %}{% for a in x %}{% for b in x %}{% endfor %}{% endfor %}",
    "{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}{{ f(60) }}",
])
def test_a_runaway_template_is_a_template_error_after_a_bounded_number_of_steps(template):
    started = time.perf_counter()
    refusal = _refusal(template, max_chars=None)  # the default output bound: only the steps stop these
    assert (refusal.reason, refusal.detail) == ("template_error", "the chat template ran more than 1,000,000 steps")
    assert time.perf_counter() - started < 15


@pytest.mark.parametrize("template", [
    "{{ 'x' * 1000000000 }}",
    "{{ 'x' | center(1000000000) }}",
    "{{ 'x'.ljust(1000000000) }}",
    "{{ 2 ** 1000000000 }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ '%999999999d' % 1 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s | length }}",
])
def test_a_template_that_builds_a_huge_value_is_refused_before_it_is_made(template):
    started = time.perf_counter()
    assert _refusal(template).reason == "template_error"
    assert time.perf_counter() - started < 5


def test_a_rendering_above_its_output_bound_is_document_too_long():
    template = "{% for i in range(1000) %}{{ messages[0].content }}{% endfor %}"
    assert _refusal(template, max_chars=10_000).reason == "document_too_long"


def _tokenizer_with_template(directory, template) -> str:
    chat_tokenizer(directory)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return str(directory)


@pytest.mark.parametrize("template", [5, {"default": "{{ messages }}"}, [{"name": "default"}], ["{{ x }}"]])
def test_a_chat_template_that_is_not_a_string_is_one_line_at_start_up(tmp_path, capsys, template):
    directory = _tokenizer_with_template(tmp_path / "tok", template)
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps(CONVERSATION) + "\n")
    assert main(["sft", str(source), "--text-tokenizer", directory, "--out", str(tmp_path / "out"),
                 "--no-progress"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "chat_template" in line and len(line) < 400


def test_named_chat_templates_take_the_default_one(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "{{ messages[0].content }}"}]
    tokenizer = load_text_tokenizer(_tokenizer_with_template(tmp_path / "tok", named))
    assert ChatRenderer.from_tokenizer(tokenizer).render(CONVERSATION) == "What is in the photo?"


def test_a_message_longer_than_max_tokens_can_hold_is_document_too_long_before_tokenizing(tmp_path, monkeypatch):
    tokenizer = load_text_tokenizer(str(chat_tokenizer(tmp_path / "tok")))
    max_tokens = 1000
    text = "a cat " * (max_tokens * tokenizer.max_token_bytes // 6 + 1)
    tokenized = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda piece: tokenized.append(len(piece)) or encode(piece))
    record = {"messages": [{"role": "user", "content": text}]}
    skip = built_skip(tokenizer, tar_conversation(record, []), max_tokens=max_tokens)
    assert skip.reason == "document_too_long"
    assert all(size < 1000 for size in tokenized)  # the long text never reached the tokenizer


def test_max_token_bytes_bounds_every_piece_of_the_vocabulary(tmp_path):
    tokenizer = load_text_tokenizer(str(chat_tokenizer(tmp_path / "tok")))
    pieces = [tokenizer.decode([i]).encode("utf-8") for i in range(tokenizer.vocab_size)
              if i not in {c.id for c in tokenizer.control_tokens().values()}]
    assert max(map(len, pieces)) <= tokenizer.max_token_bytes


DEEP = "[" * 100_000 + "]" * 100_000
SURROGATE = json.dumps([{"role": "user", "content": "x"}]).replace('"x"', '"\\ud800"')


def test_parquet_json_cells_with_deep_nesting_or_lone_surrogates_are_invalid_json(tmp_path):
    path = tmp_path / "c.parquet"
    good = json.dumps(CONVERSATION["messages"])
    pq.write_table(pa.table({"messages": [DEEP, SURROGATE, good]}), path)
    conversations = list(read_conversations([path]))
    assert [c.error.reason if c.error else None for c in conversations] == ["invalid_json", "invalid_json", None]


def test_jsonl_transcript_rows_with_deep_nesting_or_lone_surrogates_are_bad_table_rows(tmp_path):
    table = tmp_path / "t.jsonl"
    rows = [DEEP, json.dumps({"path": "a.wav", "text": "x"}).replace('"x"', '"\\udc00"'),
            json.dumps({"path": "b.wav", "text": "fine"})]
    table.write_text("\n".join(rows) + "\n")
    kept, dropped = read_transcript_table(table)
    assert [row["path"] for row in kept] == ["b.wav"]
    assert [record.reason for record in dropped] == ["bad_table_row", "bad_table_row"]


def test_the_budget_leaves_ordinary_template_features_as_they_render():
    template = ("{% macro f(obj, context) %}{{ obj }}{{ context }}{% endmacro %}{{ f(obj=1, context=2) }} "
                "{% for m in messages %}{{ loop.index }}/{{ loop.length }}{{ '.' if loop.last }}{% endfor %} "
                "{% for x in [[1, [2]]] recursive %}{{ x }}{% endfor %} {{ '%5s|' % 'a' }}{{ '{:>3}'.format(7) }}")
    record = {"messages": [CONVERSATION["messages"][0]] * 2}
    assert ChatRenderer(template, "<s>", "</s>").render(record) == "12 1/22/2. [1, [2]]     a|  7"
