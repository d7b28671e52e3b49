"""`mmtok dedup` and `mmtok plan --exclude`: the groups brute force finds, keepers by rule (never by input order),
drops by sample id that reach the plan's dropped table with their keeper, and one-line refusals of bad input.
Decontamination (`--against BENCH`): training images matching a benchmark image dropped by sample id, each named
with the benchmark image and the distance; suspect matches held back until `--confirm` names them; `plan
--exclude` drops them as `contaminated`."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image, ImageEnhance

from encodekit import caption_corpus, real_images, write_tar
from mmtok.cli import main as cli
from mmtok.curate.dedup import find_duplicates
from mmtok.formats.plan import Plan
from realmedia import skimage_images


# -- the groups, against brute force --------------------------------------------------------------------------------
def _flip(value: int, bits: list[int]) -> int:
    for bit in bits:
        value ^= 1 << bit
    return value


def _synthetic(seed: int = 0):
    """Three sources (radius 3, exact, off) with planted pairs: near-duplicates at every distance 0..5 inside the
    radius source and across sources, a chain whose ends are 6 apart, equal bytes across sources (one of them in
    the `off` source), equal pHashes in the `off` source, and a 64-bit sha256 head shared by different bytes."""
    rng = np.random.default_rng(seed)
    n = 1500
    phash = [int(v) for v in rng.integers(0, 2**63, n, dtype=np.int64).astype(np.uint64) * 2 + rng.integers(0, 2, n)]
    sha = [bytes(rng.integers(0, 256, 32, dtype=np.uint8)) for _ in range(n)]
    radius = [3] * 500 + [0] * 500 + [-1] * 500

    def plant(i: int, j: int, distance: int) -> None:
        phash[j] = _flip(phash[i], [int(b) for b in rng.choice(64, distance, replace=False)])

    for d in range(6):
        plant(10 + d, 100 + d, d)  # inside the radius source
        plant(20 + d, 600 + d, d)  # radius x exact: a pair only at distance 0
        plant(700 + d, 1100 + d, d)  # exact x off: never by pHash
    plant(30, 130, 3)
    phash[230] = _flip(phash[130], [b for b in range(64) if (phash[30] ^ phash[130]) >> b & 1 == 0][:3])  # chain
    sha[1200], sha[40] = sha[800], sha[800]  # equal bytes in all three sources
    phash[1300] = phash[1301] = phash[1302]  # equal pHashes where the rule is off
    sha[900] = sha[901][:8] + bytes(24)  # a head shared by different digests...
    sha[902] = sha[900]  # ...and a true copy in the same run
    return np.array(phash, np.uint64), np.frombuffer(b"".join(sha), np.uint8).reshape(n, 32), np.array(radius, np.int8)


def _brute_force(phash, sha, radius, order):
    n = len(phash)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i in range(n):
        distance = np.bitwise_count(phash[i] ^ phash[i + 1:])
        same = np.all(sha[i + 1:] == sha[i], axis=1)
        near = (radius[i + 1:] >= 0) & (radius[i] >= 0) & (distance <= np.minimum(radius[i + 1:], radius[i]))
        for j in np.flatnonzero(same | near) + i + 1:
            parent[root(int(j))] = root(i)
    groups: dict[int, list[int]] = {}
    for i in range(n):
        groups.setdefault(root(i), []).append(i)
    return {i: min(members, key=lambda m: order[m]) for members in groups.values() if len(members) > 1
            for i in members if i != min(members, key=lambda m: order[m])}


def test_groups_and_keepers_match_brute_force_with_planted_pairs_at_every_distance():
    phash, sha, radius = _synthetic()
    order = np.random.default_rng(1).permutation(len(phash))
    heads = np.ascontiguousarray(sha[:, :8]).view(">u8").ravel().astype(np.uint64)
    found = find_duplicates(phash, heads, radius, lambda nodes: order[nodes],
                            lambda a, b: np.all(sha[a] == sha[b], axis=1))
    expected = _brute_force(phash, sha, radius, order)
    assert dict(zip(found.dropped.tolist(), found.keeper.tolist(), strict=True)) == expected
    pairs = {(min(i, k), max(i, k)) for i, k in expected.items()}
    for d in range(4):
        assert (10 + d, 100 + d) in pairs  # within radius 3
    assert (14, 104) not in pairs and (15, 105) not in pairs  # 4 and 5 bits apart
    assert (20, 600) in pairs and (21, 601) not in pairs  # across radius 3 and exact: equal pHashes only
    assert (700, 1100) not in pairs  # `off` is joined by equal pHashes to no one...
    assert expected.get(1200) in (40, 800) or expected.get(40) == 1200 or expected.get(800) == 1200  # ...but bytes
    assert 1301 not in expected and 1302 not in expected
    assert {expected.get(230), expected.get(130), expected.get(30)} & {30, 130, 230}  # the chain is one group
    assert 901 not in expected and expected.get(902, expected.get(900)) in (900, 902)
    distance = np.bitwise_count(phash[found.dropped] ^ phash[found.keeper])
    assert (found.distance == distance).all()
    same = np.all(sha[found.dropped] == sha[found.keeper], axis=1)
    assert ((found.rule == "sha256") == same).all()
    assert set(found.rule[~same]) <= {"phash_exact", "phash_radius"}
    keepers = sorted(set(found.keeper.tolist()), key=lambda k: order[k])
    assert [keepers[g] for g in found.group] == found.keeper.tolist()  # groups are numbered in keeper order


# -- the commands, on real images ------------------------------------------------------------------------------------
def _encoded(image: Image.Image, fmt: str = "PNG", **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> Path:
    """Two scanned and hashed sources of real photos: `web` (the caption corpus, which repeats coffee.png) and
    `frames`, which holds a byte copy of web's astronaut, near copies (cropped by 4 pixels, brightened, re-encoded
    at JPEG quality 10) of rocket and coffee, and a photo of its own."""
    root = tmp_path_factory.mktemp("dedup")
    shards = caption_corpus(root / "web-shards", corrupt=True)
    images = real_images()
    rocket = Image.open(images["rocket.jpg"]).convert("RGB")
    coffee = Image.open(images["coffee.png"]).convert("RGB")
    w, h = rocket.size
    members = [("f000.png", images["astronaut.png"].read_bytes()),
               ("f001.png", _encoded(rocket.crop((4, 4, w - 4, h - 4)))),
               ("f002.png", _encoded(ImageEnhance.Brightness(rocket).enhance(1.3))),
               ("f003.jpg", _encoded(coffee, "JPEG", quality=10)),
               ("f004.png", next(p for p in skimage_images() if p.name == "grass.png").read_bytes())]
    frames = write_tar(root / "frames-shards" / "frames.tar", members)
    for name, paths in (("web", shards), ("frames", [frames])):
        assert cli(["scan", *map(str, paths), "--out", str(root / name), "--no-progress"]) == 0
        assert cli(["hash", str(root / name), "--out", str(root / f"{name}.h"), "--no-progress", "--workers", "1"]) == 0
    return root


def _policy(root: Path, text: str) -> Path:
    path = root / "policy.yaml"
    path.write_text(text)
    return path


POLICY = "sources:\n  web: {rule: exact}\n  frames: {rule: radius, radius: 4, priority: 5}\n"


def test_dedup_lists_every_drop_with_its_group_keeper_rule_and_distance(sources, tmp_path, capsys):
    policy = _policy(tmp_path, POLICY)
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy", str(policy),
                "--out", str(tmp_path / "d")]) == 0
    summary = capsys.readouterr().err
    rows = pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()
    by_key = {(r["source"], r["key"]): r for r in rows}
    # frames' byte copy of web's astronaut: web wins on priority (0 < 5), whatever the order of the inputs
    assert by_key[("frames", "f000")]["keeper_source"] == "web" and by_key[("frames", "f000")]["rule"] == "sha256"
    # the rocket's near copies are within radius 4 of each other inside frames; web's rocket is exact-only
    # ...and the keeper is the larger (full-size brightened) copy, though its key sorts after the cropped one's
    near = by_key[("frames", "f001")]
    assert near["rule"] == "phash_radius" and (near["keeper_source"], near["keeper_key"]) == ("frames", "f002")
    assert 0 < near["distance"] <= 4
    assert ("frames", "f004") not in by_key
    counts = json.loads((tmp_path / "d" / "dedup.json").read_text())["counts"]
    for source, c in counts.items():
        assert c["hashed"] == c["kept"] + c["dropped"] == json.loads((sources / f"{source}.h" / "hashes.json")
                                                                     .read_text())["hashed"]
        assert c["dropped"] == sum(c["by_rule"].values()) == sum(r["source"] == source for r in rows)
        assert f"{source} (" in summary
    reordered = tmp_path / "d2"
    assert cli(["dedup", str(sources / "frames.h"), str(sources / "web.h"), "--policy", str(policy),
                "--out", str(reordered)]) == 0
    assert (reordered / "dropped.parquet").read_bytes() == (tmp_path / "d" / "dropped.parquet").read_bytes()


def test_plan_exclude_drops_the_listed_rows_with_their_keepers_and_counts_add_up(sources, tmp_path, capsys):
    policy = _policy(tmp_path, POLICY)
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy", str(policy),
                "--out", str(tmp_path / "d")]) == 0
    listed = [r for r in pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist() if r["source"] == "frames"]
    assert cli(["plan", str(sources / "frames"), "--out", str(tmp_path / "p"), "--preset", "demo", "--mode", "image",
                "--quiet", "--exclude", str(tmp_path / "d")]) == 0
    assert f"duplicate {len(listed)}" in capsys.readouterr().err
    dropped = pq.read_table(tmp_path / "p" / "dropped.parquet").to_pylist()
    duplicates = {r["manifest_row"]: r["keeper"] for r in dropped if r["reason"] == "duplicate"}
    assert duplicates == {r["manifest_row"]: f"{r['keeper_source']}:{r['keeper_key']} (row {r['keeper_row']})"
                          for r in listed}
    assert all(r["keeper"] is None for r in dropped if r["reason"] != "duplicate")
    # read as skip records (the schema of every stage): the keeper is the record's detail
    records = {r.position: r for r in Plan.open(tmp_path / "p").skip_records()}
    assert {row: r.detail for row, r in records.items() if r.reason == "duplicate"} == duplicates
    assert all(r.stage == "plan" and r.source.endswith(".tar") and r.key for r in records.values())
    kept = pq.read_table(tmp_path / "p" / "plan.parquet", columns=["manifest_row"]).column(0).to_pylist()
    assert not set(kept) & set(duplicates) and len(kept) + len(dropped) == 5
    meta = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert meta["exclude"]["rows"] == len(listed) == meta["dropped_by_reason"]["duplicate"]
    assert cli(["plan", "--explain", str(tmp_path / "p")]) == 0
    assert f"drops {len(listed)} rows of source 'frames'" in capsys.readouterr().out


@pytest.mark.parametrize("case, fragment", [
    ("unknown_source", "names source(s) ['laion'] that no hash table is"),
    ("missing_source", "has no rule for source(s) ['frames']"),
    ("unknown_rule", "unknown rule 'fuzzy'"),
    ("radius_missing", "rule radius needs `radius:`"),
    ("not_a_policy", "a policy is a mapping `sources:`"),
    ("other_algorithm", "different algorithms"),
    ("same_source_twice", "have the same source name"),
    ("rule_of_wrong_type", "unknown rule ['exact']"),
    ("huge_priority", "`priority` must be an integer in"),
    ("name_not_a_string", "source names are non-empty strings"),
    ("alias_bomb", "`priority` must be an integer in"),
])
def test_bad_dedup_input_is_one_line_exit_2_and_nothing_written(sources, tmp_path, capsys, case, fragment):
    tables = [sources / "web.h", sources / "frames.h"]
    text = {"unknown_source": POLICY + "  laion: {rule: exact}\n", "missing_source": "sources:\n  web: {rule: exact}\n",
            "unknown_rule": "sources:\n  web: {rule: exact}\n  frames: {rule: fuzzy}\n",
            "radius_missing": "sources:\n  web: {rule: exact}\n  frames: {rule: radius}\n",
            "not_a_policy": "- web\n- frames\n",
            "rule_of_wrong_type": "sources:\n  web: {rule: exact}\n  frames: {rule: [exact]}\n",
            "huge_priority": "sources:\n  web: {rule: exact}\n  frames: {rule: exact, priority: 10000000000000}\n",
            "name_not_a_string": "sources:\n  web: {rule: exact}\n  frames: {rule: exact}\n  1: {rule: exact}\n",
            "alias_bomb": "sources:\n  web: {rule: exact}\n  frames: {rule: exact, priority: [&a0 [x, x, x, x, x, "
            + "x, x, x, x, x], " + ", ".join(f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)) + "]}\n",
            }.get(case, POLICY)
    if case in ("other_algorithm", "same_source_twice"):
        copy = tmp_path / "frames.h"
        shutil.copytree(sources / "frames.h", copy)
        meta = json.loads((copy / "hashes.json").read_text())
        field, value = ("algorithm", "phash-other") if case == "other_algorithm" else ("source", "web")
        meta[field] = value
        (copy / "hashes.json").write_text(json.dumps(meta))
        tables[1] = copy
    assert cli(["dedup", *map(str, tables), "--policy", str(_policy(tmp_path, text)), "--out",
                str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmtok dedup: error: ") and err.count("\n") == 1 and fragment in err, err[:2000]
    assert len(err) < 1000 and not (tmp_path / "d").exists()


@pytest.mark.parametrize(("damage", "key"), [
    (lambda meta: meta["manifest"].update(rows="5"), "rows"),
    (lambda meta: meta["manifest"].pop("directory"), "directory"),
    (lambda meta: meta["counts"]["skipped"].update(decode_error=-1), "decode_error"),
    (lambda meta: meta["captions"].update(fragments=[1]), "fragments"),
    (lambda meta: meta.update(hashed=None), "hashed"),
    (lambda meta: meta.update(source=["web"]), "source"),
])
def test_a_hash_table_of_the_wrong_shape_is_refused_naming_the_key(sources, tmp_path, capsys, damage, key):
    """hashes.json is read back by `mmtok dedup` (and the report), from tables anyone may hand it: one that parses
    but has the wrong shape is one line naming the file and the key, before anything is written."""
    copy = tmp_path / "frames.h"
    shutil.copytree(sources / "frames.h", copy)
    meta = json.loads((copy / "hashes.json").read_text())
    damage(meta)
    (copy / "hashes.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli(["dedup", str(sources / "web.h"), str(copy), "--policy", str(_policy(tmp_path, POLICY)), "--out",
                str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hashes.json" in err and repr(key) in err, err
    assert not (tmp_path / "d").exists()


def test_plan_refuses_a_duplicate_list_of_other_manifests(sources, tmp_path, capsys):
    policy = _policy(tmp_path, "sources:\n  frames: {rule: exact}\n")
    assert cli(["dedup", str(sources / "frames.h"), "--policy", str(policy), "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    assert cli(["plan", str(sources / "web"), "--out", str(tmp_path / "p"), "--preset", "demo", "--quiet",
                "--exclude", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "was not made from this manifest" in err and "frames" in err, err
    assert not (tmp_path / "p").exists()


def test_plan_refuses_a_duplicate_list_whose_rows_are_not_its_manifests(sources, tmp_path, capsys):
    import hashlib

    import pyarrow as pa

    policy = _policy(tmp_path, POLICY)
    listed = tmp_path / "d"
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy", str(policy),
                "--out", str(listed)]) == 0
    table = pq.read_table(listed / "dropped.parquet")
    rows = table.column("manifest_row").to_numpy().copy()
    rows[table.column("source").to_numpy(zero_copy_only=False) == "frames"] = -1  # crafted, checksum made to match
    pq.write_table(table.set_column(1, "manifest_row", pa.array(rows)), listed / "dropped.parquet")
    meta = json.loads((listed / "dedup.json").read_text())
    meta["fingerprint"] = hashlib.sha256((listed / "dropped.parquet").read_bytes()).hexdigest()
    (listed / "dedup.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli(["plan", str(sources / "frames"), "--out", str(tmp_path / "p"), "--preset", "demo", "--mode", "image",
                "--quiet", "--exclude", str(listed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "are not increasing rows of its manifest's 5" in err, err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize(("damage", "key"), [
    (lambda meta: meta["counts"]["web"].update(kept="3"), "kept"),
    (lambda meta: meta["inputs"][0].pop("manifest_fingerprint"), "manifest_fingerprint"),
    (lambda meta: meta["policy"].update(frames=["radius", 4]), "rule"),
    (lambda meta: meta.update(groups=None), "groups"),
    (lambda meta: meta["captions"].update(unchecked_sources=[1]), "unchecked_sources"),
    (lambda meta: meta.update(held_sha256=7), "held_sha256"),
    (lambda meta: meta.update(decontamination={
        "against": [], "radius": {}, "suspect_images": [], "suspect_sources": [], "confirmed": [], "contaminated": 0,
        "held": 0, "guards": {"max_matches": 1, "max_share": float("nan"), "min_flagged": 1}}), "max_share"),
])
def test_a_duplicate_list_of_the_wrong_shape_is_refused_naming_the_key(sources, tmp_path, capsys, damage, key):
    """dedup.json is read back by `plan --exclude` (and the report): one that parses but has the wrong shape is one
    line naming the file and the key, before any row is planned -- never a traceback, nor a key read unchecked."""
    listed = tmp_path / "d"
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy",
                str(_policy(tmp_path, POLICY)), "--out", str(listed)]) == 0
    meta = json.loads((listed / "dedup.json").read_text())
    damage(meta)
    (listed / "dedup.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert cli(["plan", str(sources / "web"), "--out", str(tmp_path / "p"), "--preset", "demo", "--quiet",
                "--exclude", str(listed)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "dedup.json" in err and repr(key) in err, err
    assert not (tmp_path / "p").exists()
    if key == "kept":  # a key of a nested record is named with where it is
        assert "dedup.json (counts.web): key 'kept'" in err, err
    if key == "max_share":
        assert "dedup.json (decontamination.guards): key 'max_share' must be a finite number >= 0" in err, err


@pytest.mark.parametrize("command, name", [("hash", "hashes.parquet"), ("hash", "hashes.json"),
                                           ("dedup", "dropped.parquet"), ("dedup", "dedup.json")])
def test_an_out_holding_files_mmtok_did_not_write_is_refused_and_left_alone(sources, tmp_path, capsys, command, name):
    out = tmp_path / "someone-elses"
    out.mkdir()
    (out / name).write_text('{"format": "theirs"}')
    args = ([str(sources / "frames"), "--no-progress"] if command == "hash"
            else [str(sources / "frames.h"), "--policy", str(_policy(tmp_path, "sources:\n  frames: {rule: exact}\n"))])
    assert cli([command, *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"mmtok {command}: error: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == '{"format": "theirs"}'


def test_plan_warns_when_it_drops_a_keeper_of_its_own_manifest(sources, tmp_path, capsys):
    policy = _policy(tmp_path, POLICY)
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy", str(policy),
                "--out", str(tmp_path / "d")]) == 0
    capsys.readouterr()
    # f002 (427x640) keeps f001 (419x632); a pixel limit between the two drops the keeper itself
    assert cli(["plan", str(sources / "frames"), "--out", str(tmp_path / "p"), "--preset", "demo", "--mode", "image",
                "--quiet", "--max-source-pixels", "270000", "--max-pixels", "270000", "--exclude",
                str(tmp_path / "d")]) == 0
    err = capsys.readouterr().err
    assert "warning: 1 duplicate excluded by" in err and "drops 1 keeper (too_many_pixels 1)" in err, err
    excluded = json.loads((tmp_path / "p" / "plan.json").read_text())["exclude"]
    assert excluded["keepers_dropped"] == {"too_many_pixels": 1} and excluded["duplicates_without_kept_copy"] == 1


# -- decontamination: --against a benchmark's hash table ------------------------------------------------------------
@pytest.fixture(scope="module")
def bench(sources, tmp_path_factory) -> Path:
    """A benchmark `vqa` of three real images: frames' grass photo re-encoded as JPEG quality 30 (a near copy),
    the coffee photo web repeats, re-encoded as JPEG quality 90 (near four training images: web's copies and
    frames' JPEG; no byte copy) and the astronaut (a byte copy of web's and frames')."""
    root = tmp_path_factory.mktemp("bench")
    images = real_images()
    grass = Image.open(next(p for p in skimage_images() if p.name == "grass.png")).convert("RGB")
    coffee = Image.open(images["coffee.png"]).convert("RGB")
    members = [("b000.jpg", _encoded(grass, "JPEG", quality=30)), ("b001.jpg", _encoded(coffee, "JPEG", quality=90)),
               ("b002.png", images["astronaut.png"].read_bytes())]
    tar = write_tar(root / "shards" / "vqa.tar", members)
    assert cli(["scan", str(tar), "--out", str(root / "manifest"), "--no-progress"]) == 0
    assert cli(["hash", str(root / "manifest"), "--source", "vqa", "--out", str(root / "vqa.h"), "--no-progress",
                "--workers", "1"]) == 0
    return root / "vqa.h"


def _dedup(sources: Path, bench: Path, tmp_path: Path, policy: str, *flags: str) -> dict:
    out = tmp_path / "d"
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy",
                str(_policy(tmp_path, policy)), "--out", str(out), "--against", str(bench), *flags]) == 0
    return {"dropped": {(r["source"], r["key"]): r for r in pq.read_table(out / "dropped.parquet").to_pylist()},
            "held": {(r["source"], r["key"]): r for r in pq.read_table(out / "held.parquet").to_pylist()},
            "meta": json.loads((out / "dedup.json").read_text())}


def _matched(row: dict) -> tuple:
    return row["rule"], row["keeper_source"], row["keeper_key"], row["group"]


MANY = POLICY + "decontamination: {max_matches: 2}\n"  # coffee (4 training images) is suspect


def test_matches_are_dropped_by_sample_id_named_with_the_benchmark_image_and_a_suspect_one_is_held(
        sources, bench, tmp_path, capsys):
    found = _dedup(sources, bench, tmp_path, MANY)
    dropped, held, meta = found["dropped"], found["held"], found["meta"]
    assert _matched(dropped[("frames", "f004")]) == ("benchmark", "vqa", "b000", -1)  # the re-encoded grass
    assert dropped[("frames", "f004")]["distance"] <= 4
    # the astronaut's byte copies: matches of vqa:b002 (a benchmark match outranks being a duplicate)
    assert _matched(dropped[("web", "s003")]) == _matched(dropped[("frames", "f000")]) == ("benchmark", "vqa", "b002",
                                                                                           -1)
    # coffee matches 4 training images (> max_matches 2): held back; its kept copy c002 stays, listed with why
    assert list(held) == [("web", "c002")] and held[("web", "c002")]["why"] == "benchmark_image_matches_many"
    assert (held[("web", "c002")]["bench_source"], held[("web", "c002")]["bench_key"]) == ("vqa", "b001")
    assert dropped[("web", "s008")]["rule"] == "sha256"  # its byte copies stay dropped as duplicates of c002
    record = meta["decontamination"]
    assert record["suspect_images"] == [{"benchmark": "vqa:b001", "row": 1, "matches": 4}]
    assert (record["contaminated"], record["held"], record["radius"]) == (3, 1, {"frames": 4, "web": 4})
    for source, counts in meta["counts"].items():
        assert counts["hashed"] == counts["kept"] + counts["dropped"]
        assert counts["dropped"] == sum(counts["by_rule"].values()) == sum(s == source for s, _ in dropped)
    assert meta["counts"]["frames"]["by_rule"]["benchmark"] == 2 and meta["counts"]["web"]["held"] == 1
    err = capsys.readouterr().err
    assert "and 3 images matching 1 benchmark among 30 images" in err
    assert "held back: benchmark image vqa:b001 matches 4 training images" in err and "--confirm vqa:b001" in err

    confirmed = _dedup(sources, bench, tmp_path, MANY, "--confirm", "vqa:b001")
    assert _matched(confirmed["dropped"][("web", "c002")]) == ("benchmark", "vqa", "b001", -1)
    assert confirmed["held"] == {} and confirmed["meta"]["decontamination"]["confirmed"] == ["vqa:b001"]
    assert "confirmed by --confirm: vqa:b001" in capsys.readouterr().err


def test_a_source_with_an_unusual_share_flagged_is_held_until_confirmed_and_never_dropped_whole(
        sources, bench, tmp_path, capsys):
    share = POLICY + "decontamination: {max_matches: 2, max_share: 0.1, min_flagged: 1}\n"  # coffee held, as above
    found = _dedup(sources, bench, tmp_path, share)
    # frames: 1 of its 5 images matches by pHash (20% > 10%): held back, with why; its byte copy of the astronaut
    # is certain (never held, never counted), as is web's
    held = {key: r["why"] for (source, key), r in found["held"].items() if source == "frames"}
    assert held == {"f004": "source_share"}
    assert _matched(found["dropped"][("frames", "f000")])[:3] == ("benchmark", "vqa", "b002")
    assert _matched(found["dropped"][("web", "s003")])[:3] == ("benchmark", "vqa", "b002")
    assert found["meta"]["decontamination"]["suspect_sources"] == [{"source": "frames", "flagged": 1, "hashed": 5}]
    assert "held back: source frames has 1 of 5 images matching benchmarks" in capsys.readouterr().err
    confirmed = _dedup(sources, bench, tmp_path, share, "--confirm", "frames")
    assert {key for (source, key), r in confirmed["dropped"].items() if source == "frames"
            and r["rule"] == "benchmark"} == {"f000", "f004"}  # by sample id: f001..f003 are not touched by it


def test_plan_exclude_drops_matches_as_contaminated_with_the_benchmark_image(sources, bench, tmp_path, capsys):
    _dedup(sources, bench, tmp_path, MANY)
    assert cli(["plan", str(sources / "frames"), "--out", str(tmp_path / "p"), "--preset", "demo", "--mode", "image",
                "--quiet", "--exclude", str(tmp_path / "d")]) == 0
    assert "contaminated 2" in capsys.readouterr().err
    dropped = {r["manifest_row"]: r for r in pq.read_table(tmp_path / "p" / "dropped.parquet").to_pylist()}
    assert (dropped[4]["reason"], dropped[4]["keeper"]) == ("contaminated", "vqa:b000 (row 0)")
    assert (dropped[0]["reason"], dropped[0]["keeper"]) == ("contaminated", "vqa:b002 (row 2)")
    assert {dropped[row]["reason"] for row in (1, 3)} == {"duplicate"}
    meta = json.loads((tmp_path / "p" / "plan.json").read_text())
    assert meta["dropped_by_reason"]["contaminated"] == 2 and meta["dropped_by_reason"]["duplicate"] == 2
    from mmtok.codecs import emu35

    checkpoint = emu35.write_random_checkpoint(tmp_path / "ckpt")
    assert cli(["encode", "--plan", str(tmp_path / "p"), "--checkpoint", str(checkpoint), "--out", str(tmp_path / "e"),
                "--device", "cpu", "--loader-threads", "1", "--no-progress"]) == 0
    capsys.readouterr()
    assert cli(["status", str(tmp_path / "e"), "--plan", str(tmp_path / "p")]) == 0  # the job view names them too
    assert (f"curation: the plan excludes 4 rows of source frames listed by {(tmp_path / 'd').resolve()} "
            "(duplicate 2, contaminated 2); they never reach a GPU") in capsys.readouterr().out


@pytest.mark.parametrize("case, fragment", [
    ("other_algorithm", "was made by phash-other, the training tables by"),
    ("named_like_a_source", "have the same source name 'frames'; a benchmark is named apart"),
    ("confirm_typo", "--confirm 'vqa:b01' names neither a training source"),
    ("confirm_alone", "--confirm confirms benchmark matches: give the benchmarks with --against"),
    ("bad_radius", "`decontaminate` is a pHash radius 0..8 to benchmark images, or off; got 99"),
    ("bad_guards", "`decontamination: max_share` is a share in (0, 1], got 2"),
    ("guards_not_a_mapping", "`decontamination:` is a mapping of radius, max_matches, max_share, min_flagged"),
    ("guards_alias_bomb", "`decontamination: max_matches` is an integer >= 0, got [["),
    ("benchmark_name_with_colon", "benchmark name 'v:qa' holds ':'"),
])
def test_bad_benchmark_input_is_one_line_exit_2_and_nothing_written(sources, bench, tmp_path, capsys, case,
                                                                     fragment):
    bomb = "[&a0 [x, x, x, x, x, x, x, x, x, x], " + ", ".join(
        f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)) + "]"
    policy = {"bad_radius": POLICY.replace("{rule: exact}", "{rule: exact, decontaminate: 99}"),
              "bad_guards": POLICY + "decontamination: {max_share: 2}\n",
              "guards_not_a_mapping": POLICY + "decontamination: false\n",
              "guards_alias_bomb": POLICY + f"decontamination: {{max_matches: {bomb}}}\n"}.get(case, POLICY)
    against = ["--against", str(bench)]
    flags = {"confirm_typo": ["--confirm", "vqa:b01"], "confirm_alone": ["--confirm", "frames"]}.get(case, [])
    if case in ("other_algorithm", "named_like_a_source", "benchmark_name_with_colon"):
        copy = tmp_path / "vqa.h"
        shutil.copytree(bench, copy)
        meta = json.loads((copy / "hashes.json").read_text())
        meta.update({"other_algorithm": {"algorithm": "phash-other"}, "named_like_a_source": {"source": "frames"},
                     "benchmark_name_with_colon": {"source": "v:qa"}}[case])
        (copy / "hashes.json").write_text(json.dumps(meta))
        against = ["--against", str(copy)]
    if case == "confirm_alone":
        against = []
    capsys.readouterr()
    assert cli(["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy",
                str(_policy(tmp_path, policy)), "--out", str(tmp_path / "d"), *against, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmtok dedup: error: ") and err.count("\n") == 1 and fragment in err, err[:2000]
    assert not (tmp_path / "d").exists()


def _tiles(sheet: Path) -> list[list[np.ndarray]]:
    """The image tiles of a contact sheet (TILE x TILE squares), row by row."""
    from mmtok.curate.report import LABEL, TILE

    pixels = np.asarray(Image.open(sheet).convert("RGB"), np.int16)
    rows = (pixels.shape[0] - 8) // (TILE + LABEL + 8)
    columns = (pixels.shape[1] - 8) // (TILE + 8)
    return [[pixels[8 + y * (TILE + LABEL + 8):][:TILE, 8 + x * (TILE + 8):][:, :TILE] for x in range(columns)]
            for y in range(rows)]


def _grey(tile: np.ndarray) -> bool:
    return bool((tile == 128).all(axis=2).mean() > 0.9)  # the placeholder: flat grey under a line of text


def test_the_report_shows_sampled_groups_every_match_beside_its_benchmark_image_and_counts_that_add_up(
        sources, tmp_path, capsys):
    images = real_images()
    grass = Image.open(next(p for p in skimage_images() if p.name == "grass.png")).convert("RGB")
    tar = write_tar(tmp_path / "shards" / "vqa.tar", [("b000.jpg", _encoded(grass, "JPEG", quality=30)),
                                                       ("b002.png", images["astronaut.png"].read_bytes())])
    assert cli(["scan", str(tar), "--out", str(tmp_path / "m"), "--no-progress"]) == 0
    assert cli(["hash", str(tmp_path / "m"), "--source", "vqa", "--out", str(tmp_path / "vqa.h"), "--no-progress",
                "--workers", "1"]) == 0
    argv = ["dedup", str(sources / "web.h"), str(sources / "frames.h"), "--policy", str(_policy(tmp_path, POLICY)),
            "--out", str(tmp_path / "d"), "--against", str(tmp_path / "vqa.h"), "--report"]
    capsys.readouterr()
    assert cli(argv) == 0
    assert "report: " in capsys.readouterr().err
    report = tmp_path / "d" / "report"
    meta = json.loads((tmp_path / "d" / "dedup.json").read_text())
    index = (report / "index.md").read_text()
    for source, counts in meta["counts"].items():
        matches = counts["by_rule"]["benchmark"]
        assert counts["hashed"] == counts["kept"] + (counts["dropped"] - matches) + matches
        assert (f"| {source} | {counts['hashed']:,} | {counts['kept']:,} | {counts['dropped'] - matches:,} | "
                f"{matches:,} | 0 | {counts['held']:,} |") in index
    recorded = json.loads((report / "report.json").read_text())
    assert recorded["unshown"] == [] and "benchmark-matches.png" in recorded["sheets"]
    matches = _tiles(report / "benchmark-matches.png")
    assert len(matches) == meta["decontamination"]["contaminated"] == 3  # web s003, frames f000 and f004
    assert all(len(row) == 2 and not _grey(row[0]) and not _grey(row[1]) for row in matches)
    assert "frames:f004 d=" in index and "benchmark vqa:b000" in index
    duplicates = [name for name in recorded["sheets"] if name.startswith("duplicates-")]
    assert len(duplicates) == 2 and all(len(_tiles(report / name)) for name in duplicates)
    assert "keeper web:c002" in index  # coffee's group, keeper first

    with open(tar, "ab") as handle:  # the benchmark's tar changes after its scan: its images are not trusted
        handle.write(bytes(10240))
    assert cli(argv) == 0
    recorded = json.loads((report / "report.json").read_text())
    assert {u["source"] for u in recorded["unshown"]} == {"vqa"}
    assert {u["reason"] for u in recorded["unshown"]} == {"stale_media"}
    assert all(not _grey(row[0]) and _grey(row[1]) for row in _tiles(report / "benchmark-matches.png"))
    assert "could not be shown" in capsys.readouterr().err and "stale_media" in (report / "index.md").read_text()


def test_a_match_never_keeps_a_group_and_an_already_deduplicated_set_and_unquoted_off_work(sources, tmp_path, capsys):
    # found by an attack: with no duplicates among the tables the run crashed (an Arrow cast of empty columns);
    # `off` unquoted (YAML reads False) was refused; a group whose keeper was a match lost its last copy
    images = real_images()
    rocket = Image.open(images["rocket.jpg"]).convert("RGB")
    brightened = _encoded(ImageEnhance.Brightness(rocket).enhance(1.3))  # frames' f002, byte for byte
    tar = write_tar(tmp_path / "shards" / "vqa.tar", [("b000.png", brightened)])
    assert cli(["scan", str(tar), "--out", str(tmp_path / "m"), "--no-progress"]) == 0
    assert cli(["hash", str(tmp_path / "m"), "--source", "vqa", "--out", str(tmp_path / "vqa.h"), "--no-progress",
                "--workers", "1"]) == 0
    policy = _policy(tmp_path, "sources:\n  frames: {rule: radius, radius: 4, decontaminate: off}\n"
                               "  web: {rule: off, decontaminate: off}\n")
    assert cli(["dedup", str(sources / "frames.h"), str(sources / "web.h"), "--policy", str(policy), "--out",
                str(tmp_path / "d"), "--against", str(tmp_path / "vqa.h")]) == 0
    rows = {(r["source"], r["key"]): r for r in pq.read_table(tmp_path / "d" / "dropped.parquet").to_pylist()}
    assert _matched(rows[("frames", "f002")]) == ("benchmark", "vqa", "b000", -1)  # bytes match with `off`
    assert ("frames", "f001") not in rows  # its near copy now keeps the group: the image stays in the data
    meta = json.loads((tmp_path / "d" / "dedup.json").read_text())
    groups = sorted({r["group"] for r in rows.values() if r["rule"] != "benchmark"})
    assert groups == list(range(meta["groups"]))  # numbered 0.. with no gap, and counted as listed
    capsys.readouterr()
    assert cli(["dedup", str(sources / "frames.h"), "--policy", str(_policy(tmp_path, "sources:\n  frames: "
                "{rule: exact}\n")), "--out", str(tmp_path / "alone"), "--against", str(tmp_path / "vqa.h")]) == 0
    alone = pq.read_table(tmp_path / "alone" / "dropped.parquet").to_pylist()
    assert [(r["key"], r["rule"]) for r in alone] == [("f001", "benchmark"), ("f002", "benchmark")]  # radius 4
    assert "0 duplicates in 0 groups and 2 images matching 1 benchmark" in capsys.readouterr().err
