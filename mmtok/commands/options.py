"""Argument types several commands share: a bad value is refused where the flag is parsed, in argparse's one
`error:` line (exit 2), before the command does any work."""

from __future__ import annotations

import argparse

from mmtok.errors import MmtokError
from mmtok.launch import DEVICE_FORMS, parse_device


def device(text: str) -> str:
    """The argparse type of `--device`: `launch.parse_device`, its refusal as argparse's error line."""
    try:
        return parse_device(text)
    except MmtokError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--device ")) from None


def add_device_argument(parser, default_help: str = "cuda:LOCAL_RANK if available, else cpu") -> None:
    """`--device` (one of DEVICE_FORMS; default: from the launcher, see launch.resolve_device)."""
    parser.add_argument("--device", type=device, default=None,
                        help=f"torch device: {DEVICE_FORMS} (default: {default_help})")
