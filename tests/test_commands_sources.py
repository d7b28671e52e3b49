import io
import tarfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from mmtok.cli import main
from mmtok.commands.sources import load_source
from mmtok.errors import MmtokError
from realmedia import REPO, skimage_images


def test_every_bundled_declaration_is_valid():
    files = sorted((REPO / "manifests").glob("*.yaml"))
    assert len(files) >= 5
    for path in files:
        source = load_source(path, root="/data")
        assert source.modality in ("image", "audio")
        assert source.inputs, path


def _shard(path: Path, images: list[Path]) -> None:
    with tarfile.open(path, "w") as tar:
        for number, image in enumerate(images):
            data = image.read_bytes()
            info = tarfile.TarInfo(f"sample{number}{image.suffix}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_scan_takes_inputs_and_options_from_a_declaration(tmp_path):
    photos = [p for p in skimage_images() if p.suffix in (".png", ".jpg")][:3]
    (tmp_path / "shards").mkdir()
    _shard(tmp_path / "shards" / "a.tar", photos)
    declaration = tmp_path / "corpus.yaml"
    declaration.write_text("name: corpus\nmodality: image\ninputs: [shards/*.tar]\noptions: {workers: 1}\n")
    assert main(["scan", "--source", str(declaration), "--out", str(tmp_path / "m"), "--no-progress"]) == 0
    table = pq.read_table(tmp_path / "m" / "manifest.parquet")
    assert table.num_rows == 3
    assert set(table.column("tar").to_pylist()) == {str(tmp_path / "shards" / "a.tar")}


def test_declaration_errors_name_the_problem(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\nmodality: image\ninputs: [x.tar]\nshards: [y.tar]\n")
    with pytest.raises(MmtokError, match="unknown keys"):
        load_source(bad)
    audio = tmp_path / "audio.yaml"
    audio.write_text("name: speech\nmodality: audio\ninputs: [clips]\n")
    assert main(["scan", "--source", str(audio), "--out", str(tmp_path / "m")]) == 2
    assert "declares modality 'audio'" in capsys.readouterr().err
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("name: w\nmodality: image\ninputs: [x.tar]\noptions: {colour: red}\n")
    assert main(["scan", "--source", str(wrong), "--out", str(tmp_path / "m")]) == 2
    assert "'colour' is not an option" in capsys.readouterr().err
