"""The readers of manifest rows, of table inputs, of a part's commit log and of a run's items, this tree against a
git revision, in one run.

    python benchmarks/bench_table_reads.py --against REV [--repeat 3] [--documents 3000]

Each case runs in a fresh process with `mmtok` from this tree or from REV (`git archive REV mmtok`), on the
same files, alternating, best of --repeat (CPU seconds of the reads alone):
  parquet cells   3,000 Parquet rows of a 60 KB image and a caption, row groups of 100, each image and its
                  caption read through `MemberReader` (what encode's loader threads do)
  arrow cells     an Arrow stream of 4,000 record batches of 10 rows, each image and caption the same way
  tar members     a tar of 3,000 samples of a 60 KB image and a caption, each image and its caption read
                  through `MemberReader` by byte range, 4 threads at once (what encode's loader does)
  audio units     a Parquet audio table of 1,000 one-row row groups: every unit's payloads
                  (`audio convert`: a unit per row group)
  commit log      a part's commit log of 20,000 units (`read_commits`: what a resume, merge and status read)
  item index      the items of --documents documents of 2-20 images over 3 parts (`bench_merge`'s writer):
                  `ImageIndex` (sft) and merge's `_read`
Markdown on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time
from pathlib import Path
case, folder = sys.argv[1], Path(sys.argv[2])

def timed(read):
    began = time.process_time()
    read()
    return time.process_time() - began

if case in ("parquet cells", "arrow cells"):
    from mmtok.formats.manifest import MemberReader
    path = str(folder / ("cells.parquet" if case == "parquet cells" else "cells.arrow"))
    rows = 3000 if case == "parquet cells" else 40000
    def read():
        reader = MemberReader()
        for row in range(rows):
            reader.read_member("parquet", path, "jpg", row, 0)
            reader.read_text("parquet", path, row, 200, "txt")
    seconds = timed(read)
elif case == "tar members":
    from concurrent.futures import ThreadPoolExecutor
    from mmtok.formats.manifest import MemberReader
    path = str(folder / "members.tar")
    places = json.loads((folder / "members.json").read_text())
    def read():
        reader = MemberReader()
        def one(place):
            image, text = place
            reader.read_member("tar", path, "x.jpg", image[0], image[1])
            reader.read_text("tar", path, text[0], text[1], None)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(one, places))
    seconds = timed(read)
elif case == "commit log":
    from mmtok.formats.commitlog import read_commits
    seconds = timed(lambda: read_commits(folder / "log"))
elif case == "audio units":
    from mmtok.audio.sources.parquet import table_units
    units, _ = table_units(folder / "audio.parquet", "audio", "text")
    seconds = timed(lambda: [payload for unit in units for payload in unit.payloads()])
else:
    import mmtok.formats.items as items
    from mmtok.merge.assemble import _read
    items.part_containers = lambda directory: {}  # the benchmark's parts record no tars: not what is timed
    parts = sorted((folder / "items" / "parts").glob("part-*"))
    seconds = timed(lambda: items.ImageIndex(parts)) + timed(lambda: _read(parts))
print(json.dumps(seconds))
"""

CASES = ("parquet cells", "arrow cells", "tar members", "commit log", "audio units", "item index")


def write_inputs(folder: Path, documents: int) -> None:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(REPO / "benchmarks"))
    import bench_merge

    rng = np.random.default_rng(0)
    pq.write_table(pa.table({"jpg": [rng.bytes(60_000) for _ in range(3000)],
                             "txt": [f"caption {n} " * 5 for n in range(3000)]}), folder / "cells.parquet",
                   row_group_size=100)
    schema = pa.schema([("jpg", pa.binary()), ("txt", pa.string())])
    with pa.OSFile(str(folder / "cells.arrow"), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for batch in range(4000):
            writer.write_batch(pa.record_batch([[rng.bytes(100) for _ in range(10)],
                                                [f"caption {batch}"] * 10], schema=schema))
    write_tar(folder, rng)
    write_log(folder / "log")
    pq.write_table(pa.table({"audio": [b"not decoded %d" % n for n in range(1000)]}), folder / "audio.parquet",
                   row_group_size=1)
    bench_merge.write_document_parts(folder / "items", folder / "plain", 3, documents)


def write_tar(folder: Path, rng) -> None:
    """members.tar (3,000 samples of a 60 KB image and a caption) and members.json: each sample's (offset, size)
    of its image and of its caption, as the scan records them."""
    import io
    import tarfile

    with tarfile.open(folder / "members.tar", "w", format=tarfile.USTAR_FORMAT) as archive:
        for n in range(3000):
            for name, data in ((f"{n:06d}.jpg", rng.bytes(60_000)), (f"{n:06d}.txt", f"caption {n} ".encode() * 5)):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    with tarfile.open(folder / "members.tar") as archive:
        members = archive.getmembers()
        places = [[(m.offset_data, m.size) for m in members[i:i + 2]] for i in range(0, len(members), 2)]
    (folder / "members.json").write_text(json.dumps(places))


def write_log(directory: Path) -> None:
    """A part of 20,000 units of 4 short sequences each (this tree's `PartWriter`; the log's format is the same)."""
    import numpy as np

    from mmtok.formats.commitlog import PartWriter

    with PartWriter(directory, {"part": 0, "num_parts": 1}) as part:
        for unit in range(20_000):
            part.commit(unit, [np.arange(5, dtype=np.int32)] * 4, [{"unit": unit}] * 4, {"written": 4, "images": 3})


def run(case: str, source: Path, folder: Path) -> float:
    done = subprocess.run([sys.executable, "-c", CHILD, case, str(folder)], capture_output=True, text=True,
                          env={"PYTHONPATH": str(source), "PATH": "/usr/bin:/bin"}, cwd=folder, check=True)
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", required=True, help="the git revision measured beside this tree")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--documents", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temporary:
        folder, old = Path(temporary), Path(temporary) / "revision"
        old.mkdir()
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.against, "mmtok"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
        write_inputs(folder, args.documents)
        print(f"| case | this tree | {args.against} | this tree / {args.against} |\n|---|---:|---:|---:|")
        for case in CASES:
            ours, theirs = [], []
            for _ in range(args.repeat):
                ours.append(run(case, REPO, folder))
                theirs.append(run(case, old, folder))
            print(f"| {case} | {min(ours):.3f} s | {min(theirs):.3f} s | {min(ours) / min(theirs):.3f} |", flush=True)


if __name__ == "__main__":
    main()
