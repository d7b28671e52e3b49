"""`mmtok encode --executor ray` on a local Ray cluster started by the test (CPU workers, the tiny random Emu3.5
codec): merged bytes identical to one process's, with a worker killed inside an item (its item handed out again
and resumed from its commit log) and with a stalled worker (its item backed up at the tail; the backup's copy is
the part). Faults are made from outside, at known places: the worker writing an item with a commit is killed;
the worker holding the last item is stopped (SIGSTOP) until the backup has finished."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from encodekit import planned_items
from mmtok.cli import main
from mmtok.formats.commitlog import read_commits
from mmtok.formats.partdir import parts_root
from mmtok.formats.plan import Plan
from mmtok.formats.private_parts import PRIVATE_DIR
from mmtok.fsutil import sha256_file

ray = pytest.importorskip("ray")
MERGED = ("merged.bin", "merged.idx", "merged.provenance.jsonl")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A plan of 6 work items of several batches each, its one-process merged bytes, and a local Ray cluster."""
    root = tmp_path_factory.mktemp("ray")
    plan, checkpoint = planned_items(root, 6)
    items = Plan.open(plan).work_items()
    assert len(items) >= 4 and (items[:, 1] - items[:, 0] > 1).all()
    one = root / "one"
    assert main(_argv(plan, checkpoint, one)) == 0 and main(["merge", str(one)]) == 0
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, object_store_memory=100 * 1024 * 1024,
             runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    yield plan, checkpoint, {name: sha256_file(one / name) for name in MERGED}
    ray.shutdown()


def _argv(plan: Path, checkpoint: Path, out: Path, *extra: str) -> list[str]:
    return ["encode", "--plan", str(plan), "--checkpoint", str(checkpoint), "--out", str(out), "--device", "cpu",
            "--loader-threads", "1", "--no-progress", *extra]


def _merged(out: Path) -> dict:
    assert main(["merge", str(out)]) == 0
    return {name: sha256_file(out / name) for name in MERGED}


def _private_copies(out: Path) -> list[Path]:
    root = parts_root(out) / PRIVATE_DIR
    return sorted(root.iterdir()) if root.is_dir() else []


def _watch(out: Path, act, stop: threading.Event) -> threading.Thread:
    """Call act(private copy) for each private copy until it returns True (in a thread, polling)."""
    def loop():
        while not stop.is_set():
            for copy in _private_copies(out):
                if act(copy):
                    return
            time.sleep(0.02)

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    return thread


def test_two_workers_give_the_bytes_of_one_process_and_a_rerun_has_nothing_to_do(job, tmp_path, capsys):
    plan, checkpoint, reference = job
    out = tmp_path / "out"
    assert main(_argv(plan, checkpoint, out, "--executor", "ray", "--ray-workers", "2", "--json")) == 0
    assert _merged(out) == reference
    assert not _private_copies(out)
    assert main(_argv(plan, checkpoint, out, "--executor", "ray")) == 0
    assert "is finished; nothing to do" in capsys.readouterr().err


def test_a_worker_killed_inside_an_item_has_it_resumed_elsewhere(job, tmp_path, capsys):
    plan, checkpoint, reference = job
    out, stop, killed = tmp_path / "out", threading.Event(), []

    def kill_after_first_commit(copy: Path) -> bool:
        try:
            committed = len(read_commits(copy)[0])
        except Exception:  # noqa: BLE001 (a copy being created: look again)
            return False
        if committed >= 1:
            pid = int(copy.name.rsplit(".", 1)[1])
            killed.append((copy.name, committed))
            os.kill(pid, signal.SIGKILL)
            return True
        return False

    watcher = _watch(out, kill_after_first_commit, stop)
    assert main(_argv(plan, checkpoint, out, "--executor", "ray", "--ray-workers", "2")) == 0
    stop.set()
    watcher.join()
    err = capsys.readouterr().err
    assert killed and "retries 1 (1 worker lost)" in err, err
    assert _merged(out) == reference
    assert not _private_copies(out)  # the killed copy was adopted and resumed, or removed once its item was published


def test_a_stalled_worker_s_item_is_backed_up_and_the_backup_is_the_part(job, tmp_path, capsys):
    """The first copy of the last item to commit is stopped (SIGSTOP) after its first commit, before its last: it
    cannot publish, so another copy, which only a backup makes, must be the part. (Which copy that is depends on
    where the item was when the tail came: running, a backup of it is the part; still waiting behind another
    item, the backup runs first and is the one stopped, and the waiting call, cancelled or not, gets the item
    done -- tests/test_ray_scheduling.py replays each case.) A stop that lands after the copy was complete (the
    worker raced past the check) proves nothing, and the run is made again on a fresh output (at most 3 times)."""
    plan, checkpoint, reference = job
    items = Plan.open(plan).work_items()
    last = len(items) - 1
    batches = int(items[last, 1] - items[last, 0])
    for attempt in range(3):
        out, stop, stalled, first = tmp_path / f"out-{attempt}", threading.Event(), [], []

        def stall_the_last_item(copy: Path, stalled: list = stalled, first: list = first) -> bool:
            if not copy.name.startswith(f"part-{last:05d}."):
                return False
            first[:] = first or [copy.name]  # the original: a backup's copy appears later (the tail may start one)
            if copy.name != first[0] or not _commits(copy):
                return False
            pid = int(copy.name.rsplit(".", 1)[1])
            os.kill(pid, signal.SIGSTOP)  # as slow as can be: it never finishes its item
            stalled.append((pid, copy.is_dir() and _commits(copy) < batches))  # stopped before its last commit?
            return True

        watcher = _watch(out, stall_the_last_item, stop)
        try:
            assert main(_argv(plan, checkpoint, out, "--executor", "ray", "--ray-workers", "2")) == 0
        finally:
            stop.set()
            watcher.join()
            for pid, _ in stalled:
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        err = capsys.readouterr().err
        if stalled and stalled[0][1]:
            break
    else:
        pytest.fail("the worker of the last item finished it before it could be stopped, three times")
    backups = re.search(r"backups (\d+) \((\d+) finished first\)", err)
    assert backups and int(backups[1]) >= 1, err
    assert _merged(out) == reference
    assert not _private_copies(out)  # the stalled worker was stopped and its copy removed


def _commits(copy: Path) -> int:
    try:
        return len(read_commits(copy)[0])
    except Exception:  # noqa: BLE001 (a copy being created or renamed away: none seen)
        return 0


def test_a_killed_driver_is_started_again_and_finishes_from_the_parts_on_disk(job, tmp_path):
    """The driver (a process of its own, with its own local cluster) is killed with its workers once two items
    are published; started again, it does only what is left, adopting the killed workers' unfinished copies."""
    import subprocess
    import sys

    from mmtok.formats.partdir import is_done, part_dir

    plan, checkpoint, reference = job
    out = tmp_path / "out"
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "OMP_NUM_THREADS": "1"}
    driver = subprocess.Popen([sys.executable, "-m", "mmtok", *_argv(plan, checkpoint, out, "--executor", "ray",
                                                                      "--ray-workers", "2")],
                              env=env, stdout=subprocess.DEVNULL, stderr=(tmp_path / "driver.log").open("wb"),
                              start_new_session=True)
    deadline = time.monotonic() + 120
    while sum(is_done(part_dir(out, i)) for i in range(len(Plan.open(plan).work_items()))) < 2:
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()
        assert time.monotonic() < deadline, "the driver published fewer than two items in 120 s"
        time.sleep(0.05)
    os.killpg(driver.pid, signal.SIGKILL)  # the driver, its local cluster and its workers
    driver.wait()
    assert main(_argv(plan, checkpoint, out, "--executor", "ray", "--ray-workers", "2")) == 0
    assert _merged(out) == reference
    assert not _private_copies(out)


def test_a_worker_that_cannot_load_the_codec_and_a_device_index_are_one_line(job, tmp_path, capsys):
    import shutil

    plan, checkpoint, _ = job
    damaged = tmp_path / "ckpt"
    shutil.copytree(checkpoint, damaged)
    weights = max(damaged.rglob("*"), key=lambda p: p.stat().st_size if p.is_file() else 0)
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(_argv(plan, damaged, tmp_path / "out", "--executor", "ray", "--ray-workers", "1")) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert "a Ray worker could not start:" in line, line
    argv = _argv(plan, checkpoint, tmp_path / "out2", "--executor", "ray")
    argv[argv.index("cpu")] = "cuda:1"
    assert main(argv) == 2
    assert "--device 'cuda:1' does not apply" in capsys.readouterr().err
