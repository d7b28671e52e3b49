"""Manifest -> plan: NumPy only, never per-row Python (seconds per hundred million rows).

1. `mmtok.plan.rows`: window bounds from one pass over the document column; then, group of windows
   by group of windows, read the manifest columns the plan needs, filter rows (each drop gets a
   reason), compute target shapes with `mmtok.media.resize.target_shapes`. Only about one group of
   rows is in memory at a time: the plan's memory grows with its batches, not with the manifest.
2. and 3. `mmtok.plan.batching`: windows snapped to document boundaries; inside each window,
   images sorted by exact shape and cut into batches under the token budget and max_batch_images.
   Batches are numbered in that order; the order of images depends only on the manifest and the
   parameters -- never on the world size.
4. here: rank ranges balance the cost model over the batch list (`mmtok.ranks`); plan.json last.
   When the batches are too few for the world size to balance within BALANCE_TARGET, the plan is
   made a second time with the batches that hold each rank's target cut split in two
   (`mmtok.ranks.balance_splits`); what still limits the balance is named in plan.json's `balance`.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np

from mmtok import __version__
from mmtok.errors import MmtokError
from mmtok.formats.dedup import DedupList, Exclusion
from mmtok.formats.manifest import Manifest
from mmtok.formats.plan import (
    SCAN_REASON,
    Balance,
    BatchFill,
    CostRange,
    Exactness,
    LongDocuments,
    OverBudget,
    OverBudgetShape,
    PlanExclusion,
    PlanMetadata,
    PlanTotals,
    PlanWriter,
    RankCost,
    WorkItems,
    has_plan,
)
from mmtok.formats.presets import PlanParameters
from mmtok.plan.batching import GroupPlan, GroupPlanner, window_groups
from mmtok.plan.captions import CAPTION_REASONS
from mmtok.plan.rows import EXCLUDED, Reasons, read_groups, text_tokenizer, window_bounds
from mmtok.ranks import balance_splits, imbalance, item_ranges, partition_ranks, rank_costs, worker_items
from mmtok.text import TextTokenizer

BALANCE_TARGET = 0.005  # modeled imbalance (max / mean rank cost - 1) the plan guarantees where the work allows
SPLIT_ABOVE = 0.001  # imbalance above which a second pass splits batches at the rank targets


# ----------------------------------------------------------------------------- 4. the whole plan


class _BatchLog:
    """The per-batch arrays the rank partition and the summary need (a few bytes per batch)."""

    KEYS = ("cost", "tokens", "num_images", "full", "target_height", "target_width")

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {k: [] for k in self.KEYS}

    def add(self, plan: GroupPlan) -> None:
        if plan.batches is not None:
            for key in self.KEYS:
                self.parts[key].append(plan.batches[key])

    def array(self, key: str, dtype) -> np.ndarray:
        return np.concatenate(self.parts[key]).astype(dtype) if self.parts[key] else np.zeros(0, dtype)


def build_plan(manifest_dir: str | os.PathLike, params: PlanParameters, out_dir: str | os.PathLike,
               world_size: int = 1, progress: bool = True, fixed_batches: bool = False,
               exclude: str | os.PathLike | None = None) -> PlanMetadata:
    """Plan `manifest_dir` into `out_dir`; returns what plan.json holds.

    Guarantees: deterministic (same manifest, parameters and world size -> byte-identical files);
    every manifest row is in exactly one of plan.parquet and dropped.parquet; every batch is one
    target shape and within the token budget unless it is a single image; image order (and so every
    document) does not depend on `world_size` -- only where batches are split for balance does, and
    with `fixed_batches` no batch is split, so the batch list does not depend on it either; the
    modeled imbalance is at most BALANCE_TARGET unless plan.json's `balance.limited_by` says why not.
    A plan that keeps no image is an MmtokError naming the drops and the flag to change: raised before
    anything is written when `out_dir` holds a plan (which stays as it was), else after the plan is written
    (so dropped.parquet and `--explain` can show the rows). `exclude`: a duplicate list (`mmtok dedup`) whose
    rows of this manifest are dropped as `duplicate`, each with its keeper in dropped.parquet (`contaminated`, with
    the benchmark image it matched, for a list made with `--against`; `caption_flagged`, with what its caption
    check found).
    """
    if world_size < 1:
        raise MmtokError(f"--world-size must be >= 1, got {world_size}")
    manifest = Manifest.open(Path(manifest_dir).resolve())
    exclusion = _exclusion(exclude, manifest)
    tokenizer = text_tokenizer(params.text_tokenizer)
    reasons = Reasons()
    bounds = window_bounds(manifest, params.window_rows, progress)
    meta, log = _plan_pass(manifest, params, tokenizer, bounds, reasons, out_dir, world_size, {}, progress,
                           fixed_batches, exclusion)
    if world_size > 1 and meta.imbalance > SPLIT_ABOVE and not fixed_batches:
        splits = _splits(log, params, world_size)
        if splits:  # the second pass reads and filters the manifest again: no per-row state is kept
            meta, _ = _plan_pass(manifest, params, tokenizer, bounds, reasons, out_dir, world_size, splits, progress,
                                 fixed_batches, exclusion)
    _refuse_empty(meta, Path(out_dir), written=True)
    return meta


def _exclusion(exclude, manifest: Manifest) -> tuple[PlanExclusion, Exclusion] | None:
    """(what plan.json records of it, less its keeper counts; the rows) of the duplicate list `exclude`, or None."""
    if exclude is None:
        return None
    listed = DedupList.open(exclude)
    rows = listed.exclusion(manifest.fingerprint, manifest.num_rows)
    record = PlanExclusion(directory=str(Path(exclude).resolve()), fingerprint=listed.metadata.fingerprint,
                           source=rows.source, rows=len(rows.rows))
    return record, rows


class _LostKeepers:
    """Keepers of this manifest that the plan drops for a reason of its own (too small, a document member
    dropped...): their excluded duplicates then have no copy kept, which the summary warns about."""

    def __init__(self, exclusion: Exclusion):
        self.exclusion = exclusion
        self.own = exclusion.own_keeper_rows()
        self.rows: list[np.ndarray] = []
        self.by_reason: dict[str, int] = {}

    def add(self, plan: GroupPlan, reasons: Reasons) -> None:
        other = ~np.isin(plan.dropped_codes, reasons.registered(*EXCLUDED))
        hit = np.isin(plan.dropped_rows, self.own) & other
        self.rows.append(plan.dropped_rows[hit])
        for code in plan.dropped_codes[hit].tolist():
            self.by_reason[reasons.names[code]] = self.by_reason.get(reasons.names[code], 0) + 1

    def record(self, listed: PlanExclusion) -> PlanExclusion:
        """`listed` with the keepers the plan dropped, by reason, and the duplicates left without a kept copy."""
        rows = np.concatenate(self.rows) if self.rows else np.zeros(0, np.int64)
        return replace(listed, keepers_dropped=dict(sorted(self.by_reason.items())),
                       duplicates_without_kept_copy=self.exclusion.without_kept_copy(rows))


def _plan_pass(manifest: Manifest, params: PlanParameters, tokenizer: TextTokenizer, bounds: np.ndarray,
               reasons: Reasons, out_dir, world_size: int, splits: dict[int, list[int]],
               progress: bool, fixed_batches: bool, exclusion) -> tuple[PlanMetadata, _BatchLog]:
    """Read, filter and plan every group and write the plan files; returns plan.json's content and the
    batch log."""
    from mmtok.progress import progress as progress_bar

    groups = window_groups(bounds)
    group_rows = read_groups(manifest, params, reasons, bounds[groups],
                             (exclusion[1].rows, exclusion[1].kinds()) if exclusion else None)
    lost = _LostKeepers(exclusion[1]) if exclusion else None
    planner = None
    log = _BatchLog()
    dropped: dict[int, int] = {}  # reason code -> rows
    documents = {"kept": 0, "total": 0, "image_tokens": 0, "text_tokens": 0, "tokens": 0}
    desc = "plan: batches" + (" (split for balance)" if splits else "")
    with PlanWriter(out_dir) as writer, \
            progress_bar(total=int(bounds[-1]), desc=desc, unit="row", unit_scale=True, enabled=progress) as bar:
        for g, rows in enumerate(group_rows):
            if planner is None:  # made here: the caption containers are named as rows are read
                planner = GroupPlanner(params, reasons, tokenizer, rows.containers, manifest.text_column, splits)
            w0, w1 = int(groups[g]), int(groups[g + 1])
            plan = planner.plan(rows, bounds[w0:w1], w0)
            _write_group(writer, plan, reasons, exclusion[1] if exclusion else None)
            if lost is not None:
                lost.add(plan, reasons)
            log.add(plan)
            _add_document_totals(documents, plan)
            for code, count in enumerate(np.bincount(plan.dropped_codes).tolist()):
                dropped[code] = dropped.get(code, 0) + count
            bar.update(len(rows))
        if planner is not None:
            planner.close()
        meta = _metadata(manifest, params, tokenizer, int(bounds[-1]), dropped, reasons, log, documents,
                         n_windows=len(bounds) - 1, world_size=world_size, fixed_batches=fixed_batches,
                         split_batches=sum(len(v) for v in splits.values()),
                         long_documents=LongDocuments(limit=params.max_document_tokens,
                                                      dropped=planner.long_documents if planner else 0,
                                                      largest_tokens=planner.largest_document if planner else 0),
                         exclude=lost.record(exclusion[0]) if exclusion else None)
        if has_plan(out_dir):
            _refuse_empty(meta, Path(out_dir), written=False)  # a plan of no image must not replace the last plan
        return writer.finish(meta), log


def _splits(log: _BatchLog, params: PlanParameters, world_size: int) -> dict[int, list[int]]:
    """Balance splits for the batches of a first pass: batch -> image positions."""
    found: dict[int, list[int]] = {}
    for batch, at in balance_splits(log.array("cost", np.float64), log.array("num_images", np.int64),
                                    params.cost_model.batch, world_size):
        found.setdefault(batch, []).append(at)
    return found


# The change that lets rows dropped for a reason through; the parameter whose value it quotes.
_DROP_FIXES = {
    "too_few_pixels": ("lower --min-source-pixels", "min_source_pixels"),
    "too_many_pixels": ("raise --max-source-pixels", "max_source_pixels"),
    "aspect_ratio": ("raise --max-aspect-ratio", "max_aspect_ratio"),
    "target_too_large": ("lower --max-pixels", "max_pixels"),
    "document_too_long": ("raise --max-document-tokens (0: no limit)", "max_document_tokens"),
}


def _drop_fix(reason: str, parameters: dict) -> str | None:
    """What to change for rows dropped with `reason`; None for a reason that follows from another."""
    if reason in _DROP_FIXES:
        change, name = _DROP_FIXES[reason]
        return f"{change} (now {parameters[name]:,})"
    if reason.startswith(SCAN_REASON) or reason == "unknown_dimensions":
        return "the scan found no usable image in those rows: fix the inputs and rerun `mmtok scan`"
    if reason in CAPTION_REASONS:
        return "fix the captions, or plan with --mode image (no captions needed)"
    return None


def _refuse_empty(meta: PlanMetadata, out_dir: Path, written: bool) -> None:
    """MmtokError when the plan keeps no image: how many rows, dropped why, where to see them (the plan just
    `written`, else nowhere: the earlier plan in `out_dir` is kept), and what to change."""
    totals = meta.totals
    if totals.kept_images:
        return
    if not totals.manifest_rows:
        raise MmtokError(f"{meta.manifest_dir} has no rows, so the plan holds no image; rerun `mmtok scan` on "
                         "shards that contain images")
    counts = sorted(meta.dropped_by_reason.items(), key=lambda item: (-item[1], item[0]))
    fixes = dict.fromkeys(fix for fix in (_drop_fix(reason, meta.parameters) for reason, _ in counts) if fix)
    raise MmtokError(f"all {totals.manifest_rows:,} manifest rows were dropped "
                     f"({', '.join(f'{reason} {count:,}' for reason, count in counts)}), so the plan holds no image "
                     + (f"-- see {out_dir / 'dropped.parquet'} or `mmtok plan --explain {out_dir}`" if written else
                        f"-- nothing written, the earlier plan in {out_dir} is kept")
                     + "".join(f"; {fix}" for fix in fixes))


def _write_group(writer: PlanWriter, plan: GroupPlan, reasons: Reasons, exclusion: Exclusion | None) -> None:
    if len(plan.dropped_rows):
        keeper = np.full(len(plan.dropped_rows), None, object)
        if exclusion is not None:
            listed = np.isin(plan.dropped_codes, reasons.registered(*EXCLUDED))
            # a contaminated row: its benchmark image; a caption-flagged row: what its caption check found
            keeper[listed] = exclusion.keepers_of(plan.dropped_rows[listed])
        writer.write_dropped(plan.dropped_rows, plan.dropped_codes, reasons.names, keeper)
    if plan.images is not None:
        writer.write_images(plan.images)
        writer.write_batches(plan.batches)
    if plan.documents is not None:
        writer.write_documents(plan.documents)


def _add_document_totals(totals: dict, plan: GroupPlan) -> None:
    totals["total"] += plan.documents_total
    totals["kept"] += plan.documents_kept
    totals["text_tokens"] += plan.text_tokens
    totals["tokens"] += plan.document_tokens
    if plan.batches is not None:
        totals["image_tokens"] += int(plan.batches["tokens"].sum())


def _over_budget(log: _BatchLog, over: np.ndarray, limit: int = 20) -> OverBudget:
    """Images above the token budget (each alone in its batch): count and the largest shapes."""
    height = log.array("target_height", np.int64)[over]
    width = log.array("target_width", np.int64)[over]
    tokens = log.array("tokens", np.int64)[over]
    shapes, first, count = np.unique(np.stack([height, width], axis=1), axis=0, return_index=True, return_counts=True)
    largest = np.argsort(-tokens[first], kind="stable")[:limit]
    return OverBudget(images=int(over.sum()),
                      shapes=[OverBudgetShape(height=int(shapes[i, 0]), width=int(shapes[i, 1]),
                                              tokens=int(tokens[first[i]]), images=int(count[i])) for i in largest])


def rank_summary(costs: np.ndarray, world_size: int) -> tuple[np.ndarray, RankCost, float]:
    """Rank ranges, their modeled costs and the modeled imbalance for one world size."""
    ranges = partition_ranks(costs, world_size)
    per_rank = rank_costs(costs, ranges)
    return (ranges, RankCost(min=float(per_rank.min()), mean=float(per_rank.mean()), max=float(per_rank.max()),
                             idle_ranks=int(np.sum(ranges[:, 0] == ranges[:, 1]))), imbalance(per_rank))


def cut_work_items(costs: np.ndarray, params: PlanParameters, world_size: int) -> WorkItems:
    """The plan's work items (`mmtok.ranks.item_ranges`): batch ranges of about `item_seconds` of GPU time each
    by the cost model, their number independent of any world size; `imbalance`: the modeled imbalance of
    `world_size` workers sharing them statically (`mmtok.ranks.worker_items`: items are not split, so it is
    coarser than the batch-level rank ranges')."""
    target = params.item_seconds / params.cost_model.seconds_per_unit
    ranges = item_ranges(costs, target)
    cost = rank_costs(costs, ranges) if len(ranges) else np.zeros(0)
    shared = rank_costs(cost, worker_items(cost, world_size)) if len(ranges) else np.zeros(world_size)
    return WorkItems(item_seconds=params.item_seconds, target_cost=target, count=len(ranges),
                     cost=CostRange(min=float(cost.min()) if len(cost) else 0.0,
                                    max=float(cost.max()) if len(cost) else 0.0),
                     imbalance=imbalance(shared), batches=ranges.tolist())


def balance_limit(rank_cost: RankCost, modeled: float, costs: np.ndarray, counts: np.ndarray, overhead: float,
                  world_size: int, fixed_batches: bool = False) -> str | None:
    """Why the `modeled` imbalance is above BALANCE_TARGET (None when it is not): the cause and the figure."""
    if modeled <= BALANCE_TARGET:
        return None
    images = int(counts.sum())
    if images < world_size:
        return (f"{images:,} images for {world_size:,} ranks: {rank_cost.idle_ranks:,} ranks have no "
                "work -- plan for fewer ranks")
    mean = rank_cost.mean
    if fixed_batches:
        return (f"--fixed-batches: no batch is split at a rank target (so the batch list does not depend on "
                f"--world-size), and the largest batch costs {100 * float(costs.max()) / mean:.1f}% of a rank's mean "
                "cost -- plan for fewer ranks, or without --fixed-batches where the device is batch-invariant")
    largest = float(np.max((costs - overhead) / np.maximum(counts, 1) + overhead)) if len(costs) else 0.0
    return (f"the smallest piece of a batch (the per-batch overhead of the cost model, {overhead:g}, plus one image) "
            f"costs up to {100 * largest / mean:.1f}% of a rank's mean cost ({images / world_size:,.1f} images per "
            "rank), so cuts cannot get closer to their targets -- plan for fewer ranks, or fit the cost model to "
            "your GPU (`mmtok calibrate`: its per-batch overhead may be smaller than the analytic default's)")


def _metadata(manifest: Manifest, params: PlanParameters, tokenizer: TextTokenizer, n_rows: int,
              dropped: dict[int, int], reasons: Reasons, log: _BatchLog, documents: dict, n_windows: int,
              world_size: int, fixed_batches: bool, split_batches: int, long_documents: LongDocuments,
              exclude: PlanExclusion | None) -> PlanMetadata:
    costs = log.array("cost", np.float64)
    tokens, count = log.array("tokens", np.int64), log.array("num_images", np.int64)
    ranges, rank_cost, modeled = rank_summary(costs, world_size)
    over = tokens > params.token_budget
    kept_images = int(count.sum())
    return PlanMetadata(
        tool_version=__version__,
        manifest_dir=str(manifest.directory),
        manifest_fingerprint=manifest.fingerprint,
        parameters={**params.to_dict(), "text_tokenizer_sha256": tokenizer.fingerprint,
                    "text_vocab_size": tokenizer.vocab_size},
        world_size=world_size,
        rank_batches=ranges.tolist(), rank_cost=rank_cost, imbalance=modeled,
        balance=Balance(target=BALANCE_TARGET, fixed_batches=fixed_batches,
                        limited_by=balance_limit(rank_cost, modeled, costs, count, params.cost_model.batch, world_size,
                                                 fixed_batches),
                        split_batches=split_batches),
        num_batches=len(costs),
        num_windows=n_windows,
        work_items=cut_work_items(costs, params, world_size),
        totals=PlanTotals(
            manifest_rows=n_rows, kept_images=kept_images, dropped_images=n_rows - kept_images,
            documents=documents["total"], kept_documents=documents["kept"],
            dropped_documents=documents["total"] - documents["kept"],
            image_tokens=documents["image_tokens"], text_tokens=documents["text_tokens"],
            document_tokens=documents["tokens"], cost=float(costs.sum())),
        exact=Exactness(image_tokens=True, text_tokens=params.document_totals_exact,
                        document_tokens=params.document_totals_exact,
                        note="sft/interleaved: document text is counted by the encoder; document_tokens "
                             "there are BOS + image blocks + EOS only"),
        dropped_by_reason={reasons.names[i]: dropped[i] for i in sorted(dropped) if i and dropped[i]},
        over_budget=_over_budget(log, over),
        batch_fill=BatchFill(
            full_fraction=float(log.array("full", bool).mean()) if len(costs) else 0.0,
            mean_fill=float(np.minimum(tokens / params.token_budget, 1).mean()) if len(costs) else 0.0,
            mean_images=float(count.mean()) if len(costs) else 0.0),
        long_documents=long_documents,
        exclude=exclude,
    )
