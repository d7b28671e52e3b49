"""`mmtok plan`: build deterministic shape-uniform GPU batches balanced across ranks."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("plan", help="build deterministic shape-uniform GPU batches balanced across ranks", description="build deterministic shape-uniform GPU batches balanced across ranks.")
    parser.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("plan")
