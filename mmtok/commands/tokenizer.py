"""`mmtok tokenizer build|check`: the omnimodal Hugging Face tokenizer for training, and its check against data."""

from __future__ import annotations

import argparse

from mmtok.commands.report import plural, print_summary

BUILD_HELP = """\
Write a Hugging Face tokenizer directory (tokenizer.json, tokenizer_config.json, special_tokens_map.json,
and the base's chat_template.jinja if it has one) whose ids are exactly mmtok's vocabulary layout for the
text tokenizer T: the text ids of T unchanged; then the 200 omni-special ids (<|img_start|> ... by name,
<image>/<audio> encoding to the ids of <|image|>/<|audio|>, free slots named <|omni_reserved_N|>); then
one token per image code (<|visual token i|>) and per audio code (<|audio token i|>). With the built-in
tekken (131,072 text ids) that is 266,440 ids: <|img_start|> = 131,073, image code 0 = 131,272, audio
code 0 = 262,344; a 128,000-id base shifts every omni id down by 3,072. tokenizer_config.json carries
every key of the released Apertus 1.5 tokenizer_config.json (base_vocab_size, the omnimodal_config block that
the swiss-ai Megatron-LM fork reads, the sft_* sequences, the span tokens, vision_tokenizer/audio_tokenizer) and
mmtok's additions; docs/training.md lists them. Use the same
--text-tokenizer as `mmtok plan` / `mmtok audio convert`, then `mmtok tokenizer check` against the data.
"""

CHECK_HELP = """\
Check a tokenizer directory against datasets written by `mmtok merge` (OUT/merged, OUT/merged_no_reasoning)
or `mmtok audio interleave` (OUT/stage, OUT/long-context): the same layout as the dataset's metadata
(OUT/merged.json or OUT/interleave.json), every structure token and BOS/EOS at the id the data uses, the
same base text tokenizer and codec, and every id on disk inside the tokenizer's vocabulary. With
--against REF, also compare it with another tokenizer directory (a released one, or one holding only its
tokenizer_config.json): the chat template, every tokenizer_config.json and special_tokens_map.json key, every
token name's id and every added token's flags. Prints one line per problem or difference and exits 1, or one
success line and exits 0.
"""


def add_parser(sub) -> None:
    parser = sub.add_parser("tokenizer", help="build the omnimodal HF tokenizer for training; check it against data",
                            description="The tokenizer a training run needs: `build` writes a Hugging Face tokenizer "
                            "directory whose ids are mmtok's vocabulary layout for a text tokenizer; `check` verifies "
                            "it against merged datasets (and, with --against, key by key against a released one). "
                            "`mmtok tokenizer SUBCOMMAND --help`; docs/training.md.")
    tokenizer_sub = parser.add_subparsers(dest="tokenizer_command", required=True, metavar="SUBCOMMAND")
    build = tokenizer_sub.add_parser("build", help="write the omnimodal tokenizer directory for a text tokenizer",
                                     description=BUILD_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    build.add_argument("--text-tokenizer", required=True, metavar="T",
                       help="`tekken` (built in), a tekken JSON, an HF tokenizer.json or its directory: the one the "
                       "data was tokenized with")
    build.add_argument("--out", required=True, metavar="DIR", help="tokenizer directory to write (created if needed)")
    build.add_argument("--image-codec", metavar="NAME",
                       help="image codec of the data, recorded in tokenizer_config.json and compared by `check` "
                       "(a registered image codec: emu3.5, emu3 or a plugin's; default emu3.5); its codes use the "
                       "131,072 image ids")
    build.add_argument("--audio-codec", metavar="NAME",
                       help="audio codec of the data, recorded like --image-codec (default wavtokenizer); its codes "
                       "use the 4,096 audio ids")
    build.set_defaults(func=run_build)
    check = tokenizer_sub.add_parser("check", help="verify a tokenizer directory against datasets",
                                     description=CHECK_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    check.add_argument("directory", metavar="DIR", help="tokenizer directory (the --out of `mmtok tokenizer build`)")
    check.add_argument("--data", action="append", default=[], metavar="PREFIX",
                       help="dataset prefix such as OUT/merged (repeat for several datasets)")
    check.add_argument("--against", metavar="REF", help="a tokenizer directory to compare key by key and id by id, "
                       "such as the released Apertus 1.5 tokenizer")
    check.set_defaults(func=run_check)


def run_build(args) -> int:
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.tools.tokenizer import build_tokenizer

    refuse_out_overlapping(args.out, [args.text_tokenizer])
    summary = build_tokenizer(args.text_tokenizer, args.out, image_codec=args.image_codec, audio_codec=args.audio_codec)
    omni = summary["total_size"] - summary["text_size"]
    print_summary("tokenizer build", f"{summary['text_tokenizer']} ({summary['text_size']:,} text ids) + "
                  f"{omni:,} omni ids = {summary['total_size']:,} ids -> {summary['out']} (tokenizer.json "
                  f"{summary['tokenizer_json_bytes'] / 1e6:.1f} MB) in {summary['seconds']:.1f} s")
    return 0


def run_check(args) -> int:
    from mmtok.errors import MmtokError
    from mmtok.tools.tokenizer import check_tokenizer, compare_tokenizers

    if not args.data and not args.against:
        raise MmtokError("tokenizer check needs --data PREFIX (a dataset) or --against REF (a tokenizer directory)")
    problems, summaries = check_tokenizer(args.directory, args.data) if args.data else ([], [])
    differences, count, compared = compare_tokenizers(args.directory, args.against) if args.against else ([], 0, "")
    for line in [*problems, *differences]:
        print_summary("tokenizer check", line)
    verdicts = []
    if problems:
        verdicts.append(f"{plural(len(problems), 'problem')}: {args.directory} does not fit this data")
    if count:
        verdicts.append(f"{plural(count, 'difference')}: {args.directory} differs from {args.against}")
    for verdict in verdicts:
        print_summary("tokenizer check", verdict)
    if verdicts:
        return 1
    for summary in summaries:
        print_summary("tokenizer check", f"ok: {args.directory} fits {summary}")
    if args.against:
        print_summary("tokenizer check", f"ok: {args.directory} equals {args.against}, {compared}")
    return 0
