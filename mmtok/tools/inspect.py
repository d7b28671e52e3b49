"""`mmtok inspect`: say what a manifest, a plan, an encode output or a Megatron dataset holds.

Datasets are shown document by document: text decoded with the text tokenizer, image blocks as
`<image HxW codes>`, audio blocks as `<audio N codes = S s>`, with optional rendering of the blocks
to PNG/WAV through a codec's decoder.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats import interleave, megatron, merged, partdir
from mmtok.fsutil import required
from mmtok.vocab import VocabLayout

AUDIO_CODES_PER_SECOND = 40


def inspect_path(path: str, *, limit: int = 3, text_tokenizer: str | None = None, text_vocab_size: int | None = None,
                 render_dir: str | None = None, codec=None) -> str:
    """A human-readable report of whatever `path` is."""
    from mmtok.formats.manifest import METADATA_FILE as MANIFEST  # Arrow-backed: imported when asked for
    from mmtok.formats.plan import META_FILE as PLAN

    target = Path(path)
    if (target / MANIFEST).is_file():
        return describe_manifest(target, limit)
    if (target / PLAN).is_file():
        return describe_plan(target)
    if partdir.parts_root(target).is_dir():
        return describe_encode_output(target)
    prefix = _dataset_prefix(target)
    if prefix is not None:
        return describe_dataset(prefix, limit=limit, text_tokenizer=text_tokenizer, text_vocab_size=text_vocab_size,
                                render_dir=render_dir, codec=codec)
    for candidate in (target, target.with_suffix("")):
        reason = interleave.not_written_reason(candidate) or merged.not_written_reason(candidate)
        if reason:
            raise MmtokError(f"{path}: no dataset here: {reason}")
    raise MmtokError(f"{path}: not a manifest dir, plan dir, encode output dir or Megatron dataset (.bin/.idx)")


def recorded_tokenizer(prefix: Path) -> tuple[str, Path] | None:
    """The text tokenizer the dataset at `prefix` was made with, as its metadata records it -- a merge output's
    merged.json, or the identity.json of the part whose tokens it is -- with the file that records it, when it
    still loads with the recorded checksum. A file of the wrong shape is a DamagedFile naming it and the key."""
    from mmtok.text import BUILTIN_TEKKEN, builtin_tekken_path, load_text_tokenizer

    summary = merged.SUMMARY_FILE.path(prefix.parent)
    if summary.is_file():
        path = summary
        identity = required(merged.SUMMARY_FILE.read(prefix.parent) or {}, "identity", dict, path, default={})
    elif (prefix.parent / partdir.IDENTITY).is_file() and prefix.name == partdir.part_prefix(prefix.parent).name:
        path, identity = prefix.parent / partdir.IDENTITY, partdir.read_identity(prefix.parent)
    else:
        return None
    recorded = required(identity, "text_tokenizer", dict, path, default={})
    name, sha256 = (required(recorded, key, str, path, default=None) for key in ("name", "sha256"))
    if name is None:
        return None
    if name == builtin_tekken_path().name:
        name = BUILTIN_TEKKEN  # a tekken tokenizer records its file's name: the built-in one's is known
    try:
        return (name, path) if load_text_tokenizer(name).fingerprint == sha256 else None
    except (OSError, MmtokError):  # moved or changed since it was recorded: the caller falls back
        return None


def _dataset_prefix(target: Path) -> Path | None:
    for prefix in (target, target.with_suffix("")):
        if megatron.idx_path(prefix).is_file() and megatron.bin_path(prefix).is_file():
            return prefix
    return None


def describe_manifest(directory: Path, limit: int) -> str:
    from mmtok.formats.manifest import Manifest

    manifest = Manifest.open(directory)
    table = manifest.read(columns=["key", "format", "width", "height", "status", "reason", "size"])
    status = Counter(table.column("status").to_pylist())
    reasons = Counter(r for r in table.column("reason").to_pylist() if r)
    formats = Counter(table.column("format").to_pylist())
    lines = [f"manifest {directory}: {table.num_rows} rows ({status.get('ok', 0)} ok)",
             "formats: " + ", ".join(f"{k or '?'}={v}" for k, v in formats.most_common()),
             "reasons: " + (", ".join(f"{k}={v}" for k, v in reasons.most_common()) or "none")]
    if table.num_rows:
        ok = np.asarray(table.column("status").to_pylist()) == "ok"
        pixels = np.asarray(table.column("width"), np.int64) * np.asarray(table.column("height"), np.int64)
        if ok.any():
            lines.append(f"pixels (ok rows): median {int(np.median(pixels[ok]))}, max {int(pixels[ok].max())}")
    lines.append(f"fingerprint: {manifest.fingerprint}")
    for row in table.slice(0, limit).to_pylist():
        lines.append(f"  {row}")
    return "\n".join(lines)


def describe_plan(directory: Path) -> str:
    try:
        from mmtok.tools.explain import explain_plan
    except ImportError:
        from mmtok.formats.plan import Plan

        meta = Plan.open(directory).meta.to_json()
        keys = ("num_batches", "world_size", "imbalance", "totals")
        return "\n".join(f"{key}: {meta[key]}" for key in keys)
    return explain_plan(directory)


def describe_encode_output(directory: Path) -> str:
    parts = [part for _, part in partdir.part_directories(directory)]
    lines = [f"encode output {directory}: {len(parts)} part directories"]
    for part in parts:
        state = "DONE" if partdir.is_done(part) else "in progress"
        detail = ""
        if (part / partdir.STATS).is_file():
            stats = partdir.read_stats(part)
            state += "" if stats.get("dataset", True) else " (no tokens: no dataset)"
            detail = ", ".join(f"{k}={v}" for k, v in sorted(stats.get("counts", {}).items()))
        lines.append(f"  {part.name}: {state} {detail}")
    for name in (merged.MERGED, merged.NO_REASONING):
        if megatron.idx_path(directory / name).is_file():
            _, lengths, _, _ = megatron.read_index(directory / name)
            lines.append(f"{name}: {len(lengths)} sequences, {int(lengths.sum())} tokens")
        elif reason := merged.not_written_reason(directory / name):
            lines.append(f"{name}: not written: {reason}")
    return "\n".join(lines)


def describe_dataset(prefix: Path, *, limit: int, text_tokenizer: str, text_vocab_size: int | None,
                     render_dir: str | None, codec) -> str:
    from mmtok.text import load_text_tokenizer

    recorded = None if text_tokenizer else recorded_tokenizer(prefix)
    tokenizer = load_text_tokenizer(text_tokenizer or (recorded[0] if recorded else "tekken"))
    source = ("--text-tokenizer" if text_tokenizer else f"recorded in {recorded[1]}" if recorded else
              "the default: no loadable tokenizer recorded; pass --text-tokenizer")
    layout = VocabLayout(text_vocab_size or tokenizer.vocab_size)
    dtype, lengths, _, _ = megatron.read_index(prefix)
    lines = [f"dataset {prefix}: {len(lengths)} sequences, {int(lengths.sum())} tokens, dtype {dtype.name}, "
             f"text vocabulary {layout.text_size}",
             f"text tokenizer: {tokenizer.name} ({source})"]
    if len(lengths):
        lines.append(f"sequence length: min {int(lengths.min())}, mean {lengths.mean():.1f}, max {int(lengths.max())}")
    for number, tokens in enumerate(megatron.read_sequences(prefix)):
        if number >= limit:
            break
        lines.append(f"--- sequence {number} ({len(tokens)} tokens)")
        _check_ids(prefix, number, tokens, layout)
        try:
            lines.append(render_sequence(tokens, layout, tokenizer))
        except ValueError as err:  # the ids do not parse in this layout: most likely another text tokenizer
            raise MmtokError(f"{prefix}: sequence {number} does not parse with text tokenizer {tokenizer.name} "
                             f"(text vocabulary {layout.text_size}): {err}; pass the --text-tokenizer the data was "
                             "made with") from None
        if render_dir and codec is not None:
            lines.extend(render_blocks(tokens, layout, codec, Path(render_dir), number))
    return "\n".join(lines)


def _check_ids(prefix: Path, number: int, tokens: np.ndarray, layout: VocabLayout) -> None:
    """Refuse a sequence holding an id outside the layout (a damaged .bin, or another vocabulary) in one line,
    before a tokenizer library is handed it (tiktoken and mistral_common raise tracebacks on such ids)."""
    bad = (tokens < 0) | (tokens >= layout.total_size)
    if bad.any():
        raise MmtokError(f"{megatron.bin_path(prefix)}: sequence {number} holds {int(bad.sum())} id(s) outside the "
                         f"vocabulary [0, {layout.total_size}) (min {int(tokens.min())}, max {int(tokens.max())}): the "
                         "file is damaged, or the data was made with another text tokenizer -- pass its "
                         "--text-tokenizer / --text-vocab-size, or rerun the stage that wrote it")


def render_sequence(tokens: np.ndarray, layout: VocabLayout, tokenizer) -> str:
    """One line per segment: decoded text, `<image HxW codes>`, `<audio N codes = S s>`."""
    specials = {v: k for k, v in layout.special_ids().items()}
    parts = []
    for segment in layout.split_sequence(tokens):
        if segment[0] == "text":
            words, run = [], []
            for token in [int(t) for t in segment[1]] + [None]:
                if token is not None and token not in specials:
                    run.append(token)
                    continue
                if run:
                    words.append(repr(tokenizer.decode(run)))
                    run = []
                if token is not None:
                    words.append(specials[token])
            parts.append(" ".join(words))
        elif segment[0] == "image":
            height, width = segment[1].shape
            parts.append(f"<image {height}x{width} codes, dims {tokenizer.decode(segment[2].tolist())!r}>")
        else:
            count = len(segment[1])
            parts.append(f"<audio {count} codes = {count / AUDIO_CODES_PER_SECOND:.2f} s>")
    return "\n".join(parts)


def render_blocks(tokens: np.ndarray, layout: VocabLayout, codec, out_dir: Path, number: int) -> list[str]:
    """Decode the sequence's image blocks (PNG) or audio blocks (WAV) with `codec` into `out_dir`."""
    import torch

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    device = codec.device
    blocks = [s for s in layout.split_sequence(tokens) if s[0] == codec.modality]
    for index, block in enumerate(blocks):
        codes = torch.from_numpy(np.asarray(block[1], np.int64)[None]).to(device)
        with torch.inference_mode():
            decoded = codec.decode(codes).float().cpu().numpy()[0]
        if codec.modality == "image":
            from PIL import Image

            path = out_dir / f"seq{number:06d}_image{index}.png"
            pixels = np.clip((decoded.transpose(1, 2, 0) + 1.0) * 127.5, 0, 255).round().astype(np.uint8)
            Image.fromarray(pixels).save(path)
        else:
            import soundfile

            path = out_dir / f"seq{number:06d}_audio{index}.wav"
            soundfile.write(path, decoded, codec.sample_rate, subtype="FLOAT")
        written.append(f"  rendered {path}")
    return written


# -- `inspect --megatron`: the training arguments for datasets -------------------------------------
VOCAB_DIVISIBLE_BY = 128  # --make-vocab-size-divisible-by (Megatron-LM's default)
TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)
LONGEST_WHOLE_SAMPLE = 32_768  # above this, advise the 8,192-token stage length instead of the longest document
STAGE_SEQ_LENGTH = interleave.STAGE_MAX_TOKENS  # the stage set's longest sequence (`mmtok audio interleave`)


@dataclass(frozen=True)
class Recipe:
    """What `inspect --megatron` found: `text` is the argument block and its `#` lines; `warnings` are the
    problems a run with these arguments would meet (also in `text`, as `# warning:` lines)."""

    text: str
    warnings: list[str]


def megatron_recipe(paths: list[str], *, weights: list[float] | None = None, tokenizer: str | None = None,
                    seq_length: int | None = None, train_tokens: int | None = None) -> Recipe:
    """The Megatron-LM arguments that train on the datasets at `paths`, then `#` lines that explain them.

    The argument block is shell-ready (one argument per line, joined by backslashes). `seq_length` replaces the
    advised --seq-length; `train_tokens` (the run's token budget) adds --train-samples and the epochs of each
    dataset the blend implies. Refused with MmtokError: a path that is no dataset, datasets of different layouts,
    weights that do not match the paths, a budget or length below 1, and a `tokenizer` directory that
    `mmtok tokenizer check` does not pass for these datasets.
    """
    prefixes = [_require_prefix(path) for path in paths]
    metas = _checked_metadata(prefixes, weights, tokenizer, seq_length, train_tokens)
    lengths = [megatron.read_index(prefix)[1] for prefix in prefixes]
    layout = VocabLayout(metas[0]["vocab"]["text_size"])
    advised, advice = advise_seq_length(np.concatenate(lengths))
    seq_length, seq_note = (advised, advice) if seq_length is None else (seq_length, f"as given (advised: {advised:,})")
    split, split_note = advise_split([len(part) for part in lengths])
    data = [str(prefix.resolve()) for prefix in prefixes]
    data_path = " ".join(f"{w:g} {p}" for w, p in zip(weights, data, strict=True)) if weights else " ".join(data)
    arguments = [f"--data-path {data_path}", f"--split {split}", "--tokenizer-type HuggingFaceTokenizer",
                 f"--tokenizer-model {Path(tokenizer).resolve() if tokenizer else 'TOKENIZER_DIR'}",
                 f"--make-vocab-size-divisible-by {VOCAB_DIVISIBLE_BY}", f"--seq-length {seq_length}"]
    tokens = [int(part.sum()) for part in lengths]
    warnings = short_dataset_warnings(prefixes, tokens, seq_length, blended_by_size=weights is None and len(paths) > 1)
    notes = []
    if train_tokens is not None:
        train_samples = -(-train_tokens // seq_length)
        arguments.append(f"--train-samples {train_samples}")
        epoch_notes, epoch_warnings = budget_epochs(prefixes, tokens, weights, seq_length, train_samples)
        notes += epoch_notes
        warnings += epoch_warnings
    lines = [f"# Megatron-LM data and tokenizer arguments for {len(prefixes)} mmtok dataset(s)",
             " \\\n".join(arguments),
             *_recipe_notes(prefixes, metas, lengths, layout, weights, tokenizer, seq_note, split_note), *notes,
             *(f"# warning: {warning}" for warning in warnings)]
    return Recipe("\n".join(lines), warnings)


def _checked_metadata(prefixes: list[Path], weights, tokenizer, seq_length, train_tokens) -> list[dict]:
    """Each dataset's metadata, once the recipe's inputs are checked (see `megatron_recipe`)."""
    from mmtok.tools.tokenizer import check_tokenizer, dataset_metadata

    if weights is not None and (len(weights) != len(prefixes) or min(weights) <= 0):
        raise MmtokError(f"--weights needs one positive weight per dataset ({len(prefixes)}), got {weights}")
    for flag, value in (("--seq-length", seq_length), ("--train-tokens", train_tokens)):
        if value is not None and value < 1:
            raise MmtokError(f"{flag} must be at least 1, got {value}")
    metas = [dataset_metadata(prefix) for prefix in prefixes]
    sizes = {(meta["vocab"]["text_size"], meta["vocab"].get("total_size")) for meta in metas}
    if len(sizes) > 1:
        raise MmtokError(f"the datasets use different vocabulary layouts {sorted(sizes)}: one model trains on one "
                         "layout -- encode them with the same text tokenizer")
    if tokenizer:
        problems, _ = check_tokenizer(tokenizer, [str(p) for p in prefixes])
        if problems:
            raise MmtokError(f"tokenizer {tokenizer} does not fit the data: {problems[0]} ({len(problems)} problem(s); "
                             f"`mmtok tokenizer check {tokenizer} --data PREFIX` lists them all)")
    return metas


def samples_per_epoch(tokens: int, seq_length: int) -> int:
    """The samples megatron-core's GPTDataset cuts from one pass over `tokens` tokens: each takes --seq-length + 1
    tokens, its last one shared with the next sample (`add_extra_token_to_sequence`)."""
    return max(tokens - 1, 0) // seq_length


def short_dataset_warnings(prefixes: list[Path], tokens: list[int], seq_length: int, *,
                           blended_by_size: bool) -> list[str]:
    """One warning per dataset that holds fewer tokens than one sample (--seq-length + 1)."""
    warnings = []
    for prefix, count in zip(prefixes, tokens, strict=True):
        if samples_per_epoch(count, seq_length):
            continue
        what = (f"{prefix} holds {count:,} tokens, fewer than one sample (--seq-length + 1 = {seq_length + 1:,}), "
                "so megatron-core cuts no sample from one pass over it")
        if blended_by_size:
            warnings.append(f"{what}; a blend without --weights weighs each dataset by those samples, so building it "
                            "fails (AssertionError in megatron-core's BlendedDataset) -- give --weights, a smaller "
                            "--seq-length, or leave the dataset out")
        else:
            warnings.append(f"{what}: every sample drawn from it repeats it whole -- blend it with more data, give a "
                            "smaller --seq-length, or leave it out")
    return warnings


def budget_epochs(prefixes: list[Path], tokens: list[int], weights: list[float] | None, seq_length: int,
                  train_samples: int) -> tuple[list[str], list[str]]:
    """The `#` lines that say how many epochs of each dataset a run of `train_samples` samples draws (share of the
    blend x the tokens the blend serves / dataset tokens), and the warnings: datasets repeated, or the blend
    running out.

    With weights, megatron-core starts a new shuffled epoch of a dataset whenever one ends, so the mixture holds to
    the end of the run; without weights it blends several datasets by their samples per epoch and builds one epoch
    of each, so the blend runs out when they do."""
    train_tokens = train_samples * seq_length
    per_epoch = [samples_per_epoch(count, seq_length) for count in tokens]
    if weights is None and len(prefixes) > 1:
        shares = [count / max(sum(per_epoch), 1) for count in per_epoch]
        served = min(train_samples, sum(per_epoch))
    else:
        shares = [w / sum(weights) for w in weights] if weights else [1.0]
        served = train_samples
    served_note = (f", of which the blend serves {served:,} samples = {served * seq_length:,} tokens"
                   if served < train_samples else "")
    notes = [f"# epochs: --train-samples {train_samples:,} of --seq-length {seq_length:,} = {train_tokens:,} train "
             f"tokens{served_note}; each dataset's epochs = its share of the blend x the tokens served / its tokens"]
    warnings = []
    for prefix, count, share in zip(prefixes, tokens, shares, strict=True):
        epochs = share * served * seq_length / max(count, 1)
        unused = f" -- {1 - epochs:.0%} of its tokens never train" if epochs < 1 else ""
        notes.append(f"#   {prefix}: share {share:.3f}, {count:,} tokens: {epochs:,.2f} epochs{unused}")
        if epochs > 1:
            warnings.append(f"{prefix} is repeated: {epochs:,.2f} epochs, its first pass ends at {1 / epochs:.1%} of "
                            "the run (megatron-core then reshuffles and repeats it, keeping the mixture; a loader that "
                            "does not repeat would drop it there and shift the mixture to the others)")
    if served < train_samples:
        warnings.append(f"without --weights megatron-core builds one epoch of each dataset: the blend holds "
                        f"{served:,} samples, so the data runs out at {served / train_samples:.1%} of the "
                        f"{train_samples:,} samples asked for -- give --weights to repeat the datasets")
    return notes, warnings


def _recipe_notes(prefixes, metas, lengths, layout: VocabLayout, weights, tokenizer, seq_note: str,
                  split_note: str) -> list[str]:
    padded = ", ".join(f"{_padded(layout.total_size, tp):,} at TP {tp}" for tp in TENSOR_PARALLEL_SIZES)
    notes = [f"# data: {prefix}: {len(part):,} documents, {int(part.sum()):,} tokens, longest {int(part.max()):,}"
             for prefix, part in zip(prefixes, lengths, strict=True)]
    if len(metas) > 1:
        notes.append("# --data-path: weights are normalized by Megatron" if weights else
                     "# --data-path: no weights given, so Megatron blends the datasets by their sizes")
    notes += [
        f"# vocabulary: {layout.total_size:,} ids = {layout.text_size:,} text + "
        f"{layout.image_offset - layout.text_size} omni-special + {layout.image_codebook:,} image + "
        f"{layout.audio_codebook:,} audio; Megatron pads the embedding to a multiple of {VOCAB_DIVISIBLE_BY} x "
        f"--tensor-model-parallel-size: {padded} (the padding ids never occur in the data)",
        f"# --seq-length: {seq_note}",
        "# samples: megatron-core's GPTDataset shuffles the documents, concatenates them (each mmtok document ends "
        "with EOS, the tokenizer's eos_token, which Megatron uses as eod) and cuts samples of --seq-length + 1 tokens "
        "straight across document boundaries: a document longer than --seq-length continues in the next sample, and "
        "a sample may end inside an image or audio block; --reset-position-ids --reset-attention-mask keep the "
        "documents that share a sample apart",
        f"# --split: {split_note}",
    ]
    if tokenizer:
        notes.append(f"# tokenizer: {tokenizer} passes `mmtok tokenizer check` for these datasets")
    else:
        notes.append(f"# TOKENIZER_DIR: run `mmtok tokenizer build --text-tokenizer {_text_spec(metas[0])} --out "
                     "TOKENIZER_DIR`, then pass it with --tokenizer to check it against the data")
    return notes


def advise_seq_length(lengths: np.ndarray) -> tuple[int, str]:
    """A --seq-length for documents of `lengths` and why: the power of two (at least 1,024) that holds the longest
    document, or the 8,192-token stage length when that would exceed 32,768."""
    longest = int(lengths.max())
    whole = max(1024, 1 << max(longest - 1, 1).bit_length())
    if whole <= LONGEST_WHOLE_SAMPLE:
        return whole, f"no document is longer than one sample (longest {longest:,} tokens)"
    over = lengths > STAGE_SEQ_LENGTH
    share = lengths[over].sum() / lengths.sum()
    return STAGE_SEQ_LENGTH, (f"{int(over.sum()):,} documents ({share:.1%} of the tokens, longest {longest:,}) are "
                              f"longer and continue over several samples; a long-context stage with a larger "
                              "--seq-length keeps them whole")


def advise_split(documents: list[int]) -> tuple[str, str]:
    """A --split for datasets of `documents` documents each and why."""
    if min(documents) >= 100:
        return "99,1,0", ("Megatron gives each dataset's last 1% of documents (in file order, i.e. corpus order) to "
                          "validation; mmtok writes no separate validation set")
    return "100,0,0", (f"a dataset has only {min(documents)} documents, so a 1% validation split would be empty; "
                       "every document trains")


def _padded(size: int, tensor_parallel: int) -> int:
    multiple = VOCAB_DIVISIBLE_BY * tensor_parallel
    return -(-size // multiple) * multiple


def _require_prefix(path: str) -> Path:
    prefix = _dataset_prefix(Path(path))
    if prefix is None:
        raise MmtokError(f"{path}: not a Megatron dataset (pass a prefix such as OUT/merged, or its .bin/.idx)")
    return prefix


def _text_spec(meta: dict) -> str:
    from mmtok.text import BUILTIN_TEKKEN, builtin_tekken_path

    name = meta["text_tokenizer"].get("name", "T")
    return BUILTIN_TEKKEN if name == builtin_tekken_path().name else name
