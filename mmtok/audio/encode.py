"""`mmtok encode --modality audio`: per-rank bucketed encoding of Lhotse Shar shards (not implemented yet)."""

from mmtok.errors import NotImplementedYet


def add_arguments(parser) -> None:
    """Register the audio-only options of `mmtok encode` (called by mmtok/commands/encode.py)."""
    parser.add_argument_group("audio options (--modality audio)")


def run(args) -> int:
    raise NotImplementedYet("encode --modality audio")
