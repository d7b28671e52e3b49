"""Fault injection: `mmtok encode` killed with SIGKILL at scheduled points, torn, resumed until done."""

from __future__ import annotations

import os
import random
import signal
import sys
import time
from functools import partial

from encodekit import ONE_IMAGE_BATCHES, planned_job
from mmtok.cli import main
from mmtok.codecs import emu35
from mmtok.formats.commitlog import read_commits
from mmtok.formats.partdir import COMMITS, is_done, part_dir
from mmtok.formats.plan import Plan
from mmtok.fsutil import sha256_file


def _records(out, part: int = 0) -> int:
    return len(read_commits(part_dir(out, part))[0])


def _gated_encode(argv: list[str], arrived, gate) -> None:
    """A child `mmtok encode` whose codec announces each batch on `arrived` and then waits for one permit
    from `gate`: it commits exactly the batches the test allows, so it is always alive to be killed."""
    encode = emu35.Emu35Codec.encode

    def gated(self, pixels):
        arrived.release()
        gate.acquire()
        return encode(self, pixels)

    emu35.Emu35Codec.encode = gated  # this forked child only
    _encode(argv)


def _encode(argv: list[str]) -> None:
    sys.exit(main(argv))  # the exit status becomes the child's exitcode


# (where the kill lands, batches allowed), tearing tails after the kills marked `+tear`:
#   startup   at a random instant of start-up/resume (imports done, plan/part/lock/recovery), no commit yet
#   device    once the rank waits at the device for its first batch: loaders running, nothing committed
#   between   after exactly `allowed` more commits, at a random instant before the next batch may start
#   inflight  at a random instant while the last allowed batch is encoded or committed
SCHEDULE = [("startup", 0), ("device", 0), ("between", 2), ("startup+tear", 0), ("inflight", 3), ("between", 1),
            ("startup", 0), ("device+tear", 0), ("between", 3), ("inflight", 2), ("between+tear", 2), ("device", 0)]


def test_sigkill_at_startup_between_commits_and_in_flight_then_resume_gives_the_clean_merged_bytes(
        tmp_path, forkserver):
    plan_dir, checkpoint = planned_job(tmp_path)

    def argv(out):
        return ["encode", "--plan", str(plan_dir), "--checkpoint", str(checkpoint), "--out", str(out),
                "--device", "cpu", "--loader-threads", "2", "--no-progress"]

    assert main(argv(tmp_path / "clean")) == 0 and main(["merge", str(tmp_path / "clean")]) == 0
    total = _records(tmp_path / "clean")
    assert total > sum(allowed for _, allowed in SCHEDULE)  # no scheduled run can finish the rank
    killed, rng = tmp_path / "killed", random.Random(20240611)
    landed = []
    for kind, allowed in SCHEDULE:
        before = _records(killed)
        arrived, gate = forkserver.Semaphore(0), forkserver.Semaphore(0)
        process = forkserver.Process(target=_gated_encode, args=(argv(killed), arrived, gate))
        process.start()
        for _ in range(allowed):
            gate.release()
        if kind.startswith("startup"):
            time.sleep(rng.uniform(0, 0.3))
        elif kind.startswith("device"):
            _wait_until(partial(arrived.acquire, timeout=0.01), process, kind)
            time.sleep(rng.uniform(0, 0.02))
        elif kind.startswith("between"):
            _wait_until(lambda before=before, allowed=allowed: _safe_records(killed) >= before + allowed, process, kind)
            time.sleep(rng.uniform(0, 0.02))
        else:  # inflight: the last allowed batch has reached the device
            for _ in range(allowed):
                _wait_until(partial(arrived.acquire, timeout=0.01), process, kind)
            time.sleep(rng.uniform(0, 0.03))
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        assert process.exitcode == -signal.SIGKILL, (kind, process.exitcode)  # killed, not finished or failed
        after = _records(killed)
        landed.append((kind, before, after))
        if kind.endswith("+tear"):
            _tear_tails(part_dir(killed, 0), rng)  # what a kill in the middle of write() leaves
    assert len(landed) == len(SCHEDULE) == 12 and not is_done(part_dir(killed, 0))
    for (kind, allowed), (_, before, after) in zip(SCHEDULE, landed, strict=True):
        if kind.startswith("inflight"):
            assert before <= after <= before + allowed, landed
        else:  # nothing commits at start-up or at the device; `between` lands after exactly `allowed` commits
            assert after == before + allowed, landed
    assert landed[0][1] == 0 and 0 < landed[-1][2] < total, landed

    process = forkserver.Process(target=_encode, args=(argv(killed),))  # resume, uninterrupted, to the end
    process.start()
    process.join()
    assert process.exitcode == 0 and is_done(part_dir(killed, 0)) and _records(killed) == total
    assert main(["merge", str(killed)]) == 0
    for name in ("merged.bin", "merged.idx", "merged.provenance.jsonl"):
        assert sha256_file(killed / name) == sha256_file(tmp_path / "clean" / name), name


def _wait_until(condition, process, kind: str, timeout: float = 60) -> None:
    """Poll `condition` while the child runs; fail naming `kind` if it exits or takes over `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.is_alive(), f"{kind}: the encode process exited ({process.exitcode}) before the kill"
        assert time.monotonic() < deadline, f"{kind}: nothing happened for {timeout} s"
        time.sleep(0.001)


def _safe_records(out, part: int = 0) -> int:
    try:
        return _records(out, part)
    except Exception:  # the log may be mid-append while we look
        return -1


def _tear_tails(directory, rng: random.Random) -> None:
    """Append partial bytes to every appended file, as a kill during write() would."""
    for name in ("tokens.bin", "provenance.jsonl", "carry.bin", COMMITS):
        with open(directory / name, "ab") as handle:
            handle.write(rng.randbytes(rng.randint(1, 37)).replace(b"\n", b"x"))


def _worker(argv: list[str], ranks: list[int], world_size: int) -> None:
    """One GPU of a SLURM array: the ranks it is handed, one after another."""
    for rank in ranks:
        if main([*argv, "--rank", str(rank), "--world-size", str(world_size)]):
            sys.exit(1)


def _run_workers(forkserver, argv: list[str], world_size: int, shares: list[list[int]]) -> None:
    workers = [forkserver.Process(target=_worker, args=(argv, ranks, world_size)) for ranks in shares]
    for process in workers:
        process.start()
    for process in workers:
        process.join()
    assert [p.exitcode for p in workers] == [0] * len(workers)


def test_merged_bytes_are_the_same_for_any_workers_and_after_a_kill_inside_an_item_resumed_by_another_count(
        tmp_path, forkserver):
    plan_dir, checkpoint = planned_job(tmp_path)
    whole = Plan.open(plan_dir)  # about a tenth of the job per work item: items of several batches
    seconds = whole.item_costs().sum() * whole.meta.parameters["cost_model"]["seconds_per_unit"] / 10
    plan = tmp_path / "plan-items"
    assert main(["plan", str(tmp_path / "manifest"), "--out", str(plan), "--quiet", *ONE_IMAGE_BATCHES,
                 "--text-tokenizer", str(tmp_path / "tokenizer"), "--world-size", "6", "--item-seconds",
                 str(seconds)]) == 0
    opened = Plan.open(plan)
    assert len(opened.work_items()) >= 8 and (opened.work_items()[:, 1] - opened.work_items()[:, 0] > 1).all()

    def argv(out):
        return ["encode", "--plan", str(plan), "--checkpoint", str(checkpoint), "--out", str(out), "--device", "cpu",
                "--loader-threads", "1", "--no-progress"]

    at_once, killed, two = tmp_path / "at-once", tmp_path / "killed", tmp_path / "two"
    _run_workers(forkserver, argv(at_once), 6, [[worker] for worker in range(6)])
    _run_workers(forkserver, argv(two), 2, [[0], [1]])
    # worker 3 of 6 dies after the first commit of an item of more than one batch; the job is then resumed by
    # 4 workers (another count): they skip nothing of it, and whoever takes that item resumes its commit log
    item = next(i for i in opened.worker_items(3, 6) if opened.work_items()[i, 1] - opened.work_items()[i, 0] > 1)
    first = opened.worker_items(3, 6).start
    arrived, gate = forkserver.Semaphore(0), forkserver.Semaphore(0)
    dying = forkserver.Process(target=_gated_encode,
                               args=([*argv(killed), "--rank", "3", "--world-size", "6"], arrived, gate))
    dying.start()
    for _ in range(sum(int(e - s) for s, e in opened.work_items()[first:item]) + 1):
        gate.release()  # every batch of the items before it, and the first batch of the item
    _wait_until(lambda: _safe_records(killed, item) >= 1, dying, "the dying worker")
    os.kill(dying.pid, signal.SIGKILL)
    dying.join()
    assert dying.exitcode == -signal.SIGKILL and not is_done(part_dir(killed, item))
    assert 1 <= _records(killed, item) < len(read_commits(part_dir(at_once, item))[0])
    _run_workers(forkserver, argv(killed), 4, [[3], [1], [2], [0]])
    for out in (at_once, killed, two):
        assert main(["merge", str(out)]) == 0
    for name in ("merged.bin", "merged.idx", "merged.provenance.jsonl"):
        assert sha256_file(killed / name) == sha256_file(at_once / name) == sha256_file(two / name), name
