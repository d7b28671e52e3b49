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


def test_inspect_of_sft_parts_and_merged_uses_the_recorded_tokenizer_and_says_so(tmp_path, capsys):
    """Issue 34.4: without --text-tokenizer, the tokenizer the part's identity.json (or merged.json) records."""
    import json

    from encodekit import chat_tokenizer

    tokenizer = chat_tokenizer(tmp_path / "tok")
    source = tmp_path / "c.jsonl"
    source.write_text(json.dumps({"messages": [{"role": "user", "content": "Hello there."},
                                               {"role": "assistant", "content": "General Kenobi."}]}) + "\n")
    assert main(["sft", str(source), "--text-tokenizer", str(tokenizer), "--out", str(tmp_path / "sft"),
                 "--no-progress"]) == 0
    assert main(["merge", str(tmp_path / "sft")]) == 0
    part = tmp_path / "sft" / "parts" / "part-00000"
    for prefix, record in ((part / "tokens", part / "identity.json"),
                           (tmp_path / "sft" / "merged", tmp_path / "sft" / "merged.json")):
        capsys.readouterr()
        assert main(["inspect", str(prefix)]) == 0
        out = capsys.readouterr().out
        assert f"text tokenizer: {tokenizer / 'tokenizer.json'} (recorded in {record})" in out
        assert "General Kenobi." in out
    assert main(["inspect", str(part / "tokens"), "--text-tokenizer", str(tokenizer)]) == 0
    assert "(--text-tokenizer)" in capsys.readouterr().out
