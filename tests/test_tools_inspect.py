import numpy as np

from mmtok.cli import main
from mmtok.formats.megatron import DatasetWriter
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout


def test_inspect_shows_text_and_block_shapes_of_a_dataset(tmp_path, capsys):
    tokenizer, layout = load_text_tokenizer(), VocabLayout()
    caption = tokenizer.encode(" A tabby cat.")
    with DatasetWriter(tmp_path / "data") as writer:
        block = layout.image_block(np.arange(12).reshape(3, 4), tokenizer.encode("3*4"))
        writer.add(np.concatenate([[tokenizer.bos_id], block, caption, [tokenizer.eos_id]]))
        writer.add(np.concatenate([[tokenizer.bos_id], layout.audio_block(np.arange(80)), [tokenizer.eos_id]]))
    assert main(["inspect", str(tmp_path / "data.idx"), "--limit", "5"]) == 0
    out = capsys.readouterr().out
    assert "2 sequences" in out
    assert "<image 3x4 codes, dims '3*4'>" in out
    assert "A tabby cat." in out
    assert "<audio 80 codes = 2.00 s>" in out


def test_inspect_refuses_an_unknown_path(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nothing")]) == 2
    assert "not a manifest dir" in capsys.readouterr().err
