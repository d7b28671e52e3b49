"""`mmtok pack`: conversations and their media (files, table cells, base64) -> WebDataset tars."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from mmtok.commands.report import files_skipped, plural, print_summary, reasons, refuse_nothing_usable
from mmtok.commands.sources import add_media_root
from mmtok.formats import skips

if TYPE_CHECKING:  # pack is imported when a pack runs, not for `--help`
    from mmtok.sft.pack import PackReport

DESCRIPTION = """\
Write the conversations of the inputs (.jsonl lines, .parquet rows with a `messages` column, or tar
samples) as WebDataset tars, OUT/conversations-NNNNNN.tar: one sample per conversation, KEY.json (the
record, its id kept, each medium named by its member) + one member per image and audio medium, bytes
unchanged. The image path (scan -> plan --mode sft -> encode) reads images only from tar members; pack
is how images given as file paths, Parquet cells or base64 get there. Run the SFT flow on the packed
tars afterwards (docs/sft.md). A conversation whose media cannot all be read is not packed: it is named
with its reason in OUT/skipped.jsonl. The output depends only on the inputs.
"""


def add_parser(sub) -> None:
    parser = sub.add_parser("pack", help="conversations and their media (paths, cells, base64) -> WebDataset tars",
                            description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", type=Path, help="conversation files (.jsonl, .parquet, .tar)")
    parser.add_argument("--out", type=Path, required=True,
                        help="output directory: empty, new, or an earlier pack (whose own tars are replaced); it "
                        "may not hold an input, and a file there that pack did not write is refused, never replaced")
    parser.add_argument("--samples-per-tar", type=int, default=1000, help="conversations per tar (default 1000)")
    parser.add_argument("--max-media-bytes", type=int, default=1 << 30, metavar="N",
                        help="largest medium packed, in bytes (default 1 GiB = 1073741824): a conversation with a "
                        "larger one is skipped as media_too_large instead of copied (media are streamed, never "
                        "read whole into memory)")
    add_media_root(parser)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.errors import MmtokError
    from mmtok.sft.pack import pack

    if args.samples_per_tar < 1:
        raise MmtokError(f"--samples-per-tar {args.samples_per_tar}: it must be at least 1")
    if args.max_media_bytes < 1:
        raise MmtokError(f"--max-media-bytes {args.max_media_bytes}: it must be at least 1")
    report = pack(args.inputs, args.out, samples_per_tar=args.samples_per_tar, max_media_bytes=args.max_media_bytes,
                  progress=not args.no_progress, media_roots=args.media_root)
    print_summary("pack", summary_lines(report, args.out))
    from mmtok.sft.pack import SKIPPED

    refuse_nothing_usable(str(args.out), report.counts.get("packed", 0), report.counts, Path(args.out) / SKIPPED)
    return 0


def summary_lines(report: PackReport, out: Path) -> list[str]:
    """What was packed and skipped (naming where the skips are listed), and the commands that read the tars."""
    from mmtok.sft.pack import SKIPPED

    counts = report.counts
    skipped = skips.by_reason(counts)
    media = ", ".join(plural(counts.get(f"{kind}_packed", 0), noun) for kind, noun in (("image", "image"),
                                                                                     ("audio", "audio file")))
    return [f"{plural(counts.get('conversations', 0), 'conversation')} -> {plural(len(report.tars), 'tar')} in "
            f"{out}: {counts.get('packed', 0):,} packed (media: {media}), {sum(skipped.values()):,} skipped"
            + (f" ({reasons(skipped)}; each named in {out / SKIPPED})" if skipped else "")
            + files_skipped(counts, out / SKIPPED),
            f"next: mmtok scan {out}/conversations-*.tar ..., and the same tars to `mmtok audio convert --kind "
            "conversations` and `mmtok sft`"]
