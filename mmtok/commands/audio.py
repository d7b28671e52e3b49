"""`mmtok audio convert|interleave`: audio sources -> Lhotse Shar; per-clip tokens -> interleaved sequences."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("audio", help="audio conversion and speech/text interleaving")
    audio_sub = parser.add_subparsers(dest="audio_command", required=True, metavar="SUBCOMMAND")
    for name, text in (("convert", "audio sources -> Lhotse Shar (24 kHz + text token ids)"),
                       ("interleave", "per-clip token cache -> interleaved speech/text sequences")):
        child = audio_sub.add_parser(name, help=text, description=text)
        child.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet(f"audio {args.audio_command}")
