"""scan -> plan -> encode -> merge on real images in tar shards, read back with megatron-core."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from encodekit import (
    PLAN_FLAGS,
    caption_corpus,
    caption_env,
    encode_all,
    gpt_dataset,
    interleaved_corpus,
    one_torch_thread,
    parse_block,
    plan,
    real_images,
)
from mmtok.cli import main
from mmtok.codecs import emu35
from mmtok.errors import MmtokError
from mmtok.formats.megatron import read_sequences
from mmtok.formats.partdir import part_dir, read_stats
from mmtok.formats.plan import Plan
from mmtok.fsutil import sha256_file
from mmtok.media.images import ImageDecodeError, decode_rgb, resize_rgb
from mmtok.text import caption_text, load_text_tokenizer
from mmtok.vocab import VocabLayout
from summaries import json_result, summary_lines

MERGED_FILES = ("merged.bin", "merged.idx", "merged.provenance.jsonl")


@pytest.fixture(scope="module", autouse=True)
def single_torch_thread():
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    env = caption_env(tmp_path_factory.mktemp("e2e"))
    # A small HF tokenizer loads in milliseconds; the built-in 131k tekken is used where noted.
    env.codec, env.tokenizer = emu35.load(env.checkpoint, "cpu"), load_text_tokenizer(str(env.text))
    return env


def digests(out: Path) -> dict[str, str]:
    return {name: sha256_file(out / name) for name in MERGED_FILES}


def manifest_rows(manifest: Path) -> list[dict]:
    return pq.read_table(manifest / "manifest.parquet").to_pylist()


def serial_codes(env, plan_dir: Path) -> dict[int, np.ndarray]:
    """Reference: each planned batch decoded, resized and encoded in one thread -> codes per manifest row."""
    planned = pq.read_table(plan_dir / "plan.parquet").to_pylist()
    manifest = manifest_rows(env.manifest)
    batches: dict[int, list[dict]] = {}
    for entry in planned:
        batches.setdefault(entry["batch"], []).append(entry)
    codes = {}
    for batch in batches.values():
        height, width = batch[0]["target_height"], batch[0]["target_width"]
        pixels = np.zeros((len(batch), height, width, 3), np.uint8)
        ok = []
        for slot, planned_row in enumerate(batch):
            entry = manifest[planned_row["manifest_row"]]
            with open(entry["tar"], "rb") as handle:
                handle.seek(entry["offset"])
                data = handle.read(entry["size"])
            try:
                pixels[slot] = resize_rgb(decode_rgb(data), height, width)
                ok.append((slot, planned_row["manifest_row"]))
            except ImageDecodeError:
                pass
        if ok:
            encoded = env.codec.encode(torch.from_numpy(pixels)).numpy()
            codes.update({row: encoded[slot] for slot, row in ok})
    return codes


def test_merged_dataset_reads_with_megatron_core_and_matches_design_layout(env, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    plan_dir = plan(env, "plan-image-text", "--mode", "image-text", "--text-tokenizer", "tekken")
    out = encode_all(env, plan_dir, tmp_path / "out", world_size=1)
    tekken = load_text_tokenizer("tekken")
    layout = VocabLayout(text_size=tekken.vocab_size)
    reference = serial_codes(env, plan_dir)
    manifest = manifest_rows(env.manifest)
    provenance = [json.loads(line) for line in (out / "merged.provenance.jsonl").read_text().splitlines()]
    dataset = IndexedDataset(str(out / "merged"))
    assert len(dataset) == len(provenance) > 0
    blocks_seen = 0
    for index, record in enumerate(provenance):
        tokens = dataset[index]
        assert tokens.dtype == np.int32 and tokens[0] == tekken.bos_id and tokens[-1] == tekken.eos_id
        position = 1
        for row in record["rows"]:  # BOS, the blocks in image order, the caption, EOS
            codes, position = parse_block(tokens, position, layout, tekken)
            np.testing.assert_array_equal(codes, reference[row])
            blocks_seen += 1
        entry = manifest[record["rows"][0]]
        with open(entry["tar"], "rb") as handle:
            handle.seek(entry["text_offset"])
            caption = caption_text(handle.read(entry["text_size"]))
        assert tokens[position:-1].tolist() == tekken.encode(caption)
        if caption.startswith("chelsea_rotated"):  # stored 451x300 with EXIF orientation 6: displayed upright
            assert codes.shape[0] > codes.shape[1]
        assert record["key"] == entry["key"] and record["tar"] == entry["tar"]
    meta = json.loads((plan_dir / "plan.json").read_text())
    assert blocks_seen == meta["totals"]["kept_images"]
    assert sum(len(dataset[i]) for i in range(len(dataset))) == meta["totals"]["document_tokens"]
    assert any(len(r["rows"]) == 2 for r in provenance), "the corpus has two-image documents"
    _check_gpt_dataset(out / "merged", layout, tekken.eos_id, tmp_path)


class MegatronTokenizerStub:
    """What GPTDatasetConfig reads from a tokenizer: vocabulary size, end-of-document id, identifiers."""

    def __init__(self, vocab_size: int, eod: int):
        self.vocab_size, self.eod, self.eos, self.pad = vocab_size, eod, eod, -1
        self.unique_identifiers = {"class": "mmtok-test-stub", "vocab_size": vocab_size, "eod": eod}


def _check_gpt_dataset(prefix: Path, layout: VocabLayout, eos: int, cache: Path) -> None:
    """A GPTDataset built by BlendedMegatronDatasetBuilder on CPU serves exactly our token stream."""
    sequences = list(read_sequences(prefix))
    length = 32
    tokenizer = MegatronTokenizerStub(layout.total_size, eos)
    total = sum(s.size for s in sequences)
    train = gpt_dataset(([str(prefix)], None), tokenizer, length, (total - 1) // length, cache)
    assert len(train) == (total - 1) // length
    stream = np.concatenate([sequences[d] for d in train.document_index])
    for i in range(len(train)):
        sample = train[i]
        j = int(train.shuffle_index[i])
        expected = stream[j * length : (j + 1) * length + 1]
        np.testing.assert_array_equal(sample["tokens"].numpy(), expected[:-1])
        np.testing.assert_array_equal(sample["labels"].numpy(), expected[1:])


def test_merged_bytes_do_not_depend_on_the_number_of_workers(env, tmp_path):
    # small work items: many more than workers, so each worker takes several, one after another
    plan_dir = plan(env, "plan-ws3", "--mode", "image-text", "--world-size", "3", "--item-seconds", "0.0005")
    items = Plan.open(plan_dir).work_items()
    assert len(items) > 7
    runs = {n: encode_all(env, plan_dir, tmp_path / f"ws{n}", world_size=n) for n in (1, 3, 7)}
    assert digests(runs[1]) == digests(runs[3]) == digests(runs[7])
    merged = {n: json.loads((out / "merged.json").read_text()) for n, out in runs.items()}
    assert merged[1]["identity"] == merged[3]["identity"] == merged[7]["identity"]  # the job has the same parts
    for n in (1, 3, 7):  # one part per work item, holding that item's batches, whoever encoded it
        assert [read_stats(part_dir(runs[n], i))["batches"] for i in range(len(items))] == items.tolist()


def test_workers_without_items_encode_nothing(env, tmp_path, capsys):
    plan_dir = plan(env, "plan-wide", "--mode", "image", "--token-budget", "200", "--max-batch-images", "8")
    items = len(Plan.open(plan_dir).work_items())
    wide = digests(encode_all(env, plan_dir, tmp_path / "wide", world_size=items + 2))
    assert f"rank {items + 1}/{items + 2}: no work item of its own" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "wide" / "parts").iterdir()) == [f"part-{i:05d}" for i in range(items)]
    assert wide == digests(encode_all(env, plan_dir, tmp_path / "one", world_size=1))


def test_loader_thread_count_does_not_change_the_output(env, tmp_path):
    plan_dir = plan(env, "plan-threads", "--mode", "text-image")
    one = digests(encode_all(env, plan_dir, tmp_path / "t1", world_size=1, threads=1))
    four = digests(encode_all(env, plan_dir, tmp_path / "t4", world_size=1, threads=4, extra=("--prefetch", "2")))
    assert one == four


def test_text_image_and_image_modes_lay_out_documents_per_design(env, tmp_path):
    layout = VocabLayout(text_size=env.tokenizer.vocab_size)
    for mode in ("text-image", "image"):
        out = encode_all(env, plan(env, f"plan-{mode}", "--mode", mode), tmp_path / mode, world_size=1)
        provenance = [json.loads(x) for x in (out / "merged.provenance.jsonl").read_text().splitlines()]
        for record, tokens in zip(provenance, read_sequences(out / "merged"), strict=True):
            position = 1
            if mode == "text-image":  # BOS caption blocks EOS
                position = int(np.flatnonzero(tokens == layout.special_id("<|img_start|>"))[0])
                assert position > 1
            for _ in record["rows"]:
                _, position = parse_block(tokens, position, layout, env.tokenizer)
            assert position == tokens.size - 1 and tokens[-1] == env.tokenizer.eos_id


def test_corrupt_images_are_skipped_with_reasons_and_counts_add_up(env, tmp_path):
    caption_corpus(tmp_path / "bad", corrupt=True)
    assert main(["scan", str(tmp_path / "bad" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    plan_dir = plan(env, "plan-corrupt", "--mode", "image-text", manifest=tmp_path / "manifest")
    out = encode_all(env, plan_dir, tmp_path / "out", world_size=2)
    summary = json.loads((out / "merged.json").read_text())
    counts = summary["counts"]
    skipped = {k: v for k, v in counts.items() if k.startswith("skipped:")}
    assert skipped.get("skipped:decode_error", 0) == 3  # c000, c001 and the bad half of c002
    assert skipped.get("skipped:document_image_failed", 0) == 1  # the good half of c002
    meta = json.loads((plan_dir / "plan.json").read_text())
    assert counts["images_written"] + sum(skipped.values()) == meta["totals"]["kept_images"]
    keys = {json.loads(x)["key"] for x in (out / "merged.provenance.jsonl").read_text().splitlines()}
    assert not keys & {"c000", "c001", "c002"} and summary["sequences"] == counts["documents_written"]
    # every skipped image is named: sample key, container, member, reason and detail
    skipped_file = [json.loads(x) for x in (out / summary["skipped_file"]).read_text().splitlines()]
    assert len(skipped_file) == sum(skipped.values())
    named = {(s["key"], s["member"], s["reason"]) for s in skipped_file}
    assert named == {("c000", "c000.jpg", "decode_error"), ("c001", "c001.png", "decode_error"),
                     ("c002", "c002.1.jpg", "decode_error"), ("c002", "c002.0.png", "document_image_failed")}
    for record in skipped_file:
        assert record["source"].endswith("shard-2.tar") and record["detail"], record


def test_interleaved_documents_follow_the_json_order(env, tmp_path):
    interleaved_corpus(tmp_path / "web")
    assert main(["scan", str(tmp_path / "web" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    out = encode_all(env, plan(env, "plan-web", "--mode", "interleaved", manifest=tmp_path / "manifest"),
                     tmp_path / "out", world_size=1)
    layout = VocabLayout(text_size=env.tokenizer.vocab_size)
    encode = env.tokenizer.encode
    documents = {json.loads(x)["key"]: tokens for x, tokens in
                 zip((out / "merged.provenance.jsonl").read_text().splitlines(), read_sequences(out / "merged"),
                     strict=True)}
    tokens = documents["w000"]  # text, image 0, two texts joined by a blank line, image 1
    assert tokens[0] == env.tokenizer.bos_id
    text = encode("A cat sat on the chair.")
    assert tokens[1 : 1 + len(text)].tolist() == text
    _, position = parse_block(tokens, 1 + len(text), layout, env.tokenizer)
    text = encode("Then it slept.\n\nIt woke at noon.")
    assert tokens[position : position + len(text)].tolist() == text
    _, position = parse_block(tokens, position + len(text), layout, env.tokenizer)
    assert position == tokens.size - 1 and tokens[-1] == env.tokenizer.eos_id
    tokens = documents["w002"]  # json lists image 1 before image 0: blocks follow the json order
    start = 1 + len(encode("Coins and coffee:"))
    first, middle = parse_block(tokens, start, layout, env.tokenizer)
    second, end = parse_block(tokens, middle, layout, env.tokenizer)
    assert first.shape != second.shape or not np.array_equal(first, second)
    assert tokens[end:-1].tolist() == encode("That was all.")


def test_rerun_of_a_finished_rank_is_a_no_op_and_other_inputs_are_refused(env, tmp_path, capsys):
    plan_dir = plan(env, "plan-refuse", "--mode", "image")
    encode_all(env, plan_dir, tmp_path / "out", world_size=1)
    before = digests(tmp_path / "out")
    assert main(["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out", str(tmp_path / "out"),
                 "--device", "cpu", "--loader-threads", "3", "--no-progress"]) == 0  # loader threads may differ
    assert "already finished" in capsys.readouterr().err and digests(tmp_path / "out") == before
    other = emu35.write_random_checkpoint(tmp_path / "other", seed=7)
    with pytest.raises(MmtokError, match=r"codec\.checkpoint_sha256 \(recorded"):
        from mmtok.encode.runner import encode_image_rank

        encode_image_rank(plan_dir, tmp_path / "out", emu35.load(other, "cpu"), rank=0, world_size=1)
    other_plan = plan(env, "plan-refuse-2", "--mode", "image", "--token-budget", "40")
    assert main(["encode", "--plan", str(other_plan), "--checkpoint", str(env.checkpoint), "--out",
                 str(tmp_path / "out"), "--device", "cpu", "--no-progress"]) == 2


def test_a_missing_tar_stops_the_rank_with_a_clear_message(env, tmp_path, capsys):
    caption_corpus(tmp_path / "data")
    assert main(["scan", str(tmp_path / "data" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    plan_dir = plan(env, "plan-missing", "--mode", "image", manifest=tmp_path / "manifest")
    (tmp_path / "data" / "shard-1.tar").unlink()
    assert main(["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out",
                 str(tmp_path / "out"), "--device", "cpu", "--no-progress"]) == 2
    assert "shard-1.tar: input file listed in the manifest is missing" in capsys.readouterr().err


def test_many_consecutive_decode_failures_stop_the_rank(env, tmp_path, capsys):
    caption_corpus(tmp_path / "data", corrupt=True)
    assert main(["scan", str(tmp_path / "data" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    plan_dir = plan(env, "plan-systematic", "--mode", "image", manifest=tmp_path / "manifest")
    assert main(["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out",
                 str(tmp_path / "out"), "--device", "cpu", "--no-progress", "--max-consecutive-failures", "1"]) == 2
    assert "images in a row failed to decode" in capsys.readouterr().err


def test_parquet_inputs_are_read_by_row_with_their_caption_column(env, tmp_path):
    import pyarrow as pa

    images = real_images()
    names = ["astronaut.png", "rocket.jpg", "coins.png", "horse.png", "color.png"]
    table = pa.table({"image": [images[n].read_bytes() for n in names],
                      "caption": [f"the {n.split('.')[0]} picture" for n in names]})
    pq.write_table(table, tmp_path / "images.parquet", row_group_size=2)  # rows span several row groups
    assert main(["scan", str(tmp_path / "images.parquet"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--image-column", "image", "--text-column", "caption", "--no-progress"]) == 0
    out = encode_all(env, plan(env, "plan-parquet", "--mode", "image-text", manifest=tmp_path / "manifest"),
                     tmp_path / "out", world_size=1)
    layout = VocabLayout(text_size=env.tokenizer.vocab_size)
    records = [json.loads(x) for x in (out / "merged.provenance.jsonl").read_text().splitlines()]
    assert sorted(r["rows"][0] for r in records) == list(range(len(names)))
    for record, tokens in zip(records, read_sequences(out / "merged"), strict=True):
        _, position = parse_block(tokens, 1, layout, env.tokenizer)
        caption = f"the {names[record['rows'][0]].split('.')[0]} picture"
        assert tokens[position:-1].tolist() == env.tokenizer.encode(caption)


def test_a_stop_while_a_document_is_half_encoded_resumes_and_merges_the_same_bytes(env, tmp_path, monkeypatch):
    from mmtok.encode.runner import encode_image_rank
    from mmtok.formats.commitlog import PartWriter
    from mmtok.formats.items import read_items

    plan_dir = plan(env, "plan-items", "--mode", "image-text")
    clean = encode_all(env, plan_dir, tmp_path / "clean", world_size=1)
    real_commit = PartWriter.commit

    class Stop(Exception):
        pass

    def commit_then_stop(self, unit, *args, items=(), **kwargs):
        real_commit(self, unit, *args, items=items, **kwargs)
        if any(record["kind"] == "image" for record, _ in items):  # part of a multi-image document is committed
            raise Stop(unit)

    monkeypatch.setattr(PartWriter, "commit", commit_then_stop)
    with pytest.raises(Stop):
        encode_image_rank(plan_dir, tmp_path / "stopped", env.codec, rank=0, world_size=1)
    monkeypatch.setattr(PartWriter, "commit", real_commit)
    records, _ = read_items(part_dir(tmp_path / "stopped", 0))
    documents = {r["document"] for r in records if r["kind"] == "image"}
    assert documents and not (tmp_path / "stopped" / "parts" / "part-00000" / "DONE").exists()
    encode_image_rank(plan_dir, tmp_path / "stopped", env.codec, rank=0, world_size=1)
    assert main(["merge", str(tmp_path / "stopped")]) == 0
    assert digests(tmp_path / "stopped") == digests(clean)


def test_a_device_error_is_reported_even_when_the_committer_fails_after_it(env, tmp_path, monkeypatch):
    import threading

    from mmtok.encode.runner import encode_image_rank
    from mmtok.formats.commitlog import PartWriter

    plan_dir = plan(env, "plan-first-error", "--mode", "image-text")
    device_failed = threading.Event()
    real_encode = type(env.codec).encode
    calls = []

    def failing_encode(self, pixels):
        calls.append(1)
        if len(calls) == 2:
            device_failed.set()
            raise RuntimeError("the device failed first")
        return real_encode(self, pixels)

    def failing_commit(self, *args, **kwargs):
        assert device_failed.wait(60)  # fails strictly after the device did
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(type(env.codec), "encode", failing_encode)
    monkeypatch.setattr(PartWriter, "commit", failing_commit)
    with pytest.raises(RuntimeError, match="the device failed first"):
        encode_image_rank(plan_dir, tmp_path / "out", env.codec, rank=0, world_size=1)


def test_encode_refuses_a_plan_that_keeps_no_image(env, tmp_path, capsys):
    # nothing from nothing: the plan exits 2 (and says why); encode then refuses instead of writing empty parts
    out = env.root / "plan-nothing"
    assert main(["plan", str(env.manifest), "--out", str(out), "--quiet", *PLAN_FLAGS, "--text-tokenizer",
                 str(env.text), "--min-source-pixels", "50000000", "--max-source-pixels", "60000000"]) == 2
    capsys.readouterr()
    assert main(["encode", "--plan", str(out), "--checkpoint", str(env.checkpoint), "--out", str(tmp_path / "o"),
                 "--device", "cpu", "--no-progress"]) == 2
    assert "the plan keeps no image" in capsys.readouterr().err
    assert not (tmp_path / "o" / "parts").exists()


def test_summaries_go_to_stderr_and_json_prints_one_result_on_stdout(env, tmp_path, capsys):
    capsys.readouterr()
    assert main(["scan", str(env.root / "captions" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    summary_lines(capsys.readouterr(), "scan")
    assert main(["plan", str(tmp_path / "manifest"), "--out", str(tmp_path / "plan"), "--quiet", *PLAN_FLAGS,
                 "--text-tokenizer", str(env.text), "--world-size", "2", "--item-seconds", "0.0005"]) == 0
    assert "; 2 ranks, imbalance" in summary_lines(capsys.readouterr(), "plan")[0]
    encode = ["encode", "--plan", str(tmp_path / "plan"), "--checkpoint", str(env.checkpoint), "--out",
              str(tmp_path / "out"), "--world-size", "2", "--device", "cpu", "--loader-threads", "2", "--no-progress",
              "--no-take-over"]  # each rank its own items: run one after another, the first would take them all
    assert main([*encode, "--rank", "0"]) == 0
    assert summary_lines(capsys.readouterr(), "encode")[0].startswith("rank 0/2 -> ", len("mmtok encode: "))
    assert main([*encode, "--rank", "1", "--json"]) == 0
    captured = capsys.readouterr()
    result = json_result(captured)
    assert captured.err.startswith("mmtok encode: rank 1/2 -> ")
    assert set(result) == {  # the --json contract: a key renamed or lost breaks a user's script
        "rank", "world_size", "items", "num_items", "stopped", "mode", "counts", "parts", "dataset", "sequences",
        "already_done", "items_done_before", "taken_over", "held_by_others", "unfinished_failed", "take_over_failed",
        "discarded_copies", "images_planned", "images_written", "images_deferred", "items_failed", "skipped",
        "wall_s", "device_busy_s", "device_busy_fraction", "tokens_per_s", "images_per_s", "fill_s", "device",
        "loader_threads"}
    first, last = result["items"]
    assert (result["rank"], result["world_size"]) == (1, 2) and 0 < first < last == result["num_items"]
    assert result["parts"] == [str(part_dir(tmp_path / "out", i)) for i in range(first, last)]
    assert result["images_written"] == sum(read_stats(part_dir(tmp_path / "out", i))["images_written"]
                                           for i in range(first, last)) > 0
    assert main(["merge", str(tmp_path / "out"), "--no-progress"]) == 0
    summary_lines(capsys.readouterr(), "merge")
    assert main(["merge", str(tmp_path / "out"), "--no-progress", "--json"]) == 0
    merged = json_result(capsys.readouterr())
    assert {k: merged[k] for k in ("sequences", "tokens", "counts")} == \
        {k: v for k, v in json.loads((tmp_path / "out" / "merged.json").read_text()).items()
         if k in ("sequences", "tokens", "counts")}


def test_a_worker_takes_over_the_items_nobody_holds_and_names_a_taken_item_that_fails(env, tmp_path, capsys):
    """Worker 1 of 2 never comes: worker 0 does its own items, then takes over worker 1's from the far end. One
    of those is damaged (its files cut short): a warning names it, the worker does all the others, then exits 2
    naming it (the job is not done); once deleted, worker 1 does just that one and the bytes are those of
    one process doing everything."""
    plan_dir = plan(env, "plan-take-over", "--mode", "image-text", "--world-size", "2", "--item-seconds", "0.0005")
    opened = Plan.open(plan_dir)
    count, own = len(opened.work_items()), opened.worker_items(0, 2)
    damaged = own.stop  # worker 1's first item: taken over last
    reference = encode_all(env, plan_dir, tmp_path / "one", world_size=1)
    out = tmp_path / "out"
    shutil.copytree(part_dir(reference, damaged), part_dir(out, damaged))  # this run's part, killed and then rotted
    (part_dir(out, damaged) / "DONE").unlink()
    for name in ("tokens.bin", "provenance.jsonl", "items.ids", "items.jsonl"):  # shorter than its records say
        if (part_dir(out, damaged) / name).exists():
            (part_dir(out, damaged) / name).write_bytes(b"")
    capsys.readouterr()
    argv = ["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out", str(out), "--world-size",
            "2", "--device", "cpu", "--loader-threads", "2", "--no-progress"]
    assert main([*argv, "--rank", "0", "--json"]) == 2  # it did everything else; the job is not done: exit 2
    captured = capsys.readouterr()
    result = json_result(captured)
    taken = [item for item in reversed(range(own.stop, count)) if item != damaged]
    assert result["taken_over"] == taken and list(result["take_over_failed"]) == [str(damaged)]
    assert result["unfinished_failed"] == [damaged]
    assert f"took over {len(taken)} items of other workers' shares" in captured.err
    assert f"warning: item {damaged} (another worker's, taken over) failed" in captured.err
    assert f"error: 1 item this worker took over failed and is not finished: {damaged}" in captured.err
    assert main([*argv, "--rank", "1"]) == 2  # its owner meets the damage: an error naming the part
    assert f"part-{damaged:05d}" in capsys.readouterr().err
    shutil.rmtree(part_dir(out, damaged))
    assert main([*argv, "--rank", "1", "--json"]) == 0
    result = json_result(capsys.readouterr())
    assert result["taken_over"] == [] and len(result["parts"]) == count - own.stop
    assert main(["merge", str(out)]) == 0
    assert digests(out) == digests(reference)


def test_a_worker_without_items_prints_its_json_result(env, tmp_path, capsys):
    plan_dir = plan(env, "plan-one-item", "--mode", "image")
    assert len(Plan.open(plan_dir).work_items()) == 1
    capsys.readouterr()
    assert main(["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out", str(tmp_path),
                 "--rank", "1", "--world-size", "2", "--device", "cpu", "--no-progress", "--json",
                 "--no-take-over"]) == 0
    result = json_result(capsys.readouterr())
    assert result == {"rank": 1, "world_size": 2, "items": [1, 1], "num_items": 1, "parts": []}
