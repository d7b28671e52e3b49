"""Fault injection: `mmtok encode` killed with SIGKILL at random instants, resumed until done."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import pytest
from encodekit import caption_corpus, chat_tokenizer

from mmtok.cli import main
from mmtok.codecs import emu35
from mmtok.formats.commitlog import COMMITS, is_done, part_dir, read_commits, read_stats
from mmtok.fsutil import sha256_file

FLAGS = ["--min-pixels", "1024", "--max-pixels", "2304", "--min-source-pixels", "100", "--token-budget", "40",
         "--max-batch-images", "1", "--window-rows", "9", "--mode", "image-text"]


@pytest.fixture(scope="module")
def forkserver():
    """Encode processes forked from a server that has torch and mmtok imported: a restart costs
    milliseconds instead of seconds of imports, so many kills fit in a fast test."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the server: the CPU "device" shares 2 cores with loaders
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo (imported by a codec load on the meta device) and pyarrow.dataset (filtered plan
    # reads) take seconds to import: do it once, in the server
    context.set_forkserver_preload(["torch", "torch._dynamo", "pyarrow.dataset", "mmtok.cli", "mmtok.encode.runner",
                                    "mmtok.codecs.emu35"])
    yield context
    if previous is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    else:
        os.environ["OMP_NUM_THREADS"] = previous


def _records(out) -> int:
    return len(read_commits(part_dir(out, 0))[0])


def test_sigkill_at_random_instants_then_resume_gives_the_clean_merged_bytes(tmp_path, forkserver):
    caption_corpus(tmp_path / "data")
    checkpoint = emu35.write_random_checkpoint(tmp_path / "ckpt")
    assert main(["scan", str(tmp_path / "data" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
                 "--no-progress"]) == 0
    text = chat_tokenizer(tmp_path / "tokenizer")  # loads in milliseconds: restarts stay cheap
    assert main(["plan", str(tmp_path / "manifest"), "--out", str(tmp_path / "plan"), "--quiet", *FLAGS,
                 "--text-tokenizer", str(text)]) == 0

    def argv(out):
        return ["encode", "--plan", str(tmp_path / "plan"), "--checkpoint", str(checkpoint), "--out", str(out),
                "--device", "cpu", "--loader-threads", "2", "--no-progress"]

    assert main(argv(tmp_path / "clean")) == 0 and main(["merge", str(tmp_path / "clean")]) == 0
    total = _records(tmp_path / "clean")
    per_batch = read_stats(part_dir(tmp_path / "clean", 0))["wall_s"] / total  # kill timing scales with speed
    killed = tmp_path / "killed"
    rng = random.Random(20240611)
    kills, torn, landed_at = 0, 0, []
    while not is_done(part_dir(killed, 0)):
        before = _records(killed) if (part_dir(killed, 0) / COMMITS).exists() else 0
        process = forkserver.Process(target=main, args=(argv(killed),))
        process.start()
        if kills < 12:
            # Kill after 0-2 more commits plus a random fraction of a batch's time: during start-up,
            # loading, encoding, or between a batch's data and its commit record.
            wait_for = before + rng.randint(0, 2)
            deadline = time.monotonic() + 60
            while _safe_records(killed) < wait_for and process.is_alive() and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(rng.uniform(0, 1.5 * per_batch))
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
                kills += 1
        process.join()
        landed_at.append(_safe_records(killed))
        if kills and kills % 3 == 0 and not is_done(part_dir(killed, 0)):
            torn += _tear_tails(part_dir(killed, 0), rng)  # what a kill in the middle of write() leaves
    assert kills >= 10, f"only {kills} kills landed before the rank finished (records after each: {landed_at})"
    assert len(set(landed_at)) >= 4 and min(landed_at) < total, landed_at
    assert main(["merge", str(killed)]) == 0
    for name in ("merged.bin", "merged.idx", "merged.provenance.jsonl"):
        assert sha256_file(killed / name) == sha256_file(tmp_path / "clean" / name), name
    assert torn >= 1


def _safe_records(out) -> int:
    try:
        return _records(out)
    except Exception:  # the log may be mid-append while we look
        return -1


def _tear_tails(directory, rng: random.Random) -> int:
    """Append partial bytes to every appended file, as a kill during write() would."""
    for name in ("tokens.bin", "provenance.jsonl", "carry.bin", COMMITS):
        with open(directory / name, "ab") as handle:
            handle.write(rng.randbytes(rng.randint(1, 37)).replace(b"\n", b"x"))
    return 1
