"""Image items: what the image encode of a `--mode sft` plan (and of documents of several images) leaves
in a part's items (`mmtok.formats.commitlog`: items.ids / items.jsonl) for a later stage to assemble.

An image item is one image of a tar member: its record holds the sample's fields (key, source = the
tar, container, member, manifest_row, document, image_index), the `digest` of the bytes it was decoded
from (`media_digest`; absent when they could not be read) and, for an image that failed, `skip` and
`detail`; its ids are the image block (none when it failed). `image_item` writes one (`mmtok encode`);
`read_items`, `iter_items` and `ItemRecords` read a part's items back (merge's assembly, tests);
`ItemLocations` is the one loop that indexes them (where each item is) for `ImageIndex`, which finds them again
by (tar, member) across the parts of an output (`mmtok sft`), and for merge's assembly (`mmtok.merge.assemble`).
A document of several images also has a `template` item, which merge's assembly reads beside the images.

Items are bound to their tar as the scan saw it: each image part's identity holds `part_containers`, the
scan's identity of every tar of the part (`mmtok.formats.manifest.container_identity`); `ImageIndex.stale`
says whether a tar changed since, so no item lends its tokens to other bytes at the same path.
"""

from __future__ import annotations

import functools
import hashlib
import mmap
import os
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from mmtok.errors import MmtokError, Skip
from mmtok.formats import commitlog, kept, partdir
from mmtok.formats.keys import KeyTable, key_digest
from mmtok.formats.manifest import identity_change, stale_detail
from mmtok.formats.megatron import TOKEN_DTYPE
from mmtok.formats.skips import SkipRecord
from mmtok.fsutil import random_access

IMAGE_KIND = "image"
TEMPLATE_KIND = "template"


CONTAINERS = "part_containers"  # the part identity key: tar path -> the scan's identity of it


def media_digest(data: bytes) -> str:
    """The digest an image item records of the bytes it was decoded from (blake2b, 128 bits, hex)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


DIGEST_BYTES = 16  # of media_digest


def _digest_bytes(digest) -> bytes:
    """A recorded media_digest as its 16 bytes; zeros where there is none (or it is not one)."""
    try:
        raw = bytes.fromhex(digest) if isinstance(digest, str) else b""
    except ValueError:
        raw = b""
    return raw if len(raw) == DIGEST_BYTES else bytes(DIGEST_BYTES)


def image_item(sample: dict, failure: Skip | None, block: np.ndarray | None,
               digest: str | None = None) -> tuple[dict, np.ndarray]:
    """The (record, ids) of one image for `PartWriter.commit(items=...)`: its block, or why it failed."""
    record = {"kind": IMAGE_KIND, **sample}
    if digest is not None:
        record["digest"] = digest
    if failure:
        record.update(skip=failure.reason, detail=failure.detail)
    return record, block if block is not None else np.zeros(0, np.int32)


# Reading a part's items (items.jsonl, items.ids: `commitlog.PartWriter` commits them with each unit)


def read_items(directory: str | os.PathLike) -> tuple[list[dict], np.ndarray]:
    """(item records, each with its `offset` into the ids, in commit order; the ids, memory-mapped)."""
    records = [record for _, record in iter_items(directory)]
    return records, read_item_ids(directory, records[-1]["offset"] + records[-1]["length"] if records else 0)


def iter_items(directory: str | os.PathLike) -> Iterator[tuple[int, dict]]:
    """(position, record) of each item of a part in commit order, one at a time: the record with its
    `offset` into the ids, and the position of its line for `ItemRecords.at` (re-reading it later)."""
    path = Path(directory) / partdir.ITEMS
    if not path.is_file():
        return
    offset = position = 0
    with open(path, "rb") as handle:
        for line in handle:
            record = commitlog.item_record(line)
            record["offset"] = offset
            offset += record["length"]
            yield position, record
            position += len(line)


def read_item_ids(directory: str | os.PathLike, count: int) -> np.ndarray:
    """The ids of a part's items, memory-mapped; `count` is where the last item's ids end (0: none)."""
    if not count:
        return np.zeros(0, TOKEN_DTYPE)
    return np.memmap(Path(directory) / partdir.ITEM_IDS, dtype=TOKEN_DTYPE, mode="r")


# Where an item is -- its part, its ids in that part's items.ids, its record's line -- and whether it failed:
# the columns every index of items keeps (`ImageIndex`; merge's assembly), as array typecodes (25 bytes an item).
LOCATION = {"part": "i", "offset": "q", "length": "i", "has_skip": "B", "line": "q"}


class ItemLocations:
    """Reads the items of parts one part at a time (`read_part`) and keeps where each one is (`LOCATION`), in read
    order, unless its reader `drop`s it: the one loop over items.jsonl of every index of items. A record is parsed,
    its reader takes what it needs, and it is dropped: an index of 10^8 items holds columns, not records."""

    def __init__(self):
        self._columns = {name: array(code) for name, code in LOCATION.items()}
        self.end = 0  # where the ids of the part read last end (0: it has no item)

    def read_part(self, number: int, directory: str | os.PathLike) -> Iterator[dict]:
        """Each item record of part `number` (at `directory`), in commit order, with its `offset` into the ids;
        its location is kept unless the reader calls `drop` (once) before asking for the next. Read to its end,
        it leaves `end`: where the part's item ids end."""
        parts, offsets, lengths, has_skip, lines = (column.append for column in self._columns.values())
        self.end = 0
        for line, record in iter_items(directory):  # (appended here, not by a call per item: the loop is hot)
            offset, length = record["offset"], record["length"]
            self.end = offset + length
            parts(number)
            offsets(offset)
            lengths(length)
            has_skip("skip" in record)
            lines(line)
            yield record

    def drop(self) -> None:
        """Forget the location of the record `read_part` gave last (one its reader does not index); called twice
        for one record, it would forget another's."""
        for column in self._columns.values():
            column.pop()

    def columns(self) -> dict[str, np.ndarray]:
        """The `LOCATION` columns of the items kept, as NumPy arrays."""
        return column_arrays(self._columns)


def column_arrays(columns: dict[str, array]) -> dict[str, np.ndarray]:
    """Columns read into `array`s (compact while they grow) as NumPy arrays: views of them, no copy."""
    return {name: np.frombuffer(column, column.typecode) if column else np.zeros(0, column.typecode)
            for name, column in columns.items()}


class ItemRecords:
    """A part's item records by the positions `iter_items` gave (memory-mapped; opened on the first `at`)."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / partdir.ITEMS
        self._map = None

    def at(self, position: int) -> dict:
        """The record whose line starts at `position` (without the `offset` `iter_items` adds)."""
        if self._map is None:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        self._map.seek(position)
        return commitlog.item_record(self._map.readline())

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None


def image_skip(item: dict, skip: Skip, stage: str) -> SkipRecord:
    """The skip record of the image an image item (of items.jsonl) describes."""
    return SkipRecord.of(skip, stage=stage, key=item["key"], source=item["source"], container=item["container"],
                         member=item["member"], position=int(item["manifest_row"]))


@dataclass(frozen=True)
class ImageItem:
    part: int  # position of its part in the directories the index was built from
    offset: int  # into that part's item ids
    length: int
    skip: Skip | None  # why the image did not encode; None when it did
    digest: str | None = None  # media_digest of the bytes it was decoded from (None: the encode recorded none)


class ImageIndex:
    """The image items of the parts `directories`, by (tar, member); tars are compared by resolved path.

    Kept as NumPy columns, 57 bytes an item (its media digest included) and 20 a sample (`nbytes`), not as
    records: an item's key is the digest of its tar and member (`mmtok.formats.keys`), and the record of an image
    that failed is re-read from its part when its skip is asked for. Of two items of one member the later (in
    part, then line order) is kept."""

    def __init__(self, directories: list[Path], restored: dict | None = None):
        """Built from the parts' items.jsonl (one json record an item), or from a kept index (see `cached`)."""
        self._records = [ItemRecords(directory) for directory in directories]
        if restored is not None:
            self._restore(directories, restored)
            return
        self._ids: list[np.ndarray] = []
        self._containers: dict[str, dict] = {}  # resolved tar path -> the scan's identity of it
        self._stale: dict[str, str | None] = {}
        members, samples, digests, self._tars = bytearray(), bytearray(), bytearray(), set()
        locations = ItemLocations()
        for number, directory in enumerate(directories):
            self._containers.update({_real(tar): identity for tar, identity in part_containers(directory).items()})
            for record in locations.read_part(number, directory):
                if record.get("kind") != IMAGE_KIND:
                    locations.drop()
                    continue
                tar = _real(record["source"])
                self._tars.add(tar)
                members += key_digest(f"{tar}\0{record['member']}")
                digests += _digest_bytes(record.get("digest"))
                samples += key_digest(f"{tar}\0{record['key']}")
            self._ids.append(_item_ids(directory, locations.end))
        self._ends = [int(ids.size) for ids in self._ids]
        self._members, chosen = KeyTable.of(members, keep="last")
        self._columns = {name: column[chosen] for name, column in locations.columns().items()}
        self._digests = np.frombuffer(bytes(digests), np.uint8).reshape(-1, DIGEST_BYTES)[chosen]
        self._samples = KeyTable.of(samples, count=True)[0]  # its counts: images per (tar, sample key)
        self.tars = sorted(self._tars)  # resolved paths of the tars the images come from

    # -- kept between the ranks of one `mmtok sft` output: built once, memory-mapped by every other rank ----------
    @classmethod
    def cached(cls, directories: list[Path], folder: Path) -> ImageIndex:
        """The index of the parts `directories`, from `folder` when a rank kept it there for these very part files
        (`mmtok.formats.kept`: their paths, sizes, mtimes and inodes; each array the file its writer recorded),
        else built and kept there. The arrays are memory-mapped, so a rank reads the pages of the items it looks
        up, not the index of every item of the corpus.

        The rank that builds it first checks every part against its checksums (`commitlog.verify_part`), and the
        index records the part files as they were before that check (`commitlog.part_verified_files`): a rank that
        finds it for the same files relies on that check instead of reading every part's bytes again, so what a
        rank reads does not grow with the corpus. A part file changed since makes the index be built (and the
        parts checked) again."""
        def check() -> None:
            for directory in directories:
                commitlog.verify_part(directory)

        inputs = [file for directory in directories for file in commitlog.part_verified_files(directory)]
        arrays, fields = kept.load_or_keep(folder, inputs, KEPT_FORMAT, check, lambda: cls(directories)._kept())
        return cls(directories, {"arrays": arrays, **fields})

    def _kept(self) -> tuple[dict[str, np.ndarray], dict]:
        """(arrays, fields) that `_restore` makes this index of again."""
        samples_high, samples_low = self._samples.halves()
        members_high, members_low = self._members.halves()
        arrays = {"members_high": members_high, "members_low": members_low, "samples_high": samples_high,
                  "samples_low": samples_low, "samples_counts": self._samples.counts, "digests": self._digests,
                  **{f"column_{name}": column for name, column in self._columns.items()}}
        return arrays, {"ends": self._ends, "tars": self.tars, "containers": self._containers}

    def _restore(self, directories: list[Path], restored: dict) -> None:
        arrays = restored["arrays"]
        self._ends = restored["ends"]
        self._ids = [_item_ids(directory, end) for directory, end in zip(directories, self._ends, strict=True)]
        self._containers, self._stale, self._tars = restored["containers"], {}, set(restored["tars"])
        self._members = KeyTable(arrays["members_high"], arrays["members_low"], None)
        self._samples = KeyTable(arrays["samples_high"], arrays["samples_low"], arrays["samples_counts"])
        self._columns = {name: arrays[f"column_{name}"] for name in LOCATION}
        self._digests = arrays["digests"]
        self.tars = sorted(self._tars)

    @property
    def nbytes(self) -> int:
        """Bytes the index keeps for its items and samples (the item ids are memory-mapped, not counted)."""
        return (self._members.nbytes + sum(column.nbytes for column in self._columns.values()) + self._samples.nbytes
                + self._digests.nbytes)

    def images_of(self, tar: str, key: str) -> int:
        """How many images sample `key` of `tar` has."""
        found = self._samples.find(f"{_real(tar)}\0{key}")
        return 0 if found < 0 else int(self._samples.counts[found])

    def holds_tar(self, tar: str) -> bool:
        return _real(tar) in self._tars

    def stale(self, tar: str) -> str | None:
        """Why the items of `tar` no longer belong to the file at that path (a `stale_media` detail), or None;
        the file is looked at once per index."""
        real = _real(tar)
        if real not in self._stale:
            recorded = self._containers.get(real)
            change = None if recorded is None else identity_change(real, recorded)
            self._stale[real] = None if change is None else stale_detail(tar, change)
        return self._stale[real]

    def find(self, tar: str, member: str) -> ImageItem | None:
        found = self._members.find(f"{_real(tar)}\0{member}")
        if found < 0:
            return None
        part, offset, length, failed, line = (int(self._columns[name][found]) for name in LOCATION)
        skip = None
        if failed:
            record = self._records[part].at(line)
            skip = Skip(record["skip"], record.get("detail", ""))
        digest = self._digests[found].tobytes()
        return ImageItem(part, offset, length, skip, digest.hex() if any(digest) else None)

    def ids(self, item: ImageItem) -> np.ndarray:
        """The image block of an item that encoded."""
        return self._ids[item.part][item.offset:item.offset + item.length]


KEPT_FORMAT = "mmtok-image-index/2"
KEPT_DIR = "image-index"  # `mmtok sft` OUT/image-index/: the index one rank built, for the others


def _item_ids(directory: Path, end: int) -> np.ndarray:
    """A part's item ids (memory-mapped), refused when its records need more than the file holds."""
    ids = np.asarray(random_access(read_item_ids(directory, end)))  # sft looks a few blocks up in it
    if end > ids.size:  # records that point past the ids: never lend a cut block
        raise MmtokError(f"{directory / partdir.ITEMS}: its records need {end} ids but "
                         f"{directory / partdir.ITEM_IDS} holds {ids.size}; the part is damaged -- "
                         f"delete {directory} and re-encode this part")
    return ids


def part_containers(directory: Path) -> dict[str, dict]:
    """The scan's identity of every tar an image part's items come from; refused for a part that predates them."""
    identity = partdir.read_identity(directory)
    if CONTAINERS not in identity:
        raise MmtokError(f"{directory / partdir.IDENTITY}: this image part records no identity of its tars (made by "
                         "an older mmtok), so its items cannot be bound to their bytes; re-run `mmtok scan`, "
                         "`mmtok plan` and `mmtok encode`")
    return identity[CONTAINERS]


def refuse_changed_containers(identities: list[dict]) -> None:
    """MmtokError naming the first tar recorded in image part `identities` whose file changed since its scan
    (`mmtok merge`: the part's tokens and provenance would name other bytes); a tar that is gone is not refused."""
    for identity in identities:
        for tar, recorded in sorted(identity.get(CONTAINERS, {}).items()):
            change = identity_change(tar, recorded)
            if change is not None:
                raise MmtokError(stale_detail(tar, change))


@functools.lru_cache(maxsize=4096)
def _real(path: str) -> str:
    """The resolved path of a tar, once per path (it is asked for every image of every conversation)."""
    return os.path.realpath(path)
