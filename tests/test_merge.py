"""mmtok merge: part checks, order, verification, and the no-reasoning copy's rules."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mmtok.cli import main
from mmtok.documents import pack_template
from mmtok.errors import MmtokError
from mmtok.formats.commitlog import PartWriter
from mmtok.formats.megatron import read_sequences
from mmtok.formats.merged import AssembledFigures
from mmtok.formats.partdir import part_dir
from mmtok.formats.parts import find_parts
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import sha256_file
from mmtok.merge.merge import ReasoningIds, merge, strip_sequence

BOS, EOS, PRE, SUF, END = 1, 2, 32, 33, 70
BOI, EOI = 900, 901  # around an image block in these tests
SPECIAL = {"<|inner_prefix|>": PRE, "<|inner_suffix|>": SUF, "<|assistant_end|>": END}
IDS = ReasoningIds(PRE, SUF, END, BOS, EOS)


def _identity(part: int, num_parts: int, **extra) -> dict:
    return {"part": part, "num_parts": num_parts, "modality": "image", "plan_fingerprint": "p",
            "part_batches": [part, part + 1], "text_special_ids": SPECIAL,
            "text_tokenizer": {"name": "t", "bos_id": BOS, "eos_id": EOS}, **extra}


def _write_parts(out, parts: list[list[list[int]]], finish=True) -> None:
    for number, sequences in enumerate(parts):
        shard = PartWriter(part_dir(out, number), _identity(number, len(parts)))
        shard.commit(number, [np.array(s, np.int32) for s in sequences],
                     [{"key": f"k{number}-{i}"} for i in range(len(sequences))], {"written": len(sequences)})
        if finish:
            shard.finish({"wall_s": 1.0})
        shard.close()


def test_merge_joins_parts_in_part_order_and_verifies_with_megatron_core(tmp_path):
    parts = [[[BOS, 5, 6, EOS]], [[BOS, 7, EOS], [BOS, 8, 9, 10, EOS]], [], [[BOS, 11, EOS]]]
    _write_parts(tmp_path, parts)
    summary = merge(tmp_path)
    flat = [s for part in parts for s in part]
    assert [list(s) for s in read_sequences(tmp_path / "merged")] == flat
    assert summary.verified_with == "megatron-core IndexedDataset"
    assert summary.counts == {"written": 4} and summary.sequences == 4
    lines = (tmp_path / "merged.provenance.jsonl").read_text().splitlines()
    assert [json.loads(line)["key"] for line in lines] == ["k0-0", "k1-0", "k1-1", "k3-0"]
    assert json.loads((tmp_path / "merged.json").read_text())["tokens"] == sum(map(len, flat))


def test_merge_lists_every_unfinished_part(tmp_path):
    _write_parts(tmp_path, [[[BOS, 5, EOS]]] * 4)
    (part_dir(tmp_path, 1) / "DONE").unlink()
    (part_dir(tmp_path, 3) / "DONE").unlink()
    with pytest.raises(MmtokError, match=r"2 of 4 parts are not finished.*part-00001.*part-00003"):
        merge(tmp_path)


def test_merge_lists_parts_never_started(tmp_path):
    shard = PartWriter(part_dir(tmp_path, 2), _identity(2, 3))
    shard.finish({})
    with pytest.raises(MmtokError, match=r"2 of 3 parts.*part-00000.*part-00001"):
        find_parts(tmp_path)


def test_merge_refuses_parts_of_different_runs(tmp_path):
    PartWriter(part_dir(tmp_path, 0), _identity(0, 2)).finish({})
    PartWriter(part_dir(tmp_path, 1), _identity(1, 2, plan_fingerprint="other")).finish({})
    with pytest.raises(MmtokError, match=r"part-00001.*plan_fingerprint \(recorded 'p', now 'other'\)"):
        merge(tmp_path)


def test_merge_of_nothing_says_to_encode_first(tmp_path):
    with pytest.raises(MmtokError, match="run `mmtok encode"):
        merge(tmp_path)


@pytest.mark.parametrize("tokens, expected, counted", [
    ([BOS, 5, PRE, 6, 7, SUF, 8, END, EOS], [BOS, 5, 8, END, EOS], "spans_removed"),
    ([BOS, PRE, 6, PRE, 7, SUF, 8, EOS], [BOS, 8, EOS], "spans_removed"),  # no nesting: first suffix closes
    ([BOS, 5, PRE, 6, 7, END, 9, EOS], [BOS, 5, END, 9, EOS], "orphan_prefixes"),  # closed by the turn end
    ([BOS, 5, PRE, 6, 7, EOS], [BOS, 5, EOS], "orphan_prefixes"),  # runs to the end, final EOS kept
    ([BOS, 5, SUF, 6, EOS], [BOS, 5, 6, EOS], "orphan_suffixes"),  # stray suffix removed alone
])
def test_strip_sequence_rules(tokens, expected, counted):
    stats = dict.fromkeys(("spans_removed", "orphan_prefixes", "orphan_suffixes"), 0)
    tokens = np.array(tokens, np.int32)
    assert tokens[strip_sequence(tokens, IDS, stats)].tolist() == expected
    assert stats == {**dict.fromkeys(stats, 0), counted: 1}


def test_strip_reasoning_drops_emptied_sequences_and_keeps_provenance_aligned(tmp_path):
    parts = [[[BOS, 5, PRE, 6, SUF, 7, EOS], [BOS, PRE, 6, 6, SUF, EOS]],
             [[BOS, 9, 10, EOS], [BOS, PRE, 3, EOS]]]
    _write_parts(tmp_path, parts)
    assert main(["merge", str(tmp_path), "--strip-reasoning"]) == 0
    assert [list(s) for s in read_sequences(tmp_path / "merged_no_reasoning")] == [[BOS, 5, 7, EOS], [BOS, 9, 10, EOS]]
    keys = [json.loads(x)["key"] for x in (tmp_path / "merged_no_reasoning.provenance.jsonl").read_text().splitlines()]
    assert keys == ["k0-0", "k1-0"]
    strip = json.loads((tmp_path / "merged.json").read_text())["strip_reasoning"]
    assert strip["dropped_empty_sequences"] == 2 and strip["spans_removed"] == 2 and strip["orphan_prefixes"] == 1
    assert strip["reasoning_tokens_removed"] == 3 + 4 + 2 and strip["sequences"] == 2


def test_strip_reasoning_works_across_block_boundaries(tmp_path, monkeypatch):
    import mmtok.merge.merge

    rng = np.random.default_rng(0)
    sequences = []
    for i in range(300):
        body = rng.integers(100, 200, rng.integers(1, 20)).tolist()
        sequences.append([BOS, *body, PRE, *body[:3], SUF, i + 100, EOS] if i % 3 else [BOS, *body, EOS])
    _write_parts(tmp_path, [sequences[:170], sequences[170:]])
    merge(tmp_path, strip_reasoning=True)
    reference = sha256_file(tmp_path / "merged_no_reasoning.bin")
    monkeypatch.setattr(mmtok.merge.merge, "BLOCK_TOKENS", 37)
    merge(tmp_path, strip_reasoning=True)
    assert sha256_file(tmp_path / "merged_no_reasoning.bin") == reference
    stripped = list(read_sequences(tmp_path / "merged_no_reasoning"))
    assert len(stripped) == 300 and not any(np.isin(s, [PRE, SUF]).any() for s in stripped)


def test_strip_reasoning_needs_a_tokenizer_with_reasoning_markers(tmp_path):
    shard = PartWriter(part_dir(tmp_path, 0), {**_identity(0, 1), "text_special_ids": {}})
    shard.commit(0, [np.array([BOS, 5, EOS], np.int32)], [{}], {})
    shard.finish({})
    with pytest.raises(MmtokError, match=r"has no <\|inner_prefix\|> / <\|inner_suffix\|> token"):
        merge(tmp_path, strip_reasoning=True)


def test_merged_bytes_are_the_same_without_an_in_kernel_copy(tmp_path, monkeypatch):
    import errno
    import os

    parts = [[[BOS, 5, 6, EOS]] * 3, [[BOS, 7, EOS], [BOS, 8, 9, 10, EOS]]]
    _write_parts(tmp_path, parts)
    merge(tmp_path)
    reference = {name: sha256_file(tmp_path / name) for name in ("merged.bin", "merged.provenance.jsonl")}

    def cross_device(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)  # e.g. parts and OUT on different filesystems
    merge(tmp_path)
    assert {name: sha256_file(tmp_path / name) for name in reference} == reference


@pytest.mark.damages_datasets
def test_a_flipped_byte_in_a_part_is_refused_by_merge_naming_the_part_and_unit(tmp_path):
    _write_parts(tmp_path, [[[BOS, 5, 6, EOS]], [[BOS, 7, 8, 9, EOS]]])
    tokens = part_dir(tmp_path, 1) / "tokens.bin"
    data = bytearray(tokens.read_bytes())
    data[6] ^= 0x04  # a bit of token 1, as bit rot or a bad copy would flip it
    tokens.write_bytes(bytes(data))
    with pytest.raises(MmtokError, match=r"part-00001/tokens.bin: the bytes of unit 1 do not match their checksum"):
        merge(tmp_path)
    assert not (tmp_path / "merged.bin").exists() and not (tmp_path / "merged.json").exists()


@pytest.mark.damages_datasets
@pytest.mark.parametrize("damage", ["truncate tokens.bin", "delete tokens.idx", "truncate stats.json",
                                    "truncate identity.json", "flip identity.json", "flip stats.json",
                                    "delete DONE", "truncate DONE", "delete commits.log"])
def test_a_truncated_or_missing_part_file_is_one_line_error(tmp_path, capsys, damage):
    _write_parts(tmp_path, [[[BOS, 5, 6, EOS]], [[BOS, 7, 8, 9, EOS]]])
    action, name = damage.split()
    path = part_dir(tmp_path, 0) / name
    if action == "delete":
        path.unlink()
    elif action == "flip":  # one bit, the JSON still parses: only a checksum can tell
        data = bytearray(path.read_bytes())
        digit = next(i for i, c in enumerate(data) if chr(c).isdigit())
        data[digit] = ord("7") if data[digit] != ord("7") else ord("3")
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    assert main(["merge", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "part-00000" in err and "Traceback" not in err, err


def test_merge_of_parts_without_tokens_writes_no_dataset_and_says_so(tmp_path):
    for number in range(2):
        shard = PartWriter(part_dir(tmp_path, number), _identity(number, 2))
        shard.commit(0, [], [], {"skipped:decode_error": 1},
                     skipped=[SkipRecord(key=f"k{number}", source="a.tar", reason="decode_error", detail="x",
                                         stage="encode")])
        shard.finish({})
    (tmp_path / "merged.bin").write_bytes(b"stale")  # an earlier merge's output must not survive looking valid
    summary = merge(tmp_path, strip_reasoning=True)
    assert summary.dataset is False and summary.sequences == 0
    assert summary.strip_reasoning["dataset"] is False
    for name in ("merged.bin", "merged.idx", "merged_no_reasoning.bin", "merged_no_reasoning.idx"):
        assert not (tmp_path / name).exists(), name
    skipped = [json.loads(line) for line in (tmp_path / "merged.skipped.jsonl").read_text().splitlines()]
    assert [s["key"] for s in skipped] == ["k0", "k1"]
    assert json.loads((tmp_path / "merged.json").read_text())["counts"]["skipped:decode_error"] == 2


def test_parts_without_tokens_are_left_out_of_the_merged_dataset(tmp_path):
    _write_parts(tmp_path, [[[BOS, 5, EOS]], [], [[BOS, 6, EOS]]])
    assert not (part_dir(tmp_path, 1) / "tokens.idx").exists()
    summary = merge(tmp_path)
    assert [list(s) for s in read_sequences(tmp_path / "merged")] == [[BOS, 5, EOS], [BOS, 6, EOS]]
    assert [p["dataset"] for p in summary.parts] == [True, False, True]


def test_a_second_merge_of_one_output_is_refused(tmp_path):
    from mmtok.fsutil import WriterLock

    _write_parts(tmp_path, [[[BOS, 5, EOS]]])
    with WriterLock(tmp_path, "merge output"):  # held in this process: the same rule as across processes
        with pytest.raises(MmtokError, match="already being written"):
            merge(tmp_path)
    merge(tmp_path)


def test_inspect_says_why_a_merge_wrote_no_dataset(tmp_path, capsys):
    shard = PartWriter(part_dir(tmp_path, 0), _identity(0, 1))
    shard.commit(0, [], [], {"skipped:decode_error": 1},
                 skipped=[SkipRecord(key="k", source="a.tar", reason="decode_error", stage="encode")])
    shard.finish({})
    merge(tmp_path)
    assert main(["inspect", str(tmp_path / "merged")]) == 2
    assert "every input was skipped" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no tokens: no dataset" in out and "merged: not written" in out


@pytest.mark.parametrize("summary", ["[1]", '{"dataset": false}', '{"strip_reasoning": 3}', '"text"'])
def test_a_wrong_shaped_merged_json_is_no_traceback(tmp_path, capsys, summary):
    (tmp_path / "merged.json").write_text(summary)
    assert main(["inspect", str(tmp_path / "merged")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err


# -- documents of several images: assembled by merge from the parts' items --------------------------
def _block(document: int, index: int) -> list[int]:
    """The block of image `index` of `document` in these tests: BOI, index + 1 codes, EOI."""
    return [BOI, *[1000 + 10 * document + index] * (index + 1), EOI]


def _image(document: int, index: int, skip: str | None = None, detail: str = "") -> tuple[dict, np.ndarray]:
    """An image item as encode commits it: its block, or (failed) no ids and why."""
    record = {"kind": "image", "key": f"doc{document}", "source": "s.tar", "container": "s.tar",
              "member": f"doc{document}.{index}.jpg", "manifest_row": 100 * document + index,
              "document": document, "image_index": index}
    if skip:
        return {**record, "skip": skip, "detail": detail}, np.zeros(0, np.int32)
    return record, np.array(_block(document, index), np.int32)


def _template(document: int, pieces: list, skip: str | None = None, detail: str = "") -> tuple[dict, np.ndarray]:
    """A template item as encode commits it; `pieces` are text id lists and image slots (ints)."""
    record = {"kind": "template", "document": document, "key": f"doc{document}", "tar": "s.tar",
              "num_images": sum(isinstance(piece, int) for piece in pieces)}
    if skip:
        return {**record, "skip": skip, "detail": detail}, np.zeros(0, np.int32)
    ids, record["layout"] = pack_template([piece if isinstance(piece, int) else np.array(piece, np.int32)
                                           for piece in pieces])
    return record, ids


def _write_batches(out, parts: list[list[tuple]]) -> None:
    """Finished parts, one list of batches each; a batch is (sequences, items[, skipped]) committed as one
    unit numbered by its global position, as encode commits a plan's batches."""
    unit = 0
    for number, batches in enumerate(parts):
        shard = PartWriter(part_dir(out, number), _identity(number, len(parts)))
        for sequences, items, *skipped in batches:
            skipped = skipped[0] if skipped else []
            counts = {"images_written": len(sequences), "documents_written": len(sequences),
                      "tokens": sum(map(len, sequences)),
                      "images_deferred": sum(record["kind"] == "image" for record, _ in items),
                      **{f"skipped:{r.reason}": 1 for r in skipped}}
            shard.commit(unit, [np.array(s, np.int32) for s in sequences],
                         [{"key": "-".join(map(str, s))} for s in sequences], counts, skipped=skipped, items=items)
            unit += 1
        shard.finish({})


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_document_over_three_parts_is_its_template_with_the_blocks_after_all_plain_sequences(tmp_path):
    doc4 = _template(4, [[BOS, 40, 41], 0, [42], 1, 2, [EOS]])
    doc2 = _template(2, [[BOS], 0, [20, 21], 1, [EOS]])
    _write_batches(tmp_path, [
        [([[BOS, 5, EOS]], [_image(4, 1), _image(2, 1)])],
        [([[BOS, 6, EOS]], [_image(4, 2)]), ([], [doc4])],
        [([[BOS, 7, 7, EOS]], [_image(4, 0), doc2, _image(2, 0)])],  # document 4's items before document 2's
    ])
    summary = merge(tmp_path)
    expected_doc2 = [BOS, BOI, 1020, EOI, 20, 21, BOI, 1021, 1021, EOI, EOS]
    expected_doc4 = [BOS, 40, 41, BOI, 1040, EOI, 42, BOI, 1041, 1041, EOI, BOI, 1042, 1042, 1042, EOI, EOS]
    assert [list(s) for s in read_sequences(tmp_path / "merged")] == [
        [BOS, 5, EOS], [BOS, 6, EOS], [BOS, 7, 7, EOS], expected_doc2, expected_doc4]
    assert _lines(tmp_path / "merged.provenance.jsonl")[3:] == [
        {"document": 2, "key": "doc2", "tar": "s.tar", "rows": [200, 201]},
        {"document": 4, "key": "doc4", "tar": "s.tar", "rows": [400, 401, 402]}]
    tokens = len(expected_doc2) + len(expected_doc4)
    assert summary.assembled == AssembledFigures(2, 0, tokens)
    assert summary.sequences == 5 and summary.tokens == 3 + 3 + 4 + tokens
    assert summary.counts["images_written"] == 3 + 5 and summary.counts["documents_written"] == 3 + 2
    assert summary.counts["tokens"] == summary.tokens
    assert json.loads((tmp_path / "merged.json").read_text()) == summary.to_json()
    assert not list(tmp_path.glob("*assembled*")), "the assembled documents' dataset is joined, then removed"


def _global_batches() -> list[tuple]:
    """Batches of one plan in global order: plain sequences, a skip, and three documents of several images
    whose items span batches (document 6 with a failed image; document 8's template before document 3's)."""
    plain_skip = SkipRecord(key="k9", source="s.tar", container="tar", member="k9.jpg", position=9,
                            reason="decode_error", detail="x", stage="encode")
    return [
        ([[BOS, 5, EOS]], [_template(8, [[BOS, 80], 0, [81], 1, 2, [EOS]]), _image(8, 0)]),
        ([[BOS, 6, 6, EOS]], [_image(8, 1), _template(6, [[BOS], 0, 1, [EOS]]), _image(6, 0, "decode_error", "bad")]),
        ([], [_template(3, [[BOS], 0, 1, [EOS]]), _image(3, 0), _image(8, 2)], [plain_skip]),
        ([[BOS, 7, EOS], [BOS, 8, EOS]], [_image(6, 1), _image(3, 1)]),
        ([[BOS, 9, EOS]], []),
    ]


def test_merged_bytes_of_assembled_documents_do_not_depend_on_the_number_of_parts(tmp_path):
    batches = _global_batches()
    _write_batches(tmp_path / "one", [batches])
    _write_batches(tmp_path / "three", [batches[:2], batches[2:3], batches[3:]])
    merged = {}
    for run in ("one", "three"):
        merge(tmp_path / run)
        merged[run] = {name: sha256_file(tmp_path / run / name) for name in
                       ("merged.bin", "merged.idx", "merged.provenance.jsonl", "merged.skipped.jsonl")}
    assert merged["one"] == merged["three"]
    documents = [p.get("document") for p in _lines(tmp_path / "three" / "merged.provenance.jsonl")]
    assert documents == [None] * 5 + [3, 8]  # document 6 failed
    assert [s["key"] for s in _lines(tmp_path / "three" / "merged.skipped.jsonl")] == ["k9", "doc6", "doc6"]


def test_a_failed_image_skips_its_whole_document_naming_every_image(tmp_path):
    _write_batches(tmp_path, [
        [([[BOS, 5, EOS]], [_template(7, [[BOS], 0, 1, 2, [EOS]]), _image(7, 0),
                            _image(7, 1, "decode_error", "bad huffman")])],
        [([], [_image(7, 2), _template(9, [[BOS], 0, 1, [EOS]]), _image(9, 0), _image(9, 1)])],
    ])
    summary = merge(tmp_path)
    sequences = [list(s) for s in read_sequences(tmp_path / "merged")]
    assert sequences == [[BOS, 5, EOS], [BOS, *_block(9, 0), *_block(9, 1), EOS]]
    assert [p.get("document") for p in _lines(tmp_path / "merged.provenance.jsonl")] == [None, 9]
    skipped = _lines(tmp_path / "merged.skipped.jsonl")
    assert [(s["member"], s["position"], s["reason"]) for s in skipped] == [
        ("doc7.0.jpg", 700, "document_image_failed"), ("doc7.1.jpg", 701, "decode_error"),
        ("doc7.2.jpg", 702, "document_image_failed")]
    assert skipped[1] == {"key": "doc7", "source": "s.tar", "container": "s.tar", "member": "doc7.1.jpg",
                          "position": 701, "reason": "decode_error", "detail": "bad huffman", "stage": "merge"}
    assert skipped[0]["detail"] == skipped[2]["detail"] == "image 1 of the document: decode_error: bad huffman"
    counts = summary.counts
    assert counts["skipped:decode_error"] == 1 and counts["skipped:document_image_failed"] == 2
    assert counts["documents_skipped"] == 1 and counts["documents_written"] == 2
    lost = sum(v for k, v in counts.items() if k.startswith("skipped:"))
    assert counts["images_written"] + lost == 1 + 3 + 2  # every planned image, once
    assert summary.assembled == AssembledFigures(1, 1, len(sequences[1]))
    assert json.loads((tmp_path / "merged.json").read_text()) == summary.to_json()


def test_a_failed_template_skips_every_image_with_its_reason(tmp_path):
    _write_batches(tmp_path, [
        [([[BOS, 5, EOS]], [_template(7, [0, 1, 2], "invalid_json", "Expecting value"), _image(7, 0)])],
        [([], [_image(7, 1), _image(7, 2)])],
    ])
    summary = merge(tmp_path)
    assert [list(s) for s in read_sequences(tmp_path / "merged")] == [[BOS, 5, EOS]]
    skipped = _lines(tmp_path / "merged.skipped.jsonl")
    assert [(s["member"], s["reason"], s["detail"]) for s in skipped] == [
        (f"doc7.{index}.jpg", "invalid_json", "Expecting value") for index in range(3)]
    assert summary.counts["skipped:invalid_json"] == 3 and summary.counts["documents_skipped"] == 1
    assert summary.assembled == AssembledFigures(0, 1, 0)


def test_a_run_of_only_assembled_documents_still_merges_to_a_dataset(tmp_path):
    _write_batches(tmp_path, [[([], [_template(1, [[BOS], 0, 1, [EOS]]), _image(1, 0)])], [([], [_image(1, 1)])]])
    summary = merge(tmp_path, strip_reasoning=True)
    assert [p["dataset"] for p in summary.parts] == [False, False]
    assert summary.dataset is True and summary.sequences == 1
    assert [list(s) for s in read_sequences(tmp_path / "merged")] == [[BOS, *_block(1, 0), *_block(1, 1), EOS]]
    assert summary.strip_reasoning["sequences"] == 1


def test_a_run_whose_assembled_documents_all_failed_writes_no_dataset(tmp_path):
    _write_batches(tmp_path, [[([], [_template(1, [[BOS], 0, 1, [EOS]]), _image(1, 0, "decode_error"),
                                     _image(1, 1)])]])
    summary = merge(tmp_path)
    assert summary.dataset is False and summary.sequences == 0
    assert json.loads((tmp_path / "merged.json").read_text())["dataset"] is False
    assert not (tmp_path / "merged.bin").exists() and not (tmp_path / "merged.idx").exists()
    assert [s["reason"] for s in _lines(tmp_path / "merged.skipped.jsonl")] == ["decode_error", "document_image_failed"]
    assert summary.assembled == AssembledFigures(0, 1, 0)


@pytest.mark.parametrize("case", ["missing template", "missing image", "extra image", "second template"])
def test_a_document_with_inconsistent_items_is_refused_naming_it(tmp_path, capsys, case):
    template = _template(7, [[BOS], 0, 1, [EOS]])
    items = {"missing template": [_image(7, 0), _image(7, 1)],
             "missing image": [template, _image(7, 1)],
             "extra image": [template, _image(7, 0), _image(7, 1), _image(7, 2)],
             "second template": [template, _image(7, 0), _image(7, 1)]}[case]
    second = [template] if case == "second template" else []
    _write_batches(tmp_path, [[([[BOS, 5, EOS]], items)], [([[BOS, 6, EOS]], second)]])
    assert main(["merge", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "document 7" in err and "Traceback" not in err, err
    assert not (tmp_path / "merged.json").exists() and not list(tmp_path.glob("*assembled*"))


def test_a_second_item_for_one_image_is_refused_naming_the_document(tmp_path):
    # parts of one run hold each image once; two copies (e.g. a part copied in from another run with the
    # same plan) must not silently pick one of them
    _write_batches(tmp_path, [[([], [_template(7, [[BOS], 0, 1, [EOS]]), _image(7, 0), _image(7, 1)])],
                              [([], [_image(7, 1, "decode_error")])]])
    with pytest.raises(MmtokError, match="document 7"):
        merge(tmp_path)


def test_a_flipped_byte_in_a_part_items_is_refused_by_merge_naming_the_part_and_file(tmp_path):
    _write_batches(tmp_path, [[([[BOS, 5, EOS]], [_template(1, [[BOS], 0, 1, [EOS]]), _image(1, 0)])],
                              [([[BOS, 6, EOS]], [_image(1, 1)])]])
    ids = part_dir(tmp_path, 1) / "items.ids"
    data = bytearray(ids.read_bytes())
    data[5] ^= 0x04  # a bit of an image code
    ids.write_bytes(bytes(data))
    with pytest.raises(MmtokError, match=r"part-00001/items.ids: the bytes of unit 1 do not match their checksum"):
        merge(tmp_path)
    assert not (tmp_path / "merged.bin").exists() and not (tmp_path / "merged.json").exists()


def test_strip_reasoning_removes_spans_in_assembled_documents(tmp_path):
    _write_batches(tmp_path, [
        [([[BOS, 5, PRE, 6, SUF, EOS]], [_template(3, [[BOS, 30, PRE, 31, SUF], 0, [36], 1, [EOS]]), _image(3, 0)])],
        [([[BOS, 7, EOS]], [_image(3, 1), _template(4, [[BOS, PRE], 0, 1, [SUF, EOS]]), _image(4, 0), _image(4, 1)])],
    ])
    summary = merge(tmp_path, strip_reasoning=True)
    assert [list(s) for s in read_sequences(tmp_path / "merged_no_reasoning")] == [
        [BOS, 5, EOS], [BOS, 7, EOS], [BOS, 30, *_block(3, 0), 36, *_block(3, 1), EOS]]
    keys = [p.get("key") for p in _lines(tmp_path / "merged_no_reasoning.provenance.jsonl")]
    assert keys == [f"{BOS}-5-{PRE}-6-{SUF}-{EOS}", f"{BOS}-7-{EOS}", "doc3"]  # document 4 was all reasoning
    strip = summary.strip_reasoning
    assert strip["spans_removed"] == 3 and strip["dropped_empty_sequences"] == 1 and strip["sequences"] == 3
    assert strip["reasoning_tokens_removed"] == 3 + 3 + 2 + len(_block(4, 0)) + len(_block(4, 1))
