"""`mmtok demo`: run the whole flow once on the real media bundled with mmtok."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "demo", help="run the whole flow on bundled real media",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Run the whole flow once on bundled real media, printing each command as it runs:\n"
        "  images: scan -> plan -> encode (2 ranks) -> merge -> inspect, on photos with captions;\n"
        "  audio:  audio convert -> encode -> merge -> interleave, on speech clips;\n"
        "  SFT:    a conversation tar built from both -> scan -> plan --mode sft -> encode -> audio convert\n"
        "          --kind conversations -> encode --modality audio -> sft -> merge --strip-reasoning -> inspect.\n"
        "Without checkpoints the codecs are tiny random-weight checkpoints in the official formats\n"
        "(real files, meaningless tokens).")
    parser.add_argument("--out", default="mmtok-demo", help="output directory (default ./mmtok-demo): new, empty or "
                        "an earlier demo's, whose own files are replaced (others are left alone); it may not hold "
                        "a --image-checkpoint or --audio-checkpoint")
    parser.add_argument("--world-size", type=int, default=2, help="encode ranks to simulate (default 2)")
    parser.add_argument("--image-checkpoint", default=None, help="official Emu3.5 tokenizer directory (optional)")
    parser.add_argument("--audio-checkpoint", default=None, help="official WavTokenizer directory (optional)")
    parser.add_argument("--no-audio", action="store_true",
                        help="run the image flow only (the SFT flow needs the audio codec)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from mmtok.commands.demo_flow import run_demo

    run_demo(Path(args.out), world_size=args.world_size, image_checkpoint=args.image_checkpoint,
             audio_checkpoint=args.audio_checkpoint, audio=not args.no_audio)
    return 0
