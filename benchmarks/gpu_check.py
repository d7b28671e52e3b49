"""One prepared GPU check: every figure mmtok needs from a GPU, in one command, within a time budget.

    bash benchmarks/gpu_check.sh [--out DIR]           # on the GPU machine (under 8 minutes on an H200)
    bash benchmarks/gpu_check.sh --smoke --out DIR     # the same steps on the CPU with tiny sizes (CI)

The shell wrapper picks a Python that has torch and makes mmtok importable; this file runs the steps.
Each step runs in its own process under its own time cap, so a step that fails, runs out of memory or
out of time loses nothing of the others; a step saves its figures as it goes, so even a step killed at
its cap reports what it measured. After every step `gpu_check.json` and `gpu_check.md` are rewritten in
the results directory (--out, default $OUT, else /tmp/gpu-check).

Steps (status ok / failed / skipped, with a one-line error):
  environment   python, torch, CUDA, cuDNN, GPU name and memory, driver (torch.cuda; nvidia-smi if present)
  emu35         full-size random-weight Emu3.5 encoder at 512^2 and 1024^2: images/s of the chunked argmax and
                of the official softmax/one-hot quantizer, TF32 (the contract) and strict fp32; peak memory per
                case; code flips TF32 vs strict fp32 and bf16 autocast vs strict fp32 on the same real photos
  wavtokenizer  WavTokenizer encoder (official encoder size), seconds of audio per second at batch 1 and 32
  batch_invariance  under each codec's precision contract: the codes of a fixed real-photo set (Emu3.5) encoded
                at batch sizes 1, 2, 7, 16 and the plan's largest, and in shuffled compositions, against batch
                1: differing codes per million and the top-1 minus top-2 logit gaps where they differ; the same
                for WavTokenizer's kept codes (clips of mixed lengths, duration-sorted and shuffled batches,
                gaps of the negative squared distance)
  e2e           real-photo JPEG shards -> mmtok scan -> plan (2 ranks) -> encode rank 0 and 1 one after the
                other on cuda:0 (LOCAL_RANK=0, mid-size codec) -> merge; device-busy fraction and images/s
                from each part's stats.json
  status        `mmtok status OUT --plan PLAN --json` on the e2e output (skipped while the command is missing)
  calibrate     `mmtok calibrate` of the full-size codec, about a minute (skipped while the command is missing)
  cuda_context  in a fresh process with LOCAL_RANK=0: mmtok.launch.resolve_device(None), then the encoder's
                pinned host ring and a codec encode; current_device() == LOCAL_RANK before pinning, and the
                CUDA contexts of that process (NVML, else nvidia-smi): exactly one, on its own GPU
                (with two or more GPUs also LOCAL_RANK=1: no context of that process on GPU 0)

--smoke runs every step on the CPU (CUDA hidden) with tiny sizes in under 2 minutes on 2 cores; the
steps' code paths are the GPU run's. Without --smoke and without CUDA, the GPU steps are skipped.
This parent process imports only the standard library, so a report is written even where torch is missing.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: the parent process imports only the standard library (above)
    import torch

REPO = Path(__file__).resolve().parent.parent
STEPS = ("environment", "emu35", "wavtokenizer", "batch_invariance", "e2e", "status", "calibrate", "cuda_context")
REPORT_JSON, REPORT_MD = "gpu_check.json", "gpu_check.md"
MIB = 1 << 20
NOT_REACHED = "not reached: the check stopped before this step"


@dataclass(frozen=True)
class Profile:
    """Everything that differs between the GPU run and --smoke."""

    name: str
    budget_s: float  # the whole check; each step also has its own cap below
    caps: dict  # step -> seconds
    soft_margin_s: float  # a step stops starting new work this long before its cap
    emu35_config: str  # "full", "mid" or "tiny" (emu35_config())
    emu35_cases: tuple  # (image side, batch) pairs
    flip_photos: dict  # image side -> photos whose codes are compared
    case_seconds: float  # timed calls per case: as many as fit in this, at most max_repeats
    max_repeats: int
    case_reserve_s: float  # a case is skipped when less than this is left
    wav_clip_s: float
    wav_clips: int
    wav_batches: tuple
    e2e_codec: str
    e2e_distinct: int  # distinct JPEGs; the corpus repeats them up to e2e_images
    e2e_images: int
    e2e_long_side: tuple  # (min, max) pixels of a JPEG's long side
    e2e_per_shard: int
    e2e_loader_threads: int
    e2e_plan_flags: tuple
    calibrate_checkpoint: str
    calibrate_preset: dict  # "base": a preset of plans/; the other keys replace its values
    calibrate_flags: tuple
    invariance_codec: str  # Emu3.5 config of the batch_invariance step
    invariance_side: int  # image side of its photo set
    invariance_batches: tuple  # batch sizes compared with batch 1; the last is the plan's largest at that side
    invariance_clips: int  # WavTokenizer clips of mixed lengths
    invariance_clip_s: tuple  # (min, max) clip seconds


GPU = Profile(
    name="gpu", budget_s=405,
    caps={"environment": 15, "emu35": 115, "wavtokenizer": 35, "batch_invariance": 40, "e2e": 100, "status": 15,
          "calibrate": 60, "cuda_context": 25},
    soft_margin_s=6,
    emu35_config="full", emu35_cases=((512, 16), (1024, 4)), flip_photos={512: 16, 1024: 8},
    case_seconds=3.0, max_repeats=5, case_reserve_s=12,
    wav_clip_s=10.0, wav_clips=64, wav_batches=(1, 32),
    e2e_codec="mid", e2e_distinct=96, e2e_images=1536, e2e_long_side=(512, 2048), e2e_per_shard=128,
    e2e_loader_threads=max(1, min(14, (os.cpu_count() or 2) - 2)),
    e2e_plan_flags=("--preset", "apertus-stage1", "--token-budget", "32768", "--max-batch-images", "32"),
    calibrate_checkpoint="full", calibrate_preset={"base": "apertus-stage1"},
    calibrate_flags=("--device", "cuda", "--max-shapes", "6", "--batch-sizes", "1,8,32",
                     "--max-images", "32", "--repeats", "2", "--no-progress"),
    # 123 = apertus-stage1's largest batch at 512^2: token_budget 131,072 // 1,065 tokens per image
    invariance_codec="mid", invariance_side=512, invariance_batches=(2, 7, 16, 123),
    invariance_clips=64, invariance_clip_s=(1.0, 12.0),
)
SMOKE = Profile(
    # Caps about 3x what each step takes on an idle 2-core VM (~50 s in all), so a loaded CI machine
    # slows the check down rather than failing it.
    name="smoke", budget_s=300,
    caps={"environment": 30, "emu35": 60, "wavtokenizer": 60, "batch_invariance": 60, "e2e": 150, "status": 30,
          "calibrate": 60, "cuda_context": 45},
    soft_margin_s=2,
    emu35_config="tiny", emu35_cases=((64, 2),), flip_photos={64: 4},
    case_seconds=0.3, max_repeats=2, case_reserve_s=2,
    wav_clip_s=0.5, wav_clips=2, wav_batches=(1, 2),
    e2e_codec="tiny", e2e_distinct=8, e2e_images=24, e2e_long_side=(96, 192), e2e_per_shard=8, e2e_loader_threads=1,
    e2e_plan_flags=("--preset", "apertus-stage1", "--min-pixels", "1024", "--max-pixels", "2304", "--min-source-pixels",
                    "100", "--token-budget", "60", "--max-batch-images", "3"),
    calibrate_checkpoint="tiny",
    calibrate_preset={"base": "apertus-stage1", "min_pixels": 64 * 64, "max_pixels": 128 * 128},
    calibrate_flags=("--device", "cpu", "--max-shapes", "2", "--batch-sizes", "1",
                     "--max-images", "1", "--repeats", "1", "--no-progress"),
    invariance_codec="tiny", invariance_side=64, invariance_batches=(2, 7, 16, 17),
    invariance_clips=9, invariance_clip_s=(0.2, 0.6),
)


class Skipped(Exception):
    """A step that cannot run here; the message says why."""


def error_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:400]


def setup_note() -> str:
    """Which Python and which mmtok the check runs with (gpu_check.sh says so in GPU_CHECK_SETUP)."""
    return os.environ.get("GPU_CHECK_SETUP", f"python {sys.executable} (run directly, not through gpu_check.sh)")


def write_json(path: Path, data: dict) -> None:
    """Atomic: a reader (or a kill) never sees half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(partial, path)


# =============================================================================================
# The child side: one step in its own process


class StepRecord:
    """A step's figures so far, saved to its result file after every change."""

    def __init__(self, path: Path, deadline: float):
        self.path, self.deadline = path, deadline
        self.results: dict = {}
        self.save("failed", "the step stopped before it finished")  # what a kill leaves

    def left(self) -> float:
        """Seconds until this step should stop starting new work."""
        return self.deadline - time.time()

    def put(self, key: str, value) -> None:
        self.results[key] = value
        self.save("failed", "the step stopped before it finished")

    def append(self, key: str, item) -> None:
        self.put(key, self.results.get(key, []) + [item])

    def save(self, status: str, error: str | None) -> None:
        write_json(self.path, {"status": status, "error": error, "results": self.results})


def run_step(name: str, profile: Profile, work: Path, result: Path, deadline: float) -> None:
    step = StepRecord(result, deadline)
    try:
        STEP_FUNCTIONS[name](step, profile, work)
    except Skipped as why:
        step.save("skipped", str(why))
    except Exception as err:  # any failure is this step's result, with the traceback in its log
        traceback.print_exc()
        step.save("failed", error_line(err))
    else:
        step.save("ok", None)


def torch_device(profile: Profile):
    """(torch, the device the step measures on): CPU in --smoke, else CUDA or Skipped."""
    import torch

    if profile.name == "smoke":
        return torch, torch.device("cpu")
    if not torch.cuda.is_available():
        raise Skipped("no CUDA: torch.cuda.is_available() is False (run with --smoke for the CPU variant)")
    return torch, torch.device("cuda", 0)


def synchronizer(torch, device):
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def benchmarks_module(name: str):
    """A module of benchmarks/ or tests/ (bench_emu35, encodekit): their helpers, not copies of them."""
    for folder in (str(REPO / "benchmarks"), str(REPO / "tests")):
        if folder not in sys.path:
            sys.path.insert(0, folder)
    return importlib.import_module(name)


def emu35_config(name: str) -> dict:
    from mmtok.codecs import emu35

    return {"full": emu35.FULL_SIZE_CONFIG, "mid": benchmarks_module("bench_emu35").MID_CONFIG,
            "tiny": emu35.TINY_CONFIG}[name]


def random_checkpoint(work: Path, name: str) -> Path:
    """The random-weight Emu3.5 checkpoint of config `name` under `work`, written once and shared by the steps."""
    from mmtok.codecs import emu35

    directory = work / f"emu35-{name}"
    if not (directory / emu35.CONFIG_FILE).is_file():  # written last, atomically: present = complete
        emu35.write_random_checkpoint(directory, emu35_config(name), seed=0)
    return directory


# -- images -----------------------------------------------------------------------------------------
def source_images(limit: int) -> tuple[list, str]:
    """Up to `limit` RGB PIL images and where they came from: scikit-image's sample photos, then Debian's
    mate-backgrounds, where installed; else synthetic smooth images (the device machine may have neither)."""
    from mmtok.media.images import load_rgb_file

    paths: list[Path] = []
    try:
        import skimage.data

        folder = Path(skimage.data.__file__).parent
        paths += sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg"))
    except ImportError:
        pass
    paths += sorted(p for p in Path("/usr/share/backgrounds/mate").rglob("*") if p.suffix.lower() in (".jpg", ".png"))
    if paths:
        chosen = paths[:limit]
        skimage_count = sum("skimage" in str(p) for p in chosen)
        label = f"real images: {skimage_count} skimage.data, {len(chosen) - skimage_count} mate-backgrounds files"
        return [load_rgb_file(str(p)) for p in chosen], label
    return [synthetic_photo(seed) for seed in range(limit)], f"synthetic smooth images ({limit}; no real photos found)"


def synthetic_photo(seed: int, height: int = 768, width: int = 1024):
    """A smooth random RGB field with fine grain: a stand-in photo where no real one is installed."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize((width, height), Image.BICUBIC)
    grain = rng.normal(0, 6, (height, width, 3))
    return Image.fromarray(np.clip(np.asarray(coarse, np.float64) + grain, 0, 255).astype(np.uint8))


def photo_batch(images: list, side: int, count: int):
    """uint8 [count, side, side, 3]: the images resized (bicubic, as the pipeline), repeated as needed."""
    import numpy as np

    from mmtok.media.images import resize_rgb

    return np.stack([resize_rgb(images[i % len(images)], side, side) for i in range(count)])


# -- step: environment -------------------------------------------------------------------------------
def step_environment(step: StepRecord, profile: Profile, work: Path) -> None:
    from importlib import metadata

    step.put("setup", setup_note())
    step.put("python", f"{platform.python_version()} at {sys.executable}")
    step.put("platform", f"{platform.platform()}, {os.cpu_count()} CPUs")
    packages = {}
    for name in ("torch", "numpy", "pillow", "pyarrow", "scipy", "pyyaml", "tokenizers", "safetensors", "scikit-image",
                 "lhotse", "soxr", "soundfile", "mistral-common", "megatron-core", "nvidia-ml-py", "mmtok"):
        try:
            packages[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            packages[name] = None
    step.put("packages", packages)
    import torch

    import mmtok

    step.put("mmtok", f"{mmtok.__version__} from {Path(mmtok.__file__).parent}")
    step.put("torch", {"version": torch.__version__, "cuda": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                       "cuda_available": torch.cuda.is_available(), "threads": torch.get_num_threads()})
    gpus = []
    for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                     "capability": f"{props.major}.{props.minor}", "multiprocessors": props.multi_processor_count})
    step.put("gpus", gpus)
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,memory.used,clocks.max.sm",
                                "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        step.put("nvidia_smi", query.stdout.strip() or query.stderr.strip())
    else:
        step.put("nvidia_smi", "not installed")


# -- step: emu35 -------------------------------------------------------------------------------------
def step_emu35(step: StepRecord, profile: Profile, work: Path) -> None:
    torch, device = torch_device(profile)
    from mmtok.codecs import emu35

    bench = benchmarks_module("bench_emu35")
    cuda = device.type == "cuda"
    started = time.perf_counter()
    codec = emu35.load(random_checkpoint(work, profile.emu35_config), device)
    step.put("model", {"config": profile.emu35_config, "device": str(device),
                       "parameters_m": round(sum(p.numel() for p in codec.parameters()) / 1e6, 1),
                       "encoder_parameters_m": round(sum(p.numel() for p in codec.encoder.parameters()) / 1e6, 1),
                       "codebook": list(codec.quantize.embedding.weight.shape),
                       "weights_mib": round(torch.cuda.memory_allocated(device) / MIB) if cuda else None,
                       "build_and_load_s": round(time.perf_counter() - started, 1)})
    images, label = source_images(max(profile.flip_photos.values()))
    step.put("images", label)
    contracts = (("TF32", emu35.PRECISION), ("strict fp32", bench.STRICT_FP32))
    paths = {"argmax": codec.encode, "softmax/one-hot": codec.encode_reference}

    def throughput(precision: str, contract) -> None:
        for side, batch in profile.emu35_cases:
            for case in time_paths(step, torch, device, profile, paths, contract, photo_batch(images, side, batch)):
                step.append("throughput", {"image": side, "batch": batch, "precision": precision, **case})
            if cuda:
                torch.cuda.empty_cache()

    throughput(*contracts[0])
    for side, count in profile.flip_photos.items():  # the codes strict fp32 / TF32 / bf16 give the same photos
        if step.left() < profile.case_reserve_s:
            step.append("flips", {"image": side, "status": "skipped: out of time"})
            continue
        step.append("flips", code_flips(torch, device, codec, bench.STRICT_FP32, photo_batch(images, side, count),
                                        dict(profile.emu35_cases)[side], side))
    throughput(*contracts[1])
    emu35.PRECISION.apply()


def measure(torch, device, profile: Profile, function) -> dict:
    """A warm-up call, then as many timed calls as fit in profile.case_seconds (at most max_repeats), each
    between device synchronizations: the best wall seconds and the peak memory of the timed calls."""
    sync = synchronizer(torch, device)
    timed = benchmarks_module("bench_emu35").timed
    warm = timed(function, sync)[0]
    repeats = max(1, min(profile.max_repeats, int(profile.case_seconds / max(warm, 1e-6))))
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    best = min(timed(function, sync)[0] for _ in range(repeats))
    peak = round(torch.cuda.max_memory_allocated(device) / MIB) if device.type == "cuda" else None
    return {"best_s": best, "warmup_s": round(warm, 3), "repeats": repeats, "peak_mib": peak}


def time_paths(step: StepRecord, torch, device, profile: Profile, paths: dict, contract, photos):
    """Each quantizer path of `paths` on one batch under `contract`: its figures, or why it has none (out
    of time, out of GPU memory); the softmax path's codes are compared with the argmax path's."""
    pixels = torch.from_numpy(photos).to(device)
    codes = {}
    for path, encode in paths.items():
        case = {"path": path}
        if step.left() < profile.case_reserve_s:
            yield {**case, "status": "skipped: out of time"}
            continue
        try:
            contract.apply()
            figures = measure(torch, device, profile,
                              lambda path=path, encode=encode: codes.__setitem__(path, encode(pixels)))
        except torch.cuda.OutOfMemoryError as err:
            case["status"] = f"failed: {error_line(err)[:160]}"
        else:
            best = figures.pop("best_s")
            case.update(images_per_s=round(len(pixels) / best, 2), seconds_per_batch=round(best, 4), **figures)
        if "status" in case and device.type == "cuda":
            torch.cuda.empty_cache()  # outside the handler: its traceback no longer holds the tensors
        if len(codes) == 2:
            case["identical_codes"] = bool(torch.equal(*codes.values()))
        yield case


def code_flips(torch, device, codec, strict, photos, batch: int, side: int) -> dict:
    """Fractions of codes that differ from strict fp32 under TF32 and under bf16 autocast, same photos."""
    from mmtok.codecs import emu35

    strict_codes, tf32_codes, bf16_codes = [], [], []
    for start in range(0, len(photos), batch):
        pixels = torch.from_numpy(photos[start:start + batch]).to(device)
        strict.apply()
        strict_codes.append(codec.encode(pixels).cpu())
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            # Around the codec's bf16 refusal on purpose, to measure what the refusal prevents.
            latents = codec.quant_conv(codec.encoder(codec.normalize(pixels)))
            bf16_codes.append(codec.quantize.codes(latents).cpu().to(torch.int32))
        emu35.PRECISION.apply()
        tf32_codes.append(codec.encode(pixels).cpu())
    strict_codes, tf32_codes, bf16_codes = (torch.cat(c) for c in (strict_codes, tf32_codes, bf16_codes))
    return {"image": side, "photos": len(photos), "codes": strict_codes.numel(),
            "tf32_vs_fp32": float((tf32_codes != strict_codes).float().mean()),
            "bf16_vs_fp32": float((bf16_codes != strict_codes).float().mean())}


# -- step: wavtokenizer ------------------------------------------------------------------------------
def step_wavtokenizer(step: StepRecord, profile: Profile, work: Path) -> None:
    torch, device = torch_device(profile)
    from mmtok.codecs import wavtokenizer as wt

    directory = work / "wavtokenizer"
    if not (directory / "model.ckpt").is_file():
        wt.write_random_checkpoint(directory)
    codec = wt.load(directory, device)
    step.put("model", {"device": str(device), "encoder_parameters_m":
                       round(sum(p.numel() for p in codec.encoder.parameters()) / 1e6, 1),
                       "codebook": codec.codebook_size, "precision": codec.precision.to_dict()})
    waves = torch.from_numpy(synthetic_audio(profile.wav_clip_s, profile.wav_clips, wt.SAMPLE_RATE)).to(device)
    lengths = torch.full((len(waves),), waves.shape[1], device=device)
    step.put("audio", f"{profile.wav_clips} clips x {profile.wav_clip_s:g} s of synthetic tones and noise at 24 kHz "
                      "(encoder time does not depend on the content)")

    def encode_all(batch: int) -> None:
        for start in range(0, len(waves), batch):
            codec.encode(waves[start:start + batch], lengths[start:start + batch])

    for batch in profile.wav_batches:
        case = {"batch": batch, "audio_s": profile.wav_clips * profile.wav_clip_s}
        if step.left() < profile.case_reserve_s:
            step.append("cases", {**case, "status": "skipped: out of time"})
            continue
        figures = measure(torch, device, profile, functools.partial(encode_all, batch))
        best = figures.pop("best_s")
        step.append("cases", {**case, "wall_s": round(best, 4), "audio_s_per_s": round(case["audio_s"] / best, 1),
                              **figures})


def synthetic_audio(seconds: float, count: int, rate: int):
    """float32 [count, seconds * rate]: gliding tones with a syllable-like envelope plus noise, peak 0.7."""
    import numpy as np

    rng = np.random.default_rng(0)
    t = np.arange(int(seconds * rate)) / rate
    clips = []
    for _ in range(count):
        pitch = rng.uniform(90, 250) * (1 + 0.2 * np.sin(2 * np.pi * rng.uniform(0.2, 1) * t))
        wave = sum(np.sin(2 * np.pi * k * np.cumsum(pitch) / rate) / k for k in range(1, 6))
        wave = wave * (0.5 + 0.5 * np.sin(2 * np.pi * 4 * t) ** 2) + 0.05 * rng.standard_normal(t.size)
        clips.append(0.7 * wave / np.abs(wave).max())
    return np.stack(clips).astype(np.float32)


# -- step: batch_invariance -------------------------------------------------------------------------
def step_batch_invariance(step: StepRecord, profile: Profile, work: Path) -> None:
    """The codes of one input at other batch sizes and between other neighbours, against batch 1."""
    torch, device = torch_device(profile)
    from mmtok.codecs import emu35
    from mmtok.codecs import wavtokenizer as wt

    torch.set_grad_enabled(False)  # this process only measures
    codec = emu35.load(random_checkpoint(work, profile.invariance_codec), device)
    largest = profile.invariance_batches[-1]
    images, label = source_images(largest)
    photos = torch.from_numpy(photo_batch(images, profile.invariance_side, largest))
    step.put("images", f"{largest} photos at {profile.invariance_side}^2 ({label}); Emu3.5 {profile.invariance_codec} "
                       f"config, TF32 contract, on {device}")
    emu35.PRECISION.apply()
    weight = codec.quantize.embedding.weight

    def image_gaps(index: int, positions) -> list[float]:
        latents = codec.latents(photos[index:index + 1])[0].flatten(1).T  # [h*w, D], batch 1
        return top2_gaps(latents[positions] @ weight.T)

    step.put("image_median_gap", float(top2_gaps(codec.latents(photos[:1])[0].flatten(1).T @ weight.T).median()))
    invariance_cases(step, profile, torch, "emu3.5", photos, lambda batch: codec.encode(batch).flatten(1).cpu(),
                     image_gaps, device)

    directory = work / "wavtokenizer"
    if not (directory / "model.ckpt").is_file():
        wt.write_random_checkpoint(directory)
    audio = wt.load(directory, device)
    clips = mixed_clips(profile, wt.SAMPLE_RATE)
    step.put("audio", f"{len(clips)} synthetic clips of {profile.invariance_clip_s[0]:g} to "
                      f"{profile.invariance_clip_s[1]:g} s; WavTokenizer random weights, strict fp32, kept codes only")
    embed = audio.codebook.embed

    def audio_gaps(index: int, positions) -> list[float]:
        with torch.inference_mode():
            latents = audio.encoder(torch.from_numpy(clips[index]).to(device)[None, None])[0].T[positions]
        return top2_gaps(-(latents.pow(2).sum(1, keepdim=True) - 2 * latents @ embed.T + audio.codebook.embed_sq))

    def encode_audio(batch: list) -> list:
        return [torch.from_numpy(codes) for codes in audio.encode_clips(batch, sample_rate=wt.SAMPLE_RATE)]

    invariance_cases(step, profile, torch, "wavtokenizer", clips, encode_audio, audio_gaps, device)


def top2_gaps(scores) -> "torch.Tensor":
    """Top-1 minus top-2 score per row: how far each code is from flipping."""
    top = scores.topk(2, dim=1).values
    return (top[:, 0] - top[:, 1]).float().cpu()


def mixed_clips(profile: Profile, rate: int) -> list:
    """profile.invariance_clips synthetic clips of seeded lengths across profile.invariance_clip_s."""
    import numpy as np

    low, high = profile.invariance_clip_s
    waves = synthetic_audio(high, profile.invariance_clips, rate)
    lengths = np.random.default_rng(2).integers(int(low * rate), int(high * rate), len(waves))
    return [np.ascontiguousarray(wave[:length]) for wave, length in zip(waves, lengths, strict=True)]


def invariance_cases(step: StepRecord, profile: Profile, torch, codec: str, items, encode, gaps, device) -> None:
    """Encode `items` at batch 1, then at each size of profile.invariance_batches (input order), duration- or
    index-sorted in batches of 7 and in two shuffles at 16; one record per layout of what differs from batch 1."""
    import numpy as np

    count = len(items)
    sizes = [size for size in profile.invariance_batches if size <= count] or [count]
    rng = np.random.default_rng(0)
    layouts = [("input order", np.arange(count), size) for size in sizes]
    if codec == "wavtokenizer":
        layouts.append(("duration-sorted buckets", np.argsort([len(clip) for clip in items], kind="stable"), 7))
    layouts += [(f"shuffle {seed}", rng.permutation(count), min(16, count)) for seed in (1, 2)]

    def run(order, size: int) -> list:
        out = [None] * count
        for start in range(0, count, size):
            chosen = [int(i) for i in order[start:start + size]]
            batch = [items[i] for i in chosen] if isinstance(items, list) else items[chosen]
            for index, codes in zip(chosen, encode(batch), strict=True):
                out[index] = codes
        return out

    alone = run(np.arange(count), 1)
    total = sum(int(codes.numel()) for codes in alone)
    for name, order, size in layouts:
        case = {"codec": codec, "layout": name, "batch": size, "codes": total}
        if step.left() < profile.case_reserve_s:
            step.append("invariance", {**case, "status": "skipped: out of time"})
            continue
        try:
            codes = run(order, size)
        except torch.cuda.OutOfMemoryError as err:
            case["status"] = f"failed: {error_line(err)[:160]}"
        else:
            differing = {i: torch.nonzero(codes[i] != alone[i]).flatten() for i in range(count)}
            found = [gap for i, where in differing.items() if len(where) for gap in gaps(i, where[:20]).tolist()]
            changed = sum(len(where) for where in differing.values())
            case.update(differing=changed, per_million=round(1e6 * changed / max(total, 1), 1),
                        gaps=[float(f"{gap:.3g}") for gap in sorted(found)[:10]])
        if device.type == "cuda":
            torch.cuda.empty_cache()
        step.append("invariance", case)


# -- step: e2e ---------------------------------------------------------------------------------------
def e2e_paths(work: Path) -> dict[str, Path]:
    root = work / "e2e"
    return {"root": root, "data": root / "data", "manifest": root / "manifest", "plan": root / "plan",
            "out": root / "encoded", "tokenizer": root / "tokenizer"}


def step_e2e(step: StepRecord, profile: Profile, work: Path) -> None:
    torch, device = torch_device(profile)

    encodekit = benchmarks_module("encodekit")  # tests/encodekit.py: tar writer and the small chat tokenizer
    paths = e2e_paths(work)
    shutil.rmtree(paths["root"], ignore_errors=True)
    images, label = source_images(24)
    started = time.perf_counter()
    jpegs = web_jpegs(images, profile.e2e_distinct, profile.e2e_long_side)
    members = []
    for index in range(profile.e2e_images):
        name, data = jpegs[index % len(jpegs)]
        members.append([(f"k{index:06d}.jpg", data), (f"k{index:06d}.txt", f"a photo: {name}".encode())])
    for shard, start in enumerate(range(0, len(members), profile.e2e_per_shard)):
        encodekit.write_tar(paths["data"] / f"shard-{shard:04d}.tar",
                            [m for sample in members[start:start + profile.e2e_per_shard] for m in sample])
    step.put("corpus", {"images": profile.e2e_images, "distinct_jpegs": len(jpegs), "sources": label,
                        "long_side_px": list(profile.e2e_long_side),
                        "mean_jpeg_kb": round(sum(len(d) for _, d in jpegs) / len(jpegs) / 1024, 1),
                        "build_s": round(time.perf_counter() - started, 1)})
    tokenizer = encodekit.chat_tokenizer(paths["tokenizer"])  # an HF tokenizer: no mistral-common needed
    checkpoint = random_checkpoint(work, profile.e2e_codec)
    step.put("codec", f"emu3.5 random weights, {profile.e2e_codec} config, device {device} (LOCAL_RANK=0)")
    run_mmtok(step, "scan", [str(paths["data"] / "*.tar"), "--out", str(paths["manifest"]), "--no-progress"])
    # small work items, so each of the 2 ranks has several (a rank encodes its items one after another)
    run_mmtok(step, "plan", [str(paths["manifest"]), "--out", str(paths["plan"]), "--quiet", "--world-size", "2",
                             "--text-tokenizer", str(tokenizer), *profile.e2e_plan_flags, "--item-seconds", "0.2"])
    for rank in (0, 1):  # one after the other on the one GPU: each rank's figures are its own (its items summed)
        result = run_mmtok(step, f"encode rank {rank}", [
            "--plan", str(paths["plan"]), "--checkpoint", str(checkpoint), "--out", str(paths["out"]), "--rank",
            str(rank), "--world-size", "2", "--loader-threads", str(profile.e2e_loader_threads), "--no-progress",
            "--json"], env={"LOCAL_RANK": "0"}, command="encode")
        stats = json.loads(result.stdout.strip().splitlines()[-1]) if result.stdout.strip() else {}
        step.append("parts", {"rank": rank, **{key: stats.get(key) for key in (
            "images_planned", "images_written", "images_per_s", "device_busy_fraction", "wall_s", "device_busy_s",
            "fill_s", "tokens_per_s", "device", "loader_threads")}})
    walls = [part["wall_s"] for part in step.results["parts"]]
    step.put("wall_imbalance", max(walls) / (sum(walls) / len(walls)) - 1 if all(walls) else None)
    run_mmtok(step, "merge", [str(paths["out"]), "--no-progress"])
    merged = json.loads((paths["out"] / "merged.json").read_text())
    step.put("merged", {key: merged.get(key) for key in ("num_parts", "sequences", "tokens", "dataset",
                                                          "verified_with")})


def web_jpegs(images: list, count: int, long_side: tuple) -> list[tuple[str, bytes]]:
    """`count` distinct JPEGs (quality 90) of seeded random crops of `images` in common aspect ratios, scaled
    to a long side in `long_side`: web-like sizes with photo content. Encoded on all cores."""
    import io
    import random
    from concurrent.futures import ThreadPoolExecutor

    from PIL import Image

    rng = random.Random(0)
    jobs = []
    for index in range(count):
        image = images[index % len(images)]
        aspect = rng.choice((1.0, 4 / 3, 3 / 4, 3 / 2, 2 / 3, 16 / 9, 9 / 16))  # width / height
        width = int(min(image.width, image.height * aspect) * rng.uniform(0.5, 1.0))
        height = max(16, min(image.height, round(width / aspect)))
        left, top = rng.randint(0, image.width - width), rng.randint(0, image.height - height)
        jobs.append((index, image, (left, top, left + width, top + height), rng.uniform(*long_side)))

    def encode(job) -> tuple[str, bytes]:
        index, image, box, side = job
        crop = image.crop(box)
        scale = side / max(crop.size)
        crop = crop.resize((max(16, round(crop.width * scale)), max(16, round(crop.height * scale))), Image.BICUBIC)
        buffer = io.BytesIO()
        crop.save(buffer, "JPEG", quality=90)
        return f"photo-{index}", buffer.getvalue()

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:  # PIL releases the GIL in resize and encode
        return list(pool.map(encode, jobs))


def run_mmtok(step: StepRecord, label: str, args: list[str], env: dict | None = None,
              command: str | None = None) -> subprocess.CompletedProcess:
    """`python -m mmtok COMMAND ARGS` within the step's time; its output goes to the step log; a non-zero
    exit raises with the command's last line."""
    command = command or label
    started, timeout = time.perf_counter(), max(1.0, step.left())
    try:
        result = subprocess.run([sys.executable, "-m", "mmtok", command, *args], capture_output=True, text=True,
                                env={**os.environ, **(env or {})}, timeout=timeout)
    except subprocess.TimeoutExpired as err:
        output = err.stderr or b""  # bytes even with text=True on some Python versions
        output = output.decode(errors="replace") if isinstance(output, bytes) else output
        print(f"$ mmtok {command} {' '.join(args)}\n{output}", file=sys.stderr, flush=True)
        raise RuntimeError(f"mmtok {label} did not finish in the {timeout:.0f} s left to the step") from None
    seconds = time.perf_counter() - started
    print(f"$ mmtok {command} {' '.join(args)}\n{result.stdout}{result.stderr}", file=sys.stderr, flush=True)
    step.append("commands", {"command": label, "seconds": round(seconds, 2), "exit": result.returncode})
    if result.returncode != 0:
        lines = (result.stderr.strip() or result.stdout.strip() or "no output").splitlines()
        raise RuntimeError(f"mmtok {label} exited {result.returncode}: {lines[-1]}")
    return result


def require_command(name: str) -> None:
    """Skipped unless this mmtok has the command `name`."""
    probe = subprocess.run([sys.executable, "-m", "mmtok", name, "--help"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        raise Skipped(f"mmtok {name} not available")


def json_output(result: subprocess.CompletedProcess, label: str) -> dict:
    try:
        return json.loads(result.stdout)
    except json.JSONDecodeError as err:
        raise RuntimeError(f"{label} --json did not print JSON ({err}): {result.stdout[:200]!r}") from None


# -- step: status ------------------------------------------------------------------------------------
def step_status(step: StepRecord, profile: Profile, work: Path) -> None:
    require_command("status")
    paths = e2e_paths(work)
    if not (paths["out"] / "parts").is_dir():
        raise Skipped("no encode output: the e2e step did not get as far as encoding")
    result = run_mmtok(step, "status", [str(paths["out"]), "--plan", str(paths["plan"]), "--json"])
    step.put("json", json_output(result, "mmtok status"))


# -- step: calibrate ---------------------------------------------------------------------------------
def step_calibrate(step: StepRecord, profile: Profile, work: Path) -> None:
    torch_device(profile)
    require_command("calibrate")
    checkpoint = random_checkpoint(work, profile.calibrate_checkpoint)
    preset = calibration_preset(work, profile.calibrate_preset)
    changed = ", ".join(f"{key} {value}" for key, value in profile.calibrate_preset.items() if key != "base")
    step.put("preset", f"{profile.calibrate_preset['base']}{' with ' + changed if changed else ''}; text tokenizer: "
             "the small HF one of the e2e step (the device image has no mistral-common for `tekken`; only the "
             "dimension-text token counts differ)")
    result = run_mmtok(step, "calibrate", [
        "--codec", "emu3.5", "--checkpoint", str(checkpoint), "--preset", str(preset), *profile.calibrate_flags,
        "--out", str(work / "calibrated.yaml"), "--json"], env={"LOCAL_RANK": "0"})
    step.put("checkpoint", f"{profile.calibrate_checkpoint} config")
    step.put("json", json_output(result, "mmtok calibrate"))


def calibration_preset(work: Path, changes: dict) -> Path:
    """plans/<changes["base"]>.yaml with the other `changes` applied and `text_tokenizer` set to
    tests/encodekit.py's small HF tokenizer, written under `work`."""
    import yaml

    changes = dict(changes)
    preset = yaml.safe_load((REPO / "plans" / f"{changes.pop('base')}.yaml").read_text())
    tokenizer = benchmarks_module("encodekit").chat_tokenizer(work / "calibrate-tokenizer")
    preset.update(changes, text_tokenizer=str(tokenizer))
    path = work / "calibrate-preset.yaml"
    path.write_text(yaml.safe_dump(preset, sort_keys=False))
    return path


# -- step: cuda_context ------------------------------------------------------------------------------
def step_cuda_context(step: StepRecord, profile: Profile, work: Path) -> None:
    torch, device = torch_device(profile)
    random_checkpoint(work, "tiny")  # written here, so the probe's CUDA context is the only thing it sets up
    ranks = [0, 1] if device.type == "cuda" and torch.cuda.device_count() >= 2 else [0]
    failures = []
    for local_rank in ranks:
        result = subprocess.run([sys.executable, __file__, "--context-probe", "--work", str(work)],
                                capture_output=True, text=True, env={**os.environ, "LOCAL_RANK": str(local_rank)},
                                timeout=max(1, step.left()))
        print(result.stdout + result.stderr, file=sys.stderr)
        if result.returncode != 0:
            raise RuntimeError(f"probe LOCAL_RANK={local_rank} exited {result.returncode}: "
                               f"{(result.stderr.strip() or 'no output').splitlines()[-1]}")
        probe = json.loads(result.stdout.strip().splitlines()[-1])
        probe["checks"] = context_checks(probe, local_rank)
        failures += [check for check in probe["checks"] if check.startswith("FAIL")]
        step.append("probes", probe)
    if failures:
        raise AssertionError("; ".join(failures))


def context_checks(probe: dict, local_rank: int) -> list[str]:
    """What the probe shows about where its CUDA context lives ('ok: ...', 'FAIL: ...' or 'n/a: ...')."""
    if not probe["device"].startswith("cuda"):
        return [f"n/a: no CUDA, resolve_device(None) gave {probe['device']} (the CPU variant ran the same path)"]
    current = probe["current_device_before_pinning"]
    checks = [("ok" if current == local_rank else "FAIL")
              + f": current_device() = {current} before pinning (LOCAL_RANK {local_rank})",
              ("ok" if probe["pinned"] else "FAIL") + ": the encoder's host ring is pinned"]
    contexts = probe["contexts"]
    if contexts is None:
        return checks + [f"n/a: contexts not observable ({probe['contexts_note']})"]
    own = normalized_uuid(probe["uuids"][local_rank])
    checks.append(("ok" if len(contexts) == 1 else "FAIL") + f": {len(contexts)} CUDA context(s) of this process")
    if own and all(c["uuid"] for c in contexts):  # which GPU: by UUID (NVML and CUDA may number GPUs differently)
        stray = [c for c in contexts if normalized_uuid(c["uuid"]) != own]
        checks.append(("FAIL" if stray else "ok") + f": no context on another GPU than cuda:{local_rank}"
                      + (f" (found on {', '.join(c['uuid'] for c in stray)})" if stray else ""))
    return checks


def normalized_uuid(text: str) -> str:
    text = str(text).lower()
    for prefix in ("gpu-", "mig-"):
        text = text.removeprefix(prefix)
    return "".join(ch for ch in text if ch in "0123456789abcdef")


def context_probe(work: Path) -> None:
    """In a fresh process: the encoder's device setup as `mmtok encode` does it; prints one JSON line."""
    import threading

    import torch

    from mmtok.codecs.registry import load_codec
    from mmtok.encode.loader import HostRing
    from mmtok.launch import resolve_device

    device = resolve_device(None)
    cuda = device.type == "cuda"
    probe = {"pid": os.getpid(), "local_rank": int(os.environ["LOCAL_RANK"]), "device": str(device),
             "current_device_before_pinning": torch.cuda.current_device() if cuda else None}
    region = HostRing(3 * 32 * 32, pin=cuda).acquire(3 * 32 * 32, threading.Event())
    probe["pinned"] = bool(region.is_pinned())
    pixels = region.view(1, 32, 32, 3)
    pixels.copy_(torch.randint(0, 256, pixels.shape, dtype=torch.uint8))
    codec = load_codec("emu3.5", work / "emu35-tiny", device)
    probe["codes"] = list(codec.encode(pixels.to(device, non_blocking=True)).shape)
    if cuda:
        torch.cuda.synchronize(device)
        probe["uuids"] = [str(getattr(torch.cuda.get_device_properties(i), "uuid", "")) for i in
                          range(torch.cuda.device_count())]
        probe["contexts"], probe["contexts_note"] = contexts_of(os.getpid())
    print(json.dumps(probe))


def contexts_of(pid: int) -> tuple[list[dict] | None, str]:
    """The CUDA contexts of process `pid` as [{uuid, used_mib}] and how they were read (NVML, else
    nvidia-smi); None when neither lists this process (no NVML, or another PID namespace)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        found = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            for process in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if process.pid == pid:
                    used = process.usedGpuMemory
                    found.append({"uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
                                  "used_mib": round(used / MIB) if used else None})
        if found:
            return found, "NVML compute processes"
        note = "NVML lists no compute process with this pid"
    except Exception as err:  # no pynvml, no NVML library, or a call this driver does not support
        note = f"NVML: {error_line(err)}"
    if shutil.which("nvidia-smi"):
        query = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory,gpu_uuid",
                                "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=20)
        rows = [[cell.strip() for cell in line.split(",")] for line in query.stdout.splitlines()
                if line.count(",") == 2]
        found = [{"uuid": uuid, "used_mib": int(used) if used.isdigit() else None}
                 for row_pid, used, uuid in rows if row_pid == str(pid)]
        if found:
            return found, "nvidia-smi --query-compute-apps"
        note += f"; nvidia-smi lists {len(rows)} compute app(s), none with this pid"
    return None, note


STEP_FUNCTIONS = {"environment": step_environment, "emu35": step_emu35, "wavtokenizer": step_wavtokenizer,
                  "batch_invariance": step_batch_invariance, "e2e": step_e2e, "status": step_status,
                  "calibrate": step_calibrate, "cuda_context": step_cuda_context}


# =============================================================================================
# The parent side: run the steps under the budget, write the report


class Terminated(Exception):
    """SIGTERM reached the check (gpu_check.sh's global timeout): stop the step, keep its figures, write the report."""


def raise_terminated(signum, frame) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # `timeout` signals the process and then its group: once is enough
    raise Terminated()


TERMINATED = "stopped by SIGTERM (gpu_check.sh's global timeout); figures so far are kept"


def run_child(name: str, profile: Profile, work: Path, cap: float) -> dict:
    """Run step `name` in its own process group for at most `cap` seconds; its record, timed and with its log's
    tail. The group (the step and its mmtok subprocesses) is stopped at the cap or when the check gets SIGTERM."""
    result, log = work / f"{name}.result.json", work / f"{name}.log"
    result.unlink(missing_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if profile.name == "smoke":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU variant, also on a machine with a GPU
        env["OMP_NUM_THREADS"] = "1"  # on a small shared machine, OpenMP threads spinning against each other are
        # many times slower than one thread
    command = [sys.executable, __file__, "--run-step", name, "--work", str(work), "--result", str(result),
               "--deadline", str(time.time() + cap - min(profile.soft_margin_s, cap / 4))]
    if profile.name == "smoke":
        command.append("--smoke")
    started = time.perf_counter()
    ended = None
    with open(log, "w") as handle:
        # Its own process group, so that stop_group reaches its subprocesses; not its own session, so that
        # whatever kills this check's session (the device machine's cleanup) reaches them too.
        child = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                 preexec_fn=os.setpgrp)
        try:
            child.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            ended = f"timed out after its cap of {cap:.0f} s (figures so far are kept)"
        except Terminated:
            ended = TERMINATED
        if ended:
            stop_group(child)
    seconds = time.perf_counter() - started
    text = log.read_text(errors="replace")
    try:
        record = json.loads(result.read_text())
    except (OSError, json.JSONDecodeError):
        last = text.strip().splitlines()[-1] if text.strip() else "no output"
        record = {"status": "failed", "error": f"the step process exited {child.returncode}: {last[:300]}",
                  "results": {}}
    if ended:
        record.update(status="failed", error=ended)
    elif child.returncode != 0 and record["status"] != "failed":
        record.update(status="failed", error=f"the step process exited {child.returncode}")
    tail = 4000 if record["status"] == "failed" else 1200
    return {"status": record["status"], "error": record["error"], "seconds": round(seconds, 1), "cap_s": round(cap),
            "results": record["results"], "log_tail": text[-tail:]}


def stop_group(child: subprocess.Popen) -> None:
    """SIGTERM the step's process group (its mmtok subprocesses too), SIGKILL what is left after 2 s."""
    for sig, wait in ((signal.SIGTERM, 2), (signal.SIGKILL, 2)):
        try:
            os.killpg(child.pid, sig)
        except ProcessLookupError:
            return
        try:
            child.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_check(profile: Profile, out: Path, work: Path, budget: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    started, clock = datetime.datetime.now(datetime.timezone.utc), time.monotonic()
    report = {"check": "benchmarks/gpu_check.py", "mode": profile.name,
              "started": started.isoformat(timespec="seconds"), "budget_s": budget, "setup": setup_note(),
              "host": f"{platform.node()}, {os.cpu_count()} CPUs",
              "steps": {name: {"status": "skipped", "error": NOT_REACHED, "results": {}} for name in STEPS}}
    print(f"gpu_check: mode {profile.name}, budget {budget:.0f} s, report -> {out}/{REPORT_JSON} + {REPORT_MD}",
          flush=True)
    print(f"gpu_check: {report['setup']}", flush=True)
    signal.signal(signal.SIGTERM, raise_terminated)
    for number, name in enumerate(STEPS, 1):
        left = budget - (time.monotonic() - clock)
        cap = min(profile.caps[name], left - 1)
        if cap < 3:
            report["steps"][name] = {"status": "skipped", "error": f"not run: the check's budget of {budget:.0f} s "
                                     "was spent", "results": {}}
        else:
            report["steps"][name] = run_child(name, profile, work, cap)
        step = report["steps"][name]
        print(f"gpu_check: [{number}/{len(STEPS)}] {name}: {step['status']}"
              + (f" in {step['seconds']} s" if "seconds" in step else "")
              + (f" -- {step['error']}" if step["error"] else ""), flush=True)
        if step["status"] == "failed" and step.get("log_tail"):
            print("\n".join(step["log_tail"].splitlines()[-15:]), file=sys.stderr, flush=True)
        report["wall_s"] = round(time.monotonic() - clock, 1)
        write_report(out, report)
        if step["error"] == TERMINATED:
            break
    statuses = [step["status"] for step in report["steps"].values()]
    print(f"gpu_check: {statuses.count('ok')} ok, {statuses.count('failed')} failed, {statuses.count('skipped')} "
          f"skipped in {report['wall_s']} s; {out / REPORT_MD}", flush=True)
    return 1 if "failed" in statuses else 0


def write_report(out: Path, report: dict) -> None:
    write_json(out / REPORT_JSON, report)
    partial = out / (REPORT_MD + ".partial")
    partial.write_text(markdown(report))
    os.replace(partial, out / REPORT_MD)


# -- Markdown ----------------------------------------------------------------------------------------
def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    cells = [["" if cell is None else str(cell) for cell in row] for row in rows]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def percent(value, digits: int = 1) -> str:
    return "" if value is None else f"{100 * value:.{digits}f}%"


def md_environment(r: dict) -> list[str]:
    torch = r.get("torch", {})
    lines = [f"- setup: {r.get('setup')}", f"- python {r.get('python')}; {r.get('platform')}",
             f"- mmtok {r.get('mmtok')}",
             f"- torch {torch.get('version')}, CUDA {torch.get('cuda')}, cuDNN {torch.get('cudnn')}, "
             f"CUDA available: {torch.get('cuda_available')}, {torch.get('threads')} CPU threads"]
    lines += [f"- GPU {g['index']}: {g['name']}, {g['memory_gib']} GiB, compute capability {g['capability']}, "
              f"{g['multiprocessors']} SMs" for g in r.get("gpus", [])]
    lines.append(f"- nvidia-smi: {r.get('nvidia_smi')}")
    missing = [name for name, version in r.get("packages", {}).items() if version is None]
    lines.append("- packages: " + ", ".join(f"{n} {v}" for n, v in r.get("packages", {}).items() if v)
                 + (f"; missing: {', '.join(missing)}" if missing else ""))
    return lines


def md_emu35(r: dict) -> list[str]:
    model = r.get("model", {})
    weights = f", weights {model['weights_mib']} MiB" if model.get("weights_mib") else ""
    lines = [f"Model: {model.get('config')} config, {model.get('parameters_m')} M parameters "
             f"({model.get('encoder_parameters_m')} M encoder), codebook {model.get('codebook')}, on "
             f"{model.get('device')}{weights}, built and loaded in {model.get('build_and_load_s')} s. "
             f"Images: {r.get('images')}.", ""]
    rows = [[c["image"], c["batch"], c["path"], c["precision"], c.get("images_per_s", c.get("status")),
             c.get("seconds_per_batch"), c.get("repeats"), c.get("peak_mib"), c.get("identical_codes")]
            for c in r.get("throughput", [])]
    lines += [table(["image", "batch", "quantizer", "precision", "images/s", "s/batch", "repeats",
                     "peak MiB (weights included)", "codes identical to argmax"], rows), ""]
    rows = [[f["image"], f.get("photos"), f.get("codes"), percent(f.get("tf32_vs_fp32"), 3),
             percent(f.get("bf16_vs_fp32"), 3), f.get("status")] for f in r.get("flips", [])]
    return lines + ["Code flips on the same photos (reference: strict fp32; random weights, so these show how close "
                    "the logit gaps are, not the trained model's figures):", "",
                    table(["image", "photos", "codes", "TF32 vs fp32", "bf16 autocast vs fp32", "status"], rows)]


def md_wavtokenizer(r: dict) -> list[str]:
    model = r.get("model", {})
    rows = [[c["batch"], c["audio_s"], c.get("audio_s_per_s", c.get("status")), c.get("wall_s"), c.get("repeats"),
             c.get("peak_mib")] for c in r.get("cases", [])]
    return [f"Encoder {model.get('encoder_parameters_m')} M parameters, codebook {model.get('codebook')}, on "
            f"{model.get('device')}, strict fp32 contract. Audio: {r.get('audio')}.", "",
            table(["batch", "audio s", "audio s per s", "best wall s", "repeats", "peak MiB"], rows)]


def md_batch_invariance(r: dict) -> list[str]:
    rows = [[c["codec"], c["layout"], c["batch"], c["codes"], c.get("differing", c.get("status")),
             c.get("per_million"), ", ".join(map(str, c.get("gaps", [])))] for c in r.get("invariance", [])]
    return [f"Images: {r.get('images')}. Audio: {r.get('audio')}. Median top-1 minus top-2 logit of the first "
            f"photo's codes: {rounded(r.get('image_median_gap'))}.", "",
            table(["codec", "layout", "batch", "codes", "differing from batch 1", "per million",
                   "gaps where they differ (logit / -distance)"], rows), "", invariance_verdict(r)]


def invariance_verdict(r: dict) -> str:
    """What the cases mean for the world-size contract (docs/codecs.md), and the action they call for."""
    cases = r.get("invariance", [])
    measured = [c for c in cases if "differing" in c]
    differing = sorted({c["codec"] for c in measured if c["differing"]})
    if not measured or len(measured) < len(cases):
        return "Verdict: incomplete (a case did not run); rerun this step before relying on either contract."
    if differing:
        return (f"Verdict: NOT batch-invariant on this device ({', '.join(differing)}): plans made for different "
                "--world-size values may give different merged bytes here. Plan with `mmtok plan --fixed-batches` "
                "(or encode one plan at every world size) where byte-identical outputs across world sizes matter.")
    return ("Verdict: batch-invariant on this device for every case: plans for any --world-size give the same "
            "merged bytes here; `--fixed-batches` is not needed.")


def md_e2e(r: dict) -> list[str]:
    corpus = r.get("corpus", {})
    lines = [f"Corpus: {corpus.get('images')} captioned JPEGs ({corpus.get('distinct_jpegs')} distinct, long side "
             f"{corpus.get('long_side_px')} px, mean {corpus.get('mean_jpeg_kb')} KB) from {corpus.get('sources')}, "
             f"built in {corpus.get('build_s')} s. Codec: {r.get('codec')}.", "",
             table(["command", "seconds", "exit"],
                   [[c["command"], c["seconds"], c["exit"]] for c in r.get("commands", [])]),
             ""]
    rows = [[p["rank"], p.get("images_written"), p.get("images_planned"), rounded(p.get("images_per_s")),
             percent(p.get("device_busy_fraction")), rounded(p.get("wall_s")), rounded(p.get("fill_s"), 2),
             p.get("device"), p.get("loader_threads")]
            for p in r.get("parts", [])]
    lines.append(table(["part", "images written", "planned", "images/s", "device busy", "wall s", "fill s", "device",
                        "loader threads"], rows))
    if r.get("wall_imbalance") is not None:
        lines += ["", f"Wall-time imbalance of the two parts (max/mean - 1): {percent(r['wall_imbalance'], 2)}."]
    if "merged" in r:
        lines += ["", "Merge: " + ", ".join(f"{k} {v}" for k, v in r["merged"].items())]
    return lines


def rounded(value, digits: int = 4):
    return f"{value:.{digits}g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def md_status(r: dict) -> list[str]:
    if "json" not in r:  # the command failed: its error line says why
        return []
    status = r["json"]
    balance, totals = status.get("imbalance") or {}, status.get("totals") or {}
    lines = [f"States {status.get('states')}; measured imbalance (max/mean - 1 of the parts' wall s) "
             f"{percent(balance.get('measured'), 2)}, modeled by the plan {percent(balance.get('modeled'), 3)}, world "
             f"size {balance.get('world_size')} (plan: {balance.get('plan_world_size')}). Totals: "
             f"{totals.get('written')} written, {totals.get('tokens')} tokens, device busy "
             f"{percent(totals.get('device_busy_fraction'))}.", ""]
    rows = [[p.get("part"), p.get("state"), p.get("written"), rounded(p.get("per_s")),
             percent(p.get("device_busy_fraction")), rounded(p.get("wall_s")), percent(p.get("wall_share")),
             percent(p.get("modeled_share"))] for p in status.get("parts", [])]
    lines.append(table(["part", "state", "written", "per s", "device busy", "wall s", "wall share", "modeled share"],
                       rows))
    if status.get("warnings"):
        lines += ["", "Warnings: " + "; ".join(map(str, status["warnings"]))]
    return lines


def md_calibrate(r: dict) -> list[str]:
    if "json" not in r:
        return []
    result = r["json"]
    model, info = result["cost_model"], result["calibration"]
    replaced = info.get("replaced") or {}

    def errors(report: dict | None) -> list:
        return [percent(report.get("median")), percent(report.get("p95"))] if report else ["(none held out)", ""]

    return [f"{r.get('checkpoint')} checkpoint on {info.get('device')}, preset {r.get('preset')}, grid "
            f"{info.get('grid')}: {len(info.get('timings', []))} batches timed in "
            f"{rounded(info.get('timing_seconds'), 3)} s.", "",
            f"Fitted model (seconds per batch = count*(a*n + b*n^2 + c) + batch, n = latent positions at stride "
            f"{model.get('stride')}): a={rounded(model.get('a'))} b={rounded(model.get('b'))} "
            f"c={rounded(model.get('c'))} batch={rounded(model.get('batch'))}.", "",
            table(["model", "timed: median error", "timed: p95", "held-out: median", "held-out: p95"],
                  [["calibrated", *errors(info["errors"].get("fitted")), *errors(info["errors"].get("held_out"))],
                   [f"replaced ({(replaced.get('cost_model') or {}).get('source')}, best scale)",
                    *errors((replaced.get("errors") or {}).get("fitted")),
                    *errors((replaced.get("errors") or {}).get("held_out"))]])]


def md_cuda_context(r: dict) -> list[str]:
    lines = []
    for probe in r.get("probes", []):
        contexts = probe.get("contexts")
        where = ("; ".join(f"{c['uuid']} {c['used_mib']} MiB" for c in contexts) if contexts
                 else probe.get("contexts_note", ""))
        lines += [f"LOCAL_RANK={probe['local_rank']} (pid {probe['pid']}): device {probe['device']}, current device "
                  f"before pinning {probe.get('current_device_before_pinning')}, pinned ring {probe.get('pinned')}, "
                  f"contexts: {where or 'not counted'}"] + [f"- {check}" for check in probe.get("checks", [])] + [""]
    return lines


RENDERERS = {"environment": md_environment, "emu35": md_emu35, "wavtokenizer": md_wavtokenizer,
             "batch_invariance": md_batch_invariance, "e2e": md_e2e,
             "status": md_status, "calibrate": md_calibrate, "cuda_context": md_cuda_context}


def markdown(report: dict) -> str:
    steps = report["steps"]
    lines = [f"# GPU check ({report['mode']})", "",
             f"Started {report['started']}, {report.get('wall_s', 0)} s of a {report['budget_s']:.0f} s budget, "
             f"on {report['host']}. Setup: {report['setup']}.", "",
             table(["step", "status", "seconds", "cap s", "error"],
                   [[name, s["status"], s.get("seconds"), s.get("cap_s"), s["error"]] for name, s in steps.items()])]
    for name, step in steps.items():
        lines += ["", f"## {name}: {step['status']}", ""]
        if step["error"]:
            lines += [f"{step['status']}: {step['error']}", ""]
        if step["results"]:
            try:
                lines += RENDERERS[name](step["results"])
            except Exception as err:  # figures of another shape (a partial step, a changed --json): show them raw
                lines += [f"(figures not rendered: {error_line(err)})", "", "```json",
                          json.dumps(step["results"], indent=1, default=str)[:6000], "```"]
    return "\n".join(lines) + "\n"


# -- main --------------------------------------------------------------------------------------------
def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="every step on the CPU with tiny sizes (under 2 minutes)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "/tmp/gpu-check"),
                        help="results directory for gpu_check.json and gpu_check.md (default $OUT, else "
                        "/tmp/gpu-check)")
    parser.add_argument("--budget", type=float, help="seconds for the whole check (default 405, --smoke 300)")
    parser.add_argument("--work", type=Path, help="scratch directory (default: a new temporary one, removed at the "
                        "end)")
    parser.add_argument("--keep-work", action="store_true", help="keep the scratch directory (corpus, checkpoints, "
                        "logs)")
    parser.add_argument("--run-step", choices=STEPS, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--context-probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    profile = SMOKE if args.smoke else GPU
    if args.run_step:
        run_step(args.run_step, profile, args.work, args.result, args.deadline)
        return 0
    if args.context_probe:
        context_probe(args.work)
        return 0
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        return run_check(profile, args.out, work, args.budget or profile.budget_s)
    finally:
        if not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"gpu_check: scratch kept in {work}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
