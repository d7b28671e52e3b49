"""`mmtok audio convert|interleave`: audio sources -> Lhotse Shar; per-clip tokens -> interleaved sequences."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.report import plural, print_summary, reasons
from mmtok.commands.sources import add_media_root
from mmtok.formats import skips
from mmtok.formats.interleave import LONG_MAX_TOKENS, STAGE_MAX_TOKENS, InterleaveSummary

if TYPE_CHECKING:  # conversion is imported when it runs, not for `--help`
    from mmtok.audio.convert import Converted

CONVERT_HELP = """\
Convert audio sources into Lhotse Shar shards: 24 kHz mono audio (24-bit FLAC) with the text already
tokenized into cut.custom["text_tokens"], plus source id, clip number, original sampling rate and
languages. INPUT kinds (auto-detected, or --kind): a directory of audio files (any file libsndfile
opens: wav flac ogg oga opus mp3 aiff ..., with or without extension; other files are counted by
extension; --transcripts TSV/JSONL with columns path, text, recording_id, start, end, language,
target_language, id, clip), WebDataset .tar files (audio member + txt/json sidecar per key), Lhotse
manifests (.jsonl[.gz] recordings + supervisions) and .parquet files (an audio-bytes column).
--kind conversations (never detected) reads SFT conversations -- KEY.json samples of WebDataset tars,
.jsonl files (one per line), .parquet files (a `messages` column) -- and converts the audio their
messages reference (a tar member, a file, inline bytes) into clips <conversation id>/audio-<k> without
text; a reference to a clip already in an audio token cache ({"cut_id": ...}) is left out; `mmtok sft`
assembles the conversations later. Invalid clips and unreadable table rows are skipped with a counted
reason (OUT/conversion.json, OUT/dropped/); in = written + skipped + ignored. Rerunning resumes after
the last complete shard; one run at a time writes OUT (a second is refused, naming the holder).
"""

INTERLEAVE_HELP = """\
Build interleaved speech/text sequences from the per-clip token cache of `mmtok encode --modality audio`:
consecutive clips of one recording form runs; each run gives two copies alternating audio and text
(one starting with audio, one with text) that end with text; single clips and each run's leftover
clip give transcription sequences. Sequences up to --stage-max-tokens go to OUT/stage, longer ones
(split at clip boundaries to at most --max-tokens) to OUT/long-context. A set that gets no sequence
is not written (Megatron cannot load an empty dataset; OUT/interleave.json and the summary say so);
when no clip gives a sequence at all, the command fails and writes nothing.
"""


def add_parser(sub) -> None:
    parser = sub.add_parser("audio", help="audio conversion and speech/text interleaving",
                            description="Audio before and after the GPU: `convert` turns directories, tars, Lhotse "
                            "manifests or Parquet into Lhotse Shar (24 kHz, text token ids) for `mmtok encode "
                            "--modality audio`; `interleave` builds speech/text sequences from its per-clip token "
                            "cache. `mmtok audio SUBCOMMAND --help` for each; docs/audio.md for all of it.")
    audio_sub = parser.add_subparsers(dest="audio_command", required=True, metavar="SUBCOMMAND")
    convert = audio_sub.add_parser("convert", help="audio sources -> Lhotse Shar (24 kHz + text token ids)",
                                   description=CONVERT_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    convert.add_argument("inputs", nargs="*", type=Path, metavar="INPUT",
                         help="directory, .tar, .parquet or Lhotse .jsonl[.gz]; with --kind conversations: "
                         "conversation .tar, .jsonl or .parquet")
    convert.add_argument("--source", type=Path, metavar="FILE",
                         help="source declaration (manifests/*.yaml): its inputs follow INPUT arguments and its "
                         "options apply where no flag is given")
    convert.add_argument("--root", type=Path, metavar="DIR",
                         help="directory that relative paths of --source are relative to (default: its folder)")
    convert.add_argument("--out", required=True, type=Path, help="output directory (Shar shards in OUT/shar)")
    convert.add_argument("--kind", default="auto",
                         choices=("auto", "dir", "tar", "lhotse", "parquet", "conversations"),
                         help="source kind of every input (default: detect per input; conversations is never "
                         "detected)")
    convert.add_argument("--transcripts", type=Path,
                         help="TSV (with header) or JSONL transcript table for a directory input")
    convert.add_argument("--audio-column", default="audio", help="Parquet: column with audio bytes (default audio)")
    convert.add_argument("--text-column", default="text", help="Parquet: column with the text (default text)")
    convert.add_argument("--text-tokenizer", default="tekken", help="tokenizer spec (default: built-in tekken)")
    convert.add_argument("--allow-command-sources", action="store_true",
                         help="Lhotse manifests: also read recordings whose sources are `command` (a shell "
                         "command, run as you) or `url` (fetched); without it each of their clips is skipped as "
                         "unsafe_source. Only for manifests you trust")
    add_media_root(convert)
    convert.add_argument("--shard-size", type=int, default=5000, help="cuts per Shar shard (default 5000)")
    convert.add_argument("--min-duration", type=float, default=0.3,
                         help="drop clips shorter than this (s, default 0.3)")
    convert.add_argument("--max-duration", type=float, default=60.0, help="drop clips longer than this (s, default 60)")
    convert.add_argument("--min-rms-dbfs", type=float, default=-60.0,
                         help="drop clips quieter than this RMS (default -60)")
    convert.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                         help="decode processes (default: CPU count; 0 = in the main process)")
    convert.add_argument("--no-progress", action="store_true", help="no progress bar")
    convert.set_defaults(func=run, parser=convert)

    interleave = audio_sub.add_parser("interleave", help="per-clip token cache -> interleaved speech/text sequences",
                                      description=INTERLEAVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    interleave.add_argument("encoded", type=Path, help="output directory of `mmtok encode --modality audio`")
    interleave.add_argument("--out", required=True, type=Path, help="output directory")
    interleave.add_argument("--stage-max-tokens", type=int, default=STAGE_MAX_TOKENS,
                            help=f"longest sequence of the stage set (default {STAGE_MAX_TOKENS})")
    interleave.add_argument("--max-tokens", type=int, default=LONG_MAX_TOKENS,
                            help="longest long-context sequence; longer ones are split at clip boundaries "
                            f"(default {LONG_MAX_TOKENS})")
    interleave.add_argument("--no-progress", action="store_true", help="no progress bar")
    interleave.set_defaults(func=run)


def run(args) -> int:
    from mmtok.fsutil import refuse_out_overlapping

    if args.audio_command == "convert":
        from mmtok.audio.convert import ConvertOptions, convert
        from mmtok.errors import MmtokError

        if args.source is not None:
            from mmtok.commands.sources import apply_source, load_source

            declared = apply_source(args, args.parser, load_source(args.source, args.root), "audio")
            args.inputs = list(args.inputs) + [Path(p) for p in declared]
        if not args.inputs:
            raise MmtokError("no input: give INPUT paths or --source FILE")
        refuse_out_overlapping(args.out, [*args.inputs, args.transcripts, args.source, args.text_tokenizer,
                                           *args.media_root])
        if args.shard_size <= 0:
            raise MmtokError(f"--shard-size must be positive, got {args.shard_size}")
        options = ConvertOptions(min_duration=args.min_duration, max_duration=args.max_duration,
                                 min_rms_dbfs=args.min_rms_dbfs, shard_size=args.shard_size,
                                 text_tokenizer=args.text_tokenizer)
        if args.allow_command_sources:
            print_summary("audio convert", "warning: --allow-command-sources: the shell commands and URLs of the "
                          "Lhotse manifests' sources are run and fetched as you; use it only for manifests you trust")
        converted = convert(args.inputs, args.out, options, kind=args.kind, transcripts=args.transcripts,
                         audio_column=args.audio_column, text_column=args.text_column, workers=args.workers,
                         progress=not args.no_progress, allow_command_sources=args.allow_command_sources,
                         media_roots=args.media_root)
        print_summary("audio convert", convert_line(converted))
        if not converted.report.counts.get("written", 0):  # as scan and interleave: nothing usable is a failure
            from mmtok.formats.shar import SKIPPED_DIR

            found = plural(converted.report.counts.get("in", 0), "input")
            raise MmtokError(f"no clip was written from {args.out}'s inputs ({found} found; each skip is named in "
                             f"{Path(args.out) / SKIPPED_DIR}): check the inputs and the options above")
        return 0
    from mmtok.audio.interleave import interleave

    refuse_out_overlapping(args.out, [args.encoded])

    summary = interleave(args.encoded, args.out, stage_max_tokens=args.stage_max_tokens, max_tokens=args.max_tokens,
                         progress=not args.no_progress)
    print_summary("audio interleave", interleave_line(summary))
    return 0


def convert_line(converted: Converted) -> str:
    """One line: in = written + skipped + ignored, each with its reasons / extensions."""
    report = converted.report
    counts = report.counts
    hours = sum(s.duration for s in report.shards) / 3600
    parts = [f"{'already complete: ' if converted.already_done else ''}in {counts.get('in', 0):,}: "
             f"{plural(counts.get('written', 0), 'clip')} ({hours:.3f} h) written in "
             f"{plural(len(report.shards), 'shard')}"]
    ignored = {k.split(":", 1)[1]: v for k, v in counts.items() if k.startswith("ignored:")}
    for noun, these in (("skipped", skips.by_reason(counts)), ("ignored non-audio files", ignored)):
        if these:
            listed = ", ".join(f"{k}: {v:,}" for k, v in sorted(these.items()))
            parts.append(f"{noun} {sum(these.values()):,} ({listed})")
    return "; ".join(parts)


def interleave_line(summary: InterleaveSummary) -> str:
    """One line: the clips, each set's sequences and tokens (or why it was not written), the skips."""
    sets = []
    for name, entry in summary.datasets.items():
        if entry.written:
            sets.append(f"{name}: {plural(entry.sequences, 'sequence')}, {plural(entry.tokens, 'token')}")
        else:
            sets.append(f"{name}: {entry.reason} -- not written")
    counts = summary.counts
    skipped = skips.by_reason(counts)
    return (f"{plural(counts['clips'], 'clip')} -> " + "; ".join(sets)
            + (f"; skipped {sum(skipped.values()):,} ({reasons(skipped)})" if skipped else ""))
