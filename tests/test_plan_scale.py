"""The plan files are byte-identical to those of the whole-table planner it replaced (golden sha256s).

The golden digests were recorded with the planner of commit 6b0f67a (every manifest row in memory)
before the planner was made to stream the manifest group by group: multi-image documents, scan
errors, documents dropped whole and as too long, balance splits (64 ranks), small processing groups,
and a caption mode reading real tar sidecars. plan.json is hashed without the fields that name the
temporary directories (`manifest_dir`, and the fingerprints that depend on the tar paths in the
manifest). The digests depend on the pyarrow version (Parquet's `created_by`), pinned in constraints.txt.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from mmtok.plan import batching
from mmtok.plan import rows as plan_rows
from realmedia import skimage_images
from test_plan import FILES, SMALL, caption_shard, documents_of, images, plan, row, write_manifest  # noqa: F401

PATH_FIELDS = ("manifest_dir", "manifest_fingerprint", "fingerprint")


def digests(out: Path) -> dict[str, str]:
    """sha256 of every plan file (plan.json without the fields naming temporary paths)."""
    found = {}
    for name in FILES:
        data = (out / name).read_bytes()
        if name == "plan.json":
            meta = json.loads(data)
            for field in PATH_FIELDS:
                meta.pop(field)
            data = json.dumps(meta, sort_keys=True).encode()
        found[name] = hashlib.sha256(data).hexdigest()[:16]
    return found


@pytest.fixture(scope="module")
def mixed(tmp_path_factory, images) -> Path:
    """Real image shapes as one-image documents, documents of 2-5 images, a scan error, a document with
    one member too small (dropped whole), a document too long for SMALL_LONG."""
    sizes = [1] * len(images) + [2, 3, 5, 1, 4, 2, 1, 3] * 3 + [1] * len(images) + [6, 1, 2]
    rows = documents_of(images, sizes)
    tiny = dict(width=8, height=8)
    rows += [row(10_000, 0), row(10_000, 1, **tiny), row(10_001, 0, status="error", reason="truncated_member")]
    return write_manifest(tmp_path_factory.mktemp("mixed"), rows)


CASES = {  # name -> (parameters, world size, small processing groups)
    "1 rank": (SMALL, 1, False),
    "3 ranks": (SMALL, 3, False),
    "64 ranks, balance splits": (SMALL, 64, False),
    "64 ranks, small groups": (SMALL, 64, True),
    "long documents dropped, 5 ranks": (SMALL.override(max_document_tokens=4000), 5, False),
}
GOLDEN: dict[str, dict[str, str]] = {
    "1 rank": {
        "plan.parquet": "1c0398637ed8d42a",
        "batches.parquet": "aee157196b1f865f",
        "documents.parquet": "ac11736a85198c9b",
        "dropped.parquet": "1945f03f52f73afe",
        "plan.json": "026db39d1e718d0c",
    },
    "3 ranks": {
        "plan.parquet": "1c0398637ed8d42a",
        "batches.parquet": "aee157196b1f865f",
        "documents.parquet": "ac11736a85198c9b",
        "dropped.parquet": "1945f03f52f73afe",
        "plan.json": "96a1387d223e94bf",
    },
    "64 ranks, balance splits": {
        "plan.parquet": "39ac5bd04a9928af",
        "batches.parquet": "688d39548225fb6b",
        "documents.parquet": "dd628d3503d27a48",
        "dropped.parquet": "1945f03f52f73afe",
        "plan.json": "1532696048bba85e",
    },
    "64 ranks, small groups": {
        "plan.parquet": "39ac5bd04a9928af",
        "batches.parquet": "688d39548225fb6b",
        "documents.parquet": "dd628d3503d27a48",
        "dropped.parquet": "1945f03f52f73afe",
        "plan.json": "1532696048bba85e",
    },
    "long documents dropped, 5 ranks": {
        "plan.parquet": "ad0384f5d24ac8bd",
        "batches.parquet": "bed2e5e694f3811b",
        "documents.parquet": "f706a7c5b038f14e",
        "dropped.parquet": "64b33570bd77b3f2",
        "plan.json": "8ed41c9c78f1c15e",
    },
}
CAPTIONS_GOLDEN = {
    "plan.parquet": "2dc727c5ea735494",
    "batches.parquet": "fa2dc5aef7188ed1",
    "documents.parquet": "1a33f02460be5dca",
    "dropped.parquet": "7835ecdc2f5b8672",
    "plan.json": "5bfdff08e17e39d7",
}


@pytest.mark.parametrize("case", CASES)
def test_plan_files_match_the_whole_table_planner(mixed, tmp_path, monkeypatch, case):
    params, world_size, small_groups = CASES[case]
    if small_groups:
        monkeypatch.setattr(batching, "GROUP_ROWS", 7)
        monkeypatch.setattr(batching, "MAX_GROUP_WINDOWS", 2)
        monkeypatch.setattr(plan_rows, "READ_ROWS", 5)
        monkeypatch.setattr(plan_rows, "FILTER_ROWS", 3)
    meta = plan(mixed, tmp_path / "p", params, world_size)
    if world_size == 64:
        assert meta["balance"]["split_batches"] > 0
    if params.max_document_tokens == 4000:
        assert meta["long_documents"]["dropped"] > 0
    assert digests(tmp_path / "p") == GOLDEN[case]


def test_caption_mode_plan_files_match_the_whole_table_planner(tmp_path):
    sources = [p for p in skimage_images() if p.suffix == ".png"][:8]
    captions = [b"An astronaut.", None, b"A cat on a mat.", b"  ", b"Coins " * 30, b"x", "caf\u00e9".encode(), b"end"]
    _, rows = caption_shard(tmp_path, sources, captions)
    manifest = write_manifest(tmp_path / "m", rows)
    plan(manifest, tmp_path / "p", SMALL.override(mode="image-text"), 2)
    assert digests(tmp_path / "p") == CAPTIONS_GOLDEN
