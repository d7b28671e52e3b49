"""`mmtok bench reconstruct`: tokenizer reconstruction benchmark (PSNR/SSIM/LPIPS; audio metrics)."""

from mmtok.errors import NotImplementedYet


def add_parser(sub) -> None:
    parser = sub.add_parser("bench", help="tokenizer benchmarks")
    bench_sub = parser.add_subparsers(dest="bench_command", required=True, metavar="SUBCOMMAND")
    child = bench_sub.add_parser("reconstruct", help="score tokenizer reconstructions per category")
    child.set_defaults(func=run)


def run(args) -> int:
    raise NotImplementedYet("bench reconstruct")
