"""`mmtok sft`: assemble SFT conversations (text, images, audio) from their encoded media into parts."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.report import (
    files_skipped,
    idle_worker_line,
    listed_in,
    parts_named,
    plural,
    print_report,
    reasons,
    refuse_nothing_usable,
    refuse_unfinished,
    take_over_lines,
)
from mmtok.commands.sources import add_media_root
from mmtok.formats import skips
from mmtok.sft.build import DEFAULT_MAX_TOKENS

if TYPE_CHECKING:
    from mmtok.workers import WorkerRun

DESCRIPTION = """\
Render SFT conversations with the text tokenizer's chat template and replace every media placeholder
(<|image|>/<image>, <|audio|>/<audio>, or an image/audio content part) by its medium's block: images
from an image encode output (`mmtok plan --mode sft` over the conversation tars, then `mmtok encode`),
audio from audio encode outputs (`mmtok audio convert --kind conversations`, then `mmtok encode
--modality audio`; clips of the pretraining path are referenced as {"cut_id": ...}). Writes one part
per rank into OUT/parts/; then `mmtok merge OUT [--strip-reasoning]`.

Inputs: WebDataset tars (KEY.json + media members), .jsonl (one conversation per line), .parquet (a
`messages` column). A conversation is written only when every medium it references encoded; otherwise
it is named in the part's skipped.jsonl with its reason (missing_media, placeholder_mismatch,
media_skipped:<reason>, ...). CPU only.

Workers: --rank/--world-size, else RANK/WORLD_SIZE, else SLURM_PROCID/SLURM_NTASKS. Worker w of W
starts with an even, contiguous range of the work items, then takes over every item no process has
finished or holds (unless --no-take-over), so the slowest worker sets no tail. The parts and the merged
output are the same for every number of workers; a killed or requeued job resumes with any number of
workers, each item from its last committed unit. SIGUSR1 or SIGTERM: the unit in hand is committed and
the worker exits 75 (what `mmtok encode --print-sbatch` requeues on).
"""


def add_parser(sub) -> None:
    parser = sub.add_parser("sft", help="assemble SFT conversations with their encoded images and audio",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="conversation files (.tar, .jsonl, .parquet)")
    parser.add_argument("--text-tokenizer", required=True,
                        help="HF tokenizer directory with a chat_template (the image plan's tokenizer)")
    parser.add_argument("--images", type=Path, default=None,
                        help="image encode output of a `--mode sft` plan over the conversation tars")
    parser.add_argument("--audio", type=Path, action="append", default=[],
                        help="audio encode output (repeatable): its token cache holds the conversations' clips")
    parser.add_argument("--converted", type=Path, action="append", default=[],
                        help="`mmtok audio convert` output (repeatable): names why a clip it dropped is missing")
    parser.add_argument("--out", type=Path, required=True, help="output directory (parts go to OUT/parts/)")
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help=f"skip conversations longer than this as document_too_long (default "
                             f"{DEFAULT_MAX_TOKENS:,}); text "
                             "that certainly has more tokens (more UTF-8 bytes than this x the tokenizer's longest "
                             "vocabulary entry) is skipped before it is tokenized, and bounds the chat template's "
                             "rendering")
    add_media_root(parser)
    parser.add_argument("--rank", type=int, default=None, help="this worker's rank (default: from the environment)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="number of workers (default: from the environment)")
    parser.add_argument("--no-take-over", action="store_true",
                        help="do only this worker's own items; an own item another process holds is an error")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true",
                        help="also print the rank's summary as one JSON object on stdout "
                        "(the human one stays on stderr)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.errors import MmtokError
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.launch import StopRequest

    refuse_out_overlapping(args.out, [*args.inputs, args.images, *args.audio, *args.converted, args.text_tokenizer,
                                      *args.media_root])
    if args.max_tokens < 1:
        raise MmtokError(f"--max-tokens {args.max_tokens}: it must be at least 1")
    with StopRequest(in_flight="the unit in hand") as stop:  # a signal stops the worker cleanly (see StopRequest)
        return _worker(args, stop)


def _worker(args, stop) -> int:
    from mmtok.launch import STOPPED_EXIT, resolve_rank
    from mmtok.sft.build import SftOptions, assemble_worker

    rank, world_size = resolve_rank(args.rank, args.world_size)
    options = SftOptions(max_tokens=args.max_tokens, progress=not args.no_progress, take_over=not args.no_take_over,
                         stop=stop)
    worker = assemble_worker(args.inputs, args.out, text_tokenizer=args.text_tokenizer, images=args.images,
                             audio=args.audio, converted=args.converted, rank=rank, world_size=world_size,
                             options=options, media_roots=args.media_root)
    print_report("sft", summary_lines(rank, world_size, worker, args.out),
                 {"rank": rank, "world_size": world_size, **worker.to_json()} if args.json else None)
    if worker.stopped:
        return STOPPED_EXIT
    refuse_nothing_usable(f"rank {rank}/{world_size}", worker.counts.get("documents_written", 0), worker.counts,
                          listed_in(worker, "skipped.jsonl"), rank_of=("sft", world_size))
    refuse_unfinished(worker.take_over)
    return 0


def summary_lines(rank: int, world_size: int, worker: WorkerRun, out: Path) -> list[str]:
    """What the worker wrote and skipped (naming where the skips are listed), what it took over, and the next
    command."""
    counts = worker.counts
    skipped = skips.by_reason(counts)
    head = f"rank {rank}/{world_size}"
    idle = idle_worker_line(head, worker, "assembled")
    if worker.stopped:
        lines = [f"{head}: stopped on {worker.stopped.signal} in work item {worker.stopped.item:,} (every "
                 "unit it read is committed); rerun or requeue this command to resume from there"]
    elif idle:
        lines = [idle]
    else:
        listed = listed_in(worker, "skipped.jsonl")
        items = f"{plural(len(worker.items), 'own work item')} of {worker.num_items:,}"
        conversations = plural(counts.get("conversations", 0), "conversation")
        lines = [f"{head} ({items}) -> {parts_named(worker)}: {conversations}: "
                 f"{counts.get('documents_written', 0):,} written ({plural(counts.get('tokens', 0), 'token')}, "
                 f"{counts.get('images_written', 0):,} image and "
                 f"{plural(counts.get('audio_written', 0), 'audio block')}), "
                 f"{counts.get('documents_skipped', 0):,} skipped"
                 + (f" ({reasons(skipped)}; each named in {listed})" if skipped else "")
                 + files_skipped(counts, listed)]
        if counts.get("control_literals"):
            lines.append(f"{plural(counts['control_literals'], 'conversation')} held control-token names in their "
                         "text (tokenized as text, never as control tokens: control_literals)")
    lines += take_over_lines(worker.take_over)
    return lines + [f"job view: mmtok status {out}; when every item is finished: mmtok merge {out} "
                    "[--strip-reasoning]"]
