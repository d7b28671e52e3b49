"""`mmtok scan --rank R --world-size N`: shards claimed under locks, committed once, assembled into the bytes
of a one-process scan, whatever the world size, the order the ranks run in, a killed rank or a held claim."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

from mmtok.cli import main as cli
from mmtok.formats.scan_shards import commit_path, read_commit
from mmtok.fsutil import WriterLock
from mmtok.scan.scanner import CACHE_DIR, ScanOptions, describe, rows_cache_path, run_scan, scan_share, shard_key
from realmedia import skimage_images

OPTIONS = ScanOptions()


def _jpeg(path: Path, side: int) -> bytes:
    with Image.open(path) as image:
        image = image.convert("RGB")
        image.thumbnail((side, side))
        out = io.BytesIO()
        image.save(out, "JPEG", quality=80)
        return out.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 1_700_000_000
    tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[Path]:
    """Nine WebDataset shards of real photos, 1 to 5 samples each (uneven bytes), captions, one document of
    three images ordered by its json sidecar, one truncated shard, one file that is not a tar, and a
    directory given as an input (`unreadable_shard`)."""
    photos = [_jpeg(p, 48 + 16 * k) for k, p in enumerate(skimage_images()[:6])]
    root = tmp_path_factory.mktemp("dist")
    paths = []
    for s in range(9):
        path = root / f"shard-{s:02d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for k in range(s % 5 + 1):
                key = f"{s:02d}{k:03d}"
                _add(tar, f"{key}.jpg", photos[(s + k) % len(photos)])
                _add(tar, f"{key}.txt", f"photo {s} {k}".encode())
            if s == 4:
                for n in (2, 0, 1):
                    _add(tar, f"doc.{n}.jpg", photos[n])
                _add(tar, "doc.json", json.dumps({"images": ["doc.1.jpg", "doc.0.jpg", "doc.2.jpg"]}).encode())
        paths.append(path)
    paths[7].write_bytes(paths[7].read_bytes()[:2000])  # ends inside a member
    paths[8].write_bytes(b"not a tar at all" * 40)
    (root / "a-directory").mkdir()  # unreadable: committed marked `retry`, tried again by every assembly
    return paths + [root / "a-directory"]


def _files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory) -> dict[str, bytes]:
    """What a one-process scan writes; two of them write the same bytes but in the lock files, whose line
    names the holder (host, pid, time): those are compared by name only."""
    outs = [tmp_path_factory.mktemp(f"one{n}") for n in range(2)]
    for out in outs:
        run_scan([describe(str(p)) for p in shards], out, OPTIONS, workers=1, progress=False)
    first, second = (_files(out) for out in outs)
    assert first.keys() == second.keys()
    assert {name for name in first if first[name] != second[name] and not name.endswith(".lock")} == set()
    return first


def _same_as_one_process(out: Path, reference: dict[str, bytes]) -> None:
    written = _files(out)
    assert written.keys() == reference.keys()
    assert {name for name in reference if not name.endswith(".lock") and written[name] != reference[name]} == set()
    assert any(name.endswith(".parquet") for name in reference) and any(name.endswith(".json") for name in reference)


@pytest.mark.parametrize("world_size", [1, 3, 7])
def test_every_world_size_writes_the_one_process_bytes(shards, reference, tmp_path, world_size):
    sources = [describe(str(p)) for p in shards]
    shares = [scan_share(sources, tmp_path, OPTIONS, rank, world_size, workers=1, progress=False)
              for rank in reversed(range(world_size))]  # the last rank first: it takes over the others' shards
    assert sum(s.scanned_shards for s in shares) == len(shards)  # each shard scanned once by the ranks
    assert [s.manifest is not None for s in shares] == [True] * world_size  # whoever finds all done assembles
    assert sum(s.own_shards for s in shares) == len(shards)
    _same_as_one_process(tmp_path, reference)


def _mmtok(*args: str, check: bool = True, prelude: str = "") -> subprocess.CompletedProcess:
    code = f"import sys\n{prelude}\nfrom mmtok.cli import main\nsys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, "scan", *args], capture_output=True, text=True, check=check)


# The rank kills itself (SIGKILL) while it scans its second shard: its first shard is committed, the
# second is claimed (its lock held) and has no commit. Deterministic: no timing involved.
_KILL_IN_SECOND_SHARD = """
import os, signal
import mmtok.scan.scanner as scanner
_scan, _calls = scanner.scan_source, []
def scan_source(*args):
    _calls.append(1)
    if len(_calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return _scan(*args)
scanner.scan_source = scan_source
"""


def test_killed_rank_is_taken_over_by_the_rerun(shards, reference, tmp_path, capsys):
    args = [*map(str, shards), "--out", str(tmp_path), "--world-size", "3", "--workers", "1", "--no-progress"]
    killed = _mmtok(*args, "--rank", "1", check=False, prelude=_KILL_IN_SECOND_SHARD)
    assert killed.returncode == -9
    committed = [p for p in shards if read_commit(rows_cache_path(tmp_path, describe(str(p)), OPTIONS), verify=True)]
    assert len(committed) == 1 and not (tmp_path / "manifest.json").exists()
    assert cli(["scan", *args, "--rank", "1"]) == 0  # takes the dead rank's claim at once, scans the rest
    rerun = capsys.readouterr().err
    assert re.search(rf"rank 1 of 3: scanned {len(shards) - 1} shards", rerun), rerun
    assert "every shard is done: writing the manifest" in rerun
    _same_as_one_process(tmp_path, reference)
    for rank in ("0", "2"):  # ranks that find every shard done just assemble
        assert cli(["scan", *args, "--rank", rank]) == 0
        done = capsys.readouterr().err
        assert f"rank {rank} of 3: scanned 0 shards" in done
        assert re.search(r"\d\.\d\d reads and \d+\.\d KB read per image; wrote", done), done
    _same_as_one_process(tmp_path, reference)


def test_a_held_claim_is_never_scanned_by_another_rank(shards, reference, tmp_path):
    held = describe(str(shards[2]))
    with WriterLock(tmp_path / CACHE_DIR, "test", name=shard_key(held, OPTIONS) + ".lock"):
        rank = _mmtok(*map(str, shards), "--out", str(tmp_path), "--rank", "0", "--world-size", "2",
                      "--workers", "2", "--no-progress")
    assert f"scanned {len(shards) - 1} shards" in rank.stderr and "1 shard still being scanned" in rank.stderr
    assert not commit_path(rows_cache_path(tmp_path, held, OPTIONS)).exists()
    assert not (tmp_path / "manifest.json").exists()
    final = run_scan([describe(str(p)) for p in shards], tmp_path, OPTIONS, workers=1, progress=False)
    # The claim's holder ended: the final run scans that shard, and the unreadable input once more.
    assert final.run.scanned_shards == 2
    _same_as_one_process(tmp_path, reference)


def test_concurrent_ranks_scan_each_shard_once(shards, reference, tmp_path):
    command = [sys.executable, "-m", "mmtok", "scan", *map(str, shards), "--out", str(tmp_path), "--workers", "1",
               "--no-progress"]
    ranks = [subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=_env(rank, 3)) for rank in range(3)]
    lines = [process.communicate()[1] for process in ranks]
    assert [process.returncode for process in ranks] == [0, 0, 0], lines
    scanned = [int(re.search(r"scanned (\d+) shards?", line).group(1)) for line in lines]
    assert sum(scanned) == len(shards), lines
    # Every rank that scanned a shard says what it cost the storage (what the summary of the manifest says too).
    assert all(re.search(r"\d\.\d\d reads and \d+\.\d KB read per image", line)
               for line, count in zip(lines, scanned, strict=True) if count)
    if not (tmp_path / "manifest.json").exists():  # both finishers saw a shard still claimed: the final step
        assert cli(["scan", *map(str, shards), "--out", str(tmp_path), "--no-progress"]) == 0
    _same_as_one_process(tmp_path, reference)


def _env(rank: int, world_size: int) -> dict[str, str]:
    """The environment srun gives task `rank` of `world_size` (what `mmtok scan` reads without --rank)."""
    import os

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    return {**env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size)}


def test_damaged_rows_are_rescanned_before_assembly(shards, reference, tmp_path):
    sources = [describe(str(p)) for p in shards]
    run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    rows = rows_cache_path(tmp_path, sources[3], OPTIONS)
    data = bytearray(rows.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum tells
    rows.write_bytes(bytes(data))
    scanned = run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    assert scanned.run.scanned_shards == 2  # that shard, and the unreadable input (tried by every run)
    _same_as_one_process(tmp_path, reference)


def test_a_dead_claim_holders_leftovers_are_cleared_and_its_shard_rescanned(shards, reference, tmp_path):
    sources = [describe(str(p)) for p in shards]
    run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    rows = rows_cache_path(tmp_path, sources[5], OPTIONS)
    commit_path(rows).unlink()  # killed between its rows and its commit
    stale = rows.with_name(f".{rows.name}.tmp-999999")  # and a half-written file of an earlier try
    stale.write_bytes(b"half")
    share = scan_share(sources, tmp_path, OPTIONS, 0, 2, workers=1, progress=False)
    assert share.scanned_shards == 1 and not stale.exists()
    _same_as_one_process(tmp_path, reference)


@pytest.mark.parametrize("edit", [{"documents": 99}, {"reads": "x"}, {"images_ok": None}])
def test_a_commit_whose_stats_were_edited_is_not_committed(shards, reference, tmp_path, edit):
    # The stats number the manifest's documents and fill manifest.json: the checksum must cover them too.
    sources = [describe(str(p)) for p in shards]
    run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    commit = commit_path(rows_cache_path(tmp_path, sources[2], OPTIONS))
    record = json.loads(commit.read_text())
    record["stats"].update(edit)
    commit.write_text(json.dumps(record))
    scanned = run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    assert scanned.run.scanned_shards == 2  # that shard, and the unreadable input (tried by every run)
    _same_as_one_process(tmp_path, reference)


@pytest.mark.parametrize("edit", [lambda rec: rec["stats"].pop("documents"), lambda rec: rec["stats"].update(reads="x"),
                                  lambda rec: rec["stats"]["shard_errors"].append({"reason": "x"}),
                                  lambda rec: rec["stats"]["formats"].update(jpeg=-1), lambda rec: rec.pop("retry"),
                                  lambda rec: rec.pop("rows_bytes")],
                         ids=["no-documents", "reads-string", "shard-error-without-fields", "negative-count",
                              "no-retry", "no-rows-bytes"])
def test_a_commit_of_another_shape_whose_checksum_matches_is_scanned_again(shards, reference, tmp_path, edit):
    """The checksum proves a commit was written whole, not that this build wrote it: stats of another shape (a
    build of the same SCAN_VERSION with other fields) are not committed, so the input is scanned again -- never a
    KeyError in the assembly."""
    import hashlib

    from mmtok.formats.scan_shards import COMMIT_KEYS

    sources = [describe(str(p)) for p in shards]
    run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    commit = commit_path(rows_cache_path(tmp_path, sources[2], OPTIONS))
    record = json.loads(commit.read_text())
    edit(record)
    fields = {key: record.get(key) for key in COMMIT_KEYS}
    record["sha256"] = hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()
    commit.write_text(json.dumps(record))
    assert hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest() == record["sha256"]  # it matches
    scanned = run_scan(sources, tmp_path, OPTIONS, workers=1, progress=False)
    assert scanned.run.scanned_shards == 2  # that shard, and the unreadable input (tried by every run)
    _same_as_one_process(tmp_path, reference)
