"""Issue 49: inputs as the tools users already run write them, built here with those tools (webdataset's
TarWriter, Hugging Face `datasets`, lhotse in test_encode_audio/test_audio_convert; img2dataset's Parquet
layout reproduced, see below), through the CLI: what is read, and what is named when it cannot be."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from audio_corpus import DIGITS, digit
from convertkit import dropped_records, load_cuts
from encodekit import real_images
from mmtok.cli import main
from mmtok.formats.manifest import Manifest


@pytest.fixture(scope="module")
def photos() -> list[Path]:
    images = real_images()
    return [images[name] for name in ("chelsea.png", "rocket.jpg", "coffee.png")]


def scan(inputs: list[Path], out: Path, *options: str) -> int:
    return main(["scan", *map(str, inputs), "--out", str(out), "--workers", "1", "--no-progress", *options])


def test_webdataset_keys_with_dots_merge_images_and_audio_alike_and_are_named(tmp_path, photos, capsys):
    """webdataset 0.2's TarWriter names members KEY.EXT, and its reader takes the key up to the first dot: three
    samples `laion.v2.00000N` are one sample `laion`. Scan warns naming it; audio convert keeps the first clip
    and names each further one as extra_audio_member with the key rule (was no_audio_member for all)."""
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "images.tar")) as sink:
        for index, photo in enumerate(photos):
            sink.write({"__key__": f"laion.v2.{index:06d}", photo.suffix[1:]: photo.read_bytes()})
    with wds.TarWriter(str(tmp_path / "speech.tar")) as sink:
        for key in "123":
            sink.write({"__key__": f"talk.v2.{key}", "wav": digit(key).read_bytes(), "txt": DIGITS[key]})
    grouped = list(wds.WebDataset(str(tmp_path / "speech.tar"), shardshuffle=False))
    assert [s["__key__"] for s in grouped] == ["talk"]  # webdataset's own reader: one sample

    assert scan([tmp_path / "images.tar"], tmp_path / "m") == 0
    assert ("1 sample holds several images named past the key's first dot (first: sample `laion` with "
            "laion.v2.000000.png, laion.v2.000001.jpg, laion.v2.000002.png)") in capsys.readouterr().err
    assert Manifest.open(tmp_path / "m").metadata.documents == 1

    out = tmp_path / "audio"
    assert main(["audio", "convert", str(tmp_path / "speech.tar"), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    (clip,) = load_cuts(out)
    assert clip.custom["origin"].endswith("speech.tar:talk.v2.1.wav")
    extra = dropped_records(out)
    assert [r["reason"] for r in extra] == ["extra_audio_member"] * 2
    assert all("sample talk holds 3 audio members" in r["detail"] and "first dot" in r["detail"] for r in extra)
    assert [r["source"].rsplit(":", 1)[1] for r in extra] == ["talk.v2.2.wav", "talk.v2.3.wav"]


def test_hugging_face_image_datasets_are_read_or_named(tmp_path, photos, capsys):
    """datasets 5.2: `save_to_disk` embeds the image bytes in Arrow files, which scan reads; `to_parquet()` of
    images loaded from files keeps only their paths (`path_only_cell`, with the fix in docs/scan.md); a
    `Sequence(Image())` column is named with what to do instead of "no column"."""
    from datasets import Dataset, Features, Image, Sequence, Value

    paths = [str(p) for p in photos]
    ds = Dataset.from_dict({"image": paths, "text": ["a cat", "a rocket", "a cup"]}).cast_column("image", Image())
    ds.save_to_disk(tmp_path / "saved")
    assert scan(sorted((tmp_path / "saved").glob("*.arrow")), tmp_path / "m1", "--text-column", "text") == 0
    manifest = Manifest.open(tmp_path / "m1")
    keys = manifest.read(["key"]).column("key").to_pylist()
    assert manifest.metadata.images_ok == 3 and keys == [p.name for p in photos]  # the cells' `path`

    ds.to_parquet(tmp_path / "paths.parquet")
    assert scan([tmp_path / "paths.parquet"], tmp_path / "m2") == 2
    assert "path_only_cell 3" in capsys.readouterr().err

    features = Features({"images": Sequence(Image()), "text": Value("string")})
    Dataset.from_dict({"images": [paths[:2]], "text": ["two"]}, features=features).to_parquet(tmp_path / "seq.parquet")
    assert scan([tmp_path / "seq.parquet"], tmp_path / "m3") == 2
    err = capsys.readouterr().err
    assert "'images' holds a list of images per row (Hugging Face Sequence(Image()))" in err


def test_img2dataset_parquet_output_keys_samples_by_its_key_column(tmp_path, photos):
    """img2dataset 1.47 `--output_format parquet` writes one Parquet file per shard: the image bytes in `jpg`,
    its `key` (shard + index: `000000012`), `caption`, `url` and status columns. img2dataset needs the network
    to run, so the layout is reproduced here with pyarrow. Its key is the manifest's key (was the row number)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = ["000000003", "000000007", "000000011"]
    table = pa.table({
        "url": [f"http://127.0.0.1/{k}.jpg" for k in keys], "caption": ["a cat", "a rocket", "a cup"],
        "key": keys, "status": ["success"] * 3, "error_message": pa.nulls(3, pa.string()),
        "width": [256] * 3, "height": [256] * 3, "sha256": ["0" * 64] * 3,
        "jpg": pa.array([p.read_bytes() for p in photos], pa.binary())})
    pq.write_table(table, tmp_path / "00000.parquet")
    assert scan([tmp_path / "00000.parquet"], tmp_path / "m", "--text-column", "caption") == 0
    rows = Manifest.open(tmp_path / "m").read(["key", "member", "text_size"]).to_pylist()
    assert [r["key"] for r in rows] == keys and {r["member"] for r in rows} == {"jpg"}
    assert [r["text_size"] for r in rows] == [5, 8, 5]


def test_hugging_face_audio_datasets_convert(tmp_path):
    """datasets 5.2 with an `Audio` feature: a `save_to_disk` directory (Arrow files, bytes embedded) is detected
    and converted; `to_parquet()` of files keeps their paths, read inside the Parquet file's directory."""
    from datasets import Audio, Dataset

    (tmp_path / "clips").mkdir()
    for key in "12":
        (tmp_path / "clips" / f"{key}.wav").write_bytes(digit(key).read_bytes())
    ds = Dataset.from_dict({"audio": [str(tmp_path / "clips" / f"{k}.wav") for k in "12"],
                            "text": [DIGITS["1"], DIGITS["2"]]}).cast_column("audio", Audio())
    ds.save_to_disk(tmp_path / "saved")
    out = tmp_path / "from-arrow"
    assert main(["audio", "convert", str(tmp_path / "saved"), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    cuts = load_cuts(out)
    assert len(cuts) == 2 and json.loads((out / "conversion.json").read_text())["counts"]["written"] == 2

    ds.to_parquet(tmp_path / "train.parquet")
    out = tmp_path / "from-parquet"
    assert main(["audio", "convert", str(tmp_path / "train.parquet"), "--out", str(out), "--workers", "0",
                 "--no-progress"]) == 0
    assert [c.custom["text_tokens"] for c in load_cuts(out)] == [c.custom["text_tokens"] for c in cuts]
    assert [c.custom["source_id"] for c in cuts] == ["saved/data-00000-of-00001/00000000",
                                                     "saved/data-00000-of-00001/00000001"]


def test_dotted_audio_keys_take_the_first_sidecar_and_dataset_dict_splits_keep_their_rows(tmp_path):
    """The first clip of a sample merged by dots takes the first json sidecar's text (was the last one's); the
    splits of a `DatasetDict.save_to_disk` share their Arrow file names, so clip ids keep the split's folder (the
    second split was `duplicate_id`); a FIFO named .arrow is `not_a_file`, never opened (it would block)."""
    import io
    import os
    import tarfile

    from datasets import Audio, Dataset, DatasetDict

    from mmtok.text import load_text_tokenizer

    with tarfile.open(tmp_path / "dotted.tar", "w") as tar:
        for key, text in (("1", "one"), ("2", "two")):
            for name, data in ((f"laion.v2.{key}.wav", digit(key).read_bytes()),
                               (f"laion.v2.{key}.json", json.dumps({"text": text}).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    assert main(["audio", "convert", str(tmp_path / "dotted.tar"), "--out", str(tmp_path / "o1"), "--workers", "0",
                 "--no-progress"]) == 0
    (clip,) = load_cuts(tmp_path / "o1")
    assert clip.custom["text_tokens"] == load_text_tokenizer().encode("one")

    paths = [str(digit(k)) for k in "123"]
    ds = Dataset.from_dict({"audio": paths, "text": ["one", "two", "three"]}).cast_column("audio", Audio())
    DatasetDict({"train": ds.select([0, 1]), "test": ds.select([2])}).save_to_disk(tmp_path / "dd")
    out = tmp_path / "o2"
    assert main(["audio", "convert", str(tmp_path / "dd" / "train"), str(tmp_path / "dd" / "test"), "--out", str(out),
                 "--workers", "0", "--no-progress"]) == 0
    assert sorted(c.id for c in load_cuts(out)) == ["test/data-00000-of-00001/00000000",
                                                     "train/data-00000-of-00001/00000000",
                                                     "train/data-00000-of-00001/00000001"]
    out = tmp_path / "o2-whole"  # the DatasetDict's own folder: its splits in dataset_dict.json's order
    assert main(["audio", "convert", str(tmp_path / "dd"), "--out", str(out), "--workers", "0", "--no-progress"]) == 0
    assert [c.id for c in load_cuts(out)] == ["dd/train/data-00000-of-00001/00000000",
                                              "dd/train/data-00000-of-00001/00000001",
                                              "dd/test/data-00000-of-00001/00000000"]

    os.mkfifo(tmp_path / "f.arrow")
    assert main(["audio", "convert", str(tmp_path / "f.arrow"), "--out", str(tmp_path / "o3"), "--workers", "0",
                 "--no-progress"]) == 2
    (record,) = dropped_records(tmp_path / "o3")
    assert record["reason"] == "not_a_file" and "FIFO" in record["detail"]
