"""Durable, atomic file writes (a crash never leaves a half-written file under its final name), the reading
back of the JSON they write, the one-writer lock of an output directory, which input paths name one file, and
the one rule for reading a file an input names: only a regular file is opened (a FIFO would block, a device
never ends or acts on open)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import socket
import stat
import struct
import time
from pathlib import Path
from typing import IO, Iterable, Iterator

from mmtok.errors import DamagedFile, MmtokError, brief

_FLOCK = struct.Struct("hhqqi")  # struct flock on 64-bit Linux: type, whence, start, len, pid


RESTORE = "restore the file or rerun the stage that wrote it"  # the fix a DamagedFile of a stage's file names

def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or file creation inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, mode: str = "wb") -> Iterator[IO]:
    """Open a temporary sibling of `path`; on clean exit fsync it and rename it over `path`.

    On an exception the temporary file is removed and `path` is left untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    handle = open(tmp, mode)
    try:
        yield handle
        handle.flush()
        os.fsync(handle.fileno())
        handle.close()
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except OSError as err:
        _discard(handle, tmp)
        raise with_filename(err, path) from None
    except BaseException:
        _discard(handle, tmp)
        raise


def sync(handle: IO, data_only: bool = False) -> None:
    """Flush the open file `handle` and make its bytes durable (an append or a truncation that a resume
    relies on). `data_only` skips the metadata a read does not need (fdatasync: not the mtime)."""
    handle.flush()
    (os.fdatasync if data_only else os.fsync)(handle.fileno())


def publish_file(tmp: str | os.PathLike, path: str | os.PathLike) -> None:
    """Make the complete, closed file `tmp` durable, then rename it over `path`. The caller fsyncs the
    directory (`fsync_dir`), once for all the files it publishes together."""
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def claim_directory(source: str | os.PathLike, target: str | os.PathLike) -> bool:
    """Rename directory `source` to `target` unless `target` exists (the kernel refuses a directory rename onto
    a non-empty directory, so of writers racing for one name exactly one wins) and make it durable; False when
    `target` was there already or `source` is gone (another process claimed it first). Everything in `source`
    must be durable already."""
    try:
        os.rename(source, target)
    except FileNotFoundError as err:
        if not os.path.exists(source):
            return False
        raise with_filename(err, target) from None
    except OSError as err:
        if err.errno in (errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise with_filename(err, target) from None
    fsync_dir(Path(target).parent)
    if Path(source).parent != Path(target).parent:
        fsync_dir(Path(source).parent)
    return True


def _discard(handle: IO, tmp: Path) -> None:
    try:
        handle.close()  # may fail again (a full disk cannot take the buffered rest)
    except OSError:
        pass
    tmp.unlink(missing_ok=True)


def with_filename(err: OSError, path: str | os.PathLike) -> OSError:
    """`err` naming `path` when it names no file (a failed write() or fsync() says only the errno)."""
    if err.filename is not None or err.errno is None:
        return err
    return type(err)(err.errno, err.strerror, str(path))


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An OSError inside the block names `path` when it names no file (a library writing through its own
    handle -- pyarrow's ParquetWriter on a full disk -- says only the errno)."""
    try:
        yield
    except OSError as err:
        raise with_filename(err, path) from None


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    with atomic_writer(path, "wb") as handle:
        handle.write(data)


def atomic_write_json(path: str | os.PathLike, obj) -> None:
    """Write `obj` as sorted, indented JSON (byte-stable for equal objects)."""
    text = json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    atomic_write_bytes(path, text.encode("utf-8"))


def read_json(path: str | os.PathLike) -> dict | list | None:
    """The JSON document at `path` (what `atomic_write_json` wrote), or None when there is no such file;
    DamagedFile naming the file when it does not parse."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text("utf-8"))
    except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the parser's stack
        raise DamagedFile(f"{path}: not valid JSON ({str(err)[:200]}); restore the file") from None


def read_json_object(path: str | os.PathLike) -> dict | None:
    """`read_json` of a file that must hold one JSON object (a summary, a report, a part's identity):
    anything else is a DamagedFile naming the file."""
    value = read_json(path)
    if value is not None and not isinstance(value, dict):
        raise DamagedFile(f"{path}: must hold an object, not {_json_name(value)}; {RESTORE}")
    return value


def refuse_foreign_output(out: Path, written: tuple[str, ...], marks: tuple[str, ...], command: str,
                          metadata: tuple[str, str, int, str]) -> None:
    """MmtokError, before anything is written, when the directory `out` holds files that `command` did not write:
    its `metadata` file (name, format, version, what) of another format, or a file of a name it writes
    (`written`) with neither that metadata nor any of `marks` (what only `command` leaves there: its cache, its
    lock) beside it. mmtok never replaces a file it did not write; an earlier version of its own format it does
    (the rerun an error about that version asks for), and so a metadata file that no longer parses beside one of
    `marks` other than itself (the rerun its reader asks for). A metadata path that is no regular file is never
    taken for one."""
    name, fmt, version, what = metadata
    if os.path.lexists(out / name):
        try:
            meta = json.loads(read_regular_file(out / name).decode("utf-8"))
        except OSError as err:  # a FIFO, a device, a dangling link: never a file mmtok wrote (nor to be waited on)
            raise MmtokError(f"{out / name} is not a {what} `{command}` wrote ({err.strerror or err}); pass an --out "
                             "of its own") from None
        except (ValueError, RecursionError):
            meta = None
        if not isinstance(meta, dict) and any(mark != name and os.path.lexists(out / mark) for mark in marks):
            return  # its own, damaged (a full disk, a crash mid-write): the rerun replaces it
        found = meta.get("format_version") if isinstance(meta, dict) and meta.get("format") == fmt else None
        if not (isinstance(found, int) and not isinstance(found, bool) and 1 <= found <= version):
            raise MmtokError(f"{out / name} is not a {what} `{command}` wrote; pass an --out of its own")
        return
    found = [name for name in written if os.path.lexists(out / name)]
    if found and not any(os.path.lexists(out / mark) for mark in marks):
        raise MmtokError(f"{out} holds {', '.join(found)}, which `{command}` did not write (no {marks[0]} beside "
                         "it); pass an --out of its own")


def read_stage_metadata(path: Path, fmt: str, version: int, what: str, rerun: str) -> dict:
    """The metadata file `path` a stage writes last (its presence means the output is complete), checked to be
    `fmt` version `version`: MmtokError naming `what` and the command to `rerun` when it is absent, unreadable
    or another format."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise MmtokError(f"{path.parent} holds no complete {what} ({path.name} not found); run `{rerun}`") from None
    except (OSError, ValueError, RecursionError) as err:
        raise MmtokError(f"cannot read {path}: {str(err)[:200]}; rerun `{rerun}`") from None
    if not isinstance(meta, dict) or meta.get("format") != fmt or meta.get("format_version") != version:
        found = meta.get("format") if isinstance(meta, dict) else _json_name(meta)
        raise MmtokError(f"{path} is not an mmtok {what} of version {version} (format {found!r}); rerun `{rerun}`")
    return meta


_MISSING = object()


def required(obj: dict, key: str, kind: type | tuple[type, ...], path: str | os.PathLike, default=_MISSING):
    """`obj[key]`, which must be a `kind` (an int is never a bool); `default` when the key is absent and a
    default is given. Else DamagedFile naming the file and the key: the one check every reader of a JSON
    file that parses but may have the wrong shape (a list, a string for a number, a missing key) goes through."""
    if not isinstance(obj, dict):
        raise DamagedFile(f"{path}: {_json_name(obj)} where an object holding key {key!r} belongs; "
                          f"{RESTORE}")
    if key not in obj:
        if default is not _MISSING:
            return default
        raise DamagedFile(f"{path}: no key {key!r}; {RESTORE}")
    value = obj[key]
    if not _is_kind(value, kind):
        raise DamagedFile(f"{path}: key {key!r} must be {_json_name(kind)}, not {_json_name(value)}; "
                          f"{RESTORE}")
    return value


class _Within(str):
    """A file's path with a place inside it (`plan.json (balance.fixed_batches)`), as messages name a key of a
    nested record; `within` of one adds to its place."""

    def __new__(cls, path: str | os.PathLike, place: str) -> _Within:
        named = super().__new__(cls, f"{path} ({place})")
        named.path, named.place = path, place
        return named

    def __reduce__(self):  # pickled and copied as what it is made from
        return _Within, (self.path, self.place)


def within(path: str | os.PathLike, place: str) -> str:
    """`path` for the checks (`required` ...) of a record nested at `place` ("inputs[3]", "counts.web"), so a
    message names where the key is: `manifest.json (inputs[3].identity): key 'size' must be ...`."""
    if isinstance(path, _Within):
        return _Within(path.path, path.place + ("" if place.startswith("[") else ".") + place)
    return _Within(path, place)


def required_number(obj: dict, key: str, path: str | os.PathLike, default=_MISSING, minimum: float | None = None):
    """`required(obj, key, number)` as a finite float (>= `minimum` when given); `default` when the key is absent
    and a default is given. Else DamagedFile naming the file and the key -- an integer too large for a float too
    (JSON has no bound on them)."""
    if default is not _MISSING and isinstance(obj, dict) and key not in obj:
        return default
    value = required(obj, key, (int, float), path)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number) or (minimum is not None and number < minimum):
        bound = "" if minimum is None else f" >= {minimum:g}"
        raise DamagedFile(f"{path}: key {key!r} must be a finite number{bound}, not {brief(value, 40)}; "
                          f"{RESTORE}")
    return number


def required_count(obj: dict, key: str, path: str | os.PathLike) -> int:
    """`required(obj, key, int)`, which must be >= 0 (a count, an index, a position)."""
    value = required(obj, key, int, path)
    if value < 0:
        raise DamagedFile(f"{path}: key {key!r} must be >= 0, not {value}; {RESTORE}")
    return value


def required_counts(obj: dict, key: str, path: str | os.PathLike) -> dict[str, int]:
    """The object `obj[key]` of {name: count}, every count an integer >= 0."""
    counts = required(obj, key, dict, path)
    for name in counts:
        required_count(counts, name, within(path, key))
    return counts


def required_list(obj: dict, key: str, kind: type | tuple[type, ...], path: str | os.PathLike) -> list:
    """The list `obj[key]`, every element a `kind`."""
    values = required(obj, key, list, path)
    for value in values:
        if not _is_kind(value, kind):
            raise DamagedFile(f"{path}: every entry of key {key!r} must be {_json_name(kind)}, not "
                              f"{_json_name(value)}; {RESTORE}")
    return values


def _is_kind(value, kind: type | tuple[type, ...]) -> bool:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)


JSON_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
              bool: "a boolean", type(None): "null"}


def _json_name(value_or_kind) -> str:
    """The JSON name of a value's type, or of a Python type (or tuple of types), for messages."""
    if isinstance(value_or_kind, tuple):
        return " or ".join(_json_name(kind) for kind in value_or_kind)
    kind = value_or_kind if isinstance(value_or_kind, type) else type(value_or_kind)
    return JSON_NAMES.get(kind, kind.__name__)


class SummaryFile:
    """The JSON summary a run writes last, so that its presence means the run completed: removed when a run
    starts (`remove`), written atomically when it ends (`write`), read back by whoever needs the run's result."""

    def __init__(self, name: str):
        self.name = name

    def path(self, out: str | os.PathLike) -> Path:
        return Path(out) / self.name

    def remove(self, out: str | os.PathLike) -> None:
        """Until it is rewritten, OUT does not claim to hold a completed run."""
        self.path(out).unlink(missing_ok=True)

    def write(self, out: str | os.PathLike, summary: dict) -> None:
        atomic_write_json(self.path(out), summary)

    def read(self, out: str | os.PathLike) -> dict | None:
        """The summary, or None when OUT holds no completed run; DamagedFile naming the file when damaged or
        not a JSON object."""
        return read_json_object(self.path(out))


def refuse_out_overlapping(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None],
                           flag: str = "--out") -> None:
    """MmtokError, before anything is written, when the output `out` would hold an input: `out` is one of
    `inputs` (file or directory) or an input lies inside the directory `out`. Paths are compared resolved
    (symlinks followed), so a link cannot hide an overlap. `out` next to its inputs, or inside an input
    directory, is not an overlap: no command reads its own output as input (`audio convert` leaves an
    output inside a directory input out of the walk)."""
    target = Path(os.path.realpath(out))
    for given in inputs:
        if given is None or not os.path.exists(given):
            continue  # a name (`tekken`, a preset) or a missing input: nothing there to destroy
        source = Path(os.path.realpath(given))
        if source == target:
            raise MmtokError(f"{flag} {out} is the input {given}: writing there would destroy it; pass another "
                             f"{flag}")
        if source.is_relative_to(target):
            raise MmtokError(f"the input {given} is inside {flag} {out}, which this command writes; pass an "
                             f"{flag} that holds no input")


def outside(path: str | os.PathLike, root: str | os.PathLike) -> str | None:
    """The real path of `path` (symlinks and `..` resolved) when it lies outside the real path of the directory
    `root`, else None: the one rule for what a directory given to mmtok may hand it."""
    real = os.path.realpath(path)
    return None if inside(real, os.path.realpath(root)) else real


def inside(real: str, root: str) -> bool:
    """Whether the real path `real` is the real directory `root` or lies under it (both already resolved)."""
    return real == root or real.startswith(root.rstrip("/") + "/")


def own_file(path: Path, what: str) -> Path:
    """`path`, a file of a directory someone handed over whole (a tokenizer, a checkpoint), when its real path
    stays in that directory; MmtokError naming where it leads otherwise: such a directory comes from strangers,
    and a link in it to /etc/passwd must not become a chat template or a copied file. The one link that may
    leave is the Hugging Face hub cache's own: `REPO/snapshots/REV/NAME` -> `REPO/blobs/HASH`."""
    real = outside(path, path.parent)
    if real is None:
        return path
    directory = Path(os.path.realpath(path.parent))
    if directory.parent.name == "snapshots" and Path(real).parent == directory.parent.parent / "blobs":
        return path
    raise MmtokError(f"{what} {path} resolves to {real}, outside its directory {path.parent}; its files must lie "
                     "in its directory (copy them there)")


def copy_file_into(source: str | os.PathLike, handle: IO) -> None:
    """Append the bytes of file `source` to the open binary file `handle`.

    Uses copy_file_range (an in-kernel copy: no trip through user space, a reflink on filesystems
    that share extents), falling back to a buffered copy where the kernel or filesystem cannot.
    """
    import errno
    import shutil

    handle.flush()
    with open(source, "rb") as src:
        size, copied = os.fstat(src.fileno()).st_size, 0
        try:
            while copied < size:
                step = os.copy_file_range(src.fileno(), handle.fileno(), size - copied)
                if step == 0:  # the source shrank while copying
                    break
                copied += step
        except OSError as err:
            if err.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            src.seek(copied)
            handle.seek(0, os.SEEK_END)
            shutil.copyfileobj(src, handle, 1 << 24)
    handle.seek(0, os.SEEK_END)  # the kernel moved the descriptor's offset; resync the buffered writer


_FILE_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_a_regular_file(path: str | os.PathLike) -> str | None:
    """What `path` is when it is no regular file ("a FIFO", "a directory", ...), else None; symlinks are
    followed, and a path that cannot be stat'ed raises OSError (FileNotFoundError when it is not there)."""
    return _kind(os.stat(path).st_mode)


def _kind(mode: int) -> str | None:
    if stat.S_ISREG(mode):
        return None
    return next((name for test, name in _FILE_KINDS if test(mode)), "no regular file")


def read_regular_file(path: str | os.PathLike) -> bytes:
    """The bytes of the regular file at `path` (`open_regular_file`)."""
    with open_regular_file(path) as handle:
        return handle.read()


def open_regular_file(path: str | os.PathLike) -> IO[bytes]:
    """The regular file at `path`, open for binary reading (the caller closes it). Anything else is refused
    with an OSError before it is opened, and again after (opened non-blocking, so a FIFO swapped in
    meanwhile cannot block a read)."""
    kind = not_a_regular_file(path)
    if kind is None:
        handle = open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb")
        kind = _kind(os.fstat(handle.fileno()).st_mode)
        if kind is None:
            return handle
        handle.close()
    raise OSError(errno.EINVAL, f"{kind}, not a regular file: mmtok reads only regular files", str(path))


def shown_path(path: str | os.PathLike) -> str:
    """`path` as text that every UTF-8 writer (JSON, Parquet, a terminal) takes: itself, or with `\\xNN` escapes
    for the bytes of a file name that is not UTF-8 (which Python holds as lone surrogates). A path is valid
    UTF-8 exactly when `shown_path(path) == os.fspath(path)`."""
    text = os.fspath(path)
    try:
        return os.fsencode(text).decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate no file name gives (from JSON text): \udXXX escapes
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


DUPLICATE_INPUT = "duplicate_input"  # the reason of an input that is a file given already, under another path
OUTSIDE_ROOT = "outside_root"  # the skip reason of a file or reference whose real path leaves its roots


def same_file_as(paths: Iterable[str | os.PathLike]) -> list[int | None]:
    """For each path, the index of the first earlier path naming the same file -- the same device and inode
    after symlinks: a symlink, a hard link, a bind mount -- else None. A path that cannot be stat'ed is its
    own (its reader names the error). Every stage reads such an input once (DUPLICATE_INPUT)."""
    first: dict[tuple[int, int], int] = {}
    earlier: list[int | None] = []
    for index, path in enumerate(paths):
        try:
            st = os.stat(path)
        except (OSError, ValueError):  # missing, a NUL byte, a name too long
            earlier.append(None)
            continue
        found = first.setdefault((st.st_dev, st.st_ino), index)
        earlier.append(None if found == index else found)
    return earlier


def random_access(array):
    """`array` (a NumPy memory map) with the kernel's read-ahead off for it (MADV_RANDOM): a lookup faults in
    its own page, not the 128 KiB around it, so the pages a process holds of a big index it looks a few
    thousand keys up in stay bounded by its lookups, not by the index's size. Where the platform or the
    array has no such advice, the array as it is."""
    import mmap

    mapped = getattr(array, "_mmap", None)  # np.memmap (and np.load's mmap_mode) keep their mmap.mmap there
    if mapped is not None and hasattr(mmap, "MADV_RANDOM") and hasattr(mapped, "madvise"):
        mapped.madvise(mmap.MADV_RANDOM)
    return array


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """The sha256 of the regular file at `path` (anything else is an OSError: a FIFO or /dev/zero never ends)."""
    import hashlib

    digest = hashlib.sha256()
    with open_regular_file(path) as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def check_recorded(path: Path, recorded_sha256: str | None, rerun: str) -> None:
    """MmtokError (one line naming `path` and the command to `rerun`) unless the file another stage wrote is
    still the one it recorded: readable, of sha256 `recorded_sha256`."""
    if not isinstance(recorded_sha256, str) or not recorded_sha256:
        raise MmtokError(f"{path}: the stage that wrote it recorded no sha256 of it (its metadata is damaged or from "
                         f"another mmtok); rerun `{rerun}`")
    try:
        actual = sha256_file(path)
    except OSError as err:
        raise MmtokError(f"cannot read {path}: {err.strerror or err}; rerun `{rerun}`") from None
    if actual != recorded_sha256:
        raise MmtokError(f"{path} changed after it was written (sha256 {actual[:12]}... != recorded "
                         f"{recorded_sha256[:12]}...); rerun `{rerun}`")


class LockHeld(MmtokError):
    """Another process holds a `WriterLock` (the message names it and what to do)."""


class WriterLock:
    """One writer at a time for an output directory: an exclusive POSIX record lock on `DIR/.lock` (or on
    another file of DIR guarding one piece of it: a scan shard's claim).

    The lock is an fcntl (POSIX) lock, so the kernel -- or, on a shared file system, its lock manager
    (NFSv4, Lustre mounted with `flock`, GPFS) -- drops it when the holding process dies, SIGKILL
    included: a killed writer never blocks the next run. The file also records who holds it (host,
    pid, start time) so a refused process can name the holder; that text may be stale, the lock
    never is. POSIX locks are per process and are released when the process closes *any* descriptor
    of the file, so the file is opened once per process and a process-wide table refuses a second
    writer inside the same process too.
    """

    NAME = ".lock"
    _held: dict[str, "WriterLock"] = {}

    def __init__(self, directory: str | os.PathLike, what: str, name: str = NAME, wait: bool = False):
        """Take the lock `directory/name` (one lock file may guard one piece of a directory, e.g. a shard's
        scan); `wait` blocks until the holder releases it or dies, else a held lock raises `LockHeld`."""
        self.path = Path(directory) / name
        self.path.parent.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.path)
        if key in WriterLock._held:
            raise MmtokError(f"{what} is already being written by this process; one writer per output")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(self._fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(self._fd)
            if err.errno in (errno.EACCES, errno.EAGAIN):
                raise LockHeld(f"{what} is being written by another process ({self._holder()}); wait for it "
                                 "to finish or stop it, then rerun this command (it resumes). One writer per "
                                 "output: a second one is refused.") from None
            raise MmtokError(f"{self.path}: cannot take the writer lock ({os.strerror(err.errno)}); mmtok needs a "
                             "file system with POSIX (fcntl) locks for its outputs (local disks, NFSv4, "
                             "Lustre mounted with -o flock, GPFS)") from None
        holder = f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S %Z')}"
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, (holder + "\n").encode(), 0)
        self._key = key
        WriterLock._held[key] = self

    @classmethod
    def check_free(cls, directory: str | os.PathLike, what: str) -> None:
        """Refuse now if another process holds the lock (taken and dropped at once): a duplicate job
        stops before it loads a model, not after. The lock that guards the writes is taken later."""
        if os.path.isdir(directory):
            cls(directory, what).release()

    def _holder(self) -> str:
        try:
            text = self.path.read_text("utf-8", errors="replace").strip()
        except OSError:
            text = ""
        return text or "holder unknown"

    @classmethod
    def holder(cls, directory: str | os.PathLike) -> str | None:
        """Who holds the writer lock of `directory` (the holder's own "host, pid, since" line), or None
        when no process does. Takes no lock and writes nothing, so the holder is never disturbed."""
        path = Path(directory) / cls.NAME
        if os.path.realpath(path) in cls._held:
            # This process writes there: closing any descriptor of the file would drop its POSIX lock.
            return f"this process (pid {os.getpid()})"
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            query = _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, 0, 0, 0)
            kind, _, _, _, pid = _FLOCK.unpack(fcntl.fcntl(fd, fcntl.F_GETLK, query))
            if kind == fcntl.F_UNLCK:
                return None
            text = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip()
        finally:
            os.close(fd)
        return text or f"pid {pid}"

    def release(self) -> None:
        """Drop the lock (closing the descriptor releases it); safe to call twice."""
        if WriterLock._held.get(getattr(self, "_key", None)) is self:
            del WriterLock._held[self._key]
            os.close(self._fd)

    def __enter__(self) -> "WriterLock":
        return self

    def __exit__(self, *exc) -> None:
        self.release()
