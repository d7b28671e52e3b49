"""Image items: what the image encode of a `--mode sft` plan (and of documents of several images) leaves
in a part's items (`mmtok.formats.commitlog`: items.ids / items.jsonl) for a later stage to assemble.

An image item is one image of a tar member: its record holds the sample's fields (key, source = the
tar, container, member, manifest_row, document, image_index) and, for an image that failed, `skip` and
`detail`; its ids are the image block (none when it failed). `image_item` writes one (`mmtok encode`);
`ImageIndex` finds them again by (tar, member) across the parts of an output (`mmtok sft`). A document
of several images also has a `template` item, which merge's assembly reads beside the images.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.errors import Skip
from mmtok.formats import commitlog

IMAGE_KIND = "image"
TEMPLATE_KIND = "template"


def image_item(sample: dict, failure: Skip | None, block: np.ndarray | None) -> tuple[dict, np.ndarray]:
    """The (record, ids) of one image for `PartWriter.commit(items=...)`: its block, or why it failed."""
    record = {"kind": IMAGE_KIND, **sample}
    if failure:
        record.update(skip=failure.reason, detail=failure.detail)
    return record, block if block is not None else np.zeros(0, np.int32)


@dataclass(frozen=True)
class ImageItem:
    part: int  # position of its part in the directories the index was built from
    offset: int  # into that part's item ids
    length: int
    skip: Skip | None  # why the image did not encode; None when it did


class ImageIndex:
    """The image items of the parts `directories`, by (tar, member); tars are compared by resolved path."""

    def __init__(self, directories: list[Path]):
        self._ids: list[np.ndarray] = []
        self._items: dict[tuple[str, str], ImageItem] = {}
        self._count: Counter = Counter()  # images per (tar, sample key)
        for number, directory in enumerate(directories):
            end = 0
            for _, record in commitlog.iter_items(directory):
                end = record["offset"] + record["length"]
                if record.get("kind") != IMAGE_KIND:
                    continue
                tar = _real(record["source"])
                skip = Skip(record["skip"], record.get("detail", "")) if "skip" in record else None
                self._items[(tar, record["member"])] = ImageItem(number, record["offset"], record["length"], skip)
                self._count[(tar, record["key"])] += 1
            self._ids.append(np.asarray(commitlog.read_item_ids(directory, end)))
        self._tars = {tar for tar, _ in self._count}
        self.tars = sorted(self._tars)  # resolved paths of the tars the images come from

    def images_of(self, tar: str, key: str) -> int:
        """How many images sample `key` of `tar` has."""
        return self._count[(_real(tar), key)]

    def holds_tar(self, tar: str) -> bool:
        return _real(tar) in self._tars

    def find(self, tar: str, member: str) -> ImageItem | None:
        return self._items.get((_real(tar), member))

    def ids(self, item: ImageItem) -> np.ndarray:
        """The image block of an item that encoded."""
        return self._ids[item.part][item.offset:item.offset + item.length]


@functools.lru_cache(maxsize=4096)
def _real(path: str) -> str:
    """The resolved path of a tar, once per path (it is asked for every image of every conversation)."""
    return os.path.realpath(path)
