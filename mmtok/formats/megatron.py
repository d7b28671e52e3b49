"""Megatron-LM indexed dataset (`.bin` + `.idx`), the format megatron-core's IndexedDataset reads.

`.idx` layout (little endian):
  magic b"MMIDIDX\\x00\\x00" | u64 version = 1 | u8 dtype code | u64 sequence count N |
  u64 document-index length D (= documents + 1) | int32 lengths[N] | int64 byte pointers[N] |
  int64 document indices[D]
`.bin`: the tokens of every sequence back to back. mmtok writes one sequence per document, so
the document indices are 0..N.

This is the only module that knows these byte layouts.
"""

from __future__ import annotations

import logging
import os
import struct
import warnings
from pathlib import Path
from typing import Iterable

import numpy as np

from mmtok.errors import DamagedFile, MmtokError
from mmtok.fsutil import atomic_writer, copy_file_into, fsync_dir, publish_file, with_filename

INDEX_MAGIC = b"MMIDIDX\x00\x00"
INDEX_VERSION = 1
DTYPE_CODES = {np.dtype(np.uint8): 1, np.dtype(np.int8): 2, np.dtype(np.int16): 3, np.dtype(np.int32): 4,
               np.dtype(np.int64): 5, np.dtype(np.float64): 6, np.dtype(np.float32): 7, np.dtype(np.uint16): 8}
CODE_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
TOKEN_DTYPE = np.dtype(np.int32)  # omnimodal ids go up to 266,439: uint16 cannot hold them


def bin_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.bin")


def idx_path(prefix: str | os.PathLike) -> Path:
    return Path(f"{prefix}.idx")


def remove_dataset(prefix: str | os.PathLike) -> None:
    """Remove the dataset at `prefix` if there is one (.idx first: a lone .bin is not a dataset), so a
    dataset an earlier run left behind cannot be taken for this run's."""
    for path in (idx_path(prefix), bin_path(prefix)):
        path.unlink(missing_ok=True)


def check_tokens_fit(tokens: np.ndarray, dtype: np.dtype = TOKEN_DTYPE) -> np.ndarray:
    """Return `tokens` as `dtype`, refusing any id the dtype cannot represent."""
    tokens = np.asarray(tokens)
    if tokens.size:
        info = np.iinfo(dtype)
        low, high = int(tokens.min()), int(tokens.max())
        if low < max(info.min, 0) or high > info.max:
            raise ValueError(f"token ids [{low}, {high}] do not fit the dataset dtype {np.dtype(dtype).name}")
    return tokens.astype(dtype, copy=False)


def encode_index(lengths: np.ndarray, dtype: np.dtype = TOKEN_DTYPE) -> bytes:
    """The bytes of an `.idx` file for sequences of `lengths` tokens, one document each."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and lengths.min() < 0:
        raise ValueError("sequence lengths must be non-negative")
    if lengths.size and lengths.max() > np.iinfo(np.int32).max:
        raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed")
    count = len(lengths)
    pointers = np.zeros(count, dtype=np.int64)
    if count > 1:
        np.cumsum(lengths[:-1] * np.dtype(dtype).itemsize, out=pointers[1:])
    documents = np.arange(count + 1, dtype=np.int64)
    header = INDEX_MAGIC + struct.pack("<QBQQ", INDEX_VERSION, DTYPE_CODES[np.dtype(dtype)], count, count + 1)
    return b"".join([header, lengths.astype(np.int32).tobytes(), pointers.tobytes(), documents.tobytes()])


def write_index(prefix: str | os.PathLike, lengths: np.ndarray, dtype: np.dtype = TOKEN_DTYPE) -> None:
    """Atomically write `prefix.idx` for sequences of `lengths` tokens.

    Refuses a dataset without tokens: megatron-core cannot open it (it cannot mmap an empty .bin),
    so writers leave such a dataset out and say so in their metadata (every dataset written opens
    in megatron-core).
    """
    if not int(np.asarray(lengths, np.int64).sum()):
        raise ValueError(f"{idx_path(prefix)}: refusing to write a dataset without tokens (megatron-core cannot "
                         "open it); the caller must leave it out")
    with atomic_writer(idx_path(prefix)) as handle:
        handle.write(encode_index(lengths, dtype))


class DamagedDataset(DamagedFile):
    """A `.idx`/`.bin` pair that does not hold what its header says: one line naming the file."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: {problem}; the dataset is damaged or not one mmtok wrote -- rerun the stage that "
                         "wrote it (`mmtok merge`, `mmtok audio interleave`)")


def read_index(prefix: str | os.PathLike) -> tuple[np.dtype, np.ndarray, np.ndarray, np.ndarray]:
    """(dtype, lengths, pointers, document indices) of `prefix.idx`, validated against `prefix.bin`: every
    count, length, pointer and document index is checked before it is used, so no reader (mmtok's or
    megatron-core's) ever sees a header that points past its files. DamagedDataset names the file otherwise."""
    path = idx_path(prefix)
    data = path.read_bytes()
    head = len(INDEX_MAGIC) + struct.calcsize("<QBQQ")
    if len(data) < head or data[: len(INDEX_MAGIC)] != INDEX_MAGIC:
        raise DamagedDataset(path, "not a Megatron indexed-dataset index (bad magic)")
    version, code, count, doc_count = struct.unpack_from("<QBQQ", data, len(INDEX_MAGIC))
    if version != INDEX_VERSION or code not in CODE_DTYPES:
        raise DamagedDataset(path, f"unsupported version {version} or dtype code {code}")
    expected = head + count * 4 + count * 8 + doc_count * 8
    if len(data) < expected:
        raise DamagedDataset(path, f"truncated index ({len(data)} bytes, its header needs {expected})")
    lengths = np.frombuffer(data, np.int32, count, head)
    pointers = np.frombuffer(data, np.int64, count, head + count * 4)
    documents = np.frombuffer(data, np.int64, doc_count, head + count * 12)
    dtype = CODE_DTYPES[code]
    _check_layout(path, bin_path(prefix), dtype, lengths, pointers, documents)
    return dtype, lengths, pointers, documents


def _check_layout(path: Path, bin_file: Path, dtype: np.dtype, lengths: np.ndarray, pointers: np.ndarray,
                  documents: np.ndarray) -> None:
    """Lengths, pointers and document indices that stay inside the `.bin` and the sequence count."""
    try:
        bin_size = bin_file.stat().st_size
    except FileNotFoundError:
        raise DamagedDataset(path, f"no {bin_file.name} beside it") from None
    sizes = lengths.astype(np.int64) * dtype.itemsize
    if lengths.size and int(lengths.min()) < 0:
        raise DamagedDataset(path, f"a negative sequence length ({int(lengths.min())})")
    if int(sizes.sum()) != bin_size:
        raise DamagedDataset(path, f"lengths cover {int(lengths.astype(np.int64).sum())} tokens but {bin_file} holds "
                                   f"{bin_size // dtype.itemsize}")
    if lengths.size and (int(pointers.min()) < 0 or (pointers % dtype.itemsize).any()
                         or int((pointers + sizes).max()) > bin_size):
        raise DamagedDataset(path, f"a sequence pointer outside {bin_file} ({bin_size} bytes)")
    if (documents.size < 1 or int(documents[0]) != 0 or int(documents[-1]) != lengths.size
            or (np.diff(documents) < 0).any()):
        raise DamagedDataset(path, f"document indices that are not 0 … {lengths.size} in order")


def read_sequences(prefix: str | os.PathLike) -> Iterable[np.ndarray]:
    """Yield each sequence of a dataset as an array (for inspect, tests and small tools)."""
    dtype, lengths, pointers, _ = read_index(prefix)
    tokens = np.memmap(bin_path(prefix), dtype=dtype, mode="r") if lengths.sum() else np.zeros(0, dtype)
    for pointer, length in zip(pointers, lengths, strict=True):
        start = int(pointer) // dtype.itemsize
        yield np.array(tokens[start : start + int(length)])


class DatasetWriter:
    """Write a dataset in one go (not resumable): `add(tokens)` per document, then `close()`.

    The `.bin` is written under a temporary name and renamed with the `.idx` on close, so a crash
    never leaves a pair that looks complete.
    """

    def __init__(self, prefix: str | os.PathLike, dtype: np.dtype = TOKEN_DTYPE):
        self.prefix = Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._tmp_bin = self.prefix.with_name(f".{self.prefix.name}.bin.tmp-{os.getpid()}")
        self._handle = open(self._tmp_bin, "wb")
        self.lengths: list[int] = []

    def add(self, tokens: np.ndarray) -> None:
        tokens = check_tokens_fit(tokens, self.dtype)
        try:
            self._handle.write(tokens.tobytes())
        except OSError as err:
            raise with_filename(err, self._tmp_bin) from None
        self.lengths.append(int(tokens.size))

    def close(self) -> bool:
        """Publish the dataset; returns False (writing nothing) when it has no tokens, which
        megatron-core could not open."""
        if not sum(self.lengths):
            self.abort()
            return False
        try:
            self._handle.close()
            publish_file(self._tmp_bin, bin_path(self.prefix))
        except OSError as err:
            self.abort()
            raise with_filename(err, self._tmp_bin) from None
        write_index(self.prefix, np.asarray(self.lengths, np.int64), self.dtype)
        fsync_dir(self.prefix.parent)
        return True

    def abort(self) -> None:
        try:
            self._handle.close()
        except OSError:  # a full disk cannot take the buffered rest; the file goes anyway
            pass
        self._tmp_bin.unlink(missing_ok=True)

    def __enter__(self) -> "DatasetWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def concatenate(prefixes: list[str | os.PathLike], out_prefix: str | os.PathLike) -> int:
    """Join datasets in the given order into `out_prefix` (bytes copied, pointers rebuilt).

    Returns the number of sequences written. Both output files appear atomically.
    """
    out_prefix = Path(out_prefix)
    lengths, dtypes = [], set()
    for prefix in prefixes:
        dtype, part_lengths, _, _ = read_index(prefix)
        dtypes.add(dtype)
        lengths.append(np.asarray(part_lengths))
    if len(dtypes) > 1:
        raise ValueError(f"cannot merge datasets of different dtypes: {sorted(d.name for d in dtypes)}")
    dtype = dtypes.pop() if dtypes else TOKEN_DTYPE
    with atomic_writer(bin_path(out_prefix)) as out:
        for prefix in prefixes:
            copy_file_into(bin_path(prefix), out)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    write_index(out_prefix, all_lengths, dtype)
    return len(all_lengths)


# -- reading back with megatron-core ----------------------------------------------------------------
MEGATRON_READER = "megatron-core IndexedDataset"
MMTOK_READER = "mmtok reader"


def verify_merged(prefix: Path, part_prefixes: list[Path]) -> str:
    """Read the dataset joined from `part_prefixes` back with megatron-core and compare it with them.

    Checks the sequence count, every length, the document index, and the first and last sequence
    of every part token for token. Returns the name of the reader used: MEGATRON_READER, or MMTOK_READER
    when megatron-core is not installed.
    """
    lengths = [read_index(p)[1] for p in part_prefixes]
    expected = np.concatenate(lengths) if lengths else np.zeros(0, np.int32)
    read_index(prefix)  # mmtok's checks first: megatron-core never opens an index that points past its files
    try:
        IndexedDataset = import_indexed_dataset()
    except ImportError:  # the caller says so: the name returned is MMTOK_READER
        return _verify_with_mmtok(prefix, expected)
    dataset = IndexedDataset(str(prefix))  # keep alive while its arrays are in use: they view its mmap
    problems = []
    if len(dataset) != expected.size or not np.array_equal(dataset.sequence_lengths, expected):
        problems.append("sequence lengths differ from the parts'")
    if not np.array_equal(dataset.document_indices, np.arange(expected.size + 1)):
        problems.append("document index is not one document per sequence")
    start = 0
    for part_prefix, part_lengths in zip(part_prefixes, lengths, strict=True):
        for local in {0, part_lengths.size - 1} if part_lengths.size else ():
            source = _read_sequence(part_prefix, local)
            if not np.array_equal(dataset[start + local], source):
                problems.append(f"sequence {start + local} differs from {part_prefix} sequence {local}")
        start += part_lengths.size
    release_reader(dataset)
    del dataset
    if problems:
        raise MmtokError(f"{prefix}: merged dataset failed verification: {'; '.join(problems)}")
    return MEGATRON_READER


def import_indexed_dataset():
    """megatron-core's reader, imported without its warnings about absent training extras (Apex,
    Transformer Engine, CUDA), which say nothing about reading a dataset."""
    torch_log = logging.getLogger("torch.utils.cpp_extension")
    level = torch_log.level
    torch_log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from megatron.core.datasets.indexed_dataset import IndexedDataset
    finally:
        torch_log.setLevel(level)
    return IndexedDataset


def release_reader(dataset) -> None:
    """Let go of a megatron-core IndexedDataset's files. Its index reader's `__getitem__` is an
    `lru_cache` on the class, which keeps the last readers -- and their open mmaps -- alive after
    the dataset is dropped; clearing it closes them (a merge must not hold its outputs open)."""
    getitem = getattr(type(getattr(dataset, "index", None)), "__getitem__", None)
    if hasattr(getitem, "cache_clear"):
        getitem.cache_clear()


def _verify_with_mmtok(prefix: Path, expected: np.ndarray) -> str:
    _, lengths, _, documents = read_index(prefix)
    if not np.array_equal(lengths, expected) or not np.array_equal(documents, np.arange(expected.size + 1)):
        raise MmtokError(f"{prefix}: merged index does not match the parts")
    return MMTOK_READER


def _read_sequence(prefix: Path, index: int) -> np.ndarray:
    dtype, lengths, pointers, _ = read_index(prefix)
    with open(bin_path(prefix), "rb") as handle:
        handle.seek(int(pointers[index]))
        return np.frombuffer(handle.read(int(lengths[index]) * dtype.itemsize), dtype)
