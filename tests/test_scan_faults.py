"""`mmtok scan` under real operating conditions: damaged size fields, compressed shards, inputs
without a single image, an output that cannot be written."""

from __future__ import annotations

import errno
import io
import tarfile
from pathlib import Path

import pytest

import mmtok.fsutil
from mmtok.cli import main as cli
from mmtok.formats.manifest import Manifest
from mmtok.scan.scanner import ScanOptions, describe, run_scan
from realmedia import skimage_images
from tarkit import SIZE_FIELD, with_header_field


@pytest.fixture(scope="module")
def jpg() -> bytes:
    """A real photo (scikit-image's rocket.jpg)."""
    return next(p for p in skimage_images() if p.name == "rocket.jpg").read_bytes()


def tar_bytes(members: list[tuple[str, bytes, dict]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    """A tar of (name, data, pax records) members; the ustar size field holds len(data)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tar:
        for name, data, pax in members:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.pax_headers = len(data), 1_700_000_000, pax
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def header_offsets(data: bytes) -> list[int]:
    """Offset of each member's own ustar header (after its pax header, if any)."""
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return [m.offset_data - 512 for m in tar.getmembers()]


def scan_rows(tmp_path: Path, shards: list[Path]) -> tuple[list[tuple], dict]:
    out = tmp_path / "out"
    run_scan([describe(str(p)) for p in shards], out, ScanOptions(), workers=1, progress=False)
    rows = [(r["member"], r["size"], r["status"], r["reason"]) for r in Manifest.open(out).read().to_pylist()]
    return rows, Manifest.open(out).metadata


def shard_errors(out: Path) -> list:
    """The skip records of the manifest's shard-level error rows (no sample key)."""
    return [record for record in Manifest.open(out).skip_records() if not record.key]


# ------------------------------------------------------------------------------ size fields


@pytest.mark.parametrize("record", ["1e23", "1" + "0" * 30, "9" * 5000, "-5", " 12"],
                         ids=["float", "above-int64", "5000-digits", "negative", "space"])
def test_unusable_pax_size_is_a_member_reason_and_the_walk_goes_on_with_the_ustar_size(tmp_path, jpg, record):
    shard = tmp_path / "s.tar"
    shard.write_bytes(tar_bytes([("a.jpg", jpg, {}), ("b.jpg", jpg, {"size": record}), ("c.jpg", jpg, {})]))
    rows, meta = scan_rows(tmp_path, [shard])
    n = len(jpg)
    # GNU tar's rule: an unusable pax size falls back to the ustar field, which locates c.jpg.
    assert rows == [("a.jpg", n, "ok", ""), ("b.jpg", n, "error", "bad_member_size"), ("c.jpg", n, "ok", "")]
    assert meta.reasons == {"bad_member_size": 1}


@pytest.mark.parametrize("field", [b"\x80" + (1 << 80).to_bytes(11, "big"), b"\xff" * 12, b"-0000000001\x00"],
                         ids=["base256-2^80", "base256-negative", "octal-negative"])
def test_unusable_ustar_size_keeps_the_members_before_and_resyncs_to_the_next_header(tmp_path, jpg, field):
    data = tar_bytes([("a.jpg", jpg, {}), ("b.jpg", jpg, {}), ("c.jpg", jpg, {})], tarfile.GNU_FORMAT)
    b_header = header_offsets(data)[1]
    shard = tmp_path / "s.tar"
    shard.write_bytes(with_header_field(data, b_header, SIZE_FIELD, field))
    rows, _ = scan_rows(tmp_path, [shard])
    errors = shard_errors(tmp_path / "out")
    n = len(jpg)
    assert rows == [("a.jpg", n, "ok", ""), ("b.jpg", 0, "error", "bad_member_size"), ("c.jpg", n, "ok", "")]
    [error] = errors
    assert (error.reason, error.member, error.position, error.source) == ("bad_member_size", "b.jpg", 1, str(shard))
    assert Manifest.open(tmp_path / "out").read(["offset"]).column(0)[1].as_py() == b_header
    assert "size field" in error.detail


def test_unusable_pax_and_ustar_sizes_stop_at_the_member_and_resync(tmp_path, jpg):
    data = tar_bytes([("a.jpg", jpg, {}), ("b.jpg", jpg, {"size": "1e23"}), ("c.jpg", jpg, {})])
    b_header = header_offsets(data)[1]
    shard = tmp_path / "s.tar"
    shard.write_bytes(with_header_field(data, b_header, SIZE_FIELD, b"\xff" * 12))
    rows, _ = scan_rows(tmp_path, [shard])
    errors = shard_errors(tmp_path / "out")
    assert [r[0::3] for r in rows] == [("a.jpg", ""), ("b.jpg", "bad_member_size"), ("c.jpg", "")]
    assert "pax size=b'1e23'" in errors[0].detail


# ------------------------------------------------------------------------------ compressed


@pytest.mark.parametrize("mode,command", [("w:gz", "gunzip"), ("w:bz2", "bunzip2"), ("w:xz", "unxz")])
def test_compressed_tar_gets_its_own_reason_with_the_fix(tmp_path, jpg, mode, command):
    packed = tmp_path / "s.tar.x"
    with tarfile.open(packed, mode) as tar:
        info = tarfile.TarInfo("a.jpg")
        info.size = len(jpg)
        tar.addfile(info, io.BytesIO(jpg))
    good = tmp_path / "good.tar"
    good.write_bytes(tar_bytes([("a.jpg", jpg, {})]))
    rows, _ = scan_rows(tmp_path, [packed, good])
    errors = shard_errors(tmp_path / "out")
    assert [r[0::3] for r in rows] == [("", "compressed_tar"), ("a.jpg", "")]
    assert command in errors[0].detail and "uncompressed" in errors[0].detail


# ------------------------------------------------------------------------------ exit status


def no_image_inputs(tmp_path: Path, jpg: bytes) -> dict[str, tuple[Path, str]]:
    """Inputs that yield no image, with the words the error must contain."""
    folder = tmp_path / "shards"
    folder.mkdir()
    photo = tmp_path / "photo.jpg"
    photo.write_bytes(jpg)
    packed = tmp_path / "s.tar.gz"
    with tarfile.open(packed, "w:gz") as tar:
        tar.addfile(tarfile.TarInfo("empty.txt"), io.BytesIO(b""))
    captions = tmp_path / "captions.tar"
    captions.write_bytes(tar_bytes([("a.txt", b"a caption", {})]))
    return {
        "typo": (tmp_path / "shard-0001.tar", "No such file"),
        "directory": (folder, "pass the shards inside it"),
        "image": (photo, "a jpeg image, not a container"),
        "compressed": (packed, "gunzip"),
        "no-image-members": (captions, "sample without image"),
    }


@pytest.mark.parametrize("case", ["typo", "directory", "image", "compressed", "no-image-members"])
def test_scan_exits_2_saying_what_and_why_only_when_no_input_yields_an_image(tmp_path, jpg, capsys, case):
    path, words = no_image_inputs(tmp_path, jpg)[case]
    flags = ["--workers", "1", "--no-progress"]
    assert cli(["scan", str(path), "--out", str(tmp_path / "alone"), *flags]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("mmtok scan: error: no image found in 1 input(s)")
    assert str(path) in line or case == "no-image-members"
    assert words in line
    good = tmp_path / "good.tar"
    good.write_bytes(tar_bytes([("a.jpg", jpg, {})]))
    assert cli(["scan", str(path), str(good), "--out", str(tmp_path / "mixed"), *flags]) == 0
    assert "1 image ok" in capsys.readouterr().err


# ------------------------------------------------------------------------------ unwritable output


class _FullDisk(io.FileIO):
    """A file on a full disk: it can be created, but no byte can be written to it."""

    def write(self, data) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def _full_disk_open(path, mode="r", *args, **kwargs):
    if "w" in mode:
        return io.BufferedWriter(_FullDisk(path, "w"))
    return open(path, mode, *args, **kwargs)


def _read_only_open(path, mode="r", *args, **kwargs):
    if "w" in mode:
        raise OSError(errno.EROFS, "Read-only file system", str(path))
    return open(path, mode, *args, **kwargs)


@pytest.mark.parametrize("opener,words", [(_full_disk_open, "No space left on device [ENOSPC]"),
                                          (_read_only_open, "Read-only file system [EROFS]")],
                         ids=["full", "read-only"])
def test_unwritable_output_stops_the_scan_with_one_line_and_leaves_no_temporary_file(tmp_path, jpg, capsys,
                                                                                      monkeypatch, opener, words):
    shard = tmp_path / "s.tar"
    shard.write_bytes(tar_bytes([("a.jpg", jpg, {})]))
    monkeypatch.setattr(mmtok.fsutil, "open", opener, raising=False)  # every atomic write of the scan
    out = tmp_path / "out"
    assert cli(["scan", str(shard), "--out", str(out), "--workers", "1", "--no-progress"]) == 2
    # The shard's cache write fails first; that stops the run (not a `scan_failed` row per shard).
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"mmtok scan: error: {out / '.scan-cache'}") and words in line
    # Only the locks remain (the manifest's and the shard's claim; a lock file holds no data and is reused).
    assert [p.name for p in out.rglob("*") if p.is_file() and not p.name.endswith(".lock")] == []
