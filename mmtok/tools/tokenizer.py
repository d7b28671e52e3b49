"""The omnimodal Hugging Face tokenizer: mmtok's vocabulary layout as a `tokenizers` directory.

`build_tokenizer` extends a text tokenizer into one whose ids are exactly `VocabLayout`'s:

    0 … T-1                 the text tokenizer's own tokens, ids unchanged (T = its vocabulary size)
    T … T+199               OMNI_SPECIAL_TOKENS by name; the free slots named `<|omni_reserved_N|>` (N = slot)
    image_offset + i        `<|visual token i|>`  (image code i)
    audio_offset + i        `<|audio token i|>`   (audio code i)

The code-token names are those of the public swiss-ai/apertus-omni-tokenizer, so both tools name an id alike.
Every omni token is an added token with special=True: matched as one token in text, dropped by
`skip_special_tokens`. The aliases `<image>`/`<audio>` are Replace rules at the front of the normalizer,
and their targets are matched on normalized text, so `<image>` encodes to the id of `<|image|>`.

A tekken base (mistral-common) is converted to a byte-level BPE with the same ids: its encoding of text
equals mmtok's TextTokenizer's, except that the converted tokenizer -- like every HF tokenizer -- turns the
name of a control token written in the text (`<s>`, `[INST]`) into that token, where tekken's own
encoder reads it as plain characters.

tokenizer_config.json holds every key of the released Apertus 1.5 one (tests/data/apertus_1p5_tokenizer), with
its values when the base has the release's text vocabulary, and mmtok's additions (docs/training.md lists them).

`check_tokenizer` compares a tokenizer directory with the datasets mmtok wrote (`mmtok merge`,
`mmtok audio interleave`): the layout, the structure and text special ids, and every id on disk.
`compare_tokenizers` compares it with another tokenizer directory, key by key and id by id.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok import __version__
from mmtok.errors import MmtokError, brief
from mmtok.formats import interleave, megatron, merged
from mmtok.fsutil import atomic_write_bytes, atomic_write_json, read_json_object, required
from mmtok.text import (
    CHAT_TEMPLATE_FILE,
    CONFIG_JSON,
    TekkenTokenizer,
    TextTokenizer,
    check_contiguous,
    load_text_tokenizer,
    read_chat_template,
    tokenizer_difference,
    tokenizer_file,
)
from mmtok.vocab import OMNI_SPECIAL_BLOCK, OMNI_SPECIAL_TOKENS, TOKEN_ALIASES, VocabLayout

TOKENIZER_JSON = "tokenizer.json"
SPECIAL_MAP_JSON = "special_tokens_map.json"
IMAGE_CODE_TOKEN = "<|visual token {i}|>"
AUDIO_CODE_TOKEN = "<|audio token {i}|>"
RESERVED_TOKEN = "<|omni_reserved_{i}|>"
ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
CODEC_SECTIONS = {"image": "vision_tokenizer", "audio": "audio_tokenizer"}  # tokenizer_config.json keys
# Keys of the released Apertus 1.5 tokenizer_config.json (tests/data/apertus_1p5_tokenizer) that no base
# decides, with the release's values; a base's own value wins.
RELEASE_DEFAULTS = {"add_prefix_space": False, "clean_up_tokenization_spaces": False, "extra_special_tokens": {},
                    "model_input_names": ["input_ids", "attention_mask"], "model_max_length": int(1e30),
                    "padding_side": "left"}
# The release's SFT boundary keys (read by the swiss-ai Megatron-LM fork) and the chat token each one names.
SFT_SEQUENCES = {"sft_user_begin_sequence": "<|user_start|>", "sft_assistant_begin_sequence": "<|assistant_start|>",
                 "sft_eot_token": "<|assistant_end|>"}
# The release's span keys: key -> the structure token it names.
SPAN_TOKENS = {"vision_begin_token": "<|img_start|>", "vision_end_token": "<|img_end|>",
               "audio_begin_token": "<|audio_start|>", "audio_end_token": "<|audio_end|>"}
ADDED_TOKEN_FLAGS = ("special", "normalized", "lstrip", "rstrip", "single_word")
DIFFERENCES_SHOWN = 20  # token differences printed per kind by `check --against`; all are counted


def omni_token_names(layout: VocabLayout) -> list[str]:
    """The names of ids layout.text_size … layout.total_size - 1, in id order: one per id, no gap."""
    reserved = [RESERVED_TOKEN.format(i=slot) for slot in range(len(OMNI_SPECIAL_TOKENS), OMNI_SPECIAL_BLOCK)]
    return [*OMNI_SPECIAL_TOKENS, *reserved,
            *(IMAGE_CODE_TOKEN.format(i=code) for code in range(layout.image_codebook)),
            *(AUDIO_CODE_TOKEN.format(i=code) for code in range(layout.audio_codebook))]


def code_token_ids(layout: VocabLayout) -> dict[str, int]:
    """Named structure tokens and every code token with its layout id (reserved slots excluded)."""
    ids = layout.special_ids()
    ids.update({IMAGE_CODE_TOKEN.format(i=code): layout.image_offset + code for code in range(layout.image_codebook)})
    ids.update({AUDIO_CODE_TOKEN.format(i=code): layout.audio_offset + code for code in range(layout.audio_codebook)})
    return ids


# -- the base text tokenizer -----------------------------------------------------------------------
@dataclass
class Base:
    """A text tokenizer ready to extend: its `tokenizers` object and the files around it to keep."""

    tokenizer: object  # tokenizers.Tokenizer
    config: dict  # tokenizer_config.json keys kept (roles, chat template, ...)
    special_tokens_map: dict
    chat_template_file: Path | None
    text: TextTokenizer  # mmtok's view: vocabulary size, fingerprint, BOS/EOS


def load_base(spec: str) -> Base:
    """The base tokenizer named by `spec` (anything `load_text_tokenizer` accepts), with contiguous ids 0 … T-1."""
    from tokenizers import Tokenizer

    text = load_text_tokenizer(spec)
    if isinstance(text, TekkenTokenizer):
        tekken = text._tok  # the mistral-common Tekkenizer that mmtok encodes with
        tokenizer, roles = tekken_to_hf(tekken), tekken_roles(tekken)
        base = Base(tokenizer, dict(roles), dict(roles), None, text)
    else:
        path = Path(text.name)  # an HFTokenizer is named by its tokenizer.json
        config = _read_json(path.with_name(CONFIG_JSON))
        tokenizer = Tokenizer.from_file(str(tokenizer_file(path)))
        roles = {"bos_token": text.token_text(text.bos_id), "eos_token": text.token_text(text.eos_id)}
        if tokenizer.token_to_id("<pad>") is not None:
            roles["pad_token"] = "<pad>"  # the release names a pad token; a base's own pad_token wins
        roles.update({role: config[role] for role in ROLES if role in config})
        config = {**config, **roles}
        template = tokenizer_file(path.with_name(CHAT_TEMPLATE_FILE))
        base = Base(tokenizer, config, _read_json(path.with_name(SPECIAL_MAP_JSON)) or roles,
                    template if template.is_file() else None, text)
    _check_base(base, spec)
    return base


def _check_base(base: Base, spec: str) -> None:
    vocab = base.tokenizer.get_vocab(with_added_tokens=True)
    check_contiguous(vocab.values(), base.text.vocab_size, spec)  # a tekken base: what its conversion made
    taken = [name for name in [*OMNI_SPECIAL_TOKENS, *TOKEN_ALIASES, IMAGE_CODE_TOKEN.format(i=0),
                               AUDIO_CODE_TOKEN.format(i=0)] if name in vocab]
    if taken:
        raise MmtokError(f"text tokenizer {spec} already has {taken[0]!r} (id {vocab[taken[0]]:,}): mmtok adds the "
                         "omni tokens after the text vocabulary -- build from the text-only base tokenizer")


def tekken_roles(tekken) -> dict[str, str]:
    """The role tokens (bos/eos/unk/pad) of a Tekkenizer, by name."""
    return {"bos_token": tekken.id_to_piece(tekken.bos_id), "eos_token": tekken.id_to_piece(tekken.eos_id),
            "unk_token": tekken.id_to_piece(tekken.unk_id), "pad_token": tekken.id_to_piece(tekken.pad_id)}


def tekken_to_hf(tekken):
    """A byte-level BPE `tokenizers.Tokenizer` with the ids and the text encoding of `tekken` (a Tekkenizer).

    Control tokens (ids below num_special_tokens) become special added tokens at their own ids; every
    other id keeps its bytes. tiktoken merges, again and again, the adjacent pair whose union has the lowest
    rank; so every split of a token into two vocabulary tokens is a merge, ordered by the token's rank, and
    `ignore_merges` gives a pre-token that is itself in the vocabulary its own id first, as tiktoken does.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = tekken.num_special_tokens
    ranks = {tekken.id_to_byte_piece(i): i for i in range(specials, tekken.n_words)}
    chars = byte_level_chars()

    def text(piece: bytes) -> str:
        return "".join(chars[byte] for byte in piece)

    vocab = {tekken.id_to_piece(i): i for i in range(specials)} | {text(piece): i for piece, i in ranks.items()}
    if len(vocab) != tekken.n_words:
        raise MmtokError(f"tekken {tekken.file_path}: a control token's name equals a text token's bytes; "
                         "it cannot be converted")
    merges = sorted((rank, ranks[piece[:cut]], ranks[piece[cut:]], cut, piece) for piece, rank in ranks.items()
                    for cut in range(1, len(piece)) if piece[:cut] in ranks and piece[cut:] in ranks)
    pattern = json.loads(Path(tekken.file_path).read_text("utf-8"))["config"]["pattern"]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[(text(p[:c]), text(p[c:])) for *_, c, p in merges],
                                     ignore_merges=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tekken.id_to_piece(i), special=True, normalized=False)
                                  for i in range(specials)])
    return tokenizer


def byte_level_chars() -> list[str]:
    """GPT-2's byte -> character table (what `tokenizers`' ByteLevel pre-tokenizer maps each byte to)."""
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, spare = [], 256
    for byte in range(256):
        if byte in printable:
            chars.append(chr(byte))
        else:
            chars.append(chr(spare))
            spare += 1
    return chars


# -- build -----------------------------------------------------------------------------------------
def build_tokenizer(text_spec: str, out: str | Path, *, image_codec: str | None = None,
                    audio_codec: str | None = None) -> dict:
    """Write the omnimodal tokenizer of `text_spec` into `out`; returns a summary.

    Checked before any file is written: every base token keeps its id, every omni token has its
    `VocabLayout` id, the ids are exactly 0 … total_size - 1, and `<image>`/`<audio>` encode to the ids
    of `<|image|>`/`<|audio|>`. Each file is replaced atomically.
    """
    from tokenizers import AddedToken

    from mmtok.codecs import registry

    chosen = {"image": image_codec or registry.DEFAULTS["image"], "audio": audio_codec or registry.DEFAULTS["audio"]}
    types = {kind: registry.of_modality(name, kind, f"--{kind}-codec").TOKENIZER_TYPE for kind, name in chosen.items()}
    started = time.monotonic()
    out = Path(out)
    base = load_base(text_spec)
    if (out / TOKENIZER_JSON).resolve() == Path(base.text.name).resolve():
        raise MmtokError(f"--out {out} is the base tokenizer's own directory: write the omnimodal one elsewhere")
    layout = VocabLayout(base.text.vocab_size)
    base_vocab = base.tokenizer.get_vocab(with_added_tokens=True)
    tokenizer = base.tokenizer
    with_aliases(tokenizer)
    aliased = set(TOKEN_ALIASES.values())
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=name in aliased)
                                  for name in omni_token_names(layout)])
    verify_ids(tokenizer, base_vocab, layout, text_spec)
    data = tokenizer.to_str().encode("utf-8")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / TOKENIZER_JSON, data)
    atomic_write_json(out / SPECIAL_MAP_JSON, base.special_tokens_map)
    _copy_chat_template(base.chat_template_file, out)
    atomic_write_json(out / CONFIG_JSON, tokenizer_config(base, base_vocab, layout, types))
    return {"out": str(out), "text_tokenizer": base.text.name, "text_size": layout.text_size,
            "total_size": layout.total_size, "tokenizer_json_bytes": len(data),
            "seconds": round(time.monotonic() - started, 2)}


def with_aliases(tokenizer) -> None:
    """Put Replace(alias, target) for every TOKEN_ALIASES entry in front of the tokenizer's normalizer."""
    from tokenizers import normalizers

    rules = [normalizers.Replace(alias, target) for alias, target in TOKEN_ALIASES.items()]
    if tokenizer.normalizer is not None:
        rules.append(tokenizer.normalizer)
    tokenizer.normalizer = normalizers.Sequence(rules)


def verify_ids(tokenizer, base_vocab: dict[str, int], layout: VocabLayout, spec: str) -> None:
    """Raise MmtokError unless `tokenizer` holds the base ids unchanged and every omni id where the layout puts it."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    problem = None
    if len(vocab) != layout.total_size:
        problem = f"{len(vocab):,} ids instead of {layout.total_size:,}"
    elif moved := next((name for name, i in base_vocab.items() if vocab.get(name) != i), None):
        problem = f"text token {brief(repr(moved))} moved from id {base_vocab[moved]:,} to {vocab.get(moved)}"
    elif wrong := next((n for i, n in enumerate(omni_token_names(layout), layout.text_size) if vocab.get(n) != i),
                       None):
        problem = f"{wrong!r} got id {vocab.get(wrong)} instead of its layout id"
    else:
        for alias, target in TOKEN_ALIASES.items():
            if tokenizer.encode(alias, add_special_tokens=False).ids != [layout.special_id(target)]:
                problem = f"the alias {alias} does not encode to {target}"
    if problem:
        raise MmtokError(f"building the omnimodal tokenizer from {spec}: {problem} -- the base tokenizer has "
                         "tokens this build does not expect; please report it with the base tokenizer attached")


def tokenizer_config(base: Base, base_vocab: dict[str, int], layout: VocabLayout, types: dict[str, str]) -> dict:
    """tokenizer_config.json: every key of the released Apertus 1.5 one (docs/training.md lists them), the base's
    own keys (roles, chat template), and mmtok's additions (structure_token_ids, the `mmtok` provenance).

    From a base with the release's text vocabulary the release's keys get the release's values: the roles come
    from the base, the SFT sequences are the ids of the base's Apertus chat tokens (absent from a base without
    them), everything else follows from the layout. `types`: the image and audio codecs' TOKENIZER_TYPE.
    """
    # added_tokens_decoder would list the base's added tokens only; tokenizer.json holds them all
    config = {key: value for key, value in base.config.items() if key != "added_tokens_decoder"}
    return {
        **RELEASE_DEFAULTS,
        **config,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": layout.text_size,  # as the release: the text vocabulary (len(tokenizer) is total_size)
        "added_tokens_count": layout.total_size - layout.text_size,
        **{key: [base_vocab[name]] for key, name in SFT_SEQUENCES.items() if name in base_vocab},
        **{key: [layout.special_id(name)] for key, name in SPAN_TOKENS.items()},
        **layout.omnimodal_config(structure=True),
        CODEC_SECTIONS["image"]: {"type": types["image"], "codebook_size": layout.image_codebook},
        CODEC_SECTIONS["audio"]: {"type": types["audio"], "codebook_size": layout.audio_codebook},
        "mmtok": {"version": __version__, "base_tokenizer": base.text.describe(),
                  "content_tokens": {"vision": IMAGE_CODE_TOKEN, "audio": AUDIO_CODE_TOKEN},
                  "reserved_token": RESERVED_TOKEN, "aliases": dict(TOKEN_ALIASES)},
    }


def _copy_chat_template(source: Path | None, out: Path) -> None:
    target = out / CHAT_TEMPLATE_FILE
    if source is None:
        target.unlink(missing_ok=True)  # a template left from an earlier build would be read by transformers
    else:
        atomic_write_bytes(target, source.read_bytes())


def _read_json(path: Path) -> dict:
    """A JSON object file of a tokenizer directory ({} when absent)."""
    return read_json_object(tokenizer_file(path)) or {}


# -- check -----------------------------------------------------------------------------------------
def _no_tokenizer(directory: Path, wanted: str) -> str:
    """The refusal for a path that is not a tokenizer directory: missing, not a directory, or without one."""
    what = ("does not exist" if not directory.exists() else "is not a directory" if not directory.is_dir()
            else f"has no {TOKENIZER_JSON}")
    return f"{directory}: {what} -- pass {wanted}"


def read_tokenizer(directory: str | Path) -> tuple[object, dict]:
    """The `tokenizers.Tokenizer` and the tokenizer_config.json of a tokenizer directory."""
    from tokenizers import Tokenizer

    directory = Path(directory)
    if not tokenizer_file(directory / TOKENIZER_JSON).is_file():
        raise MmtokError(_no_tokenizer(directory, "a directory written by `mmtok tokenizer build`"))
    config = _read_json(directory / CONFIG_JSON)
    if not isinstance(config.get("base_vocab_size"), int):
        raise MmtokError(f"{directory / CONFIG_JSON}: no base_vocab_size, so not an omnimodal tokenizer -- "
                         "build one with `mmtok tokenizer build`")
    try:
        return Tokenizer.from_file(str(directory / TOKENIZER_JSON)), config
    except Exception as err:  # the tokenizers library raises plain Exceptions for a damaged file
        raise MmtokError(f"{directory / TOKENIZER_JSON}: not a readable tokenizer ({brief(err)}); rebuild it with "
                         "`mmtok tokenizer build`") from None


def dataset_metadata(prefix: str | Path) -> dict:
    """What mmtok recorded about the dataset at `prefix`: `vocab`, `text_tokenizer`, `codec` and, for image
    data, `text_special_ids` -- from OUT/merged.json (`mmtok merge`) or OUT/interleave.json
    (`mmtok audio interleave`)."""
    prefix = Path(prefix)
    if not (megatron.idx_path(prefix).is_file() and megatron.bin_path(prefix).is_file()):
        raise MmtokError(f"{prefix}: no {prefix.name}.bin/.idx -- pass a dataset prefix such as OUT/merged")
    recorded = _recorded_layout(prefix.parent)
    if recorded is None:
        raise MmtokError(f"{prefix}: no {merged.SUMMARY} or {interleave.METADATA} next to it, so its layout is "
                         "unknown -- pass a dataset written by `mmtok merge` (OUT/merged) or `mmtok audio interleave` "
                         "(OUT/stage)")
    path, meta = recorded
    vocab = required(meta, "vocab", dict, path)
    required(vocab, "text_size", int, path)
    return {"file": str(path), "vocab": vocab,
            **{key: required(meta, key, dict, path, default={})
               for key in ("text_tokenizer", "codec", "text_special_ids")}}


def _recorded_layout(directory: Path) -> tuple[Path, dict] | None:
    """(file, what it records about the datasets) of the merge summary in `directory` or, without one, of its
    interleave summary."""
    summary = merged.SUMMARY_FILE.read(directory)
    if summary is not None:
        path = merged.SUMMARY_FILE.path(directory)
        return path, required(summary, "identity", dict, path, default={})
    metadata = interleave.METADATA_FILE.read(directory)
    return None if metadata is None else (interleave.METADATA_FILE.path(directory), metadata)


def check_tokenizer(directory: str | Path, datasets: list[str]) -> tuple[list[str], list[str]]:
    """Compare a tokenizer directory with datasets; returns (problems, one summary line per dataset).

    A problem is one line naming what differs and where. None means: the same layout, every structure and
    text special token at the id the data uses, and every id on disk inside the tokenizer's vocabulary.
    """
    tokenizer, config = read_tokenizer(directory)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    layout = VocabLayout(config["base_vocab_size"])
    problems = tokenizer_problems(vocab, config, layout, Path(directory))
    summaries = []
    for prefix in datasets:
        meta = dataset_metadata(prefix)
        different = layout_problems(meta, layout, prefix)  # then every omni id differs: one line says it
        problems += different or special_problems(meta, vocab, config, prefix)
        problems += provenance_problems(meta, config, prefix)
        found, summary = id_problems(prefix, len(vocab))
        problems += found
        summaries.append(summary)
    return problems, summaries


def tokenizer_problems(vocab: dict[str, int], config: dict, layout: VocabLayout, directory: Path) -> list[str]:
    """The tokenizer against its own base_vocab_size: size, named structure and code tokens, omnimodal_config."""
    problems = []
    if len(vocab) != layout.total_size:
        problems.append(f"tokenizer {directory}: {len(vocab):,} ids, but base_vocab_size {layout.text_size:,} "
                        f"makes the layout {layout.total_size:,}")
    expected = code_token_ids(layout)
    wrong = [name for name, i in expected.items() if vocab.get(name) != i]
    if wrong:
        problems.append(f"tokenizer {directory}: {len(wrong):,} structure/code tokens are not at their layout ids "
                        f"(first {wrong[0]!r}: {vocab.get(wrong[0])}, layout {expected[wrong[0]]:,})")
    if not _config_matches(config.get("omnimodal_config"), layout.omnimodal_config(structure=True)["omnimodal_config"]):
        problems.append(f"tokenizer {directory / CONFIG_JSON}: omnimodal_config differs from the layout of "
                        f"base_vocab_size {layout.text_size:,} -- rebuild it with `mmtok tokenizer build`")
    return problems


def _config_matches(actual, expected: dict) -> bool:
    """Whether `actual` states `expected`: the offsets and sizes always, the structure ids where it has them
    (tokenizers built by other tools may carry only the fields the Megatron-LM fork reads)."""
    if not isinstance(actual, dict) or actual.get("omni_special_token_offset") != expected["omni_special_token_offset"]:
        return False
    have = actual.get("modalities")
    required = ("name", "offset", "vocab_size")
    return (isinstance(have, list) and len(have) == len(expected["modalities"])
            and all(isinstance(h, dict) and all(h.get(k) == v for k, v in e.items() if k in h or k in required)
                    for h, e in zip(have, expected["modalities"], strict=True)))


def layout_problems(meta: dict, layout: VocabLayout, prefix) -> list[str]:
    """The dataset's recorded layout against the tokenizer's: no line, or one naming every value that differs."""
    keys = [key for key in ("text_size", "image_offset", "audio_offset", "total_size")
            if meta["vocab"].get(key) != getattr(layout, key)]
    if not keys:
        return []
    recorded = ", ".join(f"{key} {_number(meta['vocab'].get(key))}" for key in keys)
    have = ", ".join(f"{getattr(layout, key):,}" for key in keys)
    return [f"layout: dataset {prefix} has {recorded} ({meta['file']}), the tokenizer {have} -- build the tokenizer "
            f"from the text tokenizer the data was made with ({meta['text_tokenizer'].get('name', '?')})"]


def special_problems(meta: dict, vocab: dict[str, int], config: dict, prefix) -> list[str]:
    """Structure tokens, BOS/EOS and recorded text special tokens: the tokenizer's id for each name vs the data's."""
    recorded = meta["vocab"].get("special_tokens") or VocabLayout(meta["vocab"]["text_size"]).special_ids()
    recorded = dict(recorded, **meta["text_special_ids"])
    for role, key in (("bos_token", "bos_id"), ("eos_token", "eos_id")):
        name = _role_name(config.get(role))
        if name and key in meta["text_tokenizer"]:
            recorded[name] = meta["text_tokenizer"][key]
    return [f"token {brief(name)}: dataset {prefix} uses id {_number(i)}, the tokenizer has "
            f"{'no such token' if vocab.get(name) is None else f'id {vocab[name]:,}'}"
            for name, i in recorded.items() if vocab.get(name) != i]


def provenance_problems(meta: dict, config: dict, prefix) -> list[str]:
    """The base text tokenizer and the codec the tokenizer was built for against those the data was made with."""
    problems = []
    base = config.get("mmtok", {}).get("base_tokenizer")  # absent in tokenizers built by other tools
    data = meta["text_tokenizer"]
    difference = tokenizer_difference(data, base) if base and data.get("sha256") else None
    if difference:
        problems.append(f"text tokenizer: dataset {prefix} was made with another text tokenizer than the one this "
                        f"tokenizer was built from: {difference} -- rebuild it with --text-tokenizer set to the data's")
    codec = meta["codec"]
    section = config.get(CODEC_SECTIONS.get(codec.get("modality"), ""), {})
    if section.get("type") and codec.get("name") and section["type"].lower() != codec["name"].lower():  # "Emu3.5" too
        problems.append(f"codec: dataset {prefix} holds {codec['name']} codes, the tokenizer was built for "
                        f"{section['type']} -- rebuild it with --{codec['modality']}-codec {codec['name']}")
    return problems


def id_problems(prefix, vocab_size: int) -> tuple[list[str], str]:
    """Every id of the dataset inside [0, vocab_size): (problems, a summary line)."""
    dtype, lengths, _, _ = megatron.read_index(prefix)
    tokens = np.memmap(megatron.bin_path(prefix), dtype=dtype, mode="r") if lengths.sum() else np.zeros(0, dtype)
    low, high = id_range(tokens)
    summary = f"{prefix}: {len(lengths):,} sequences, {int(lengths.sum()):,} tokens, ids {low:,} … {high:,}"
    if low >= 0 and high < vocab_size:
        return [], summary
    position = int(np.flatnonzero((tokens < 0) | (tokens >= vocab_size))[0])
    sequence = int(np.searchsorted(np.cumsum(lengths, dtype=np.int64), position, side="right"))
    return [f"ids: dataset {prefix} holds id {int(tokens[position]):,} (sequence {sequence:,}), outside the "
            f"tokenizer's {vocab_size:,} ids"], summary


def id_range(tokens: np.ndarray, chunk: int = 1 << 24) -> tuple[int, int]:
    """(min, max) of `tokens`, read in chunks so a memory-mapped dataset is not loaded whole; (0, -1) when empty."""
    ranges = [(int(part.min()), int(part.max()))
              for part in (tokens[i : i + chunk] for i in range(0, len(tokens), chunk))]
    return (min(r[0] for r in ranges), max(r[1] for r in ranges)) if ranges else (0, -1)


def _role_name(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _number(value) -> str:
    return f"{value:,}" if isinstance(value, int) else "none"



# -- check against another tokenizer ---------------------------------------------------------------
def compare_tokenizers(directory: str | Path, reference: str | Path) -> tuple[list[str], int, str]:
    """Every difference between two tokenizer directories, one line each: their chat templates (the one
    transformers renders with: chat_template.jinja where there is one, else tokenizer_config.json's
    `chat_template`), the other tokenizer_config.json and special_tokens_map.json keys (nested keys by their
    path, `omnimodal_config.modalities[0].offset`), every token name's id, and every added token's flags
    (ADDED_TOKEN_FLAGS). A reference with a tokenizer_config.json and no tokenizer.json (a release's config,
    what users compare keys against) is compared by its files alone. The token lines of each kind stop after
    DIFFERENCES_SHOWN with one line counting the rest. Returns (lines, how many differences there are, what was
    compared): ([], 0, ...) when the two are equal."""
    here, there = _tokenizer_files(directory), _tokenizer_files(reference, config_alone=True)
    names = (Path(directory).name, Path(reference).name)
    if names[0] == names[1] or not all(names):
        names = (str(directory), str(reference))
    partial = there["vocab"] is None  # a release's config alone: what it does not hold is not compared
    lines = [] if partial and there["template"] is None else _template_difference(here, there, names)
    for file in (CONFIG_JSON, SPECIAL_MAP_JSON):
        if partial and file not in there["present"]:
            continue
        ours, theirs = ({k: v for k, v in files[file].items() if k != "chat_template"} for files in (here, there))
        lines += [f"{file} {key}: {what}" for key, what in value_differences(ours, theirs, names)]
    if partial:
        compared = ", ".join([*sorted(there["present"]), *(["the chat template"] if there["template"] else [])])
        return lines, len(lines), (f"key by key ({names[1]} holds no {TOKENIZER_JSON}: {compared} compared, no "
                                   "token ids)")
    vocab, ref_vocab = here["vocab"], there["vocab"]
    added, ref_added = here["added"], there["added"]

    def in_id_order(found: set[str]) -> list[str]:  # so the lines read as the vocabulary does
        return sorted(found, key=lambda name: (vocab.get(name, ref_vocab.get(name, -1)), name))

    ids = [f"token {brief(repr(name))}: {_id_in(vocab, name, names[0])}, {_id_in(ref_vocab, name, names[1])}"
           for name in in_id_order(vocab.keys() | ref_vocab.keys()) if vocab.get(name) != ref_vocab.get(name)]
    flags = [f"added token {brief(repr(name))}: {_flag_difference(added.get(name), ref_added.get(name), names)}"
             for name in in_id_order(added.keys() | ref_added.keys()) if added.get(name) != ref_added.get(name)]
    return ([*lines, *_shown("token ids", ids), *_shown("added tokens", flags)], len(lines) + len(ids) + len(flags),
            "key by key and id by id")


def value_differences(ours, theirs, names: tuple[str, str], key: str = "") -> list[tuple[str, str]]:
    """(key path, what differs) for every value of two JSON documents that differs: dictionaries key by key,
    lists of the same length item by item, anything else as a whole."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        found = []
        for name in sorted(ours.keys() | theirs.keys()):
            path = f"{key}.{name}" if key else name
            if name not in theirs or name not in ours:
                value, where = (ours[name], names[0]) if name in ours else (theirs[name], names[1])
                found.append((path, f"only in {where} ({brief(json.dumps(value, ensure_ascii=False), 80)})"))
            else:
                found += value_differences(ours[name], theirs[name], names, path)
        return found
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        return [found for i, (a, b) in enumerate(zip(ours, theirs, strict=True))
                for found in value_differences(a, b, names, f"{key}[{i}]")]
    if ours == theirs and type(ours) is type(theirs):
        return []
    shown = [brief(json.dumps(value, ensure_ascii=False), 80) for value in (ours, theirs)]
    return [(key, f"{shown[0]} in {names[0]}, {shown[1]} in {names[1]}")]


def _tokenizer_files(directory: str | Path, config_alone: bool = False) -> dict:
    """Of any Hugging Face tokenizer directory: `vocab` (every token name -> id, added tokens included) and
    `added` (added token name -> its flags) from tokenizer.json, read as JSON (loading a `tokenizers.Tokenizer`
    of 135,368 added tokens takes seconds); its tokenizer_config.json and special_tokens_map.json ({} when absent)
    and its chat template (`template`: the text and the file it came from, or None). With `config_alone`, a
    directory with a tokenizer_config.json and no tokenizer.json is read too (`vocab` and `added` None)."""
    directory = Path(directory)
    path = tokenizer_file(directory / TOKENIZER_JSON)
    config = tokenizer_file(directory / CONFIG_JSON)
    files = {CONFIG_JSON: _read_json(config), SPECIAL_MAP_JSON: _read_json(directory / SPECIAL_MAP_JSON),
             "template": _chat_template(directory), "vocab": None, "added": None,
             "present": {name for name in (CONFIG_JSON, SPECIAL_MAP_JSON) if (directory / name).is_file()}}
    if not path.is_file():
        if config_alone and config.is_file():
            return files
        raise MmtokError(_no_tokenizer(directory, "a Hugging Face tokenizer directory" +
                                       (f" (or one holding its {CONFIG_JSON})" if config_alone else "")))
    state = read_json_object(path)
    model = required(state, "model", dict, path)
    pieces = model.get("vocab")
    if isinstance(pieces, list):  # Unigram: [piece, score] in id order
        pieces = {entry[0]: i for i, entry in enumerate(pieces) if isinstance(entry, list) and entry}
    if not isinstance(pieces, dict):
        raise MmtokError(f"{path}: its model has no vocabulary this check reads (type {model.get('type')})")
    added = [entry for entry in required(state, "added_tokens", list, path, default=[])
             if isinstance(entry, dict) and isinstance(entry.get("content"), str) and isinstance(entry.get("id"), int)]
    pieces = {name: i for name, i in pieces.items() if isinstance(i, int)}  # ids compared and sorted as numbers
    return {**files, "vocab": {**pieces, **{entry["content"]: entry["id"] for entry in added}},
            "added": {entry["content"]: {flag: entry.get(flag) for flag in ADDED_TOKEN_FLAGS} for entry in added}}


def _chat_template(directory: Path) -> tuple[str, str] | None:
    """(the chat template transformers renders with, where it is): chat_template.jinja where there is one,
    else tokenizer_config.json's `chat_template` when it is a string; None when there is neither."""
    template = read_chat_template(directory / CHAT_TEMPLATE_FILE)
    if template is not None:
        return template, CHAT_TEMPLATE_FILE
    value = _read_json(directory / CONFIG_JSON).get("chat_template")
    return (value, f"{CONFIG_JSON} chat_template") if isinstance(value, str) else None


def _template_difference(here: dict, there: dict, names: tuple[str, str]) -> list[str]:
    """The line naming how two tokenizers' chat templates differ, or none: the same text is the same
    template whether it is a chat_template.jinja or a tokenizer_config.json key."""
    ours, theirs = here["template"], there["template"]
    if (ours and ours[0]) == (theirs and theirs[0]):
        return []
    if ours is None or theirs is None:
        (text, source), where = (ours, names[0]) if theirs is None else (theirs, names[1])
        return [f"chat template: only in {where} ({len(text):,} characters, {source})"]
    return [f"chat template: differs ({len(ours[0]):,} characters in {names[0]} ({ours[1]}), {len(theirs[0]):,} in "
            f"{names[1]} ({theirs[1]}))"]


def _id_in(vocab: dict[str, int], name: str, where: str) -> str:
    return f"id {vocab[name]:,} in {where}" if name in vocab else f"not in {where}"


def _flag_difference(ours: dict | None, theirs: dict | None, names: tuple[str, str]) -> str:
    """The flags in which one added token differs between two tokenizers, or in which one it is no added token."""
    if ours is None or theirs is None:
        return f"an added token in {names[0] if theirs is None else names[1]} only"
    return "; ".join(f"{flag} {ours[flag]} in {names[0]}, {theirs[flag]} in {names[1]}"
                     for flag in ADDED_TOKEN_FLAGS if ours[flag] != theirs[flag])


def _shown(kind: str, lines: list[str]) -> list[str]:
    if len(lines) <= DIFFERENCES_SHOWN:
        return lines
    return [*lines[:DIFFERENCES_SHOWN], f"… and {len(lines) - DIFFERENCES_SHOWN:,} more differences in {kind}"]
