"""`mmtok demo`: run the whole flow on bundled real media."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("demo", help="run the whole flow on bundled real media", description="run the whole flow on bundled real media.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("demo")
