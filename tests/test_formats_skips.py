"""Skip records: one schema, one writer, one reader (`mmtok.formats.skips`), and the `skipped:<reason>`
counters made and read back nowhere else."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from mmtok.errors import MmtokError, Skip
from mmtok.formats import skips
from mmtok.formats.skips import SkipRecord

PACKAGE = Path(__file__).resolve().parent.parent / "mmtok"
OWNER = PACKAGE / "formats" / "skips.py"
KEY = re.compile(r"(skipped|dropped):(?! )")  # a counter key's start ("dropped: none" is prose)

RECORDS = [
    SkipRecord.of(Skip("decode_error", "truncated JPEG"), stage="encode", key="000017", source="/d/a.tar",
                  container="tar", member="000017.jpg", position=17),
    SkipRecord(key="chat/\udcff-not-utf8", source="b.jsonl:line 3", reason="invalid_json", stage="pack"),
    SkipRecord(key="clip-7", source="c.tar:clip-7", reason="silent", detail="peak -90 dBFS, ünïcode", stage="convert"),
]


def test_records_read_back_as_written(tmp_path):
    path = tmp_path / "x.skipped.jsonl"
    with open(path, "wb") as handle:
        skips.append(handle, RECORDS[:2])
        skips.append(handle, RECORDS[2:])
    assert list(skips.read(path)) == RECORDS
    assert RECORDS[0].skip().reason == "decode_error" and RECORDS[0].skip().detail == "truncated JPEG"


def test_every_line_has_every_field_in_one_order():
    for record in RECORDS:
        line = skips.to_line(record)
        assert line.endswith(b"\n") and line.count(b"\n") == 1 and line.isascii()
        assert list(json.loads(line)) == ["key", "source", "container", "member", "position", "reason", "detail",
                                          "stage"]
    assert json.loads(skips.to_line(RECORDS[1]))["container"] is None


@pytest.mark.parametrize("damaged", [b'{"key": "k", "reas', b"[1, 2]\n",
                                     b'{"key":"k","source":"s","reason":"x","detail":"","stage":"encode"}\n',
                                     b"\xff\xfe\n",
                                     # every key, in order, but values of the wrong JSON types
                                     b'{"key":["a"],"source":1,"container":null,"member":null,"position":"x",'
                                     b'"reason":{"a":1},"detail":"","stage":"encode"}\n',
                                     b'{"key":"k","source":"s","container":null,"member":null,"position":true,'
                                     b'"reason":"x","detail":"","stage":"encode"}\n'])
def test_a_damaged_line_is_refused_naming_the_file_and_line(tmp_path, damaged):
    path = tmp_path / "skipped.jsonl"
    path.write_bytes(skips.to_line(RECORDS[0]) + damaged)
    with pytest.raises(MmtokError) as caught:
        list(skips.read(path))
    message = str(caught.value)
    assert message.startswith(f"{path}:2: ") and "\n" not in message


def test_counter_keys_read_back_to_their_reasons():
    counts = {skips.count_key("too_long"): 2, skips.count_key("decode_error"): 1, "written": 5,
              skips.item_failed_key("short_read"): 3}
    assert skips.reason_of(skips.count_key("media_skipped:silent")) == "media_skipped:silent"
    assert skips.reason_of("written") is None
    assert skips.by_reason(counts) == {"decode_error": 1, "too_long": 2}
    assert skips.items_failed_by_reason(counts) == {"short_read": 3}
    assert skips.total(counts) == 3 and skips.total(counts, failed_items=True) == 6


def _key_strings(tree: ast.AST):
    """Every string literal (or f-string's leading literal) that starts like a skip counter key."""
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            node = node.values[0]
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and KEY.match(node.value):
            yield node.lineno, node.value


def test_only_the_skips_module_makes_or_parses_skip_counter_keys():
    # a set: an f-string's literal is walked twice
    found = sorted({f"{path.relative_to(PACKAGE.parent)}:{line}: {text!r}"
                    for path in PACKAGE.rglob("*.py") if path != OWNER
                    for line, text in _key_strings(ast.parse(path.read_text("utf-8")))})
    assert not found, "build or read `skipped:<reason>` keys with mmtok.formats.skips:\n" + "\n".join(found)
