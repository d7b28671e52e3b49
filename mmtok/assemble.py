"""Documents of several images, assembled in one ordered CPU pass from the items of every part.

Encode commits each image of such a document as an *image item* (its block, or why it failed) on
whichever rank encoded it, and the document's text template as a *template item* (on the rank of its
first image); see `mmtok.encode.runner.Assembler`. `assemble_documents` reads the items of all parts,
takes the documents in id order and writes each one once: its template with every image slot
replaced by that image's block. When an image or the template failed, every image of the document
gets a skip record instead -- a failed image its own reason, the others `document_image_failed`
(or the template's reason). The result depends only on the plan and the codes, never on which rank
encoded what, so the merged bytes are the same for every world size.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import numpy as np

from mmtok.encode.documents import DocumentBuilder, unpack_template
from mmtok.errors import MmtokError, Skip
from mmtok.formats import commitlog
from mmtok.formats.megatron import DatasetWriter


@dataclass
class _Document:
    template: tuple[int, dict] | None = None  # (part, template item)
    images: dict[int, tuple[int, dict]] = field(default_factory=dict)  # image_index -> (part, image item)


@dataclass(frozen=True)
class Assembled:
    counts: dict[str, int]
    dataset: bool  # whether `prefix` holds a dataset (False: no document had a token)


def assemble_documents(part_dirs: list[Path], prefix: Path, provenance: IO, skipped: IO,
                       progress: bool = False) -> Assembled:
    """Write the multi-image documents of `part_dirs` to the dataset `prefix` (one sequence each, by
    document id), their provenance lines to `provenance` and skip records to `skipped`."""
    from mmtok.progress import progress as progress_bar

    documents, ids = _collect(part_dirs)
    counts: Counter = Counter()
    writer = DatasetWriter(prefix)
    try:
        for document in progress_bar(sorted(documents), desc="merge: assemble documents", unit="doc",
                                     enabled=progress and bool(documents)):
            entry = documents[document]
            _check_complete(document, entry, part_dirs)
            tokens, skips = _assemble(entry, ids)
            if skips:
                counts.update(f"skipped:{s['reason']}" for s in skips)
                counts["documents_skipped"] += 1
                skipped.write(b"".join(_line(s) for s in skips))
                continue
            writer.add(tokens)
            provenance.write(_line(_provenance(document, entry)))
            counts.update(images_written=len(entry.images), documents_written=1, tokens=int(tokens.size))
    except BaseException:
        writer.abort()
        raise
    return Assembled(dict(counts), writer.close())


def _collect(part_dirs: list[Path]) -> tuple[dict[int, _Document], list[np.ndarray]]:
    documents: dict[int, _Document] = {}
    ids = []
    for number, directory in enumerate(part_dirs):
        records, part_ids = commitlog.read_items(directory)
        ids.append(part_ids)
        for record in records:
            entry = documents.setdefault(int(record["document"]), _Document())
            if record["kind"] == "template":
                if entry.template is not None:
                    raise MmtokError(f"{directory}: document {record['document']} has a second template item "
                                     f"(the first is in {part_dirs[entry.template[0]]}); the parts come from "
                                     "different runs -- re-encode into a fresh --out")
                entry.template = (number, record)
            elif record["kind"] == "image":
                index = int(record["image_index"])
                if index in entry.images:
                    raise MmtokError(f"{directory}: document {record['document']} has a second item for image {index} "
                                     f"(the first is in {part_dirs[entry.images[index][0]]}); the parts come from "
                                     "different runs -- re-encode into a fresh --out")
                entry.images[index] = (number, record)
            else:
                raise MmtokError(f"{directory}: item of unknown kind {record['kind']!r}; written by another mmtok "
                                 "version? re-encode into a fresh --out")
    return documents, ids


def _check_complete(document: int, entry: _Document, part_dirs: list[Path]) -> None:
    """Every document has its template and exactly the images the template counts."""
    if entry.template is None:
        part = part_dirs[next(iter(entry.images.values()))[0]]
        raise MmtokError(f"document {document}: image items in {part} but no part holds its template; the parts "
                         "are incomplete or from different runs -- re-encode into a fresh --out")
    expected = entry.template[1]["num_images"]
    if sorted(entry.images) != list(range(expected)):
        raise MmtokError(f"document {document}: the parts hold images {sorted(entry.images)} of its {expected}; "
                         "the parts are incomplete or from different runs -- re-encode into a fresh --out")


def _item_ids(ids: list[np.ndarray], part: int, record: dict) -> np.ndarray:
    return np.asarray(ids[part][record["offset"]:record["offset"] + record["length"]])


def _assemble(entry: _Document, ids: list[np.ndarray]) -> tuple[np.ndarray | None, list[dict]]:
    """(the document's tokens, []) or (None, a skip record per image)."""
    part, template = entry.template
    failed = {index: item for index, (_, item) in entry.images.items() if "skip" in item}
    if failed or "skip" in template:
        return None, [_skip_record(item, _why(index, failed, template))
                      for index, (_, item) in sorted(entry.images.items())]
    blocks = {index: _item_ids(ids, p, item) for index, (p, item) in entry.images.items()}
    return DocumentBuilder.assemble(unpack_template(_item_ids(ids, part, template), template["layout"]), blocks), []


def _why(index: int, failed: dict[int, dict], template: dict) -> Skip:
    if index in failed:
        return Skip(failed[index]["skip"], failed[index].get("detail", ""))
    if failed:
        first = min(failed)
        cause = Skip(failed[first]["skip"], failed[first].get("detail", ""))
        return Skip("document_image_failed", f"image {first} of the document: {cause}")
    return Skip(template["skip"], template.get("detail", ""))


def _skip_record(item: dict, skip: Skip) -> dict:
    fields = ("key", "source", "container", "member", "manifest_row", "document", "image_index")
    return {**{k: item[k] for k in fields}, "reason": skip.reason, "detail": skip.detail}


def _provenance(document: int, entry: _Document) -> dict:
    template = entry.template[1]
    return {"document": document, "key": template["key"], "tar": template["tar"],
            "rows": [item["manifest_row"] for _, (_, item) in sorted(entry.images.items())]}


def _line(record: dict) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode() + b"\n"
