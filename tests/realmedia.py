"""Where the real test media lives, with a clear failure when it is missing (tests use real media,
not synthetic noise: docs/development.md#tests).

Images: scikit-image's bundled `skimage.data` files and Debian's `mate-backgrounds` photos.
Speech: Debian's `alsa-utils` sounds (48 kHz), `asterisk-core-sounds-en-wav` prompts (8 kHz) and
`espeak-ng` for known texts. `.ci/run` installs the Debian packages. The golden codec sets are in the
repository (tests/golden/, compact; goldenkit.py expands them); $MMTOK_GOLDEN may point at a folder of
original sets instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MATE_DIR = Path("/usr/share/backgrounds/mate")
ALSA_DIR = Path("/usr/share/sounds/alsa")
ASTERISK_DIR = Path("/usr/share/asterisk/sounds/en")
DEBIAN_MEDIA = "mate-backgrounds alsa-utils asterisk-core-sounds-en asterisk-core-sounds-en-wav espeak-ng"


def _require(paths: list[Path], what: str) -> list[Path]:
    if not paths:
        pytest.fail(f"{what} not found: install Debian's test media with "
                    f"`apt-get install -y {DEBIAN_MEDIA}` (.ci/run does this)")
    return paths


def skimage_images() -> list[Path]:
    """The bundled scikit-image sample photos (jpg/png/gif/tif), sorted by name."""
    import skimage.data

    folder = Path(skimage.data.__file__).parent
    files = [p for p in sorted(folder.iterdir()) if p.suffix.lower() in (".png", ".jpg", ".gif", ".tif")]
    return _require(files, "scikit-image sample images")


def mate_photos() -> list[Path]:
    """Debian mate-backgrounds photos and artwork (JPEG and PNG up to 5640x3172), sorted."""
    return _require(sorted(p for p in MATE_DIR.rglob("*") if p.suffix.lower() in (".jpg", ".png")),
                    "mate-backgrounds photos")


def alsa_sounds() -> list[Path]:
    """Debian alsa-utils speech samples (48 kHz WAV), sorted."""
    return _require(sorted(ALSA_DIR.glob("*.wav")), "alsa-utils sounds")


def asterisk_prompts() -> list[Path]:
    """Debian asterisk English prompts (8 kHz WAV), sorted."""
    return _require(sorted(ASTERISK_DIR.glob("*.wav")), "asterisk-core-sounds-en-wav prompts")


def espeak(text: str, out: Path, voice: str = "en") -> Path:
    """Synthesize `text` with espeak-ng into a WAV file (22,050 Hz) and return its path."""
    exe = shutil.which("espeak-ng")
    if exe is None:
        _require([], "espeak-ng")
    subprocess.run([exe, "-v", voice, "-w", str(out), text], check=True, capture_output=True)
    return out


def golden(name: str, cache: Path) -> Path:
    """A golden set folder laid out as the official code wrote it (checkpoint/ + reference arrays):
    $MMTOK_GOLDEN/<name> when that override is set, else tests/golden/<name> expanded once into `cache`."""
    override = os.environ.get("MMTOK_GOLDEN")
    if override:
        folder = Path(override) / name
        if not folder.is_dir():
            pytest.fail(f"golden set {folder} is missing: unset MMTOK_GOLDEN to use the sets in tests/golden")
        return folder
    folder = cache / name
    if not folder.is_dir():
        from goldenkit import COMPACT_ROOT, expand

        partial = cache / f"{name}.partial"  # renamed when complete: an interrupted expansion is redone
        shutil.rmtree(partial, ignore_errors=True)
        expand(COMPACT_ROOT / name, partial).rename(folder)
    return folder
