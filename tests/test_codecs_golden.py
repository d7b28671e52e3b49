"""The golden codec sets kept compact in tests/golden expand to the official files bit for bit (the sha256
list in tests/golden/README.md), so the parity tests read exactly what the official code read and wrote."""

from __future__ import annotations

import hashlib
import json
import os
import re

import pytest

from goldenkit import COMPACT_ROOT, expand_weights


def recorded_sha256(name: str) -> dict[str, str]:
    text = (COMPACT_ROOT / "README.md").read_text()
    return {path: digest for digest, path in re.findall(r"^([0-9a-f]{64})  (\S+)$", text, re.MULTILINE)
            if path.startswith(f"{name}/")}


@pytest.mark.parametrize("name", ["emu35", "emu3", "wavtokenizer"])
def test_expanded_set_has_the_recorded_sha256_for_every_file(golden_sets, name):
    folder = golden_sets(name)
    expected = recorded_sha256(name)
    assert any("/checkpoint/model." in path for path in expected)
    if not os.environ.get("MMTOK_GOLDEN"):  # the in-repo expansion holds exactly the recorded files
        assert sorted(f"{name}/{p.relative_to(folder).as_posix()}" for p in folder.rglob("*") if p.is_file()) \
            == sorted(expected)
    for path, digest in expected.items():
        assert hashlib.sha256((folder.parent / path).read_bytes()).hexdigest() == digest, path


def test_expansion_refuses_tensors_that_differ_from_the_packed_ones(tmp_path):
    header = json.loads((COMPACT_ROOT / "emu3" / "checkpoint" / "weights.json").read_text())
    counter = next(t for t in header["tensors"] if t["key"].endswith("num_batches_tracked"))
    counter["fill"] += 1
    compact = tmp_path / "compact"
    compact.mkdir()
    (compact / "weights.json").write_text(json.dumps(header))
    (compact / "weights.npz").symlink_to(COMPACT_ROOT / "emu3" / "checkpoint" / "weights.npz")
    with pytest.raises(AssertionError, match="rebuilt tensors differ"):
        expand_weights(compact, tmp_path)
