"""The one reader of records of each input container (`mmtok.formats.containers.Container`), by the container's
name: what a stage asks for a file once it knows what the file is. Its own module because the readers live beside
their formats (`tables.py`, `webdataset.py`), which import `containers.py`; imported when first asked for, so that
a stage reading JSON Lines does not load pyarrow."""

from __future__ import annotations

from mmtok.formats.containers import ARROW, JSONL, PARQUET, TAR, Container, JsonLines


def reader(name: str) -> Container:
    """The `Container` that reads container `name`: TAR, PARQUET or ARROW (every column), JSONL. A stage that
    wants some columns of a table only makes its own `mmtok.formats.tables.TableRecords`."""
    if name == JSONL:
        return JsonLines()
    if name == TAR:
        from mmtok.formats.webdataset import TarSamples

        return TarSamples()
    if name in (PARQUET, ARROW):
        from mmtok.formats.tables import TableRecords

        return TableRecords(name)
    raise ValueError(f"no reader for container {name!r}")
