"""What one rank encodes: its batch range of the plan, joined with the manifest columns it needs.

Everything is NumPy arrays over the rank's plan rows (plan order: batch, then position in batch) and
over its documents, so the loaders and the writer index them without per-row Python objects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.encode.reader import read_manifest_rows
from mmtok.errors import MmtokError
from mmtok.formats import plan as plan_format
from mmtok.formats.manifest import read_manifest_metadata

PLAN_COLUMNS = ["manifest_row", "batch", "target_height", "target_width", "tokens", "document", "image_index"]


@dataclass
class RankWork:
    """A rank's share of a plan. Row arrays are aligned with the rank's plan rows."""

    plan_meta: dict
    rank: int
    world_size: int
    batch_range: tuple[int, int]  # [start, end) global batch ids
    rederived: bool  # True when the ranges were re-derived for a world size the plan was not made for
    batch_starts: np.ndarray  # row offset of batch start+i (length n_batches + 1)
    rows: dict[str, np.ndarray]  # plan columns + manifest columns, one entry per image
    documents: np.ndarray  # sorted unique document ids of the rank
    doc_images: np.ndarray  # planned images per document
    doc_last_batch: np.ndarray  # the batch that completes each document
    doc_row: np.ndarray  # a row of each document (its first in plan order): key, tar and sidecars
    text_column: str | None  # captions of Parquet/Arrow inputs: the scan's text column

    def __post_init__(self) -> None:
        self._by_last = np.argsort(self.doc_last_batch, kind="stable")  # ties stay in document-id order
        self._last_sorted = self.doc_last_batch[self._by_last]
        self._rows_by_doc = np.lexsort((self.rows["image_index"], self.rows["document"]))
        self._doc_starts = np.concatenate([[0], np.cumsum(self.doc_images)])

    @property
    def mode(self) -> str:
        return self.plan_meta["parameters"]["mode"]

    @property
    def num_batches(self) -> int:
        return self.batch_range[1] - self.batch_range[0]

    @property
    def num_images(self) -> int:
        return int(self.batch_starts[-1])

    def batch_rows(self, batch: int) -> slice:
        """Rows of global batch `batch`."""
        i = batch - self.batch_range[0]
        return slice(int(self.batch_starts[i]), int(self.batch_starts[i + 1]))

    def completing(self, batch: int) -> np.ndarray:
        """Positions (in `documents`) of the documents whose last image is in `batch`, by document id."""
        lo, hi = np.searchsorted(self._last_sorted, [batch, batch + 1])
        return self._by_last[lo:hi]

    def doc_position(self, document: int) -> int:
        return int(np.searchsorted(self.documents, document))

    def document_rows(self, position: int) -> np.ndarray:
        """Rows of the document at `position` in `documents`, in image order."""
        return self._rows_by_doc[self._doc_starts[position] : self._doc_starts[position + 1]]

    def images_before(self, batch: int) -> int:
        """Planned images of this rank in batches before `batch` (progress after a resume)."""
        return int(self.batch_starts[min(max(batch - self.batch_range[0], 0), self.num_batches)])


def rank_batches(plan_dir: Path, meta: dict, rank: int, world_size: int) -> tuple[tuple[int, int], bool]:
    """([start, end) of `rank`, re-derived?). The plan's own ranges when `world_size` matches it;
    otherwise the same cost-balanced partition (mmtok.plan.partition_ranks) for `world_size`."""
    if not 0 <= rank < world_size:
        raise MmtokError(f"rank {rank} is outside 0..{world_size - 1} (world size {world_size})")
    if world_size == meta["world_size"]:
        return plan_format.rank_range(meta, rank), False
    from mmtok.plan import partition_ranks

    costs = plan_format.read_table(plan_dir, plan_format.BATCHES_FILE, ["cost"]).column(0).to_numpy()
    docs = plan_format.read_table(plan_dir, plan_format.DOCUMENTS_FILE, ["first_batch", "last_batch"])
    first, last = docs.column(0).to_numpy(), docs.column(1).to_numpy()
    blocked = np.zeros(len(costs) + 2, np.int64)  # cut j is blocked when first < j <= last for some document
    spans = first < last
    np.add.at(blocked, first[spans] + 1, 1)
    np.add.at(blocked, last[spans] + 1, -1)
    cut_ok = np.cumsum(blocked)[: len(costs) + 1] == 0
    start, end = partition_ranks(costs, cut_ok, world_size)[rank]
    return (int(start), int(end)), True


def load_rank_work(plan_dir: str | os.PathLike, rank: int, world_size: int) -> RankWork:
    """Read the plan rows of `rank`'s batches and the manifest columns the loaders need."""
    import pyarrow.parquet as pq

    plan_dir = Path(plan_dir)
    meta = plan_format.read_meta(plan_dir)
    (start, end), rederived = rank_batches(plan_dir, meta, rank, world_size)
    # Row-group statistics on `batch` (the sort key) let this read only the rank's row groups.
    table = pq.read_table(plan_dir / plan_format.IMAGES_FILE, columns=PLAN_COLUMNS,
                          filters=[("batch", ">=", start), ("batch", "<", end)], use_threads=False)
    rows = {name: table.column(name).to_numpy() for name in PLAN_COLUMNS}
    if np.any(np.diff(rows["batch"]) < 0):
        raise MmtokError(f"{plan_dir}: plan rows are not sorted by batch; re-run `mmtok plan`")
    manifest_meta = read_manifest_metadata(meta["manifest_dir"])
    recorded = manifest_meta["fingerprint"]
    if recorded != meta["manifest_fingerprint"]:
        raise MmtokError(f"the manifest in {meta['manifest_dir']} was rewritten after planning (fingerprint "
                         f"{recorded[:12]}... != plan's {meta['manifest_fingerprint'][:12]}...); re-run `mmtok plan`")
    rows.update(read_manifest_rows(meta["manifest_dir"], rows["manifest_row"]))
    batch_starts = np.searchsorted(rows["batch"], np.arange(start, end + 1)).astype(np.int64)
    documents, first_row, doc_images = np.unique(rows["document"], return_index=True, return_counts=True)
    doc_last_batch = np.zeros(len(documents), np.int64)
    np.maximum.at(doc_last_batch, np.searchsorted(documents, rows["document"]), rows["batch"])
    return RankWork(plan_meta=meta, rank=rank, world_size=world_size, batch_range=(start, end),
                    rederived=rederived, batch_starts=batch_starts, rows=rows, documents=documents,
                    doc_images=doc_images, doc_last_batch=doc_last_batch, doc_row=first_row,
                    text_column=(manifest_meta.get("options") or {}).get("text_column"))
