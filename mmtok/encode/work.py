"""What one part encodes: a work item of the plan (a batch range), joined with the manifest columns it needs.

Everything is NumPy arrays over the rank's plan rows (plan order: batch, then position in batch), so
the loaders and the writer index them without per-row Python objects. A document's template (its
text) is built with the batch that holds its first image (image_index 0: a kept document always has
it, documents are dropped whole).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.manifest import identity_change, stale_detail
from mmtok.formats.plan import Plan, PlanMetadata

PLAN_COLUMNS = ["manifest_row", "batch", "target_height", "target_width", "tokens", "document", "image_index",
                "document_images"]
MANIFEST_COLUMNS = ("key", "document", "image_index", "tar", "container", "member", "offset", "size", "width",
                    "height", "text_offset", "text_size", "json_offset", "json_size")


@dataclass
class ItemWork:
    """One work item of a plan (`Plan.work_items`), encoded into its own part. Row arrays are aligned with the
    item's plan rows."""

    plan_meta: PlanMetadata
    item: int  # its index: the part's number
    num_items: int  # the plan's work items: the job's number of parts
    batch_range: tuple[int, int]  # [start, end) global batch ids
    batch_starts: np.ndarray  # row offset of batch start+i (length n_batches + 1)
    rows: dict[str, np.ndarray]  # plan columns + manifest columns, one entry per image
    text_column: str | None  # captions of Parquet/Arrow inputs: the scan's text column
    containers: dict[str, dict]  # the scan's identity of each container of the rank (its part identity)
    stale: dict[str, str]  # containers changed since the scan -> why: their images are `stale_media`, unread

    @property
    def mode(self) -> str:
        return self.plan_meta.parameters["mode"]

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

    def template_rows(self, batch: int) -> np.ndarray:
        """Rows of `batch` whose document's template is built with it (the documents' first images)."""
        rows = self.batch_rows(batch)
        return rows.start + np.flatnonzero(self.rows["image_index"][rows] == 0)

    def images_before(self, batch: int) -> int:
        """Planned images of this item in batches before `batch` (progress after a resume)."""
        return int(self.batch_starts[min(max(batch - self.batch_range[0], 0), self.num_batches)])


def load_item_work(plan: Plan, item: int) -> ItemWork:
    """Read the plan rows of work item `item` and the manifest columns the loaders need."""
    items = plan.work_items()
    start, end = (int(x) for x in items[item])
    table = plan.batch_rows(start, end, columns=PLAN_COLUMNS)
    rows = {name: table.column(name).to_numpy() for name in PLAN_COLUMNS}
    if np.any(np.diff(rows["batch"]) < 0):
        raise MmtokError(f"{plan.directory}: plan rows are not sorted by batch; re-run `mmtok plan`")
    manifest = plan.manifest()
    rows.update(manifest.read_rows(rows["manifest_row"], MANIFEST_COLUMNS))
    batch_starts = np.searchsorted(rows["batch"], np.arange(start, end + 1)).astype(np.int64)
    containers = manifest.identities(sorted(set(rows["tar"])))
    return ItemWork(plan_meta=plan.meta, item=item, num_items=len(items), batch_range=(start, end),
                    batch_starts=batch_starts, rows=rows, text_column=manifest.text_column, containers=containers,
                    stale=stale_containers(containers))


def stale_containers(containers: dict[str, dict]) -> dict[str, str]:
    """The containers whose bytes are no longer those the scan saw -> the `stale_media` detail."""
    changes = {path: identity_change(path, recorded) for path, recorded in containers.items()}
    return {path: stale_detail(path, change) for path, change in changes.items() if change}
