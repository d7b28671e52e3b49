"""The README's first quick-start command runs `mmtok demo`: it must keep working end to end."""

import importlib.util
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from megatron.core.datasets.indexed_dataset import IndexedDataset

from mmtok.cli import main
from mmtok.commands.demo_flow import CHAT_TOKENIZER, LEGACY_MARKER, MARKER, WRITES, demo_conversations
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout

REPO = Path(__file__).resolve().parent.parent


def test_demo_runs_the_whole_flow_and_counts_the_broken_download(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    log = captured.out
    images = json.loads((out / "encoded" / "merged.json").read_text())
    counts = images.get("counts", images)
    assert counts["images_written"] == 11  # 12 photos and the looping caption's sample, less the two curated out
    assert counts["skipped:decode_error"] == 1  # the truncated JPEG, found at decode time
    # curation: one benchmark match (the half-size rocket) and one caption flag, by sample id, with pictures
    plan = json.loads((out / "plan" / "plan.json").read_text())
    assert plan["dropped_by_reason"] == {"contaminated": 1, "caption_flagged": 1}
    listed = {r["key"]: r["rule"] for r in pq.read_table(out / "curation" / "dedup" / "dropped.parquet").to_pylist()}
    assert listed == {"rocket": "benchmark", "looping_caption": "caption_loop"}
    report = (out / "curation" / "dedup" / "report" / "index.md").read_text()
    assert "| demo-images | 13 | 11 | 0 | 1 | 1 | 0 |" in report and "benchmark demo-bench:question-0017" in report
    assert "curation: of 13 images hashed, dropped before the GPUs: 1 matching the benchmark, 1 flagged" in captured.err
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


def test_demo_refuses_an_out_that_holds_its_checkpoint(tmp_path, capsys):
    """`--out D --image-checkpoint D/checkpoints/X` once removed D, checkpoint included, then failed."""
    from mmtok.codecs import emu35

    out = tmp_path / "demo"
    checkpoint = emu35.write_random_checkpoint(out / "checkpoints" / "mine")
    (out / MARKER).write_bytes(LEGACY_MARKER)  # an earlier demo's output, as in the report
    before = {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()}
    assert main(["demo", "--out", str(out), "--image-checkpoint", str(checkpoint), "--no-audio"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"the input {checkpoint} is inside --out {out}" in line
    assert {p: p.read_bytes() for p in checkpoint.rglob("*") if p.is_file()} == before


def test_a_rerun_replaces_only_what_the_demo_wrote(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--out", str(out), "--no-audio"]) == 0
    (out / "notes.txt").write_text("mine")
    (out / "results").mkdir()
    stale = out / "encoded" / "stale.bin"  # inside a directory the demo wrote: the demo's to replace
    stale.write_bytes(b"x")
    assert main(["demo", "--out", str(out), "--no-audio"]) == 0
    assert (out / "notes.txt").read_text() == "mine" and (out / "results").is_dir()
    assert not stale.exists() and (out / "encoded" / "merged.bin").is_file()
    assert json.loads((out / MARKER).read_text())["wrote"] == list(WRITES)


@pytest.mark.parametrize("planted", ["directory", "symlink"])
def test_a_name_the_demo_writes_but_did_not_write_is_never_deleted(tmp_path, capsys, planted):
    out = tmp_path / "demo"
    out.mkdir()
    (out / MARKER).write_text(json.dumps({"format": "mmtok-demo/1", "wrote": ["checkpoints"]}))
    if planted == "directory":
        (out / "plan").mkdir()
        (out / "plan" / "mine.txt").write_text("mine")
    else:
        (tmp_path / "data").mkdir()
        (out / "plan").symlink_to(tmp_path / "data")
    assert main(["demo", "--out", str(out), "--no-audio"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert f"{out} holds plan, which no earlier demo wrote there" in line
    assert (out / "plan" / "mine.txt").is_file() if planted == "directory" else (out / "plan").is_symlink()


def test_the_demo_template_opens_an_assistant_turn_for_generation_as_the_release_does():
    """Issue 34.5: with add_generation_prompt the release's template ends in <|assistant_start|>; so does the
    demo's (mmtok renders training data without it)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(CHAT_TOKENIZER))
    messages = [{"role": "user", "content": "Hello."}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    training = tokenizer.apply_chat_template(messages, tokenize=False)
    assert prompt == training + "<|assistant_start|>" and prompt.startswith("<s>")
    assert tokenizer("Hello.")["input_ids"][0] != tokenizer.bos_token_id  # the template owns BOS, as the release's


def test_a_legacy_demo_output_never_owns_the_curation_folder_it_could_not_have_written(tmp_path, capsys):
    out = tmp_path / "demo"
    (out / "curation").mkdir(parents=True)
    (out / "curation" / "mine.txt").write_text("mine")
    (out / MARKER).write_bytes(LEGACY_MARKER)  # a demo from before curation: it wrote no curation/
    assert main(["demo", "--out", str(out), "--no-audio"]) == 2
    assert f"{out} holds curation, which no earlier demo wrote there" in capsys.readouterr().err
    assert (out / "curation" / "mine.txt").read_text() == "mine"
