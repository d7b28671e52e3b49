"""Untrusted inputs reach no code and no file outside their roots (issue 21, section 1, and Lhotse manifests
with missing keys): a Lhotse `command`/`url` source is neither run nor fetched unless asked for; a conversation's
media path resolves only inside the input's directory or a `--media-root`; FIFOs, devices and directories are
never opened (nothing blocks); no skip detail holds a byte of a file. Each test builds its own hostile corpus.
"""

from __future__ import annotations

import base64
import errno
import json
import os
import tarfile
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from audio_corpus import digit, write_jsonl
from convertkit import assert_counts_add_up, dropped_records, load_cuts, report
from encodekit import real_images
from mmtok.audio.convert import ConvertOptions, convert
from mmtok.cli import main
from mmtok.errors import Skip
from mmtok.formats.conversations import locate, read_conversations
from mmtok.workers import TakeOver, WorkerRun

SECRET = b"TOPSECRETPASSWORD-do-not-copy"


@contextmanager
def fifo_unblocked(path: Path):
    """A FIFO at `path` whose every reader, should one open it, soon gets end-of-file instead of blocking
    forever: so a test of code that opens it fails rather than hangs."""
    os.mkfifo(path)
    stop = threading.Event()

    def writer():
        while not stop.wait(0.05):
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # succeeds only while a reader waits
            except OSError as err:
                if err.errno != errno.ENXIO:
                    return

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield path
    finally:
        stop.set()
        thread.join()


def _recording(ident: str, source: dict) -> dict:
    return {"id": ident, "sources": [{"channels": [0], **source}], "sampling_rate": 8000,
            "num_samples": 8000, "duration": 1.0, "channel_ids": [0]}


def _file_recording(ident: str, path: Path) -> dict:
    from lhotse import Recording

    return Recording.from_file(path, recording_id=ident).to_dict()


def _convert(tmp_path: Path, manifests: list[Path], **kwargs) -> dict:
    convert(manifests, tmp_path / "out", ConvertOptions(), workers=0, progress=False, **kwargs)
    counts = report(tmp_path / "out")["counts"]
    assert_counts_add_up(counts)
    return counts


def _reasons(out: Path) -> dict[str, str]:
    return {record["key"]: record["reason"] for record in dropped_records(out)}


# -- Lhotse sources ---------------------------------------------------------------------------------------
def test_a_lhotse_command_source_is_not_run(tmp_path):
    marker = tmp_path / "ran"
    command = f"touch {marker}; cat {digit('1')}"
    manifest = write_jsonl(tmp_path / "recordings.jsonl", [_recording("evil", {"type": "command", "source": command}),
                                                           _file_recording("good", digit("2"))])
    counts = _convert(tmp_path, [manifest])
    assert not marker.exists()
    assert counts == {"in": 2, "written": 1, "skipped:unsafe_source": 1}
    assert _reasons(tmp_path / "out") == {"evil": "unsafe_source"}
    assert [cut.id for cut in load_cuts(tmp_path / "out")] == ["good"]


def test_a_lhotse_url_source_is_not_fetched(tmp_path):
    (tmp_path / "secret.wav").write_bytes(digit("3").read_bytes())
    manifest = write_jsonl(tmp_path / "recordings.jsonl", [
        _recording("remote", {"type": "url", "source": f"file://{tmp_path / 'secret.wav'}"})])
    assert _convert(tmp_path, [manifest]) == {"in": 1, "skipped:unsafe_source": 1}


def test_allow_command_sources_runs_a_command_source_and_says_so(tmp_path, capsys):
    marker = tmp_path / "ran"
    manifest = write_jsonl(tmp_path / "recordings.jsonl", [
        _recording("piped", {"type": "command", "source": f"touch {marker}; cat {digit('1')}"})])
    assert main(["audio", "convert", str(manifest), "--out", str(tmp_path / "out"), "--workers", "0",
                 "--no-progress", "--allow-command-sources"]) == 0
    assert marker.exists()
    assert [cut.id for cut in load_cuts(tmp_path / "out")] == ["piped"]
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert len(warnings) == 1 and "--allow-command-sources" in warnings[0], warnings


def test_convert_without_the_flag_refuses_command_sources_from_the_cli_too(tmp_path, capsys):
    manifest = write_jsonl(tmp_path / "recordings.jsonl", [
        _recording("piped", {"type": "command", "source": f"cat {digit('1')}"})])
    assert main(["audio", "convert", str(manifest), "--out", str(tmp_path / "out"), "--workers", "0",
                 "--no-progress"]) == 2  # its only clip refused: nothing usable written (issue 49.3)
    err = capsys.readouterr().err
    assert "unsafe_source" in err and "no clip was written" in err


def test_a_lhotse_fifo_or_directory_file_source_is_not_opened(tmp_path):
    (tmp_path / "folder.wav").mkdir()
    with fifo_unblocked(tmp_path / "pipe.wav") as fifo:
        manifest = write_jsonl(tmp_path / "recordings.jsonl", [
            _recording("fifo", {"type": "file", "source": str(fifo)}),
            _recording("dir", {"type": "file", "source": str(tmp_path / "folder.wav")}),
            _file_recording("good", digit("2"))])
        counts = _convert(tmp_path, [manifest])
    assert counts == {"in": 3, "written": 1, "skipped:not_a_file": 2}
    assert _reasons(tmp_path / "out") == {"fifo": "not_a_file", "dir": "not_a_file"}


BAD_ROWS = [  # (row, what its detail names)
    ({"id": "s-no-recording", "start": 0.0, "duration": 0.5}, "recording_id"),
    ({"id": "s-no-start", "recording_id": "good", "duration": 0.5}, "start"),
    ({"recording_id": "good", "start": 0.0, "duration": 0.5}, "id"),
    ({"sources": [{"type": "file", "channels": [0], "source": "x.wav"}], "sampling_rate": 8000}, "id"),
    ({"id": "r-no-type", "sources": [{"channels": [0], "source": "x.wav"}], "sampling_rate": 8000,
      "num_samples": 8000, "duration": 1.0}, "type"),
    ({"id": "r-sources-not-a-list", "sources": "x.wav", "sampling_rate": 8000, "num_samples": 8000,
      "duration": 1.0}, "sources"),
    ({"id": "r-no-sources", "sampling_rate": 8000, "num_samples": 8000, "duration": 1.0},
     "recording without `sources`"),
    (["not", "an", "object"], "object"),
]


def test_lhotse_rows_with_missing_keys_are_bad_manifest_rows_naming_the_line(tmp_path):
    good = _file_recording("good", digit("2"))
    sups = [{"id": "s-good", "recording_id": "good", "start": 0.0, "duration": 0.5, "text": "two"}]
    manifest = write_jsonl(tmp_path / "mixed.jsonl", [good, *sups, *(row for row, _ in BAD_ROWS)])
    counts = _convert(tmp_path, [manifest])
    assert counts == {"in": 1 + len(BAD_ROWS), "written": 1, "skipped:bad_manifest_row": len(BAD_ROWS)}
    dropped = [r for r in dropped_records(tmp_path / "out") if r["reason"] == "bad_manifest_row"]
    for line, ((_, named), record) in enumerate(zip(BAD_ROWS, dropped, strict=True), 3):
        assert record["source"] == f"{manifest}:{line}", record
        assert named in record["detail"], record


# -- conversation media ---------------------------------------------------------------------------------
def _turns(content) -> list[dict]:
    return [{"role": "user", "content": content}, {"role": "assistant", "content": "Yes."}]


def _image_line(ident: str, reference: str) -> dict:
    return {"id": ident, "images": [reference], "messages": _turns("<image> What is it?")}


def _hostile_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """data/convs.jsonl next to a real photo, referencing a file outside data/ in three ways; the secret dir."""
    data, secret = tmp_path / "data", tmp_path / "secret"
    data.mkdir()
    secret.mkdir()
    photo = real_images()["horse.png"].read_bytes()
    (data / "horse.png").write_bytes(photo)
    (secret / "shadow.png").write_bytes(photo + SECRET)  # would pass as a png: only the roots keep it out
    (data / "link.png").symlink_to(secret / "shadow.png")
    (data / "inner.png").symlink_to("horse.png")  # a symlink that stays inside is fine
    lines = [_image_line("inside", "horse.png"), _image_line("inner-link", "inner.png"),
             _image_line("absolute", str(secret / "shadow.png")),
             _image_line("dotdot", "../secret/shadow.png"), _image_line("symlink", "link.png"),
             _image_line("file-url", f"file://{secret / 'shadow.png'}")]
    write_jsonl(data / "convs.jsonl", lines)
    return data / "convs.jsonl", secret


def _pack(inputs: list[Path], out: Path, *flags) -> dict:
    code = main(["pack", *map(str, inputs), "--out", str(out), "--no-progress", *map(str, flags)])
    report = json.loads((out / "pack.json").read_text())
    assert code == (0 if report["counts"].get("packed") else 2)  # nothing packed: exit 2 (issue 49.3)
    return report


def _packed_bytes(out: Path) -> bytes:
    data = b""
    for tar in sorted(out.glob("conversations-*.tar")):
        with tarfile.open(tar) as archive:
            data += b"".join(archive.extractfile(m).read() for m in archive)
    return data


def _skipped(out: Path) -> dict[str, dict]:
    return {r["key"]: r for r in map(json.loads, (out / "skipped.jsonl").read_text().splitlines())}


def test_media_outside_the_input_directory_are_not_packed(tmp_path):
    inputs, _ = _hostile_corpus(tmp_path)
    counts = _pack([inputs], tmp_path / "out")["counts"]
    assert counts == {"conversations": 6, "packed": 2, "image_packed": 2, "skipped:outside_root": 4}
    skipped = _skipped(tmp_path / "out")
    assert {key: r["reason"] for key, r in skipped.items()} == {
        "absolute": "outside_root", "dotdot": "outside_root", "symlink": "outside_root", "file-url": "outside_root"}
    assert "--media-root" in skipped["absolute"]["detail"]  # says how to admit it
    assert SECRET not in _packed_bytes(tmp_path / "out")


def test_a_media_root_admits_the_files_under_it(tmp_path):
    inputs, secret = _hostile_corpus(tmp_path)
    counts = _pack([inputs], tmp_path / "out", "--media-root", secret)["counts"]
    assert counts == {"conversations": 6, "packed": 6, "image_packed": 6}


def test_a_media_root_that_is_no_directory_is_refused_in_one_line(tmp_path, capsys):
    inputs, _ = _hostile_corpus(tmp_path)
    assert main(["pack", str(inputs), "--out", str(tmp_path / "out"), "--no-progress",
                 "--media-root", str(tmp_path / "typo")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--media-root" in err and "typo" in err
    assert not (tmp_path / "out").exists()


def test_a_fifo_device_or_directory_medium_is_never_opened(tmp_path):
    data = tmp_path / "data"
    (data / "folder.png").mkdir(parents=True)
    with fifo_unblocked(data / "pipe.png"):
        lines = [_image_line("fifo", "pipe.png"), _image_line("dir", "folder.png"),
                 _image_line("device", "/dev/zero")]
        write_jsonl(data / "convs.jsonl", lines)
        counts = _pack([data / "convs.jsonl"], tmp_path / "out", "--media-root", "/dev")["counts"]
    assert counts == {"conversations": 3, "skipped:not_a_file": 3}


def test_no_byte_of_a_referenced_file_is_in_a_skip_detail(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "notes.txt").write_bytes(SECRET)  # no image extension: its bytes are looked at
    inline = base64.b64encode(SECRET).decode()
    write_jsonl(data / "convs.jsonl", [_image_line("file", "notes.txt"),
                                       _image_line("inline", f"data:image/png;base64,{inline}")])
    _pack([data / "convs.jsonl"], tmp_path / "out")
    listed = (tmp_path / "out" / "skipped.jsonl").read_bytes()
    assert [r["reason"] for r in _skipped(tmp_path / "out").values()] == ["missing_media", "missing_media"]
    for fragment in (SECRET[:8], SECRET[:8].hex().encode(), SECRET[:4].hex().encode()):
        assert fragment not in listed


def test_audio_convert_of_conversations_keeps_to_the_roots(tmp_path):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    (elsewhere / "one.wav").write_bytes(digit("1").read_bytes())
    line = {"id": "c", "audios": [str(elsewhere / "one.wav")], "messages": _turns("<audio> Which digit?")}
    write_jsonl(data / "convs.jsonl", [line])
    counts = _convert(tmp_path, [data / "convs.jsonl"], kind="conversations")
    assert counts == {"in": 1, "skipped:outside_root": 1}
    assert main(["audio", "convert", "--kind", "conversations", str(data / "convs.jsonl"), "--out",
                 str(tmp_path / "out2"), "--workers", "0", "--no-progress", "--media-root", str(elsewhere)]) == 0
    assert [cut.id for cut in load_cuts(tmp_path / "out2")] == ["c/audio-0"]


def test_sft_resolves_media_with_the_same_roots(tmp_path, monkeypatch):
    data, elsewhere = tmp_path / "data", tmp_path / "elsewhere"
    data.mkdir()
    elsewhere.mkdir()
    (elsewhere / "one.wav").write_bytes(digit("1").read_bytes())
    line = {"id": "c", "audios": ["../elsewhere/one.wav"], "messages": _turns("<audio> Which digit?")}
    write_jsonl(data / "convs.jsonl", [line])
    for roots, reason in (((), "outside_root"), ((elsewhere,), None)):
        conversation = next(iter(read_conversations([data / "convs.jsonl"], media_roots=roots)))
        media = conversation.media()
        if reason is None:
            assert locate(conversation, media, media[0].slot).path == str(elsewhere / "one.wav")
        else:
            with pytest.raises(Skip) as caught:
                locate(conversation, media, media[0].slot)
            assert caught.value.reason == reason
    seen = {}
    import mmtok.sft.build

    def assemble(inputs, out, **kwargs):
        seen.update(kwargs)
        return WorkerRun(items=range(0, 1), num_items=1, counts={}, parts=[], sequences=0, already_done=False,
                         stopped=None, take_over=TakeOver(taken_over=[], held_by_others=[], failed={},
                                                          unfinished_failed=[]))

    monkeypatch.setattr(mmtok.sft.build, "assemble_worker", assemble)
    assert main(["sft", str(data / "convs.jsonl"), "--text-tokenizer", "tekken", "--out", str(tmp_path / "sft"),
                 "--media-root", str(elsewhere), "--rank", "0", "--world-size", "1", "--no-progress"]) == 0
    assert seen["media_roots"] == [elsewhere]


def test_a_symlink_out_of_an_audio_directory_is_outside_root_and_never_read(tmp_path):
    """`mmtok audio convert DIR`: a file link and a directory link inside DIR that lead elsewhere are
    `outside_root`, each named in the drop list; a link that stays inside DIR is read."""
    source, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    (source / "sub").mkdir(parents=True)
    (elsewhere / "private").mkdir(parents=True)
    (source / "one.wav").write_bytes(digit("1").read_bytes())
    (source / "sub" / "two.wav").write_bytes(digit("2").read_bytes())
    (source / "inside.wav").symlink_to("sub/two.wav")
    (elsewhere / "recording.wav").write_bytes(digit("3").read_bytes())
    (elsewhere / "private" / "call.wav").write_bytes(digit("4").read_bytes())
    (source / "linked.wav").symlink_to(elsewhere / "recording.wav")
    (source / "linked-dir").symlink_to(elsewhere / "private")
    out = tmp_path / "out"
    assert main(["audio", "convert", str(source), "--out", str(out), "--workers", "1", "--no-progress"]) == 0
    assert sorted(cut.id for cut in load_cuts(out)) == ["inside", "one", "sub/two"]
    counts = report(out)["counts"]
    assert counts["skipped:outside_root"] == 2
    assert_counts_add_up(counts)
    dropped = {record["key"]: record for record in dropped_records(out) if record["reason"] == "outside_root"}
    assert sorted(dropped) == ["linked-dir", "linked.wav"]  # a linked directory is named, never walked
    assert str(elsewhere / "recording.wav") in dropped["linked.wav"]["detail"]


def test_transcript_rows_naming_files_outside_the_directory_are_outside_root(tmp_path):
    source, elsewhere = tmp_path / "in", tmp_path / "elsewhere"
    source.mkdir()
    elsewhere.mkdir()
    (source / "one.wav").write_bytes(digit("1").read_bytes())
    (elsewhere / "x.wav").write_bytes(digit("2").read_bytes())
    table = tmp_path / "rows.tsv"
    table.write_text(f"path\ttext\none.wav\tone\n../elsewhere/x.wav\ttwo\n{elsewhere / 'x.wav'}\ttwo again\n")
    out = tmp_path / "out"
    assert main(["audio", "convert", str(source), "--transcripts", str(table), "--out", str(out), "--workers", "1",
                 "--no-progress"]) == 0
    assert [cut.id for cut in load_cuts(out)] == ["one"]
    assert {record["reason"] for record in dropped_records(out)} == {"outside_root"}
