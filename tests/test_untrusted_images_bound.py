"""Issue 21 §3, images: tokens always belong to the bytes they claim.

An image item is bound to the bytes it came from (the digest encode takes of every member it decodes) and to
the identity of its tar as the scan saw it (size, mtime, a fingerprint of its first bytes). A tar changed since
then never lends its old tokens: encode does not decode it, `mmtok sft` skips its conversations as
`stale_media`, `mmtok merge` refuses it naming the tar. The items store is checksummed and verified by sft, and
every image code is checked against the image range before a commit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from encodekit import chat_tokenizer, real_images, write_tar
from mmtok.cli import main
from mmtok.codecs import emu35
from mmtok.encode import loader
from mmtok.errors import MmtokError
from mmtok.formats import commitlog, partdir
from mmtok.formats.items import CONTAINERS, ImageIndex, media_digest, part_containers, read_items
from mmtok.formats.manifest import container_identity
from mmtok.vocab import check_ids_in_range

PLAN = ["--mode", "sft", "--min-pixels", "1024", "--max-pixels", "2304", "--token-budget", "40",
        "--max-batch-images", "2"]
# Two conversations of one image each: re-packed, each sample gets the other's photo under the same member name.
PHOTOS = {"c000": "chelsea.png", "c001": "coffee.png"}


def _conversation(question: str) -> dict:
    return {"messages": [{"role": "user", "content": f"<image>\n{question}"},
                         {"role": "assistant", "content": "A photo."}]}


def _pack(tar: Path, photos: dict[str, str]) -> Path:
    images = real_images()
    members = []
    for key, photo in photos.items():
        members += [(f"{key}.0.png", images[photo].read_bytes()),
                    (f"{key}.json", json.dumps(_conversation(f"What is in photo {key}?")).encode())]
    return write_tar(tar, members)


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """(the chat tokenizer's directory, a random emu3.5 checkpoint), shared by every test."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("kit")
    return chat_tokenizer(root / "tokenizer"), emu35.write_random_checkpoint(root / "ckpt")


def _scan_plan(kit, work: Path, tar: Path) -> Path:
    text, _ = kit
    assert main(["scan", str(tar), "--out", str(work / "manifest"), "--workers", "1", "--no-progress"]) == 0
    assert main(["plan", str(work / "manifest"), "--out", str(work / "plan"), "--quiet", *PLAN,
                 "--text-tokenizer", str(text)]) == 0
    return work / "plan"


def _encode(kit, work: Path) -> int:
    return main(["encode", "--plan", str(work / "plan"), "--checkpoint", str(kit[1]), "--out", str(work / "images"),
                 "--device", "cpu", "--no-progress"])


def _sft(kit, work: Path, tar: Path, out: str) -> int:
    return main(["sft", str(tar), "--text-tokenizer", str(kit[0]), "--images", str(work / "images"),
                 "--out", str(work / out), "--no-progress"])


@pytest.fixture()
def encoded(kit, tmp_path):
    """A conversation tar scanned, planned and encoded (`--mode sft`): (work directory, the tar)."""
    tar = _pack(tmp_path / "data" / "conv-0.tar", PHOTOS)
    _scan_plan(kit, tmp_path, tar)
    assert _encode(kit, tmp_path) == 0
    return tmp_path, tar


def _counts(out: Path) -> dict:
    return partdir.read_stats(partdir.part_dir(out, 0))["counts"]


def _skips(out: Path) -> list[dict]:
    return [json.loads(line) for line in (partdir.part_dir(out, 0) / partdir.SKIPPED).read_text().splitlines()]


def _repack_swapped(tar: Path) -> None:
    """The reported case: the same tar path re-packed, every sample now holding the other's photo."""
    _pack(tar, dict(zip(PHOTOS, reversed(PHOTOS.values()), strict=True)))


def test_a_tar_repacked_after_its_encode_is_stale_media_not_another_photos_tokens(kit, encoded):
    work, tar = encoded
    assert _sft(kit, work, tar, "before") == 0
    assert _counts(work / "before")["documents_written"] == 2
    _repack_swapped(tar)
    assert _sft(kit, work, tar, "after") == 2  # every conversation skipped: nothing usable, exit 2 (issue 49.3)
    counts = _counts(work / "after")
    assert counts.get("documents_written", 0) == 0 and counts["skipped:stale_media"] == 2, counts
    records = _skips(work / "after")
    assert {r["key"].split("/")[-1] for r in records} == set(PHOTOS)
    assert {r["reason"] for r in records} == {"stale_media"}
    assert all(str(tar) in r["detail"] and "changed since" in r["detail"] for r in records), records


def test_image_items_record_the_digest_of_the_bytes_they_were_decoded_from(encoded):
    work, tar = encoded
    records, _ = read_items(partdir.part_dir(work / "images", 0))
    photos = real_images()
    assert {r["key"]: r["digest"] for r in records} == {key: media_digest(photos[photo].read_bytes())
                                                         for key, photo in PHOTOS.items()}
    [identity] = partdir.read_identity(partdir.part_dir(work / "images", 0))[CONTAINERS].values()
    assert identity == container_identity(tar)


def test_a_tar_changed_between_scan_and_encode_is_stale_media_and_never_decoded(kit, tmp_path, monkeypatch):
    tar = _pack(tmp_path / "data" / "conv-0.tar", PHOTOS)
    _scan_plan(kit, tmp_path, tar)
    _repack_swapped(tar)
    monkeypatch.setattr(loader, "decode_rgb", lambda data: pytest.fail("a stale tar's bytes were decoded"))
    assert _encode(kit, tmp_path) == 2  # every image stale: nothing usable, exit 2
    records, ids = read_items(partdir.part_dir(tmp_path / "images", 0))
    assert [r["skip"] for r in records] == ["stale_media"] * 2 and ids.size == 0
    assert all(str(tar) in r["detail"] and "digest" not in r for r in records)
    assert _sft(kit, tmp_path, tar, "sft") == 2
    assert _counts(tmp_path / "sft")["skipped:stale_media"] == 2


def test_merge_refuses_an_encode_whose_tar_changed_since_in_one_line_naming_it(kit, tmp_path, capsys):
    tar = _pack(tmp_path / "data" / "img-0.tar", PHOTOS)
    text, _ = kit
    assert main(["scan", str(tar), "--out", str(tmp_path / "manifest"), "--workers", "1", "--no-progress"]) == 0
    assert main(["plan", str(tmp_path / "manifest"), "--out", str(tmp_path / "plan"), "--quiet", "--mode", "image",
                 *PLAN[2:], "--text-tokenizer", str(text)]) == 0
    assert _encode(kit, tmp_path) == 0
    _repack_swapped(tar)
    capsys.readouterr()
    assert main(["merge", str(tmp_path / "images"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(tar) in err and "changed since its scan" in err, err
    assert not (tmp_path / "images" / "merged.bin").exists()


@pytest.mark.parametrize("name", [partdir.ITEM_IDS, partdir.ITEMS])
def test_a_flipped_bit_in_the_image_items_is_a_one_line_refusal_naming_the_file(kit, encoded, capsys, name):
    work, tar = encoded
    path = partdir.part_dir(work / "images", 0) / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    capsys.readouterr()
    assert _sft(kit, work, tar, "sft") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and "checksum" in err, err


def test_image_codes_outside_the_codebook_are_refused_before_a_commit(kit, tmp_path, monkeypatch, capsys):
    tar = _pack(tmp_path / "data" / "conv-0.tar", PHOTOS)
    _scan_plan(kit, tmp_path, tar)
    encode = emu35.Emu35Codec.encode
    monkeypatch.setattr(emu35.Emu35Codec, "encode", lambda self, pixels: encode(self, pixels) + (1 << 20))
    capsys.readouterr()
    assert _encode(kit, tmp_path) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "image codes of" in err and str(tar) in err and "outside [0," in err, err
    assert commitlog.read_commits(partdir.part_dir(tmp_path / "images", 0)) == ([], 0)


def test_check_ids_in_range_names_what_the_range_and_the_offenders():
    check_ids_in_range(np.array([3, 4, 9]), 3, 10, "audio ids")
    check_ids_in_range(np.zeros(0, np.int64), 3, 10, "nothing")
    with pytest.raises(MmtokError, match=r"audio ids of x: 2 id\(s\) outside \[3, 10\) \(min 2, max 10\)"):
        check_ids_in_range(np.array([2, 5, 10]), 3, 10, "audio ids of x")


def test_an_image_part_that_predates_tar_identities_is_a_one_line_rerun_refusal(tmp_path):
    (tmp_path / partdir.IDENTITY).write_text(json.dumps({"part": 0, "num_parts": 1, "modality": "image",
                                                           "mode": "sft"}))
    with pytest.raises(MmtokError, match=r"records no identity of its tars .* re-run `mmtok scan`"):
        part_containers(tmp_path)


def test_a_manifest_of_the_previous_version_is_a_one_line_rerun_scan(kit, tmp_path, capsys):
    tar = _pack(tmp_path / "data" / "conv-0.tar", PHOTOS)
    assert main(["scan", str(tar), "--out", str(tmp_path / "manifest"), "--workers", "1", "--no-progress"]) == 0
    meta_path = tmp_path / "manifest" / "manifest.json"
    meta = json.loads(meta_path.read_text())
    assert meta["inputs"][0]["identity"] == container_identity(tar)
    meta_path.write_text(json.dumps({**meta, "format_version": 1}))
    capsys.readouterr()
    assert main(["plan", str(tmp_path / "manifest"), "--out", str(tmp_path / "plan"), "--quiet", *PLAN,
                 "--text-tokenizer", str(kit[0])]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "rerun `mmtok scan`" in err, err


def test_item_records_that_point_past_the_stored_ids_are_refused_naming_the_file(tmp_path):
    (tmp_path / partdir.IDENTITY).write_text(json.dumps({"part": 0, "num_parts": 1, CONTAINERS: {}}))
    record = {"kind": "image", "key": "k", "source": str(tmp_path / "t.tar"), "member": "k.0.png", "length": 10}
    (tmp_path / partdir.ITEMS).write_text(json.dumps(record) + "\n")
    (tmp_path / partdir.ITEM_IDS).write_bytes(np.arange(4, dtype=np.int32).tobytes())
    with pytest.raises(MmtokError, match=r"items.jsonl: its records need 10 ids but .*items.ids holds 4"):
        ImageIndex([tmp_path])


def test_latents_that_overflow_are_refused_before_a_commit(kit, tmp_path, capsys):
    """Finite weights whose sums overflow float32: the encoder's NaN/Inf never become codes (argmax over NaN is
    code 0 for every image); the encode stops in one line with nothing of the batch committed."""
    tar = _pack(tmp_path / "data" / "conv-0.tar", PHOTOS)
    _scan_plan(kit, tmp_path, tar)
    checkpoint = tmp_path / "overflowing"
    shutil.copytree(kit[1], checkpoint)
    saved = torch.load(checkpoint / "model.ckpt", weights_only=True)
    saved.get("state_dict", saved)["encoder.conv_in.weight"].fill_(3e38)
    torch.save(saved, checkpoint / "model.ckpt")
    capsys.readouterr()
    assert main(["encode", "--plan", str(tmp_path / "plan"), "--checkpoint", str(checkpoint),
                 "--out", str(tmp_path / "images"), "--device", "cpu", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "non-finite values" in err and "nothing of it was committed" in err, err
    assert commitlog.read_commits(partdir.part_dir(tmp_path / "images", 0)) == ([], 0)


def test_a_batch_whose_every_code_is_one_value_is_flagged(kit, tmp_path, monkeypatch, capsys):
    """A checkpoint that maps everything to one code (damaged weights that still load): counted as
    flagged:uniform_codes in the part, with a warning line in the rank's summary -- not silence."""
    tar = _pack(tmp_path / "data" / "conv-0.tar", PHOTOS)
    _scan_plan(kit, tmp_path, tar)
    encode = emu35.Emu35Codec.encode
    monkeypatch.setattr(emu35.Emu35Codec, "encode", lambda self, pixels: encode(self, pixels) * 0 + 7)
    capsys.readouterr()
    assert _encode(kit, tmp_path) == 0
    err = capsys.readouterr().err
    assert "warning: 1 batch gave every image one code (flagged:uniform_codes)" in err, err
    stats = json.loads((partdir.part_dir(tmp_path / "images", 0) / "stats.json").read_text())
    assert stats["counts"]["flagged:uniform_codes"] == 1


@pytest.mark.parametrize("layout", ["members-repeated", "key-repeated"])
def test_two_samples_with_one_key_are_duplicate_key(kit, tmp_path, capsys, layout):
    """Issue 48.5: a key that names two samples (or one sample holding a member twice) was skipped as the
    misleading `placeholder_mismatch` (the scan files both samples' images under the key) and its repeat as
    `duplicate_conversation`; every such sample is `duplicate_key` now, named in the skip list."""
    images = real_images()
    photo = images["chelsea.png"].read_bytes()
    one, two = (json.dumps(_conversation(q)).encode() for q in ("first?", "second?"))
    other = [("m.json", json.dumps(_conversation("other?")).encode()), ("m.0.png", photo)]
    first, second = [("k.json", one), ("k.0.png", photo)], [("k.json", two), ("k.0.png", photo)]
    members = [*first, *second, *other] if layout == "members-repeated" else [*first, *other, *second]
    tar = write_tar(tmp_path / "data" / "dup.tar", members)
    _scan_plan(kit, tmp_path, tar)
    assert _encode(kit, tmp_path) == 0
    assert _sft(kit, tmp_path, tar, "sft") == 0
    assert "duplicate_key" in capsys.readouterr().err
    skipped = [json.loads(line) for line in
               (partdir.part_dir(tmp_path / "sft", 0) / "skipped.jsonl").read_text().splitlines()]
    expected = ["dup/k"] if layout == "members-repeated" else ["dup/k", "dup/k (repeat 2)"]
    assert sorted(r["key"] for r in skipped) == expected and {r["reason"] for r in skipped} == {"duplicate_key"}


def test_an_image_changed_in_a_tar_that_keeps_its_identity_is_stale_media(encoded, kit, capsys):
    """Issue 34.1(a): a tar whose size, mtime and first 8 KiB are unchanged (tar pads to 10 KiB records, `touch -r`
    restores a time) but whose later image bytes differ: sft compares each image's bytes with the digest its
    encode recorded, so the conversation is skipped as stale_media, never given the old image's tokens."""
    import os

    from mmtok.formats.tar import read_members

    work, tar = encoded
    member = next(m for m in read_members(tar) if m.name == "c001.0.png")
    assert member.offset > 8192  # past the head the tar's identity digests
    stat = tar.stat()
    data = bytearray(tar.read_bytes())
    data[member.offset + member.size // 2] ^= 0xFF
    tar.write_bytes(bytes(data))
    os.utime(tar, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert tar.stat().st_size == stat.st_size
    capsys.readouterr()
    assert _sft(kit, work, tar, "sft") == 0
    skipped = [json.loads(line) for line in
               (partdir.part_dir(work / "sft", 0) / "skipped.jsonl").read_text().splitlines()]
    assert [(r["key"], r["reason"]) for r in skipped] == [("conv-0/c001", "stale_media")]
    assert "its bytes are not those `mmtok encode` decoded" in skipped[0]["detail"]
