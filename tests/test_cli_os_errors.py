"""OS errors end in one line naming the file, the errno and the fix; no temp file is left; after the
cause is fixed, rerunning the same command resumes and gives the clean run's bytes.

A full disk and a read-only file system are real ones: small tmpfs mounts (root only, as in CI).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from diskkit import fill
from encodekit import planned_job
from mmtok.cli import main
from mmtok.formats.commitlog import read_commits
from mmtok.formats.partdir import part_dir
from mmtok.fsutil import sha256_file

MERGED = ("merged.bin", "merged.idx", "merged.provenance.jsonl", "merged.skipped.jsonl")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("oserrors")
    plan_dir, checkpoint = planned_job(root, corrupt=True)
    encode = ["encode", "--plan", str(plan_dir), "--checkpoint", str(checkpoint), "--device", "cpu",
              "--loader-threads", "1", "--no-progress", "--out"]
    assert main([*encode, str(root / "clean")]) == 0 and main(["merge", str(root / "clean")]) == 0
    return root, encode


PAGES_FREE = 6


def _one_line_error(capsys, *expected: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for text in expected:
        assert text in err, err
    return err


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


def _same_as_clean(out: Path, clean: Path) -> None:
    for name in MERGED:
        assert sha256_file(out / name) == sha256_file(clean / name), name


def test_encode_on_a_full_disk_is_one_line_and_resumes_once_space_is_freed(job, mount, capsys):
    root, encode = job
    fs = mount(1 << 20)
    out = fs.path / "out"
    fill(fs.path, leave=PAGES_FREE * 4096)  # room for a few commits, not for the whole part
    assert main([*encode, str(out)]) == 2
    _one_line_error(capsys, "No space left on device [ENOSPC]", str(out), "rerun the same command", "resume")
    assert not _temp_files(fs.path)
    assert read_commits(part_dir(out, 0))[0], "the disk must fill up mid-run, after some commits"
    (fs.path / "ballast").unlink()
    assert main([*encode, str(out)]) == 0 and main(["merge", str(out)]) == 0
    _same_as_clean(out, root / "clean")


def test_encode_into_a_read_only_file_system_is_one_line(job, mount, capsys):
    _, encode = job
    fs = mount(1 << 20)
    fs.remount("ro")
    assert main([*encode, str(fs.path / "out")]) == 2
    _one_line_error(capsys, "Read-only file system [EROFS]", str(fs.path / "out"))


def test_merge_on_a_full_disk_is_one_line_leaves_no_temp_file_and_reruns(job, mount, capsys):
    root, encode = job
    fs = mount(8 << 20)
    out = fs.path / "out"
    assert main([*encode, str(out)]) == 0
    capsys.readouterr()  # the encode's summary (stderr too): the merge's error is to be its only line
    ballast = fill(fs.path, leave=2 * 4096)  # two pages: the merged files do not fit
    assert main(["merge", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, "No space left on device [ENOSPC]", str(out))
    assert not _temp_files(fs.path) and not (out / "merged.json").exists()
    ballast.unlink()
    assert main(["merge", str(out)]) == 0
    _same_as_clean(out, root / "clean")


def test_scan_into_a_read_only_output_is_one_line_and_leaves_nothing(job, mount, capsys):
    root, _ = job
    fs = mount(1 << 20)
    (fs.path / "manifest").mkdir()
    fs.remount("ro")
    assert main(["scan", str(root / "data" / "*.tar"), "--out", str(fs.path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 2
    _one_line_error(capsys, "Read-only file system")
    assert not list((fs.path / "manifest").iterdir())
