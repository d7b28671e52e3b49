"""`mmtok scan`: index tar shards (headers only) into a Parquet manifest."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("scan", help="index tar shards (headers only) into a Parquet manifest", description="index tar shards (headers only) into a Parquet manifest.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("scan")
