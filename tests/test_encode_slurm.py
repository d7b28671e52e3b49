"""SLURM arrays over work items: the script `mmtok encode --print-sbatch` prints, run by bash as SLURM would run an
array task (SLURM_ARRAY_* set, a stand-in `scontrol` that records its arguments), stopped by USR1 (what
`--signal=B:USR1@120` sends before the time limit) and by TERM (preemption, scancel), then resumed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from encodekit import GATE, planned_items
from mmtok.cli import main
from mmtok.formats.commitlog import read_commits
from mmtok.formats.partdir import is_done, part_dir
from mmtok.formats.plan import Plan
from mmtok.fsutil import WriterLock, sha256_file
from mmtok.launch import STOPPED_EXIT


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """A plan of a few work items of several batches, the clean merged bytes, and the printed script."""
    root = tmp_path_factory.mktemp("slurm")
    plan, checkpoint = planned_items(root, 4)
    items = Plan.open(plan).work_items()
    common = ["--plan", str(plan), "--checkpoint", str(checkpoint), "--device", "cpu", "--loader-threads", "1"]
    assert main(["encode", *common, "--out", str(root / "clean"), "--no-progress", "--world-size", "1"]) == 0
    assert main(["merge", str(root / "clean")]) == 0
    return {"root": root, "plan": plan, "items": items, "common": common}


def _script(job, out: Path, capsys, monkeypatch, *extra: str) -> str:
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # the script names this interpreter, whatever PATH finds
    capsys.readouterr()
    assert main(["encode", *job["common"], "--out", str(out), "--print-sbatch", "2", *extra]) == 0
    return capsys.readouterr().out


def test_the_printed_script_is_an_array_throttled_to_the_gpus_one_task_per_gpu_or_per_item(job, tmp_path, capsys,
                                                                                          monkeypatch):
    count = len(job["items"])
    text = _script(job, tmp_path / "out", capsys, monkeypatch)  # by default one task per GPU: 2
    assert "#SBATCH --array=0-1%2\n" in text
    for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@120", "#SBATCH --gpus=1", "#SBATCH --cpus-per-task=3"):
        assert line + "\n" in text
    assert f'{sys.executable} -m mmtok encode --plan {job["plan"]} ' in text  # this mmtok, not the first on PATH
    assert f"--out {tmp_path / 'out'} " in text and "--no-progress --device cpu \\\n" in text
    assert '\n    --rank "$SLURM_ARRAY_TASK_ID" --world-size 2 &\n' in text
    (tmp_path / "encode.sbatch").write_text(text)
    subprocess.run(["bash", "-n", str(tmp_path / "encode.sbatch")], check=True)
    assert not (tmp_path / "out").exists()  # printing encodes nothing
    per_item = _script(job, tmp_path / "out", capsys, monkeypatch, "--world-size", str(count))
    assert f"#SBATCH --array=0-{count - 1}%2\n" in per_item and f"--world-size {count} &" in per_item
    for extra, message in ((("--print-sbatch", "0"), "at least 1"),
                           (("--print-sbatch", "2", "--rank", "1"), "drop --rank"),
                           (("--print-sbatch", "2", "--device", "cuda:1"), "drop --device")):
        assert main(["encode", *job["common"], "--out", str(tmp_path / "out"), *extra]) == 2
        assert message in capsys.readouterr().err
    assert main(["encode", *job["common"], "--out", str(tmp_path / "o\ntouch PWNED #"), "--print-sbatch", "2"]) == 2
    assert "control characters" in capsys.readouterr().err


def _array(job, tmp_path: Path, out: Path, capsys, monkeypatch) -> Path:
    """The printed script of one task per item, the gate (sitecustomize) and a stand-in scontrol beside it."""
    script = tmp_path / "encode.sbatch"
    script.write_text(_script(job, out, capsys, monkeypatch, "--world-size", str(len(job["items"]))))
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(GATE)
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "scontrol").write_text('#!/bin/sh\necho "$@" >> "$SCONTROL_LOG"\n')
    (tmp_path / "bin" / "scontrol").chmod(0o755)
    return script


def _run_task(script: Path, task: int, gate: Path | None, log: Path, at: str = "2") -> subprocess.Popen:
    """Array task `task` of job 4242, as SLURM's batch step runs it: bash, the SLURM_ARRAY_* variables."""
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(task), "SLURM_ARRAY_JOB_ID": "4242", "SLURM_JOB_ID": "4243",
           "PATH": f"{script.parent / 'bin'}{os.pathsep}{os.environ['PATH']}",
           "SCONTROL_LOG": str(script.parent / "scontrol.log")}
    if gate is not None:
        gate.mkdir(exist_ok=True)
        env.update(PYTHONPATH=str(script.parent / "site"), GATE_AT=at, GATE_DIR=str(gate))
    return subprocess.Popen(["bash", str(script)], env=env, stdout=log.open("ab"), stderr=subprocess.STDOUT)


def _wait_for(condition, process: subprocess.Popen, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert process.poll() is None, f"{what}: the task exited ({process.returncode}) first"
        assert time.monotonic() < deadline, f"{what}: nothing after {timeout} s"
        time.sleep(0.01)


def _stop_mid_item(script: Path, task: int, number: signal.Signals, tag: str, at: str = "2") -> int:
    """Run the task until its second batch of this session is on the device (`at`="load": until it loads the
    model), send `number` to the batch shell, let it go on; returns the shell's exit status."""
    gate, log = script.parent / f"gate-{tag}", script.parent / f"task-{tag}.log"
    process = _run_task(script, task, gate, log, at)
    _wait_for((gate / "arrived").exists, process, "the second batch")
    process.send_signal(number)
    _wait_for(lambda: f"{number.name} received" in log.read_text(errors="replace"), process, "the stop request")
    (gate / "release").touch()
    return process.wait(timeout=120)


def test_usr1_commits_the_batch_in_flight_and_requeues_the_task_term_stops_without_requeue_merged_bytes_equal(
        job, tmp_path, capsys, monkeypatch):
    items = job["items"]
    task = int((items[:, 1] - items[:, 0]).argmax())  # one task per item: the item with the most batches
    assert items[task, 1] - items[task, 0] >= 5
    out = tmp_path / "out"
    script = _array(job, tmp_path, out, capsys, monkeypatch)
    part = part_dir(out, task)

    # before the time limit: 2 batches committed (the one in flight included), part left unfinished and unlocked
    assert _stop_mid_item(script, task, signal.SIGUSR1, "usr1") == STOPPED_EXIT
    assert (tmp_path / "scontrol.log").read_text() == f"requeue 4242_{task}\n"
    assert len(read_commits(part)[0]) == 2 and not is_done(part) and WriterLock.holder(part) is None
    log = (tmp_path / "task-usr1.log").read_text()
    assert f"stopped on SIGUSR1 before batch {items[task, 0] + 2:,} of work item {task}" in log

    # the requeued task resumes; preemption (TERM) stops it the same way, and it is not requeued by the script
    assert _stop_mid_item(script, task, signal.SIGTERM, "term") == STOPPED_EXIT
    assert (tmp_path / "scontrol.log").read_text() == f"requeue 4242_{task}\n"
    assert len(read_commits(part)[0]) == 4 and not is_done(part)

    finish = _run_task(script, task, None, tmp_path / "task-finish.log")
    assert finish.wait(timeout=300) == 0 and is_done(part)
    for other in range(len(items)):
        if other != task:
            assert main(["encode", *job["common"], "--out", str(out), "--no-progress", "--rank", str(other),
                         "--world-size", str(len(items))]) == 0
    assert main(["merge", str(out)]) == 0
    for name in ("merged.bin", "merged.idx", "merged.provenance.jsonl"):
        assert sha256_file(out / name) == sha256_file(job["root"] / "clean" / name), name


class _AfterItem:
    """A stop request that comes while the last batch of `item` is committed: seen once the item is finished."""

    name = "SIGUSR1"

    def __init__(self, out: Path, item: int):
        self.part = part_dir(out, item)

    def is_set(self) -> bool:
        return is_done(self.part)


def test_a_stop_during_an_items_last_batch_finishes_that_item_and_starts_no_other(job, tmp_path):
    from mmtok.codecs import emu35
    from mmtok.encode.runner import EncodeOptions, encode_image_rank
    from mmtok.workers import ItemStop

    items, out = job["items"], tmp_path / "out"
    codec = emu35.load(job["common"][job["common"].index("--checkpoint") + 1], "cpu")
    options = EncodeOptions(loader_threads=1, progress=False, stop=_AfterItem(out, 0))
    result = encode_image_rank(job["plan"], out, codec, rank=0, world_size=1, options=options)
    assert result.stopped == ItemStop("SIGUSR1", 1, int(items[1, 0]))
    assert is_done(part_dir(out, 0)) and not part_dir(out, 1).exists() and result.items_done_before == 0


def test_a_stop_while_the_model_loads_commits_nothing_and_exits_for_a_requeue(job, tmp_path, capsys, monkeypatch):
    items, out = job["items"], tmp_path / "out"
    script = _array(job, tmp_path, out, capsys, monkeypatch)
    assert _stop_mid_item(script, 1, signal.SIGUSR1, "load", at="load") == STOPPED_EXIT
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242_1\n"
    log = (tmp_path / "task-load.log").read_text()
    assert f"stopped on SIGUSR1 before batch {items[1, 0]:,} of work item 1" in log and "Traceback" not in log
    assert not part_dir(out, 1).exists()
