"""`mmtok encode`: encode one rank's share of a plan (images) or Shar shards (audio)."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("encode", help="encode one rank's share of a plan (images) or Shar shards (audio)", description="encode one rank's share of a plan (images) or Shar shards (audio).")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("encode")
