"""Untrusted input, class "outputs" (issue 21 §5, and §4's media bound of `pack`): mmtok never destroys
what it did not write, an --out that overlaps an input is refused before anything is written, a run that
exits non-zero leaves the previous complete output untouched, a full disk ends in one line with no temp
file left, and `pack` streams media under a size bound. Each test builds its own small hostile case.

A full disk is a real one: a small tmpfs (root only, as in CI and tests/test_cli_os_errors.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
from pathlib import Path

import pytest

from encodekit import caption_corpus, chat_tokenizer, real_images, write_tar
from mmtok.cli import main
from mmtok.errors import MmtokError
from mmtok.fsutil import sha256_file


def _turns(content, answer: str = "Noted.") -> list[dict]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]


def _conversations(root: Path, lines: int = 2) -> Path:
    """talk.jsonl: `lines` conversations, each with one real photo referenced by relative path."""
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    (images / "horse.png").write_bytes(real_images()["horse.png"].read_bytes())
    path = root / "talk.jsonl"
    path.write_text("".join(json.dumps({"id": f"c{i}", "images": ["images/horse.png"],
                                        "messages": _turns(f"<image> Picture {i}?", "A horse.")}) + "\n"
                            for i in range(lines)))
    return path


def _scan(inputs: str, out: str) -> int:
    return main(["scan", inputs, "--out", out, "--workers", "1", "--no-progress"])


def _scanned(root: Path) -> Path:
    """A captioned corpus under root/data, scanned into root/manifest."""
    caption_corpus(root / "data")
    assert _scan(str(root / "data" / "*.tar"), str(root / "manifest")) == 0
    return root / "manifest"


def _snapshot(directory: Path) -> dict[str, str]:
    """name -> sha256 of every file under `directory` (the locks excluded: taking one writes its holder line)."""
    return {str(p.relative_to(directory)): sha256_file(p) for p in sorted(directory.rglob("*"))
            if p.is_file() and not p.name.endswith(".lock")}


def _one_line_error(capsys, *expected: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "Exception ignored" not in err, err
    for text in expected:
        assert text in err, err
    return err


# ----------------------------------------------------------------------------- pack: foreign files

def test_pack_refuses_a_users_own_tars_at_its_target_names_and_touches_none(tmp_path, capsys):
    inputs = _conversations(tmp_path)
    out = tmp_path / "out"
    theirs = [write_tar(out / f"conversations-{i:06d}.tar", [(f"mine{i}.txt", b"my own data %d" % i)])
              for i in range(5)]
    before = _snapshot(out)
    assert main(["pack", str(inputs), "--out", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, str(theirs[0]), "not written by `mmtok pack`")
    assert _snapshot(out) == before


def test_pack_replaces_only_the_tars_its_own_metadata_names(tmp_path, capsys):
    inputs = _conversations(tmp_path, lines=3)
    out = tmp_path / "out"
    assert main(["pack", str(inputs), "--out", str(out), "--samples-per-tar", "1", "--no-progress"]) == 0
    assert sorted(p.name for p in out.glob("conversations-*.tar")) == [f"conversations-{i:06d}.tar" for i in range(3)]
    mine = write_tar(out / "conversations-000007.tar", [("mine.txt", b"my own data")])
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["pack", str(inputs), "--out", str(out), "--no-progress"]) == 2
    _one_line_error(capsys, str(mine))
    assert _snapshot(out) == before
    mine.unlink()
    assert main(["pack", str(inputs), "--out", str(out), "--no-progress"]) == 0  # its own tars: replaced
    assert sorted(p.name for p in out.glob("conversations-*.tar")) == ["conversations-000000.tar"]


def test_pack_after_a_killed_pack_still_knows_which_tars_it_wrote(tmp_path, monkeypatch):
    import mmtok.sft.pack

    out = tmp_path / "out"
    calls = []
    real = mmtok.sft.pack.pack_conversation

    def killed(conversation, key, *options):
        calls.append(key)
        if len(calls) == 4:
            raise KeyboardInterrupt  # two tars are published, pack.json is not written
        return real(conversation, key, *options)

    monkeypatch.setattr(mmtok.sft.pack, "pack_conversation", killed)
    assert main(["pack", str(_conversations(tmp_path, lines=4)), "--out", str(out), "--samples-per-tar", "1",
                 "--no-progress"]) == 130
    monkeypatch.undo()
    assert not (out / "pack.json").exists() and len(list(out.glob("conversations-*.tar"))) == 2
    assert main(["pack", str(_conversations(tmp_path, lines=1)), "--out", str(out), "--no-progress"]) == 0
    assert sorted(p.name for p in out.glob("conversations-*.tar")) == ["conversations-000000.tar"]


# ----------------------------------------------------------------------------- pack: bounded media

def test_pack_skips_a_medium_above_max_media_bytes_as_media_too_large(tmp_path, capsys):
    inputs = _conversations(tmp_path, lines=1)
    size = (tmp_path / "images" / "horse.png").stat().st_size
    out = tmp_path / "out"
    assert main(["pack", str(inputs), "--out", str(out), "--max-media-bytes", str(size - 1), "--no-progress"]) == 2
    report = json.loads((out / "pack.json").read_text())
    assert report["counts"].get("skipped:media_too_large") == 1 and not report["counts"].get("packed")
    (record,) = [json.loads(line) for line in (out / "skipped.jsonl").read_text().splitlines()]
    assert record["reason"] == "media_too_large" and "c0" in record["key"] and f"{size - 1:,}" in record["detail"]
    assert main(["pack", str(inputs), "--out", str(out), "--max-media-bytes", str(size), "--no-progress"]) == 0
    with tarfile.open(out / "conversations-000000.tar") as tar:
        packed = tar.extractfile("000000000.0.png").read()
    assert packed == (tmp_path / "images" / "horse.png").read_bytes()


def test_pack_never_reads_a_whole_medium_into_memory(tmp_path, monkeypatch):
    """The packed member is streamed from the file: Located.read() (all bytes at once) is never called."""
    from mmtok.formats import conversations

    inputs = _conversations(tmp_path, lines=1)

    def refuse(self):
        raise AssertionError("pack read a whole medium into memory")

    monkeypatch.setattr(conversations.Located, "read", refuse)
    assert main(["pack", str(inputs), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    with tarfile.open(tmp_path / "out" / "conversations-000000.tar") as tar:
        assert tar.extractfile("000000000.0.png").read() == (tmp_path / "images" / "horse.png").read_bytes()


# ----------------------------------------------------------------------------- --out overlapping an input

def test_sft_refuses_an_out_that_holds_its_input_and_leaves_the_input_whole(tmp_path, capsys):
    out = tmp_path / "out"
    part = out / "parts" / "part-00000"
    part.mkdir(parents=True)
    inputs = part / "skipped.jsonl"  # a conversation file where sft writes its part's skip list
    inputs.write_text(json.dumps({"id": "c0", "messages": _turns("Hello?", "Hi.")}) + "\n")
    before = inputs.read_bytes()
    tokenizer = chat_tokenizer(tmp_path / "tokenizer")
    assert main(["sft", str(inputs), "--text-tokenizer", str(tokenizer), "--out", str(out), "--rank", "0",
                 "--world-size", "1", "--no-progress"]) == 2
    _one_line_error(capsys, str(inputs), "inside --out")
    assert inputs.read_bytes() == before
    assert sorted(p.name for p in part.iterdir()) == ["skipped.jsonl"]


def test_scan_refuses_an_out_that_holds_a_shard_before_writing(tmp_path, capsys):
    data = tmp_path / "data"
    (shard,) = caption_corpus(data)[:1]
    assert _scan(str(shard), str(data)) == 2
    _one_line_error(capsys, str(shard), "inside --out")
    assert sorted(p.name for p in data.iterdir()) == sorted(p.name for p in caption_corpus(tmp_path / "again"))


def test_audio_convert_refuses_a_directory_input_as_its_out(tmp_path, capsys):
    from audio_corpus import digit

    speech = tmp_path / "speech"
    speech.mkdir()
    (speech / "one.wav").write_bytes(digit("1").read_bytes())
    assert main(["audio", "convert", str(speech), "--out", str(speech), "--workers", "0", "--no-progress"]) == 2
    _one_line_error(capsys, str(speech), "is the input")
    assert sorted(p.name for p in speech.iterdir()) == ["one.wav"]


def test_plan_refuses_the_manifest_directory_as_its_out(tmp_path, capsys):
    manifest = _scanned(tmp_path)
    before = _snapshot(manifest)
    capsys.readouterr()
    assert main(["plan", str(manifest), "--out", str(manifest), "--quiet"]) == 2
    _one_line_error(capsys, "is the input")
    assert _snapshot(manifest) == before


def test_an_out_next_to_its_inputs_is_fine(tmp_path):
    from mmtok.fsutil import refuse_out_overlapping

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text("")
    refuse_out_overlapping(tmp_path / "out", [tmp_path / "in" / "a.jsonl", tmp_path / "in"])
    refuse_out_overlapping(tmp_path / "in" / "out", [tmp_path / "in" / "a.jsonl", tmp_path / "in"])
    refuse_out_overlapping(tmp_path / "tekken", ["tekken"])  # a name, not a path: nothing to destroy
    link = tmp_path / "alias"
    link.symlink_to(tmp_path / "in")
    with pytest.raises(Exception, match="inside --out"):
        refuse_out_overlapping(link, [tmp_path / "in" / "a.jsonl"])  # a symlink hides no overlap


# ----------------------------------------------------------------------------- a failed run keeps the last output

def test_merge_strip_reasoning_that_cannot_strip_writes_nothing_and_keeps_the_last_merge(tmp_path, capsys):
    import numpy as np

    from mmtok.formats.commitlog import PartWriter
    from mmtok.formats.partdir import part_dir

    part = PartWriter(part_dir(tmp_path, 0), {"part": 0, "num_parts": 1, "modality": "image",
                                              "plan_fingerprint": "p", "part_batches": [0, 1],
                                              "text_special_ids": {},  # no reasoning markers
                                              "text_tokenizer": {"name": "t", "bos_id": 1, "eos_id": 2}})
    part.commit(0, [np.array([1, 5, 2], np.int32)], [{"key": "k"}], {"written": 1})
    part.finish({})
    part.close()
    assert main(["merge", str(tmp_path), "--no-progress"]) == 0
    before = _snapshot(tmp_path)
    capsys.readouterr()
    assert main(["merge", str(tmp_path), "--strip-reasoning", "--no-progress"]) == 2
    _one_line_error(capsys, "has no <|inner_prefix|> / <|inner_suffix|> token")
    assert _snapshot(tmp_path) == before


def test_scan_with_a_mistyped_path_keeps_the_good_manifest(tmp_path, capsys):
    out = _scanned(tmp_path)
    before = _snapshot(out)
    capsys.readouterr()
    assert _scan(str(tmp_path / "dtaa" / "shard-000000.tar"), str(out)) == 2
    _one_line_error(capsys, "no image found", "dtaa")
    assert _snapshot(out) == before


def test_plan_that_keeps_no_row_keeps_the_good_plan(tmp_path, capsys):
    manifest, out = _scanned(tmp_path), tmp_path / "plan"
    assert main(["plan", str(manifest), "--out", str(out), "--quiet"]) == 0
    before = _snapshot(out)
    capsys.readouterr()
    assert main(["plan", str(manifest), "--out", str(out), "--quiet", "--min-source-pixels", "0",
                 "--max-source-pixels", "1"]) == 2
    _one_line_error(capsys, "so the plan holds no image", "too_many_pixels")
    assert _snapshot(out) == before and not [p for p in out.iterdir() if ".tmp" in p.name]


# ----------------------------------------------------------------------------- a full disk; reproducible bytes

@pytest.fixture
def full_disk(mount):
    """make(leave) -> a 1 MiB tmpfs with `leave` bytes free (a real full disk, as tests/test_cli_os_errors.py
    makes one)."""
    from diskkit import fill

    def make(leave: int) -> Path:
        disk = mount(1 << 20).path
        fill(disk, leave)
        return disk

    return make


def _temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("leave", [4096, 12_288])  # full while the first / the last Parquet file is started
def test_plan_on_a_full_disk_is_one_line_naming_the_file_and_leaves_no_temp_file(tmp_path, full_disk, capsys, leave):
    manifest = _scanned(tmp_path)
    disk = full_disk(leave=leave)
    capsys.readouterr()
    assert main(["plan", str(manifest), "--out", str(disk / "plan"), "--quiet"]) == 2
    _one_line_error(capsys, "No space left on device", str(disk / "plan") + "/", ".parquet")
    assert not _temp_files(disk)


def _speech(root: Path) -> Path:
    from audio_corpus import digit

    root.mkdir(parents=True, exist_ok=True)
    for name in ("1", "2", "3"):
        (root / f"{name}.wav").write_bytes(digit(name).read_bytes())
    return root


@pytest.mark.parametrize("leave", [30_000, 50_000])  # the disk fills while the shard's tar is written
def test_audio_convert_on_a_full_disk_ends_in_one_line(tmp_path, full_disk, leave):
    """In a process of its own: the tar writer's leftover stream retried its write at exit ("Exception ignored")."""
    import sys

    import mmtok

    speech = _speech(tmp_path / "speech")
    disk = full_disk(leave=leave)
    env = {**os.environ, "PYTHONPATH": str(Path(mmtok.__file__).parents[1])}
    result = subprocess.run([sys.executable, "-m", "mmtok", "audio", "convert", str(speech), "--out",
                             str(disk / "out"), "--workers", "0", "--no-progress"], capture_output=True, text=True,
                            env=env, timeout=120)
    err = result.stderr.strip()
    assert result.returncode == 2 and len(err.splitlines()) == 1, err
    assert "No space left on device" in err and str(disk / "out") in err and "Exception ignored" not in err
    assert not _temp_files(disk) and not list((disk / "out" / ".work").glob("*"))


def test_two_identical_audio_converts_give_byte_identical_files(tmp_path):
    speech = _speech(tmp_path / "speech")
    for out in ("a", "b"):
        assert main(["audio", "convert", str(speech), "--out", str(tmp_path / out), "--workers", "0",
                     "--no-progress"]) == 0
        if out == "a":
            import time

            time.sleep(1.1)  # gzip headers hold seconds
    first, second = _snapshot(tmp_path / "a"), _snapshot(tmp_path / "b")
    differ = sorted(name for name in first if first[name] != second.get(name))
    assert first.keys() == second.keys() and not differ, differ


def test_a_damaged_metadata_file_is_a_stages_own_only_beside_another_of_its_marks(tmp_path):
    # `mmtok dedup --report` marks its folder with its metadata file itself: a report.json that does not parse is
    # then no proof that the folder is the report's, and a foreign index.md beside it is never replaced.
    from mmtok.fsutil import refuse_foreign_output

    metadata = ("report.json", "mmtok-report", 1, "duplicate-list report")
    (tmp_path / "index.md").write_text("their notes")
    (tmp_path / "report.json").write_text("not json")
    with pytest.raises(MmtokError, match="is not a duplicate-list report"):
        refuse_foreign_output(tmp_path, ("index.md",), ("report.json",), "mmtok dedup --report", metadata)
    (tmp_path / ".cache").mkdir()  # a mark only that stage leaves: a damaged report.json beside it is its own
    refuse_foreign_output(tmp_path, ("index.md",), ("report.json", ".cache"), "mmtok dedup --report", metadata)
