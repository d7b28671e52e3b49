"""Documents of several images, assembled in one ordered CPU pass from the items of every part.

Encode commits each image of such a document as an *image item* (its block, or why it failed) on
whichever rank encoded it, and the document's text template as a *template item* (on the rank of its
first image); see `mmtok.encode.runner.Assembler`. `assemble_documents` reads the items of all parts,
takes the documents in id order and writes each one once: its template with every image slot
replaced by that image's block. When an image or the template failed, every image of the document
gets a skip record instead -- a failed image its own reason, the others `document_image_failed`
(or the template's reason). The result depends only on the plan and the codes, never on which rank
encoded what, so the merged bytes are the same for every world size.

The items are indexed as NumPy columns (54 bytes an item, `_Index`), not kept as records: a record is
re-read from its part when a document needs it (its template once; its images' records only when it
is skipped), so 10^8 images take ~6-7 GB of memory.
"""

from __future__ import annotations

import json
from array import array
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import numpy as np

from mmtok.documents import DocumentBuilder, unpack_template
from mmtok.errors import MmtokError, Skip
from mmtok.formats import skips
from mmtok.formats.items import (
    IMAGE_KIND,
    LOCATION,
    TEMPLATE_KIND,
    ItemLocations,
    ItemRecords,
    column_arrays,
    image_skip,
    read_item_ids,
)
from mmtok.formats.megatron import DatasetWriter
from mmtok.formats.skips import SkipRecord

TEMPLATE, IMAGE = 0, 1  # `_Index.kind`: a document's template sorts before its images
# The index's own columns and their array typecodes; with where each item is (`LOCATION`), 46 bytes an item
# (+ 8 for `_Index.read`), whatever its record holds.
COLUMNS = {"kind": "b", "document": "q", "image_index": "i", "manifest_row": "q"}


@dataclass(frozen=True)
class _Index:
    """The items of every part as NumPy columns, one row an item. Sorted (see `_collect`) by document,
    kind, image_index: each document's template, then its images by index, are one contiguous slice.
    `offset`/`length` locate the item's ids in its part's item ids, `line` its record in the part (re-read
    for what the columns do not hold), `read` its position in read order (part by part, line by line).
    A template's image_index is 0 and its manifest_row -1."""
    kind: np.ndarray
    document: np.ndarray
    image_index: np.ndarray
    part: np.ndarray
    offset: np.ndarray
    length: np.ndarray
    has_skip: np.ndarray
    manifest_row: np.ndarray
    line: np.ndarray
    read: np.ndarray


@dataclass(frozen=True)
class Assembled:
    counts: dict[str, int]
    dataset: bool  # whether `prefix` holds a dataset (False: no document had a token)


def assemble_documents(part_dirs: list[Path], prefix: Path, provenance: IO, skipped: IO,
                       progress: bool = False) -> Assembled:
    """Write the multi-image documents of `part_dirs` to the dataset `prefix` (one sequence each, by
    document id), their provenance lines to `provenance` and skip records to `skipped`."""
    from mmtok.progress import progress as progress_bar

    index, ids = _collect(part_dirs)
    bounds, failed = _documents(index)
    records = [ItemRecords(directory) for directory in part_dirs]
    counts: Counter = Counter()
    writer = DatasetWriter(prefix)
    try:
        for number in progress_bar(range(bounds.size - 1), desc="merge: assemble documents", unit="doc",
                                   enabled=progress and bounds.size > 1):
            start, end = int(bounds[number]), int(bounds[number + 1])
            document = int(index.document[start])
            template = _template(document, index, start, end, records, part_dirs)
            if failed[number]:
                document_skips = _skips(index, start, end, template, records)
                counts.update(skips.count_key(s.reason) for s in document_skips)
                counts["documents_skipped"] += 1
                skips.append(skipped, document_skips)
                continue
            tokens = _assemble(index, start, end, template, ids)
            writer.add(tokens)
            provenance.write(_line({"document": document, "key": template["key"], "tar": template["tar"],
                                    "rows": index.manifest_row[start + 1:end].tolist()}))
            counts.update(images_written=end - start - 1, documents_written=1, tokens=int(tokens.size))
    except BaseException:
        writer.abort()
        raise
    finally:
        for part in records:
            part.close()
    return Assembled(dict(counts), writer.close())


def _collect(part_dirs: list[Path]) -> tuple[_Index, list[np.ndarray]]:
    """(the sorted index of the items of `part_dirs`, the item ids of each part). Refuses a second
    template or a second item for one image of a document, and an item of unknown kind -- whichever
    comes first in read order."""
    columns, ids, unknown = _read(part_dirs)
    order = np.lexsort((columns["image_index"], columns["kind"], columns["document"]))  # stable: ties keep read order
    index = _Index(**{name: columns.pop(name)[order] for name in [*COLUMNS, *LOCATION]}, read=order)  # one at a time
    _refuse_second_items(index, part_dirs)
    if unknown:
        directory, kind = unknown
        raise MmtokError(f"{directory}: item of unknown kind {kind}; written by another mmtok "
                         "version? re-encode into a fresh --out")
    return index, ids


def _read(part_dirs: list[Path]) -> tuple[dict[str, np.ndarray], list[np.ndarray], tuple[Path, str] | None]:
    """(the index's columns in read order, the item ids of each part, None) -- or, when a part holds an item
    of unknown kind, the columns of the items before it and (that part, the kind's repr) instead of None.
    Each record is parsed, its columns appended and the record dropped.

    This loop is about a third of the assembly's time, json.loads most of it (300k items: 1.25 s of
    3.9 s without fsync, 1.0 s parsing): a fixed-width binary index of these columns, written by
    `PartWriter.commit` beside items.jsonl, would make it one read per part."""
    columns = {name: array(code) for name, code in COLUMNS.items()}
    kinds, documents, image_indices, manifest_rows = (column.append for column in columns.values())
    locations, ids, unknown = ItemLocations(), [], None
    for number, directory in enumerate(part_dirs):
        for record in locations.read_part(number, directory):
            if unknown:
                locations.drop()
                continue  # the rest of the part is still parsed (a damaged line is refused first, as before)
            kind = record["kind"]
            if kind == TEMPLATE_KIND:
                kinds(TEMPLATE)
                image_indices(0)
                manifest_rows(-1)
            elif kind == IMAGE_KIND:
                kinds(IMAGE)
                image_indices(int(record["image_index"]))
                manifest_rows(int(record["manifest_row"]))
            else:
                unknown = directory, repr(kind)
                locations.drop()
                continue
            documents(int(record["document"]))
        ids.append(np.asarray(read_item_ids(directory, locations.end)))  # plain views slice faster than a memmap
        if unknown:
            break
    arrays = {**column_arrays(columns), **locations.columns()}
    arrays["has_skip"] = arrays["has_skip"].view(bool)
    return arrays, ids, unknown


def _refuse_second_items(index: _Index, part_dirs: list[Path]) -> None:
    """Parts of one run hold each template and each image once; the first repeat in read order is refused."""
    same = ((index.document[1:] == index.document[:-1]) & (index.kind[1:] == index.kind[:-1])
            & (index.image_index[1:] == index.image_index[:-1]))  # same[i]: row i + 1 repeats row i
    repeats = np.flatnonzero(same) + 1
    if not repeats.size:
        return
    second = int(repeats[np.argmin(index.read[repeats])])
    first = second - 1
    while first and same[first - 1]:
        first -= 1  # the first of the rows it repeats: the earliest read (the sort is stable)
    directory, earlier, document = part_dirs[index.part[second]], part_dirs[index.part[first]], index.document[second]
    if index.kind[second] == TEMPLATE:
        raise MmtokError(f"{directory}: document {document} has a second template item (the first is in {earlier}); "
                         "the parts come from different runs -- re-encode into a fresh --out")
    raise MmtokError(f"{directory}: document {document} has a second item for image {index.image_index[second]} "
                     f"(the first is in {earlier}); the parts come from different runs -- re-encode into a fresh --out")


def _documents(index: _Index) -> tuple[np.ndarray, np.ndarray]:
    """(where each document's rows in the sorted index start, then where the last ends; per document
    whether its template or one of its images failed)."""
    if not index.document.size:
        return np.zeros(1, np.intp), np.zeros(0, bool)
    starts = np.flatnonzero(np.concatenate(([True], index.document[1:] != index.document[:-1])))
    return np.append(starts, index.document.size), np.logical_or.reduceat(index.has_skip, starts)


def _template(document: int, index: _Index, start: int, end: int, records: list[ItemRecords],
              part_dirs: list[Path]) -> dict:
    """The template record of the document in rows start:end, which must hold it and exactly the images it counts."""
    if index.kind[start] != TEMPLATE:
        first = start + int(np.argmin(index.read[start:end]))
        raise MmtokError(f"document {document}: image items in {part_dirs[index.part[first]]} but no part holds its "
                         "template; the parts are incomplete or from different runs -- re-encode into a fresh --out")
    template = records[index.part[start]].at(int(index.line[start]))
    expected = template["num_images"]
    images = index.image_index[start + 1:end]  # sorted and distinct: they are 0..expected-1 when both ends are
    if images.size != expected or (expected and (images[0] != 0 or images[-1] != expected - 1)):
        raise MmtokError(f"document {document}: the parts hold images {images.tolist()} of its {expected}; "
                         "the parts are incomplete or from different runs -- re-encode into a fresh --out")
    return template


def _assemble(index: _Index, start: int, end: int, template: dict, ids: list[np.ndarray]) -> np.ndarray:
    """The tokens of the document in rows start:end: its template with each slot replaced by that image's block."""
    pieces = [ids[part][offset:offset + length] for part, offset, length in
              zip(index.part[start:end].tolist(), index.offset[start:end].tolist(), index.length[start:end].tolist(),
                  strict=True)]
    return DocumentBuilder.assemble(unpack_template(pieces[0], template["layout"]), dict(enumerate(pieces[1:])))


def _skips(index: _Index, start: int, end: int, template: dict,
           records: list[ItemRecords]) -> list[SkipRecord]:
    """A skip record for each image of the failed document in rows start:end, by image index."""
    items = [records[part].at(line) for part, line in
             zip(index.part[start + 1:end].tolist(), index.line[start + 1:end].tolist(), strict=True)]
    failed = {image: item for image, item in enumerate(items) if "skip" in item}
    return [image_skip(item, _why(image, failed, template), "merge") for image, item in enumerate(items)]


def _why(index: int, failed: dict[int, dict], template: dict) -> Skip:
    if index in failed:
        return Skip(failed[index]["skip"], failed[index].get("detail", ""))
    if failed:
        first = min(failed)
        cause = Skip(failed[first]["skip"], failed[first].get("detail", ""))
        return Skip("document_image_failed", f"image {first} of the document: {cause}")
    return Skip(template["skip"], template.get("detail", ""))


def _line(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
