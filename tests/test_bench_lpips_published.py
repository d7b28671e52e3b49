"""Our offline LPIPS against published LPIPS values for public image pairs.

The pairs: the five TID2013 reference/distorted pairs (I03, I04, I06, I08, I19; 512x384 BMP) that the
IQA-PyTorch project (PyPI `pyiqa`) ships in its source distribution under ResultsCalibra/, with the values
its calibration table publishes for the original LPIPS code (`lpips.LPIPS(net="alex", version="0.1")`,
row "lpips" of ResultsCalibra/results_official.csv). The sdist (8 MB) is taken from $MMTOK_PYIQA_SDIST,
or the cache ~/.cache/mmtok/, or downloaded once with pip (the ordinary PyPI client); the test skips,
saying why, only when none of these can provide it. Its sha256 is checked before use.
"""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmtok.bench.lpips import LPIPS, uint8_to_model

SDIST = "pyiqa-0.1.16.tar.gz"
SDIST_SHA256 = "80fb913302585a774875c224b4f95068ac17bebd88f735876e6f0c3bb0988d34"
# ResultsCalibra/results_official.csv, row "lpips" (the original PyTorch LPIPS, AlexNet, v0.1).
PUBLISHED = {"I03": 0.7237, "I04": 0.2572, "I06": 0.05079, "I08": 0.05205, "I19": 0.4253}


def sdist_path() -> Path:
    explicit = os.environ.get("MMTOK_PYIQA_SDIST")
    if explicit:
        return Path(explicit)
    cache = Path.home() / ".cache" / "mmtok"
    path = cache / SDIST
    if not path.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run([sys.executable, "-m", "pip", "download", "pyiqa==0.1.16", "--no-deps",
                            "--no-binary", ":all:", "--quiet", "-d", str(cache)], check=True, timeout=300,
                           capture_output=True)
        except (subprocess.SubprocessError, OSError) as err:
            pytest.skip(f"cannot obtain {SDIST} (set MMTOK_PYIQA_SDIST to a local copy): {err}")
    return path


@pytest.fixture(scope="module")
def pairs() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    path = sdist_path()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == SDIST_SHA256, f"{path} is not the expected sdist"
    out = {}
    with tarfile.open(path) as archive:
        for name in PUBLISHED:
            images = []
            for folder in ("ref_dir", "dist_dir"):
                data = archive.extractfile(f"pyiqa-0.1.16/ResultsCalibra/{folder}/{name}.bmp").read()
                images.append(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
            out[name] = tuple(images)
    return out


def test_lpips_matches_published_values_of_the_original_implementation(pairs):
    model = LPIPS()
    with torch.no_grad():
        ours = {name: float(model(uint8_to_model(ref), uint8_to_model(dist))[0]) for name, (ref, dist) in pairs.items()}
    for name, value in PUBLISHED.items():
        # The published numbers have 4 significant decimals; ours agree within their rounding.
        assert abs(ours[name] - value) < 1e-4, (name, ours[name], value)
