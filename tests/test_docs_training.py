"""docs/training.md's megatron-core block, run as it stands on the page, in a directory holding what its constants
name: two merged outputs of mmtok's real flow (OUT_A, OUT_B) and their `mmtok tokenizer build` (omni-tokenizer).
The block's tokenizer is megatron-core's Hugging Face one: transformers, which takes most of this test's time
(about 8 s of CPU) loading the 135,782-id tokenizer."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training.md"
MARKER = "<!-- tests/test_docs_training.py runs the next block as it stands -->"


def page_block() -> str:
    """The fenced python block right after MARKER on the page."""
    found = re.search(re.escape(MARKER) + r"\n```python\n(.*?)\n```\n", PAGE.read_text(), re.S)
    assert found, f"{PAGE}: no python block after {MARKER}"
    return found.group(1)


@pytest.fixture
def workdir(caption_blend, tmp_path):
    """A directory where the page's names are conftest's caption_blend: OUT_A and OUT_B its two outputs (modes
    image-text and text-image), omni-tokenizer its tokenizer."""
    (tmp_path / "OUT_A").symlink_to(caption_blend.datasets[0].parent)
    (tmp_path / "OUT_B").symlink_to(caption_blend.datasets[1].parent)
    (tmp_path / "omni-tokenizer").symlink_to(caption_blend.tokenizer)
    return tmp_path


def test_the_pages_megatron_core_block_builds_the_weighted_blend_with_documents_kept_apart(workdir, monkeypatch,
                                                                                         capsys):
    pytest.importorskip("transformers", reason="megatron-core's Hugging Face tokenizer needs transformers")
    monkeypatch.chdir(workdir)
    namespace = {}
    try:
        exec(compile(page_block(), str(PAGE), "exec"), namespace)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    train, tokenizer, seq_length = namespace["train"], namespace["tokenizer"], namespace["SEQ_LENGTH"]
    assert f"20 samples; tokens ({seq_length},)" in capsys.readouterr().out
    assert torch.bincount(torch.from_numpy(train.dataset_index).long()).tolist() == [14, 6]  # 0.7 / 0.3 of 20
    for index in range(len(train)):
        sample = train[index]
        tokens, positions = sample["tokens"], sample["position_ids"]
        assert tokens.shape == sample["labels"].shape == positions.shape == (seq_length,)
        assert torch.equal(tokens[1:], sample["labels"][:-1]) and int(tokens.max()) < tokenizer.vocab_size
        ends = (tokens[:-1] == tokenizer.eod).nonzero().flatten()
        assert len(ends) > 1  # short caption documents: several in every sample
        assert positions[ends + 1].tolist() == [0] * len(ends)  # reset_position_ids: each document starts at 0
        mask = sample["attention_mask"][0]  # True = may not attend
        assert bool(mask[ends[0] + 1, ends[0]]) and not bool(mask[ends[0], ends[0]])
