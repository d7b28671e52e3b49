"""Issue 49.3: a stage that writes nothing usable from a non-empty input exits 2 with its counts by reason, in
every stage (scan, audio convert and interleave did already): image and audio encode -- on the run and on a
rerun that finds the part finished --, merge, sft and pack. Each keeps its files, so the reasons can be read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import mmtok.sft.build
from audio_corpus import digit
from encodekit import PLAN_FLAGS, chat_tokenizer, damaged_jpeg, damaged_png, one_torch_thread, real_images, write_tar
from mmtok.cli import main


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return chat_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def run(capsys, *argv: str) -> tuple[int, str]:
    capsys.readouterr()
    code = main(list(argv))
    return code, capsys.readouterr().err


def test_image_encode_and_merge_of_undecodable_images_exit_2_naming_the_reasons(tmp_path, tokenizer, capsys):
    from mmtok.codecs import emu35

    images = real_images()
    jpeg, png = images["rocket.jpg"].read_bytes(), images["coffee.png"].read_bytes()
    bad = write_tar(tmp_path / "bad.tar", [("c000.jpg", damaged_jpeg(jpeg)), ("c000.txt", b"a damaged jpeg"),
                                           ("c001.png", damaged_png(png)), ("c001.txt", b"a damaged png")])
    good = write_tar(tmp_path / "good.tar", [("g000.png", png), ("g000.txt", b"a cup")])
    checkpoint = emu35.write_random_checkpoint(tmp_path / "ckpt")
    said = {}
    for tar, expected in ((bad, 2), (good, 0)):  # the good shard: the same commands succeed
        name = tar.stem
        assert main(["scan", str(tar), "--out", str(tmp_path / f"m-{name}"), "--workers", "1", "--no-progress"]) == 0
        assert main(["plan", str(tmp_path / f"m-{name}"), "--out", str(tmp_path / f"p-{name}"), "--quiet", *PLAN_FLAGS,
                     "--text-tokenizer", str(tokenizer), "--mode", "image"]) == 0
        encode = ["encode", "--plan", str(tmp_path / f"p-{name}"), "--checkpoint", str(checkpoint), "--out",
                  str(tmp_path / f"e-{name}"), "--device", "cpu", "--loader-threads", "1", "--no-progress"]
        with one_torch_thread():
            code, err = run(capsys, *encode)
            assert code == expected, err
            rerun, again = run(capsys, *encode)  # the part is finished: the same verdict from its counters
        assert rerun == expected and "already finished" in again
        merged, merge_err = run(capsys, "merge", str(tmp_path / f"e-{name}"))
        assert merged == expected
        said[name] = err, again, merge_err
    err, again, merge_err = said["bad"]
    assert "nothing usable was written -- every input was skipped (decode_error 2; each named in" in err
    assert "decode_error 2" in again and "merged.skipped.jsonl" in merge_err
    assert json.loads((tmp_path / "e-bad" / "merged.json").read_text())["dataset"] is False  # kept, to be read


def test_audio_encode_that_encodes_no_clip_exits_2_also_on_the_rerun(tmp_path, capsys):
    from mmtok.codecs.wavtokenizer import write_random_checkpoint

    (tmp_path / "in").mkdir()
    for key in "12":
        (tmp_path / "in" / f"{key}.wav").write_bytes(digit(key).read_bytes())
    assert main(["audio", "convert", str(tmp_path / "in"), "--out", str(tmp_path / "conv"), "--workers", "0",
                 "--no-progress"]) == 0
    checkpoint = write_random_checkpoint(tmp_path / "ckpt")
    encode = ["encode", "--modality", "audio", "--shar", str(tmp_path / "conv" / "shar"), "--checkpoint",
              str(checkpoint), "--out", str(tmp_path / "enc"), "--device", "cpu", "--num-workers", "0",
              "--no-progress", "--max-clip-duration", "0.01"]
    with one_torch_thread():
        for _ in range(2):
            code, err = run(capsys, *encode)
            assert code == 2 and "nothing usable was written -- every input was skipped (too_long 2;" in err


def test_sft_and_pack_of_conversations_that_are_all_skipped_exit_2(tmp_path, tokenizer, capsys):
    lines = ['{"messages": [{"role": "user", "content": [{"type": "image", "image": "missing.png"}]}, '
             '{"role": "assistant", "content": "A cat."}]}', "not json", '{"nomessages": 1}']
    (tmp_path / "bad.jsonl").write_text("\n".join(lines) + "\n")
    code, err = run(capsys, "sft", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "sft"), "--text-tokenizer",
                    str(tokenizer), "--no-progress")
    assert code == 2 and "nothing usable was written -- every input was skipped (" in err
    assert "invalid_json 1" in err and "skipped.jsonl" in err
    code, err = run(capsys, "pack", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "pack"), "--no-progress")
    assert code == 2 and "invalid_json 1" in err and (tmp_path / "pack" / "skipped.jsonl").is_file()


def test_a_rank_of_several_that_writes_nothing_warns_and_merge_gives_the_verdict(tmp_path, tokenizer, capsys,
                                                                                monkeypatch):
    # under torchrun or srun a rank's non-zero exit would stop the other ranks: the job's verdict is merge's
    (tmp_path / "bad.jsonl").write_text("not json\n" * 300)
    monkeypatch.setattr(mmtok.sft.build, "UNITS_PER_ITEM", 1)  # 2 units of 256 lines: a work item each
    for rank in range(2):
        code, err = run(capsys, "sft", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "sft"), "--text-tokenizer",
                        str(tokenizer), "--rank", str(rank), "--world-size", "2", "--no-progress", "--no-take-over")
        assert code == 0 and "warning: rank" in err and "the other ranks go on" in err
    code, err = run(capsys, "merge", str(tmp_path / "sft"), "--no-progress")
    assert code == 2 and "invalid_json 300" in err
