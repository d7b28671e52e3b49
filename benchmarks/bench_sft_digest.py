"""What `mmtok sft`'s per-image freshness check costs: reading an image member's bytes from its tar and taking
their digest (`media_digest`), beside decoding the same member to 512 px (the encode's host work), per image.

    .venv/bin/python benchmarks/bench_sft_digest.py [--photos 8] [--repeats 5]

Real photos (Debian's mate-backgrounds, 2-6 MB JPEGs: the upper end of web images) in one tar; best of the
repeats, per image.
"""

from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from encodekit import write_tar  # noqa: E402 (tests/encodekit.py: the tar writer)
from mmtok.formats.conversations import Located  # noqa: E402
from mmtok.formats.items import media_digest  # noqa: E402
from mmtok.formats.tar import read_members  # noqa: E402
from realmedia import mate_photos  # noqa: E402


def main() -> None:
    from PIL import Image

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    photos = mate_photos()[: args.photos]
    members = [(f"{i}.jpg", photo.read_bytes()) for i, photo in enumerate(photos)]
    tar = write_tar(Path(tempfile.mkdtemp()) / "photos.tar", members)
    sources = [Located("member", m.name, path=str(tar), offset=m.offset, size=m.size) for m in read_members(tar)]

    def check() -> None:
        for source in sources:
            media_digest(source.read())

    def decode() -> None:
        for source in sources:
            image = Image.open(io.BytesIO(source.read()))
            image.draft("RGB", (512, 512))
            image.convert("RGB")

    mean_mb = sum(s.size for s in sources) / len(sources) / 1e6
    for name, action in (("read + digest (the sft check)", check), ("read + decode to 512 px (encode)", decode)):
        best = float("inf")
        for _ in range(args.repeats):
            started = time.perf_counter()
            action()
            best = min(best, time.perf_counter() - started)
        print(f"{name}: {best / len(sources) * 1000:.2f} ms per image (mean member {mean_mb:.2f} MB)")


if __name__ == "__main__":
    main()
