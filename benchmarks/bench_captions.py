"""What the caption checks add to `mmtok hash`: the measures of one caption beside the pHash of one web image.

    python benchmarks/bench_captions.py [--captions 20000] [--rounds 3]

Captions: real English text (the sentences of this repository's docs/ and README, joined into captions of 10 to
60 words, as alt-text and model captions run), measured by `mmtok.curate.captions.measure` without fragments and
with 10,000 prompt fragments of 3 to 12 words taken from the same text (the most a fragment file may hold).
Worst cases: three captions of 64 KiB (the most that is read of one): one word repeated, random letters and
spaces, and 13,000 distinct words, each with the 10,000 fragments. Baseline, in the same run and process: the
per-image work of `mmtok hash` (`mmtok.curate.phash.image_hashes`) on the bundled demo photos re-encoded as
512-pixel JPEGs. CPU time of this process (one core); rounds alternate the two, the best round is reported.
"""

from __future__ import annotations

import argparse
import io
import random
import re
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def real_captions(count: int, rng: random.Random) -> list[bytes]:
    text = " ".join(p.read_text("utf-8") for p in sorted((REPO / "docs").glob("*.md")) + [REPO / "README.md"])
    words = re.sub(r"[`|#*\[\]()<>]", " ", text).split()
    out = []
    for _ in range(count):
        start, length = rng.randrange(len(words) - 60), rng.randint(10, 60)
        out.append(" ".join(words[start:start + length]).encode("utf-8"))
    return out, words


def web_images() -> list[bytes]:
    from PIL import Image

    out = []
    for path in sorted((REPO / "mmtok" / "data" / "demo" / "images").iterdir()):
        image = Image.open(path).convert("RGB")
        image.thumbnail((512, 512), Image.Resampling.LANCZOS)
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def per_item(work, items) -> float:
    began = time.process_time()
    for item in items:
        work(item)
    return (time.process_time() - began) / len(items)


def main() -> None:
    from mmtok.curate import captions
    from mmtok.curate.phash import image_hashes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--captions", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = random.Random(0)
    texts, words = real_captions(args.captions, rng)
    fragments = captions.Fragments([" ".join(words[s:s + rng.randint(3, 12)])
                                    for s in (rng.randrange(len(words) - 12) for _ in range(captions.MAX_FRAGMENTS))])
    images = web_images() * 20
    best = {"image": [], "plain": [], "fragments": []}
    for _ in range(args.rounds):
        best["image"].append(per_item(image_hashes, images))
        best["plain"].append(per_item(lambda t: captions.measure(t, False, None), texts))
        best["fragments"].append(per_item(lambda t: captions.measure(t, False, fragments), texts))
    image = min(best["image"])
    print(f"{len(texts):,} captions (mean {sum(len(t.split()) for t in texts) / len(texts):.0f} words), "
          f"{len(images)} web JPEGs, best of {args.rounds} rounds, one core")
    print("| work per sample | CPU time | vs the image's pHash + sha256 |\n|---|---:|---:|")
    print(f"| pHash + sha256 of a 512-px JPEG (baseline) | {image * 1e3:.2f} ms | 1.00 |")
    for name, label in (("plain", "caption measures"), ("fragments", "caption measures, 10,000 fragments")):
        value = min(best[name])
        print(f"| {label} | {value * 1e6:.0f} us | {value / image:.3f} |")
    vocab = sorted(set(words))
    worst = {"one word repeated": b"ha " * (captions.MAX_CAPTION_BYTES // 3),
             "random letters and spaces": bytes(rng.choice(b"ab ") for _ in range(captions.MAX_CAPTION_BYTES)),
             "13,000 distinct words": " ".join(rng.choice(vocab) for _ in range(13000)).encode()[
                 :captions.MAX_CAPTION_BYTES]}
    for name, data in worst.items():
        value = min(per_item(lambda t: captions.measure(t, True, fragments), [data]) for _ in range(args.rounds))
        print(f"| worst case, 64 KiB: {name}, 10,000 fragments | {value * 1e3:.1f} ms | {value / image:.1f} |")


if __name__ == "__main__":
    main()
