"""The duplicate list: `D/dropped.parquet` + `D/dedup.json` (written by `mmtok dedup`, read by `mmtok plan --exclude`).

  dropped.parquet  one row per dropped image, sorted by (source, manifest_row): `source`, `manifest_row`, `key`,
                   `group` (the duplicate group, numbered in keeper order; -1 for a benchmark match),
                   `keeper_source`, `keeper_row`, `keeper_key` (the kept copy; for rule `benchmark`, the benchmark
                   image it matched: the benchmark's name, its row and key), `rule` (RULES: why it is dropped) and
                   `distance` (the Hamming distance of the two pHashes; 0 for equal bytes); for a caption rule,
                   no keeper (nulls, row -1, group -1, distance -1) and `detail` (what the check found; "" for
                   the other rules)
  held.parquet     with `--against` only: the benchmark matches held back as suspect (kept, not dropped), sorted
                   by (source, manifest_row): `source`, `manifest_row`, `key`, `bench_source`, `bench_row`,
                   `bench_key`, `distance`, `why` (`mmtok.curate.decontaminate`: ITEM_SUSPECT, SOURCE_SUSPECT)
  dedup.json       written last (`DedupMetadata`, its shape checked when read back): the algorithm id, the
                   policy as applied, every input (source, hash table, its manifest's directory and
                   fingerprint), the caption checks, the decontamination (with `--against`), per-source
                   counts and the sha256 of dropped.parquet (`fingerprint`) and held.parquet
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa

from mmtok import __version__
from mmtok.errors import MmtokError
from mmtok.formats.parquet import read_recorded
from mmtok.fsutil import (
    atomic_write_json,
    atomic_writer,
    fsync_dir,
    read_stage_metadata,
    refuse_foreign_output,
    required,
    required_counts,
    required_list,
    required_number,
    sha256_file,
    within,
)

DROPPED_FILE = "dropped.parquet"
METADATA_FILE = "dedup.json"
LOCK_FILE = ".dedup.lock"  # the writer's lock (`WriterLock`), taken before the first write: it marks the folder as ours
FORMAT = "mmtok.dedup"
FORMAT_VERSION = 2  # 2: caption rules and `detail`
# sha256: the same bytes; phash_exact: equal pHashes; phash_radius: pHashes within the source's radius (or
# joined to the keeper through such pairs: groups are connected, so the distance may exceed the radius)
# benchmark: the image matches a benchmark image (`--against`: equal bytes, or pHashes within the source's radius)
# caption_*: the image's sample caption fails a caption check (`mmtok.curate.captions`; `detail` says how)
CAPTION_RULES = ("caption_fragment", "caption_loop", "caption_ending", "caption_numbers", "caption_template")
RULES = ("sha256", "phash_exact", "phash_radius", "benchmark", *CAPTION_RULES)
BENCHMARK_RULE = "benchmark"
HELD_FILE = "held.parquet"

SCHEMA = pa.schema([("source", pa.string()), ("manifest_row", pa.int64()), ("key", pa.string()),
                    ("group", pa.int64()), ("keeper_source", pa.string()), ("keeper_row", pa.int64()),
                    ("keeper_key", pa.string()), ("rule", pa.string()), ("distance", pa.int8()),
                    ("detail", pa.string())])
HELD_SCHEMA = pa.schema([("source", pa.string()), ("manifest_row", pa.int64()), ("key", pa.string()),
                         ("bench_source", pa.string()), ("bench_row", pa.int64()), ("bench_key", pa.string()),
                         ("distance", pa.int8()), ("why", pa.string())])


def check_output(directory: Path) -> None:
    """Refuse an output directory whose files of our names `mmtok dedup` did not write (before any work). The
    writer's lock file (`WriterLock`, taken before the first write) marks a directory as `mmtok dedup`'s."""
    refuse_foreign_output(directory, (DROPPED_FILE, METADATA_FILE, HELD_FILE), (LOCK_FILE,), "mmtok dedup",
                          (METADATA_FILE, FORMAT, FORMAT_VERSION, "duplicate list"))


def write_dedup(directory: str | os.PathLike, dropped: pa.Table, metadata: DedupMetadata,
                held: pa.Table | None = None) -> DedupMetadata:
    """Write dropped.parquet (rows as SCHEMA, already sorted; other columns are left out) and, when given,
    held.parquet (HELD_SCHEMA), then dedup.json; return the metadata written."""
    import pyarrow.parquet as pq

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / METADATA_FILE).unlink(missing_ok=True)
    with atomic_writer(directory / DROPPED_FILE) as handle:
        pq.write_table(dropped.select(SCHEMA.names).cast(SCHEMA), handle, compression="zstd", row_group_size=1 << 20)
        handle.flush()
        fingerprint = sha256_file(handle.name)
    held_sha256 = None
    if held is not None:
        with atomic_writer(directory / HELD_FILE) as handle:
            pq.write_table(held.select(HELD_SCHEMA.names).cast(HELD_SCHEMA), handle, compression="zstd")
            handle.flush()
            held_sha256 = sha256_file(handle.name)
    else:
        (directory / HELD_FILE).unlink(missing_ok=True)  # an earlier run's held list (with --against) is stale
    meta = replace(metadata, dropped=dropped.num_rows, fingerprint=fingerprint, held_sha256=held_sha256)
    atomic_write_json(directory / METADATA_FILE, meta.to_json())
    fsync_dir(directory)
    return meta


@dataclass(frozen=True)
class Exclusion:
    """The rows of one manifest that a duplicate list drops: sorted manifest rows and, aligned, their keepers."""

    source: str
    rows: np.ndarray  # int64, sorted
    keepers: np.ndarray  # object: "SOURCE:KEY (row N)" of each row's keeper
    keeper_source: np.ndarray  # object: the keeper's source
    keeper_row: np.ndarray  # int64: the keeper's manifest row (in its source's manifest)
    contaminated: np.ndarray  # bool: the row matches a benchmark image (its "keeper" is that image)
    caption: np.ndarray  # bool: the row's caption is flagged (its "keeper" text says how; it has no keeper)

    def kinds(self) -> np.ndarray:
        """Per row: 0 a duplicate, 1 a benchmark match, 2 caption-flagged (`mmtok.plan.rows.EXCLUDED`)."""
        return np.where(self.caption, 2, np.where(self.contaminated, 1, 0)).astype(np.int8)

    def keepers_of(self, rows: np.ndarray) -> np.ndarray:
        """The keeper of each of `rows` (every one of them excluded)."""
        return self.keepers[np.searchsorted(self.rows, rows)]

    def own_keeper_rows(self) -> np.ndarray:
        """The sorted rows of this manifest that keep a copy for an excluded row."""
        return np.unique(self.keeper_row[(self.keeper_source == self.source) & ~self.contaminated])

    def without_kept_copy(self, dropped_keepers: np.ndarray) -> int:
        """How many excluded rows have their keeper among `dropped_keepers` (rows of this manifest)."""
        own = (self.keeper_source == self.source) & ~self.contaminated
        return int(np.isin(self.keeper_row[own], dropped_keepers).sum())


# -- dedup.json ----------------------------------------------------------------------------------------------
# Written by `write_dedup` (`DedupMetadata.to_json`), read back by `DedupList.open` (`DedupMetadata.from_json`:
# the list is a store another stage wrote, possibly by a stranger: every key's type is checked before use).
NUMBER = (int, float)


@dataclass(frozen=True)
class PolicyRecord:
    """A source's rule as applied (`mmtok.curate.dedup.SourceRule`): radius 0 for the exact rules."""

    rule: str
    radius: int
    priority: int

    @classmethod
    def from_json(cls, value, path: Path) -> PolicyRecord:
        return cls(required(value, "rule", str, path), required(value, "radius", int, path),
                   required(value, "priority", int, path))


@dataclass(frozen=True)
class ListInput:
    """A hash table the list was made from, and the manifest it hashed."""

    source: str
    hashes: str  # the hash table's directory
    hashes_fingerprint: str
    manifest_directory: str | None
    manifest_fingerprint: str

    @classmethod
    def from_json(cls, value, path: Path) -> ListInput:
        return cls(required(value, "source", str, path), required(value, "hashes", str, path),
                   required(value, "hashes_fingerprint", str, path),
                   required(value, "manifest_directory", (str, type(None)), path, None),
                   required(value, "manifest_fingerprint", str, path))


@dataclass(frozen=True)
class CaptionRecord:
    """The caption checks: their thresholds (`mmtok.curate.captions.Thresholds`), the sources not checked and
    how many images they flagged."""

    thresholds: dict
    unchecked_sources: list[str]
    flagged: int

    @classmethod
    def from_json(cls, value, path: Path) -> CaptionRecord:
        return cls(required(value, "thresholds", dict, path),
                   required_list(value, "unchecked_sources", str, path),
                   required(value, "flagged", int, path))


@dataclass(frozen=True)
class Benchmark:
    """A benchmark hash table of `--against`."""

    benchmark: str  # its source name
    hashes: str
    hashes_fingerprint: str
    images: int

    @classmethod
    def from_json(cls, value, path: Path) -> Benchmark:
        return cls(required(value, "benchmark", str, path), required(value, "hashes", str, path),
                   required(value, "hashes_fingerprint", str, path), required(value, "images", int, path))


@dataclass(frozen=True)
class GuardRecord:
    """The guards against false benchmark matches (`mmtok.curate.decontaminate.Guards`)."""

    max_matches: int
    max_share: float
    min_flagged: int

    @classmethod
    def from_json(cls, value, path: Path) -> GuardRecord:
        required_number(value, "max_share", path, minimum=0)  # finite (the value is kept as written: 1 stays 1)
        return cls(required(value, "max_matches", int, path), required(value, "max_share", NUMBER, path),
                   required(value, "min_flagged", int, path))


@dataclass(frozen=True)
class SuspectImage:
    """A benchmark image matching more training images than the guards allow: its matches are held back."""

    benchmark: str  # BENCHMARK:KEY
    row: int
    matches: int

    @classmethod
    def from_json(cls, value, path: Path) -> SuspectImage:
        return cls(required(value, "benchmark", str, path), required(value, "row", int, path),
                   required(value, "matches", int, path))


@dataclass(frozen=True)
class SuspectSource:
    """A training source with more benchmark matches than the guards allow: its matches are held back."""

    source: str
    flagged: int
    hashed: int

    @classmethod
    def from_json(cls, value, path: Path) -> SuspectSource:
        return cls(required(value, "source", str, path), required(value, "flagged", int, path),
                   required(value, "hashed", int, path))


@dataclass(frozen=True)
class DecontaminationRecord:
    """What `--against` did: the benchmarks, the guards, each source's match radius ("off": not checked), the
    suspects held back, the `--confirm` names, and the matches dropped and held."""

    against: list[Benchmark]
    guards: GuardRecord
    radius: dict[str, int | str]
    suspect_images: list[SuspectImage]
    suspect_sources: list[SuspectSource]
    confirmed: list[str]
    contaminated: int
    held: int

    @classmethod
    def from_json(cls, value, path: Path) -> DecontaminationRecord:
        radius = required(value, "radius", dict, path)
        return cls(against=[Benchmark.from_json(v, within(path, f"against[{i}]"))
                            for i, v in enumerate(required(value, "against", list, path))],
                   guards=GuardRecord.from_json(required(value, "guards", dict, path), within(path, "guards")),
                   radius={name: required(radius, name, (int, str), within(path, "radius")) for name in radius},
                   suspect_images=[SuspectImage.from_json(v, within(path, f"suspect_images[{i}]"))
                                   for i, v in enumerate(required(value, "suspect_images", list, path))],
                   suspect_sources=[SuspectSource.from_json(v, within(path, f"suspect_sources[{i}]"))
                                    for i, v in enumerate(required(value, "suspect_sources", list, path))],
                   confirmed=required_list(value, "confirmed", str, path),
                   contaminated=required(value, "contaminated", int, path), held=required(value, "held", int, path))


@dataclass(frozen=True)
class SourceCounts:
    """One source's images: hashed = kept + dropped; the dropped by rule (RULES); the matches held back (kept)."""

    hashed: int
    kept: int
    dropped: int
    by_rule: dict[str, int]
    held: int = 0

    @classmethod
    def from_json(cls, value, path: Path) -> SourceCounts:
        return cls(required(value, "hashed", int, path), required(value, "kept", int, path),
                   required(value, "dropped", int, path), required_counts(value, "by_rule", path),
                   required(value, "held", int, path, 0))


@dataclass(frozen=True)
class DedupMetadata:
    """dedup.json. `dedup` makes the record; `write_dedup` adds what the written files give (the rows, their
    sha256) and writes `to_json()`."""

    algorithm: str
    policy: dict[str, PolicyRecord]  # by source name
    inputs: list[ListInput]
    groups: int  # duplicate groups that drop an image, numbered 0.. in keeper order
    captions: CaptionRecord
    decontamination: DecontaminationRecord | None  # None: made without --against (no key in the file)
    counts: dict[str, SourceCounts]  # by source name
    dropped: int = 0  # rows of dropped.parquet
    fingerprint: str = ""  # sha256 of dropped.parquet
    held_sha256: str | None = None  # of held.parquet (with --against; no key in the file otherwise)
    tool: str = f"mmtok {__version__}"

    def to_json(self) -> dict:
        document = {**asdict(self), "format": FORMAT, "format_version": FORMAT_VERSION}
        for key in ("decontamination", "held_sha256"):
            if document[key] is None:
                del document[key]
        return document

    @classmethod
    def from_json(cls, document: dict, path: Path) -> DedupMetadata:
        policy, counts = required(document, "policy", dict, path), required(document, "counts", dict, path)
        decontamination = required(document, "decontamination", dict, path, None)
        return cls(algorithm=required(document, "algorithm", str, path),
                   policy={name: PolicyRecord.from_json(policy[name], within(path, f"policy.{name}"))
                           for name in policy},
                   inputs=[ListInput.from_json(v, within(path, f"inputs[{i}]"))
                           for i, v in enumerate(required(document, "inputs", list, path))],
                   groups=required(document, "groups", int, path),
                   captions=CaptionRecord.from_json(required(document, "captions", dict, path),
                                                    within(path, "captions")),
                   decontamination=None if decontamination is None else
                   DecontaminationRecord.from_json(decontamination, within(path, "decontamination")),
                   counts={name: SourceCounts.from_json(counts[name], within(path, f"counts.{name}"))
                           for name in counts},
                   dropped=required(document, "dropped", int, path),
                   fingerprint=required(document, "fingerprint", str, path),
                   held_sha256=required(document, "held_sha256", str, path, None),
                   tool=required(document, "tool", str, path))


class DedupList:
    """A complete duplicate list, opened once and validated: `DedupList.open` is the only way in."""

    def __init__(self, directory: Path, metadata: DedupMetadata):
        self.directory = directory
        self.metadata = metadata

    @classmethod
    def open(cls, directory: str | os.PathLike) -> DedupList:
        directory = Path(directory)
        path = directory / METADATA_FILE
        meta = read_stage_metadata(path, FORMAT, FORMAT_VERSION, "duplicate list",
                                   f"mmtok dedup HASHES... --policy POLICY --out {directory}")
        return cls(directory, DedupMetadata.from_json(meta, path))

    def exclusion(self, manifest_fingerprint: str, manifest_rows: int) -> Exclusion:
        """The rows this list drops from the manifest of that fingerprint (which has `manifest_rows` rows);
        MmtokError when no input of the list was hashed from it (a list made for other manifests, or before the
        manifest was scanned again), or when the list is damaged (columns, types, rows that are not increasing
        rows of that manifest)."""
        import pyarrow.compute as pc

        inputs = {entry.manifest_fingerprint: entry.source for entry in self.metadata.inputs}
        source = inputs.get(manifest_fingerprint)
        if source is None:
            raise MmtokError(f"the duplicate list {self.directory} was not made from this manifest (fingerprint "
                             f"{manifest_fingerprint[:12]}...; its sources: {', '.join(sorted(inputs.values()))}); "
                             "run `mmtok hash` on this manifest and `mmtok dedup` with its table")
        table = self.table()
        table = table.filter(pc.equal(table.column("source"), source))
        rows = table.column("manifest_row").to_numpy()
        if len(rows) and (rows[0] < 0 or rows[-1] >= manifest_rows or (np.diff(rows) <= 0).any()):
            raise MmtokError(f"{self.directory / DROPPED_FILE}: the rows of source {source!r} are not increasing rows "
                             f"of its manifest's {manifest_rows:,}; the list is damaged -- rerun `mmtok dedup` into "
                             f"{self.directory}")
        caption = pc.is_in(table.column("rule"), pa.array(CAPTION_RULES)).to_numpy(zero_copy_only=False)
        keepers = [f"{rule}: {detail}" if flagged else f"{keeper_source}:{key} (row {row})"
                   for keeper_source, key, row, rule, detail, flagged in zip(
                       *(table.column(name).to_pylist() for name in ("keeper_source", "keeper_key", "keeper_row",
                                                                     "rule", "detail")), caption, strict=True)]
        return Exclusion(source=source, rows=rows, keepers=np.asarray(keepers, dtype=object),
                         keeper_source=np.asarray(table.column("keeper_source").to_pylist(), dtype=object),
                         keeper_row=table.column("keeper_row").to_numpy(),
                         contaminated=pc.equal(table.column("rule"), BENCHMARK_RULE).to_numpy(zero_copy_only=False),
                         caption=caption)

    def table(self) -> pa.Table:
        """dropped.parquet, after checking its sha256 against dedup.json and its columns against SCHEMA."""
        return read_recorded(self.directory / DROPPED_FILE, self.metadata.fingerprint, SCHEMA, "a duplicate list",
                             f"mmtok dedup HASHES... --policy POLICY --out {self.directory}")

    def held_table(self) -> pa.Table | None:
        """held.parquet (checked the same way), or None for a list made without --against."""
        if self.metadata.held_sha256 is None:
            return None
        return read_recorded(self.directory / HELD_FILE, self.metadata.held_sha256, HELD_SCHEMA,
                             "the held-back benchmark matches",
                             f"mmtok dedup ... --against BENCH --out {self.directory}")
