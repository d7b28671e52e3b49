"""`mmtok plan`: build deterministic shape-uniform GPU batches balanced across ranks."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmtok.commands.report import plural, print_summary
from mmtok.errors import MmtokError
from mmtok.formats.presets import MODES

if TYPE_CHECKING:  # the plan's types; pyarrow is imported when a plan is made
    from mmtok.formats.plan import PlanMetadata

# (flag, type, help) for every parameter a flag can override; dest = the PlanParameters field name
PARAMETER_FLAGS = (
    ("--text-tokenizer", str, "text tokenizer: `tekken`, a tokenizer.json or its directory"),
    ("--factor", int, "pixels per code of the image codec (16 Emu3.5, 8 Emu3)"),
    ("--min-source-pixels", int, "drop source images with fewer pixels"),
    ("--max-source-pixels", int, "drop source images with more pixels"),
    ("--max-aspect-ratio", float, "drop source images whose long/short side ratio is larger"),
    ("--min-pixels", int, "resize: smallest target area (upscale below)"),
    ("--max-pixels", int, "resize: largest target area (downscale above)"),
    ("--token-budget", int, "image-block tokens per batch"),
    ("--max-batch-images", int, "images per batch at most"),
    ("--window-rows", int, "manifest rows per window (snapped forward to a document boundary)"),
    ("--max-document-tokens", int, "drop documents whose image blocks + BOS/EOS exceed this many tokens (0: no limit)"),
    ("--cost-a", float, "cost model: per latent position"),
    ("--cost-b", float, "cost model: per latent position squared (attention)"),
    ("--cost-c", float, "cost model: per image"),
    ("--cost-batch", float, "cost model: per batch"),
    ("--cost-stride", int, "cost model: pixels per latent position at the attention resolution"),
    ("--cost-seconds-per-unit", float, "cost model: GPU seconds per cost unit (1 for a `mmtok calibrate` fit)"),
    ("--item-seconds", float, "target GPU time of one work item by the cost model (default 180)"),
)


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "plan", help="build deterministic shape-uniform GPU batches balanced across ranks",
        description="Plan a scanned manifest into shape-uniform batches under a token budget, numbered "
        "globally and split into contiguous cost-balanced rank ranges. `mmtok plan MANIFEST --out PLAN "
        "--preset apertus-stage1 --world-size 64`; `mmtok plan --explain PLAN` describes an existing plan.")
    parser.add_argument("source", help="manifest directory (from `mmtok scan`); with --explain and no --out: a plan")
    parser.add_argument("--out", "-o", help="plan directory to write")
    parser.add_argument("--preset", help="preset name (plans/NAME.yaml) or a YAML file; flags override it")
    parser.add_argument("--world-size", type=int, default=1,
                        help="number of encode ranks (default 1); on a cluster about 8 per GPU, run as a SLURM array "
                        "with a concurrency limit of the GPUs (docs/slurm.md)")
    parser.add_argument("--mode", choices=MODES, help="document layout the encoder will write")
    parser.add_argument("--cost-model", metavar="FILE", help="YAML with a `cost_model:` mapping (from `mmtok "
                        "calibrate --out`, or a preset): replaces the preset's cost model; --cost-* flags still apply")
    for flag, kind, text in PARAMETER_FLAGS:
        parser.add_argument(flag, type=kind, help=text)
    parser.add_argument("--fixed-batches", action="store_true",
                        help="never split a batch at a rank target: the batch list, and so every image's batch, is "
                        "the same for every --world-size (merged bytes then do not rely on the device's codes being "
                        "batch-invariant); costs balance only on corpora with few batches per rank")
    parser.add_argument("--exclude", metavar="DEDUP_DIR",
                        help="a duplicate list from `mmtok dedup`: its rows of this manifest are dropped (reason "
                        "`duplicate`, with the keeper in dropped.parquet; `contaminated`, with the benchmark image, "
                        "for a list made with --against; `caption_flagged`, with what the caption check found) and "
                        "never reach a GPU")
    parser.add_argument("--explain", action="store_true",
                        help="print the shape histogram, token totals, drops by reason and per-rank cost")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def parameters_from_args(args):
    """Preset (or the built-in defaults), then the --cost-model file, then every flag that was given.
    A --cost-* flag is recorded in the cost model's source."""
    import dataclasses

    from mmtok.formats.presets import CostModel, PlanParameters, load_preset

    base = load_preset(args.preset) if args.preset else PlanParameters()
    if args.cost_model:
        base = dataclasses.replace(base, cost_model=CostModel.from_file(args.cost_model))
    overrides = {flag[2:].replace("-", "_"): getattr(args, flag[2:].replace("-", "_"))
                 for flag, _, _ in PARAMETER_FLAGS}
    changed = [f"{name[5:]}={value}" for name, value in overrides.items()
               if name.startswith("cost_") and value is not None]
    if changed:
        overrides["cost_source"] = f"{base.cost_model.source}; overridden by flags: {', '.join(changed)}"
    return base.override(mode=args.mode, **overrides)


def run(args) -> int:
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.plan import build_plan
    from mmtok.tools.explain import explain_plan

    if args.out is None:
        if not args.explain:
            raise MmtokError("pass --out PLAN_DIR to write a plan (or --explain PLAN_DIR to describe one)")
        print(explain_plan(args.source))
        return 0
    refuse_out_overlapping(args.out, [args.source, args.cost_model, args.preset, args.text_tokenizer, args.exclude])
    meta = build_plan(args.source, parameters_from_args(args), args.out, world_size=args.world_size,
                      progress=not args.quiet, fixed_batches=args.fixed_batches, exclude=args.exclude)
    print_summary("plan", summary(meta, args.out))
    if args.explain:
        print(explain_plan(args.out))
    return 0


def summary(meta: PlanMetadata, out) -> list[str]:
    t = meta.totals
    over = meta.over_budget.images
    return [f"{plural(t.manifest_rows, 'row')} -> {plural(t.kept_images, 'image')} in "
            f"{plural(meta.num_batches, 'batch', 'batches')} ({t.dropped_images:,} dropped: "
            f"{', '.join(f'{k} {v:,}' for k, v in sorted(meta.dropped_by_reason.items())) or 'none'}); "
            f"{plural(t.image_tokens, 'image token')}; {plural(meta.world_size, 'rank')}, imbalance "
            f"{100 * meta.imbalance:.3f}%" + _items_part(meta)
            + (f"; {plural(over, 'image')} above the budget" if over else "")
            + f"; wrote {out}"] + _warnings(meta)


def _items_part(meta: PlanMetadata) -> str:
    """The work items encode takes, and the imbalance of the plan's ranks sharing them (they are not split)."""
    items = meta.work_items
    if not items:
        return ""
    return (f"; {plural(items.count, 'work item')} of ~{items.item_seconds:g} s (ranks sharing them: "
            f"imbalance {100 * items.imbalance:.3f}%)")


def _warnings(meta: PlanMetadata) -> list[str]:
    """Lines for what the user should know: balance above target (and why), documents over the limit."""
    lines = []
    balance, long = meta.balance, meta.long_documents
    if balance.limited_by:
        lines.append(f"warning: modeled imbalance {100 * meta.imbalance:.2f}% is above the "
                     f"{100 * balance.target:.1f}% target: {balance.limited_by}")
    excluded = meta.exclude
    if excluded and excluded.duplicates_without_kept_copy:
        reasons = ", ".join(f"{reason} {n:,}" for reason, n in excluded.keepers_dropped.items())
        lines.append(f"warning: {plural(excluded.duplicates_without_kept_copy, 'duplicate')} excluded by "
                     f"{excluded.directory} have their keeper in this manifest, and this plan drops "
                     f"{plural(sum(excluded.keepers_dropped.values()), 'keeper')} ({reasons}): no copy of those "
                     "images is kept; relax those filters or give `mmtok dedup` a policy that prefers other sources")
    if long.dropped:
        lines.append(f"warning: {plural(long.dropped, 'document')} dropped as document_too_long (over "
                     f"{plural(long.limit, 'token')}; the largest has {plural(long.largest_tokens, 'token')}); "
                     "raise --max-document-tokens (0: no limit) to keep them")
    return lines
