"""MemberReader under concurrency: a descriptor in use is never closed or reused under a reader."""

from __future__ import annotations

import contextlib
import os
import random
import threading
from pathlib import Path

import numpy as np
import pytest

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



def test_each_container_is_read_by_its_own_fields_and_an_unknown_one_is_a_short_read(tmp_path: Path):
    """A manifest row is read through its container's `Fields`; a row of a container the scan never writes (a
    stranger's manifest.parquet) is a ShortRead naming it, a file that is gone one line naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from mmtok.errors import MmtokError
    from mmtok.formats.manifest import ShortRead

    tar = tmp_path / "shard.tar"
    tar.write_bytes(b"0123456789" * 100)
    table = tmp_path / "cells.parquet"
    pq.write_table(pa.table({"jpg": [b"first", b"second"], "txt": ["a cat", "a dog"]}), table)
    reader = MemberReader()
    assert reader.read_member("tar", str(tar), "k.jpg", 10, 5) == b"01234"
    assert reader.read_text("tar", str(tar), 995, 5, None) == b"56789"
    assert reader.read_member("parquet", str(table), "jpg", 1, 0) == b"second"
    assert reader.read_text("parquet", str(table), 1, 3, "txt") == b"a d"
    with pytest.raises(ShortRead, match="names no text column"):
        reader.read_text("parquet", str(table), 1, 3, None)
    with pytest.raises(ShortRead, match="ends inside the member"):
        reader.read_member("tar", str(tar), "k.jpg", 990, 20)
    with pytest.raises(ShortRead, match="container 'zip' in the manifest is none the scan writes"):
        reader.read_member("zip", str(tar), "k.jpg", 0, 5)
    for container in ("tar", "parquet"):
        with pytest.raises(MmtokError, match="input file listed in the manifest is missing"):
            reader.read_member(container, str(tmp_path / "gone"), "jpg", 0, 5)
    reader.close()
