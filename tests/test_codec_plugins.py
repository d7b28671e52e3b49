"""Codecs are plugins: a package that registers a codec in the `mmtok.codecs` entry-point group runs through every
stage with no edit to mmtok, and a broken plugin is one line naming it that hides no other codec.

The toy plugin (tests/plugins/toycodec) is installed as pip would install it -- its module and a .dist-info
holding its metadata and entry points, on a path of its own -- so that importlib.metadata finds it exactly as it
finds an installed package; the CLI then runs in fresh interpreters with that path on PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import tomllib

from encodekit import PLAN_FLAGS, caption_corpus, chat_tokenizer
from mmtok.cli import main
from mmtok.codecs import registry
from mmtok.vocab import VocabLayout

TOYCODEC = Path(__file__).parent / "plugins" / "toycodec"


def install(site: Path, project: dict, modules: dict[str, str]) -> Path:
    """Install a distribution into `site` the way pip lays it out: its modules (name -> source) and a
    NAME-VERSION.dist-info with METADATA and entry_points.txt (the files importlib.metadata reads)."""
    site.mkdir(parents=True, exist_ok=True)
    for name, source in modules.items():
        (site / f"{name}.py").write_text(source, "utf-8")
    info = site / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n")
    lines = [f"[{group}]\n" + "".join(f"{name} = {value}\n" for name, value in points.items())
             for group, points in project.get("entry-points", {}).items()]
    (info / "entry_points.txt").write_text("\n".join(lines), "utf-8")
    return site


def toy_site(site: Path) -> Path:
    """The toy codec package of tests/plugins/toycodec, from its own pyproject.toml."""
    project = tomllib.loads((TOYCODEC / "pyproject.toml").read_text("utf-8"))["project"]
    return install(site, project, {"mmtok_toycodec": (TOYCODEC / "mmtok_toycodec.py").read_text("utf-8")})


@pytest.fixture
def on_path(monkeypatch):
    """Put a plugin site on sys.path for this test (the registry's caches cleared before and after)."""
    def add(site: Path) -> None:
        monkeypatch.syspath_prepend(str(site))
        registry.entries.cache_clear()
        registry.plugin.cache_clear()

    yield add
    registry.entries.cache_clear()
    registry.plugin.cache_clear()


def mmtok(site: Path, *argv: str) -> str:
    """Run the `mmtok` CLI in a fresh interpreter with the plugin site on PYTHONPATH; its stdout + stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "mmtok", *argv], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, f"mmtok {' '.join(argv)} failed ({done.returncode}): {done.stderr[-3000:]}"
    return done.stdout + done.stderr


def test_a_plugin_codec_runs_scan_plan_encode_merge_and_tokenizer_build(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    site = toy_site(tmp_path / "site")
    with pytest.raises(ModuleNotFoundError):  # installed on its own path only: mmtok's own code never names it
        __import__("mmtok_toycodec")
    caption_corpus(tmp_path / "data")
    text = chat_tokenizer(tmp_path / "text")
    sys.path.insert(0, str(site))
    try:
        import mmtok_toycodec

        checkpoint = mmtok_toycodec.write_random_checkpoint(tmp_path / "ckpt", seed=1)
    finally:
        sys.path.remove(str(site))
    mmtok(site, "scan", str(tmp_path / "data" / "*.tar"), "--out", str(tmp_path / "manifest"), "--workers", "1",
          "--no-progress")
    mmtok(site, "plan", str(tmp_path / "manifest"), "--out", str(tmp_path / "plan"), "--quiet", *PLAN_FLAGS,
          "--factor", "8", "--text-tokenizer", str(text), "--world-size", "2")
    for rank in ("0", "1"):
        mmtok(site, "encode", "--plan", str(tmp_path / "plan"), "--codec", "toy-image", "--checkpoint",
              str(checkpoint), "--out", str(tmp_path / "encoded"), "--rank", rank, "--world-size", "2",
              "--device", "cpu", "--no-progress")
    mmtok(site, "merge", str(tmp_path / "encoded"))
    said = mmtok(site, "tokenizer", "build", "--text-tokenizer", str(text), "--out", str(tmp_path / "omni"),
                 "--image-codec", "toy-image")
    assert "tokenizer build" in said

    dataset = IndexedDataset(str(tmp_path / "encoded" / "merged"))  # megatron-core opens what merge wrote
    tokens = np.concatenate([np.asarray(dataset[i]) for i in range(len(dataset))])
    layout = VocabLayout(text_size=json.loads((tmp_path / "omni" / "tokenizer_config.json").read_text())["vocab_size"])
    codes = tokens[(tokens >= layout.image_offset) & (tokens < layout.image_offset + layout.image_codebook)]
    codes = codes - layout.image_offset
    assert len(dataset) > 10 and codes.size > 100
    assert codes.max() < 64 and np.unique(codes).size > 5  # the toy palette's codes, not one colour everywhere
    encoded = json.loads((tmp_path / "encoded" / "parts" / "part-00000" / "identity.json").read_text())
    assert encoded["codec"]["name"] == "toy-image" and encoded["codec"]["codebook_size"] == 64
    config = json.loads((tmp_path / "omni" / "tokenizer_config.json").read_text())
    assert config["vision_tokenizer"]["type"] == "ToyImage" and config["audio_tokenizer"]["type"] == "wavtokenizer"


def test_the_toy_codec_is_found_only_once_installed(tmp_path, on_path):
    assert "toy-image" not in registry.names()
    on_path(toy_site(tmp_path / "site"))
    assert "toy-image" in registry.names("image") and "toy-image" not in registry.names("audio")
    assert registry.plugin("toy-image").TOKENIZER_TYPE == "ToyImage"


BROKEN = {  # codec name -> the module its distribution registers for it
    "fails-to-import": "import mmtok_no_such_dependency  # a dependency the plugin forgot to declare\n",
    "no-functions": "MODALITY = 'image'\nTOKENIZER_TYPE = 'Half'\n\ndef load(directory, device):\n    return None\n",
    "not-a-codec": ("from mmtok_toycodec import MODALITY, TOKENIZER_TYPE, checkpoint_paths, write_random_checkpoint\n\n"
                    "def load(directory, device):\n    return object()\n"),
    "breaks-the-contract": ("from mmtok_toycodec import *\nimport mmtok_toycodec\n\n"
                            "def load(directory, device):\n    codec = mmtok_toycodec.load(directory, device)\n"
                            "    codec.pixels_per_code = 0\n    return codec\n"),
    "exits-at-import": "import sys\nsys.exit('this plugin ends the process')\n",
    "load-raises": ("from mmtok_toycodec import MODALITY, TOKENIZER_TYPE, checkpoint_paths, write_random_checkpoint\n\n"
                    "def load(directory, device):\n    raise ValueError('boom in load')\n"),
    "another-name": ("from mmtok_toycodec import *\nimport mmtok_toycodec\n\n"
                     "def load(directory, device):\n    return mmtok_toycodec.load(directory, device)\n"),
    "codes-out-of-range": ("from mmtok_toycodec import *\nimport mmtok_toycodec\n\n"
                           "class Wrong(mmtok_toycodec.ToyImageCodec):\n    name = 'codes-out-of-range'\n\n"
                           "    def encode(self, pixels):\n        return super().encode(pixels) + 1000\n\n"
                           "def load(directory, device):\n    codec = mmtok_toycodec.load(directory, device)\n"
                           "    codec.__class__ = Wrong\n    return codec\n"),
}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


@pytest.fixture
def broken_plugins(tmp_path, on_path):
    """The toy codec and four broken plugins, each a distribution of its own, on sys.path; a toy checkpoint."""
    site = toy_site(tmp_path / "site")
    for number, (name, source) in enumerate(BROKEN.items()):
        module = f"mmtok_broken_{number}"
        install(site, {"name": f"broken-{number}", "version": "1.0",
                       "entry-points": {"mmtok.codecs": {name: module}}}, {module: source})
    on_path(site)
    import mmtok_toycodec

    return mmtok_toycodec.write_random_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_broken_plugin_is_one_line_naming_it_and_hides_no_other_codec(broken_plugins, tmp_path, capsys, name):
    from encodekit import real_images
    from mmtok.codecs import emu35

    image = real_images()["coffee.png"]
    small = ["--min-pixels", "1024", "--max-pixels", "4096", "--device", "cpu"]
    assert main(["codec", "encode", "--codec", name, "--checkpoint", str(broken_plugins), str(image),
                 "--out", str(tmp_path / "codes.npy"), *small]) == 2
    line = _one_line(capsys)
    number = list(BROKEN).index(name)
    if name != "codes-out-of-range":  # a codec that loaded: its codes are refused, named by the codec
        assert f"codec plugin {name!r} (mmtok_broken_{number}, from broken-{number})" in line, line
    else:
        assert "codec codes-out-of-range: the codes of" in line, line
    expected = {"fails-to-import": "import failed: ModuleNotFoundError", "no-functions": "no function",
                "not-a-codec": "not a mmtok.codecs.base.Codec", "breaks-the-contract": "pixels_per_code must be",
                "exits-at-import": "import failed: SystemExit: this plugin ends the process",
                "load-raises": "load() failed: ValueError: boom in load",
                "another-name": "name 'toy-image' is not the name it is registered as ('another-name')",
                "codes-out-of-range": "outside [0, 64)"}
    assert expected[name] in line, line
    # every other codec still works, the built-in ones and the toy plugin beside the broken one, and a
    # mistake about another codec is told without importing any plugin
    assert {"emu3.5", "emu3", "toy-image"} <= set(registry.names("image"))
    assert main(["encode", "--plan", str(tmp_path / "plan"), "--codec", "wavtokenizer", "--checkpoint",
                 str(broken_plugins), "--out", str(tmp_path / "encoded"), "--device", "cpu"]) == 2
    assert "--codec wavtokenizer is an audio codec; this needs an image codec (registered codecs:" in _one_line(capsys)
    for codec, checkpoint in (("emu3.5", emu35.write_random_checkpoint(tmp_path / "emu35")),
                              ("toy-image", broken_plugins)):
        assert main(["codec", "encode", "--codec", codec, "--checkpoint", str(checkpoint), str(image),
                     "--out", str(tmp_path / f"{codec}.npy"), *small]) == 0
        assert np.load(tmp_path / f"{codec}.npy").ndim == 2


def test_unknown_twice_registered_and_wrong_modality_codecs_are_refused_in_one_line(tmp_path, on_path, capsys):
    from encodekit import real_images

    site = install(tmp_path / "site", {"name": "shadow", "version": "1.0",
                                       "entry-points": {"mmtok.codecs": {"emu3": "mmtok_shadow"}}},
                   {"mmtok_shadow": "raise RuntimeError('never imported')\n"})
    on_path(site)
    text = chat_tokenizer(tmp_path / "text")
    assert main(["tokenizer", "build", "--text-tokenizer", str(text), "--out", str(tmp_path / "a"),
                 "--image-codec", "emu3"]) == 2
    line = _one_line(capsys)
    assert "codec 'emu3' is registered more than once" in line and "mmtok_shadow (from shadow)" in line, line
    assert main(["tokenizer", "build", "--text-tokenizer", str(text), "--out", str(tmp_path / "b"),
                 "--image-codec", "no-such-codec"]) == 2
    line = _one_line(capsys)
    assert "unknown codec 'no-such-codec'; registered codecs: emu3, emu3.5, wavtokenizer" in line, line
    assert main(["tokenizer", "build", "--text-tokenizer", str(text), "--out", str(tmp_path / "c"),
                 "--image-codec", "wavtokenizer"]) == 2
    assert "--image-codec wavtokenizer is an audio codec" in _one_line(capsys)
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()  # refused before anything is written
    assert main(["tokenizer", "build", "--text-tokenizer", str(text), "--out", str(tmp_path / "d")]) == 0
    shar = tmp_path / "no-shar"
    shar.mkdir()
    assert main(["encode", "--modality", "audio", "--shar", str(shar), "--codec", "emu3.5", "--checkpoint",
                 str(tmp_path), "--out", str(tmp_path / "enc"), "--device", "cpu", "--no-progress"]) == 2
    assert "is an image codec" in capsys.readouterr().err
    del real_images
