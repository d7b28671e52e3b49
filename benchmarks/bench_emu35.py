"""Emu3.5 IBQ codec benchmark: chunked-argmax quantizer vs the official softmax/one-hot path, and encoders.

    python benchmarks/bench_emu35.py                      # CPU sections, plus the CUDA section on a GPU
    python benchmarks/bench_emu35.py --quick              # small sizes: a smoke run of the CPU sections
    python benchmarks/bench_emu35.py --accelerator-smoke  # the CUDA section's code on the CPU, tiny sizes

Sections (Markdown tables on stdout, progress on stderr):
1. Quantizer alone at full size: a 131,072 x 256 codebook (N(0, 1), the reference's init) and N(0, 1)
   latents of 512x512 (32x32 grid) and 1024x1024 (64x64 grid) images, batch 1-8. Each path runs in its
   own fresh subprocess: time (best of the repeats) and peak memory (ru_maxrss after the runs minus
   ru_maxrss once the codebook and latents exist); the two paths' codes are compared. The reference
   path holds several [B, 131072, h, w] float32 tensors; a case that does not fit in the memory
   available at that moment is reported as skipped, with what it would need.
2. Whole encoder on the CPU, MID_CONFIG below (full-size codebook, a half-width, half-depth encoder), images/s
   of `encode` (argmax) and `encode_reference` (softmax path) on real photos, same run.
3. CUDA, only when torch.cuda.is_available(): the full-size architecture (FULL_SIZE_CONFIG, about 455 M
   parameters, random weights) at 512^2 and 1024^2 with TF32 on and off (images/s, peak memory); the
   two quantizer paths on the GPU; and the fraction of codes that differ between TF32 and strict fp32
   and between bf16 autocast and strict fp32 on real photos (skimage + Debian mate-backgrounds). The
   bf16 run calls the codec's modules directly, because the codec itself refuses bf16 by contract.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

from mmtok.codecs import emu35
from mmtok.codecs.base import PrecisionContract
from mmtok.media.images import load_rgb_file, resize_rgb

CODEBOOK = (131072, 256)
MIB = 1 << 20
# Reference path: logits, softmax and one-hot, each [B, 131072, h, w] float32, are what
# the reference allocates; measured 3.04x one such tensor at 512x512, batch 1, on the CPU.
REFERENCE_TENSORS = 3.2
MEMORY_MARGIN = 3 << 30  # leave this much of MemAvailable to the rest of the machine
# Mid-size encoder for the CPU figure: the published layout at half its width and half its depth
# (ch 128, 2 ResNet blocks per level) with the full 131,072 x 256 codebook.
MID_CONFIG = {**emu35.FULL_SIZE_CONFIG,
              "ddconfig": {**emu35.FULL_SIZE_CONFIG["ddconfig"], "ch": 128, "num_res_blocks": 2}}
STRICT_FP32 = PrecisionContract(tf32_matmul=False, tf32_conv=False)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows])


def random_quantizer(device: str | torch.device = "cpu") -> emu35.Quantizer:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return emu35.Quantizer(*CODEBOOK).to(device)


def random_latents(batch: int, grid: int, device: str | torch.device = "cpu") -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * batch + grid)
    return torch.randn(batch, CODEBOOK[1], grid, grid, generator=generator).to(device)


def quantize(quantizer: emu35.Quantizer, latents: torch.Tensor, path: str) -> torch.Tensor:
    with torch.no_grad():
        return quantizer.codes(latents) if path == "argmax" else quantizer.codes_reference(latents)[0]


def real_photos(size: int, count: int) -> np.ndarray:
    """`count` real photos (skimage samples, then Debian mate-backgrounds), resized to size x size: uint8 NHWC."""
    import skimage.data

    folder = Path(skimage.data.__file__).parent
    paths = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg"))
    paths += sorted(p for p in Path("/usr/share/backgrounds/mate").rglob("*") if p.suffix.lower() in (".jpg", ".png"))
    photos = [resize_rgb(load_rgb_file(str(path)), size, size) for path in paths[:count]]
    return np.stack([photos[i % len(photos)] for i in range(count)])


def best_time(function, repeats: int, sync=lambda: None) -> float:
    """Best wall-clock seconds of `repeats` calls."""
    return min(timed(function, sync)[0] for _ in range(repeats))


def timed(function, sync=lambda: None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of one call. CPU time is the figure that holds
    when other processes share the cores; wall time is what a dedicated machine would see."""
    sync()
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    sync()
    return time.perf_counter() - wall, time.process_time() - cpu


# ------------------------------------------------------------------------------- 1. quantizer, CPU


def quantizer_worker(path: str, grid: int, batch: int, repeats: int, codes_out: str) -> None:
    """Fresh process: one path, one case; prints JSON {wall, cpu, peak_bytes} and saves the codes."""
    quantizer = random_quantizer()
    latents = random_latents(batch, grid)
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    codes = []
    runs = [timed(lambda: codes.append(quantize(quantizer, latents, path))) for _ in range(repeats)]
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - baseline) * 1024  # Linux: KiB
    np.save(codes_out, codes[-1].numpy())
    print(json.dumps({"wall": min(r[0] for r in runs), "cpu": min(r[1] for r in runs), "peak_bytes": peak}))


def available_bytes() -> int:
    with open("/proc/meminfo") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["MemAvailable"].split()[0]) * 1024


def run_worker(path: str, grid: int, batch: int, repeats: int, codes_out: Path) -> dict:
    command = [sys.executable, __file__, "--worker", path, "--grid", str(grid), "--batch", str(batch),
               "--repeats", str(repeats), "--codes-out", str(codes_out)]
    result = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def quantizer_section(grids: tuple[int, ...], batches: tuple[int, ...]) -> str:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for grid in grids:
            for batch in batches:
                log(f"quantizer: grid {grid}x{grid}, batch {batch}")
                repeats = 2 if batch * grid * grid <= 2048 else 1
                case = [f"{16 * grid}x{16 * grid}", f"{grid}x{grid}", batch]
                argmax = run_worker("argmax", grid, batch, repeats, Path(tmp, "argmax.npy"))
                need = REFERENCE_TENSORS * batch * CODEBOOK[0] * grid * grid * 4
                if need > available_bytes() - MEMORY_MARGIN:
                    rows.append(case + [f"{argmax['wall']:.2f} / {argmax['cpu']:.2f}",
                                        f"skipped (needs ~{need / 2**30:.0f} GiB)", "",
                                        f"{argmax['peak_bytes'] / MIB:.0f}", "", "", ""])
                    continue
                reference = run_worker("reference", grid, batch, repeats, Path(tmp, "reference.npy"))
                same = np.array_equal(np.load(Path(tmp, "argmax.npy")), np.load(Path(tmp, "reference.npy")))
                rows.append(case + [f"{argmax['wall']:.2f} / {argmax['cpu']:.2f}",
                                    f"{reference['wall']:.2f} / {reference['cpu']:.2f}",
                                    f"{reference['wall'] / argmax['wall']:.1f}x / "
                                    f"{reference['cpu'] / argmax['cpu']:.1f}x",
                                    f"{argmax['peak_bytes'] / MIB:.0f}", f"{reference['peak_bytes'] / MIB:.0f}",
                                    f"{reference['peak_bytes'] / max(argmax['peak_bytes'], 1):.0f}x",
                                    "yes" if same else "NO"])
    header = ["image", "grid", "batch", "argmax s (wall / CPU)", "softmax/one-hot s (wall / CPU)",
              "speed-up (wall / CPU)", "argmax peak MiB", "softmax/one-hot peak MiB", "memory ratio",
              "identical codes"]
    return "### Quantizer alone, 131,072 x 256 codebook, CPU\n\n" + table(header, rows)


# --------------------------------------------------------------------------------- 2. encoder, CPU


def encoder_section(sizes: tuple[int, ...], batch: int, repeats: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:  # through the official files, as a user would load it
        codec = emu35.load(emu35.write_random_checkpoint(tmp, MID_CONFIG, seed=0), "cpu")
    parameters = (sum(p.numel() for p in codec.encoder.parameters())
                  + sum(p.numel() for p in codec.quant_conv.parameters()))
    rows = []
    for size in sizes:
        log(f"encoder: {size}x{size}, batch {batch}")
        pixels = torch.from_numpy(real_photos(size, batch))
        same = torch.equal(codec.encode(pixels), codec.encode_reference(pixels))  # also the warm-up
        runs = {"argmax": [], "reference": []}
        for _ in range(repeats):  # interleaved, so both paths see the same load on a shared machine
            runs["argmax"].append(timed(partial(codec.encode, pixels)))
            runs["reference"].append(timed(partial(codec.encode_reference, pixels)))
        (wall, cpu), (ref_wall, ref_cpu) = ([min(r[i] for r in runs[path]) for i in (0, 1)] for path in runs)
        rows.append([f"{size}x{size}", batch, f"{batch / wall:.3f}", f"{batch / ref_wall:.3f}",
                     f"{cpu / batch:.1f}", f"{ref_cpu / batch:.1f}", f"{ref_cpu / cpu:.2f}x",
                     "yes" if same else "NO"])
    header = ["image", "batch", "encode images/s (wall)", "encode_reference images/s (wall)",
              "encode CPU s/image", "encode_reference CPU s/image", "speed-up (CPU time)", "identical codes"]
    return (f"### Whole encoder, CPU: MID_CONFIG ({parameters / 1e6:.1f} M encoder parameters, "
            f"131,072 x 256 codebook), real photos\n\n" + table(header, rows))


# ------------------------------------------------------------------------------- 3. accelerator


def accelerator_section(device: torch.device, config: dict, sizes: tuple[int, ...], batch: int,
                        iterations: int, flip_photos: int, grids: tuple[int, ...], batches: tuple[int, ...]) -> str:
    is_cuda = device.type == "cuda"

    def sync():
        if is_cuda:
            torch.cuda.synchronize(device)

    def peak_mib(function) -> str:
        if not is_cuda:
            return "n/a"
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        function()
        return f"{(torch.cuda.max_memory_allocated(device) - before) / MIB:.0f}"

    log(f"accelerator: building the random-weight model on {device}")
    codec = emu35.random_codec(config, seed=0).to(device)
    out = [f"### {device.type.upper()}: {torch.cuda.get_device_name(device) if is_cuda else 'CPU smoke run'}, "
           f"{sum(p.numel() for p in codec.parameters()) / 1e6:.0f} M parameters, random weights\n"]
    rows = []
    for size in sizes:
        pixels = torch.from_numpy(real_photos(size, batch)).to(device)
        for contract in (emu35.PRECISION, STRICT_FP32):
            contract.apply()
            log(f"accelerator: {size}x{size} batch {batch} tf32={contract.tf32_matmul}")
            codec.encode(pixels)  # warm-up
            seconds = best_time(partial(codec.encode, pixels), iterations, sync)
            rows.append([f"{size}x{size}", batch, "TF32" if contract.tf32_matmul else "strict fp32",
                         f"{batch / seconds:.2f}", peak_mib(partial(codec.encode, pixels))])
    out.append(table(["image", "batch", "precision", "encode images/s", "peak MiB"], rows))

    emu35.PRECISION.apply()
    rows = []
    for grid in grids:
        for count in batches:
            quantizer, latents = codec.quantize, random_latents(count, grid, device)
            if config["n_embed"] != CODEBOOK[0]:
                quantizer = random_quantizer(device)
            times, peaks, codes = {}, {}, {}
            for path in ("argmax", "reference"):
                codes[path] = quantize(quantizer, latents, path)  # warm-up, and the codes compared
                times[path] = best_time(partial(quantize, quantizer, latents, path), iterations, sync)
                peaks[path] = peak_mib(partial(quantize, quantizer, latents, path))
            rows.append([f"{grid}x{grid}", count, f"{times['argmax'] * 1e3:.1f}", f"{times['reference'] * 1e3:.1f}",
                         f"{times['reference'] / times['argmax']:.2f}x", peaks["argmax"], peaks["reference"],
                         "yes" if torch.equal(codes["argmax"], codes["reference"]) else "NO"])
    out.append("\nQuantizer alone (131,072 x 256, TF32 contract):\n")
    out.append(table(["grid", "batch", "argmax ms", "softmax/one-hot ms", "speed-up", "argmax peak MiB",
                      "softmax/one-hot peak MiB", "identical codes"], rows))

    rows = []
    for size in sizes:
        photos = real_photos(size, flip_photos)
        strict, tf32, bf16 = [], [], []
        for start in range(0, flip_photos, batch):
            pixels = torch.from_numpy(photos[start:start + batch]).to(device)
            STRICT_FP32.apply()
            strict.append(codec.encode(pixels).cpu())
            with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
                # Deliberately around the codec's bf16 refusal, to measure what the refusal prevents.
                latents = codec.quant_conv(codec.encoder(codec.normalize(pixels)))
                bf16.append(codec.quantize.codes(latents).cpu())
            emu35.PRECISION.apply()
            tf32.append(codec.encode(pixels).cpu())
        strict, tf32, bf16 = (torch.cat(codes) for codes in (strict, tf32, bf16))
        rows.append([f"{size}x{size}", flip_photos, strict.numel(), f"{(tf32 != strict).float().mean():.4%}",
                     f"{(bf16 != strict).float().mean():.4%}"])
    out.append("\nCode flips on real photos (reference: strict fp32):\n")
    out.append(table(["image", "photos", "codes", "TF32 vs fp32", "bf16 autocast vs fp32"], rows))
    emu35.PRECISION.apply()
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run of the CPU sections")
    parser.add_argument("--accelerator-smoke", action="store_true",
                        help="run the CUDA section's code on the CPU with tiny sizes (to check it before a GPU run)")
    parser.add_argument("--sections", default="quantizer,encoder,cuda", help="comma-separated subset")
    parser.add_argument("--worker", choices=("argmax", "reference"), help=argparse.SUPPRESS)
    parser.add_argument("--grid", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--repeats", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--codes-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        quantizer_worker(args.worker, args.grid, args.batch, args.repeats, args.codes_out)
        return
    torch.manual_seed(0)
    sections = set(args.sections.split(","))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads\n")
    if args.accelerator_smoke:
        print(accelerator_section(torch.device("cpu"), emu35.TINY_CONFIG, (64,), 2, 1, 4, (4,), (1, 2)))
        return
    if "quantizer" in sections:
        grids, batches = ((4, 8), (1, 2)) if args.quick else ((32, 64), (1, 2, 4, 8))
        print(quantizer_section(grids, batches) + "\n")
    if "encoder" in sections:
        print(encoder_section((64,) if args.quick else (256, 512), batch=1 if args.quick else 2, repeats=2) + "\n")
    if "cuda" in sections and torch.cuda.is_available():
        device = torch.device("cuda")
        print(accelerator_section(device, emu35.FULL_SIZE_CONFIG, (512, 1024), batch=4, iterations=5,
                                  flip_photos=32, grids=(32, 64), batches=(1, 8)))


if __name__ == "__main__":
    main()
