"""Caption checks: what `mmtok hash` measures of each caption (loops, number runs, repeated endings, prompt
fragments, templates), what `mmtok dedup` flags by the policy's `captions:` thresholds (each flagged image a row
of the drop list with its rule and detail, never the keeper of its duplicates), `plan --exclude` dropping them as
`caption_flagged`, and one-line refusals of bad fragment files and thresholds."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

from encodekit import write_tar
from mmtok.cli import main as cli
from mmtok.curate import captions
from mmtok.errors import MmtokError
from mmtok.formats.dedup import CAPTION_RULES
from realmedia import skimage_images


# -- the measures -----------------------------------------------------------------------------------------------------
def _measure(text: str, fragments: list[str] = ()) -> captions.Measures:
    return captions.measure(text.encode(), False, captions.Fragments(list(fragments)) if fragments else None)


def test_loops_count_the_most_repeats_of_a_phrase_in_a_row_whatever_case_and_punctuation():
    assert _measure("A cat sits on a mat near the door.").loop == 1
    assert _measure("a cat, A CAT; a cat a cat a cat!  on the mat").loop == 5
    assert _measure("very very nice").loop == 2
    assert _measure("the red car and the red car and the red car and").loop == 3  # a phrase of 4 words
    words = "one two three four five six seven eight nine"  # a 9-word phrase is past LOOP_WORDS
    assert _measure(" ".join([words] * 5)).loop < 5


def test_number_runs_endings_and_templates():
    assert _measure("Scores: 1, 2, 3, 4, 5 and 6").number_run == 5
    assert _measure("in 1999 the 2 cats").number_run == 1
    assert _measure("no numbers here").number_run == 0
    assert _measure("A dog runs. A dog runs! A dog runs.").ending == 3
    assert _measure("A dog runs. The sky is blue. The sky is blue. The sky is bl").ending == 2  # cut off: left out
    assert _measure("The sky is blue. A dog runs").ending == 1
    same = _measure("The image shows 3 dogs on grass").template
    assert same == _measure("the IMAGE shows 12 cats in a box").template != 0  # numbers as 0, case folded
    assert _measure("The image shows a dog").template != same
    assert _measure("Too short").template == 0


def test_fragments_match_word_for_word_and_name_the_first_line():
    lines = ["as an AI language model", "Describe the image", "here is"]
    assert _measure("Sure, here is: the image.", lines).fragment == 2
    assert _measure("As an AI-language model, I see a DESCRIBE THE IMAGE", lines).fragment == 0
    assert _measure("a description of the image", lines).fragment == -1
    assert _measure("", lines) == captions.Measures(words=0)


def test_bad_bytes_and_a_cut_character_are_told_apart():
    assert captions.measure(b"caf\xc3\xa9 \xff\xfe", False, None).words == captions.NOT_UTF8
    assert captions.measure("café café".encode()[:-1], True, None).words == 2  # cut inside é: not bad UTF-8


def test_a_hostile_caption_is_measured_in_bounded_time():
    """64 KiB of one word (the most a caption is read): the measures still come out exact."""
    data = b"ha " * (captions.MAX_CAPTION_BYTES // 3)
    got = captions.measure(data, True, captions.Fragments(["ha ha ha ha ha ha ha ha ha ha ha ha ha ha ha x"]))
    assert (got.words, got.loop, got.fragment) == (len(data) // 3, len(data) // 3, -1)


def _fragment_file(tmp_path: Path, data: bytes) -> Path:
    path = tmp_path / "fragments.txt"
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("data, fragment", [
    (b"ok line\n\xff\xfe bad\n", "is not UTF-8 (line 2, byte 8)"),
    (b"fine\n!!!\n", "line 2 has 0 words"),
    (("w " * 33).encode(), "line 1 has 33 words"),
])
def test_a_bad_fragment_file_is_one_line(tmp_path, capsys, data, fragment):
    with pytest.raises(MmtokError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        captions.Fragments.read(_fragment_file(tmp_path, data))
    assert cli(["hash", str(tmp_path / "m"), "--out", str(tmp_path / "h"), "--prompt-fragments",
                str(_fragment_file(tmp_path, data)), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "h").exists()


# -- hash, dedup, plan ------------------------------------------------------------------------------------------------
FRAGMENTS = "Here is a description of the image\n\n# not a comment, a fragment\n"
CAPTIONS = {
    "s000": b"An astronaut in a white suit holds a helmet.",
    "s001": b"a cat a cat a cat a cat a cat a cat on a mat",  # loop 6
    "s002": ("Values: " + ", ".join(str(i) for i in range(1, 31))).encode(),  # 30 numbers
    "s003": b"A red car parks. The sky is blue. The sky is blue. The sky is blue. The sky is bl",  # ending 3
    "s004": b"Sure! Here is a description of the image: a dog on grass.",  # a fragment
    "s005": b"caf\xe9 au lait",  # Latin-1: not UTF-8
    "s006": None,  # no caption
    "s007": b"a bird a bird a bird a bird a bird a bird",  # loop 6, and the byte copy of s008's image
    "s008": b"A bird on a branch in the morning light.",
}
TEMPLATED = [f"t{i:03d}" for i in range(12)]  # "The image shows ...": 12 of 21 captions checked


def _crops() -> list[bytes]:
    photo = Image.open(next(p for p in skimage_images() if p.name == "astronaut.png")).convert("RGB")
    out = []
    for i in range(24):
        buffer = io.BytesIO()
        photo.crop((16 * i, 8 * i, 16 * i + 96, 8 * i + 96)).save(buffer, "PNG")
        out.append(buffer.getvalue())
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("captions")
    crops = _crops()
    members = []
    for i, (key, caption) in enumerate(CAPTIONS.items()):
        members.append((f"{key}.png", crops[7] if key == "s008" else crops[i]))
        if caption is not None:
            members.append((f"{key}.txt", caption))
    for i, key in enumerate(TEMPLATED):
        members += [(f"{key}.png", crops[9 + i]), (f"{key}.txt", f"The image shows {i + 2} objects".encode())]
    write_tar(root / "shard-0.tar", members)
    assert cli(["scan", str(root / "shard-0.tar"), "--out", str(root / "web"), "--no-progress"]) == 0
    fragments = root / "fragments.txt"
    fragments.write_text(FRAGMENTS, encoding="utf-8")
    assert cli(["hash", str(root / "web"), "--out", str(root / "web.h"), "--no-progress", "--workers", "1",
                "--prompt-fragments", str(fragments)]) == 0
    return root


def _policy(tmp_path: Path, captions_entry: str, source: str = "") -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(f"sources:\n  web: {{rule: exact{source}}}\ncaptions: {captions_entry}\n")
    return path


def test_hash_records_the_measures_and_counts_every_caption(corpus, tmp_path, capsys):
    meta = json.loads((corpus / "web.h" / "hashes.json").read_text())
    assert meta["captions"]["counts"] == {"checked": 19, "no_caption": 1, "caption_not_utf8": 1,
                                          "caption_unreadable": 0}
    assert meta["captions"]["fragments"] == ["Here is a description of the image", "# not a comment, a fragment"]
    rows = {r["key"]: r for r in pq.read_table(corpus / "web.h" / "hashes.parquet").to_pylist()}
    assert (rows["s001"]["caption_loop"], rows["s002"]["caption_number_run"], rows["s003"]["caption_ending"],
            rows["s004"]["caption_fragment"]) == (6, 30, 3, 0)
    assert (rows["s005"]["caption_words"], rows["s006"]["caption_words"]) == (captions.NOT_UTF8, captions.NO_CAPTION)
    assert len({rows[k]["caption_template"] for k in TEMPLATED}) == 1
    # the same bytes for another world size and chunking: the measures depend on the captions alone
    for rank in (0, 1):
        assert cli(["hash", str(corpus / "web"), "--out", str(tmp_path / "h2"), "--no-progress", "--workers", "1",
                    "--prompt-fragments", str(corpus / "fragments.txt"), "--rank", str(rank), "--world-size", "2",
                    "--chunk-rows", "4"]) == 0
    assert (tmp_path / "h2" / "hashes.parquet").read_bytes() == (corpus / "web.h" / "hashes.parquet").read_bytes()
    assert "captions: 19 checked, 1 no_caption, 1 caption_not_utf8; 2 prompt fragments looked for" in \
        capsys.readouterr().err


def _key_rank(key: str) -> int:
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def test_dedup_flags_each_check_by_sample_id_and_a_flagged_image_never_keeps_its_copy(corpus, tmp_path, capsys):
    policy = _policy(tmp_path, "{template_min: 10, template_share: 0.3}")
    assert cli(["dedup", str(corpus / "web.h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    dropped = {r["key"]: r for r in pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()}
    cap = int(0.3 * 19)
    over = sorted(TEMPLATED, key=_key_rank)[cap:]  # the template's rows past the cap, by a hash of the sample key
    expected = {"s001": "caption_loop", "s002": "caption_numbers", "s003": "caption_ending",
                "s004": "caption_fragment", "s007": "caption_loop", **{k: "caption_template" for k in over}}
    assert {k: r["rule"] for k, r in dropped.items()} == expected  # s008 keeps the bytes s007 shares with it
    assert dropped["s004"]["detail"] == "prompt fragment 'Here is a description of the image'"
    assert dropped["s001"]["detail"] == "a phrase repeated 6 times in a row (loop: 4)"
    assert dropped["s002"]["detail"] == "30 numbers in a row (number_run: 16)"
    assert (dropped["s001"]["keeper_key"], dropped["s001"]["keeper_row"], dropped["s001"]["group"]) == (None, -1, -1)
    meta = json.loads((tmp_path / "d" / "dedup.json").read_text())
    counts = meta["counts"]["web"]
    assert counts["hashed"] == counts["kept"] + counts["dropped"] == 21
    assert counts["dropped"] == sum(counts["by_rule"].values()) == len(expected)
    assert meta["captions"]["flagged"] == len(expected) and meta["groups"] == 0
    assert f"and {len(expected)} images flagged by their captions among 21 images" in capsys.readouterr().err


def test_thresholds_turn_checks_off_and_a_source_may_skip_them(corpus, tmp_path):
    policy = _policy(tmp_path, "{loop: 6, number_run: off, ending: 3, fragments: off}")
    assert cli(["dedup", str(corpus / "web.h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    rules = {r["key"]: r["rule"] for r in pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()}
    assert rules == {"s008": "sha256"}  # nothing flagged: s008 is s007's duplicate again (s007 < s008 by key)
    policy = _policy(tmp_path, "{}", source=", captions: off")
    assert cli(["dedup", str(corpus / "web.h"), "--policy", str(policy), "--out", str(tmp_path / "d2")]) == 0
    assert pq.read_table(tmp_path / "d2" / "dropped.parquet").column("rule").to_pylist() == ["sha256"]


def test_plan_exclude_drops_flagged_rows_as_caption_flagged_with_what_was_found(corpus, tmp_path, capsys):
    assert cli(["dedup", str(corpus / "web.h"), "--policy", str(_policy(tmp_path, "{}")), "--out",
                str(tmp_path / "d")]) == 0
    assert cli(["plan", str(corpus / "web"), "--out", str(tmp_path / "p"), "--preset", "demo", "--mode", "image",
                "--quiet", "--exclude", str(tmp_path / "d")]) == 0
    assert "caption_flagged 5" in capsys.readouterr().err
    dropped = {r["manifest_row"]: r for r in pq.read_table(tmp_path / "p" / "dropped.parquet").to_pylist()}
    assert (dropped[1]["reason"], dropped[1]["keeper"]) == ("caption_flagged",
                                                           "caption_loop: a phrase repeated 6 times in a row (loop: 4)")
    assert {r["reason"] for r in dropped.values()} == {"caption_flagged"}
    assert cli(["plan", "--explain", str(tmp_path / "p")]) == 0
    assert "reasons duplicate, caption_flagged; keepers, what the caption checks found" in capsys.readouterr().out


def test_the_report_shows_each_rule_s_images_with_their_captions_escaped_and_counts_that_add_up(corpus, tmp_path):
    assert cli(["dedup", str(corpus / "web.h"), "--policy", str(_policy(tmp_path, "{template_min: 10}")), "--out",
                str(tmp_path / "d"), "--report"]) == 0
    report = tmp_path / "d" / "report"
    index = (report / "index.md").read_text()
    counts = json.loads((tmp_path / "d" / "dedup.json").read_text())["counts"]["web"]
    flagged = sum(counts["by_rule"][rule] for rule in CAPTION_RULES)
    assert counts["hashed"] == counts["kept"] + counts["by_rule"]["sha256"] + flagged
    assert f"| web | 21 | {counts['kept']} | 0 | 0 | {flagged} | 0 |" in index
    assert "## Flagged by caption_loop: 2 of 2, with their captions" in index
    assert "- web:s003 its last sentence said 3 times \\(ending: 2\\): A red car parks. The sky is blue." in index
    assert "Sure\\! Here is a description of the image: a dog on grass." in index
    recorded = json.loads((report / "report.json").read_text())
    assert {f"captions-{rule}.png" for rule in CAPTION_RULES} <= set(recorded["sheets"])
    assert recorded["unshown"] == []


@pytest.mark.parametrize("entry, fragment", [
    ("{loops: 3}", "`captions:` has no key 'loops'"),
    ("{loop: 0}", "`captions: loop` is an integer >= 1 or off, got 0"),
    ("{template_share: 1.5}", "`captions: template_share` is a share in (0, 1) or off, got 1.5"),
    ("{fragments: maybe}", "`captions: fragments` is on or off, got 'maybe'"),
    ("[1, 2]", "`captions:` is a mapping of"),
    ("&a [*a, *a]", "`captions:` is a mapping of"),
])
def test_bad_thresholds_are_one_line(corpus, tmp_path, capsys, entry, fragment):
    assert cli(["dedup", str(corpus / "web.h"), "--policy", str(_policy(tmp_path, entry)), "--out",
                str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "d").exists()


def test_a_fragment_index_past_the_recorded_fragments_is_refused(corpus, tmp_path, capsys):
    import shutil

    shutil.copytree(corpus / "web.h", tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "hashes.json").read_text())
    meta["captions"]["fragments"] = []
    (tmp_path / "h" / "hashes.json").write_text(json.dumps(meta))
    assert cli(["dedup", str(tmp_path / "h"), "--policy", str(_policy(tmp_path, "{}")), "--out",
                str(tmp_path / "d")]) == 2
    assert "a caption_fragment beyond the 0 fragments" in capsys.readouterr().err


def test_a_caption_in_the_report_is_literal_text_on_one_line():
    from mmtok.curate.report import _escaped

    shown = _escaped("ok\n# Heading <script>x</script> | [link](http://a) `code`\u2028\x1b[31m")
    assert "\n" not in shown and "\u2028" not in shown and "\x1b" not in shown
    for markup in ("\\#", "\\<script\\>", "\\|", "\\[link\\]\\(http://a\\)", "\\`code\\`"):
        assert markup in shown


def test_a_hash_table_of_the_first_format_is_refused_with_the_command_that_makes_it_again(corpus, tmp_path, capsys):
    import shutil

    shutil.copytree(corpus / "web.h", tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "hashes.json").read_text())
    meta["format_version"] = 1
    (tmp_path / "h" / "hashes.json").write_text(json.dumps(meta))
    assert cli(["dedup", str(tmp_path / "h"), "--policy", str(_policy(tmp_path, "{}")), "--out",
                str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "is not an mmtok hash table of version 2" in err and "rerun `mmtok hash MANIFEST --out" in err


# -- found by an attack ------------------------------------------------------------------------------------------------
def test_a_huge_parquet_caption_is_cut_in_arrow_and_bad_bytes_past_64_kib_are_still_bad(tmp_path):
    import pyarrow as pa

    from mmtok.formats.manifest import MemberReader

    crops = _crops()
    caption = "hello world " * 200_000  # 2.4 MB in one cell
    pq.write_table(pa.table({"image": crops[:2], "caption": [caption, "A plain caption."]}), tmp_path / "i.parquet")
    reader = MemberReader()
    assert reader.read_text("parquet", str(tmp_path / "i.parquet"), 0, 100, "caption") == caption.encode()[:100]
    reader.close()
    assert cli(["scan", str(tmp_path / "i.parquet"), "--text-column", "caption", "--out", str(tmp_path / "m"),
                "--no-progress"]) == 0
    assert cli(["hash", str(tmp_path / "m"), "--out", str(tmp_path / "h"), "--workers", "1", "--no-progress"]) == 0
    words = pq.read_table(tmp_path / "h" / "hashes.parquet").column("caption_words").to_pylist()
    assert words == [len(caption.encode()[:captions.MAX_CAPTION_BYTES].split()), 3]
    junk = b"ok caption " + b"\xff" * 10 + b" word" * 20000  # a bad byte inside the first 64 KiB
    assert captions.measure(junk[:captions.MAX_CAPTION_BYTES], True, None).words == captions.NOT_UTF8


def test_words_of_scripts_without_spaces_are_characters_and_fragment_files_are_read_as_an_editor_shows_them(tmp_path):
    assert _measure("一只猫" * 30).loop == 30
    assert _measure("ネコがいるネコがいるネコがいるネコがいるネコがいる").loop == 5
    fragments = captions.Fragments.read(_fragment_file(tmp_path, "\ufeffHere is\nline\u2028two\n".encode()))
    assert fragments.lines == ["Here is", "line\u2028two"]
    with pytest.raises(MmtokError, match="holds no fragment"):
        captions.Fragments.read(_fragment_file(tmp_path, b"\n  \n"))


@pytest.fixture(scope="module")
def documents(tmp_path_factory) -> Path:
    """Six 3-image documents whose captions share one template (d5's also loops) and six single images with
    captions of their own."""
    root = tmp_path_factory.mktemp("documents")
    crops = _crops()
    members = []
    for n in range(6):
        members += [(f"d{n}.{i}.png", crops[3 * n + i]) for i in range(3)]
        members.append((f"d{n}.txt", f"The image shows {n} things{' a cat' * 5 if n == 5 else ''}".encode()))
    openings = ["Astronaut portrait in orange", "Coffee cup with latte", "A tabby cat looks", "Grass in the wind",
                "Rocket on its pad", "Coins on a table"]
    for n, opening in enumerate(openings):
        members += [(f"s{n}.png", crops[18 + n]), (f"s{n}.txt", f"{opening}, photographed.".encode())]
    write_tar(root / "docs.tar", members)
    assert cli(["scan", str(root / "docs.tar"), "--out", str(root / "web"), "--no-progress"]) == 0
    assert cli(["hash", str(root / "web"), "--out", str(root / "web.h"), "--no-progress", "--workers", "1"]) == 0
    return root


def test_the_template_cap_counts_samples_that_stay_and_flags_a_document_whole(documents, tmp_path):
    policy = _policy(tmp_path, "{template_min: 5, template_share: 0.25}")
    assert cli(["dedup", str(documents / "web.h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    rows = pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()
    by_key: dict[str, set] = {}
    for row in rows:
        by_key.setdefault(row["key"], set()).add((row["rule"], row["detail"]))
    # 12 captions checked, so 3 samples of the template may stay; d5 is dropped by its loop and takes no slot
    over = sorted([f"d{n}" for n in range(5)], key=lambda k: (_key_rank(k), k))[3:]
    assert set(by_key) == {"d5", *over}
    assert len(rows) == 9 and all(len(by_key[k]) == 1 for k in by_key)  # three images each, one rule and detail
    assert {next(iter(by_key[k]))[0] for k in over} == {"caption_template"}
    assert next(iter(by_key[over[0]]))[1] == ("its template begins 5 of the source's 12 captions (42%); 3 kept "
                                              "(template_share: 0.25)")


def test_a_null_in_a_caption_column_is_one_line(corpus, tmp_path, capsys):
    import shutil

    import pyarrow as pa

    from mmtok.fsutil import sha256_file

    shutil.copytree(corpus / "web.h", tmp_path / "h")
    table = pq.read_table(tmp_path / "h" / "hashes.parquet")
    column = table.column("caption_loop").to_pylist()
    table = table.set_column(table.schema.get_field_index("caption_loop"), table.schema.field("caption_loop"),
                             pa.array([None] + column[1:], pa.int32()))
    pq.write_table(table, tmp_path / "h" / "hashes.parquet")
    meta = json.loads((tmp_path / "h" / "hashes.json").read_text())
    meta["fingerprint"] = sha256_file(tmp_path / "h" / "hashes.parquet")
    (tmp_path / "h" / "hashes.json").write_text(json.dumps(meta))
    assert cli(["dedup", str(tmp_path / "h"), "--policy", str(_policy(tmp_path, "{}")), "--out",
                str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert "a null in column caption_loop" in err and len(err.strip().splitlines()) == 1


def test_an_output_of_an_earlier_format_is_made_again_where_the_error_says(corpus, tmp_path, capsys):
    import shutil

    shutil.copytree(corpus / "web.h", tmp_path / "h")
    meta = json.loads((tmp_path / "h" / "hashes.json").read_text())
    (tmp_path / "h" / "hashes.json").write_text(json.dumps({**meta, "format_version": 1}))
    assert cli(["hash", str(corpus / "web"), "--out", str(tmp_path / "h"), "--no-progress", "--workers", "1",
                "--prompt-fragments", str(corpus / "fragments.txt")]) == 0
    assert json.loads((tmp_path / "h" / "hashes.json").read_text())["format_version"] == 2
    policy = _policy(tmp_path, "{}")
    assert cli(["dedup", str(tmp_path / "h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    meta = json.loads((tmp_path / "d" / "dedup.json").read_text())
    (tmp_path / "d" / "dedup.json").write_text(json.dumps({**meta, "format_version": 1}))
    assert cli(["dedup", str(tmp_path / "h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    (tmp_path / "d" / "dedup.json").write_text(json.dumps({**meta, "format": "someone.else"}))
    assert cli(["dedup", str(tmp_path / "h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 2
    assert "pass an --out of its own" in capsys.readouterr().err


# -- found by a review -------------------------------------------------------------------------------------------------
def _one_template_corpus(root: Path, members: list[tuple[str, bytes]]) -> Path:
    write_tar(root / "t.tar", members)
    assert cli(["scan", str(root / "t.tar"), "--out", str(root / "web"), "--no-progress"]) == 0
    assert cli(["hash", str(root / "web"), "--out", str(root / "web.h"), "--no-progress", "--workers", "1"]) == 0
    return root / "web.h"


def test_a_capped_keeper_s_copy_that_stays_is_capped_in_turn(tmp_path):
    """Four samples of one template with a cap of two; k000 and k001 are byte copies. Capping the keeper of the
    copies lets the other copy stay: it counts against the cap too (the cap once kept three)."""
    crops = _crops()
    members = []
    for n, crop in enumerate([crops[0], crops[0], crops[1], crops[2]]):
        members += [(f"k{n:03d}.png", crop), (f"k{n:03d}.txt", f"The image shows {n} things".encode())]
    table = _one_template_corpus(tmp_path, members)
    policy = _policy(tmp_path, "{template_min: 1, template_share: 0.5}")
    assert cli(["dedup", str(table), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    rows = pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()
    dropped = {r["key"] for r in rows}
    assert len(dropped) == 2 and {"k000", "k001"} & dropped  # two of the four stay, one of them a copy at most
    assert not {"k000", "k001"} <= {k for k in ("k000", "k001", "k002", "k003") if k not in dropped}
    counts = json.loads((tmp_path / "d" / "dedup.json").read_text())["counts"]["web"]
    assert counts["kept"] == 2 and counts["hashed"] == counts["kept"] + counts["dropped"]
    policy = _policy(tmp_path, "{template_min: 1, template_share: 0.1}")  # a share under one sample keeps one
    assert cli(["dedup", str(table), "--policy", str(policy), "--out", str(tmp_path / "d2")]) == 0
    assert json.loads((tmp_path / "d2" / "dedup.json").read_text())["counts"]["web"]["kept"] == 1


def test_samples_are_documents_not_keys_and_a_table_s_row_group_is_read_once_per_column(tmp_path, monkeypatch):
    """Two Parquet files without a key column (keys "0", "1", ... in each: they collide); one file's captions
    share a template. The cap counts 8 captions, not 4, and flags by document."""
    import pyarrow as pa

    from mmtok.curate import hashing

    crops = _crops()
    pq.write_table(pa.table({"image": crops[:4], "caption": [f"The image shows {n} things" for n in range(4)]}),
                   tmp_path / "a.parquet")
    pq.write_table(pa.table({"image": crops[4:8], "caption": ["A red car parks", "Coins on a table here",
                                                              "Grass in the wind", "One more photo of a bird"]}),
                   tmp_path / "b.parquet")
    assert cli(["scan", str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet"), "--text-column", "caption",
                "--out", str(tmp_path / "web"), "--no-progress"]) == 0
    reads = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group",
                        lambda self, *a, **k: reads.append(k.get("columns")) or real(self, *a, **k))
    manifest = hashing.Manifest.open(tmp_path / "web")
    hashing.hash_chunk(manifest, 0, 8, manifest.identities(hashing._containers(manifest)))
    # per file, the image column's group and the caption column's group, once each (not once per row)
    ours = sorted(str(c) for c in reads if c in (["image"], ["caption"]))
    assert ours == ["['caption']"] * 2 + ["['image']"] * 2
    assert cli(["hash", str(tmp_path / "web"), "--out", str(tmp_path / "web.h"), "--no-progress", "--workers",
                "1"]) == 0
    policy = _policy(tmp_path, "{template_min: 1, template_share: 0.25}")
    assert cli(["dedup", str(tmp_path / "web.h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    rows = pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()
    assert len(rows) == 2 and {r["manifest_row"] for r in rows} <= {0, 1, 2, 3}  # 4 of 8 captions, 2 may stay
    assert rows[0]["detail"].startswith("its template begins 4 of the source's 8 captions (50%); 2 kept")


def test_kana_punctuation_is_not_a_word():
    assert _measure("ネコ・・・・・・かわいい").loop < 5


def test_a_fragment_without_words_matches_nothing():
    assert captions.Fragments(["", "!!!", "x y"]).first_in(["a", "x", "y"]) == 2
    assert captions.Fragments(["", "!!!"]).first_in(["a", "b"]) == -1
