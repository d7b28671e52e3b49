"""Real full and read-only disks for tests: small tmpfs mounts (root only, as in CI; skipped elsewhere)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


class Mount:
    """A tmpfs of `size` bytes at `path`, resizable and remountable read-only."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True)
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                                capture_output=True, text=True)
        if result.returncode:
            pytest.skip(f"needs root to mount a tmpfs (as in CI): {result.stderr.strip()}")

    def remount(self, options: str) -> None:
        subprocess.run(["mount", "-o", f"remount,{options}", str(self.path)], check=True)

    def umount(self) -> None:
        import gc

        gc.collect()  # a reader's mmap (megatron-core's IndexedDataset) lives until collected
        subprocess.run(["umount", str(self.path)], check=True)


def fill(directory: Path, leave: int) -> Path:
    """A ballast file that leaves `leave` bytes free on the file system of `directory`."""
    stats = os.statvfs(directory)
    ballast = directory / "ballast"
    ballast.write_bytes(b"\0" * (stats.f_bavail * stats.f_frsize - leave))
    return ballast
