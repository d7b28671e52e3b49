"""The README's first quick-start command runs `mmtok demo`: it must keep working end to end."""

import json

from megatron.core.datasets.indexed_dataset import IndexedDataset

from mmtok.cli import main
from mmtok.vocab import VocabLayout


def test_demo_runs_the_whole_flow_and_counts_the_broken_download(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    images = json.loads((out / "encoded" / "merged.json").read_text())
    counts = images.get("counts", images)
    assert counts["images_written"] == 12
    assert counts["skipped:decode_error"] == 1  # the truncated JPEG, found at decode time
    dataset = IndexedDataset(str(out / "encoded" / "merged"))
    layout = VocabLayout()
    for i in range(len(dataset)):
        kinds = [segment[0] for segment in layout.split_sequence(dataset[i])]
        assert kinds == ["text", "image", "text"]  # BOS, block, caption + EOS
    audio = IndexedDataset(str(out / "audio" / "encoded" / "merged"))
    assert len(audio) == 8
    assert (out / "audio" / "interleaved" / "stage.idx").is_file()


def test_demo_refuses_to_overwrite_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path), "--no-audio"]) == 2
    assert "not an earlier demo output" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
