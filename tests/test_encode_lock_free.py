"""Lock-free writing (`mmtok encode --lock-free`, for file systems whose locks are node-local or missing): every
writer writes a private copy of its item and publishes it by one atomic rename. Two writers of one item (a
requeue race, a duplicate submission) are made to overlap at a known place -- the second writer's codec waits at
its second batch (encodekit.GATE) while the first publishes -- so what is proven does not depend on timing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from encodekit import GATE, planned_job
from mmtok.cli import main
from mmtok.formats.commitlog import read_commits
from mmtok.formats.partdir import is_done, part_dir, parts_root
from mmtok.formats.private_parts import PRIVATE_DIR
from mmtok.fsutil import sha256_file

MERGED = ("merged.bin", "merged.idx", "merged.provenance.jsonl")


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("lock-free")
    plan_dir, checkpoint = planned_job(root)
    (root / "site").mkdir()
    (root / "site" / "sitecustomize.py").write_text(GATE)
    clean = root / "clean"
    assert main(_argv(plan_dir, checkpoint, clean)[3:]) == 0 and main(["merge", str(clean)]) == 0
    return root, plan_dir, checkpoint


def _argv(plan_dir: Path, checkpoint: Path, out: Path) -> list[str]:
    return [sys.executable, "-m", "mmtok", "encode", "--plan", str(plan_dir), "--checkpoint", str(checkpoint),
            "--out", str(out), "--device", "cpu", "--loader-threads", "1", "--no-progress", "--lock-free"]


@pytest.fixture
def gated(job):
    """Starts a writer whose codec waits at its second batch until `gate/release` exists; any writer still running
    when the test ends (a failed assertion before the release) is killed, never left waiting at its gate."""
    root, started = job[0], []

    def start(argv: list[str], gate: Path) -> subprocess.Popen:
        gate.mkdir()
        env = {**os.environ, "PYTHONPATH": str(root / "site"), "GATE_AT": "2", "GATE_DIR": str(gate),
               "OMP_NUM_THREADS": "1"}
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        started.append(process)
        deadline = time.monotonic() + 120
        while not (gate / "arrived").exists():
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "the gated writer never reached its second batch"
            time.sleep(0.01)
        return process

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_a_copy_published_second_is_checked_identical_and_discarded(job, gated, tmp_path):
    root, plan_dir, checkpoint = job
    out = tmp_path / "out"
    second = gated(_argv(plan_dir, checkpoint, out), tmp_path / "gate")  # mid-item, in its private copy
    [private] = (parts_root(out) / PRIVATE_DIR).iterdir()
    assert private.name == f"part-00000.{os.uname().nodename}.{second.pid}" and not part_dir(out, 0).exists()
    first = subprocess.run([*_argv(plan_dir, checkpoint, out), "--json"], capture_output=True, text=True)
    assert first.returncode == 0, first.stderr  # it wrote and published its copy:
    result = json.loads(first.stdout)  # the published part, its dataset (looked for after the rename), none discarded
    assert (result["parts"], result["dataset"], result["discarded_copies"]) == ([str(part_dir(out, 0))], True, [])
    assert is_done(part_dir(out, 0)) and private.exists()
    (tmp_path / "gate" / "release").touch()
    _, err = second.communicate(timeout=300)
    assert second.returncode == 0, err
    assert "1 item had been published by another writer first: this worker's copies were identical" in err
    assert not private.exists() and not any((parts_root(out) / PRIVATE_DIR).iterdir())
    assert main(["merge", str(out)]) == 0
    for name in MERGED:
        assert sha256_file(out / name) == sha256_file(root / "clean" / name), name


def test_a_copy_that_differs_from_the_published_part_is_refused_and_kept(job, gated, tmp_path):
    root, plan_dir, checkpoint = job
    out = tmp_path / "out"
    second = gated(_argv(plan_dir, checkpoint, out), tmp_path / "gate")
    assert subprocess.run(_argv(plan_dir, checkpoint, out), capture_output=True).returncode == 0
    provenance = part_dir(out, 0) / "provenance.jsonl"
    provenance.write_bytes(provenance.read_bytes().replace(b'"key"', b'"kez"', 1))  # the published one is not ours
    (tmp_path / "gate" / "release").touch()
    _, err = second.communicate(timeout=300)
    assert second.returncode == 2 and "Traceback" not in err, err
    assert f"{part_dir(out, 0)} was published by another writer but its provenance.jsonl differs" in err
    [kept] = (parts_root(out) / PRIVATE_DIR).iterdir()
    assert is_done(kept)  # this writer's finished copy, kept for inspection


def test_a_killed_writers_private_copy_is_adopted_on_its_host_and_resumed_from_its_commit_log(job, gated,
                                                                                                  tmp_path):
    root, plan_dir, checkpoint = job
    out = tmp_path / "out"
    killed = gated(_argv(plan_dir, checkpoint, out), tmp_path / "gate")
    [private] = (parts_root(out) / PRIVATE_DIR).iterdir()
    deadline = time.monotonic() + 60
    while len(read_commits(private)[0]) < 1:  # its first batch is committed while the second waits on the device
        assert time.monotonic() < deadline, "the first batch was never committed"
        time.sleep(0.01)
    killed.send_signal(signal.SIGKILL)
    killed.communicate()
    assert len(read_commits(private)[0]) == 1
    rerun = subprocess.run(_argv(plan_dir, checkpoint, out), capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert not private.exists() and is_done(part_dir(out, 0))  # adopted (renamed), finished, published
    assert len(read_commits(part_dir(out, 0))[0]) == len(read_commits(part_dir(root / "clean", 0))[0])
    assert main(["merge", str(out)]) == 0
    for name in MERGED:
        assert sha256_file(out / name) == sha256_file(root / "clean" / name), name
