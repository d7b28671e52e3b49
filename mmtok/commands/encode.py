"""`mmtok encode`: encode one rank's share of a plan (images) or of the Shar shards (audio)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.options import add_device_argument
from mmtok.commands.report import (
    idle_worker_line,
    listed,
    listed_in,
    parts_named,
    plural,
    print_report,
    refuse_nothing_usable,
    refuse_unfinished,
    take_over_lines,
)
from mmtok.errors import MmtokError
from mmtok.formats import skips

if TYPE_CHECKING:
    from mmtok.encode.audio import AudioWorkerRun
    from mmtok.encode.runner import ImageWorkerRun

DESCRIPTION = """\
Encode one rank's share of the work into OUT/parts/part-NNNNN (Megatron .bin/.idx, provenance,
stats, DONE). Ranks never communicate; run one process per GPU (srun / torchrun), then `mmtok merge OUT`.

Rank and world size come from --rank/--world-size, else RANK/WORLD_SIZE (torchrun, also when
torchrun runs inside srun), else SLURM_PROCID/SLURM_NTASKS (srun). The GPU is --device, else
cuda:LOCAL_RANK, else cuda:(SLURM_LOCALID mod visible GPUs), else cuda:0 / cpu.

Images (--modality image): the plan's batches are cut into work items (`mmtok plan --explain` lists
them); worker (rank) w of W takes a contiguous cost-balanced range of items and encodes each into its own
part, OUT/parts/part-<item>. W defaults to the plan's world size, but any W works, also on a resume: finished
items are skipped, a half-done one resumes from its commit log. The merged output is the same for every W.
Then (take-over, unless --no-take-over) it takes every item no process has finished or holds, from the far
end, so a slow or dead worker costs about one item. SIGUSR1/SIGTERM: commit the batch in flight, stop, exit
75 (a rerun resumes). --print-sbatch GPUS prints a SLURM array script for this command (docs/slurm.md).
--executor ray: this process is instead a driver that hands every unfinished item to a Ray cluster's GPU
workers, with retries and tail backups (docs/ray.md).

Every batch is committed durably, with a checksum; rerunning the same command after a crash or kill
resumes from the last committed batch (after checking what was committed) and yields byte-identical
files. A resume with a different plan, codec checkpoint or precision contract is refused. One process
writes a part at a time: a second one for the same part is refused at once, naming the holder.
Every input that does not become tokens is named in the part's skipped.jsonl (merge joins them).
"""


def add_parser(sub) -> None:
    parser = sub.add_parser("encode", help="encode one rank's share of a plan (images) or Shar shards (audio)",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modality", choices=("image", "audio"), default="image",
                        help="what to encode (default image)")
    parser.add_argument("--plan", help="images: the plan directory (`mmtok plan --out`)")
    parser.add_argument("--codec", default=None, help="a registered codec (default: emu3.5 for images, wavtokenizer "
                        "for audio; plugins: docs/write-a-codec.md)")
    parser.add_argument("--checkpoint", required=True, help="directory with the codec's official checkpoint files")
    parser.add_argument("--out", required=True, help="output directory (parts go to OUT/parts/)")
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: from the environment)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of ranks (default: from the environment, else the plan's)")
    add_device_argument(parser, "see above; cpu without CUDA")
    parser.add_argument("--no-take-over", action="store_true",
                        help="encode only this worker's own work items (audio: Shar shards); by default a worker that "
                        "has finished them takes the items no process has finished or holds (a slow or dead "
                        "worker's), from the far end, and leaves an own item another worker holds to it; without "
                        "take-over a held item is an error naming the holder, and a duplicate job is refused at start")
    group = parser.add_argument_group("image options")
    group.add_argument("--loader-threads", type=int, default=min(8, os.cpu_count() or 1),
                       help="threads that read, decode, resize and tokenize ahead of the device (default min(8, CPUs))")
    group.add_argument("--prefetch", type=int, default=4,
                       help="host memory for batches prepared ahead of the device, in units of the largest "
                       "batch (pinned on CUDA; default 4)")
    group.add_argument("--max-consecutive-failures", type=int, default=64,
                       help="stop the rank after this many undecodable images in a row (default 64)")
    group.add_argument("--lock-free", action="store_true",
                       help="for an output on a file system whose locks are node-local or missing (Lustre -o "
                       "localflock, NFS nolock): write each item into a private copy (OUT/parts/.private/) and "
                       "publish it finished by an atomic rename; a copy published second is checked identical and "
                       "discarded. Implies --no-take-over (docs/encode.md#one-writer-per-part)")
    group.add_argument("--print-sbatch", type=int, metavar="GPUS", default=None,
                       help="print a SLURM batch script that runs this encode as an array of one task per GPU "
                       "(--world-size N: N tasks; at most the items, and "
                       f"{MAX_ARRAY_TASKS:,} by default), at most GPUS at once, each taking its share of the items and "
                       "then the ones nobody finished or holds; requeued before the time limit; encodes nothing "
                       "(docs/slurm.md)")
    group.add_argument("--executor", choices=("ranks", "ray"), default="ranks",
                       help="ranks (default): this process is one rank (torchrun, srun, --print-sbatch); ray: this "
                       "process drives a Ray cluster whose workers (one per GPU, each keeping the codec loaded) "
                       "encode every unfinished item, with retries when a worker dies and backups of the slowest "
                       "items at the tail (pip install 'mmtok[ray]'; docs/ray.md)")
    group.add_argument("--address", default=None, metavar="ADDR",
                       help="--executor ray: the cluster to join (default: RAY_ADDRESS, else a local one)")
    group.add_argument("--ray-workers", type=int, default=None, metavar="N",
                       help="--executor ray: workers, one GPU each (default: the cluster's GPUs; with --device "
                       "cpu, 1); workers Ray cannot place yet wait for GPUs to join")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (images and audio)")
    parser.add_argument("--json", action="store_true",
                        help="also print the rank's summary as one JSON object on stdout "
                        "(the human one stays on stderr)")
    add_audio_arguments(parser)
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.codecs.registry import DEFAULTS, of_modality
    from mmtok.fsutil import refuse_out_overlapping

    refuse_out_overlapping(args.out, [args.plan, args.checkpoint, args.shar, args.text_tokenizer])
    args.codec = args.codec or DEFAULTS[args.modality]
    of_modality(args.codec, args.modality)  # a codec of the other modality, or a broken plugin: before any work
    if args.modality == "audio":
        if args.print_sbatch is not None:
            raise MmtokError("--print-sbatch writes the array script of an image plan's work items; audio parts are "
                             "Shar shards: run `srun mmtok encode --modality audio ...` (docs/slurm.md)")
        return run_audio(args)
    return run_images(args)


def run_images(args) -> int:
    from mmtok.encode.runner import refuse_empty_plan
    from mmtok.formats.plan import Plan
    from mmtok.launch import StopRequest

    if not args.plan:
        raise MmtokError("--modality image needs --plan (the output directory of `mmtok plan`)")
    plan = Plan.open(args.plan)
    refuse_empty_plan(plan)
    if args.print_sbatch is not None:
        print(sbatch_script(args, len(plan.work_items())), end="")
        return 0
    if args.executor == "ray":
        return _ray_driver(args, plan)
    with StopRequest() as stop:  # from the start to the end a signal stops the worker cleanly (see StopRequest)
        return _image_worker(args, plan, stop)


def _ray_driver(args, plan) -> int:
    """This process drives a Ray cluster through every unfinished item (`mmtok.encode.ray_driver`)."""
    from mmtok.encode.ray_driver import check_device, encode_on_ray, import_ray, run_record
    from mmtok.launch import STOPPED_EXIT, StopRequest

    if args.rank is not None or args.world_size is not None:
        raise MmtokError("--executor ray hands items to the cluster's workers: --rank and --world-size do not apply")
    if args.ray_workers is not None and args.ray_workers < 1:
        raise MmtokError(f"--ray-workers must be at least 1, got {args.ray_workers}")
    check_device(args.device)
    import_ray()  # before anything else: one line saying how to install it
    count = len(plan.work_items())
    refuse_other_run_early(args.out, "image", args.codec, args.checkpoint, num_parts=count,
                           plan_fingerprint=plan.meta.fingerprint)
    options = {"loader_threads": args.loader_threads, "prefetch": args.prefetch,
               "max_consecutive_failures": args.max_consecutive_failures}
    with StopRequest(in_flight="nothing more: the workers stop at their last commit") as stop:
        run = encode_on_ray(args.plan, args.out, args.codec, args.checkpoint, workers=args.ray_workers,
                            address=args.address, device=args.device, options=options,
                            progress=not args.no_progress, stop=stop)
    ready = f" (the first ready after {min(run.worker_starts):,.1f} s)" if run.worker_starts else ""
    lines = [f"ray: {run.to_do:,} of {plural(run.items, 'work item')} to do, {len(run.finished):,} finished by "
             f"{plural(run.workers, 'worker')}{ready} in {run.seconds:,.1f} s" if run.to_do else
             f"ray: every one of the plan's {plural(run.items, 'work item')} is finished; nothing to do"]
    if run.to_do:
        lines.append(f"backups {run.backups:,} ({run.backups_won:,} finished first), copies discarded "
                     f"{run.discarded:,}, retries {run.retries:,} ({plural(run.workers_lost, 'worker')} lost)")
        skipped = skips.by_reason(run.counts)
        lines.append(f"{run.counts.get('images_written', 0):,} images written"
                     + (f"; skipped: {_reasons(skipped)}" if skipped else "")
                     + (f"; stopped by {run.stopped}: {run.to_do - len(run.finished):,} items left, rerun to "
                        "continue" if run.stopped else f"; next: mmtok merge {args.out}"))
    print_report("encode", lines, run_record(run) if args.json else None)
    if run.stopped:
        return STOPPED_EXIT
    failed = skips.items_failed_by_reason(run.counts)
    refuse_nothing_usable("ray", run.counts.get("images_written", 0) + run.counts.get("images_deferred", 0)
                          - sum(failed.values()), run.counts, f"{args.out}/parts/*/skipped.jsonl", extra=failed)
    return 0


def _image_worker(args, plan, stop) -> int:
    """One image worker under `stop`: its items, then (take-over) the ones nobody finished or holds."""
    from mmtok.codecs.registry import load_codec
    from mmtok.encode.runner import EncodeOptions, encode_image_rank
    from mmtok.formats.partdir import check_part_free, part_dir
    from mmtok.launch import STOPPED_EXIT, resolve_device, resolve_rank

    rank, world_size = resolve_rank(args.rank, args.world_size, plan.meta.world_size)
    items, count = plan.worker_items(rank, world_size), len(plan.work_items())
    take_over = not args.no_take_over and not args.lock_free  # take-over needs locks to see who holds an item
    refuse_other_run_early(args.out, "image", args.codec, args.checkpoint, num_parts=count,
                           plan_fingerprint=plan.meta.fingerprint)  # before anything is said about OUT's parts
    if not len(items) and (not take_over or all_done(args.out, count)):  # nothing of its own, nothing to take
        why = (f"every one of the plan's {plural(count, 'work item')} is finished" if take_over else
               f"no work item of its own: the plan has {plural(count, 'item')} for {plural(world_size, 'worker')}")
        print_report("encode", f"rank {rank}/{world_size}: {why}; nothing to do",
                     {"rank": rank, "world_size": world_size, "items": [items.start, items.stop],
                      "num_items": count, "parts": []} if args.json else None)
        return 0
    if not take_over and not args.lock_free:  # a duplicate job stops here, before it loads the model
        for item in items:
            check_part_free(part_dir(args.out, item))
    device = resolve_device(args.device)
    codec = load_codec(args.codec, args.checkpoint, device, modality="image")
    options = EncodeOptions(loader_threads=args.loader_threads, prefetch=args.prefetch,
                            max_consecutive_failures=args.max_consecutive_failures, progress=not args.no_progress,
                            stop=stop, take_over=take_over, lock_free=args.lock_free)
    result = encode_image_rank(args.plan, args.out, codec, rank=rank, world_size=world_size, device=device,
                               options=options)
    print_report("encode", summary_lines(result, args.out), result.to_json() if args.json else None)
    if result.stopped:
        return STOPPED_EXIT
    counts = result.counts  # the parts' own counters: the same verdict when a rerun finds them finished
    failed = skips.items_failed_by_reason(counts)
    refuse_nothing_usable(f"rank {rank}/{world_size}", result.images_written + result.images_deferred
                          - sum(failed.values()), counts,
                          listed_in(result, "skipped.jsonl" + (" and items.jsonl" if failed else "")), extra=failed,
                          rank_of=("encode", world_size))
    refuse_unfinished(result.take_over)
    return 0


MAX_ARRAY_TASKS = 1000  # SLURM's default MaxArraySize is 1001 (indices 0..1000); sites raise it for larger arrays
SIGNAL_LEAD_S = 120  # seconds before the time limit SLURM sends USR1: ample to commit a batch and stop


def sbatch_script(args, num_items: int) -> str:
    """The batch script of `--print-sbatch GPUS`: a SLURM array of T tasks, GPUS at once, each worker t of T of this
    command line (its own items, then take-over). T defaults to one task per GPU: a task keeps its model loaded
    and, once its own items are done, takes those nobody finished or holds, so a slow or dead node costs about
    one item; `--world-size T` sets more. The shell forwards USR1 (sent before the time limit) and TERM
    (preemption, scancel) to mmtok, which commits the batch in flight and exits STOPPED_EXIT; after USR1 (and no
    TERM) the task requeues itself, so the time limit costs no work."""
    import shlex

    from mmtok import __version__
    from mmtok.launch import STOPPED_EXIT

    gpus = args.print_sbatch
    if gpus < 1:
        raise MmtokError(f"--print-sbatch {gpus}: the number of GPUs the array may use at once must be at least 1")
    if args.rank is not None:
        raise MmtokError("--print-sbatch gives each array task its rank ($SLURM_ARRAY_TASK_ID); drop --rank")
    if args.device and args.device.strip() not in ("cuda", "cuda:0", "cpu"):
        raise MmtokError(f"--device {args.device}: each array task sees one GPU (--gpus=1), cuda:0; drop --device")
    paths = {flag: os.path.abspath(value) for flag, value in
             (("--plan", args.plan), ("--checkpoint", args.checkpoint), ("--out", args.out))}
    for flag, path in paths.items():  # a newline in a path would end the command line (and run the rest)
        if any(ord(c) < 32 or ord(c) == 127 for c in path):
            raise MmtokError(f"{flag} {path!r}: a path with control characters cannot go into a batch script; "
                             "rename it")
    tasks = args.world_size if args.world_size is not None else min(num_items, gpus, MAX_ARRAY_TASKS)
    if tasks < 1:
        raise MmtokError(f"--world-size {tasks}: an array needs at least one task")
    # this interpreter, not whichever `mmtok` comes first on the task's PATH: the version that made the plan
    command = [sys.executable, "-m", "mmtok", "encode", "--plan", paths["--plan"], "--codec", args.codec,
               "--checkpoint", paths["--checkpoint"], "--out", paths["--out"], "--loader-threads",
               str(args.loader_threads), "--prefetch", str(args.prefetch), "--max-consecutive-failures",
               str(args.max_consecutive_failures), "--no-progress", *(["--no-take-over"] if args.no_take_over else []),
               *(["--lock-free"] if args.lock_free else [])]
    if args.device:
        command += ["--device", args.device.strip()]
    alone = args.no_take_over or args.lock_free
    share = ("one item each" if tasks == num_items else f"task t starts with worker t's share of the {num_items:,} "
             "items" + ("" if alone else ", then takes any item nobody finished or holds"))
    return f"""#!/bin/bash
# Written by `mmtok encode --print-sbatch {gpus}` (mmtok {__version__}). Submit: sbatch THIS_FILE; once every task
# is done: mmtok merge OUT (OUT: the --out below). {tasks:,} array tasks ({share}), at most {gpus:,} at once,
# one GPU each.
# SLURM sends USR1 {SIGNAL_LEAD_S} s before the time limit: mmtok commits the batch in flight, stops (exit
# {STOPPED_EXIT}) and the task requeues itself; the rerun resumes from that commit. TERM (preemption, scancel)
# stops it the same way without a requeue (SLURM requeues a preempted task itself where the partition says
# so). --requeue puts a task whose node failed back in the queue; any rerun resumes. The time limit must leave
# room for the model load plus some batches beyond the {SIGNAL_LEAD_S} s, or each run stops before its first batch.
#SBATCH --job-name=mmtok-encode
#SBATCH --array=0-{tasks - 1}%{gpus}
#SBATCH --gpus=1
#SBATCH --cpus-per-task={args.loader_threads + 2}
#SBATCH --requeue
#SBATCH --signal=B:USR1@{SIGNAL_LEAD_S}
#SBATCH --open-mode=append
#SBATCH --output=mmtok-encode-%A_%a.log
{shlex.join(command)} \\
    --rank "$SLURM_ARRAY_TASK_ID" --world-size {tasks} &
worker=$!
requeue=0
interrupted=0
trap 'requeue=1; interrupted=1; kill -USR1 "$worker" 2>/dev/null' USR1
trap 'requeue=0; trap "" USR1; interrupted=1; kill -TERM "$worker" 2>/dev/null' TERM
while :; do  # a trapped signal ends `wait` early (status > 128): wait again for the worker's own status
    interrupted=0
    wait "$worker"
    status=$?
    [ "$interrupted" = 1 ] && [ "$status" -gt 128 ] || break
done
# 75: stopped cleanly; 138 (128 + USR1): the signal came before mmtok could catch it (interpreter start-up)
if [ "$requeue" = 1 ] && {{ [ "$status" = {STOPPED_EXIT} ] || [ "$status" = 138 ]; }}; then
    scontrol requeue "${{SLURM_ARRAY_JOB_ID}}_${{SLURM_ARRAY_TASK_ID}}"
fi
exit "$status"
"""


def all_done(out: str, num_items: int) -> bool:
    """Whether every work item's part is finished (a worker with take-over then has nothing to load a model for)."""
    from mmtok.formats.partdir import is_done, part_dir

    return all(is_done(part_dir(out, item)) for item in range(num_items))


def refuse_other_run_early(out: str, modality: str, codec: str, checkpoint: str, **known) -> None:
    """Before the codec loads: an --out that holds parts of another run -- another plan, world size, codec or
    checkpoint (hashed only when parts are there) -- is refused naming what differs. The rank checks its
    whole identity again once the codec is loaded, before its first batch."""
    from mmtok.codecs.registry import checkpoint_sha256
    from mmtok.formats import parts
    from mmtok.formats.partdir import part_directories

    if not part_directories(out):
        return
    described = {"name": codec}
    sha256 = checkpoint_sha256(codec, checkpoint) if Path(checkpoint).is_dir() else None
    if sha256 is not None:
        described["checkpoint_sha256"] = sha256
    parts.refuse_other_run(out, {"modality": modality, "codec": described, **known})


def summary_lines(result: ImageWorkerRun, out: str) -> list[str]:
    """The human summary of an image worker: what it wrote (or that it was finished), its pace, the job view."""
    from mmtok.encode.loop import UNIFORM_CODES

    head = f"rank {result.rank}/{result.world_size}"
    idle = idle_worker_line(head, result, "encoded")
    if result.stopped:
        stop = result.stopped
        lines = [f"{head}: stopped on {stop.signal} before batch {stop.next_batch:,} of work item {stop.item:,} "
                 "(everything before it is committed); rerun or requeue this command to resume from there"]
    elif idle:
        lines = [idle]
    else:
        lines = (_sft_lines if result.mode == "sft" else _document_lines)(result, out)
        timing = result.timing
        lines.append(f"{timing['wall_s']:.1f} s, {result.images_per_s:.1f} img/s, {timing['tokens_per_s']:,.0f} tok/s, "
                     f"device busy {100 * timing['device_busy_fraction']:.1f}% on {result.device}")
        lines += _uniform_lines(result.counts.get(UNIFORM_CODES, 0), "image")
    lines += take_over_lines(result.take_over)
    return lines + [f"job view (every rank): mmtok status {out}"]


def _sft_lines(result: ImageWorkerRun, out: str) -> list[str]:
    """No documents here: every image is an item for `mmtok sft`."""
    where = parts_named(result)
    failed = _reasons(skips.items_failed_by_reason(result.counts))
    return [f"rank {result.rank}/{result.world_size} -> {where}: {result.images_deferred:,} of "
            f"{plural(result.images_planned, 'image')} of SFT conversations stored as items, "
            f"{plural(result.counts.get('item_tokens', 0), 'token')}" + (f"; failed to decode: {failed} "
            f"(named in {where}/items.jsonl; `mmtok sft` skips their conversations, naming them)" if failed else ""),
            f"next: mmtok sft CONVERSATIONS --images {out} [--audio AUD] --out SFT, then mmtok merge SFT"]


def _document_lines(result: ImageWorkerRun, out: str) -> list[str]:
    where, skipped = parts_named(result), skips.by_reason(result.counts)
    failed = skips.items_failed_by_reason(result.counts)
    lines = [f"rank {result.rank}/{result.world_size} -> {where}: {result.images_written:,} of "
             f"{plural(result.images_planned, 'image')} in {plural(result.sequences, 'document')}, "
             f"{plural(result.counts.get('tokens', 0), 'token')}; skipped: {_reasons(skipped) or 'none'}"
             + (f" (each named in {where}/skipped.jsonl)" if skipped else "")]
    if result.images_deferred:
        lines.append(f"+ {plural(result.images_deferred, 'image')} of documents with several images, stored as "
                     "items: `mmtok merge` assembles those documents (and lists any it skips)")
    if failed:
        lines.append(f"of those, failed to decode: {_reasons(failed)} (stored as failed items, named "
                     f"in {where}/items.jsonl; their documents are skipped, and listed, when they are assembled)")
    if not result.dataset and not result.images_deferred:
        lines.append("no tokens: the part has no dataset (megatron-core cannot open an empty one); merge leaves it out")
    return lines


def _reasons(counts: dict) -> str:
    return ", ".join(f"{reason} {n:,}" for reason, n in counts.items())


def add_audio_arguments(parser) -> None:
    """Register the audio-only options of `mmtok encode`."""
    from mmtok.encode.audio import DEFAULT_SEQUENCES, SEQUENCE_MODES

    group = parser.add_argument_group("audio options (--modality audio)")
    options = [
        (("--shar",), {"type": Path, "help": "output of `mmtok audio convert` (or a Lhotse Shar directory)"}),
        (("--max-duration",), {"type": float, "default": 300.0,
                               "help": "audio: padded seconds per batch (longest clip x clips; default 300)"}),
        (("--max-clip-duration",), {"type": float, "default": 600.0,
                                    "help": "audio: clips longer than this many seconds are skipped as too_long "
                                            "(memory grows with a clip's length: ~3 GB per 1,000 s; default 600)"}),
        (("--num-buckets",), {"type": int, "default": 50,
                              "help": "audio: duration buckets of the sampler "
                                      "(default 50: < 5%% padding, see the benchmark)"}),
        (("--bucket-seed",), {"type": int, "default": 0, "help": "audio: seed of the bucketing sampler (default 0)"}),
        (("--sequences",), {"choices": SEQUENCE_MODES, "default": DEFAULT_SEQUENCES,
                            "help": "audio: which sequences to write per clip: auto = transcription (translation "
                                    "when the clip has a target language) if it has text, else audio-only "
                                    "(default); audio = audio-only for every clip; transcription = only clips "
                                    "with text; both = audio-only for every clip plus a transcription"}),
        (("--num-workers",), {"type": int, "default": min(4, os.cpu_count() or 1),
                              "help": "CPU data-loader worker processes (default min(4, CPUs))"}),
        (("--text-tokenizer",), {"default": "tekken",
                                 "help": "text tokenizer spec; must match the one the Shar text was tokenized with"}),
    ]
    for flags, kwargs in options:
        group.add_argument(*flags, **kwargs)


def run_audio(args) -> int:
    from mmtok.launch import StopRequest

    if args.shar is None:
        raise MmtokError("--modality audio needs --shar (the output directory of `mmtok audio convert`)")
    with StopRequest() as stop:  # from the start to the end a signal stops the worker cleanly (see StopRequest)
        return _audio_worker(args, stop)


def _audio_worker(args, stop) -> int:
    """One audio worker under `stop`: its shards (one part each), then (take-over) the ones nobody finished or
    holds."""
    from mmtok.codecs.registry import load_codec
    from mmtok.encode.audio import encode_audio_rank
    from mmtok.encode.audio_batches import Batching
    from mmtok.formats.partdir import check_part_free, part_dir, parts_root
    from mmtok.formats.shar import discover_shards
    from mmtok.launch import STOPPED_EXIT, resolve_device, resolve_rank
    from mmtok.ranks import assign_shards

    rank, world_size = resolve_rank(args.rank, args.world_size)
    shards, _ = discover_shards(Path(args.shar))
    if args.no_take_over:
        for index in assign_shards([s.duration for s in shards], world_size)[rank]:
            check_part_free(part_dir(args.out, shards[index].index))  # a duplicate job stops before the model loads
    refuse_other_run_early(args.out, "audio", args.codec, args.checkpoint, num_parts=len(shards))
    codec = load_codec(args.codec, args.checkpoint, resolve_device(args.device), modality="audio")
    if codec.modality != "audio":
        raise MmtokError(f"codec {codec.name} is an {codec.modality} codec; --modality audio needs an audio codec")
    batching = Batching(args.max_duration, args.num_buckets, args.bucket_seed, args.max_clip_duration)
    result = encode_audio_rank(Path(args.shar), Path(args.out), codec, rank=rank, world_size=world_size,
                               batching=batching, sequences=args.sequences, num_workers=args.num_workers,
                               text_tokenizer=args.text_tokenizer, progress=not args.no_progress,
                               take_over=not args.no_take_over, stop=stop)
    print_report("encode (audio)", audio_summary_lines(result, args.out), result.to_json() if args.json else None)
    if result.stopped:
        return STOPPED_EXIT
    counts = parts_counts(args.out, [*result.shards, *result.take_over.taken_over])  # now or in an earlier run
    refuse_nothing_usable(f"rank {rank}/{world_size}", sum(n for key, n in counts.items() if key.startswith(
        "sequences:")), counts, f"the parts' skipped.jsonl under {parts_root(args.out)}",
        rank_of=("encode (audio)", world_size))
    refuse_unfinished(result.take_over)
    return 0


def parts_counts(out: str, parts: list[int]) -> dict[str, int]:
    """The counters of `parts` of OUT summed, from their commit logs (a part finished by an earlier run too)."""
    from collections import Counter

    from mmtok.formats.commitlog import read_commits
    from mmtok.formats.partdir import part_dir

    total: Counter = Counter()
    for part in parts:
        records, _ = read_commits(part_dir(out, part))
        total.update(records[-1]["counts"] if records else {})
    return dict(total)


def audio_summary_lines(result: AudioWorkerRun, out: str) -> list[str]:
    """The human summary of an audio rank: its shards, batches and clips, what it skipped, its pace, what it
    took over or left, where it stopped."""
    run = result.run
    lost = sum(run.skipped.values())
    busy = run.device_busy_s / run.wall_s if run.wall_s else 0.0
    reasons = _reasons(run.skipped)
    head = f"rank {result.rank}/{result.world_size}"
    lines = [f"{head}: {plural(len(result.shards), 'own shard')} "
             f"({run.shards_to_do} to do), {plural(run.batches, 'batch', 'batches')}, "
             f"{plural(run.clips, 'clip')}: {run.clips - lost:,} encoded, {lost:,} skipped"
             f"{f' ({reasons}; each named in the part skipped.jsonl)' if lost else ''} in {run.wall_s:.1f} s, "
             f"device busy {100 * busy:.1f}% (waited {run.loader_wait_s:.1f} s for the loader)",
             *_uniform_lines(run.uniform_codes, "clip")]
    if result.stopped:
        lines.insert(0, f"{head}: stopped on {result.stopped.signal} before finishing shard(s) "
                        f"{listed(result.stopped.shards, 10)} (every batch encoded is committed; other ranks' shards "
                        "may be left too); rerun or requeue this command to resume from there")
    lines += take_over_lines(result.take_over)
    return lines + [f"job view (every shard): mmtok status {out}"]


def _uniform_lines(batches: int, item: str) -> list[str]:
    """The warning for batches whose every code was one value (`encode.loop.uniform_codes`)."""
    from mmtok.encode.loop import UNIFORM_CODES

    return [f"warning: {plural(batches, 'batch', 'batches')} gave every {item} one code ({UNIFORM_CODES}): a "
            "damaged checkpoint or blank inputs? Look at the tokens with `mmtok inspect`"] if batches else []
