"""The README's first quick-start command runs `mmtok demo`: it must keep working end to end."""

import importlib.util
import json
from pathlib import Path

from megatron.core.datasets.indexed_dataset import IndexedDataset

from mmtok.cli import main
from mmtok.commands.demo_flow import CHAT_TOKENIZER, demo_conversations
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_the_whole_flow_and_counts_the_broken_download(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    log = capsys.readouterr().out
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
    _check_sft(out / "sft" / "dataset", log, conversations=len(demo_conversations()))


def _check_sft(sft: Path, log: str, conversations: int) -> None:
    """Every demo conversation but the planted one is a sequence, media blocks where its messages put them."""
    counts = json.loads((sft / "merged.json").read_text())["counts"]
    assert counts["conversations"] == conversations
    assert counts["documents_written"] == conversations - 1
    assert counts["skipped:placeholder_mismatch"] == 1
    [skip] = [json.loads(line) for line in (sft / "merged.skipped.jsonl").read_text().splitlines()]
    assert (skip["key"], skip["reason"]) == ("demo-chat-000000/two_placeholders_one_clip", "placeholder_mismatch")
    dataset = IndexedDataset(str(sft / "merged"))
    layout = VocabLayout(text_size=load_text_tokenizer(str(CHAT_TOKENIZER)).vocab_size)
    kinds = [[segment[0] for segment in layout.split_sequence(dataset[i])] for i in range(len(dataset))]
    assert kinds == [["text", "image", "text", "audio", "text"],  # photo + spoken clip
                     ["text", "audio", "text", "audio", "text"],  # speech only, two turns
                     ["text", "image", "text"]]                   # tool call inside a reasoning span
    stripped = IndexedDataset(str(sft / "merged_no_reasoning"))
    assert len(stripped) == len(dataset) and len(stripped[2]) < len(dataset[2])
    shown = log.split(f"$ mmtok inspect {sft / 'merged'}", 1)[1].splitlines()
    assert sum(line.startswith("<image ") for line in shown) == 2
    assert sum(line.startswith("<audio ") for line in shown) == 3


def test_bundled_chat_tokenizer_is_what_its_script_makes(tmp_path):
    spec = importlib.util.spec_from_file_location("make_demo_chat_tokenizer",
                                                  REPO / "benchmarks" / "make_demo_chat_tokenizer.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    made = script.make_chat_tokenizer(tmp_path / "tok")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (made / name).read_bytes() == (CHAT_TOKENIZER / name).read_bytes(), \
            f"{CHAT_TOKENIZER / name} is stale: rerun `python benchmarks/make_demo_chat_tokenizer.py`"


def test_demo_refuses_to_overwrite_a_directory_it_did_not_write(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("keep me")
    assert main(["demo", "--out", str(tmp_path), "--no-audio"]) == 2
    assert "not an earlier demo output" in capsys.readouterr().err
    assert (tmp_path / "precious.txt").read_text() == "keep me"
