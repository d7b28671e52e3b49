"""Batch invariance on the CPU at a realistic codebook size: Emu3.5 codes of the same photos per batch size.

    PYTHONPATH=. python benchmarks/bench_batch_invariance.py [--photos 8] [--side 512] [--batches 1,4,8]

A random-weight Emu3.5 checkpoint in the official format with the full 131,072 x 256 codebook and a small
encoder (about 36 M parameters, most of them the codebook), written and loaded as official files; real
photos (scikit-image samples, then Debian's mate-backgrounds) resized as the pipeline does. Each batch
size encodes the photo set in order, and once shuffled; against batch 1 it reports the latents that
are not bit-identical, the codes that differ (per million) and the top-1 minus top-2 logit gaps where they
differ, beside the median gap of all codes (how close the near-ties are). Prints a Markdown section for
benchmarks/RESULTS.md. About 2-4 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from mmtok.codecs import emu35
from mmtok.media.images import load_rgb_file, resize_rgb

REPO = Path(__file__).resolve().parent.parent
# The full codebook and latent width; a narrow 5-level encoder (16 pixels per code) keeps the CPU run short.
CONFIG = {"n_embed": 131072, "embed_dim": 256, "ddconfig": {
    "double_z": False, "z_channels": 256, "resolution": 256, "in_channels": 3, "out_ch": 3,
    "ch": 32, "ch_mult": [1, 1, 2, 2, 4], "num_res_blocks": 1, "attn_resolutions": [16], "dropout": 0.0}}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def photos(count: int, side: int) -> np.ndarray:
    sys.path.insert(0, str(REPO / "tests"))
    from realmedia import mate_photos, skimage_images

    paths = [p for p in skimage_images() if p.suffix.lower() in (".png", ".jpg")] + mate_photos()
    return np.stack([resize_rgb(load_rgb_file(str(p)), side, side) for p in paths[:count]])


def in_batches(function, pixels: torch.Tensor, order: np.ndarray, size: int) -> torch.Tensor:
    """function over pixels[order] in batches of `size`, returned in the original order."""
    out = torch.cat([function(pixels[torch.from_numpy(order[s:s + size].copy())]) for s in range(0, len(order), size)])
    return out[torch.from_numpy(np.argsort(order))]


def top2_gaps(latents: torch.Tensor, weight: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Top-1 minus top-2 logit (z.e) of each latent vector [N, D], in row blocks (bounded memory)."""
    gaps = []
    for start in range(0, len(latents), block):
        top = (latents[start:start + block] @ weight.T).topk(2, dim=1).values
        gaps.append(top[:, 0] - top[:, 1])
    return torch.cat(gaps)


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=8)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--batches", default="1,4,8", help="batch sizes; the first is the reference")
    args = parser.parse_args()
    sizes = [int(x) for x in args.batches.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        codec = emu35.load(emu35.write_random_checkpoint(Path(tmp), CONFIG, seed=0), "cpu")
    parameters = sum(p.numel() for p in codec.parameters())
    pixels = torch.from_numpy(photos(args.photos, args.side))
    weight = codec.quantize.embedding.weight
    log(f"{parameters / 1e6:.1f} M parameters, {len(pixels)} photos at {args.side}^2")
    order = np.arange(len(pixels))
    reference_latents = in_batches(codec.latents, pixels, order, sizes[0])
    reference = torch.cat([codec.quantize.codes(z[None]) for z in reference_latents])
    vectors = reference_latents.permute(0, 2, 3, 1).reshape(-1, reference_latents.shape[1])
    median_gap = float(top2_gaps(vectors, weight).median())
    rows = []
    shuffled = np.random.default_rng(0).permutation(len(pixels))
    for size in sizes[1:]:
        for name, layout in (("in order", order), ("shuffled", shuffled)):
            t = time.perf_counter()
            latents = in_batches(codec.latents, pixels, layout, size)
            codes = in_batches(codec.quantize.codes, latents, layout, size)  # = encode(), whose first half is latents
            differ = (codes != reference).flatten()
            gaps = top2_gaps(vectors[differ], weight).tolist() if differ.any() else []
            rows.append([size, name, reference.numel(), int((latents != reference_latents).sum()),
                         int(differ.sum()), round(1e6 * float(differ.float().mean()), 1),
                         ", ".join(f"{g:.2g}" for g in sorted(gaps)[:8]) or "-", round(time.perf_counter() - t, 1)])
            log(f"batch {size} {name}: {rows[-1][4]} codes differ")
    wall = time.perf_counter() - started
    command = f"PYTHONPATH=. python benchmarks/bench_batch_invariance.py --photos {args.photos} --side {args.side} " \
              f"--batches {args.batches}"
    print(f"Command: `{command}`; {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads; {wall:.0f} s in all.\n")
    print(f"Codec: Emu3.5 random weights, {parameters / 1e6:.1f} M parameters (codebook 131,072 x 256), official "
          f"files; {len(pixels)} real photos at {args.side}^2; reference: batch {sizes[0]}; median top-1 minus "
          f"top-2 logit of all codes {median_gap:.3g}.\n")
    header = ["batch", "composition", "codes", "latent values not bit-identical", "codes differing", "per million",
              "gaps where they differ", "seconds"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
