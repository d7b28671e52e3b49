"""What the benchmark reads: a catalog of items with a category, the stratified sample, and item bytes.

Two inputs are accepted for `--manifest`:
- a scan manifest directory (`manifest.parquet` + `manifest.json`, see HELPERS' manifest contract):
  rows with status "ok" are items; the category is any manifest column (for example `tar`, one
  category per shard) or a column of a `--categories` table joined on `key`; bytes are read with
  seek(offset) + read(size) from the tar (or row `offset` of column `member` of a Parquet container);
- a table file (.csv, .parquet, .jsonl/.ndjson) with a path column (default `path`; relative paths are
  resolved against the table's folder) and the category column. This form serves images and audio.

The sample is drawn per category with its own NumPy Generator seeded by (seed, sha256 of the category
name): the same seed gives the same sample, and adding or removing a category leaves the other
categories' draws unchanged. Items are kept in catalog order within a category; categories are sorted.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.manifest import Manifest, MemberReader
from mmtok.fsutil import read_regular_file

TABLE_SUFFIXES = (".csv", ".parquet", ".jsonl", ".ndjson")


@dataclass(frozen=True)
class Catalog:
    """Every usable item: a stable id, its category, and where its bytes are."""

    ids: np.ndarray  # str: "row:<manifest row>" or "path:<relative path as written>"
    categories: np.ndarray  # str
    sources: np.ndarray  # str, human-readable (path, or tar:member)
    locations: list[tuple]  # ("file", path) | a manifest row's (container, path, member, offset, size)
    kind: str  # "manifest" or "table"
    fingerprint: str  # sha256 of the input file(s), recorded in the run identity
    excluded: dict[str, int]  # rows not usable, by reason


def read_catalog(manifest: str | Path, category_column: str, path_column: str = "path",
                 categories: str | Path | None = None) -> Catalog:
    """Read a scan manifest directory or a table file into a Catalog (raises MmtokError with the fix)."""
    manifest = Path(manifest)
    if manifest.is_dir():
        return _manifest_catalog(manifest, category_column, categories)
    if manifest.suffix.lower() in TABLE_SUFFIXES and manifest.is_file():
        return _table_catalog(manifest, category_column, path_column)
    raise MmtokError(f"--manifest {manifest}: expected a scan manifest directory (with manifest.parquet) or a "
                     f"table file ({', '.join(TABLE_SUFFIXES)}) with a {path_column!r} and a category column")


def read_table(path: Path):
    """A CSV / Parquet / JSON-lines file as a pyarrow Table."""
    import pyarrow.csv
    import pyarrow.json
    import pyarrow.parquet

    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pyarrow.parquet.read_table(path)
        if suffix == ".csv":
            return pyarrow.csv.read_csv(path)
        return pyarrow.json.read_json(path)
    except Exception as err:  # pyarrow raises ArrowInvalid/OSError variants
        raise MmtokError(f"{path}: cannot read as {suffix[1:]}: {err}") from None


def _column(table, name: str, path: Path) -> np.ndarray:
    if name not in table.column_names:
        raise MmtokError(f"{path}: no column {name!r}; columns are {', '.join(table.column_names)}")
    values = table.column(name).to_pylist()
    return np.array(["" if v is None else str(v) for v in values], dtype=object)


def _table_catalog(path: Path, category_column: str, path_column: str) -> Catalog:
    from mmtok.fsutil import sha256_file

    table = read_table(path)
    paths = _column(table, path_column, path)
    categories = _column(table, category_column, path)
    keep = (paths != "") & (categories != "")
    excluded = {"missing_path_or_category": int((~keep).sum())} if (~keep).any() else {}
    paths, categories = paths[keep], categories[keep]
    resolved = [p if Path(p).is_absolute() else str(path.parent / p) for p in paths]
    return Catalog(ids=np.array([f"path:{p}" for p in paths], dtype=object), categories=categories,
                   sources=np.array(paths, dtype=object), locations=[("file", p) for p in resolved],
                   kind="table", fingerprint=sha256_file(path), excluded=excluded)


def _manifest_catalog(directory: Path, category_column: str, categories: str | Path | None) -> Catalog:
    manifest = Manifest.open(directory)
    parquet = manifest.path
    table = manifest.read()
    status = _column(table, "status", parquet)
    rows = np.flatnonzero(status == "ok")
    excluded = {}
    reasons = _column(table, "reason", parquet)[status != "ok"]
    for reason in sorted(set(reasons)):
        excluded[f"manifest:{reason or 'error'}"] = int((reasons == reason).sum())
    cats = _manifest_categories(table, parquet, category_column, categories)[rows]
    has_category = cats != ""
    if (~has_category).any():
        excluded["missing_category"] = int((~has_category).sum())
    rows, cats = rows[has_category], cats[has_category]
    locations, sources = _manifest_locations(table, parquet, rows)
    return Catalog(ids=np.array([f"row:{r}" for r in rows], dtype=object), categories=cats,
                   sources=sources, locations=locations, kind="manifest", fingerprint=manifest.fingerprint,
                   excluded=excluded)


def _manifest_categories(table, parquet: Path, column: str, categories: str | Path | None) -> np.ndarray:
    if categories is None:
        values = _column(table, column, parquet)
        return np.array([Path(v).name for v in values], dtype=object) if column == "tar" else values
    side = Path(categories)
    side_table = read_table(side)
    mapping = dict(zip(_column(side_table, "key", side), _column(side_table, column, side), strict=True))
    return np.array([mapping.get(k, "") for k in _column(table, "key", parquet)], dtype=object)


def _manifest_locations(table, parquet: Path, rows: np.ndarray) -> tuple[list[tuple], np.ndarray]:
    tars, containers, members = (_column(table, c, parquet)[rows] for c in ("tar", "container", "member"))
    offsets = table.column("offset").to_numpy()[rows]
    sizes = table.column("size").to_numpy()[rows]
    locations = [(c, t, m, int(o), int(s)) for t, c, m, o, s in zip(tars, containers, members, offsets, sizes,
                                                                     strict=True)]
    sources = np.array([f"{t}:{m}" for t, m in zip(tars, members, strict=True)], dtype=object)
    return locations, sources


def stratified_sample(categories: np.ndarray, per_category: int, seed: int) -> np.ndarray:
    """Indices of up to `per_category` items per category, reproducible for a seed.

    Categories are visited in sorted order; each draws without replacement from its own Generator
    (seeded by the run seed and the category name), and keeps its picks in catalog order.
    """
    if per_category < 1:
        raise MmtokError(f"--per-category must be at least 1, got {per_category}")
    chosen = []
    for category in sorted(set(categories)):
        members = np.flatnonzero(categories == category)
        rng = np.random.default_rng([seed, _category_seed(category)])
        picks = rng.choice(members.size, size=min(per_category, members.size), replace=False)
        chosen.append(members[np.sort(picks)])
    return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)


def _category_seed(category: str) -> int:
    return int.from_bytes(hashlib.sha256(category.encode("utf-8")).digest()[:8], "little")


class ByteReader:
    """Reads item bytes by location: a whole file, or a manifest row through the manifest's reader."""

    def __init__(self) -> None:
        self._members = MemberReader(max_open=16)

    def read(self, location: tuple) -> bytes:
        if location[0] == "file":
            return read_regular_file(location[1])
        return self._members.read_member(*location)  # the manifest's reader knows each container
