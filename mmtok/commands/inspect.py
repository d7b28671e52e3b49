"""`mmtok inspect`: print what a manifest, plan or shard holds."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("inspect", help="print what a manifest, plan or shard holds", description="print what a manifest, plan or shard holds.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("inspect")
