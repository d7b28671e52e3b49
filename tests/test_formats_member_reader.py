"""MemberReader under concurrency: a descriptor in use is never closed or reused under a reader."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from pathlib import Path

import numpy as np

from mmtok.formats.manifest import MemberReader

FILES = 64
FILE_BYTES = 1 << 16
THREADS = 16
READS_PER_THREAD = 3000
MAX_OPEN = 4


def _content(index: int) -> bytes:
    """Bytes that name both the file and the position: a byte read from the wrong file or offset differs."""
    words = np.arange(FILE_BYTES // 4, dtype=np.uint32) * np.uint32(FILES) + np.uint32(index)
    return words.tobytes()


def _open_descriptors(directory: Path) -> int:
    """Descriptors of this process that point into `directory`."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(directory))
    return count


def test_reads_never_return_another_files_bytes_when_files_outnumber_max_open(tmp_path: Path):
    contents = [_content(i) for i in range(FILES)]
    paths = []
    for i, data in enumerate(contents):
        path = tmp_path / f"shard-{i:03d}.tar"
        path.write_bytes(data)
        paths.append(str(path))
    reader = MemberReader(max_open=MAX_OPEN)
    wrong: list[str] = []
    errors: list[BaseException] = []
    start = threading.Barrier(THREADS)

    def work(seed: int) -> None:
        rng = random.Random(seed)  # fixed seeds: the same reads every run
        start.wait()
        for _ in range(READS_PER_THREAD):
            index = rng.randrange(FILES)
            offset = rng.randrange(FILE_BYTES - 1)
            size = rng.randrange(1, min(4096, FILE_BYTES - offset) + 1)
            try:
                data = reader.read(paths[index], offset, size)
            except OSError as err:  # a descriptor closed under the read; reported below
                errors.append(err)
                continue
            if data != contents[index][offset:offset + size]:
                wrong.append(f"file {index} bytes [{offset}, {offset + size})")

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    open_after_reads = _open_descriptors(tmp_path)
    reader.close()
    assert not wrong and not errors, (f"{len(wrong)} reads returned wrong bytes (first: {wrong[:1]}), "
                                      f"{len(errors)} raised (first: {errors[:1]})")
    assert open_after_reads <= MAX_OPEN  # idle descriptors are bounded once the reads are done
    assert _open_descriptors(tmp_path) == 0

