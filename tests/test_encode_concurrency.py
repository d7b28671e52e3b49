"""One writer per part: two `mmtok encode` processes for the same rank and --out, started together.

What the test proves does not depend on timing: as soon as one process holds the part's lock
(seen in /proc/locks) it is frozen with SIGSTOP, so the other one necessarily meets a held lock. With
--no-take-over it must refuse with a non-zero exit naming the holder; by default (take-over) it leaves the
item to its holder and ends without writing anything. Only then is the holder let go to finish.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from encodekit import planned_job
from mmtok.cli import main
from mmtok.formats.partdir import is_done, part_dir
from mmtok.fsutil import WriterLock, sha256_file

MERGED = ("merged.bin", "merged.idx", "merged.provenance.jsonl", "merged.skipped.jsonl")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return planned_job(tmp_path_factory.mktemp("concurrency"))


def _argv(plan_dir: Path, checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "mmtok", "encode", "--plan", str(plan_dir), "--checkpoint", str(checkpoint),
            "--out", str(out), "--device", "cpu", "--loader-threads", "1", "--no-progress", *extra]


def _lock_holder(lock: Path, pids: set[int]) -> int | None:
    """The pid among `pids` that holds a POSIX lock on file `lock`, from /proc/locks."""
    try:
        inode = os.stat(lock).st_ino
    except FileNotFoundError:
        return None
    for line in Path("/proc/locks").read_text().splitlines():
        fields = line.split()
        if "POSIX" in fields and fields[-3].endswith(f":{inode}") and int(fields[-4]) in pids:
            return int(fields[-4])
    return None


@pytest.mark.parametrize("take_over", [False, True], ids=["no-take-over", "take-over"])
@pytest.mark.parametrize("attempt", range(2))
def test_two_encodes_of_one_rank_started_together_give_one_writer_and_one_refusal(job, tmp_path, attempt, take_over):
    plan_dir, checkpoint = job
    clean = plan_dir.parent / "clean"
    if not is_done(part_dir(clean, 0)):
        assert main(_argv(plan_dir, checkpoint, clean)[3:]) == 0 and main(["merge", str(clean)]) == 0
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    extra = () if take_over else ("--no-take-over",)
    processes = [subprocess.Popen(_argv(plan_dir, checkpoint, out, *extra), env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
    by_pid = {p.pid: p for p in processes}
    deadline = time.monotonic() + 120
    holder = None
    lock = part_dir(out, 0) / WriterLock.NAME
    while holder is None and time.monotonic() < deadline and all(p.poll() is None for p in processes):
        holder = _lock_holder(lock, set(by_pid))
        # a holder names itself in the lock file just after taking the lock: freeze it only once it has (else
        # the refused process reads an empty file, "holder unknown" -- a race this test once lost), and only
        # while it still holds the lock (its start-up check takes and drops it at once)
        if holder is not None and f"pid {holder}," in lock.read_text("utf-8", errors="replace"):
            os.kill(holder, signal.SIGSTOP)  # freeze the writer while it holds the lock
            if _lock_holder(lock, {holder}) != holder:
                os.kill(holder, signal.SIGCONT)
                holder = None
        else:
            holder = None
        time.sleep(0.001)
    assert holder is not None, "neither process took the part's lock: " + str([p.communicate() for p in processes])
    try:
        other = next(p for pid, p in by_pid.items() if pid != holder)
        _, err = other.communicate(timeout=120)
    finally:
        os.kill(holder, signal.SIGCONT)
    _, holder_err = by_pid[holder].communicate(timeout=300)
    assert by_pid[holder].returncode == 0, holder_err
    if take_over:  # it leaves the held item to its holder, finds nothing else to take, and says so
        assert other.returncode == 0, err
        assert "encoded nothing: every work item is finished or held by another worker" in err, err
        assert "left 1 own item to the workers holding them: 0" in err and "Traceback" not in err, err
    else:
        assert other.returncode != 0, err
        assert f"pid {holder}" in err and "being written by another process" in err and "Traceback" not in err, err
    assert main(["merge", str(out)]) == 0
    for name in MERGED:
        assert sha256_file(out / name) == sha256_file(clean / name), name
