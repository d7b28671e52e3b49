"""The commands' one voice (mmtok/commands/report.py): every summary in one shape on stderr, counts with
the noun they take, --json results as one parseable line on stdout."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from mmtok.commands.report import plural, print_json, print_summary, reasons


def test_a_count_takes_the_singular_only_for_one():
    assert [plural(n, "rank") for n in (0, 1, 2)] == ["0 ranks", "1 rank", "2 ranks"]
    assert plural(1_024, "image") == "1,024 images" and plural(1, "batch", "batches") == "1 batch"
    assert plural(3, "batch", "batches") == "3 batches"


def test_a_summary_is_a_headline_and_indented_details_on_stderr(capsys):
    print_summary("merge", ["2 parts -> OUT", "skipped 1 (decode_error 1)"])
    print_summary("scan", "1 shard")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines() == ["mmtok merge: 2 parts -> OUT", "  skipped 1 (decode_error 1)",
                                         "mmtok scan: 1 shard"]


def test_a_json_result_is_one_line_with_paths_and_numpy_counts_as_plain_values(capsys):
    print_json({"part_dir": Path("/out/parts/part-00000"), "tokens": np.int64(7), "counts": {"images": 2}})
    [line] = capsys.readouterr().out.splitlines()
    assert json.loads(line) == {"part_dir": "/out/parts/part-00000", "tokens": 7, "counts": {"images": 2}}


def test_reasons_are_listed_in_one_shape_in_reason_order():
    assert reasons({"missing_caption": 1, "decode_error": 1_200}) == "decode_error 1,200, missing_caption 1"
    assert reasons({}) == ""
