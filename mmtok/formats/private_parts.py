"""Lock-free writing of parts, for file systems whose locks are node-local or missing: each writer writes its own
copy of a part, `OUT/parts/.private/part-00003.<host>.<pid>/` (the files of `mmtok.formats.partdir`, written
by a `PartWriter` with `NoLock`), and publishes it finished by renaming it to `OUT/parts/part-00003` -- atomic,
and refused by the kernel once that directory exists -- so a part is whole or absent; a copy published second
is compared with the part and removed (`publish_part`). A copy left by a killed writer on this host is adopted
and resumed from its commit log (`adopt_private_part`)."""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

from mmtok.errors import MmtokError
from mmtok.formats.megatron import idx_path
from mmtok.formats.partdir import (
    IDENTITY,
    ITEM_IDS,
    ITEMS,
    PART_NAME,
    PROVENANCE,
    SKIPPED,
    TOKENS,
    TOKENS_BIN,
    is_done,
    parts_root,
)
from mmtok.fsutil import claim_directory, sha256_file

PRIVATE_DIR = ".private"  # OUT/parts/.private/part-00003.<host>.<pid>: a lock-free writer's copy until published
# what two copies of one part must share, byte for byte (stats.json and commits.log hold timings: they differ)
PUBLISHED_FILES = (IDENTITY, TOKENS_BIN, idx_path(TOKENS).name, PROVENANCE, SKIPPED, ITEM_IDS, ITEMS)


def private_part_dir(out: str | os.PathLike, part: int, pid: int | None = None, host: str | None = None) -> Path:
    """`OUT/parts/.private/part-00003.<host>.<pid>`: where a lock-free writer writes part 3 (nobody else does);
    by default this process's on this host."""
    return parts_root(out) / PRIVATE_DIR / f"{PART_NAME}{part:05d}.{host or socket.gethostname()}.{pid or os.getpid()}"


def private_copies(out: str | os.PathLike) -> list[tuple[int, str, int]]:
    """(part, host, pid) of every private copy under OUT/parts/.private, by the names `private_part_dir` gives."""
    root = parts_root(out) / PRIVATE_DIR
    found = []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        head, _, pid = path.name.rpartition(".")
        number, _, host = head.partition(".")
        part = number[len(PART_NAME):]
        if number.startswith(PART_NAME) and part.isdigit() and pid.isdigit() and host:
            found.append((int(part), host, int(pid)))
    return found


def adopt_private_part(out: str | os.PathLike, part: int) -> Path:
    """This process's private directory for `part`. A copy left by a writer on this host that is no longer alive
    (killed) is taken over by renaming it (of several adopters one wins the rename), so the part resumes from
    its commit log; a copy on another host cannot be known dead without a lock and is left alone (the part is
    written again; the first copy published stands)."""
    mine = private_part_dir(out, part)
    prefix = f"{PART_NAME}{part:05d}.{socket.gethostname()}."
    for candidate in sorted((parts_root(out) / PRIVATE_DIR).glob(prefix + "*")):
        pid = candidate.name[len(prefix):]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        if claim_directory(candidate, mine):  # else another process adopted it first
            return mine
    return mine


def process_alive(pid: int) -> bool:
    """Whether process `pid` of this host runs (a private copy's writer, by the pid in its name)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def publish_part(private: str | os.PathLike, final: str | os.PathLike) -> bool:
    """Publish a finished private copy as `final` by one atomic rename; True when this copy became the part.

    When a finished part is already there (another writer published first), both must hold the same bytes
    (`PUBLISHED_FILES`): then this copy is removed and False returned; a difference is refused naming the file,
    keeping this copy for inspection. A part there that is not finished is another kind of writer's (a locked
    run on the same output): refused."""
    private, final = Path(private), Path(final)
    if claim_directory(private, final):
        return True
    if not is_done(final):
        raise MmtokError(f"{final}: a part that is not finished is in the way of this writer's copy ({private}); is "
                         "a run with locks writing the same output? One kind of run per --out")
    different = [name for name in PUBLISHED_FILES if _digest(private / name) != _digest(final / name)]
    if different:
        raise MmtokError(f"{final} was published by another writer but its {different[0]} differs from this "
                         f"writer's copy ({private}, kept for inspection): the two ran with different inputs or "
                         "software; compare them, delete the wrong one and rerun")
    shutil.rmtree(private)
    return False


def _digest(path: Path) -> str | None:
    """A file's sha256, streamed (an item's tokens may be large); None when it is not there (a part without a
    dataset has no tokens.bin/.idx)."""
    try:
        return sha256_file(path)
    except FileNotFoundError:
        return None
