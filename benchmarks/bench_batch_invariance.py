"""Batch invariance on the CPU at a realistic codebook size: Emu3.5 codes of the same photos per batch size.

    PYTHONPATH=. python benchmarks/bench_batch_invariance.py [--photos 8] [--side 512] [--batches 1,4,8]
        [--official PATH/TO/Emu3.5/src]

A random-weight Emu3.5 checkpoint in the official format with the full 131,072 x 256 codebook and a small
encoder (about 36 M parameters, most of them the codebook), written and loaded as official files; real
photos (scikit-image samples, then Debian's mate-backgrounds) resized as the pipeline does. Each batch
size encodes the photo set in order, and once shuffled; against batch 1 it reports the latents that
are not bit-identical, the codes that differ (per million) and the top-1 minus top-2 logit gaps where they
differ, beside the median gap of all codes (how close the near-ties are). Prints a Markdown section for
benchmarks/RESULTS.md. About 2-4 minutes on 2 CPU cores.

With --official (the `src` folder of a checkout of the official Emu3.5 repository, github.com/baaivision/Emu3.5,
and `einops` importable; neither is a dependency of mmtok, nor is any of its code in this repository), the same
checkpoint files are also loaded by the official IBQ model and a second table gives the agreement at this
realistic codebook size: the official latents per batch size against its own batch 1, and mmtok's codes against
the official codes per batch size (equal per million, and the official top-1 minus top-2 logit where they
differ). About 3 times as long.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
import types
from pathlib import Path

import numpy as np
import torch
import yaml

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


def official_model(src: Path, checkpoint: Path) -> torch.nn.Module:
    """The official IBQ model from a checkout's `src` folder, loaded from the same config.yaml + model.ckpt.

    The package's __init__ imports transformers and omegaconf only for its hub loader, so the package object
    is made here with its path alone and `ibq` imported from it; the config is plain YAML either way."""
    package = types.ModuleType("vision_tokenizer")
    package.__path__ = [str(Path(src) / "vision_tokenizer")]
    sys.modules["vision_tokenizer"] = package
    from vision_tokenizer.ibq import IBQ  # noqa: E402 -- the official code, from the user's checkout

    model = IBQ(**yaml.safe_load((checkpoint / emu35.CONFIG_FILE).read_text()))
    state = torch.load(checkpoint / emu35.CHECKPOINT_FILE, map_location="cpu")
    model.load_state_dict(state["state_dict"])
    return model.eval()


def official_codes(model: torch.nn.Module, latents: torch.Tensor) -> torch.Tensor:
    """The official quantizer's codes (argmax of its softmax over all logits), one image at a time.

    One image at a time because the official forward holds three [B, 131072, h, w] float32 tensors (logits,
    softmax, one-hot): 1.5 GiB per 512^2 image. The batch dependence measured is the encoder's."""
    return torch.stack([model.quantize(z[None])[2][2].reshape(z.shape[1:]) for z in latents])


def official_rows(model, codec, pixels: torch.Tensor, sizes: list[int], mmtok_codes: torch.Tensor,
                  weight: torch.Tensor) -> list[list]:
    """Per batch size: official latents and codes vs its own batch 1, and mmtok's codes vs the official codes."""
    order = np.arange(len(pixels))
    encode = lambda batch: model.quant_conv(model.encoder(codec.normalize(batch)))  # noqa: E731
    rows, first_latents, first_codes = [], None, None
    for size in sizes:
        t = time.perf_counter()
        latents = in_batches(encode, pixels, order, size)
        codes = official_codes(model, latents)
        if first_latents is None:
            first_latents, first_codes = latents, codes
        differ = (codes != mmtok_codes).flatten()
        vectors = latents.permute(0, 2, 3, 1).reshape(-1, latents.shape[1])
        gaps = sorted(top2_gaps(vectors[differ], weight).tolist()) if differ.any() else []
        rows.append([size, mmtok_codes.numel(), f"{float((latents - first_latents).abs().max()):.2g}",
                     int((codes != first_codes).sum()), int(differ.sum()),
                     round(1e6 * (1 - float(differ.float().mean())), 1), gap_text(gaps),
                     round(time.perf_counter() - t, 1)])
        log(f"official batch {size}: {rows[-1][4]} codes differ from mmtok's")
    return rows


def gap_text(gaps: list[float]) -> str:
    if not gaps:
        return "-"
    shown = ", ".join(f"{g:.2g}" for g in gaps[:6])
    return shown + (f" ... {gaps[-1]:.2g} ({len(gaps)} in all)" if len(gaps) > 6 else "")


@torch.no_grad()
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--photos", type=int, default=8)
    parser.add_argument("--side", type=int, default=512)
    parser.add_argument("--batches", default="1,4,8", help="batch sizes; the first is the reference")
    parser.add_argument("--official", type=Path, metavar="SRC",
                        help="the src folder of an official Emu3.5 checkout: also compare with the official code")
    args = parser.parse_args()
    sizes = [int(x) for x in args.batches.split(",")]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = emu35.write_random_checkpoint(Path(tmp), CONFIG, seed=0)
        codec = emu35.load(checkpoint, "cpu")
        official = official_model(args.official, checkpoint) if args.official else None
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
    parity = official_rows(official, codec, pixels, sizes, reference, weight) if official is not None else []
    wall = time.perf_counter() - started
    command = f"PYTHONPATH=. python benchmarks/bench_batch_invariance.py --photos {args.photos} --side {args.side} " \
              f"--batches {args.batches}" + (" --official EMU3.5/src" if official is not None else "")
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
    if parity:
        header = ["official batch", "codes", "official latents: max abs diff vs its batch 1",
                  "official codes moved vs its batch 1", "mmtok codes differing from official", "equal per million",
                  "official top-1 minus top-2 logit where they differ", "seconds"]
        print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
        for row in parity:
            print("| " + " | ".join(map(str, row)) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
