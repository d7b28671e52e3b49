"""`mmtok inspect PATH`: print what a manifest, plan, encode output or Megatron dataset holds."""

from __future__ import annotations


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "inspect", help="print what a manifest, plan, encode output or dataset holds",
        description="Print what PATH holds: a scan manifest dir, a plan dir, an encode output dir, or a Megatron "
        "dataset (prefix, .bin or .idx). Datasets are shown document by document with text decoded and image/audio "
        "blocks summarized; --render decodes the blocks of the shown documents to PNG/WAV with a codec. "
        "--megatron instead prints the Megatron-LM arguments that train on the datasets given (one or more PATHs).")
    parser.add_argument("paths", nargs="+", metavar="PATH",
                        help="manifest dir, plan dir, encode output dir, or dataset prefix/.bin/.idx (several "
                        "datasets only with --megatron)")
    parser.add_argument("--limit", type=int, default=3, help="documents (or rows) to show (default 3)")
    parser.add_argument("--text-tokenizer", default=None,
                        help="text tokenizer used for the dataset (default: the one its merged.json -- or, for a "
                        "part's tokens, the part's identity.json -- records, when it still loads unchanged, else "
                        "tekken, the built-in Mistral-NeMo one; the view says which it used)")
    parser.add_argument("--text-vocab-size", type=int, default=None,
                        help="text vocabulary size of the layout (default: the tokenizer's size)")
    parser.add_argument("--render", metavar="DIR", default=None, help="decode shown blocks into DIR (needs --codec)")
    parser.add_argument("--codec", default=None, help="codec name for --render (a registered codec: emu3.5, emu3, "
                        "wavtokenizer, a plugin's)")
    parser.add_argument("--checkpoint", default=None, help="codec checkpoint directory for --render")
    parser.add_argument("--megatron", action="store_true",
                        help="print the Megatron-LM arguments for the datasets: --data-path, --split, tokenizer, vocab "
                        "padding, --seq-length (from the longest document in the .idx), with one comment line each")
    parser.add_argument("--weights", type=float, nargs="+", default=None, metavar="W",
                        help="with --megatron: one blending weight per PATH, in order (put it after the PATHs)")
    parser.add_argument("--tokenizer", default=None, metavar="DIR",
                        help="with --megatron: the `mmtok tokenizer build` directory; checked against the data")
    parser.add_argument("--seq-length", type=int, default=None, metavar="N",
                        help="with --megatron: the sequence length to train with (default: the advised one)")
    parser.add_argument("--train-tokens", type=int, default=None, metavar="T",
                        help="with --megatron: the run's token budget; adds --train-samples and prints how many "
                        "epochs of each dataset the weights imply, warning about repeated datasets")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.commands.report import print_summary
    from mmtok.errors import MmtokError
    from mmtok.tools.inspect import inspect_path, megatron_recipe

    if args.megatron:
        recipe = megatron_recipe(args.paths, weights=args.weights, tokenizer=args.tokenizer,
                                 seq_length=args.seq_length, train_tokens=args.train_tokens)
        print(recipe.text)
        if recipe.warnings:
            print_summary("inspect --megatron", [f"warning: {warning}" for warning in recipe.warnings])
        return 0
    if len(args.paths) > 1 or args.weights or args.tokenizer or args.seq_length or args.train_tokens:
        raise MmtokError("several PATHs, --weights, --tokenizer, --seq-length and --train-tokens go with --megatron; "
                         "without it give one PATH")
    codec = None
    if args.render:
        if not (args.codec and args.checkpoint):
            raise MmtokError("--render needs --codec and --checkpoint")
        from mmtok.codecs.registry import load_codec
        from mmtok.launch import resolve_device

        codec = load_codec(args.codec, args.checkpoint, resolve_device())
    print(inspect_path(args.paths[0], limit=args.limit, text_tokenizer=args.text_tokenizer,
                       text_vocab_size=args.text_vocab_size, render_dir=args.render, codec=codec))
    return 0
