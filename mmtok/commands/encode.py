"""`mmtok encode`: encode one rank's share of a plan (images) or of the Shar shards (audio)."""

from __future__ import annotations

import argparse
import os

from mmtok.errors import MmtokError

DESCRIPTION = """\
Encode one rank's share of the work into OUT/parts/part-NNNNN (Megatron .bin/.idx, provenance,
stats, DONE). Ranks never communicate; run one process per GPU (srun / torchrun), then `mmtok merge OUT`.

Rank and world size come from --rank/--world-size, else RANK/WORLD_SIZE (torchrun, also when
torchrun runs inside srun), else SLURM_PROCID/SLURM_NTASKS (srun). The GPU is --device, else
cuda:LOCAL_RANK, else cuda:(SLURM_LOCALID mod visible GPUs), else cuda:0 / cpu.

Images (--modality image): the rank takes its contiguous range of the plan's global batches; the
world size defaults to the plan's. If it differs from the plan's, the plan's cost-balanced ranges
are re-derived for it (the merged output is the same for every world size).

Every batch is committed durably; rerunning the same command after a crash or kill resumes from the
last committed batch and yields byte-identical files. A resume with a different plan, codec
checkpoint or precision contract is refused.
"""


def add_parser(sub) -> None:
    from mmtok.audio import encode as audio_encode

    parser = sub.add_parser("encode", help="encode one rank's share of a plan (images) or Shar shards (audio)",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modality", choices=("image", "audio"), default="image",
                        help="what to encode (default image)")
    parser.add_argument("--plan", help="images: the plan directory (`mmtok plan --out`)")
    parser.add_argument("--codec", default=None, help="codec name (default: emu3.5 for images, wavtokenizer for audio)")
    parser.add_argument("--checkpoint", required=True, help="directory with the codec's official checkpoint files")
    parser.add_argument("--out", required=True, help="output directory (parts go to OUT/parts/)")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: from the environment)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: from the environment, else the plan's)")
    parser.add_argument("--device", default=None, help="torch device (default: see above; cpu without CUDA)")
    group = parser.add_argument_group("image options")
    group.add_argument("--loader-threads", type=int, default=min(8, os.cpu_count() or 1),
                       help="threads that read, decode, resize and tokenize ahead of the device (default min(8, CPUs))")
    group.add_argument("--prefetch", type=int, default=4,
                       help="host memory for batches prepared ahead of the device, in units of the largest "
                       "batch (pinned on CUDA; default 4)")
    group.add_argument("--max-consecutive-failures", type=int, default=64,
                       help="stop the rank after this many undecodable images in a row (default 64)")
    group.add_argument("--no-progress", action="store_true", help="no progress bar")
    audio_encode.add_arguments(parser)
    parser.set_defaults(func=run)


def resolve_rank(rank: int | None, world_size: int | None, default_world_size: int = 1) -> tuple[int, int]:
    """Flags first, then RANK/WORLD_SIZE (torchrun sets them per worker, also inside an srun task),
    then SLURM_PROCID/SLURM_NTASKS, then (0, default_world_size)."""
    env = os.environ
    if rank is None:
        rank = int(env.get("RANK", env.get("SLURM_PROCID", 0)))
    if world_size is None:
        world_size = int(env.get("WORLD_SIZE", env.get("SLURM_NTASKS", default_world_size)))
    if world_size < 1 or not 0 <= rank < world_size:
        raise MmtokError(f"rank {rank} is outside 0..{world_size - 1} (world size {world_size})")
    return rank, world_size


def resolve_device(requested: str | None):
    """--device, else cuda:LOCAL_RANK, else cuda:(SLURM_LOCALID mod visible GPUs) under srun, else the default."""
    import torch

    from mmtok.codecs.base import device_from_env

    local = os.environ.get("SLURM_LOCALID")
    if requested is None and "LOCAL_RANK" not in os.environ and local is not None and torch.cuda.is_available():
        return torch.device("cuda", int(local) % torch.cuda.device_count())
    return device_from_env(requested)


def run(args) -> int:
    if args.modality == "audio":
        from mmtok.audio import encode as audio_encode

        args.rank, args.world_size = resolve_rank(args.rank, args.world_size)  # one rule for both modalities
        args.device = str(resolve_device(args.device))
        return audio_encode.run(args)
    return run_images(args)


def run_images(args) -> int:
    from mmtok.codecs.base import load_codec
    from mmtok.encode.runner import EncodeOptions, encode_rank
    from mmtok.formats.plan import read_meta

    if not args.plan:
        raise MmtokError("--modality image needs --plan (the output directory of `mmtok plan`)")
    meta = read_meta(args.plan)
    rank, world_size = resolve_rank(args.rank, args.world_size, meta["world_size"])
    if world_size != meta["world_size"]:
        print(f"mmtok encode: the plan was balanced for {meta['world_size']} ranks; re-deriving its contiguous "
              f"cost-balanced ranges for {world_size} ranks (the merged output does not depend on the world size)")
    device = resolve_device(args.device)
    codec = load_codec(args.codec or "emu3.5", args.checkpoint, device)
    options = EncodeOptions(loader_threads=args.loader_threads, prefetch=args.prefetch,
                            max_consecutive_failures=args.max_consecutive_failures, progress=not args.no_progress)
    stats = encode_rank(args.plan, args.out, codec, rank=rank, world_size=world_size, device=device, options=options)
    print_summary(rank, world_size, stats)
    return 0


def print_summary(rank: int, world_size: int, stats: dict) -> None:
    counts = stats["counts"]
    where = stats["part_dir"]
    if stats.get("already_done"):
        print(f"mmtok encode: rank {rank}/{world_size}: {where} is already finished "
              f"({stats['sequences']:,} sequences); nothing to do")
        return
    skipped = ", ".join(f"{reason} {n:,}" for reason, n in stats["skipped"].items()) or "none"
    print(f"mmtok encode: rank {rank}/{world_size} -> {where}: {stats['images_written']:,} of "
          f"{stats['images_planned']:,} images in {stats['sequences']:,} documents, {counts.get('tokens', 0):,} "
          f"tokens; skipped: {skipped}")
    print(f"  {stats['wall_s']:.1f} s, {stats['images_per_s']:.1f} img/s, {stats['tokens_per_s']:,.0f} tok/s, "
          f"device busy {100 * stats['device_busy_fraction']:.1f}% on {stats['device']}")
