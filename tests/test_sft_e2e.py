"""Omni SFT end to end on real media (issue 16): conversation tars and a .jsonl whose user turns carry real
photos and real speech go through scan -> plan --mode sft -> image encode, audio convert --kind conversations
-> audio encode, and the plain pretraining path for the same speech files; `mmtok sft` makes the sequences and
`mmtok merge --strip-reasoning` the dataset.

The corpus (`_write_corpus`) has every content form the test template knows (typed placeholders, OpenAI parts
with inline `input_audio`, the Apertus `{"parts"}` / `{"blocks"}` forms with a tool call), media interleaved,
a text-only turn, a relative file path and a `{"cut_id"}` reference into the pretraining cache, and four bad
inputs, each of which must be a named skip while everything else is written. The expected sequences are
written out by hand (`_conversations`): special tokens by name, text, and where each medium's block goes.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import soundfile
import torch

import mmtok.sft.build
from audio_corpus import digit
from chatkit import CHAT_TOKENS, DEFAULT_SYSTEM, TEMPLATE, WEATHER_TOOL
from encodekit import damaged_jpeg, image_items, real_images, train_chat_tokenizer, write_tar
from mmtok.cli import main
from mmtok.codecs import emu35, wavtokenizer
from mmtok.formats import audio_cache, partdir
from mmtok.formats.commitlog import read_commits
from mmtok.formats.items import read_items
from mmtok.formats.megatron import read_sequences
from mmtok.formats.partdir import is_done, part_dir
from mmtok.fsutil import sha256_file
from mmtok.text import load_text_tokenizer
from mmtok.vocab import VocabLayout
from realmedia import alsa_sounds, espeak
from summaries import json_result, summary_lines

UNIT = 2  # conversations per sft unit in every run here: 11 conversations are 6 units
ITEM = 2  # units per sft work item where a test splits the conversations: 6 units are 3 items

# -- the tokenizer: the omni test template plus `reasoning_content` on assistant messages --------------------
ASSISTANT_CONTENT = ("{%- if message.content is string -%}\n      {{- message.content -}}\n"
                     "    {%- elif message.content is mapping and 'blocks' in message.content -%}")
REASONING = ("{%- if message.reasoning_content -%}{{- '<|inner_prefix|>' ~ message.reasoning_content ~ "
             "'<|inner_suffix|>' -}}{%- endif -%}\n    ")
assert TEMPLATE.count(ASSISTANT_CONTENT) == 1
REASONING_TEMPLATE = TEMPLATE.replace(ASSISTANT_CONTENT, REASONING + ASSISTANT_CONTENT)
TRAINING_TEXT = [
    "Listen to the question about the photo of the cat and answer it.",
    "Which digit is spoken? One, two, three, four. Which speaker is this? The front center speaker.",
    "The rocket waits on the launch pad; the weather in Zurich is cloudy, 14 degrees.",
    f"{DEFAULT_SYSTEM} Be brief. Deliberation: enabled disabled. Tool Capabilities: weather city.",
    "0 1 2 3 4 5 6 7 8 9 * x",
]


def omni_tokenizer(directory: Path) -> Path:
    """A small byte-level BPE with the omni chat tokens and REASONING_TEMPLATE; returns its directory."""
    return train_chat_tokenizer(directory, vocab_size=380, special=["<unk>", "<s>", "</s>"], added=CHAT_TOKENS,
                                texts=TRAINING_TEXT, template=REASONING_TEMPLATE)


# -- the corpus --------------------------------------------------------------------------------------------
# Speech files of the pretraining directory (SPEECH/): the same files are tar members, inline bytes, a
# relative path and a pretraining clip of the conversations. Name -> how it is made.
QUESTION = "What is the cat looking at?"
SENTENCE = "The ship left the harbour at dawn."
SPEECH = {"question.wav": ("espeak", QUESTION), "one.wav": ("digit", "1"), "two.wav": ("digit", "2"),
          "sentence.wav": ("espeak", SENTENCE), "front.wav": ("alsa", "Front_Center.wav"), "three.wav": ("digit", "3")}


class Image:
    """Where image `index` of a tar sample's conversation goes in a reference."""

    def __init__(self, index: int):
        self.index = index


class Clip:
    """Where the audio clip `cut_id` goes in a reference; `file` is the SPEECH file it was made from."""

    def __init__(self, cut_id: str, file: str):
        self.cut_id, self.file = cut_id, file


def _preamble(thinking: bool = False, system: str = DEFAULT_SYSTEM, tools: str | None = None) -> list:
    developer = "Deliberation: " + ("enabled" if thinking else "disabled") + "\n" + (
        "Tool Capabilities:\n" + tools if tools else "Tool Capabilities: disabled")
    return ["<s>", "<|system_start|>", system, "<|system_end|>", "<|developer_start|>", developer, "<|developer_end|>"]


def _turn(*parts) -> list:
    return ["<|user_start|>", *parts, "<|user_end|>"]


def _conversations(inline_question: str) -> dict[str, dict]:
    """Conversation id ("<tar stem>/<key>" for a tar sample, else a .jsonl line's id), in input order ->
    "record"; "members" of a tar sample: [(name after "KEY.", what its bytes are)]; and either "reference",
    the sequence written by hand, or "reason", why the conversation must be skipped."""
    calls = json.dumps([{"weather": {"city": "Zurich"}}])
    return {
        "omni-0/a000": {  # a photo and a spoken question: typed <image>, an OpenAI input_audio part; reasoning
            "members": [("0.png", "chelsea.png")],
            "record": {"enable_thinking": True, "messages": [
                {"role": "user", "content": [
                    {"type": "text", "text": "<image>\nListen: "},
                    {"type": "input_audio", "input_audio": {"data": inline_question, "format": "wav"}}]},
                {"role": "assistant", "reasoning_content": "The speaker asks what the cat looks at.",
                 "content": "The cat looks at the camera."}]},
            "reference": [*_preamble(thinking=True), *_turn(Image(0), "\nListen: ",
                                                            Clip("omni-0/a000/audio-0", "question.wav")),
                          "<|assistant_start|>", "<|inner_prefix|>", "The speaker asks what the cat looks at.",
                          "<|inner_suffix|>", "The cat looks at the camera.", "<|assistant_end|>", "</s>"]},
        "omni-0/a001": {  # audio only: a typed placeholder, the sample's wav member
            "members": [("0.wav", "one.wav")],
            "record": {"messages": [{"role": "user", "content": "<|audio|> Which digit is spoken?"},
                                    {"role": "assistant", "content": "One."}]},
            "reference": [*_preamble(), *_turn(Clip("omni-0/a001/audio-0", "one.wav"), " Which digit is spoken?"),
                          "<|assistant_start|>", "One.", "<|assistant_end|>", "</s>"]},
        "omni-0/a002": {  # a tool call with reasoning and a photo: Apertus parts (user) and blocks (assistant)
            "members": [("0.jpg", "rocket.jpg")],
            "record": {"tools": [WEATHER_TOOL], "messages": [
                {"role": "system", "content": {"text": "Be brief."}},
                {"role": "user", "content": {"parts": [
                    {"type": "image", "image": "0.jpg"},
                    {"type": "text", "text": " The rocket waits on the launch pad: the weather in Zurich?"}]}},
                {"role": "assistant", "content": {"blocks": [
                    {"type": "thoughts", "text": "Zurich, so I ask for the weather in Zurich."}]},
                 "tool_calls": [{"type": "function",
                                 "function": {"name": "weather", "arguments": '{"city": "Zurich"}'}}]},
                {"role": "tool", "content": "cloudy, 14 degrees"},
                {"role": "assistant", "content": {"blocks": [
                    {"type": "thoughts", "text": " It is cloudy."},
                    {"type": "response", "text": "Cloudy, 14 degrees."}]}}]},
            "reference": [*_preamble(system="Be brief.", tools=json.dumps(WEATHER_TOOL)),
                          *_turn(Image(0), " The rocket waits on the launch pad: the weather in Zurich?"),
                          "<|assistant_start|>", "<|inner_prefix|>", "Zurich, so I ask for the weather in Zurich.",
                          "<|tools_prefix|>", calls, "<|tools_suffix|>", "<|tool_output_start|>",
                          "cloudy, 14 degrees", "<|tool_output_end|>", " It is cloudy.", "<|inner_suffix|>",
                          "Cloudy, 14 degrees.", "<|assistant_end|>", "</s>"]},
        "omni-1/a003": {  # two clips and two photos interleaved over two turns
            "members": [("0.png", "coffee.png"), ("1.png", "astronaut.png"), ("0.wav", "two.wav"),
                        ("1.wav", "sentence.wav")],
            "record": {"messages": [
                {"role": "user", "content": [
                    {"type": "image", "image": "0.png"}, {"type": "text", "text": " and "},
                    {"type": "audio", "audio": "0.wav"}, {"type": "text", "text": ": which digit?"}]},
                {"role": "assistant", "content": "Two."},
                {"role": "user", "content": {"parts": [
                    {"type": "audio", "audio": "1.wav"}, {"type": "text", "text": " then "},
                    {"type": "image_url", "image_url": {"url": "1.png"}}]}},
                {"role": "assistant", "content": "The ship, then the astronaut."}]},
            "reference": [*_preamble(), *_turn(Image(0), " and ", Clip("omni-1/a003/audio-0", "two.wav"),
                                               ": which digit?"),
                          "<|assistant_start|>", "Two.", "<|assistant_end|>",
                          *_turn(Clip("omni-1/a003/audio-1", "sentence.wav"), " then ", Image(1)),
                          "<|assistant_start|>", "The ship, then the astronaut.", "<|assistant_end|>", "</s>"]},
        "omni-1/a004": {  # text only
            "members": [],
            "record": {"messages": [{"role": "user", "content": "What is the weather in Zurich?"},
                                    {"role": "assistant", "content": "Cloudy, 14 degrees."}]},
            "reference": [*_preamble(), *_turn("What is the weather in Zurich?"), "<|assistant_start|>",
                          "Cloudy, 14 degrees.", "<|assistant_end|>", "</s>"]},
        "omni-1/a005": {  # two audio placeholders, one wav member
            "members": [("0.wav", "four")],
            "record": {"messages": [{"role": "user", "content": "<|audio|> <|audio|> Which is larger?"},
                                    {"role": "assistant", "content": "Four."}]},
            "reason": "placeholder_mismatch"},
        "omni-2/a006": {  # a truncated JPEG: its header scans, its pixels do not decode
            "members": [("0.jpg", "damaged")],
            "record": {"messages": [{"role": "user", "content": "<image> What is this?"},
                                    {"role": "assistant", "content": "A rocket."}]},
            "reason": "media_skipped:decode_error"},
        "omni-2/a007": {  # digital silence: dropped by the conversion
            "members": [("0.wav", "silent")],
            "record": {"messages": [{"role": "user", "content": "<|audio|> Is anything said?"},
                                    {"role": "assistant", "content": "No."}]},
            "reason": "media_skipped:silent"},
        "j-rel": {  # a .jsonl conversation: audio by a path relative to the file
            "record": {"messages": [
                {"role": "user", "content": [{"type": "audio", "audio": "speech/front.wav"},
                                             {"type": "text", "text": " Which speaker is this?"}]},
                {"role": "assistant", "content": "The front center speaker."}]},
            "reference": [*_preamble(), *_turn(Clip("j-rel/audio-0", "front.wav"), " Which speaker is this?"),
                          "<|assistant_start|>", "The front center speaker.", "<|assistant_end|>", "</s>"]},
        "j-cut": {  # a clip of the pretraining path's audio cache
            "record": {"messages": [
                {"role": "user", "content": [{"type": "text", "text": "Which digit is "},
                                             {"type": "audio", "audio": {"cut_id": "three"}},
                                             {"type": "text", "text": "?"}]},
                {"role": "assistant", "content": "Three."}]},
            "reference": [*_preamble(), *_turn("Which digit is ", Clip("three", "three.wav"), "?"),
                          "<|assistant_start|>", "Three.", "<|assistant_end|>", "</s>"]},
        "j-missing": {  # a relative path to no file
            "record": {"messages": [
                {"role": "user", "content": [{"type": "audio", "audio": "speech/gone.wav"},
                                             {"type": "text", "text": " Which digit is spoken?"}]},
                {"role": "assistant", "content": "Four."}]},
            "reason": "missing_media"},
    }


def _write_corpus(root: Path) -> SimpleNamespace:
    """SPEECH/ (the pretraining directory), three conversation tars and talk.jsonl under `root`."""
    speech = root / "speech"
    speech.mkdir(parents=True)
    for name, (how, what) in SPEECH.items():
        if how == "espeak":
            espeak(what, speech / name)
        elif how == "digit":
            (speech / name).write_bytes(digit(what).read_bytes())
        else:
            (speech / name).write_bytes(next(p for p in alsa_sounds() if p.name == what).read_bytes())
    soundfile.write(root / "silent.wav", np.zeros(16_000, np.float32), 16_000, subtype="PCM_16")
    images = real_images()
    media = {**{name: path.read_bytes() for name, path in images.items()},
             **{name: (speech / name).read_bytes() for name in SPEECH},
             "four": digit("4").read_bytes(), "silent": (root / "silent.wav").read_bytes(),
             "damaged": damaged_jpeg(images["rocket.jpg"].read_bytes())}
    conversations = _conversations(base64.b64encode(media["question.wav"]).decode())
    tars: dict[str, list] = {}
    for ident, spec in conversations.items():
        if "/" not in ident:
            continue
        stem, key = ident.split("/")
        tars.setdefault(stem, []).extend([(f"{key}.{suffix}", media[source]) for suffix, source in spec["members"]])
        tars[stem].append((f"{key}.json", json.dumps(spec["record"]).encode()))
    inputs = [write_tar(root / f"{stem}.tar", members) for stem, members in tars.items()]
    jsonl = root / "talk.jsonl"
    jsonl.write_text("".join(json.dumps({"id": ident, **spec["record"]}) + "\n"
                             for ident, spec in conversations.items() if "/" not in ident))
    return SimpleNamespace(root=root, speech=speech, inputs=[*inputs, jsonl], conversations=conversations)


# -- the pipeline ------------------------------------------------------------------------------------------
SMALL_IMAGES = ["--min-pixels", "1024", "--max-pixels", "2304", "--min-source-pixels", "100", "--token-budget", "40",
                "--max-batch-images", "1", "--item-seconds", "0.00001"]  # 32-48 px, one image per batch: 5 batches,
# each its own work item, so each of 3 ranks has at least one


def _run(*argv) -> None:
    assert main([*map(str, argv)]) == 0, argv


def _ranks(world_size: int, *argv) -> None:
    for rank in range(world_size):
        _run(*argv, "--rank", rank, "--world-size", world_size)


def _encode_media(env: SimpleNamespace, work: Path, world_size: int) -> SimpleNamespace:
    """The conversations' images and audio encoded with `world_size` ranks under `work`."""
    out = SimpleNamespace(images=work / "images", converted=work / "converted", audio=work / "audio")
    _ranks(world_size, "encode", "--plan", env.plan, "--checkpoint", env.emu35, "--out", out.images, "--device", "cpu",
           "--loader-threads", 1, "--no-progress")
    _run("audio", "convert", "--kind", "conversations", *env.corpus.inputs, "--text-tokenizer", env.text, "--out",
         out.converted, "--shard-size", 2, "--workers", 0, "--no-progress")
    _ranks(world_size, "encode", "--modality", "audio", "--shar", out.converted, "--checkpoint", env.wavtokenizer,
           "--text-tokenizer", env.text, "--out", out.audio, "--num-workers", 0, "--no-progress")
    return out


def _sft_argv(env: SimpleNamespace, media: SimpleNamespace, out: Path) -> list:
    return ["sft", *env.corpus.inputs, "--text-tokenizer", env.text, "--images", media.images, "--audio", media.audio,
            "--audio", env.pretrain, "--converted", media.converted, "--out", out, "--no-progress"]


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    """The corpus, the tokenizer, tiny random codecs, the scan + plan, the pretraining path's encode of
    SPEECH/, and the conversations made with one rank of everything (SFT), merged with --strip-reasoning."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("sft-e2e")
    env = SimpleNamespace(corpus=_write_corpus(root / "data"), text=omni_tokenizer(root / "tokenizer"),
                          emu35=emu35.write_random_checkpoint(root / "emu35"),
                          wavtokenizer=wavtokenizer.write_random_checkpoint(root / "wavtokenizer"),
                          manifest=root / "manifest", plan=root / "plan", pretrain=root / "pretrain")
    tars = [p for p in env.corpus.inputs if p.suffix == ".tar"]
    _run("scan", *tars, "--out", env.manifest, "--workers", 1, "--no-progress")
    _run("plan", env.manifest, "--mode", "sft", "--text-tokenizer", env.text, "--out", env.plan, "--quiet",
         *SMALL_IMAGES)
    _run("audio", "convert", env.corpus.speech, "--text-tokenizer", env.text, "--out", root / "pretrain-shar",
         "--workers", 0, "--no-progress")
    _run("encode", "--modality", "audio", "--shar", root / "pretrain-shar", "--checkpoint", env.wavtokenizer,
         "--text-tokenizer", env.text, "--out", env.pretrain, "--num-workers", 0, "--no-progress")
    _run("merge", env.pretrain)
    env.media = _encode_media(env, root / "one-rank", 1)
    env.sft = root / "one-rank" / "sft"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
        _run(*_sft_argv(env, env.media, env.sft))
    _run("merge", env.sft, "--strip-reasoning")
    env.tokenizer = load_text_tokenizer(str(env.text))
    env.layout = VocabLayout(text_size=env.tokenizer.vocab_size)
    return env


# -- reading the outputs back ------------------------------------------------------------------------------
def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _cache_ids(*outs: Path) -> dict[str, np.ndarray]:
    """cut id -> audio ids, from the audio token caches of audio encode outputs."""
    found = {}
    for out in outs:
        for path in audio_cache.find_cache_parts(out):
            cut_ids = audio_cache.read_cache_index(path).column("cut_id").to_pylist()
            found.update(zip(cut_ids, audio_cache.read_tokens(path)[0], strict=True))
    return found


def _expected_ids(env, ident: str, items: dict, clips: dict) -> list[int]:
    """The hand-written reference of conversation `ident` with every medium's block in its place."""
    stem, _, key = ident.partition("/")
    start, end = env.layout.special_id("<|audio_start|>"), env.layout.special_id("<|audio_end|>")
    ids: list[int] = []
    for part in env.corpus.conversations[ident]["reference"]:
        if isinstance(part, Image):
            ids.extend(items[(f"{stem}.tar", key, part.index)].tolist())
        elif isinstance(part, Clip):
            ids.extend([start, *clips[part.cut_id].tolist(), end])
        elif part.startswith("<") and part.endswith(">") and " " not in part:
            ids.append(env.tokenizer.token_id(part))
        else:
            ids.extend(env.tokenizer.encode(part))
    return ids


def _texts(reference: list) -> list[str]:
    """The text between a reference's media, as it decodes (special tokens by name)."""
    texts = [""]
    for part in reference:
        if isinstance(part, str):
            texts[-1] += part
        else:
            texts.append("")
    return [text for text in texts if text]


def _written(env) -> list[str]:
    return [ident for ident, spec in env.corpus.conversations.items() if "reference" in spec]


def _fingerprint(out: Path) -> dict[str, str]:
    return {name: sha256_file(out / name) for name in ("merged.bin", "merged.idx", "merged.provenance.jsonl",
                                                       "merged.skipped.jsonl")}


# -- the tests -----------------------------------------------------------------------------------------------
def test_every_sequence_opens_in_megatron_core_and_is_its_hand_written_conversation(env):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    from mmtok.formats.megatron import release_reader

    dataset = IndexedDataset(str(env.sft / "merged"))
    sequences = [np.array(dataset[i]) for i in range(len(dataset))]  # copies: the reader is released next
    release_reader(dataset)
    del dataset
    provenance = _lines(env.sft / "merged.provenance.jsonl")
    assert [p["conversation"] for p in provenance] == _written(env)  # in input order, nothing else
    items, clips = image_items(env.media.images), _cache_ids(env.media.audio, env.pretrain)
    for record, tokens in zip(provenance, sequences, strict=True):
        ident = record["conversation"]
        assert tokens.tolist() == _expected_ids(env, ident, items, clips), ident
        reference = env.corpus.conversations[ident]["reference"]
        assert record["audio"] == [p.cut_id for p in reference if isinstance(p, Clip)], ident
        assert len(record["image"]) == sum(isinstance(p, Image) for p in reference), ident
        segments = env.layout.split_sequence(tokens)  # every block parses; the text around them decodes back
        assert [s[0] for s in segments if s[0] != "text"] == [
            "image" if isinstance(p, Image) else "audio" for p in reference if not isinstance(p, str)], ident
        assert [env.tokenizer.decode(s[1].tolist()) for s in segments if s[0] == "text"] == _texts(reference), ident
    interleaved = next(p for p in provenance if p["conversation"] == "omni-1/a003")
    assert [m.rsplit(":", 1)[1] for m in interleaved["image"]] == ["a003.0.png", "a003.1.png"]


def test_every_audio_block_is_the_pretraining_paths_tokens_of_the_same_file(env):
    pretrain = {}  # file name -> the audio ids of its pretraining sequence <s> <|audio_start|> ids <|audio_end|> </s>
    for record, tokens in zip(_lines(env.pretrain / "merged.provenance.jsonl"), read_sequences(env.pretrain / "merged"),
                              strict=True):
        assert (tokens[0], tokens[-1]) == (env.tokenizer.bos_id, env.tokenizer.eos_id)
        (segment,) = env.layout.split_sequence(tokens[1:-1])
        assert segment[0] == "audio"
        pretrain[f"{record['cut_id']}.wav"] = segment[1].tolist()
    assert set(pretrain) == set(SPEECH)
    compared = []
    for record, tokens in zip(_lines(env.sft / "merged.provenance.jsonl"), read_sequences(env.sft / "merged"),
                              strict=True):
        blocks = [s[1].tolist() for s in env.layout.split_sequence(tokens) if s[0] == "audio"]
        files = [p.file for p in env.corpus.conversations[record["conversation"]]["reference"] if isinstance(p, Clip)]
        assert len(blocks) == len(files) == len(record["audio"])
        for file, codes in zip(files, blocks, strict=True):
            assert codes == pretrain[file], (record["conversation"], file)
            compared.append(file)
    assert sorted(compared) == sorted(SPEECH)  # every file: inline bytes, members, a relative path, a cache clip


def test_merged_bytes_do_not_depend_on_the_world_size_of_the_encodes_and_of_sft(env, tmp_path, monkeypatch):
    media = _encode_media(env, tmp_path, 3)
    image_parts = sorted((media.images / "parts").glob("part-*"))
    assert len(image_parts) == 5 and all(read_items(d)[0] for d in image_parts)  # a part per work item
    assert len(audio_cache.find_cache_parts(media.audio)) == 3
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    monkeypatch.setattr(mmtok.sft.build, "UNITS_PER_ITEM", ITEM)
    _ranks(3, *_sft_argv(env, media, tmp_path / "sft"), "--no-take-over")
    per_item = [partdir.read_stats(part_dir(tmp_path / "sft", item))["units"] for item in range(3)]
    assert per_item == [[0, 2], [2, 4], [4, 6]]  # 3 work items, one for each of the 3 workers
    _run("merge", tmp_path / "sft", "--strip-reasoning")
    assert _fingerprint(tmp_path / "sft") == _fingerprint(env.sft)
    for name in ("merged_no_reasoning.bin", "merged_no_reasoning.idx"):
        assert sha256_file(tmp_path / "sft" / name) == sha256_file(env.sft / name)


def _gated_sft(argv: list[str], committed, gate) -> None:
    """A child `mmtok sft` (UNIT conversations per unit, ITEM units per work item) that waits for one permit from
    `gate` before each unit's commit and announces each finished commit on `committed`: it commits exactly what is
    allowed."""
    mmtok.sft.build.CONVERSATIONS_PER_UNIT = UNIT  # this forked child only
    mmtok.sft.build.UNITS_PER_ITEM = ITEM
    commit = mmtok.sft.build._Unit.commit

    def gated(self, part):
        gate.acquire()
        commit(self, part)
        committed.release()

    mmtok.sft.build._Unit.commit = gated
    sys.exit(main(argv))


def test_sigkill_inside_a_work_item_then_resume_with_3_workers_gives_the_clean_merged_bytes(env, tmp_path,
                                                                                           monkeypatch, forkserver):
    # one worker killed twice (after 2 committed units: item 0 finished; then after 1 more: inside item 1), the
    # job finished by 3 workers: each conversation after the last commit is built exactly once
    out = tmp_path / "sft"
    argv = [*map(str, _sft_argv(env, env.media, out))]
    for allowed, total in ((2, 2), (1, 3)):
        committed, gate = forkserver.Semaphore(0), forkserver.Semaphore(0)
        process = forkserver.Process(target=_gated_sft, args=(argv, committed, gate))
        process.start()
        for _ in range(allowed):
            gate.release()
        deadline = time.monotonic() + 60
        for _ in range(allowed):
            while not committed.acquire(timeout=0.01):
                assert process.is_alive() and time.monotonic() < deadline, process.exitcode
        # the child now waits at the next unit's gate (or is on its way there): nothing more can commit
        os.kill(process.pid, signal.SIGKILL)
        process.join()
        assert process.exitcode == -signal.SIGKILL
        units = [r["unit"] for item in range(2) if part_dir(out, item).is_dir()
                 for r in read_commits(part_dir(out, item))[0]]
        assert units == list(range(total))
    assert is_done(part_dir(out, 0)) and not is_done(part_dir(out, 1))
    built = []
    build = mmtok.sft.build.ConversationBuilder.build
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)
    monkeypatch.setattr(mmtok.sft.build, "UNITS_PER_ITEM", ITEM)
    monkeypatch.setattr(mmtok.sft.build.ConversationBuilder, "build",
                        lambda self, c: built.append(c.id) or build(self, c))
    _ranks(3, *argv, "--no-take-over")  # worker 1 resumes item 1 after its first unit, worker 2 does item 2
    assert built == list(env.corpus.conversations)[3 * UNIT:]  # every conversation after the third unit, once
    _run("merge", out, "--strip-reasoning")
    assert _fingerprint(out) == _fingerprint(env.sft)


def test_stripped_copy_is_the_merged_sequences_without_their_reasoning_spans(env):
    markers = [env.tokenizer.token_id("<|inner_prefix|>"), env.tokenizer.token_id("<|inner_suffix|>")]
    merged = list(read_sequences(env.sft / "merged"))
    stripped = list(read_sequences(env.sft / "merged_no_reasoning"))
    spans = 0
    assert len(merged) == len(stripped) == len(_written(env))
    for full, short in zip(merged, stripped, strict=True):
        assert not np.isin(short, markers).any()
        keep, inside = [], False
        for token in full.tolist():
            if token == markers[0]:
                inside, spans = True, spans + 1
            elif token == markers[1]:
                inside = False
            elif not inside:
                keep.append(token)
        assert short.tolist() == keep
    assert spans == 2  # a000's reasoning_content, a002's thoughts around the tool call
    summary = json.loads((env.sft / "merged.json").read_text())["strip_reasoning"]
    assert summary["spans_removed"] == spans and summary["dropped_empty_sequences"] == 0
    assert (env.sft / "merged_no_reasoning.provenance.jsonl").read_text() == \
        (env.sft / "merged.provenance.jsonl").read_text()


def test_each_bad_input_is_a_counted_reason_naming_its_conversation_and_the_rest_is_written(env):
    expected = {ident: spec["reason"] for ident, spec in env.corpus.conversations.items() if "reason" in spec}
    skipped = _lines(env.sft / "merged.skipped.jsonl")
    assert {s["key"]: s["reason"] for s in skipped} == expected and len(skipped) == len(expected)
    summary = json.loads((env.sft / "merged.json").read_text())
    counts = summary["counts"]
    assert {k: v for k, v in counts.items() if k.startswith("skipped:")} == {
        f"skipped:{reason}": list(expected.values()).count(reason) for reason in expected.values()}
    assert counts["documents_skipped"] == len(expected)
    assert counts["documents_written"] == len(_written(env)) == summary["sequences"]
    assert counts["documents_written"] + counts["documents_skipped"] == counts["conversations"] == \
        len(env.corpus.conversations)
    assert counts["images_written"] == 4 and counts["audio_written"] == 6  # the written conversations' media
    named = {s["key"]: (s["source"], s["detail"]) for s in skipped}
    assert named["j-missing"][0].endswith("talk.jsonl:line 3") and "speech/gone.wav" in named["j-missing"][1]
    assert named["omni-2/a006"][0].endswith("omni-2.tar:a006") and "a006.0.jpg" in named["omni-2/a006"][1]
    assert "omni-2/a007/audio-0" in named["omni-2/a007"][1] and "1 audio member" in named["omni-1/a005"][1]


def test_merging_the_sft_image_encode_is_refused_in_one_line_naming_mmtok_sft(env, capsys):
    capsys.readouterr()
    assert main(["merge", str(env.media.images)]) == 2  # as typed: progress on
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()  # the refusal alone: it comes before the parts' bytes are checked
    assert line.startswith("mmtok merge: error: ") and "`mmtok sft " in line and captured.out == ""
    assert not list(env.media.images.glob("merged*"))


def test_the_sft_summary_goes_to_stderr_and_json_prints_the_rank_result(env, capsys, monkeypatch):
    monkeypatch.setattr(mmtok.sft.build, "CONVERSATIONS_PER_UNIT", UNIT)  # the identity env.sft was written with
    capsys.readouterr()
    _run(*_sft_argv(env, env.media, env.sft))  # a finished part: nothing to do, the same summary
    lines = summary_lines(capsys.readouterr(), "sft")
    assert lines[0] == (f"mmtok sft: rank 0/1: 1 own work item of 1, {part_dir(env.sft, 0)}, already finished "
                        f"({len(_written(env))} sequences); nothing to do")
    _run(*_sft_argv(env, env.media, env.sft), "--json")
    result = json_result(capsys.readouterr())
    assert set(result) == {  # the --json contract: a key renamed or lost breaks a user's script
        "rank", "world_size", "items", "num_items", "counts", "parts", "sequences", "already_done", "stopped",
        "taken_over", "held_by_others", "unfinished_failed", "take_over_failed"}
    assert (result["rank"], result["world_size"], result["already_done"]) == (0, 1, True)
    assert result["counts"]["documents_written"] == json.loads((env.sft / "merged.json").read_text())["counts"][
        "documents_written"]
