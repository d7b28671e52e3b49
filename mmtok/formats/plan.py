"""The plan on disk: the one module that knows its layout (writer and readers side by side).

```
PLAN_DIR/
  plan.parquet       one row per kept image, sorted by batch, then manifest row inside a batch; with
                     its document's kept image count (documents of several images are assembled by merge)
  batches.parquet    one row per batch (global order): where its rows start in plan.parquet, shape, cost
  documents.parquet  kept documents with several images or a counted caption: totals, first/last batch
                     (every other kept document is one image: tokens = its image's + 2, batch = its batch)
  dropped.parquet    one row per dropped manifest row with its reason (and, for `duplicate`, its keeper)
  plan.json          metadata (parameters, fingerprints, totals, rank ranges); written LAST
```

Every file is written to a temporary sibling; only when all of them are complete is an existing plan.json
removed and are they fsynced and renamed, plan.json last, so a directory holds a plan exactly when
plan.json exists and the sizes it records match the files, and a run that fails before its end (a full
disk, a plan that keeps no image) leaves the previous plan as it was and no temporary file. Parquet
files use fixed options and fixed row-group sizes, so the same inputs give byte-identical files
(Parquet stores no timestamps; `created_by` names the pyarrow version). No pickle anywhere.

`PlanWriter` writes a plan; `Plan.open` reads one (plan.json once) and serves its tables, the
manifest it was made from, and each rank's batch range and rows for any world size.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from mmtok.errors import DamagedFile, MmtokError, brief
from mmtok.formats.manifest import Manifest
from mmtok.formats.parquet import FixedRowGroups
from mmtok.formats.presets import PlanParameters
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import (
    atomic_write_json,
    fsync_dir,
    naming,
    publish_file,
    required,
    required_number,
    sha256_file,
    within,
)
from mmtok.ranks import item_ranges, partition_ranks, rank_costs, worker_range

FORMAT = "mmtok-plan"
FORMAT_VERSION = 2  # 2: document_images per image row, no lanes, any batch boundary is a rank cut
META_FILE = "plan.json"
IMAGES_FILE = "plan.parquet"
BATCHES_FILE = "batches.parquet"
DOCUMENTS_FILE = "documents.parquet"
DROPPED_FILE = "dropped.parquet"
ROW_GROUP_ROWS = 1 << 17  # fixed: row-group boundaries must not depend on how rows were produced

IMAGES_SCHEMA = pa.schema([
    ("manifest_row", pa.int64()),
    ("batch", pa.int64()),
    ("target_height", pa.int32()),
    ("target_width", pa.int32()),
    ("tokens", pa.int32()),  # exact image-block length
    ("document", pa.int64()),
    ("image_index", pa.int32()),
    ("document_images", pa.int32()),  # kept images of the row's document (> 1: the document is assembled by merge)
])
BATCHES_SCHEMA = pa.schema([
    ("batch", pa.int64()),
    ("plan_row", pa.int64()),  # first row of the batch in plan.parquet
    ("num_images", pa.int32()),
    ("target_height", pa.int32()),
    ("target_width", pa.int32()),
    ("tokens", pa.int64()),  # image-block tokens of the whole batch
    ("cost", pa.float64()),  # cost model estimate
    ("window", pa.int64()),
    ("full", pa.bool_()),  # no further image of this shape would fit (budget or max_batch_images)
])
DOCUMENTS_SCHEMA = pa.schema([
    ("document", pa.int64()),
    ("num_images", pa.int32()),
    ("text_tokens", pa.int32()),  # caption tokens in caption modes; -1 where the encoder counts text
    ("tokens", pa.int64()),  # BOS + blocks + text + EOS (text excluded where text_tokens is -1)
    ("first_batch", pa.int64()),
    ("last_batch", pa.int64()),  # the last batch holding one of its images
])
# keeper: for reason `duplicate`, the kept image ("SOURCE:KEY (row N)", from `plan --exclude`); null otherwise.
# A manifest error row is dropped as SCAN_REASON + the scan's reason. `Plan.skip_records` reads the rows as the
# skip records of every other stage; the file keeps only what the manifest does not hold (10^8 rows).
SCAN_REASON = "scan:"
DROPPED_CHUNK = 1 << 16  # rows of dropped.parquet read at a time by `Plan.skip_records`
STAGE = "plan"  # the stage of the skip records of the plan's own drops
DROPPED_SCHEMA = pa.schema([("manifest_row", pa.int64()), ("reason", pa.string()), ("keeper", pa.string())])
SCHEMAS = {IMAGES_FILE: IMAGES_SCHEMA, BATCHES_FILE: BATCHES_SCHEMA, DOCUMENTS_FILE: DOCUMENTS_SCHEMA,
           DROPPED_FILE: DROPPED_SCHEMA}
_DELTA = "DELTA_BINARY_PACKED"  # sorted or slowly varying integers: small and cheap to write
_ENCODINGS = {  # (column encodings, compressed columns); fixed options make files byte-reproducible
    IMAGES_FILE: ({"manifest_row": _DELTA, "document": _DELTA, "image_index": _DELTA},
                  # runs: plain + lz4 is cheapest
                  ("batch", "target_height", "target_width", "tokens", "document_images")),
    BATCHES_FILE: ({"batch": _DELTA, "plan_row": _DELTA, "window": _DELTA}, ("num_images", "target_height",
                   "target_width", "tokens", "cost", "full")),
    DOCUMENTS_FILE: ({name: _DELTA for name in DOCUMENTS_SCHEMA.names}, ()),
    DROPPED_FILE: ({"manifest_row": _DELTA}, ()),
}


def _parquet_options(name: str) -> dict:
    encodings, compressed = _ENCODINGS[name]
    schema = SCHEMAS[name]
    return dict(
        compression={c: ("lz4" if c in compressed else "none") for c in schema.names},
        use_dictionary=[c for c in schema.names if c not in encodings and pa.types.is_string(schema.field(c).type)],
        column_encoding=encodings,
        # per-row-group batch range: readers may filter on it
        write_statistics=["batch"] if name == IMAGES_FILE else False,
        write_page_index=False, store_schema=True, version="2.6",
    )


class _TableFile:
    """A Parquet file written in row groups of exactly ROW_GROUP_ROWS rows (the last one shorter)."""

    def __init__(self, path: Path, schema: pa.Schema):
        self.path = path
        self.tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        self.schema = schema
        self.rows = 0
        try:
            with naming(self.path):
                self._writer = pq.ParquetWriter(self.tmp, schema, **_parquet_options(path.name))
        except BaseException:
            self.tmp.unlink(missing_ok=True)  # created, but its header did not fit (a full disk)
            raise
        self._groups = FixedRowGroups(self._writer, schema, ROW_GROUP_ROWS)

    def write(self, columns: Mapping[str, np.ndarray | pa.Array]) -> None:
        arrays = [_arrow(columns[f.name], f.type) for f in self.schema]
        with naming(self.path):
            self._groups.write(pa.Table.from_arrays(arrays, schema=self.schema))
        self.rows = self._groups.rows

    def seal(self) -> None:
        """Write the last row group and the footer (the file is complete, still under its temporary name)."""
        with naming(self.path):
            self._groups.finish()
            self._writer.close()

    def publish(self) -> None:
        with naming(self.path):
            publish_file(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self._writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _arrow(values: np.ndarray | pa.Array, type_: pa.DataType) -> pa.Array:
    if isinstance(values, pa.Array):
        return values if values.type == type_ else values.cast(type_)
    return pa.array(values, type=type_)


# -- plan.json -------------------------------------------------------------------------------------------------
# `build_plan` makes a PlanMetadata, `PlanWriter.finish` completes it (files, fingerprint) and writes `to_json()`;
# `Plan.open` reads it back with `from_json`, every key's type checked (a plan may come from a stranger). Keys a
# plan of this version written by an earlier mmtok lacks have defaults: `balance.fixed_batches`, `work_items`
# (and its `imbalance`), `exclude` (and its keeper counts).


def _rank_batches(document: dict, path: Path) -> list[list[int]]:
    """`rank_batches`: `world_size` [start, end) integer pairs that cut batches 0..num_batches in order (what
    `mmtok.ranks.partition_ranks` makes); DamagedFile naming the key otherwise."""
    value = required(document, "rank_batches", list, path)
    world_size, batches = required(document, "world_size", int, path), required(document, "num_batches", int, path)
    end = 0
    for pair in value:
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(x) is int for x in pair)
                and pair[0] == end <= pair[1] <= batches):
            raise DamagedFile(f"{path}: key 'rank_batches' must cut batches 0..{batches} in order, not at "
                              f"{brief(pair, 40)}; re-run `mmtok plan`")
        end = pair[1]
    if len(value) != world_size or end != batches:
        raise DamagedFile(f"{path}: key 'rank_batches' must hold {world_size} ranges ending at batch {batches} "
                          f"(world_size, num_batches), not {len(value)} ending at {end}; re-run `mmtok plan`")
    return value


# What every reader takes from `parameters` (present since version 2); the rest is checked by PlanParameters.
_READ_PARAMETERS = {"mode": str, "text_tokenizer": str, "factor": int, "min_pixels": int, "max_pixels": int,
                    "token_budget": int, "max_batch_images": int, "window_rows": int, "cost_model": dict}
_RECORDED = ("text_tokenizer_sha256", "text_vocab_size")  # what the planner adds to PlanParameters.to_dict()


def _parameters(document: dict, path: Path) -> dict:
    """`parameters`, kept as recorded (the fingerprint covers them) after checking them: the keys readers take,
    with their types, and every value as `PlanParameters` checks it (MmtokError -> DamagedFile naming the file)."""
    parameters = required(document, "parameters", dict, path)
    for key, kind in _READ_PARAMETERS.items():
        required(parameters, key, kind, within(path, "parameters"))
    required(parameters, "text_tokenizer_sha256", str, within(path, "parameters"), "")
    if "work_items" in document:  # explain prices the items in seconds
        required_number(parameters["cost_model"], "seconds_per_unit", within(path, "parameters.cost_model"))
    where = f"{path}: parameters"
    try:
        PlanParameters.from_mapping({k: v for k, v in parameters.items() if k not in _RECORDED}, where)
    except MmtokError as err:  # the value checks do not name the file; the mapping checks do
        text = brief(err, 300)
        raise DamagedFile(f"{text if text.startswith(where) else f'{where}: {text}'}; re-run `mmtok plan`") from None
    return parameters


@dataclass(frozen=True)
class RankCost:
    """The modeled cost of the plan's ranks."""

    min: float
    mean: float
    max: float
    idle_ranks: int

    @classmethod
    def from_json(cls, value, path: Path) -> RankCost:
        return cls(*(required_number(value, key, path) for key in ("min", "mean", "max")),
                   required(value, "idle_ranks", int, path))


@dataclass(frozen=True)
class Balance:
    """The balance target, whether batches were kept whole (`--fixed-batches`), what keeps the modeled imbalance
    above the target (None: nothing), and how many batches were split at rank targets."""

    target: float
    fixed_batches: bool
    limited_by: str | None
    split_batches: int = 0

    @classmethod
    def from_json(cls, value, path: Path) -> Balance:
        return cls(required_number(value, "target", path), required(value, "fixed_batches", bool, path, False),
                   required(value, "limited_by", (str, type(None)), path),
                   required(value, "split_batches", int, path))


@dataclass(frozen=True)
class CostRange:
    min: float
    max: float


@dataclass(frozen=True)
class WorkItems:
    """The plan's work items (`mmtok.plan.core.cut_work_items`). `batches` is kept as read: `Plan.work_items`
    checks it against the items its batch costs and target give."""

    item_seconds: float
    target_cost: float
    count: int
    cost: CostRange
    imbalance: float | None  # of `world_size` workers sharing them; None in plans of an earlier mmtok
    batches: list

    @classmethod
    def from_json(cls, value, path: Path) -> WorkItems:
        cost, at_cost = required(value, "cost", dict, path), within(path, "cost")
        return cls(required_number(value, "item_seconds", path), required_number(value, "target_cost", path),
                   required(value, "count", int, path),
                   CostRange(required_number(cost, "min", at_cost), required_number(cost, "max", at_cost)),
                   required_number(value, "imbalance", path, None), required(value, "batches", list, path))

    def to_json(self) -> dict:
        document = asdict(self)
        if self.imbalance is None:
            del document["imbalance"]
        return document


@dataclass(frozen=True)
class PlanTotals:
    """What the manifest's rows became: images, documents and tokens kept and dropped, and the modeled cost."""

    manifest_rows: int
    kept_images: int
    dropped_images: int
    documents: int
    kept_documents: int
    dropped_documents: int
    image_tokens: int
    text_tokens: int
    document_tokens: int
    cost: float

    @classmethod
    def from_json(cls, value, path: Path) -> PlanTotals:
        return cls(*(required_number(value, f.name, path) if f.name == "cost" else required(value, f.name, int, path)
                     for f in fields(cls)))


@dataclass(frozen=True)
class Exactness:
    """Which token totals are exact (sft/interleaved: document text is counted by the encoder)."""

    image_tokens: bool
    text_tokens: bool
    document_tokens: bool
    note: str

    @classmethod
    def from_json(cls, value, path: Path) -> Exactness:
        return cls(*(required(value, key, bool, path) for key in ("image_tokens", "text_tokens", "document_tokens")),
                   required(value, "note", str, path))


@dataclass(frozen=True)
class OverBudgetShape:
    height: int
    width: int
    tokens: int
    images: int


@dataclass(frozen=True)
class OverBudget:
    """Images above the token budget (each alone in its batch): how many, and the largest shapes."""

    images: int
    shapes: list[OverBudgetShape]

    @classmethod
    def from_json(cls, value, path: Path) -> OverBudget:
        return cls(required(value, "images", int, path),
                   [OverBudgetShape(*(required(shape, f.name, int, within(path, f"shapes[{i}]"))
                                      for f in fields(OverBudgetShape)))
                    for i, shape in enumerate(required(value, "shapes", list, path))])


@dataclass(frozen=True)
class BatchFill:
    full_fraction: float
    mean_fill: float
    mean_images: float

    @classmethod
    def from_json(cls, value, path: Path) -> BatchFill:
        return cls(*(required_number(value, f.name, path) for f in fields(cls)))


@dataclass(frozen=True)
class LongDocuments:
    """Documents over `max_document_tokens` (0: no limit): how many were dropped, the largest document's tokens."""

    limit: int
    dropped: int
    largest_tokens: int

    @classmethod
    def from_json(cls, value, path: Path) -> LongDocuments:
        return cls(*(required(value, f.name, int, path) for f in fields(cls)))


@dataclass(frozen=True)
class PlanExclusion:
    """The duplicate list of `plan --exclude`: which, how many rows of this manifest it drops, and the keepers of
    those rows that this plan drops for a reason of its own (their duplicates then have no copy kept)."""

    directory: str
    fingerprint: str
    source: str
    rows: int
    keepers_dropped: dict[str, int] = field(default_factory=dict)
    duplicates_without_kept_copy: int = 0

    @classmethod
    def from_json(cls, value, path: Path) -> PlanExclusion:
        keepers = required(value, "keepers_dropped", dict, path, {})
        return cls(required(value, "directory", str, path), required(value, "fingerprint", str, path),
                   required(value, "source", str, path), required(value, "rows", int, path),
                   {reason: required(keepers, reason, int, within(path, "keepers_dropped")) for reason in keepers},
                   required(value, "duplicates_without_kept_copy", int, path, 0))


@dataclass(frozen=True)
class PlanFile:
    """A Parquet file of the plan as plan.json records it."""

    rows: int
    bytes: int
    sha256: str

    @classmethod
    def from_json(cls, value, path: Path) -> PlanFile:
        return cls(required(value, "rows", int, path), required(value, "bytes", int, path),
                   required(value, "sha256", str, path))


@dataclass(frozen=True)
class PlanMetadata:
    """plan.json: what the plan was made from and with, its rank ranges and work items, and its figures."""

    tool_version: str
    manifest_dir: str
    manifest_fingerprint: str
    parameters: dict  # `PlanParameters.to_dict()` and the text tokenizer's sha256 and vocabulary size
    world_size: int
    rank_batches: list[list[int]]  # [start, end) batches of each rank of `world_size`
    rank_cost: RankCost
    imbalance: float  # modeled: max / mean rank cost - 1
    balance: Balance
    num_batches: int
    num_windows: int
    work_items: WorkItems | None  # None in plans of an earlier mmtok (no key in the file)
    totals: PlanTotals
    exact: Exactness
    dropped_by_reason: dict[str, int]
    over_budget: OverBudget
    batch_fill: BatchFill
    long_documents: LongDocuments
    exclude: PlanExclusion | None  # `plan --exclude` (null without)
    files: dict[str, PlanFile] = field(default_factory=dict)  # by name; set by `PlanWriter.finish`
    fingerprint: str = ""  # `plan_fingerprint`; set by `PlanWriter.finish`

    def to_json(self) -> dict:
        document = {**asdict(self), "format": FORMAT, "format_version": FORMAT_VERSION}
        if self.work_items is None:
            del document["work_items"]
        else:
            document["work_items"] = self.work_items.to_json()
        return document

    @classmethod
    def from_json(cls, document: dict, path: Path) -> PlanMetadata:
        """The metadata of `document` (a parsed plan.json of this format and version), every key checked -- the
        keys every reader needs first, so that damage to them is what is named."""
        world_size = required(document, "world_size", int, path)
        num_batches = required(document, "num_batches", int, path)
        fingerprint = required(document, "fingerprint", str, path)
        files = required(document, "files", dict, path)
        files = {name: PlanFile.from_json(files[name], within(path, f"files.{name}")) for name in files}
        items = required(document, "work_items", dict, path, None)
        exclude = required(document, "exclude", (dict, type(None)), path, None)
        dropped = required(document, "dropped_by_reason", dict, path)
        return cls(
            tool_version=required(document, "tool_version", str, path),
            manifest_dir=required(document, "manifest_dir", str, path),
            manifest_fingerprint=required(document, "manifest_fingerprint", str, path),
            parameters=_parameters(document, path),
            world_size=world_size,
            rank_batches=_rank_batches(document, path),
            rank_cost=RankCost.from_json(required(document, "rank_cost", dict, path), within(path, "rank_cost")),
            imbalance=required_number(document, "imbalance", path),
            balance=Balance.from_json(required(document, "balance", dict, path), within(path, "balance")),
            num_batches=num_batches,
            num_windows=required(document, "num_windows", int, path),
            work_items=None if items is None else WorkItems.from_json(items, within(path, "work_items")),
            totals=PlanTotals.from_json(required(document, "totals", dict, path), within(path, "totals")),
            exact=Exactness.from_json(required(document, "exact", dict, path), within(path, "exact")),
            dropped_by_reason={reason: required(dropped, reason, int, within(path, "dropped_by_reason"))
                               for reason in dropped},
            over_budget=OverBudget.from_json(required(document, "over_budget", dict, path),
                                             within(path, "over_budget")),
            batch_fill=BatchFill.from_json(required(document, "batch_fill", dict, path), within(path, "batch_fill")),
            long_documents=LongDocuments.from_json(required(document, "long_documents", dict, path),
                                                   within(path, "long_documents")),
            exclude=None if exclude is None else PlanExclusion.from_json(exclude, within(path, "exclude")),
            files=files, fingerprint=fingerprint)


class PlanWriter:
    """Writes one plan directory; use as a context manager, call `finish(meta)` last.

    On an exception before `finish` every temporary file is removed and the directory's previous plan, if
    any, is untouched.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, _TableFile] = {}
        try:
            for name, schema in SCHEMAS.items():
                self._files[name] = _TableFile(self.directory / name, schema)
        except BaseException:
            self._abort()
            raise

    def __enter__(self) -> "PlanWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._abort()

    def _abort(self) -> None:
        """Remove every temporary file, each even when closing another fails (a full disk)."""
        for table_file in self._files.values():
            try:
                table_file.abort()
            except OSError:
                pass  # its temporary file is gone (abort unlinks it in any case); the first error is raised

    def write_images(self, columns: Mapping[str, np.ndarray]) -> None:
        self._files[IMAGES_FILE].write(columns)

    def write_batches(self, columns: Mapping[str, np.ndarray]) -> None:
        self._files[BATCHES_FILE].write(columns)

    def write_documents(self, columns: Mapping[str, np.ndarray]) -> None:
        self._files[DOCUMENTS_FILE].write(columns)

    def write_dropped(self, manifest_row: np.ndarray, reason_code: np.ndarray, reason_names: list[str],
                      keeper: np.ndarray) -> None:
        reason = pa.DictionaryArray.from_arrays(pa.array(reason_code, pa.int32()), pa.array(reason_names, pa.string()))
        self._files[DROPPED_FILE].write({"manifest_row": manifest_row, "reason": reason.dictionary_decode(),
                                         "keeper": pa.array(keeper, pa.string())})

    def finish(self, meta: PlanMetadata) -> PlanMetadata:
        """Complete the Parquet files, then replace the old plan: plan.json removed (the old metadata must not
        describe new files), the files renamed into place, plan.json (with `files` and `fingerprint` added)
        written last."""
        for table_file in self._files.values():
            table_file.seal()
        (self.directory / META_FILE).unlink(missing_ok=True)
        files = {}
        for name, table_file in self._files.items():
            table_file.publish()
            files[name] = PlanFile(rows=table_file.rows, bytes=table_file.path.stat().st_size,
                                   sha256=sha256_file(table_file.path))
        fsync_dir(self.directory)
        meta = replace(meta, files=files, fingerprint=plan_fingerprint(files[IMAGES_FILE].sha256, meta.parameters,
                                                                       meta.manifest_fingerprint))
        atomic_write_json(self.directory / META_FILE, meta.to_json())
        return meta


def has_plan(directory: str | os.PathLike) -> bool:
    """Whether `directory` holds a complete plan (its plan.json, written last)."""
    return (Path(directory) / META_FILE).is_file()


def plan_fingerprint(images_sha256: str, parameters: dict, manifest_fingerprint: str) -> str:
    """sha256 over plan.parquet's sha256, the canonical JSON of the parameters and the manifest
    fingerprint. plan.parquet's batch column holds the balance splits made for the plan's world size,
    so two plans for different world sizes may differ; ranks of one plan always agree."""
    material = {"plan.parquet": images_sha256, "parameters": parameters, "manifest_fingerprint": manifest_fingerprint}
    return hashlib.sha256(json.dumps(material, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class Plan:
    """A plan directory, opened once: plan.json checked against the files, its tables, and what
    each rank encodes (for the plan's world size or, re-derived, for any other)."""

    def __init__(self, directory: Path, meta: PlanMetadata):
        self.directory = directory
        self.meta = meta
        self._ranges: dict[int, np.ndarray] = {}
        self._items: np.ndarray | None = None  # checked once (a worker asks for them per item)
        self._manifest: Manifest | None = None
        self._plan_row: np.ndarray | None = None
        self._costs: np.ndarray | None = None

    @classmethod
    def open(cls, directory: str | os.PathLike) -> Plan:
        """The plan in `directory`, after checking the format and that every file has the recorded size."""
        directory = Path(directory)
        path = directory / META_FILE
        if not path.is_file():
            raise MmtokError(f"no plan in {directory}: {META_FILE} is missing "
                             f"(run `mmtok plan MANIFEST --out {directory}`)")
        try:
            meta = json.loads(path.read_text("utf-8"))
        except (ValueError, RecursionError) as err:  # RecursionError: nesting deeper than the parser's stack
            raise MmtokError(f"{path}: damaged ({err}); re-run `mmtok plan`") from None
        if not isinstance(meta, dict):  # the shape every reader below relies on; DamagedFile names file and key
            required(meta, "format", str, path)
        if meta.get("format") != FORMAT or meta.get("format_version") != FORMAT_VERSION:
            raise MmtokError(f"{path} is not a {FORMAT} v{FORMAT_VERSION} plan (format {meta.get('format')!r}, "
                             f"version {meta.get('format_version')!r}); re-run `mmtok plan`")
        metadata = PlanMetadata.from_json(meta, path)
        for name, recorded in metadata.files.items():
            file = directory / name
            if not file.is_file() or file.stat().st_size != recorded.bytes:
                raise MmtokError(f"{file} does not match {path} (missing or changed size); re-run `mmtok plan`")
        return cls(directory, metadata)

    @property
    def world_size(self) -> int:
        """The world size the plan's own rank ranges were balanced for."""
        return self.meta.world_size

    def table(self, name: str, columns: list[str] | None = None) -> pa.Table:
        """One of the plan's Parquet files (IMAGES_FILE, BATCHES_FILE, DOCUMENTS_FILE, DROPPED_FILE)."""
        if name not in SCHEMAS:
            raise ValueError(f"{name!r} is not a plan file; known: {sorted(SCHEMAS)}")
        return pq.read_table(self.directory / name, columns=columns)

    def manifest(self) -> Manifest:
        """The manifest the plan was made from (opened once); MmtokError when it was rewritten since."""
        if self._manifest is not None:
            return self._manifest
        manifest = self._manifest = Manifest.open(self.meta.manifest_dir)
        planned = self.meta.manifest_fingerprint
        if manifest.fingerprint != planned:
            raise MmtokError(f"the manifest in {manifest.directory} was rewritten after planning (fingerprint "
                             f"{manifest.fingerprint[:12]}... != plan's {planned[:12]}...); re-run `mmtok plan`")
        return manifest

    def skip_records(self) -> Iterator[SkipRecord]:
        """Every manifest row the plan dropped, as a skip record, in manifest-row order: an error row of the scan
        as the manifest's record of it (stage "scan"), every other row with the plan's reason (stage "plan";
        `detail`: the keeper of a `duplicate`, the benchmark image of a `contaminated` row, what the check
        found in a flagged caption). Streamed, DROPPED_CHUNK rows at a time (a plan may drop 10^8). MmtokError
        when the plan and its manifest disagree on the error rows."""
        path = self.directory / DROPPED_FILE
        manifest = self.manifest()
        scanned = manifest.skip_records()
        last = -1
        for batch in pq.ParquetFile(path).iter_batches(batch_size=DROPPED_CHUNK):
            rows = batch.column("manifest_row").to_numpy()
            if len(rows) and (rows[0] <= last or bool(np.any(np.diff(rows) <= 0))):
                raise MmtokError(f"{path}: its manifest rows do not increase (the planner writes them in order); "
                                 "re-run `mmtok plan`")
            last = int(rows[-1]) if len(rows) else last
            yield from self._skip_records(rows, batch.column("reason").to_pylist(), batch.column("keeper").to_pylist(),
                                          manifest, scanned)
        left = next(scanned, None)
        if left is not None:
            raise MmtokError(f"the manifest's error row {left.position} ({left.reason}) is not in {path}; "
                             "re-run `mmtok plan`")

    def _skip_records(self, rows: np.ndarray, reasons: list[str], keepers: list[str | None], manifest: Manifest,
                      scanned: Iterator[SkipRecord]) -> Iterator[SkipRecord]:
        """The records of one chunk of dropped.parquet: the plan's own drops named from the manifest rows, the
        scan's taken from `scanned` (the manifest's records, in row order)."""
        own = np.array([not reason.startswith(SCAN_REASON) for reason in reasons], bool)
        where = manifest.read_rows(rows[own], ["key", "tar", "container", "member"])
        taken = 0
        for row, reason, keeper, is_own in zip(rows.tolist(), reasons, keepers, own.tolist(), strict=True):
            if is_own:
                yield SkipRecord(key=where["key"][taken], source=where["tar"][taken],
                                 container=where["container"][taken], member=where["member"][taken] or None,
                                 position=row, reason=reason, detail=keeper or "", stage=STAGE)
                taken += 1
                continue
            record = next(scanned, None)
            if record is None or record.position != row or f"{SCAN_REASON}{record.reason}" != reason:
                raise MmtokError(f"{self.directory / DROPPED_FILE} drops manifest row {row} as {reason!r}, but the "
                                 f"manifest's {'next' if record else 'last'} error is "
                                 f"{'none' if record is None else f'row {record.position} ({record.reason})'}; "
                                 "re-run `mmtok plan`")
            yield record

    def ranges(self, world_size: int | None = None) -> np.ndarray:
        """[start, end) global batch range per rank, shape [world_size, 2]: the plan's own ranges for
        its world size (the default), else the same cost-balanced partition re-derived for `world_size`
        from the batch costs (`mmtok.ranks`, as the planner used it)."""
        world_size = self.world_size if world_size is None else world_size
        if world_size < 1:
            raise MmtokError(f"world size must be >= 1, got {world_size}")
        if world_size not in self._ranges:
            if world_size == self.world_size:
                ranges = np.asarray(self.meta.rank_batches, np.int64).reshape(-1, 2)
            else:
                costs = self.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
                ranges = partition_ranks(costs, world_size)
            self._ranges[world_size] = ranges
        return self._ranges[world_size]

    def work_items(self) -> np.ndarray:
        """[start, end) batch range of every work item, shape [items, 2] (plan.json's `work_items`), checked to be
        the items its batch costs and target give (`mmtok.ranks.item_ranges`): plan.json's fingerprint does not
        cover them, and parts of edited items would merge with a gap."""
        if self._items is None:
            items = self.meta.work_items
            if items is None:
                raise MmtokError(f"{self.directory / META_FILE} has no work items (a plan of an older mmtok); re-run "
                                 "`mmtok plan`")
            costs = self.batch_costs()
            target = items.target_cost
            expected = item_ranges(costs, target) if isinstance(target, float) and target > 0 else None
            if expected is None or items.batches != expected.tolist() or items.count != len(expected):
                raise MmtokError(f"{self.directory / META_FILE}: its work items are not those of its batches and "
                                 "target (edited or damaged); re-run `mmtok plan`")
            self._items = expected
        return self._items

    def batch_costs(self) -> np.ndarray:
        """The cost-model cost of each batch (read once)."""
        if self._costs is None:
            self._costs = self.table(BATCHES_FILE, ["cost"]).column(0).to_numpy()
        return self._costs

    def item_costs(self) -> np.ndarray:
        """The cost-model cost of each work item."""
        return rank_costs(self.batch_costs(), self.work_items())

    def worker_items(self, worker: int, workers: int) -> range:
        """The work items worker `worker` of `workers` takes when nothing is shared between workers (srun,
        torchrun): `mmtok.ranks.worker_items`, a function of (plan, workers) alone, so every worker computes
        every worker's share."""
        if not 0 <= worker < workers:
            raise MmtokError(f"worker {worker} is outside 0..{workers - 1} ({workers} workers)")
        return worker_range(self.item_costs(), workers, worker)

    def work_item_id(self, item: int) -> str:
        """The id of work item `item`: from the plan's fingerprint and the item's index, so two plans never share
        an id and the same plan always gives the same ones."""
        return hashlib.sha256(f"{self.meta.fingerprint}/work-item/{item}".encode()).hexdigest()[:16]

    def rank_range(self, rank: int, world_size: int | None = None) -> tuple[int, int]:
        """[start, end) global batch range of `rank` of `world_size` (default: the plan's); empty for idle ranks."""
        if world_size is None:
            if not 0 <= rank < self.world_size:
                raise MmtokError(f"rank {rank} is outside the plan's world size {self.world_size}; re-plan with "
                                 f"`mmtok plan --world-size N` for the job's size")
        elif not 0 <= rank < world_size:
            raise MmtokError(f"rank {rank} is outside 0..{world_size - 1} (world size {world_size})")
        start, end = self.ranges(world_size)[rank]
        return int(start), int(end)

    def rank_rows(self, rank: int, world_size: int | None = None, columns: list[str] | None = None) -> pa.Table:
        """The plan.parquet rows of the rank's batches (see `rank_range`), in plan order."""
        return self.batch_rows(*self.rank_range(rank, world_size), columns=columns)

    def batch_rows(self, start: int, end: int, columns: list[str] | None = None) -> pa.Table:
        """The plan.parquet rows of batches [start, end), in plan order; reads only the row groups that hold
        them."""
        images = pq.ParquetFile(self.directory / IMAGES_FILE)
        if start == end:
            schema = images.schema_arrow
            return (schema.empty_table() if columns is None
                    else pa.schema([schema.field(c) for c in columns]).empty_table())
        if self._plan_row is None:  # read once: a worker reads the rows of each of its items
            self._plan_row = self.table(BATCHES_FILE, ["plan_row"]).column(0).to_numpy()
        plan_row = self._plan_row
        first = int(plan_row[start])
        stop = int(plan_row[end]) if end < len(plan_row) else images.metadata.num_rows
        group_rows = np.array([images.metadata.row_group(i).num_rows for i in range(images.num_row_groups)], np.int64)
        group_start = np.concatenate([[0], np.cumsum(group_rows)])
        groups = np.flatnonzero((group_start[:-1] < stop) & (group_start[1:] > first))
        table = images.read_row_groups(groups.tolist(), columns=columns, use_threads=False)
        return table.slice(first - int(group_start[groups[0]]), stop - first)
