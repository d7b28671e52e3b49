"""`mmtok inspect PATH`: print what a manifest, plan, encode output or Megatron dataset holds."""

from __future__ import annotations


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "inspect", help="print what a manifest, plan, encode output or dataset holds",
        description="Print what PATH holds: a scan manifest dir, a plan dir, an encode output dir, or a Megatron "
        "dataset (prefix, .bin or .idx). Datasets are shown document by document with text decoded and image/audio "
        "blocks summarized; --render decodes the blocks of the shown documents to PNG/WAV with a codec.")
    parser.add_argument("path", help="manifest dir, plan dir, encode output dir, or dataset prefix/.bin/.idx")
    parser.add_argument("--limit", type=int, default=3, help="documents (or rows) to show (default 3)")
    parser.add_argument("--text-tokenizer", default="tekken",
                        help="text tokenizer used for the dataset (default: tekken, the built-in Mistral-NeMo one)")
    parser.add_argument("--text-vocab-size", type=int, default=None,
                        help="text vocabulary size of the layout (default: the tokenizer's size)")
    parser.add_argument("--render", metavar="DIR", default=None, help="decode shown blocks into DIR (needs --codec)")
    parser.add_argument("--codec", default=None, help="codec name for --render (emu3.5, emu3, wavtokenizer)")
    parser.add_argument("--checkpoint", default=None, help="codec checkpoint directory for --render")
    parser.set_defaults(func=run)


def run(args) -> int:
    from mmtok.errors import MmtokError
    from mmtok.inspect import inspect_path

    codec = None
    if args.render:
        if not (args.codec and args.checkpoint):
            raise MmtokError("--render needs --codec and --checkpoint")
        from mmtok.codecs.base import device_from_env, load_codec

        codec = load_codec(args.codec, args.checkpoint, device_from_env())
    print(inspect_path(args.path, limit=args.limit, text_tokenizer=args.text_tokenizer,
                       text_vocab_size=args.text_vocab_size, render_dir=args.render, codec=codec))
    return 0
