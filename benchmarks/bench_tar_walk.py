"""The tar header walk (`mmtok.formats.tar.TarWalker.members`, the scan's hot loop) against `tarfile`, and
against the walk of another git revision, so a change to the loop is measured before it lands.

    python benchmarks/bench_tar_walk.py [--members 20000] [--repeat 7] [--against REV]

Builds two tars of `--members` small members in a temporary directory: GNU format (one header a member)
and PAX format (names past 100 bytes: an `x` header before each member). Each walk runs `--repeat` times,
interleaved, and the best is reported in members per CPU-second (these machines are shared: the best of
several runs is the least disturbed). `--against REV` also walks with `mmtok/formats/tar.py` as it is at
REV (`git show`), and prints the ratio this tree / REV; the members each walk yields must be equal.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def build(path: Path, members: int, fmt: int) -> Path:
    prefix = "d" * 120 + "/" if fmt == tarfile.PAX_FORMAT else ""  # > 100 bytes: a pax `path` record
    with tarfile.open(path, "w", format=fmt) as tar:
        for number in range(members):
            info = tarfile.TarInfo(f"{prefix}{number:08d}.jpg")
            info.size = 64
            tar.addfile(info, io.BytesIO(bytes(64)))
    return path


def walk_with(module):
    from mmtok.scan.scanner import TAR_WINDOW  # the bytes the scan reads per header

    def walk(path: Path) -> list[tuple]:
        fd = os.open(path, os.O_RDONLY)
        try:
            walker = module.TarWalker(fd, os.fstat(fd).st_size, TAR_WINDOW)
            return [(name, kind, data, size) for name, kind, data, size, _, _ in walker.members()]
        finally:
            os.close(fd)
    return walk


def tarfile_walk(path: Path) -> list[tuple]:
    with tarfile.open(path) as tar:
        return [(m.name, m.offset_data, m.size) for m in tar]


def load_revision(revision: str, folder: Path):
    source = subprocess.run(["git", "-C", str(REPO), "show", f"{revision}:mmtok/formats/tar.py"], check=True,
                            capture_output=True).stdout
    path = folder / "tar_at_revision.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("tar_at_revision", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def best_rate(walk, path: Path, members: int, times: list[float]) -> None:
    began = time.process_time()
    walk(path)
    times.append(members / (time.process_time() - began))


def main() -> None:
    from mmtok.formats import tar as current

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--members", type=int, default=20_000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--against", help="a git revision whose walk is measured beside this tree's")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        walks = {"mmtok (this tree)": walk_with(current), "tarfile": tarfile_walk}
        if args.against:
            walks[f"mmtok at {args.against}"] = walk_with(load_revision(args.against, Path(folder)))
        print(f"| tar ({args.members:,} members) | " + " | ".join(walks) + " | this tree / "
              + (f"{args.against} |" if args.against else "tarfile |"))
        print("|---|" + "---:|" * (len(walks) + 1))
        for name, fmt in (("GNU", tarfile.GNU_FORMAT), ("PAX", tarfile.PAX_FORMAT)):
            path = build(Path(folder) / f"{name}.tar", args.members, fmt)
            if args.against:
                ours, theirs = walk_with(current)(path), list(walks.values())[2](path)
                assert ours == theirs, "the walks differ"
            rates: dict[str, list[float]] = {label: [] for label in walks}
            for _ in range(args.repeat):
                for label, walk in walks.items():
                    best_rate(walk, path, args.members, rates[label])
            best = {label: max(found) for label, found in rates.items()}
            other = best[f"mmtok at {args.against}"] if args.against else best["tarfile"]
            print(f"| {name} | " + " | ".join(f"{best[label]:,.0f}/s" for label in walks)
                  + f" | {best['mmtok (this tree)'] / other:.3f} |")


if __name__ == "__main__":
    main()
