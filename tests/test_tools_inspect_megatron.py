"""`mmtok inspect --megatron`: the printed arguments, read as Megatron-LM reads them, build megatron-core's blended
GPT dataset from two merged outputs (conftest's caption_blend), and its samples decode with the `mmtok tokenizer
build` tokenizer; the warnings name what megatron-core does with datasets shorter than a sample or repeated."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.datasets.megatron_tokenizer import MegatronLegacyTokenizer
from megatron.core.datasets.utils import get_blend_from_list
from tokenizers import Tokenizer

from encodekit import chat_tokenizer, gpt_dataset
from mmtok.cli import main
from mmtok.formats.megatron import read_index
from mmtok.tools.inspect import advise_seq_length, advise_split

BLOCK = re.compile(r"<\|img_start\|>(\d+)\*(\d+)<\|img_token_start\|>(.*?)<\|img_end_of_frame\|><\|img_end\|>")
ROW = re.compile(r"((?:<\|visual token \d+\|>)+)<\|img_end_of_row\|>")


class OmniTokenizer(MegatronLegacyTokenizer):
    """A `mmtok tokenizer build` directory read with the `tokenizers` library, offering what megatron-core's
    datasets read from Megatron-LM's HuggingFaceTokenizer: vocab_size = every id, eod = the eos_token's id."""

    def __init__(self, directory: Path):
        super().__init__(str(directory))
        self._tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
        config = json.loads((directory / "tokenizer_config.json").read_text())
        self._eod = self._tokenizer.token_to_id(config["eos_token"])

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    @property
    def vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    @property
    def inv_vocab(self) -> dict[int, str]:
        return {i: token for token, i in self.vocab.items()}

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eod(self) -> int:
        return self._eod


def megatron_arguments(output: str) -> argparse.Namespace:
    """The recipe's argument block as the shell passes it, parsed with exactly the Megatron-LM flags it may use."""
    block = " ".join(line for line in output.splitlines() if not line.startswith("#")).replace("\\", " ")
    parser = argparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--data-path", nargs="+", required=True)
    for flag in ("--split", "--tokenizer-type", "--tokenizer-model"):
        parser.add_argument(flag, required=True)
    for flag in ("--make-vocab-size-divisible-by", "--seq-length"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--train-samples", type=int)
    return parser.parse_args(shlex.split(block))


def complete_image_blocks(text: str) -> int:
    """How many whole image blocks `text` holds, each checked: H rows of W code tokens for the "H*W" it states."""
    found = 0
    for match in BLOCK.finditer(text):
        height, width, body = int(match.group(1)), int(match.group(2)), match.group(3)
        rows = ROW.findall(body)
        assert "".join(row + "<|img_end_of_row|>" for row in rows) == body
        assert len(rows) == height and all(row.count("<|visual token ") == width for row in rows)
        found += 1
    return found


@contextlib.contextmanager
def one_process_group(directory: Path):
    """A one-process torch.distributed group, as Megatron-LM has when it builds datasets (BlendedDataset asks
    for the rank)."""
    torch.distributed.init_process_group("gloo", init_method=f"file://{directory / 'process-group'}", rank=0,
                                         world_size=1)
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def test_recipe_builds_a_weighted_blend_whose_samples_decode_to_image_blocks(caption_blend, capsys):
    paths = [str(prefix) for prefix in caption_blend.datasets]
    assert main(["inspect", *paths, "--megatron", "--weights", "0.7", "0.3",
                 "--tokenizer", str(caption_blend.tokenizer)]) == 0
    output = capsys.readouterr().out
    args = megatron_arguments(output)
    prefixes, weights = get_blend_from_list(args.data_path)
    assert prefixes == [str(prefix.resolve()) for prefix in caption_blend.datasets] and weights == [0.7, 0.3]
    assert args.tokenizer_type == "HuggingFaceTokenizer"
    assert Path(args.tokenizer_model) == caption_blend.tokenizer.resolve()
    tokenizer = OmniTokenizer(Path(args.tokenizer_model))
    multiple = args.make_vocab_size_divisible_by
    assert f"{-(-tokenizer.vocab_size // multiple) * multiple:,} at TP 1" in output
    assert args.seq_length >= max(int(read_index(prefix)[1].max()) for prefix in caption_blend.datasets)

    with one_process_group(caption_blend.root):
        train = gpt_dataset((prefixes, weights), tokenizer, args.seq_length, 20, caption_blend.root, split=args.split)
    assert np.bincount(train.dataset_index, minlength=2).tolist() == [14, 6]  # the weights, as Megatron blends them
    blocks = 0
    for index in range(len(train)):
        sample = train[index]
        ids = torch.cat([sample["tokens"], sample["labels"][-1:]]).tolist()
        assert len(ids) == args.seq_length + 1 and 0 <= min(ids) and max(ids) < tokenizer.vocab_size
        text = tokenizer.detokenize(ids)
        assert "in the afternoon sun" in text  # captions of both datasets decode as text
        blocks += complete_image_blocks(text)
    assert blocks >= len(train)


def test_recipe_refuses_a_tokenizer_built_from_another_text_tokenizer(caption_blend, capsys):
    other = chat_tokenizer(caption_blend.root / "other-text", vocab_size=300)
    omni_other = caption_blend.root / "omni-other"
    assert main(["tokenizer", "build", "--text-tokenizer", str(other), "--out", str(omni_other)]) == 0
    capsys.readouterr()
    assert main(["inspect", str(caption_blend.datasets[0]), "--megatron", "--tokenizer", str(omni_other)]) == 2
    assert "does not fit the data: layout:" in capsys.readouterr().err


def test_recipe_without_a_tokenizer_says_how_to_build_it(caption_blend, capsys):
    assert main(["inspect", str(caption_blend.datasets[0]), "--megatron"]) == 0
    output = capsys.readouterr().out
    assert megatron_arguments(output).tokenizer_model == "TOKENIZER_DIR"
    text_tokenizer = caption_blend.env.text / "tokenizer.json"
    assert f"mmtok tokenizer build --text-tokenizer {text_tokenizer} --out TOKENIZER_DIR" in output


def test_weights_must_match_the_datasets(caption_blend, capsys):
    paths = [str(prefix) for prefix in caption_blend.datasets]
    assert main(["inspect", *paths, "--megatron", "--weights", "1"]) == 2
    assert "one positive weight per dataset (2)" in capsys.readouterr().err
    assert main(["inspect", *paths]) == 2  # several datasets only make sense for the recipe
    assert main(["inspect", paths[0], "--train-tokens", "1000"]) == 2  # so does a token budget
    assert main(["inspect", *paths, "--megatron", "--train-tokens", "0"]) == 2
    assert "--train-tokens must be at least 1, got 0" in capsys.readouterr().err


def test_seq_length_advice_holds_the_longest_document_up_to_32k():
    assert advise_seq_length(np.array([43, 12]))[0] == 1024
    assert advise_seq_length(np.array([3000, 4096]))[0] == 4096
    assert advise_seq_length(np.array([4097]))[0] == 8192
    length, note = advise_seq_length(np.array([100] * 9 + [40_000]))
    assert length == 8192 and note.startswith("1 documents (97.8% of the tokens, longest 40,000)")


def test_split_advice_holds_out_validation_only_when_every_dataset_can_spare_it():
    assert advise_split([100, 2500])[0] == "99,1,0"
    assert advise_split([99, 2500])[0] == "100,0,0"


def recipe_blend(caption_blend, capsys, *flags: str):
    """`inspect --megatron` of the fixture's two datasets with `flags`: (parsed arguments, stdout, stderr)."""
    assert main(["inspect", *map(str, caption_blend.datasets), "--megatron", *flags]) == 0
    captured = capsys.readouterr()
    return megatron_arguments(captured.out), captured.out, captured.err


def built_blend(caption_blend, args: argparse.Namespace, seq_length: int, samples: int, cache: str):
    """megatron-core's train blend of the recipe's --data-path, as Megatron-LM builds it."""
    return gpt_dataset(get_blend_from_list(args.data_path), OmniTokenizer(caption_blend.tokenizer), seq_length, samples,
                       caption_blend.root / cache)


def test_a_dataset_shorter_than_one_sample_is_warned_where_an_unweighted_blend_fails(caption_blend, capsys):
    args, out, err = recipe_blend(caption_blend, capsys)  # 763 tokens each, --seq-length 1024
    assert args.seq_length == 1024 and out.count("# warning: ") == 2 and err.count("warning: ") == 2
    assert "holds 763 tokens, fewer than one sample (--seq-length + 1 = 1,025)" in err
    assert "AssertionError in megatron-core's BlendedDataset" in err
    with one_process_group(caption_blend.root), pytest.raises(AssertionError) as failure:
        built_blend(caption_blend, args, args.seq_length, 20, "short")
    assert failure.traceback[-1].path.name == "blended_dataset.py"

    args, out, err = recipe_blend(caption_blend, capsys, "--seq-length", "256")
    assert args.seq_length == 256 and "warning" not in out + err
    with one_process_group(caption_blend.root):
        train = built_blend(caption_blend, args, 256, 20, "fits")
    assert len(train) == 4  # one epoch: 762 // 256 = 2 samples of each


def built_epochs(dataset) -> float:
    """The epochs megatron-core's GPTDataset built: its document index holds every document once per epoch."""
    return len(dataset.document_index) / len(dataset.dataset.sequence_lengths)


def test_train_tokens_give_the_epochs_megatron_core_builds_for_a_weighted_blend(caption_blend, capsys):
    args, out, err = recipe_blend(caption_blend, capsys, "--weights", "0.7", "0.3", "--seq-length", "128",
                                  "--train-tokens", "20000")
    assert args.train_samples == 157  # 20,000 / 128, rounded up
    predicted = [float(value) for value in re.findall(r"share 0\.[37]00, 763 tokens: ([\d.]+) epochs", out)]
    assert predicted == [18.44, 7.9]  # 0.7 (0.3) x 157 x 128 / 763
    with one_process_group(caption_blend.root):
        train = built_blend(caption_blend, args, 128, args.train_samples, "epochs")
    for dataset, epochs in zip(train.datasets, predicted, strict=True):
        # megatron-core builds whole epochs, for whole samples and its 0.5% surplus: the next whole number or one more
        assert epochs < built_epochs(dataset) < epochs + 2
    assert err.count("is repeated: ") == 2 and "its first pass ends at 5.4% of the run" in err


def test_train_tokens_beyond_one_epoch_of_an_unweighted_blend_say_where_the_data_runs_out(caption_blend, capsys):
    args, out, err = recipe_blend(caption_blend, capsys, "--seq-length", "128", "--train-tokens", "20000")
    assert "the blend holds 10 samples, so the data runs out at 6.4% of the 157 samples" in err
    assert out.count(": 0.84 epochs -- 16% of its tokens never train") == 2  # 5 samples x 128 of 763 tokens
    # the header's formula is the one those lines follow: the tokens the blend serves, not the budget
    assert ("20,096 train tokens, of which the blend serves 10 samples = 1,280 tokens; each dataset's epochs = its "
            "share of the blend x the tokens served / its tokens") in out
    with one_process_group(caption_blend.root):
        train = built_blend(caption_blend, args, 128, args.train_samples, "out")
    assert len(train) == 10  # one epoch of each, whatever was asked for
