"""`mmtok hash`: imagehash's pHash bit for bit, named skips, the same bytes for any world size, resume after kill -9."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import imagehash
import numpy as np
import pytest
from PIL import Image

from encodekit import caption_corpus, real_images
from mmtok.cli import main as cli
from mmtok.curate.phash import hex64, image_hashes
from mmtok.formats import skips
from mmtok.formats.hashes import HashTable
from mmtok.fsutil import WriterLock
from realmedia import mate_photos, skimage_images


def _encoded(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def _stored_variants() -> list[tuple[str, bytes]]:
    """Real photos stored in every mode and format the decoder meets, plus the degenerate cases (one pixel, one
    colour: every DCT coefficient but one is 0, so the median ties)."""
    photo = Image.open(real_images()["chelsea.png"]).convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = 6  # hashed as stored, like imagehash given Image.open(...): the orientation is not applied
    camera16 = Image.fromarray(np.asarray(photo.convert("L"), np.uint16) * 257)
    return [("rgb.jpg", _encoded(photo, "JPEG", quality=85)), ("rotated.jpg", _encoded(photo, "JPEG", exif=exif)),
            ("cmyk.jpg", _encoded(photo.convert("CMYK"), "JPEG")), ("gray.png", _encoded(photo.convert("L"), "PNG")),
            ("rgba.png", _encoded(photo.convert("RGBA"), "PNG")), ("la.png", _encoded(photo.convert("LA"), "PNG")),
            ("palette.gif", _encoded(photo.convert("P"), "GIF")), ("bilevel.png", _encoded(photo.convert("1"), "PNG")),
            ("16bit.png", _encoded(camera16, "PNG")), ("rgb.webp", _encoded(photo, "WEBP", quality=80)),
            ("tiny.png", _encoded(photo.resize((1, 1)), "PNG")),
            ("flat.png", _encoded(Image.new("RGB", (64, 48), (90, 120, 30)), "PNG")),
            ("thin.png", _encoded(photo.resize((400, 3)), "PNG"))]


def test_phash_is_bit_identical_to_imagehash_on_real_images():
    files = [(p.name, p.read_bytes()) for p in skimage_images() + mate_photos() if p.name != "multipage_rgb.tif"]
    checked = 0
    for name, data in files + _stored_variants():
        ours, digest = image_hashes(data)
        theirs = str(imagehash.phash(Image.open(io.BytesIO(data))))
        assert hex64(ours) == theirs, name
        assert len(digest) == 32
        checked += 1
    assert checked >= 70


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A scanned manifest of real captioned photos (28 rows, 3 of them damaged images)."""
    root = tmp_path_factory.mktemp("hash-corpus")
    shards = caption_corpus(root / "shards", corrupt=True)
    assert cli(["scan", *map(str, shards), "--out", str(root / "manifest"), "--no-progress"]) == 0
    return root / "manifest"


def _hash(manifest: Path, out: Path, *extra: str) -> int:
    return cli(["hash", str(manifest), "--out", str(out), "--no-progress", "--chunk-rows", "3", *extra])


def _files(out: Path) -> dict[str, bytes]:
    return {name: (out / name).read_bytes() for name in ("hashes.parquet", "skipped.jsonl", "hashes.json")}


@pytest.fixture(scope="module")
def reference(corpus, tmp_path_factory) -> dict[str, bytes]:
    out = tmp_path_factory.mktemp("hash-reference")
    assert _hash(corpus, out, "--workers", "1") == 0
    return _files(out)


def test_table_names_every_image_and_its_counts_add_up(corpus, reference, tmp_path, capsys):
    assert _hash(corpus, tmp_path, "--workers", "2") == 0
    summary = capsys.readouterr().err
    assert "28 manifest rows = 25 hashed + 3 skipped (decode_error 3) + 0 scan error rows" in summary, summary
    table = HashTable.open(tmp_path)
    hashes = table.read()
    records = list(skips.read(tmp_path / "skipped.jsonl"))
    assert len(hashes) == 25 and len(records) == 3
    assert sorted(hashes.manifest_row.tolist() + [r.position for r in records]) == list(range(28))
    assert {r.key for r in records} == {"c000", "c001", "c002"} and {r.stage for r in records} == {"hash"}
    assert all(r.member.endswith((".jpg", ".png")) and r.source.endswith("shard-2.tar") for r in records)
    assert table.algorithm == "phash-imagehash-4.3" and table.source == "manifest"


def test_table_bytes_do_not_depend_on_world_size_or_workers(corpus, reference, tmp_path):
    for world_size, workers in ((2, "2"), (3, "1"), (7, "1")):
        out = tmp_path / f"w{world_size}"
        for rank in reversed(range(world_size)):  # the last rank to finish writes the table
            assert _hash(corpus, out, "--workers", workers, "--rank", str(rank), "--world-size", str(world_size)) == 0
        assert _files(out) == reference, world_size


# The process kills itself (SIGKILL) while it hashes the 7th image: two chunks of 3 are committed, the third is
# claimed and has no commit. Deterministic: no timing involved.
_KILL_AT_SEVENTH_IMAGE = """
import os, signal
import mmtok.curate.hashing as hashing
_hash, _calls = hashing.image_hashes, []
def image_hashes(data):
    _calls.append(1)
    if len(_calls) == 7:
        os.kill(os.getpid(), signal.SIGKILL)
    return _hash(data)
hashing.image_hashes = image_hashes
"""


def test_rerun_after_kill_9_gives_the_same_table(corpus, reference, tmp_path):
    code = f"import sys\n{_KILL_AT_SEVENTH_IMAGE}\nfrom mmtok.cli import main\nsys.exit(main(sys.argv[1:]))"
    args = ["hash", str(corpus), "--out", str(tmp_path), "--no-progress", "--chunk-rows", "3", "--workers", "1"]
    killed = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    commits = sorted(p.name for p in tmp_path.glob(".hash-cache/*/chunk-*.json"))
    assert commits == ["chunk-00000000.json", "chunk-00000001.json"] and not (tmp_path / "hashes.json").exists()
    assert cli(args) == 0
    assert _files(tmp_path) == reference


def test_a_damaged_chunk_is_hashed_again(corpus, reference, tmp_path):
    assert _hash(corpus, tmp_path, "--workers", "1") == 0
    chunk = sorted(tmp_path.glob(".hash-cache/*/chunk-00000004.arrow"))[0]
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    chunk.write_bytes(bytes(data))
    (tmp_path / "hashes.parquet").unlink()
    assert _hash(corpus, tmp_path, "--workers", "1") == 0
    assert _files(tmp_path) == reference


def test_a_claimed_chunk_is_left_to_its_holder(corpus, reference, tmp_path, capsys):
    assert _hash(corpus, tmp_path, "--workers", "1", "--rank", "0", "--world-size", "2") == 0
    cache = next(tmp_path.glob(".hash-cache/*"))
    (cache / "chunk-00000005.json").unlink()  # as if rank 1 were still hashing it...
    with WriterLock(cache, "test", name=".chunk-00000005.lock"):  # ...and held its claim (this process: rank 1's)
        rank = subprocess.run([sys.executable, "-m", "mmtok", "hash", str(corpus), "--out", str(tmp_path),
                               "--no-progress", "--chunk-rows", "3", "--workers", "1", "--rank", "1", "--world-size",
                               "2"], capture_output=True, text=True)
    assert rank.returncode == 0 and "1 chunk left to other ranks" in rank.stderr, rank.stderr
    assert not (tmp_path / "hashes.json").exists() or _files(tmp_path) == reference
    assert _hash(corpus, tmp_path, "--workers", "1") == 0
    assert _files(tmp_path) == reference


def test_a_container_changed_since_the_scan_is_stale_media_not_read(corpus, tmp_path, capsys):
    import shutil

    copy = tmp_path / "corpus"
    shutil.copytree(corpus.parent / "shards", copy / "shards")
    assert cli(["scan", *map(str, sorted((copy / "shards").glob("*.tar"))), "--out", str(copy / "m"),
                "--no-progress"]) == 0
    with open(copy / "shards" / "shard-0.tar", "ab") as handle:
        handle.write(b"\0" * 10240)
    assert _hash(copy / "m", tmp_path / "h", "--workers", "1") == 0
    assert "stale_media" in capsys.readouterr().err
    stale = [r for r in skips.read(tmp_path / "h" / "skipped.jsonl") if r.reason == "stale_media"]
    assert stale and {r.source for r in stale} == {str(copy / "shards" / "shard-0.tar")}
    assert "changed since its scan (size" in stale[0].detail


@pytest.mark.parametrize("case", ["not_a_manifest", "out_is_the_manifest", "changed_manifest", "zero_chunk_rows"])
def test_bad_input_is_one_line_and_exit_2(corpus, tmp_path, capsys, case):
    import shutil

    manifest = tmp_path / "m"
    shutil.copytree(corpus, manifest)
    out, extra = tmp_path / "h", []
    if case == "not_a_manifest":
        manifest = tmp_path / "empty"
        manifest.mkdir()
    elif case == "out_is_the_manifest":
        out = manifest
    elif case == "changed_manifest":
        with open(manifest / "manifest.parquet", "ab") as handle:
            handle.write(b"x")
    else:
        extra = ["--chunk-rows", "0"]
    assert cli(["hash", str(manifest), "--out", str(out), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmtok hash: error: ") and err.count("\n") == 1, err
    assert not (out / "hashes.json").exists()


def test_a_failed_read_is_a_named_skip_not_the_end_of_the_run(corpus, tmp_path, monkeypatch):
    import errno

    from mmtok.curate.hashing import hash_manifest
    from mmtok.formats.manifest import MemberReader

    read = MemberReader.read_member

    def failing(self, container, path, member, offset, size):
        if member == "s003.png":
            raise OSError(errno.EIO, "Input/output error")
        return read(self, container, path, member, offset, size)

    monkeypatch.setattr(MemberReader, "read_member", failing)
    share = hash_manifest(corpus, tmp_path, None, 0, 1, 1, 3, progress=False)
    assert share.table.counts.skipped == {"decode_error": 3, "read_error": 1}
    failed = [r for r in skips.read(tmp_path / "skipped.jsonl") if r.reason == "read_error"]
    assert len(failed) == 1 and failed[0].member == "s003.png" and "Input/output error" in failed[0].detail
