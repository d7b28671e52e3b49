"""Command-line entry point: argument parsing only; each command lives in mmtok/commands/<name>.py.

Every command module provides `add_parser(subparsers)`, which registers its parser and sets
`func` to a `run(args) -> int` function. Heavy imports (torch, pyarrow) happen inside `run`,
so `mmtok --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from mmtok import __version__
from mmtok.errors import MmtokError

COMMANDS = ("scan", "plan", "encode", "merge", "audio", "bench", "inspect", "codec", "demo")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mmtok",
        description="Turn image and audio corpora into discrete tokens for Megatron-LM "
        "(scan -> plan -> encode -> merge). Run `mmtok COMMAND --help` for each command.",
    )
    parser.add_argument("--version", action="version", version=f"mmtok {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"mmtok.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MmtokError as err:
        print(f"mmtok {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"mmtok {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
