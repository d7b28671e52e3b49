"""The one reader of records of each input container (`mmtok.formats.containers.Container`): what a stage asks
for a file once it knows the file's container. Its own module because the readers live beside their formats
(`tables.py`, `webdataset.py`), which import `containers.py`."""

from __future__ import annotations

from mmtok.formats.containers import ARROW, JSONL, TABLE, TAR, Container, JsonLines
from mmtok.formats.tables import TableRecords
from mmtok.formats.webdataset import TarSamples

READERS: dict[str, Container] = {TAR: TarSamples(), TABLE: TableRecords(), ARROW: TableRecords(), JSONL: JsonLines()}


def reader(name: str) -> Container:
    """The `Container` that reads container `name` (TAR; TABLE, i.e. PARQUET, or ARROW; JSONL)."""
    return READERS[name]
