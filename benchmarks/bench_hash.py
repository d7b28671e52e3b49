"""`mmtok hash`'s per-image work vs `imagehash.phash`, on the same real JPEGs, one core each, in one run.

    python benchmarks/bench_hash.py [--rounds 3] [--json OUT.json]

Corpora (built in memory from Debian's mate-backgrounds photos and scikit-image's photos, so the run needs no
files of its own): `photos`, the JPEGs as they are (up to 5640x3172), and `web`, every photo re-encoded as a
JPEG of at most 512 pixels a side (quality 90, the size most web-scale corpora hold). For each corpus, rounds
alternate imagehash (`imagehash.phash(Image.open(BytesIO(data)))`) and mmtok (`mmtok.curate.phash.image_hashes`:
the decode with its guards, the pHash and the sha256 of the bytes); CPU time of this process (one core) per
image is reported, with the ratio, and every hash is checked equal to imagehash's. Also measured once: the JPEG
draft decode (a fast path considered and not adopted), its time and how many of its hashes equal the exact ones.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))


def corpora() -> dict[str, list[bytes]]:
    from PIL import Image

    from realmedia import mate_photos, skimage_images

    files = [p for p in mate_photos() + skimage_images() if p.suffix.lower() in (".jpg", ".jpeg")]
    photos = [p.read_bytes() for p in files]
    web = []
    for path in mate_photos() + skimage_images():
        if path.name == "multipage_rgb.tif":
            continue
        image = Image.open(path).convert("RGB")
        image.thumbnail((512, 512), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        web.append(buffer.getvalue())
    return {"photos": photos, "web": web}


def imagehash_round(images: list[bytes]) -> tuple[float, list[str]]:
    import imagehash
    from PIL import Image

    began = time.process_time()
    found = [str(imagehash.phash(Image.open(io.BytesIO(data)))) for data in images]
    return time.process_time() - began, found


def mmtok_round(images: list[bytes]) -> tuple[float, list[str]]:
    from mmtok.curate.phash import hex64, image_hashes

    began = time.process_time()
    found = [hex64(image_hashes(data)[0]) for data in images]
    return time.process_time() - began, found


def draft_round(images: list[bytes]) -> tuple[float, list[str]]:
    """The fast path that was measured and not adopted: libjpeg's DCT-domain downscaling to grayscale (Pillow's
    `draft("L", (64, 64))`: the smallest 1/2, 1/4 or 1/8 scale still >= 64 pixels a side) before the same steps."""
    from PIL import Image

    from mmtok.curate.phash import hex64, phash_of_image

    began = time.process_time()
    found = []
    for data in images:
        image = Image.open(io.BytesIO(data))
        image.draft("L", (64, 64))
        found.append(hex64(phash_of_image(image)))
    return time.process_time() - began, found


def draft_agreement(images: list[bytes], reference: list[str]) -> dict:
    seconds, hashes = draft_round(images)
    distance = [bin(int(a, 16) ^ int(b, 16)).count("1") for a, b in zip(hashes, reference, strict=True)]
    return {"ms_per_image": 1000 * seconds / len(images), "identical_share": distance.count(0) / len(distance),
            "mean_bits_off": sum(distance) / len(distance), "max_bits_off": max(distance)}


def measure(images: list[bytes], rounds: int) -> dict:
    times = {"imagehash": [], "mmtok": []}
    for _ in range(rounds):  # alternated, so drift on a shared machine hits both
        for name, run in (("imagehash", imagehash_round), ("mmtok", mmtok_round)):
            seconds, hashes = run(images)
            times[name].append(seconds)
            if name == "imagehash":
                reference = hashes
            elif hashes != reference:
                raise SystemExit("bench_hash: mmtok's pHash differs from imagehash's")
    best = {name: min(values) / len(images) for name, values in times.items()}
    return {"draft_not_adopted": draft_agreement(images, reference), "images": len(images),
            "mean_bytes": sum(map(len, images)) / len(images),
            "ms_per_image": {name: 1000 * value for name, value in best.items()},
            "images_per_core_second": {name: 1 / value for name, value in best.items()},
            "speedup": best["imagehash"] / best["mmtok"], "identical": True}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = {name: measure(images, args.rounds) for name, images in corpora().items()}
    for name, r in results.items():
        ms = r["ms_per_image"]
        print(f"{name}: {r['images']} JPEGs, mean {r['mean_bytes'] / 1000:.0f} KB: imagehash {ms['imagehash']:.2f} "
              f"ms/image, mmtok {ms['mmtok']:.2f} ms/image (one core each): {r['speedup']:.2f}x, hashes identical")
        d = r["draft_not_adopted"]
        print(f"  draft decode (not adopted): {d['ms_per_image']:.2f} ms/image, "
              f"{ms['imagehash'] / d['ms_per_image']:.2f}x imagehash, {100 * d['identical_share']:.0f}% of hashes "
              f"identical, {d['mean_bits_off']:.2f} bits off on average (max {d['max_bits_off']})")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
