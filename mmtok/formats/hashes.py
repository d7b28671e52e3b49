"""The hash table of a manifest: `H/hashes.parquet` + `H/skipped.jsonl` + `H/hashes.json` (written by `mmtok hash`).

  hashes.parquet   one row per hashed image, in manifest row order: `manifest_row`, `key` (the sample key),
                   `document` (the manifest's document id: one sample, whose images share its caption),
                   `phash` (uint64, the first bit of the hash the most significant), `sha256` (32 bytes, of the
                   image's bytes as stored), `pixels` (width x height as the scan read it; 0 when unknown),
                   and its sample caption's measures (`mmtok.curate.captions.Measures`): `caption_words` (or
                   why it has none: -1 no caption, -2 not UTF-8, -3 unreadable), `caption_loop`,
                   `caption_number_run`, `caption_ending`, `caption_fragment`, `caption_template`
  skipped.jsonl    one skip record (`mmtok.formats.skips`, stage "hash") per image that could not be hashed
  hashes.json      written last (its presence means the other two are complete; `HashMetadata`, every key's type
                   checked when a table is opened): the algorithm id, the source
                   name, the manifest's directory, fingerprint and row count, the counts, `captions` (the caption
                   checks' version, the prompt fragments looked for, rows checked and why others were not), and
                   the sha256 of the other two files (`fingerprint`, `skipped_sha256`)

While it runs, `mmtok hash` commits fixed chunks of manifest rows to `H/.hash-cache/<algorithm>-<manifest
fingerprint>/chunk-NNNNNNNN.arrow` (through `mmtok.formats.scan_shards`: rows, then their checksummed commit),
CHUNK_SCHEMA: the hash columns plus, for a row that was skipped, its reason, detail and where it lives. The
table is assembled from the chunks alone, in chunk order, so its bytes depend only on the manifest.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Iterable

import numpy as np
import pyarrow as pa

from mmtok import __version__
from mmtok.errors import DamagedFile
from mmtok.formats import skips
from mmtok.formats.parquet import read_recorded, write_with_skips
from mmtok.fsutil import (
    atomic_write_json,
    fsync_dir,
    read_stage_metadata,
    refuse_foreign_output,
    required,
    required_counts,
    required_list,
    within,
)

HASHES_FILE = "hashes.parquet"
SKIPPED_FILE = "skipped.jsonl"
METADATA_FILE = "hashes.json"
CACHE_DIR = ".hash-cache"
FORMAT = "mmtok.hashes"
FORMAT_VERSION = 2  # 2: the caption measures
ROW_GROUP_ROWS = 1 << 20  # fixed, so the file bytes depend only on the rows
STAGE = "hash"

CAPTION_MEASURES = ("words", "loop", "number_run", "ending", "fragment", "template")
SCHEMA = pa.schema([("manifest_row", pa.int64()), ("key", pa.string()), ("document", pa.int64()),
                    ("phash", pa.uint64()), ("sha256", pa.binary(32)), ("pixels", pa.int64()),
                    *((f"caption_{name}", pa.uint64() if name == "template" else pa.int32())
                      for name in CAPTION_MEASURES)])
# A chunk's rows: every image row of the chunk; `reason` "" when hashed, else the skip and where it lives.
CHUNK_SCHEMA = pa.schema([*SCHEMA, ("reason", pa.string()), ("detail", pa.string()), ("source", pa.string()),
                          ("container", pa.string()), ("member", pa.string())])


# -- hashes.json ----------------------------------------------------------------------------------------------
# Written by `write_hashes` (`HashMetadata.to_json`), read back by `HashTable.open` (`from_json`, every key's type
# checked: `mmtok dedup` takes hash tables from anyone). Every key has been written since version 2 began.
@dataclass(frozen=True)
class HashedManifest:
    """The manifest a table hashed."""

    directory: str
    fingerprint: str
    rows: int


@dataclass(frozen=True)
class CaptionChecks:
    """The caption checks' version (`mmtok.curate.captions.CHECKS_VERSION`), the bytes of a caption checked, the
    prompt fragments looked for, and how many hashed rows had a caption checked and why the others had none."""

    checks: int
    max_bytes: int
    fragments: list[str]
    counts: dict[str, int]


@dataclass(frozen=True)
class HashCounts:
    """The manifest's rows = hashed + skipped (by reason) + scan error rows."""

    manifest_rows: int
    scan_errors: int
    skipped: dict[str, int]


@dataclass(frozen=True)
class HashMetadata:
    """hashes.json. `mmtok.curate.hashing` makes the record; `write_hashes` adds what the files give and writes it."""

    algorithm: str
    source: str
    captions: CaptionChecks
    manifest: HashedManifest
    counts: HashCounts
    hashed: int = 0  # rows of hashes.parquet
    fingerprint: str = ""  # its sha256
    skipped_sha256: str = ""  # skipped.jsonl's
    tool: str = f"mmtok {__version__}"

    def to_json(self) -> dict:
        return {**asdict(self), "format": FORMAT, "format_version": FORMAT_VERSION}

    @classmethod
    def from_json(cls, document: dict, path: Path) -> HashMetadata:
        captions, manifest = required(document, "captions", dict, path), required(document, "manifest", dict, path)
        counts = required(document, "counts", dict, path)
        at_captions, at_manifest, at_counts = within(path, "captions"), within(path, "manifest"), within(path, "counts")
        fragments = required_list(captions, "fragments", str, at_captions)
        return cls(algorithm=required(document, "algorithm", str, path), source=required(document, "source", str, path),
                   captions=CaptionChecks(required(captions, "checks", int, at_captions),
                                          required(captions, "max_bytes", int, at_captions), fragments,
                                          required_counts(captions, "counts", at_captions)),
                   manifest=HashedManifest(required(manifest, "directory", str, at_manifest),
                                           required(manifest, "fingerprint", str, at_manifest),
                                           required(manifest, "rows", int, at_manifest)),
                   counts=HashCounts(required(counts, "manifest_rows", int, at_counts),
                                     required(counts, "scan_errors", int, at_counts),
                                     required_counts(counts, "skipped", at_counts)),
                   hashed=required(document, "hashed", int, path),
                   fingerprint=required(document, "fingerprint", str, path),
                   skipped_sha256=required(document, "skipped_sha256", str, path),
                   tool=required(document, "tool", str, path))


def cache_dir(directory: str | os.PathLike, algorithm: str, manifest_fingerprint: str) -> Path:
    """Where the chunks of one (algorithm, manifest) are committed: another manifest never reuses them."""
    return Path(directory) / CACHE_DIR / f"{algorithm}-{manifest_fingerprint[:16]}"


def chunk_path(cache: Path, chunk: int) -> Path:
    return cache / f"chunk-{chunk:08d}.arrow"


def check_output(directory: Path) -> None:
    """Refuse an output directory whose files of our names `mmtok hash` did not write (before any work)."""
    refuse_foreign_output(directory, (HASHES_FILE, SKIPPED_FILE, METADATA_FILE), (CACHE_DIR,), "mmtok hash",
                          (METADATA_FILE, FORMAT, FORMAT_VERSION, "hash table"))


def write_hashes(directory: str | os.PathLike, chunks: Iterable[pa.Table], metadata: HashMetadata) -> HashMetadata:
    """Write hashes.parquet and skipped.jsonl from the chunk tables (in order), then hashes.json; return the
    metadata written. The old hashes.json is removed first, so a killed write leaves no complete-looking table."""
    import pyarrow.compute as pc

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METADATA_FILE).unlink(missing_ok=True)

    def pieces():
        for table in chunks:
            ok = pc.equal(table.column("reason"), "")
            yield (table.filter(ok).select(SCHEMA.names).cast(SCHEMA),
                   list(_skip_records(table.filter(pc.invert(ok)))))

    rows, _, fingerprint, skipped_sha256 = write_with_skips(directory / HASHES_FILE, directory / SKIPPED_FILE, SCHEMA,
                                                            ROW_GROUP_ROWS, pieces())
    meta = replace(metadata, hashed=rows, fingerprint=fingerprint, skipped_sha256=skipped_sha256)
    atomic_write_json(directory / METADATA_FILE, meta.to_json())
    fsync_dir(directory)
    return meta


def _skip_records(table: pa.Table) -> Iterable[skips.SkipRecord]:
    for row in table.to_pylist():
        yield skips.SkipRecord(key=row["key"], source=row["source"], container=row["container"],
                               member=row["member"], position=row["manifest_row"], reason=row["reason"],
                               detail=row["detail"], stage=STAGE)


@dataclass(frozen=True)
class Hashes:
    """The columns of a hash table, aligned: manifest_row int64, key (an Arrow string array: 10^8 keys as Python
    strings would cost gigabytes; take the few that are needed), document int64, phash uint64, sha256 (n, 32)
    uint8, pixels int64, captions: `caption_<measure>` -> its column (int32; caption_template uint64)."""

    manifest_row: np.ndarray
    key: pa.Array
    document: np.ndarray
    phash: np.ndarray
    sha256: np.ndarray
    pixels: np.ndarray
    captions: dict

    def __len__(self) -> int:
        return len(self.manifest_row)


class HashTable:
    """A complete hash directory, opened once and validated: `HashTable.open` is the only way in."""

    def __init__(self, directory: Path, metadata: HashMetadata):
        self.directory = directory
        self.metadata = metadata

    @classmethod
    def open(cls, directory: str | os.PathLike) -> HashTable:
        """The hash table in `directory`; MmtokError naming the fix when it is absent, incomplete or foreign."""
        directory = Path(directory)
        path = directory / METADATA_FILE
        meta = read_stage_metadata(path, FORMAT, FORMAT_VERSION, "hash table", f"mmtok hash MANIFEST --out {directory}")
        return cls(directory, HashMetadata.from_json(meta, path))

    @property
    def algorithm(self) -> str:
        return self.metadata.algorithm

    @property
    def source(self) -> str:
        return self.metadata.source

    @property
    def manifest_fingerprint(self) -> str:
        return self.metadata.manifest.fingerprint

    def read(self) -> Hashes:
        """Every row, after checking the file's sha256 against the one recorded (a changed table is refused) and
        that every row names a sample (a key) and a manifest row."""
        import pyarrow.compute as pc

        table = read_recorded(self.directory / HASHES_FILE, self.metadata.fingerprint, SCHEMA, "a hash table",
                              f"mmtok hash MANIFEST --out {self.directory}")
        empty = next((name for name in table.column_names if table.column(name).null_count), None)
        if empty or (table.num_rows and pc.min(table.column("manifest_row")).as_py() < 0):
            what = f"a null in column {empty}" if empty else "a negative manifest row"
            raise DamagedFile(f"{self.directory / HASHES_FILE}: {what}; rerun `mmtok hash MANIFEST --out "
                              f"{self.directory}`")
        fragment = table.column("caption_fragment")
        if table.num_rows and pc.max(fragment).as_py() >= len(self.fragments):
            raise DamagedFile(f"{self.directory / HASHES_FILE}: a caption_fragment beyond the "
                              f"{len(self.fragments)} fragments hashes.json names; rerun `mmtok hash MANIFEST --out "
                              f"{self.directory}`")
        digests = table.column("sha256").combine_chunks()
        sha = np.frombuffer(digests.buffers()[1], np.uint8)[digests.offset * 32:(digests.offset + len(digests)) * 32]
        return Hashes(manifest_row=table.column("manifest_row").to_numpy(),
                      key=table.column("key").combine_chunks(), document=table.column("document").to_numpy(),
                      phash=table.column("phash").to_numpy(), sha256=sha.reshape(-1, 32),
                      pixels=table.column("pixels").to_numpy(),
                      captions={f"caption_{name}": table.column(f"caption_{name}").to_numpy()
                                for name in CAPTION_MEASURES})

    @property
    def fragments(self) -> list[str]:
        """The prompt fragments `mmtok hash --prompt-fragments` looked for (`caption_fragment` indexes them)."""
        return self.metadata.captions.fragments
