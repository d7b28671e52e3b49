"""`mmtok sft`: assemble SFT conversations (text, images, audio) from their encoded media into parts."""

from __future__ import annotations

import argparse
from pathlib import Path

from mmtok.commands.report import files_skipped, plural, print_report, reasons, refuse_nothing_usable
from mmtok.commands.sources import add_media_root
from mmtok.formats import skips

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
media_skipped:<reason>, ...). CPU only. Rank and world size: --rank/--world-size, else RANK/WORLD_SIZE,
else SLURM_PROCID/SLURM_NTASKS; the merged output is the same for every world size. Rerunning the same
command after a kill resumes from the last committed unit.
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
    parser.add_argument("--max-tokens", type=int, default=1 << 20,
                        help="skip conversations longer than this as document_too_long (default 1,048,576); text "
                             "that certainly has more tokens (more UTF-8 bytes than this x the tokenizer's longest "
                             "vocabulary entry) is skipped before it is tokenized, and bounds the chat template's "
                             "rendering")
    add_media_root(parser)
    parser.add_argument("--rank", type=int, default=None, help="this process's rank (default: from the environment)")
    parser.add_argument("--world-size", type=int, default=None, help="number of ranks (default: from the environment)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--json", action="store_true",
                        help="also print the rank's summary as one JSON object on stdout "
                        "(the human one stays on stderr)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.errors import MmtokError
    from mmtok.formats.commitlog import check_part_free, part_dir
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.launch import resolve_rank
    from mmtok.sft.build import SftOptions, assemble_rank

    refuse_out_overlapping(args.out, [*args.inputs, args.images, *args.audio, *args.converted, args.text_tokenizer,
                                      *args.media_root])
    if args.max_tokens < 1:
        raise MmtokError(f"--max-tokens {args.max_tokens}: it must be at least 1")
    rank, world_size = resolve_rank(args.rank, args.world_size)
    check_part_free(part_dir(args.out, rank))
    options = SftOptions(max_tokens=args.max_tokens, progress=not args.no_progress)
    stats = assemble_rank(args.inputs, args.out, text_tokenizer=args.text_tokenizer, images=args.images,
                          audio=args.audio, converted=args.converted, rank=rank, world_size=world_size,
                          options=options, media_roots=args.media_root)
    print_report("sft", summary_lines(rank, world_size, stats, args.out),
                 {"rank": rank, "world_size": world_size, **stats} if args.json else None)
    refuse_nothing_usable(f"rank {rank}/{world_size}", stats["counts"].get("documents_written", 0), stats["counts"],
                          f"{stats['part_dir']}/skipped.jsonl", rank_of=("sft", world_size))
    return 0


def summary_lines(rank: int, world_size: int, stats: dict, out: Path) -> list[str]:
    """What the rank wrote and skipped (naming where the skips are listed), and the next command."""
    counts = stats["counts"]
    skipped = skips.by_reason(counts)
    lines = [f"rank {rank}/{world_size}: {plural(counts.get('conversations', 0), 'conversation')}: "
             f"{counts.get('documents_written', 0):,} written ({plural(counts.get('tokens', 0), 'token')}, "
             f"{counts.get('images_written', 0):,} image and {plural(counts.get('audio_written', 0), 'audio block')}), "
             f"{counts.get('documents_skipped', 0):,} skipped" + (f" ({reasons(skipped)}; each named in "
             f"{stats['part_dir']}/skipped.jsonl)" if skipped else "")
             + files_skipped(counts, f"{stats['part_dir']}/skipped.jsonl")]
    if counts.get("control_literals"):
        lines.append(f"{plural(counts['control_literals'], 'conversation')} held control-token names in their text "
                     "(tokenized as text, never as control tokens: control_literals)")
    if stats.get("already_done"):
        lines.append(f"(part already finished: {stats['part_dir']})")
    return lines + [f"next, when every rank finished: mmtok merge {out} [--strip-reasoning]"]
