"""`mmtok merge`: join rank shards into one Megatron dataset."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("merge", help="join rank shards into one Megatron dataset", description="join rank shards into one Megatron dataset.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("merge")
