"""`mmtok tokenizer build|check`: the omnimodal HF tokenizer has mmtok's ids, and is checked against real data."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from encodekit import APERTUS_TEMPLATE, caption_env, chat_tokenizer, encode_all, one_torch_thread, plan
from mmtok.cli import main
from mmtok.errors import MmtokError
from mmtok.formats.megatron import DatasetWriter, bin_path, read_sequences
from mmtok.text import caption_text, load_text_tokenizer
from mmtok.tools.tokenizer import (
    AUDIO_CODE_TOKEN,
    IMAGE_CODE_TOKEN,
    RESERVED_TOKEN,
    build_tokenizer,
    byte_level_chars,
    omni_token_names,
    provenance_problems,
    value_differences,
)
from mmtok.vocab import OMNI_SPECIAL_TOKENS, VocabLayout

RELEASE = Path(__file__).parent / "data" / "apertus_1p5_tokenizer"  # the released tokenizer_config.json
# The names the Apertus 1.5 text vocabulary gives ids 0-3 and 61-74 (its roles and chat tokens).
APERTUS_NAMES = {0: "<unk>", 1: "<s>", 2: "</s>", 3: "<pad>", 61: "<|system_start|>", 62: "<|system_end|>",
                 63: "<|developer_start|>", 64: "<|developer_end|>", 65: "<|user_start|>", 66: "<|user_end|>",
                 67: "<|assistant_start|>", 68: "<|assistant_end|>", 73: "<|tool_output_start|>",
                 74: "<|tool_output_end|>"}
# What `mmtok tokenizer build` writes differently from the release (docs/training.md), given its text vocabulary.
RELEASE_DIFFERENCES = {"backend", "is_local", "vision_tokenizer.path", "mmtok",
                       "omnimodal_config.modalities[0].structure_token_ids",
                       "omnimodal_config.modalities[1].structure_token_ids"}
SENTENCES = [
    "The astronaut floats above the earth; the rocket waits on the launch pad.",
    "Grüße aus Zürich! Ça coûte 12,50 € — naïve café, smörgåsbord.",
    "Привет, мир: сегодня облачно, 14 градусов.",
    "今日は晴れです。我们明天去北京。 한국어 문장도 있습니다.",
    "مرحبا بالعالم، كيف حالك؟",
    "emoji 🤖🚀 and\ttabs\n\n\nnew lines   and  runs of spaces ",
    "def f(x):\n    return x ** 2  # 0.5e-3, 1234567890\n",
]


def load(directory: Path) -> tuple[Tokenizer, dict]:
    return (Tokenizer.from_file(str(directory / "tokenizer.json")),
            json.loads((directory / "tokenizer_config.json").read_text()))


def check(directory: Path, *prefixes: Path) -> int:
    return main(["tokenizer", "check", str(directory), *[a for p in prefixes for a in ("--data", str(p))]])


def sized_tokenizer(directory: Path, size: int) -> Path:
    """A byte-level BPE HF tokenizer with exactly `size` contiguous ids (<unk> <s> </s>, the 256 byte tokens,
    then unreachable fillers): a stand-in for a 128,000-token base such as EuroLLM's."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({char: 3 + i for i, char in enumerate(byte_level_chars())})
    vocab.update({f"filler{i}": i for i in range(len(vocab), size)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in ("<unk>", "<s>", "</s>")])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return directory


def apertus_like_base(directory: Path) -> Path:
    """A stand-in for the Apertus 1.5 text tokenizer: 131,072 contiguous ids with the release's role and chat
    token names at their ids, and the tokenizer_config.json keys the Apertus text tokenizer has."""
    vocab = {char: 100 + i for i, char in enumerate(byte_level_chars())}
    vocab.update({name: i for i, name in APERTUS_NAMES.items()})
    taken = set(vocab.values())
    vocab.update({f"<SPECIAL_{i}>": i for i in range(100) if i not in taken})
    vocab.update({f"filler{i}": i for i in range(len(vocab), 131_072)})
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True) for name in APERTUS_NAMES.values()])
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    release = json.loads((RELEASE / "tokenizer_config.json").read_text())
    config = {key: release[key] for key in ("add_prefix_space", "bos_token", "clean_up_tokenization_spaces",
                                            "eos_token", "model_input_names", "model_max_length", "pad_token",
                                            "padding_side", "unk_token")}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tokenizer")


@pytest.fixture(scope="module")
def tekken_dir(root) -> Path:
    assert main(["tokenizer", "build", "--text-tokenizer", "tekken", "--out", str(root / "omni-tekken")]) == 0
    return root / "omni-tekken"


@pytest.fixture(scope="module")
def tekken_omni(tekken_dir) -> tuple[Tokenizer, dict]:
    return load(tekken_dir)


@pytest.fixture(scope="module")
def small_base_dir(root) -> Path:
    base = sized_tokenizer(root / "base-128000", 128_000)
    assert main(["tokenizer", "build", "--text-tokenizer", str(base), "--out", str(root / "omni-128000")]) == 0
    return root / "omni-128000"


@pytest.fixture(scope="module")
def apertus_dir(root) -> Path:
    base = apertus_like_base(root / "apertus-text")
    assert main(["tokenizer", "build", "--text-tokenizer", str(base), "--out", str(root / "omni-apertus")]) == 0
    return root / "omni-apertus"


@pytest.fixture(scope="module")
def chat_omni(root) -> Path:
    """An omnimodal tokenizer built from the small test chat tokenizer (quick to build and to copy)."""
    build_tokenizer(str(chat_tokenizer(root / "chat-text")), root / "omni-chat-small")
    return root / "omni-chat-small"


@pytest.fixture(scope="module")
def captions(root):
    """A merged image-text caption dataset made with the built-in tekken, and its scan environment."""
    with one_torch_thread():
        env = caption_env(root / "pipeline")
        out = encode_all(env, plan(env, "plan-tekken", "--mode", "image-text", "--text-tokenizer", "tekken"),
                         root / "captions-out", world_size=1)
    return env, out


def test_tekken_build_has_the_apertus_layout(tekken_omni):
    tokenizer, _ = tekken_omni
    assert tokenizer.get_vocab_size(with_added_tokens=True) == 266_440
    assert tokenizer.token_to_id("<|img_start|>") == 131_073
    assert tokenizer.token_to_id(IMAGE_CODE_TOKEN.format(i=0)) == 131_272
    assert tokenizer.token_to_id(AUDIO_CODE_TOKEN.format(i=0)) == 262_344
    assert tokenizer.token_to_id(AUDIO_CODE_TOKEN.format(i=4_095)) == 266_439
    # a free slot has a name, so ids are contiguous
    assert tokenizer.id_to_token(131_088) == RESERVED_TOKEN.format(i=16)
    assert RESERVED_TOKEN.format(i=0) == OMNI_SPECIAL_TOKENS[0]  # one naming for every reserved slot
    layout = VocabLayout(131_072)
    assert [tokenizer.id_to_token(i) for i in range(131_072, 266_440)] == omni_token_names(layout)
    assert all(tokenizer.token_to_id(name) == i for name, i in layout.special_ids().items())


def test_tekken_text_ids_and_encoding_are_mmtoks(tekken_omni):
    tokenizer, _ = tekken_omni
    text = load_text_tokenizer("tekken")
    for sentence in SENTENCES:
        ids = tokenizer.encode(sentence, add_special_tokens=False).ids
        assert ids == text.encode(sentence), sentence
        assert tokenizer.decode(ids) == sentence
    assert [tokenizer.id_to_token(i) for i in (0, 1, 2)] == ["<unk>", "<s>", "</s>"]
    assert all(tokenizer.decode([i], skip_special_tokens=False) == text.decode([i]) for i in range(1000, 131_072, 997))


def test_control_token_names_in_text_become_control_tokens_unlike_tekken(tekken_omni):
    """The one documented difference from mistral-common's encoder (see mmtok/tools/tokenizer.py)."""
    tokenizer, _ = tekken_omni
    text = load_text_tokenizer("tekken")
    assert tokenizer.encode("</s>", add_special_tokens=False).ids == [2]
    assert 2 not in text.encode("</s>")


def test_aliases_encode_to_the_placeholder_ids(tekken_omni):
    tokenizer, _ = tekken_omni
    text = load_text_tokenizer("tekken")
    assert tokenizer.encode("<image>", add_special_tokens=False).ids == [131_079]
    assert tokenizer.encode("<audio>", add_special_tokens=False).ids == [131_085]
    ids = tokenizer.encode("Look at <image> now", add_special_tokens=False).ids
    assert ids == text.encode("Look at ") + [131_079] + text.encode(" now")
    assert tokenizer.encode("<|image|>", add_special_tokens=False).ids == [131_079]


def test_tokenizer_config_carries_the_omnimodal_contract(tekken_dir, tekken_omni):
    tokenizer, config = tekken_omni
    assert config["base_vocab_size"] == 131_072
    omni = config["omnimodal_config"]
    assert omni["omni_special_token_offset"] == 131_072
    assert [m["name"] for m in omni["modalities"]] == ["vision", "audio"]
    assert [m["offset"] for m in omni["modalities"]] == sorted(m["offset"] for m in omni["modalities"])
    for modality, (start, end, offset, size) in zip(omni["modalities"], [
            ("<|img_start|>", "<|img_end|>", 131_272, 131_072), ("<|audio_start|>", "<|audio_end|>", 262_344, 4_096)],
            strict=True):
        assert (modality["offset"], modality["vocab_size"]) == (offset, size)
        assert ((modality["start_token"], modality["end_token"])
                == (tokenizer.token_to_id(start), tokenizer.token_to_id(end)))
        assert modality["structure_token_ids"] == {n: tokenizer.token_to_id(n) for n in modality["structure_token_ids"]}
    structure = {**omni["modalities"][0]["structure_token_ids"], **omni["modalities"][1]["structure_token_ids"]}
    assert set(structure) == set(OMNI_SPECIAL_TOKENS[1:])
    assert tokenizer.token_to_id(config["eos_token"]) == 2 and tokenizer.token_to_id(config["bos_token"]) == 1
    roles = json.loads((tekken_dir / "special_tokens_map.json").read_text())
    assert roles == {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>"}


def test_a_tekken_build_has_every_release_key_but_the_sft_sequences_tekken_has_no_tokens_for(tekken_omni):
    tokenizer, config = tekken_omni
    release = json.loads((RELEASE / "tokenizer_config.json").read_text())
    missing = set(release) - set(config)
    assert missing == {"backend", "is_local", "sft_user_begin_sequence", "sft_assistant_begin_sequence",
                       "sft_eot_token"}
    assert (config["vision_tokenizer"], config["audio_tokenizer"]) == ({"type": "Emu3.5", "codebook_size": 131_072},
                                                                     release["audio_tokenizer"])
    assert [config[key] for key in ("vision_begin_token", "vision_end_token", "audio_begin_token", "audio_end_token")] \
        == [[tokenizer.token_to_id(n)] for n in ("<|img_start|>", "<|img_end|>", "<|audio_start|>", "<|audio_end|>")]
    assert (config["vocab_size"], config["added_tokens_count"]) == (131_072, 135_368)
    assert (config["eos_token"], config["pad_token"]) == ("</s>", "<pad>")  # tekken's own roles


def test_from_the_release_text_vocabulary_every_release_key_has_the_release_value(apertus_dir):
    config = json.loads((apertus_dir / "tokenizer_config.json").read_text())
    release = json.loads((RELEASE / "tokenizer_config.json").read_text())
    differences = value_differences(config, release, ("built", "release"))
    assert {key for key, _ in differences} == RELEASE_DIFFERENCES, differences
    assert all(("only in release" in what) == (key in ("backend", "is_local", "vision_tokenizer.path"))
               for key, what in differences)
    assert (config["eos_token"], config["sft_eot_token"], config["vision_tokenizer"]["type"]) == (
        "<|assistant_end|>", [68], "Emu3.5")


def test_the_release_keys_load_in_transformers_with_the_release_roles(apertus_dir, root, tmp_path):
    """The built tokenizer_config.json read by transformers, beside the text tokenizer.json: loading the whole
    build's 135,368 added tokens takes transformers about 10 s (checked by hand, docs/training.md)."""
    transformers = pytest.importorskip("transformers")
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(apertus_dir / name, tmp_path / name)
    shutil.copy(root / "apertus-text" / "tokenizer.json", tmp_path / "tokenizer.json")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id) == (68, 3, 1)
    assert (tokenizer.padding_side, tokenizer.model_max_length) == ("left", int(1e30))
    assert tokenizer.init_kwargs["sft_eot_token"] == [68] and tokenizer.init_kwargs["vision_begin_token"] == [131_073]
    assert tokenizer.encode("<|user_start|>", add_special_tokens=False) == [65]


def test_a_128000_base_shifts_every_omni_id_as_the_layout_says(root, small_base_dir):
    tokenizer, config = load(small_base_dir)
    layout = VocabLayout(128_000)
    assert tokenizer.get_vocab_size(with_added_tokens=True) == layout.total_size == 263_368
    assert all(tokenizer.token_to_id(name) == i for name, i in layout.special_ids().items())
    assert tokenizer.token_to_id("<|img_start|>") == 128_001
    assert tokenizer.token_to_id(IMAGE_CODE_TOKEN.format(i=0)) == layout.image_offset == 128_200
    assert tokenizer.token_to_id(AUDIO_CODE_TOKEN.format(i=0)) == layout.audio_offset == 259_272
    assert config["base_vocab_size"] == 128_000
    assert config["omnimodal_config"] == layout.omnimodal_config(structure=True)["omnimodal_config"]
    base = Tokenizer.from_file(str(root / "base-128000" / "tokenizer.json")).get_vocab(with_added_tokens=True)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    assert all(vocab[name] == i for name, i in base.items())  # every text id unchanged


def test_an_hf_base_keeps_its_chat_template_roles_and_ids(root):
    base = chat_tokenizer(root / "chat-base")
    summary = build_tokenizer(str(base), root / "omni-chat")
    tokenizer, config = load(root / "omni-chat")
    text = load_text_tokenizer(str(base))
    layout = VocabLayout(text.vocab_size)
    assert summary["total_size"] == layout.total_size == tokenizer.get_vocab_size(with_added_tokens=True)
    assert config["chat_template"] == APERTUS_TEMPLATE and tokenizer.token_to_id(config["eos_token"]) == text.eos_id
    for sentence in SENTENCES[:2]:
        assert tokenizer.encode(sentence, add_special_tokens=False).ids == text.encode(sentence)
    # A rendering's control tokens are the template's, by id (text.encode keeps typed names as text).
    turn = tokenizer.encode("<|user_start|>What is in this image?<|user_end|>", add_special_tokens=False).ids
    assert turn == [text.token_id("<|user_start|>"), *text.encode("What is in this image?"),
                    text.token_id("<|user_end|>")]
    ids = tokenizer.encode("<|user_start|><image> here", add_special_tokens=False).ids
    assert ids == [text.token_id("<|user_start|>"), layout.special_id("<|image|>"), *text.encode(" here")]


def test_a_base_that_already_has_omni_tokens_is_refused(root):
    base = chat_tokenizer(root / "omni-already")
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    tokenizer.add_special_tokens(["<|img_start|>"])
    tokenizer.save(str(base / "tokenizer.json"))
    with pytest.raises(MmtokError, match=r"already has '<\|img_start\|>'"):
        build_tokenizer(str(base), root / "never-written")
    assert not (root / "never-written").exists()


def test_the_base_directory_is_never_overwritten(root):
    base = chat_tokenizer(root / "own-dir")
    before = (base / "tokenizer.json").read_bytes()
    with pytest.raises(MmtokError, match="the base tokenizer's own directory"):
        build_tokenizer(str(base), base)
    assert (base / "tokenizer.json").read_bytes() == before


def test_decoding_a_merged_caption_sequence_gives_the_caption_and_the_image_markers(captions, tekken_omni):
    env, out = captions
    tokenizer, _ = tekken_omni
    layout = VocabLayout(131_072)
    manifest = _manifest_rows(env.manifest)
    records = [json.loads(line) for line in (out / "merged.provenance.jsonl").read_text().splitlines()]
    seen = 0
    for record, tokens in zip(records, read_sequences(out / "merged"), strict=True):
        if len(record["rows"]) != 1:
            continue
        entry = manifest[record["rows"][0]]
        with open(entry["tar"], "rb") as handle:
            handle.seek(entry["text_offset"])
            caption = caption_text(handle.read(entry["text_size"]))
        (kind, codes, _), text_segment = layout.split_sequence(tokens)[1:3]
        assert kind == "image" and text_segment[0] == "text"
        height, width = codes.shape
        rows = "".join("".join(IMAGE_CODE_TOKEN.format(i=int(c)) for c in row) + "<|img_end_of_row|>" for row in codes)
        block = f"<|img_start|>{height}*{width}<|img_token_start|>{rows}<|img_end_of_frame|><|img_end|>"
        assert tokenizer.decode(tokens.tolist(), skip_special_tokens=False) == f"<s>{block}{caption}</s>"
        assert tokenizer.decode(tokens.tolist(), skip_special_tokens=True) == f"{height}*{width}{caption}"
        seen += 1
    assert seen >= 10


def test_check_passes_on_the_matching_dataset(captions, tekken_dir, capsys):
    _, out = captions
    assert check(tekken_dir, out / "merged") == 0
    assert "ok:" in capsys.readouterr().err


def test_check_names_a_layout_mismatch(captions, small_base_dir, capsys):
    _, out = captions
    assert check(small_base_dir, out / "merged") == 1
    layout, text, verdict = capsys.readouterr().err.splitlines()
    assert "layout:" in layout and "text_size 131,072, image_offset 131,272" in layout
    assert "the tokenizer 128,000, 128,200" in layout and "(tekken_240718.json)" in layout
    assert "text tokenizer:" in text and verdict.endswith("does not fit this data")


def test_check_names_ids_outside_the_vocabulary(captions, tekken_dir, tmp_path, capsys):
    _, out = captions
    copy = _copy_dataset(out, tmp_path / "damaged")
    tokens = np.memmap(bin_path(copy / "merged"), dtype=np.int32, mode="r+")
    tokens[5] = 266_440
    tokens.flush()
    del tokens
    assert check(tekken_dir, copy / "merged") == 1
    problems = capsys.readouterr().err.splitlines()
    assert len(problems) == 2 and "holds id 266,440 (sequence 0)" in problems[0]


def test_check_names_a_different_eos_text_tokenizer_and_codec(captions, tekken_dir, tmp_path, capsys):
    _, out = captions
    copy = _copy_dataset(out, tmp_path / "other")
    summary = json.loads((copy / "merged.json").read_text())
    summary["identity"]["text_tokenizer"].update(sha256="0" * 64, eos_id=3)
    summary["identity"]["codec"]["name"] = "emu3"
    (copy / "merged.json").write_text(json.dumps(summary))
    assert check(tekken_dir, copy / "merged") == 1
    problems = capsys.readouterr().err.splitlines()[:-1]
    assert len(problems) == 3
    assert "token </s>:" in problems[0] and "uses id 3, the tokenizer has id 2" in problems[0]
    assert "text tokenizer:" in problems[1] and "--text-tokenizer" in problems[1]
    assert "codec:" in problems[2] and "--image-codec emu3" in problems[2]


def test_check_reads_audio_interleave_outputs_and_their_codec(tekken_dir, tmp_path, capsys):
    from mmtok.audio.interleave import STAGE
    from mmtok.formats.interleave import METADATA

    layout, text = VocabLayout(131_072), load_text_tokenizer("tekken")
    with DatasetWriter(tmp_path / STAGE) as writer:  # an interleaved sequence: speech, then its transcript
        writer.add(np.concatenate([[text.bos_id], layout.audio_block(np.array([0, 7, 4_095])),
                                   text.encode("Grüezi mitenand"), [text.eos_id]]).astype(np.int32))
    meta = {"vocab": layout.to_dict(), "text_tokenizer": text.describe(), "codec": {"name": "wavtokenizer",
                                                                                    "modality": "audio"}}
    (tmp_path / METADATA).write_text(json.dumps(meta))
    assert check(tekken_dir, tmp_path / STAGE) == 0
    assert "ids 1 … 266,439" in capsys.readouterr().err
    meta["codec"]["name"] = "another-codec"
    (tmp_path / METADATA).write_text(json.dumps(meta))
    assert check(tekken_dir, tmp_path / STAGE) == 1
    assert "rebuild it with --audio-codec another-codec" in capsys.readouterr().err


def test_check_against_an_equal_copy_passes(chat_omni, tmp_path, capsys):
    copy = shutil.copytree(chat_omni, tmp_path / "release")
    assert main(["tokenizer", "check", str(chat_omni), "--against", str(copy)]) == 0
    assert "equals" in capsys.readouterr().err


def test_check_against_names_every_changed_key_id_and_added_token(chat_omni, tmp_path, capsys):
    release = shutil.copytree(chat_omni, tmp_path / "release")
    config = json.loads((release / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|assistant_end|>"
    config["vision_tokenizer"]["type"] = "emu3.5"
    del config["added_tokens_count"]
    (release / "tokenizer_config.json").write_text(json.dumps(config))
    state = json.loads((release / "tokenizer.json").read_text())
    added = {entry["content"]: entry for entry in state["added_tokens"]}
    start, end = added["<|img_start|>"], added["<|img_end|>"]
    start["content"], end["content"] = "<|img_end|>", "<|img_start|>"  # the two ids swapped
    start["normalized"] = True  # now <|img_end|>'s entry
    seven = added[AUDIO_CODE_TOKEN.format(i=7)]
    seven["content"] = "<|audio token 7b|>"  # one token missing, one extra
    (release / "tokenizer.json").write_text(json.dumps(state))
    assert main(["tokenizer", "check", str(chat_omni), "--against", str(release)]) == 1
    lines = [line.strip() for line in capsys.readouterr().err.splitlines()]
    problems, verdict = lines[:-1], lines[-1]
    start_id, end_id = start["id"], end["id"]
    expected = [
        "tokenizer_config.json added_tokens_count: only in omni-chat-small (135368)",
        'tokenizer_config.json eos_token: "</s>" in omni-chat-small, "<|assistant_end|>" in release',
        'tokenizer_config.json vision_tokenizer.type: "Emu3.5" in omni-chat-small, "emu3.5" in release',
        f"token '<|img_start|>': id {start_id:,} in omni-chat-small, id {end_id:,} in release",
        f"token '<|img_end|>': id {end_id:,} in omni-chat-small, id {start_id:,} in release",
        f"token '<|audio token 7b|>': not in omni-chat-small, id {seven['id']:,} in release",
        f"token '<|audio token 7|>': id {seven['id']:,} in omni-chat-small, not in release",
    ]
    assert [p.removeprefix("mmtok tokenizer check: ") for p in problems[:7]] == expected
    assert [p.removeprefix("mmtok tokenizer check: ") for p in problems[7:]] == [
        "added token '<|img_end|>': normalized False in omni-chat-small, True in release",
        "added token '<|audio token 7b|>': an added token in release only",
        "added token '<|audio token 7|>': an added token in omni-chat-small only"]
    assert verdict.endswith(f"10 differences: {chat_omni} differs from {release}")


@pytest.mark.parametrize("where", ["release", "ours", "both"])
def test_check_against_compares_the_chat_template_file(chat_omni, tmp_path, capsys, where):
    # transformers renders with chat_template.jinja where a directory has one: a check that skips it says
    # "equals" for two tokenizers that render conversations differently.
    ours, release = (shutil.copytree(chat_omni, tmp_path / name) for name in ("ours", "release"))
    for name, directory in (("ours", ours), ("release", release)):
        if where in (name, "both"):
            (directory / "chat_template.jinja").write_text(f"{{{{ bos_token }}}}{name}")
    assert main(["tokenizer", "check", str(ours), "--against", str(release)]) == 1
    line = capsys.readouterr().err.splitlines()[0].removeprefix("mmtok tokenizer check: ")
    config = "1,603 in {} (tokenizer_config.json chat_template)"  # the built tokenizer's template key
    assert line == {
        "release": "chat template: differs (1,603 characters in ours (tokenizer_config.json chat_template), 22 in "
                   "release (chat_template.jinja))",
        "ours": ("chat template: differs (19 characters in ours (chat_template.jinja), "
                 + config.format("release") + ")"),
        "both": "chat template: differs (19 characters in ours (chat_template.jinja), 22 in release "
                "(chat_template.jinja))"}[where]


def test_a_template_in_the_config_or_in_chat_template_jinja_is_the_same_template(chat_omni, tmp_path, capsys):
    ours, release = (shutil.copytree(chat_omni, tmp_path / name) for name in ("ours", "release"))
    config = json.loads((release / "tokenizer_config.json").read_text())
    (release / "chat_template.jinja").write_text(config.pop("chat_template"))
    (release / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["tokenizer", "check", str(ours), "--against", str(release)]) == 0
    assert "equals" in capsys.readouterr().err


def test_check_against_a_release_config_alone_compares_its_keys(chat_omni, tmp_path, capsys):
    """Users compare against the release's tokenizer_config.json: a directory holding only that is a reference."""
    release = tmp_path / "release"
    release.mkdir()
    shutil.copy(chat_omni / "tokenizer_config.json", release)
    assert main(["tokenizer", "check", str(chat_omni), "--against", str(release)]) == 0
    assert "holds no tokenizer.json: tokenizer_config.json, the chat template compared, no token ids" in \
        capsys.readouterr().err
    config = json.loads((release / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|assistant_end|>"
    (release / "tokenizer_config.json").write_text(json.dumps(config))
    assert main(["tokenizer", "check", str(chat_omni), "--against", str(release)]) == 1
    lines = [line.removeprefix("mmtok tokenizer check: ") for line in capsys.readouterr().err.splitlines()]
    assert 'tokenizer_config.json eos_token: "</s>" in omni-chat-small, "<|assistant_end|>" in release' in lines
    (release / "tokenizer_config.json").unlink()
    assert main(["tokenizer", "check", str(chat_omni), "--against", str(release)]) == 2
    assert "has no tokenizer.json" in capsys.readouterr().err


def test_check_against_another_layout_counts_every_shifted_id_in_a_bounded_report(tekken_dir, small_base_dir, capsys):
    assert main(["tokenizer", "check", str(small_base_dir), "--against", str(tekken_dir)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert any("more differences in token ids" in line for line in lines) and len(lines) < 100
    assert "mmtok tokenizer check: tokenizer_config.json base_vocab_size: 128000 in omni-128000, 131072 in " \
        "omni-tekken" in lines


def test_a_data_tokenizer_differing_only_in_its_config_is_named_by_its_keys(chat_omni, root, tmp_path):
    """Same tokenizer.json as the tokenizer's base, another chat template: the config key is named."""
    other = shutil.copytree(root / "chat-text", tmp_path / "other-template")
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages }}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    meta = {"text_tokenizer": load_text_tokenizer(str(other)).describe(), "codec": {}}
    _, built = load(chat_omni)
    (problem,) = provenance_problems(meta, built, "OUT/merged")
    assert "the same tokenizer.json, but tokenizer_config.json differs in chat_template" in problem


def _copy_dataset(out: Path, target: Path) -> Path:
    target.mkdir()
    for name in ("merged.bin", "merged.idx", "merged.json"):
        shutil.copy(out / name, target / name)
    return target


def _manifest_rows(manifest: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(manifest / "manifest.parquet").to_pylist()


def test_check_names_what_is_wrong_with_a_path_that_is_not_a_tokenizer_directory(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "file").write_text("{}")
    for name, words in (("missing", "does not exist"), ("file", "is not a directory"),
                        ("empty", "has no tokenizer.json")):
        assert main(["tokenizer", "check", str(tmp_path / name), "--against", str(tmp_path / name)]) == 2
        assert f"{tmp_path / name}: {words} -- pass " in capsys.readouterr().err
