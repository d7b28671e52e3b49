"""`mmtok scan` on real tar shards: exact rows, every tar dialect, named damage, resume, determinism."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import tarfile
import time
import zlib
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageOps

from mmtok.cli import main as cli
from mmtok.errors import MmtokError
from mmtok.formats.manifest import COLUMNS, Manifest, MemberReader
from mmtok.scan.scanner import ScanOptions, describe, document_order, run_scan
from realmedia import mate_photos, skimage_images

REPO = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------------------ test media


def encode(image: Image.Image, fmt: str, **kwargs) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kwargs)
    return out.getvalue()


def orientation_exif(value: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = value
    return exif.tobytes()


@pytest.fixture(scope="session")
def media() -> list[tuple[str, bytes]]:
    """(extension, bytes) of real photos in each format, small enough for fast tests."""
    sources = [p for p in skimage_images() if p.name in ("astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg",
                                                         "camera.png", "horse.png", "hubble_deep_field.jpg")]
    sources += [p for p in mate_photos() if p.name in ("Aqua.jpg", "LadyBird.jpg", "Flow.png")]
    items = []
    for k, path in enumerate(sources):
        with Image.open(path) as image:
            image.draft("RGB", (400, 400))
            image = ImageOps.exif_transpose(image)
            image.thumbnail((240, 240))
            rgb = image.convert("RGB")
        items += [
            ("jpg", encode(rgb, "JPEG", exif=orientation_exif(k % 8 + 1))),
            ("jpg", encode(rgb, "JPEG", progressive=True)),
            ("png", encode(image, "PNG", compress_level=1)),
            ("webp", encode(rgb, "WEBP", quality=70)),
        ]
    items += [("gif", encode(rgb.quantize(32, method=Image.Quantize.FASTOCTREE), "GIF")),
              ("bmp", encode(rgb, "BMP")), ("tif", encode(rgb, "TIFF"))]
    return items


def pil_size(data: bytes) -> tuple[int, int]:
    with Image.open(io.BytesIO(data)) as image:
        return ImageOps.exif_transpose(image).size


def add(tar: tarfile.TarFile, name: str, data: bytes, **fields) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    for key, value in fields.items():
        setattr(info, key, value)
    tar.addfile(info, io.BytesIO(data))


def write_tar(path: Path, members: list[tuple[str, bytes]], fmt=tarfile.GNU_FORMAT, **kwargs) -> Path:
    with tarfile.open(path, "w", format=fmt, **kwargs) as tar:
        for name, data in members:
            add(tar, name, data)
    return path


def webdataset_members(media, prefix: str = "", start: int = 0) -> list[tuple[str, bytes]]:
    members = []
    for k, (ext, data) in enumerate(media):
        key = f"{prefix}{start + k:06d}"
        members += [(f"{key}.{ext}", data), (f"{key}.txt", f"caption {start + k}".encode())]
        if k % 3 == 0:
            members.append((f"{key}.json", json.dumps({"id": start + k}).encode()))
    return members


def scan(tmp_path: Path, shards: list[Path], workers: int = 1, name: str = "out", **options) -> tuple[Path, list[dict]]:
    out = tmp_path / name
    run_scan([describe(str(p)) for p in shards], out, ScanOptions(**options), workers=workers, progress=False)
    return out, Manifest.open(out).read().to_pylist()


def member_bytes(row: dict) -> bytes:
    with open(row["tar"], "rb") as handle:
        handle.seek(row["offset"])
        return handle.read(row["size"])


# --------------------------------------------------------------------------- exact on real images


@pytest.mark.parametrize("fmt", [tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT],
                         ids=["gnu", "pax", "ustar"])
def test_rows_locate_every_member_and_match_pil(tmp_path, media, fmt):
    prefix = "shards/part-a/" + "d" * 60 + "/"  # 127-char names: GNU `L`, pax `path`, ustar prefix
    members = webdataset_members(media, prefix)
    shard = write_tar(tmp_path / "s.tar", members, fmt=fmt)
    _out, rows = scan(tmp_path, [shard])
    images = [(n, d) for n, d in members if not n.endswith((".txt", ".json"))]
    assert [r["member"] for r in rows] == [n for n, _ in images]
    for row, (name, data) in zip(rows, images, strict=True):
        assert row["status"] == "ok" and row["reason"] == "", row
        assert member_bytes(row) == data
        assert (row["width"], row["height"]) == pil_size(data), name
        assert row["key"] == name.rsplit(".", 1)[0] and row["container"] == "tar"
    assert [r["document"] for r in rows] == list(range(len(rows)))


def test_sidecar_offsets_read_back_the_caption_and_json(tmp_path, media):
    shard = write_tar(tmp_path / "s.tar", webdataset_members(media[:6]))
    _out, rows = scan(tmp_path, [shard])
    reader = MemberReader()
    for k, row in enumerate(rows):
        text = reader.read_text("tar", row["tar"], row["text_offset"], row["text_size"], None)
        assert text == f"caption {k}".encode()
        with open(row["tar"], "rb") as handle:
            handle.seek(row["text_offset"])
            assert handle.read(row["text_size"]) == f"caption {k}".encode()
            if k % 3 == 0:
                handle.seek(row["json_offset"])
                assert json.loads(handle.read(row["json_size"])) == {"id": k}
            else:
                assert (row["json_offset"], row["json_size"]) == (-1, -1)


def test_multi_image_documents_share_an_id_in_image_order(tmp_path, media):
    jpg, png, webp = media[0][1], media[2][1], media[3][1]
    listed = {"texts": ["intro", None, "middle", None], "images": [None, "b.webp", None, "doc2.png"]}
    shard = write_tar(tmp_path / "s.tar", [
        ("doc1.2.jpg", jpg), ("doc1.0.png", png), ("doc1.1.webp", webp), ("doc1.txt", b"caption"),
        ("doc2.png", png), ("doc2.b.webp", webp), ("doc2.json", json.dumps(listed).encode()),
        ("doc3.jpg", jpg),
    ])
    _out, rows = scan(tmp_path, [shard])
    got = [(r["member"], r["document"], r["image_index"]) for r in rows]
    assert got == [("doc1.2.jpg", 0, 2), ("doc1.0.png", 0, 0), ("doc1.1.webp", 0, 1),
                   ("doc2.png", 1, 1), ("doc2.b.webp", 1, 0), ("doc3.jpg", 2, 0)]
    assert {r["text_size"] for r in rows[:3]} == {7}


def test_document_order_rules():
    members = ["dir/k.b.jpg", "dir/k.10.jpg", "dir/k.2.jpg", "dir/k.a.jpg"]
    assert document_order(members, "dir/k", None) == [3, 1, 0, 2]  # numbers first, then names
    # json entries name a member by its part after the key, its base name or its full name
    listed = json.dumps({"images": ["a.jpg", None, "k.b.jpg"]}).encode()
    assert document_order(members, "dir/k", listed) == [1, 3, 2, 0]
    assert document_order(members, "dir/k", b"{not json") == [3, 1, 0, 2]


def test_sft_content_parts_name_the_image_order(tmp_path, media):
    png = media[2][1]
    parts = [{"type": "image_url", "image_url": "1.png"}, {"type": "text", "text": " then "},
             {"type": "image_url", "image_url": {"url": "0.png"}}]
    conversation = {"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "ok"}]}
    shard = write_tar(tmp_path / "s.tar", [("KEY.0.png", png), ("KEY.1.png", png),
                                             ("KEY.json", json.dumps(conversation).encode())])
    _out, rows = scan(tmp_path, [shard])
    assert {r["member"]: r["image_index"] for r in rows} == {"KEY.0.png": 1, "KEY.1.png": 0}
    # the Apertus `parts` form names members the same way; an unreadable conversation keeps the numeric order
    members = ["KEY.0.png", "KEY.1.png"]
    apertus = {"messages": [{"role": "user", "content": {"parts": [{"type": "image", "image": "KEY.1.png"},
                                                                   {"type": "image", "image": "0.png"}]}}]}
    assert document_order(members, "KEY", json.dumps(apertus).encode()) == [1, 0]
    unknown = {"messages": [{"role": "user", "content": [{"type": "video", "video": "1.png"}]}]}
    assert document_order(members, "KEY", json.dumps(unknown).encode()) == [0, 1]


# ------------------------------------------------------------------------------------- damage


def png_with_size(width: int, height: int) -> bytes:
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = b"IDAT" + zlib.compress(b"\x00" * 64)
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
            + struct.pack(">I", len(idat) - 4) + idat + struct.pack(">I", zlib.crc32(idat)) + bytes(12))


def header_offsets(path: Path) -> list[int]:
    with tarfile.open(path) as tar:
        return [m.offset for m in tar.getmembers()]


def reasons(rows: list[dict]) -> list[tuple[str, str]]:
    return [(r["member"], r["reason"]) for r in rows]


def test_bad_members_get_named_rows_and_the_rest_stays_ok(tmp_path, media):
    jpg = media[0][1]
    shard = write_tar(tmp_path / "s.tar", [
        ("a.jpg", jpg),
        ("b.jpg", os.urandom(5000)),                  # garbage bytes
        ("c.png", b""),                               # zero-size member
        ("d.png", png_with_size(100_000, 100_000)),   # absurd header
        ("e.png", png_with_size(0, 10)),
        ("f.jpg", jpg[:jpg.find(b"\xff\xdb") + 20]),  # image cut inside its tables, before the frame header
        ("g.heic", b"ignored format"),
        ("h.jpg", jpg),
    ])
    out, rows = scan(tmp_path, [shard])
    assert reasons(rows) == [("a.jpg", ""), ("b.jpg", "unknown_format"), ("c.png", "zero_size"),
                             ("d.png", "absurd_dimensions"), ("e.png", "zero_dimensions"),
                             ("f.jpg", "truncated_image_header"), ("h.jpg", "")]
    assert (rows[3]["width"], rows[3]["height"], rows[3]["format"]) == (100_000, 100_000, "png")
    meta = Manifest.open(out).metadata
    assert meta.reasons == {"absurd_dimensions": 1, "truncated_image_header": 1, "unknown_format": 1,
                               "zero_dimensions": 1, "zero_size": 1}
    assert meta.images_ok == 2 and meta.ignored_members == {"(sample without image)": 1, "heic": 1}


def test_truncated_tar_keeps_everything_before_the_damage(tmp_path, media):
    members = [(f"{k:03d}.{ext}", data) for k, (ext, data) in enumerate(media[:5])]
    full = write_tar(tmp_path / "full.tar", members)
    offsets = header_offsets(full)
    data = full.read_bytes()
    mid_header = tmp_path / "mid_header.tar"
    mid_header.write_bytes(data[:offsets[3] + 100])
    mid_member = tmp_path / "mid_member.tar"
    mid_member.write_bytes(data[:offsets[3] + 512 + 200])
    no_end = tmp_path / "no_end.tar"
    no_end.write_bytes(data[:offsets[3]])
    _out, rows = scan(tmp_path, [mid_header, mid_member, no_end])
    by_tar = {}
    for row in rows:
        by_tar.setdefault(Path(row["tar"]).name, []).append((row["member"], row["status"], row["reason"]))
    ok3 = [(n, "ok", "") for n, _ in members[:3]]
    assert by_tar["mid_header.tar"] == ok3 + [("", "error", "truncated_tar")]
    assert by_tar["mid_member.tar"] == ok3 + [(members[3][0], "error", "truncated_member")]
    assert by_tar["no_end.tar"] == ok3 + [("", "error", "truncated_tar")]
    truncated = [r for r in rows if r["reason"] == "truncated_tar"]
    assert [r["offset"] for r in truncated] == [offsets[3], offsets[3]]


def test_corrupt_header_checksum_is_named_and_the_scan_resyncs(tmp_path, media):
    members = [(f"{k:03d}.{ext}", data) for k, (ext, data) in enumerate(media[:5])]
    shard = write_tar(tmp_path / "s.tar", members)
    offsets = header_offsets(shard)
    data = bytearray(shard.read_bytes())
    data[offsets[2] + 5] ^= 0x20  # a flipped bit in the third member's name
    shard.write_bytes(bytes(data))
    _out, rows = scan(tmp_path, [shard])
    assert reasons(rows) == [(members[0][0], ""), (members[1][0], ""), ("", "corrupt_header"),
                             (members[3][0], ""), (members[4][0], "")]
    assert rows[2]["offset"] == offsets[2]
    assert [r["document"] for r in rows] == [0, 1, 2, 3, 4]


def test_garbage_and_empty_and_missing_shards_do_not_stop_the_run(tmp_path, media):
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(os.urandom(64 * 1024))
    empty = tmp_path / "empty.tar"
    empty.write_bytes(b"")
    good = write_tar(tmp_path / "good.tar", [("a.jpg", media[0][1])])
    out, rows = scan(tmp_path, [garbage, empty, tmp_path / "missing.tar", good])
    assert [(Path(r["tar"]).name, r["reason"]) for r in rows] == [
        ("garbage.tar", "not_a_tar"), ("empty.tar", "empty_file"), ("missing.tar", "unreadable_shard"),
        ("good.tar", "")]
    records = list(Manifest.open(out).skip_records())
    assert [(r.reason, r.position, r.stage) for r in records] == [
        ("not_a_tar", 0, "scan"), ("empty_file", 1, "scan"), ("unreadable_shard", 2, "scan")]
    assert "FileNotFoundError" in records[2].detail


def test_every_error_row_is_a_skip_record_in_skipped_jsonl_verified_before_use(tmp_path, media):
    """Issue 47.3: the scan names what it skipped in the schema of every other stage (`mmtok.formats.skips`), one
    record per error row: an image that is no image (a sample's row) and a file that is no tar (a shard's row,
    with its detail). manifest.json records their count and the file's sha256; a changed file is refused."""
    good = write_tar(tmp_path / "good.tar", [("a.jpg", media[0][1]), ("b.jpg", b"not an image" * 10),
                                              ("c.jpg", media[1][1])])
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"url,caption\n" * 100)
    out, rows = scan(tmp_path, [good, garbage])
    manifest = Manifest.open(out)
    records = list(manifest.skip_records())
    assert [(r.position, r.key, r.source, r.member, r.reason) for r in records] == [
        (i, row["key"], row["tar"], row["member"] or None, row["reason"]) for i, row in enumerate(rows)
        if row["status"] == "error"]
    assert [(r.key, r.reason) for r in records] == [("b", "unknown_format"), ("", "not_a_tar")]
    assert all(r.stage == "scan" and r.container == "tar" for r in records)
    assert records[0].detail == "" and records[1].detail.startswith("text, not a tar")
    meta = manifest.metadata
    assert meta.skipped == meta.errors == 2 and meta.shard_errors is None and "shard_errors" not in meta.to_json()
    assert meta.skipped_sha256 == hashlib.sha256((out / "skipped.jsonl").read_bytes()).hexdigest()
    # A manifest of version 2 (manifest.json's shard_errors, no skipped.jsonl) is still read, as the same records.
    old = tmp_path / "v2"
    shutil.copytree(out, old)
    (old / "skipped.jsonl").unlink()
    v2 = {key: value for key, value in meta.to_json().items() if key not in ("skipped", "skipped_sha256")}
    v2.update(format_version=2, shard_errors=[{"reason": "not_a_tar", "offset": 0, "member": "",
                                               "detail": records[1].detail, "path": str(garbage)}])
    (old / "manifest.json").write_text(json.dumps(v2))
    assert list(Manifest.open(old).skip_records()) == records
    v2["shard_errors"] += [["not", "an", "entry"], {"path": [], "member": "", "offset": 0, "reason": "x"}]
    (old / "manifest.json").write_text(json.dumps(v2))  # entries of other shapes add no detail, and raise nothing
    assert list(Manifest.open(old).skip_records()) == records
    # a skip file changed after the scan is refused, naming it
    path = out / "skipped.jsonl"
    path.write_bytes(path.read_bytes().replace(b"unknown_format", b"unknown_formax"))
    with pytest.raises(MmtokError, match="skipped.jsonl changed after it was written"):
        manifest.skip_records()


def test_a_skipped_jsonl_the_scan_did_not_write_is_never_replaced(tmp_path, media):
    # another stage's output (`mmtok hash`, `mmtok pack`: a skipped.jsonl and their .lock) is no scan's
    good = write_tar(tmp_path / "good.tar", [("a.jpg", media[0][1])])
    theirs = tmp_path / "out" / "skipped.jsonl"
    theirs.parent.mkdir()
    theirs.write_text("their notes\n")
    (tmp_path / "out" / ".lock").write_text("")
    with pytest.raises(MmtokError, match="which `mmtok scan` did not write"):
        scan(tmp_path, [good])
    assert theirs.read_text() == "their notes\n"
    assert sorted(p.name for p in theirs.parent.iterdir()) == [".lock", "skipped.jsonl"]


def test_a_damaged_manifest_json_of_the_scan_is_rewritten_and_one_that_is_no_file_refused(tmp_path, media):
    good = write_tar(tmp_path / "good.tar", [("a.jpg", media[0][1])])
    out, _ = scan(tmp_path, [good])
    meta = out / "manifest.json"
    meta.write_text(meta.read_text()[:40])  # cut short (a full disk): the reader asks for a rerun, which works
    with pytest.raises(MmtokError, match="rerun `mmtok scan`"):
        Manifest.open(out)
    scan(tmp_path, [good])
    assert Manifest.open(out).metadata.images_ok == 1
    meta.unlink()
    os.mkfifo(meta)  # never opened to be read (it would block), never replaced
    with pytest.raises(MmtokError, match="manifest.json is not a manifest .* wrote"):
        scan(tmp_path, [good])
    assert stat.S_ISFIFO(os.lstat(meta).st_mode)
    meta.unlink()
    scan(tmp_path, [good])
    skipped = out / "skipped.jsonl"
    skipped.unlink()
    os.mkfifo(skipped)  # a store another stage wrote is verified without blocking on it
    with pytest.raises(MmtokError, match="skipped.jsonl: .*not a regular file"):
        Manifest.open(out).skip_records()
    skipped.unlink()
    skipped.write_bytes(b"")
    broken = json.loads(meta.read_text())
    del broken["skipped_sha256"]
    meta.write_text(json.dumps(broken))
    with pytest.raises(MmtokError, match="manifest.json: no key 'skipped_sha256'"):
        Manifest.open(out)


MANIFEST_DAMAGE = [
    (lambda meta: meta["inputs"].append(1), "manifest.json: every entry of key 'inputs' must be an object"),
    (lambda meta: meta["inputs"][0].pop("path"), "manifest.json (inputs[0]): no key 'path'"),
    (lambda meta: meta["inputs"][0].update(identity=None), "manifest.json (inputs[0]): key 'identity' must be an obj"),
    (lambda meta: meta["inputs"][0]["identity"].pop("head"), "manifest.json (inputs[0].identity): no key 'head'"),
    (lambda meta: meta["inputs"][0]["identity"].update(size="3"),
     "manifest.json (inputs[0].identity): key 'size' must be an integer"),
    (lambda meta: meta["options"].update(text_column=5),
     "manifest.json (options): key 'text_column' must be a string or null"),
    (lambda meta: meta.update(options=None), "manifest.json: key 'options' must be an object"),
    (lambda meta: meta.update(fingerprint=7), "manifest.json: key 'fingerprint' must be a string"),
    (lambda meta: meta["reasons"].update(zero_size=-1), "manifest.json (reasons): key 'zero_size' must be >= 0"),
    (lambda meta: meta.update(rows="5"), "manifest.json: key 'rows' must be an integer"),
]


@pytest.mark.parametrize("damage,expected", MANIFEST_DAMAGE, ids=[f"{i}" for i in range(len(MANIFEST_DAMAGE))])
def test_a_manifest_json_of_the_wrong_shape_is_one_line_naming_the_key(tmp_path, media, capsys, damage, expected):
    """manifest.json comes from anyone (plan, hash and encode take a manifest as an argument): every key its
    readers take is checked when it is opened, so a damaged one is a line naming the file and where the key is,
    not a TypeError deep in the stage that reads an input's identity or the caption column."""
    out, _ = scan(tmp_path, [write_tar(tmp_path / "good.tar", [("a.jpg", media[0][1]), ("a.txt", b"a cat")])])
    meta = json.loads((out / "manifest.json").read_text())
    damage(meta)
    (out / "manifest.json").write_text(json.dumps(meta))
    with pytest.raises(MmtokError, match=re.escape(expected)):
        Manifest.open(out)
    capsys.readouterr()
    assert cli(["hash", str(out), "--out", str(tmp_path / "h"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and expected in err, err


def test_a_manifest_json_nested_too_deep_is_one_line(tmp_path, media, capsys):
    out, _ = scan(tmp_path, [write_tar(tmp_path / "good.tar", [("a.jpg", media[0][1])])])
    (out / "manifest.json").write_text('{"format": "mmtok.manifest", "format_version": 3, "inputs": '
                                       + "[" * 100_000 + "]" * 100_000 + "}")
    assert cli(["inspect", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "manifest.json: nested too deep to parse" in err, err


def test_non_utf8_member_names_are_named(tmp_path, media):
    jpg = media[0][1]
    gnu = tmp_path / "gnu.tar"
    with tarfile.open(gnu, "w", format=tarfile.GNU_FORMAT, encoding="latin-1") as tar:
        add(tar, "caf\xe9.jpg", jpg)
        add(tar, "ok.jpg", jpg)
    pax = tmp_path / "pax.tar"
    with tarfile.open(pax, "w", format=tarfile.PAX_FORMAT, errors="surrogateescape") as tar:
        add(tar, "caf\udce9.jpg", jpg)  # written as pax path with hdrcharset=BINARY
    _out, rows = scan(tmp_path, [gnu, pax])
    assert [(r["member"], r["reason"]) for r in rows] == [
        ("caf\\xe9.jpg", "non_utf8_name"), ("ok.jpg", ""), ("caf\\xe9.jpg", "non_utf8_name")]


def test_links_named_like_images_are_not_read(tmp_path, media):
    shard = tmp_path / "s.tar"
    with tarfile.open(shard, "w", format=tarfile.GNU_FORMAT) as tar:
        add(tar, "a.jpg", media[0][1])
        add(tar, "b.jpg", b"", type=tarfile.SYMTYPE, linkname="a.jpg")
    _out, rows = scan(tmp_path, [shard])
    assert reasons(rows) == [("a.jpg", ""), ("b.jpg", "not_a_regular_file")]


# ------------------------------------------------------------------------ parquet / arrow sources


def test_parquet_and_arrow_exports_are_sources(tmp_path, media):
    images = [data for _ext, data in media[:6]]
    struct_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    column = pa.array([{"bytes": d, "path": f"img{k}.x"} for k, d in enumerate(images)] + [None], struct_type)
    texts = pa.array([f"text {k}" for k in range(6)] + [None])
    table = pa.table({"caption": texts, "image": column})
    pq.write_table(table, tmp_path / "hf.parquet", row_group_size=4)
    with pa.ipc.new_stream(tmp_path / "hf.arrow", table.schema) as writer:  # datasets.save_to_disk layout
        writer.write_table(table)
    raw = tmp_path / "raw.parquet"
    pq.write_table(pa.table({"jpeg": pa.array(images, pa.binary())}), raw)
    out, rows = scan(tmp_path, [tmp_path / "hf.parquet", tmp_path / "hf.arrow"], text_column="caption")
    reader = MemberReader()
    assert [i.file_format for i in Manifest.open(out).metadata.inputs] == ["parquet", "arrow"]
    for name in ("hf.parquet", "hf.arrow"):
        got = [r for r in rows if r["tar"].endswith(name)]
        assert {r["container"] for r in got} == {"parquet"}
        assert [r["offset"] for r in got] == list(range(7))
        assert [r["reason"] for r in got] == [""] * 6 + ["missing_image"]
        for row, data in zip(got, images, strict=False):  # the 7th row (no image) has no data: checked above
            assert row["member"] == "image" and row["key"].startswith("img")
            assert (row["width"], row["height"]) == pil_size(data)
            assert row["text_size"] == len(f"text {row['offset']}")
            assert reader.read_member(row["container"], row["tar"], row["member"], row["offset"], row["size"]) == data
            caption = reader.read_text(row["container"], row["tar"], row["text_offset"], row["text_size"], "caption")
            assert caption == f"text {row['offset']}".encode()
    _out, raw_rows = scan(tmp_path, [raw], name="raw", image_column="jpeg")
    assert [(r["member"], r["key"], r["reason"]) for r in raw_rows] == [("jpeg", str(k), "") for k in range(6)]


def test_parquet_without_an_image_column_gets_a_shard_error(tmp_path):
    pq.write_table(pa.table({"text": ["a", "b"]}), tmp_path / "t.parquet")
    _out, rows = scan(tmp_path, [tmp_path / "t.parquet"])
    assert reasons(rows) == [("", "no_image_column")]


# --------------------------------------------------------------------- determinism and restarts


@pytest.fixture()
def shards(tmp_path, media) -> list[Path]:
    directory = tmp_path / "shards"
    directory.mkdir()
    paths = []
    for s in range(6):
        members = webdataset_members(media[s::3], start=100 * s)
        paths.append(write_tar(directory / f"shard-{s:03d}.tar", members))
    broken = directory / "shard-006.tar"
    broken.write_bytes(paths[0].read_bytes()[:20_000])
    return paths + [broken]


def test_manifest_bytes_do_not_depend_on_worker_count(tmp_path, shards):
    one, rows = scan(tmp_path, shards, workers=1, name="one")
    two, _ = scan(tmp_path, shards, workers=2, name="two")
    assert (one / "manifest.parquet").read_bytes() == (two / "manifest.parquet").read_bytes()
    docs = [r["document"] for r in rows]
    assert docs == sorted(docs) and rows[-1]["reason"] in ("truncated_member", "truncated_tar")
    meta = Manifest.open(one).metadata
    assert meta.fingerprint == Manifest.open(two).verify()
    assert meta.rows == len(rows) and meta.shards == 7
    assert Manifest.open(one).read(columns=["width", "status"]).column_names == ["width", "status"]
    assert pq.ParquetFile(one / "manifest.parquet").schema_arrow.names == list(COLUMNS)


def test_rescan_after_partial_cache_gives_identical_bytes(tmp_path, shards):
    out, _ = scan(tmp_path, shards)
    reference = (out / "manifest.parquet").read_bytes()
    cache = sorted((out / ".scan-cache").glob("*.arrow"))
    assert len(cache) == len(shards)
    for path in cache[::2]:  # as if the run had been killed after the other shards finished
        path.unlink()
    (out / "manifest.json").unlink()
    (out / "manifest.parquet").unlink()
    run = run_scan([describe(str(p)) for p in shards], out, ScanOptions(), workers=2, progress=False).run
    assert run.cached_shards == len(shards) - len(cache[::2])
    assert (out / "manifest.parquet").read_bytes() == reference


def test_changed_shard_is_rescanned(tmp_path, shards, media):
    out, _ = scan(tmp_path, shards)
    write_tar(shards[1], [("only.jpg", media[0][1])])
    os.utime(shards[1], ns=(time.time_ns(), time.time_ns() + 10**9))
    run = run_scan([describe(str(p)) for p in shards], out, ScanOptions(), workers=1, progress=False).run
    assert run.scanned_shards == 1
    assert "only.jpg" in Manifest.open(out).read(columns=["member"]).column("member").to_pylist()
    assert len(list((out / ".scan-cache").glob("*.arrow"))) == len(shards)  # the stale entry was pruned


def test_killed_scan_resumes_to_identical_bytes(tmp_path, media):
    directory = tmp_path / "many"
    directory.mkdir()
    for s in range(60):
        write_tar(directory / f"{s:03d}.tar", webdataset_members(media[s % 5::5], start=100 * s))
    reference, _ = scan(tmp_path, sorted(directory.glob("*.tar")), name="reference")
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "mmtok", "scan", str(directory / "*.tar"), "--out", str(out),
               "--workers", "1", "--no-progress"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cache = out / ".scan-cache"
    deadline = time.monotonic() + 120
    while process.poll() is None and time.monotonic() < deadline:
        if len(list(cache.glob("*.arrow"))) >= 3:
            process.kill()
            break
        time.sleep(0.005)
    process.wait()
    finished_before_kill = (out / "manifest.json").exists()
    resumed = subprocess.run(command, capture_output=True, text=True, check=True)
    assert (out / "manifest.parquet").read_bytes() == (reference / "manifest.parquet").read_bytes()
    if not finished_before_kill:
        assert "from cache" in resumed.stderr and "(0 from cache)" not in resumed.stderr


# ------------------------------------------------------------------------------------------ CLI


def test_cli_expands_globs_and_shard_lists_in_order(tmp_path, shards, capsys):
    listing = tmp_path / "shards" / "list.txt"
    listing.write_text("# the broken one last\nshard-00[45].tar\n\nshard-006.tar\n")
    out = tmp_path / "cli"
    assert cli(["scan", str(tmp_path / "shards" / "shard-00[0-3].tar"), "--shard-list", str(listing),
                "--out", str(out), "--workers", "2", "--no-progress"]) == 0
    inputs = [Path(i.path).name for i in Manifest.open(out).metadata.inputs]
    assert inputs == [f"shard-{s:03d}.tar" for s in range(7)]
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("mmtok scan: 7 shards (0 from cache),") and "images ok" in summary


def test_cli_refuses_unusable_inputs_with_a_fix(tmp_path, shards, capsys):
    assert cli(["scan", str(tmp_path / "nothing-*.tar"), "--out", str(tmp_path / "o")]) == 2
    assert "matches no file" in capsys.readouterr().err
    assert cli(["scan", str(shards[0]), str(shards[0]), "--out", str(tmp_path / "o")]) == 2
    assert "given twice" in capsys.readouterr().err


def test_reading_an_incomplete_manifest_names_the_fix(tmp_path, shards):
    out, _ = scan(tmp_path, shards[:1])
    table = Manifest.open(out).read()
    pq.write_table(table.slice(1), out / "manifest.parquet")
    with pytest.raises(MmtokError, match="changed after the scan"):
        Manifest.open(out).verify()
    (out / "manifest.json").unlink()
    with pytest.raises(MmtokError, match="run `mmtok scan"):
        Manifest.open(out).read()


def test_img2dataset_sidecars_a_glob_picks_up_are_skipped_and_a_stray_file_is_named(tmp_path, capsys):
    """Issue 49.5: `mmtok scan out/*` over img2dataset's output (NNNNN.tar, NNNNN.parquet of metadata,
    NNNNN_stats.json) and a urls.csv: the sidecars are skipped with a count, the csv is `not_a_tar` saying
    what it is (was `truncated_tar` with an empty detail)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from encodekit import real_images, write_tar
    from mmtok.cli import main

    out = tmp_path / "out"
    out.mkdir()
    photo = real_images()["chelsea.png"].read_bytes()
    write_tar(out / "00000.tar", [("000000000.png", photo), ("000000000.txt", b"a cat"),
                                  ("000000000.json", b'{"key": "000000000"}')])
    pq.write_table(pa.table({"key": ["000000000"], "url": ["http://example.org/a.png"], "status": ["success"]}),
                   out / "00000.parquet")
    (out / "00000_stats.json").write_text(json.dumps({"count": 1, "successes": 1}))
    (tmp_path / "urls.csv").write_text("url,caption\nhttp://example.org/a.png,a cat\n")
    assert main(["scan", str(out / "*"), str(tmp_path / "urls.csv"), "--out", str(tmp_path / "m"), "--workers", "1",
                 "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "skipped 2 sidecar files a producer writes beside its shards" in err and "00000_stats.json" in err
    meta = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert meta["images_ok"] == 1 and meta["reasons"] == {"not_a_tar": 1}
    [error] = Manifest.open(tmp_path / "m").skip_records()
    assert error.source.endswith("urls.csv")
    assert error.detail.startswith("text, not a tar (it begins 'url,caption')")


def test_image_cells_that_hold_only_a_path_are_named_path_only_cell(tmp_path, capsys):
    """Issue 49.1: Hugging Face's `Dataset.to_parquet()` of images loaded from local files keeps {bytes: null,
    path} cells (the `Image` feature's struct, written here with pyarrow): named `path_only_cell` (docs/scan.md
    says how to embed the bytes), not the silent `missing_image`."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmtok.cli import main

    cells = pa.array([{"bytes": None, "path": "photos/a.jpg"}, {"bytes": None, "path": None}],
                     pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.table({"image": cells, "text": ["a", "b"]}), tmp_path / "train.parquet")
    assert main(["scan", str(tmp_path / "train.parquet"), "--out", str(tmp_path / "m"), "--workers", "1",
                 "--no-progress"]) == 2
    assert "path_only_cell 1" in capsys.readouterr().err
    assert json.loads((tmp_path / "m" / "manifest.json").read_text())["reasons"] == {"missing_image": 1,
                                                                                     "path_only_cell": 1}


def test_keys_with_dots_that_merge_samples_are_a_counted_warning(tmp_path, capsys):
    """Issue 49.4: `laion.v2.000001.jpg` is sample `laion` (WebDataset's rule: the key ends at the first dot),
    so two images and two captions become one sample; the second caption was counted as an ignored `txt`
    with no word. It is its own counted entry now, and the summary warns with the likely cause."""
    import json

    from encodekit import real_images, write_tar
    from mmtok.cli import main

    photo = real_images()["chelsea.png"].read_bytes()
    tar = write_tar(tmp_path / "dots.tar", [("laion.v2.000001.png", photo), ("laion.v2.000001.txt", b"a cat"),
                                            ("laion.v2.000002.png", photo), ("laion.v2.000002.txt", b"the cat")])
    assert main(["scan", str(tar), "--out", str(tmp_path / "m"), "--workers", "1", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 caption beyond a sample's first went unused" in err and "sample `laion`" in err
    assert "1 sample holds several images named past the key's first dot (first: sample `laion` with " \
           "laion.v2.000001.png, laion.v2.000002.png)" in err
    meta = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert meta["documents"] == 1 and meta["ignored_members"] == {"(second caption of one sample)": 1}
