"""`mmtok plan --explain`: what a plan holds, in a few screens whatever its size."""

from __future__ import annotations

import os

import numpy as np

from mmtok.formats.plan import BATCHES_FILE, Plan, PlanMetadata
from mmtok.ranks import rank_costs


def explain_plan(plan_dir: str | os.PathLike, top_shapes: int = 20, rank_lines: int = 16) -> str:
    """Text report: inputs, drops by reason, padding-free token totals, batch shape histogram,
    per-rank cost (every rank up to `rank_lines` ranks, else a summary and the extremes)."""
    plan = Plan.open(plan_dir)
    meta = plan.meta
    batches = plan.table(BATCHES_FILE, columns=["num_images", "target_height", "target_width", "tokens", "cost"])
    columns = {name: batches.column(name).to_numpy() for name in batches.column_names}
    sections = [_header(plan_dir, meta), _dropped(meta), _tokens(meta), _batches(meta),
                _shape_histogram(columns, top_shapes), _ranks(meta, columns["cost"], rank_lines), _work_items(plan)]
    return "\n".join(line for section in sections for line in section)


def _header(plan_dir, meta: PlanMetadata) -> list[str]:
    p, t = meta.parameters, meta.totals
    return [
        f"plan {plan_dir}  (fingerprint {meta.fingerprint[:16]}, mmtok {meta.tool_version})",
        f"manifest {meta.manifest_dir}  (fingerprint {meta.manifest_fingerprint[:16]})",
        f"mode {p['mode']}, factor {p['factor']}, pixels [{p['min_pixels']:,}, {p['max_pixels']:,}], "
        f"budget {p['token_budget']:,} tokens / {p['max_batch_images']} images per batch, "
        f"window {p['window_rows']:,} rows, text tokenizer {p['text_tokenizer']}",
        f"rows: {t.manifest_rows:,} = {t.kept_images:,} kept + {t.dropped_images:,} dropped; "
        f"documents: {t.kept_documents:,} kept, {t.dropped_documents:,} dropped",
    ]


def _dropped(meta: PlanMetadata) -> list[str]:
    counts = sorted(meta.dropped_by_reason.items(), key=lambda item: (-item[1], item[0]))
    excluded = meta.exclude
    by_reason = meta.dropped_by_reason
    kinds = [(reason, text) for reason, text in (("duplicate", "keepers"), ("contaminated", "matched benchmark images"),
                                                 ("caption_flagged", "what the caption checks found"))
             if by_reason.get(reason) or reason == "duplicate"]
    why = (f"reason{'s' if len(kinds) > 1 else ''} {', '.join(r for r, _ in kinds)}; "
           f"{', '.join(t for _, t in kinds)}")
    listed = ([f"excluded: the duplicate list {excluded.directory} drops {excluded.rows:,} rows of source "
               f"{excluded.source!r} ({why} in dropped.parquet)"] if excluded else [])
    if not counts:
        return listed + ["dropped: none"]
    return listed + ["dropped by reason:"] + [f"  {reason:<28} {count:>14,}" for reason, count in counts]


def _tokens(meta: PlanMetadata) -> list[str]:
    t, exact = meta.totals, meta.exact

    def mark(is_exact: bool) -> str:
        return "exact" if is_exact else "lower bound: text counted by the encoder"

    return [
        "tokens (padding-free):",
        f"  image blocks   {t.image_tokens:>16,}  ({mark(exact.image_tokens)})",
        f"  caption text   {t.text_tokens:>16,}  ({'exact' if exact.text_tokens else 'not counted by the plan'})",
        f"  documents      {t.document_tokens:>16,}  ({mark(exact.document_tokens)})",
    ]


def _batches(meta: PlanMetadata) -> list[str]:
    fill, over = meta.batch_fill, meta.over_budget
    lines = [f"batches: {meta.num_batches:,} in {meta.num_windows:,} windows; "
             f"{fill.mean_images:.1f} images per batch, {100 * fill.full_fraction:.1f}% full, "
             f"mean fill {100 * fill.mean_fill:.1f}% of the token budget"]
    if over.images:
        shapes = ", ".join(f"{s.height}x{s.width} ({s.tokens:,} tokens, {s.images:,} images)"
                           for s in over.shapes[:5])
        lines.append(f"  {over.images:,} images above the budget, each alone in its batch: {shapes}")
    return lines


def _shape_histogram(columns: dict, top: int) -> list[str]:
    if not len(columns["cost"]):
        return ["batch shapes: none"]
    shapes, inverse = np.unique(np.stack([columns["target_height"], columns["target_width"]], axis=1), axis=0,
                                return_inverse=True)
    inverse = inverse.ravel()
    batches = np.bincount(inverse)
    images = np.bincount(inverse, weights=columns["num_images"]).astype(np.int64)
    tokens = np.bincount(inverse, weights=columns["tokens"]).astype(np.int64)
    order = np.argsort(-images, kind="stable")
    lines = [f"batch shapes ({len(shapes):,} distinct; top {min(top, len(shapes))} by images):",
             f"  {'height x width':>15} {'batches':>10} {'images':>12} {'tokens':>16} {'share':>7}"]
    for i in order[:top]:
        lines.append(f"  {shapes[i, 0]:>6} x {shapes[i, 1]:<6} {batches[i]:>10,} {images[i]:>12,} {tokens[i]:>16,} "
                     f"{100 * images[i] / images.sum():>6.2f}%")
    return lines


def _ranks(meta: PlanMetadata, cost: np.ndarray, rank_lines: int) -> list[str]:
    ranges = np.asarray(meta.rank_batches, np.int64).reshape(-1, 2)
    per_rank = rank_costs(cost, ranges)
    summary = meta.rank_cost
    lines = [f"rank cost (cost model): min {summary.min:.4g}, mean {summary.mean:.4g}, max {summary.max:.4g}; "
             f"imbalance max/mean-1 = {100 * meta.imbalance:.3f}%; idle ranks {summary.idle_ranks}"]
    balance = meta.balance
    lines.append(f"  balance target {100 * balance.target:.1f}%: "
                 + (f"NOT met -- {balance.limited_by}" if balance.limited_by else "met")
                 + (f"; {balance.split_batches:,} batches split at rank targets for {len(ranges)} ranks"
                    if balance.split_batches else ""))
    lines += _world_size_contract(meta)
    long = meta.long_documents
    lines.append(f"  documents over max_document_tokens ({long.limit:,}; 0 = no limit): {long.dropped:,} "
                 f"dropped; largest document {long.largest_tokens:,} tokens")
    if len(ranges) <= rank_lines:
        shown = np.arange(len(ranges))
    else:
        quantiles = np.percentile(per_rank, [0, 1, 50, 99, 100])
        lines.append("  quantiles p0/p1/p50/p99/p100: " + " / ".join(f"{q:.4g}" for q in quantiles))
        heavy = np.argsort(-per_rank, kind="stable")[:rank_lines // 2]
        light = np.argsort(per_rank, kind="stable")[:rank_lines // 2]
        shown = np.unique(np.concatenate([heavy, light]))
        lines.append(f"  the {len(heavy)} heaviest and {len(light)} lightest ranks:")
    lines.append(f"  {'rank':>6} {'batches [start, end)':>24} {'cost':>12} {'vs mean':>8}")
    mean = per_rank.mean() if len(per_rank) else 0.0
    for r in shown:
        share = f"{100 * (per_rank[r] / mean - 1):+.2f}%" if mean else "-"
        lines.append(f"  {r:>6} {f'[{ranges[r, 0]}, {ranges[r, 1]})':>24} {per_rank[r]:>12.4g} {share:>8}")
    return lines


def _work_items(plan: Plan, shown: int = 4) -> list[str]:
    """The plan's work items: how many, their size, the first and last few with their ids."""
    items = plan.meta.work_items
    if not items:
        return ["work items: none recorded (a plan of an older mmtok; re-run `mmtok plan`)"]
    ranges = plan.work_items()
    cost = items.cost
    seconds = plan.meta.parameters["cost_model"]["seconds_per_unit"]
    lines = [f"work items: {items.count:,} of about {items.item_seconds:g} s of GPU time each by the cost model "
             f"(target cost {items.target_cost:.4g}; min {cost.min:.4g} = {cost.min * seconds:.3g} s, max "
             f"{cost.max:.4g} = {cost.max * seconds:.3g} s); their number does not depend on the world size",
             f"  {'item':>6} {'id':<16} {'batches [start, end)':>24}"]
    picked = list(range(len(ranges))) if len(ranges) <= 2 * shown else [*range(shown), *range(len(ranges) - shown,
                                                                                                len(ranges))]
    for i in picked:
        if i == len(ranges) - shown and len(ranges) > 2 * shown:
            lines.append(f"  {'...':>6}")
        lines.append(f"  {i:>6} {plan.work_item_id(i):<16} {f'[{ranges[i, 0]}, {ranges[i, 1]})':>24}")
    return lines


def _world_size_contract(meta: PlanMetadata) -> list[str]:
    """What the merged bytes are identical across, for this plan: its own batch list, other world sizes."""
    split = meta.balance.split_batches
    lines = ["  world size: encoding this plan with any number of ranks gives the same merged bytes by construction",
             "    (ranks take contiguous ranges of this plan's batches; no batch changes)."]
    if meta.balance.fixed_batches:  # False in plans made before --fixed-batches
        return lines + ["    --fixed-batches: no batch was split, so a plan of the same manifest and parameters for",
                        "    any other world size has the same batches, and the same merged bytes on any device."]
    cause = (f"this plan split {split:,} batches at its {meta.world_size} rank targets" if split
             else "a plan for another world size may split batches at its rank targets")
    return lines + [f"    A plan made for another world size: {cause}; the merged bytes are still identical where",
                    "    the codecs are batch-invariant (an image's codes do not depend on its batch size or",
                    "    neighbours): on the CPU proven by tests/test_codecs_batch_invariance.py, on a GPU measured by",
                    "    benchmarks/gpu_check.sh, not promised across GPU kinds; --fixed-batches removes the",
                    "    dependence (docs/codecs.md#batch-invariance-codes-that-do-not-depend-on-the-batch)."]
