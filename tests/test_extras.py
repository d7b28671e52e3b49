"""Optional extras: a missing one is one line naming the command, the extra and the pip command (exit 2)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from mmtok import cli, extras
from mmtok.errors import MmtokError

REPO = Path(__file__).resolve().parent.parent
tomllib = pytest.importorskip("tomllib")  # Python 3.11+


def test_require_returns_the_module_or_says_which_extra_to_install():
    assert extras.require("json", "bench", "mmtok bench reconstruct") is sys.modules["json"]
    with pytest.raises(MmtokError) as raised:
        extras.require("mmtok_no_such_module", "bench", "mmtok bench reconstruct")
    message = str(raised.value)
    assert message.startswith("mmtok bench reconstruct needs the bench extra: pip install 'mmtok[bench]' (")
    assert "mmtok_no_such_module" in message and "\n" not in message


def test_bench_reconstruct_without_the_bench_extra_exits_2_with_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "pesq", None)  # `import pesq` now raises ImportError, as when absent
    status = cli.main(["bench", "reconstruct", "--manifest", str(tmp_path), "--category-column", "c",
                       "--tokenizer", f"emu3.5={tmp_path}", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert status == 2
    assert len(err.splitlines()) == 1 and "needs the bench extra: pip install 'mmtok[bench]'" in err
    assert not (tmp_path / "out").exists()  # refused before any work


def test_every_extra_module_is_declared_by_that_extra():
    # The import names mmtok checks (mmtok.extras.EXTRAS) and the distributions pyproject.toml declares.
    declared = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]["optional-dependencies"]
    distributions = {"matplotlib": "matplotlib", "skimage": "scikit-image", "pesq": "pesq", "pystoi": "pystoi",
                     "megatron": "megatron-core"}
    for extra, modules in extras.EXTRAS.items():
        names = {Requirement(text).name for text in declared[extra]}
        assert {distributions[module.split(".")[0]] for module in modules} == names, extra


def test_torch_range_keeps_the_torch_of_an_ngc_container():
    # NGC PyTorch images carry pre-release versions such as 2.9.0a0+50eac811a6; pip keeps an installed
    # torch when the range contains its version, so the range must admit these.
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text("utf-8"))["project"]["dependencies"]
    torch = next(Requirement(text) for text in dependencies if Requirement(text).name == "torch")
    for version in ("2.9.0a0+50eac811a6", "2.10.0a0+b558c986e8", "2.13.0+cpu", "2.14.1"):
        assert torch.specifier.contains(version, prereleases=True), version
    assert not torch.specifier.contains("3.0.0", prereleases=True)
