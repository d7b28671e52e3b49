"""`mmtok status OUT`: states, figures and balance read from real parts, without changing a byte of them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest

from encodekit import caption_env, one_torch_thread, plan
from mmtok.cli import main
from mmtok.errors import MmtokError
from mmtok.formats import skips
from mmtok.formats.commitlog import PartWriter
from mmtok.formats.partdir import COMMITS, check_part_free, part_dir
from mmtok.formats.plan import BATCHES_FILE, Plan
from mmtok.fsutil import WriterLock
from mmtok.ranks import imbalance, rank_costs
from mmtok.tools.status import INPUT_STAGES, JobStatus, PartStatus, job_status

# A writer in another process: commits two batches, says so, then holds the part's lock until told to stop.
HOLDER = r"""
import json, sys, numpy as np
from mmtok.formats.commitlog import PartWriter
part = PartWriter(sys.argv[1], json.loads(sys.argv[2]))
for unit in range(2):
    part.commit(unit, [np.arange(5, dtype=np.int32)], [{"unit": unit}],
                {"images_written": 1, "tokens": 5, "wall_ms": 1000, "device_busy_ms": 500})
print("holding", flush=True)
sys.stdin.readline()
part.close()
"""
PROBE = "import sys; from mmtok.formats.partdir import check_part_free; check_part_free(sys.argv[1])"


def image_identity(part: int, num_parts: int, batches: tuple[int, int], **extra) -> dict:
    return {"modality": "image", "part": part, "num_parts": num_parts, "part_batches": list(batches), **extra}


def write_part(out: Path, identity: dict, units: range, *, wall_ms: int = 1000, finish: bool = False,
               counts: dict | None = None) -> Path:
    """A part with one committed unit per element of `units` (one 4-token document, one image each)."""
    directory = part_dir(out, identity["part"])
    with PartWriter(directory, identity) as part:
        for unit in units:
            part.commit(unit, [np.full(4, unit, np.int32)], [{"unit": unit}],
                        counts or {"images_written": 1, "documents_written": 1, "tokens": 4, "wall_ms": wall_ms,
                                   "device_busy_ms": wall_ms // 2})
        if finish:
            part.finish({})
    return directory


def snapshot(root: Path) -> dict:
    """Every path under `root` with its bytes (files) and mtime: what status must leave as it was."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in [root, *sorted(root.rglob("*"))]}


def by_part(status: JobStatus) -> dict[int, PartStatus]:
    return {p.part: p for p in status.parts}


def test_states_figures_and_eta_of_done_stopped_and_missing_parts(tmp_path):
    write_part(tmp_path, image_identity(0, 3, (0, 4)), range(4), wall_ms=2000, finish=True)
    write_part(tmp_path, image_identity(1, 3, (4, 10)), range(4, 6), wall_ms=1500)
    status = job_status(tmp_path)
    parts = by_part(status)
    assert status.states == {"done": 1, "running": 0, "stopped": 1, "missing": 1, "damaged": 0}
    assert parts[0].state == "done" and parts[0].detail is None
    assert (parts[0].units_done, parts[0].units_planned, parts[0].written, parts[0].tokens) == (4, 4, 4, 16)
    assert parts[0].wall_s == 8.0 and parts[0].device_busy_fraction == 0.5 and parts[0].per_s == 0.5
    assert parts[1].state == "stopped" and "rerun the same mmtok encode command" in parts[1].detail
    assert (parts[1].units_done, parts[1].units_planned) == (2, 6)
    assert parts[1].eta_s == pytest.approx(4 * 1.5) and parts[1].projected_s == pytest.approx(9.0)
    assert parts[2].state == "missing" and parts[2].units_planned is None
    assert status.slowest == [1, 0] and status.eta_s is None  # nothing runs: the job will not finish alone
    assert status.totals.units_done == 6 and status.totals.units_planned is None
    assert status.imbalance.measured is None and status.imbalance.modeled is None


def test_measured_imbalance_is_max_over_mean_wall_once_every_part_is_done(tmp_path):
    walls = {0: 3000, 1: 1000}
    for part, wall in walls.items():
        write_part(tmp_path, image_identity(part, 3, (2 * part, 2 * part + 2)), range(2 * part, 2 * part + 2),
                   wall_ms=wall, finish=True)
    write_part(tmp_path, image_identity(2, 3, (4, 4)), range(0), finish=True)  # an idle rank counts too
    status = job_status(tmp_path)
    assert status.states["done"] == 3 and status.eta_s == 0.0
    assert status.imbalance.measured == pytest.approx(6.0 / (8.0 / 3) - 1)
    assert [p.wall_share for p in status.parts] == pytest.approx([0.75, 0.25, 0.0])


def test_a_torn_last_commit_line_is_read_as_the_records_before_it(tmp_path):
    directory = write_part(tmp_path, image_identity(0, 1, (0, 5)), range(3))
    with open(directory / COMMITS, "ab") as log:
        log.write(b'{"unit":3,"len')  # a writer killed while appending its record
    part = by_part(job_status(tmp_path))[0]
    assert part.state == "stopped" and part.units_done == 3 and part.eta_s == pytest.approx(2.0)


def test_a_commit_log_damaged_mid_file_is_reported_as_damaged_in_one_line(tmp_path, capsys):
    directory = write_part(tmp_path, image_identity(0, 2, (0, 5)), range(3))
    write_part(tmp_path, image_identity(1, 2, (5, 6)), range(5, 6), finish=True)
    log = (directory / COMMITS).read_bytes().splitlines(keepends=True)
    (directory / COMMITS).write_bytes(log[0] + log[1].replace(b'"unit":1', b'"unit":7') + log[2])
    part = by_part(job_status(tmp_path))[0]
    assert part.state == "damaged" and "commit record 2 of 3 is corrupt" in part.detail
    assert "\n" not in part.detail
    assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "1 done, 1 damaged" in shown and "delete the part directory" in shown


def test_a_part_of_another_encode_run_is_named_with_the_first_differing_key(tmp_path, capsys):
    write_part(tmp_path, image_identity(0, 3, (0, 2), plan_fingerprint="a" * 64), range(2), finish=True)
    write_part(tmp_path, image_identity(1, 3, (2, 4), plan_fingerprint="a" * 64), range(2, 4), finish=True)
    write_part(tmp_path, image_identity(2, 3, (4, 6), plan_fingerprint="b" * 64), range(4, 6), finish=True)
    status = job_status(tmp_path)
    part = by_part(status)[2]
    assert status.states == {"done": 2, "running": 0, "stopped": 0, "missing": 0, "damaged": 1}
    assert part.state == "damaged" and "another encode run than part 0" in part.detail
    assert "plan_fingerprint" in part.detail and "\n" not in part.detail
    assert part.tokens == 0 and status.totals.tokens == 16  # its work is not this job's
    assert status.warnings == ["not from the encode run of part 0: part(s) 2; use one --out per run"]
    assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    assert "2 done, 1 damaged" in shown and "give each run its own --out" in shown


def test_tokens_count_the_items_merge_assembles(tmp_path):
    counts = {"images_deferred": 2, "item_tokens": 30, "wall_ms": 1000, "device_busy_ms": 500}
    write_part(tmp_path, image_identity(0, 1, (0, 2)), range(2), counts=counts, finish=True)
    part = by_part(job_status(tmp_path))[0]
    assert part.written == 4 and part.tokens == 2 * 4 + 60  # the sequences' tokens + item_tokens
    assert part.tokens_per_s == pytest.approx(68 / 2.0)


def test_running_part_is_seen_without_disturbing_its_writer_or_its_files(tmp_path):
    directory = part_dir(tmp_path, 0)
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(directory), json.dumps(image_identity(0, 1, (0, 4)))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "holding\n"  # the lock is held from here until we answer
        before = snapshot(tmp_path)
        part = by_part(job_status(tmp_path))[0]
        assert part.state == "running" and f"pid {holder.pid}" in part.detail
        assert part.eta_s == pytest.approx(2.0) and job_status(tmp_path).eta_s == pytest.approx(2.0)
        assert snapshot(tmp_path) == before
        with pytest.raises(MmtokError, match="being written by another process"):
            check_part_free(directory)  # the holder still holds its lock after status looked
    finally:
        holder.stdin.write("\n")
        holder.stdin.close()
        assert holder.wait(30) == 0
    assert by_part(job_status(tmp_path))[0].state == "stopped"


def test_status_inside_the_writing_process_leaves_its_lock_held(tmp_path):
    directory = write_part(tmp_path, image_identity(0, 2, (0, 2)), range(1))
    with PartWriter(directory, image_identity(0, 2, (0, 2))), WriterLock(part_dir(tmp_path, 1), "part 1"):
        parts = by_part(job_status(tmp_path))
        assert parts[0].state == "running" and parts[1].state == "running"  # part 1: lock taken, no identity yet
        assert "starting" in parts[1].detail
        probe = subprocess.run([sys.executable, "-c", PROBE, str(directory)], capture_output=True, text=True,
                               check=False)
        assert probe.returncode != 0 and "being written by another process" in probe.stderr


def test_audio_parts_count_clips_and_know_their_units_once_done(tmp_path):
    identity = {"modality": "audio", "num_parts": 2, "part_shard": "f"}
    batch = {"wall_ms": 2000, "device_busy_ms": 1800}
    with PartWriter(part_dir(tmp_path, 0), {**identity, "part": 0}) as part:
        for unit in range(2):
            part.commit(unit, [], [], batch)
        part.commit(2, [np.arange(6, dtype=np.int32)] * 3, [{}] * 3,
                    {"clips": 4, "encoded": 3, "skipped:too_long": 1, "wall_ms": 1000, "device_busy_ms": 0})
        part.finish({})
    write_part(tmp_path, {**identity, "part": 1}, range(1), counts=batch)
    status = job_status(tmp_path)
    parts = by_part(status)
    assert status.item == "clip" and status.states["done"] == 1 and status.states["stopped"] == 1
    assert (parts[0].units_done, parts[0].units_planned, parts[0].written) == (3, 3, 3)
    assert parts[0].skipped == 1 and parts[0].tokens == 18 and parts[0].per_s == pytest.approx(0.6)
    assert parts[1].units_planned is None and parts[1].eta_s is None
    assert status.imbalance.measured is None  # audio parts are shards, several per rank
    with pytest.raises(MmtokError, match="drop --plan"):
        job_status(tmp_path, plan=tmp_path)


def test_cli_json_help_and_exit_codes(tmp_path, capsys):
    assert main(["status", str(tmp_path)]) == 2
    assert f"run `mmtok encode --out {tmp_path}`" in capsys.readouterr().err
    write_part(tmp_path, image_identity(0, 2, (0, 1)), range(1), finish=True)
    assert main(["status", str(tmp_path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["states"]["missing"] == 1 and shown["parts"][0]["state"] == "done"
    assert main(["status", str(tmp_path), "--skipped"]) == 0  # no skip in the part: an empty listing, said so
    printed = capsys.readouterr()
    assert printed.out == "" and "0 skip records; the scan's and the plan's are listed with --plan" in printed.err
    assert main(["status", str(tmp_path), "--skipped", "--json"]) == 2
    assert "--skipped prints skip records" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["status", "--help"])
    help_text = capsys.readouterr().out
    assert all(state in help_text for state in ("done", "running", "stopped", "missing", "damaged", "imbalance"))


def test_many_parts_show_only_unfinished_and_slowest_ones(tmp_path, capsys):
    for part in range(22):
        write_part(tmp_path, image_identity(part, 23, (part, part + 1)), range(part, part + 1),
                   wall_ms=1000 + 10 * part, finish=part != 3)
    assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out
    rows = [line.split()[0] for line in shown.splitlines() if line[:7].strip().isdigit()]
    assert rows == ["3", "17", "18", "19", "20", "21", "22"]  # stopped, the 5 slowest, missing
    assert "not shown: 16 done (--json lists every part)" in shown


# -- end to end: a real plan and real encodes -----------------------------------------------------------
@pytest.fixture(scope="module")
def job(tmp_path_factory):
    env = caption_env(tmp_path_factory.mktemp("status"))
    return env, plan(env, "plan", "--mode", "image", "--world-size", "3", "--item-seconds", "0.0005")


def encode(env, plan_dir: Path, out: Path, rank: int) -> int:
    with one_torch_thread():
        return main(["encode", "--plan", str(plan_dir), "--checkpoint", str(env.checkpoint), "--out", str(out),
                     "--rank", str(rank), "--world-size", "3", "--loader-threads", "1", "--device", "cpu",
                     "--no-progress", "--no-take-over"])  # ranks run one after another: each its own items


def test_status_follows_a_real_job_to_its_measured_imbalance(job, tmp_path, capsys):
    env, plan_dir = job
    meta = json.loads((plan_dir / "plan.json").read_text())
    out = tmp_path / "out"
    opened = Plan.open(plan_dir)
    items = opened.work_items()
    last = opened.worker_items(2, 3)  # the items worker 2 of 3 takes: missing until it runs
    modeled = imbalance(rank_costs(opened.table(BATCHES_FILE, ["cost"]).column(0).to_numpy(), items))
    assert encode(env, plan_dir, out, 0) == 0 and encode(env, plan_dir, out, 1) == 0
    assert f"job view (every rank): mmtok status {out}" in capsys.readouterr().err
    status = job_status(out, plan=plan_dir)
    assert len(last) and status.states == {"done": len(items) - len(last), "running": 0, "stopped": 0,
                                              "missing": len(last), "damaged": 0}
    assert by_part(status)[last.start].units_planned == items[last.start][1] - items[last.start][0]
    assert status.imbalance.measured is None and status.imbalance.modeled == pytest.approx(modeled)
    assert encode(env, plan_dir, out, 2) == 0
    capsys.readouterr()
    assert main(["status", str(out), "--plan", str(plan_dir)]) == 0
    print(capsys.readouterr().out, file=sys.stderr)  # the human view, for `pytest -s`
    status = job_status(out, plan=plan_dir)
    assert status.states["done"] == len(items) and status.eta_s == 0.0
    assert np.isfinite(status.imbalance.measured) and status.imbalance.modeled == pytest.approx(modeled)
    assert status.totals.units_done == status.totals.units_planned == meta["num_batches"]
    assert status.totals.written == meta["totals"]["kept_images"]
    assert sum(p.modeled_share for p in status.parts) == pytest.approx(1.0)
    assert job_status(out).imbalance.modeled is None
    assert main(["merge", str(out)]) == 0  # the job has documents of two images: merge assembles their items
    merged = json.loads((out / "merged.json").read_text())
    assert merged["assembled"]["tokens"] > 0 and status.totals.tokens == merged["tokens"]


def test_the_modeled_imbalance_is_rederived_for_another_world_size(job, tmp_path):
    _, plan_dir = job
    opened = Plan.open(plan_dir)
    ranges = opened.ranges(2)
    for part in range(2):
        start, end = (int(x) for x in ranges[part])
        write_part(tmp_path, image_identity(part, 2, (start, end), plan_fingerprint=opened.meta.fingerprint),
                   range(start, end), finish=True)
    costs = opened.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
    balance = job_status(tmp_path, plan=plan_dir).imbalance
    assert balance.modeled == pytest.approx(imbalance(rank_costs(costs, ranges)))
    assert (balance.world_size, balance.plan_world_size) == (2, 3)
    write_part(tmp_path / "other", image_identity(0, 1, (0, 1), plan_fingerprint="f" * 64), range(1))
    with pytest.raises(MmtokError, match="not the plan these parts were encoded from"):
        job_status(tmp_path / "other", plan=plan_dir)


def test_the_tail_names_slow_and_silent_running_parts_and_the_parts_not_started(tmp_path, capsys):
    for part in range(4):  # four done parts at 1 s a batch: the median pace
        write_part(tmp_path, image_identity(part, 7, (2 * part, 2 * part + 2)), range(2), wall_ms=1000, finish=True)
    slow = write_part(tmp_path, image_identity(4, 7, (8, 12)), range(2), wall_ms=2000)  # 2 s a batch
    silent = write_part(tmp_path, image_identity(5, 7, (12, 16)), range(1), wall_ms=1000)
    long_ago = time.time() - 3600
    for name in (COMMITS, WriterLock.NAME):
        os.utime(silent / name, (long_ago, long_ago))  # as if its node hung an hour ago
    with PartWriter(slow, image_identity(4, 7, (8, 12))), WriterLock(silent, "part 5"):
        os.utime(silent / WriterLock.NAME, (long_ago, long_ago))
        status = job_status(tmp_path)
        assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out.splitlines()
    parts = by_part(status)
    assert parts[4].speed == pytest.approx(0.5) and parts[4].progress == pytest.approx(0.5)
    assert parts[0].speed == pytest.approx(1.0) and parts[6].speed is None
    assert parts[5].silent_s > 3500
    assert [a.action for a in status.tail.actions] == ["slow", "stalled", "not_started"]
    tail = [line for line in shown if line.startswith(("tail:", "action:"))]
    assert tail == [
        "tail: 1 not started, 2 running, 4 done; last to finish: part 4 50% at 0.50x the median pace, eta 4.0s, "
        "part 5 25% at 1.00x the median pace, eta 3.0s",
        "action: part 4 runs at 0.50x the median pace: requeue it on another node (cancel its task and exclude the "
        "node; the rerun resumes after its last commit)",
        tail[2],
        "action: 1 part not started (6): in a SLURM array they start as slots free up; otherwise launch their ranks"]
    assert tail[2].startswith("action: part 5 has committed nothing for 1h00m (its batches take 1.0s): its node "
                              "may hang; requeue it on another node")


def test_a_part_silent_before_its_first_commit_is_stalled_by_the_others_pace(tmp_path, capsys):
    for part in range(2):  # two done parts at 1 s a batch
        write_part(tmp_path, image_identity(part, 3, (2 * part, 2 * part + 2)), range(2), wall_ms=1000, finish=True)
    hung = write_part(tmp_path, image_identity(2, 3, (4, 6)), range(0))
    long_ago = time.time() - 3600
    with WriterLock(hung, "part 2"):
        for name in (COMMITS, WriterLock.NAME):
            os.utime(hung / name, (long_ago, long_ago))  # it took the lock an hour ago, then nothing
        status = job_status(tmp_path)
        assert main(["status", str(tmp_path)]) == 0
    assert [a.action for a in status.tail.actions] == ["stalled"]
    assert status.tail.actions[0].unit_s == pytest.approx(1.0)
    assert any(line.startswith("action: part 2 has committed nothing for 1h00m (no batch yet, the others' take "
                               "1.0s)") for line in capsys.readouterr().out.splitlines())


def test_a_finished_job_shows_no_tail(tmp_path, capsys):
    write_part(tmp_path, image_identity(0, 1, (0, 2)), range(2), finish=True)
    assert main(["status", str(tmp_path)]) == 0 and "tail:" not in capsys.readouterr().out
    assert job_status(tmp_path).tail.actions == []


def test_inputs_table_accounts_for_every_manifest_row_of_every_input(tmp_path, capsys):
    """Issue 49.7: one table per input that adds up -- scan errors, plan drops, encode skips (by reason),
    written and pending -- instead of reconciling three files by hand. Checked mid-job (a rank not run:
    pending) and at the end, against the scan's, plan's and parts' own counts."""
    from encodekit import PLAN_FLAGS, caption_corpus, chat_tokenizer
    from mmtok.codecs import emu35

    shards = caption_corpus(tmp_path / "captions", corrupt=True)
    photo = (tmp_path / "captions" / "shard-0.tar").read_bytes()[:3000]  # cut inside its first image
    shards.append(tmp_path / "captions" / "shard-3.tar")
    shards[-1].write_bytes(photo)
    checkpoint = emu35.write_random_checkpoint(tmp_path / "ckpt")
    assert main(["scan", *map(str, shards), "--out", str(tmp_path / "m"), "--workers", "1", "--no-progress"]) == 0
    plan_dir = tmp_path / "plan"
    assert main(["plan", str(tmp_path / "m"), "--out", str(plan_dir), "--quiet", *PLAN_FLAGS, "--text-tokenizer",
                 str(chat_tokenizer(tmp_path / "tok")), "--mode", "image", "--world-size", "2",
                 "--min-source-pixels", "40000", "--item-seconds", "0.0005"]) == 0
    meta = json.loads((plan_dir / "plan.json").read_text())
    out = tmp_path / "out"

    def table() -> list[dict]:
        capsys.readouterr()
        assert main(["status", str(out), "--plan", str(plan_dir), "--inputs", "--json"]) == 0
        return json.loads(capsys.readouterr().out)["inputs"]

    def adds_up(rows: list[dict]) -> None:
        for row in rows:
            assert row["rows"] == (sum(row["scan"].values()) + sum(row["plan"].values()) + sum(row["encode"].values())
                                   + row["written"] + row["pending"]), row

    def encode_ranks(rank: int) -> None:
        with one_torch_thread():
            assert main(["encode", "--plan", str(plan_dir), "--checkpoint", str(checkpoint), "--out", str(out),
                         "--rank", str(rank), "--world-size", "2", "--loader-threads", "1", "--device", "cpu",
                         "--no-progress", "--no-take-over"]) == 0

    encode_ranks(0)
    mid = table()
    adds_up(mid)
    assert sum(r["pending"] for r in mid) > 0
    encode_ranks(1)
    rows = table()
    adds_up(rows)
    assert [Path(r["input"]).name for r in rows] == [p.name for p in shards]
    assert sum(r["rows"] for r in rows) == meta["totals"]["manifest_rows"]
    assert sum(r["pending"] for r in rows) == 0
    assert sum(r["written"] for r in rows) == job_status(out, plan=plan_dir).totals.written
    assert rows[3]["scan"] == {"truncated_member": 1} and rows[2]["encode"] == {"decode_error": 2}
    assert sum(sum(r["plan"].values()) for r in rows) > 0
    dropped = {k: v for k, v in meta["dropped_by_reason"].items() if not k.startswith("scan:")}
    assert sum(sum(r["plan"].values()) for r in rows) == sum(dropped.values())
    assert main(["status", str(out), "--plan", str(plan_dir), "--inputs"]) == 0
    human = capsys.readouterr().out
    assert "rows = scan errors + plan drops + encode skips + written + pending" in human
    assert "encode decode_error 2" in human and human.rstrip().splitlines()[-1].lstrip().startswith("total")
    # merge drops the other image of the document whose image failed (its item record, not a part skip)
    assert main(["merge", str(out)]) == 0
    rows, counts = table(), json.loads((out / "merged.json").read_text())["counts"]
    adds_up(rows)
    assert rows[2]["encode"] == {"decode_error": 3, "document_image_failed": 1}
    assert sum(r["written"] for r in rows) == counts["images_written"]
    # Issue 47.3: `--skipped` names each of those rows once, as skip records of every stage in one schema.
    assert main(["status", str(out), "--plan", str(plan_dir), "--skipped"]) == 0
    printed = capsys.readouterr()
    (tmp_path / "all.jsonl").write_text(printed.out)
    records = list(skips.read(tmp_path / "all.jsonl"))
    listed = Counter(("encode" if r.stage == "merge" else r.stage, r.reason) for r in records)
    expected: Counter = Counter()
    for row in rows:
        expected.update({(stage, reason): n for stage in INPUT_STAGES for reason, n in row[stage].items()})
    assert listed == expected and sum(expected.values()) == len(records) > 0
    assert len({r.position for r in records}) == len(records)
    planned = [r for r in records if r.stage in ("scan", "plan")]  # the plan's drops first, in manifest-row order
    assert records[:len(planned)] == planned and [r.position for r in planned] == sorted(r.position for r in planned)
    assert [r.stage for r in records[len(planned):]] == sorted((r.stage for r in records[len(planned):]),
                                                                key=["encode", "merge"].index)
    assert f"mmtok status: {len(records)} skip records (scan truncated_member 1" in printed.err


def test_work_items_show_done_in_progress_with_last_commit_and_pending_and_an_overdue_item_is_flagged(
        tmp_path, capsys):
    items = {"work_items": {"count": 7, "target_cost": 1.0}}  # what image encode records: its parts are items
    for item in range(4):  # four done items of 2 batches at 1 s a batch: the median pace
        write_part(tmp_path, image_identity(item, 7, (2 * item, 2 * item + 2), **items), range(2), finish=True)
    busy = write_part(tmp_path, image_identity(4, 7, (8, 10), **items), range(1))  # half done, committing
    hung = write_part(tmp_path, image_identity(5, 7, (10, 30), **items), range(1))  # 20 batches: ~20 s expected
    minute_ago = time.time() - 60  # older than its whole item should take, far below the 10 minutes of a rank
    for name in (COMMITS, WriterLock.NAME):
        os.utime(hung / name, (minute_ago, minute_ago))
    with PartWriter(busy, image_identity(4, 7, (8, 10), **items)), WriterLock(hung, "item 5"):
        os.utime(hung / WriterLock.NAME, (minute_ago, minute_ago))
        status = job_status(tmp_path)
        assert main(["status", str(tmp_path)]) == 0
    shown = capsys.readouterr().out.splitlines()
    parts = by_part(status)
    assert status.work_items and parts[5].expected_s == pytest.approx(20.0)
    assert [a.action for a in status.tail.actions] == ["stalled", "not_started"] and status.tail.actions[0].part == 5
    assert status.tail.actions[0].limit_s == pytest.approx(20.0)
    stamp = parts[5].last_commit_at
    assert abs(datetime.fromisoformat(stamp).timestamp() - minute_ago) < 1.5 and parts[6].last_commit_at is None
    assert shown[0] == f"mmtok status {tmp_path}: image job, 7 work items: 4 done, 2 in progress, 1 pending"
    assert shown[1].split()[:2] == ["item", "state"]
    row = next(line for line in shown if line.split()[:3] == ["5", "in", "progress"])
    assert row.endswith(f"holder: this process (pid {os.getpid()}); last commit {stamp} (1m00s ago)")
    assert next(line for line in shown if line.split()[0] == "6").split()[1] == "pending"
    tail = [line for line in shown if line.startswith(("tail:", "action:"))]
    assert tail[0].startswith("tail: 1 pending, 2 in progress, 4 done; last to finish: item 5 5% at 1.00x the median "
                              "pace")
    assert tail[1] == ("action: item 5 has committed nothing for 1m00s (the whole item should take 20.0s at the median "
                       "pace; its batches take 1.0s): its node may hang; requeue it on another node")
    assert tail[2].startswith("action: 1 item pending (6): running workers take them over as they finish their own")
