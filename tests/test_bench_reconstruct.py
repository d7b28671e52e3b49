"""`mmtok bench reconstruct` end to end on real media with tiny random-weight tokenizers."""

from __future__ import annotations

import csv
import json
import math
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pytest
import soundfile

from manifestkit import write_rows
from mmtok import cli
from mmtok.bench import inputs, reconstruct
from mmtok.bench.report import METRICS, OVERALL
from mmtok.bench.tasks import ImageTask
from mmtok.codecs import emu3, emu35, wavtokenizer
from mmtok.errors import MmtokError
from realmedia import alsa_sounds, asterisk_prompts, espeak, mate_photos, skimage_images

TIMING = ("encode_s", "decode_s", "metrics_s")
SMALL = "max_pixels=4096,min_pixels=1024"  # keeps CPU tests fast: at most 64x64 pixels


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    return {"emu3.5": emu35.write_random_checkpoint(root / "emu35"),
            "emu3": emu3.write_random_checkpoint(root / "emu3")}


@pytest.fixture(scope="module")
def image_table(tmp_path_factory) -> Path:
    """skimage photos (one category) and Debian mate JPEGs (one category per folder), as a CSV table."""
    path = tmp_path_factory.mktemp("table") / "images.csv"
    skimage_files = [p for p in skimage_images() if p.suffix in (".png", ".jpg")]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["path", "source"])
        writer.writerows([[str(p), "skimage"] for p in skimage_files])
        # JPEGs under 4 MB: the 16 MB 5640x3172 variants only slow the test down.
        writer.writerows([[str(p), f"mate-{p.parent.name}"] for p in mate_photos()
                          if p.suffix == ".jpg" and p.stat().st_size < 4_000_000])
    return path


def bench_args(table: Path, out: Path, checkpoints: dict, seed: int = 1, per_category: int = 2) -> list[str]:
    return ["bench", "reconstruct", "--manifest", str(table), "--category-column", "source", "--per-category",
            str(per_category), "--seed", str(seed), "--out", str(out), "--no-progress", "--keep-per-category", "2",
            "--tokenizer", f"emu3.5={checkpoints['emu3.5']},{SMALL}",
            "--tokenizer", f"emu3={checkpoints['emu3']},{SMALL}"]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, image_table, checkpoints) -> Path:
    out = tmp_path_factory.mktemp("run") / "out"
    assert cli.main(bench_args(image_table, out, checkpoints)) == 0
    return out


def read_results(out: Path) -> list[dict]:
    with open(out / "results.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def table_rows(report: str, heading: str) -> list[list[str]]:
    """The cells of the first Markdown table after `heading` (header row first, separator dropped)."""
    block = []
    for line in report.split(heading, 1)[1].splitlines():
        if line.startswith("|"):
            block.append([c.strip().strip("*") for c in line.strip("|").split("|")])
        elif block:
            break
    return [block[0]] + block[2:]


def parse_number(cell: str) -> float:
    return math.inf if cell == "inf" else math.nan if cell == "–" else float(cell.replace(",", ""))


def assert_report_equals_csv_means(out: Path, modality: str) -> None:
    rows = read_results(out)
    report = (out / "report.md").read_text()
    table = table_rows(report, "## Per category")
    header, body = table[0], table[1:]
    labels = sorted({r["tokenizer"] for r in rows})
    for metric in METRICS[modality]:
        for label in labels:
            column = header.index(f"{metric.header} {label}")
            for cells in body:
                category = cells[0]
                picked = [r for r in rows if r["tokenizer"] == label and r["status"] == "ok"
                          and (category == OVERALL or r["category"] == category)]
                values = np.array([float(r[metric.key]) for r in picked])
                values = values[~np.isnan(values)]
                if not values.size:
                    assert cells[column] == "–", (metric.key, label, category)
                    continue
                expected = round(float(values.mean()), metric.digits)
                assert parse_number(cells[column]) == pytest.approx(expected, abs=10 ** -metric.digits / 2), \
                    (metric.key, label, category)


def test_report_has_every_category_and_tokenizer(first_run, image_table):
    rows = read_results(first_run)
    catalog = inputs.read_catalog(image_table, "source")
    categories = sorted(set(catalog.categories))
    assert sorted({r["category"] for r in rows}) == categories
    assert {r["tokenizer"] for r in rows} == {"emu3.5", "emu3"}
    report = (first_run / "report.md").read_text()
    body = table_rows(report, "## Per category")[1:]
    assert [cells[0] for cells in body] == categories + [OVERALL]
    overall = table_rows(report, "## Overall")
    assert [cells[0] for cells in overall[1:]] == ["emu3.5", "emu3"]
    for name in ("summary.json", "metrics.png", "run.json"):
        assert (first_run / name).stat().st_size > 0
    assert sorted(p.stem.rsplit("-", 1)[0] for p in (first_run / "grids").glob("*.png")) == categories


def test_report_numbers_equal_the_means_of_results_csv(first_run):
    assert_report_equals_csv_means(first_run, "image")
    summary = json.loads((first_run / "summary.json").read_text())
    rows = [r for r in read_results(first_run) if r["tokenizer"] == "emu3" and r["status"] == "ok"]
    assert summary["means"]["emu3"][OVERALL]["lpips"] == pytest.approx(np.mean([float(r["lpips"]) for r in rows]))


def test_rows_follow_each_tokenizers_own_resize_rule(first_run):
    for row in read_results(first_run):
        assert row["status"] == "ok"
        factor = 16 if row["tokenizer"] == "emu3.5" else 8
        height, width = int(row["height"]), int(row["width"])
        assert height % factor == 0 and width % factor == 0 and height * width <= 4096
        assert int(row["codes"]) == height * width // factor ** 2
        rows_of_codes = height // factor
        assert int(row["tokens"]) >= int(row["codes"]) + rows_of_codes + 4 + 3  # markers, eol, "h*w" digits


def test_the_run_scores_the_seeded_sample_and_another_seed_draws_another(first_run, image_table):
    catalog = inputs.read_catalog(image_table, "source")
    sample = inputs.stratified_sample(catalog.categories, 2, seed=1)
    assert np.array_equal(sample, inputs.stratified_sample(catalog.categories, 2, seed=1))
    items = list(dict.fromkeys(r["item"] for r in read_results(first_run)))
    assert items == [str(catalog.ids[i]) for i in sample]
    other = inputs.stratified_sample(catalog.categories, 2, seed=2)
    assert {str(catalog.ids[i]) for i in other} != set(items)


def test_adding_a_category_leaves_the_other_categories_draws_alone():
    categories = np.array(["a"] * 30 + ["b"] * 30, dtype=object)
    more = np.concatenate([categories, np.array(["c"] * 30, dtype=object)])
    before = inputs.stratified_sample(categories, 5, seed=9)
    after = inputs.stratified_sample(more, 5, seed=9)
    assert np.array_equal(after[:10], before)
    assert len(inputs.stratified_sample(categories, 100, seed=9)) == 60  # small categories give all they have


def test_resume_skips_finished_work_and_redoes_a_torn_tail(first_run, tmp_path, image_table, checkpoints, monkeypatch):
    out = tmp_path / "resumed"
    shutil.copytree(first_run, out)
    lines = (out / "results.csv").read_text().splitlines(keepends=True)
    kept_rows = len(lines) - 1 - 3  # all rows but the last three, then half of one: a crash mid-append
    (out / "results.csv").write_text("".join(lines[: 1 + kept_rows]) + lines[1 + kept_rows][:20])
    calls = []
    original = ImageTask.run
    monkeypatch.setattr(ImageTask, "run",
                        lambda self, entry, *a: calls.append(entry.spec.label) or original(self, entry, *a))
    assert cli.main(bench_args(image_table, out, checkpoints)) == 0
    assert len(calls) == 3
    # The recomputed rows equal the first run's: the run is deterministic apart from its timings.
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING} for r in rows]  # noqa: E731
    assert strip(read_results(out)) == strip(read_results(first_run))
    calls.clear()
    assert cli.main(bench_args(image_table, out, checkpoints)) == 0
    assert calls == []  # a finished run recomputes nothing


def test_resume_refuses_a_different_run(first_run, tmp_path, image_table, checkpoints):
    out = tmp_path / "changed"
    shutil.copytree(first_run, out)
    with pytest.raises(MmtokError, match="'seed'"):
        reconstruct.run(reconstruct.RunOptions(
            manifest=image_table, category_column="source", per_category=2, seed=2, out=out, progress=False,
            tokenizers=[reconstruct.parse_tokenizer(f"emu3={checkpoints['emu3']},{SMALL}")]))


def test_unreadable_and_too_elongated_images_get_reasons_not_crashes(tmp_path, checkpoints):
    photo = next(p for p in skimage_images() if p.stem == "astronaut")
    truncated = tmp_path / "truncated.png"
    truncated.write_bytes(photo.read_bytes()[:300])  # a real PNG cut after its first 300 bytes
    panorama = tmp_path / "panorama.png"
    from PIL import Image

    Image.open(photo).convert("RGB").crop((0, 0, 512, 80)).save(panorama)  # 6.4:1, above both aspect limits
    table = tmp_path / "odd.jsonl"
    table.write_text("".join(json.dumps({"path": p.name, "kind": "odd"}) + "\n" for p in (truncated, panorama))
                     + json.dumps({"path": str(photo), "kind": "fine"}) + "\n")
    out = tmp_path / "out"
    args = ["bench", "reconstruct", "--manifest", str(table), "--category-column", "kind", "--out", str(out),
            "--no-progress", "--tokenizer", f"emu3={checkpoints['emu3']},{SMALL}"]
    assert cli.main(args) == 0
    status = {(Path(r["source"]).name, r["tokenizer"]): r["status"] for r in read_results(out)}
    assert status == {("truncated.png", "emu3"): "decode_error", ("panorama.png", "emu3"): "aspect_ratio",
                      ("astronaut.png", "emu3"): "ok"}
    report = (out / "report.md").read_text()
    assert "not scored" in report and "aspect_ratio" in report and "decode_error" in report


def write_shards(folder: Path) -> list[Path]:
    """Two WebDataset-style shards of real photos and their manifest.parquet per the scan contract."""
    import pyarrow as pa

    photos = [p for p in skimage_images() if p.suffix == ".png"][:6]
    shards, rows = [], []
    for shard_index in range(2):
        shard = folder / f"shard-{shard_index:05d}.tar"
        with tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT) as archive:
            for i, photo in enumerate(photos[shard_index * 3:(shard_index + 1) * 3]):
                archive.add(photo, arcname=f"sample{shard_index}{i}.png")
        with tarfile.open(shard) as archive:
            for member in archive.getmembers():
                rows.append({"key": member.name[:-4], "tar": str(shard), "container": "tar", "member": member.name,
                             "offset": member.offset_data, "size": member.size, "status": "ok", "reason": ""})
        shards.append(shard)
    rows.append({"key": "broken", "tar": str(shards[0]), "container": "tar", "member": "broken.png", "offset": 0,
                 "size": 0, "status": "error", "reason": "zero_size"})
    table = pa.Table.from_pylist([{**r, "document": i, "image_index": 0, "width": 0, "height": 0, "format": "png",
                                   "orientation": 1, "text_offset": -1, "text_size": -1, "json_offset": -1,
                                   "json_size": -1} for i, r in enumerate(rows)])
    write_rows(folder / "manifest", table)
    return shards


def test_scan_manifest_input_with_one_category_per_shard(tmp_path, checkpoints):
    shards = write_shards(tmp_path)
    out = tmp_path / "out"
    args = ["bench", "reconstruct", "--manifest", str(tmp_path / "manifest"), "--category-column", "tar",
            "--per-category", "2", "--out", str(out), "--no-progress",
            "--tokenizer", f"emu3.5={checkpoints['emu3.5']},{SMALL}"]
    assert cli.main(args) == 0
    rows = read_results(out)
    assert sorted({r["category"] for r in rows}) == [s.name for s in shards]
    assert len(rows) == 4 and all(r["status"] == "ok" and r["item"].startswith("row:") for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["excluded_from_catalog"] == {"manifest:zero_size": 1}
    # The bytes read by offset are the member's: the source image's size is reported unchanged.
    from PIL import Image

    sizes = {Image.open(p).size[::-1] for p in [q for q in skimage_images() if q.suffix == ".png"][:6]}
    assert {(int(r["src_height"]), int(r["src_width"])) for r in rows} <= sizes


def test_manifest_categories_can_come_from_a_joined_table(tmp_path):
    write_shards(tmp_path)
    side = tmp_path / "kinds.csv"
    side.write_text("key,kind\nsample00,cats\nsample01,cats\nsample10,rocks\n")
    catalog = inputs.read_catalog(tmp_path / "manifest", "kind", categories=side)
    assert sorted(catalog.categories) == ["cats", "cats", "rocks"]
    assert catalog.excluded == {"manifest:zero_size": 1, "missing_category": 3}


def test_parquet_containers_are_read_by_row(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    photos = [p for p in skimage_images() if p.suffix == ".png"][:3]
    container = tmp_path / "images.parquet"
    pq.write_table(pa.table({"jpg": [p.read_bytes() for p in photos]}), container)
    reader = inputs.ByteReader()
    for row, photo in enumerate(photos):
        assert reader.read(("parquet", str(container), "jpg", row, 0)) == photo.read_bytes()  # (a manifest row's)


def test_resize_rules_come_from_checkpoint_plan_preset_or_options(tmp_path, checkpoints):
    from mmtok.codecs.registry import load_codec
    from mmtok.formats.presets import PlanParameters

    codecs = {name: load_codec(name, path) for name, path in checkpoints.items()}
    rule = lambda text, name: reconstruct.resize_rule(reconstruct.parse_tokenizer(text), codecs[name])  # noqa: E731
    plan = PlanParameters()
    assert rule("emu3.5=x", "emu3.5") == reconstruct.ResizeRule(16, plan.min_pixels, plan.max_pixels,
                                                                plan.max_aspect_ratio)
    assert rule("emu3=x", "emu3") == reconstruct.ResizeRule(8, 512 * 512, 1024 * 1024, 5.0)  # preprocessor_config.json
    preset = tmp_path / "small.yaml"
    preset.write_text("min_pixels: 4096\nmax_pixels: 16384\nmax_aspect_ratio: 2.5\n")
    assert rule(f"emu3=x,preset={preset}", "emu3") == reconstruct.ResizeRule(8, 4096, 16384, 2.5)
    assert rule(f"emu3.5=x,preset={preset},max_aspect=3", "emu3.5") == reconstruct.ResizeRule(16, 4096, 16384, 3.0)
    with pytest.raises(MmtokError, match="exceeds"):
        rule("emu3=x,min_pixels=9000,max_pixels=4096", "emu3")
    assert reconstruct.ResizeRule(8, 4096, 16384, 2.5).target(100, 300) == (None, "aspect_ratio")
    assert reconstruct.ResizeRule(8, 4096, 16384, 2.5).target(100, 140) == ((96, 144), "")


def test_tokenizer_specs_parse_options_and_reject_mistakes():
    spec = reconstruct.parse_tokenizer("emu3=/ckpt/e3,label=emu3-ft,max_pixels=1024,max_aspect=3.5")
    assert (spec.codec, str(spec.checkpoint), spec.label) == ("emu3", "/ckpt/e3", "emu3-ft")
    assert spec.options == {"max_pixels": 1024, "max_aspect": 3.5}
    for bad in ("emu3", "emu3=/c,size=3", "emu3=/c,max_pixels=big"):
        with pytest.raises(MmtokError):
            reconstruct.parse_tokenizer(bad)


# ---- audio ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def audio_table(tmp_path_factory) -> Path:
    """Real speech: alsa (48 kHz), asterisk prompts (8 kHz) and espeak-ng in two languages."""
    folder = tmp_path_factory.mktemp("speech")
    rows = [[str(p), "alsa"] for p in alsa_sounds()[:3]] + [[str(p), "asterisk"] for p in asterisk_prompts()[:3]]
    texts = {"en": ["one two three", "the weather is nice today"], "de": ["eins zwei drei", "das Wetter ist schön"]}
    for voice, lines in texts.items():
        rows += [[str(espeak(text, folder / f"{voice}{i}.wav", voice)), f"espeak-{voice}"]
                 for i, text in enumerate(lines)]
    path = folder / "clips.csv"
    with open(path, "w", newline="") as handle:
        csv.writer(handle).writerows([["path", "language"]] + rows)
    return path


def test_audio_run_on_real_speech_with_the_tiny_wavtokenizer(tmp_path, audio_table):
    checkpoint = wavtokenizer.write_random_checkpoint(tmp_path / "wt")
    out = tmp_path / "out"
    args = ["bench", "reconstruct", "--modality", "audio", "--manifest", str(audio_table), "--category-column",
            "language", "--per-category", "2", "--out", str(out), "--no-progress", "--keep-per-category", "1",
            "--tokenizer", f"wavtokenizer={checkpoint}"]
    assert cli.main(args) == 0
    rows = read_results(out)
    assert sorted({r["category"] for r in rows}) == ["alsa", "asterisk", "espeak-de", "espeak-en"]
    assert len(rows) == 8 and all(r["status"] == "ok" for r in rows)
    for row in rows:
        duration = float(row["duration_s"])
        assert int(row["codes"]) == math.ceil(int(row["samples"]) / 600)
        assert 40.0 <= float(row["tokens_per_s"]) <= 40.0 + 1 / duration
        assert 0.0 < float(row["mel_l1"]) and -1.0 <= float(row["stoi"]) <= 1.0
    assert_report_equals_csv_means(out, "audio")
    wavs = sorted((out / "recon").glob("*.wav"))
    assert len(wavs) == 8  # one input + one reconstruction per category
    for pair in {w.name.split("__")[0] for w in wavs}:
        ref, rate = soundfile.read(out / "recon" / f"{pair}__input.wav")
        dec, rate2 = soundfile.read(out / "recon" / f"{pair}__wavtokenizer.wav")
        assert rate == rate2 == 24_000 and ref.shape == dec.shape
    report = (out / "report.md").read_text()
    assert "## Listen" in report and "__input.wav" in report
    with pytest.raises(MmtokError, match="audio codec in a --modality image run"):
        reconstruct.run(reconstruct.RunOptions(manifest=audio_table, category_column="language", per_category=1,
                                               seed=0, out=tmp_path / "wrong", progress=False,
                                               tokenizers=[reconstruct.parse_tokenizer(f"wavtokenizer={checkpoint}")]))
