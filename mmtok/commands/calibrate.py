"""`mmtok calibrate`: time the image codec on the target device and fit the plan's cost model."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmtok.commands.options import add_device_argument
from mmtok.commands.report import plural, print_json, print_summary
from mmtok.errors import MmtokError

if TYPE_CHECKING:  # calibration is imported when a calibration runs, not for `--help`
    from mmtok.plan.calibrate import Calibration, ErrorStats

DEFAULT_PRESET = "apertus-stage1"


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "calibrate", help="fit the plan's encoder cost model to timings of the codec on this device",
        description="Time the image codec on random images of a grid of target shapes and batch sizes (from a "
        "preset's pixel range or from a plan's batches), fit the plan's cost model count*(a*n + b*n^2 + c) + batch "
        "to the timings, report its per-batch error on the timed and on held-out shapes next to the model it "
        "replaces, and write a YAML file for `mmtok plan --cost-model FILE`. Run it on the GPU type that will "
        "encode (`mmtok calibrate --checkpoint DIR --out cost.yaml`).")
    parser.add_argument("--codec", help="a registered image codec: emu3.5 (default), emu3, or a plugin's "
                        "(docs/write-a-codec.md)")
    parser.add_argument("--checkpoint", required=True, metavar="DIR",
                        help="directory with the official checkpoint files")
    add_device_argument(parser)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--plan", metavar="PLAN", help="take the shapes from this plan: the most common ones by image "
                        "count plus the extremes of area and aspect ratio")
    source.add_argument("--preset", metavar="NAME", help=f"take the shapes from this preset's pixel range (default "
                        f"{DEFAULT_PRESET} when no --plan)")
    parser.add_argument("--max-shapes", type=int, default=12, help="target shapes to time at most (default 12)")
    parser.add_argument("--batch-sizes", default="1,4,16", help="comma-separated images per batch (default 1,4,16); "
                        "each shape's capacity in the plan/preset is timed too")
    parser.add_argument("--max-images", type=int, default=None, help="cap on images per timed batch (keeps CPU runs "
                        "short; default: the plan/preset capacity)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per batch, after one warm-up run; the "
                        "median is fitted (default 3)")
    parser.add_argument("--out", required=True, metavar="FILE.yaml", help="YAML file to write")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON on stdout")
    parser.add_argument("--no-progress", action="store_true", help="no progress line per timed batch")
    parser.set_defaults(func=run)


def batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes:
        raise MmtokError(f"--batch-sizes {text!r}: give comma-separated positive integers, e.g. 1,4,16")
    return sizes


def run(args) -> int:
    from mmtok.codecs.registry import DEFAULTS, load_codec
    from mmtok.formats.presets import write_calibration
    from mmtok.fsutil import refuse_out_overlapping
    from mmtok.launch import resolve_device
    from mmtok.plan.calibrate import calibrate, plan_grid, preset_grid

    refuse_out_overlapping(args.out, [args.plan, args.checkpoint])
    if args.max_shapes < 1:
        raise MmtokError(f"--max-shapes must be >= 1, got {args.max_shapes}")
    sizes = batch_sizes(args.batch_sizes)
    grid = plan_grid(args.plan, args.max_shapes) if args.plan else preset_grid(args.preset or DEFAULT_PRESET,
                                                                              args.max_shapes)
    device = resolve_device(args.device)
    codec = load_codec(args.codec or DEFAULTS["image"], args.checkpoint, device, modality="image")
    result = calibrate(codec, device, grid, batch_sizes=sizes, max_images=args.max_images, repeats=args.repeats,
                       progress=not args.no_progress)
    write_calibration(args.out, result.to_json())
    if args.json:
        print_json({"out": args.out, **result.to_json()})
    else:
        print_summary("calibrate", summary(result, args))
    return 0


def _errors(stats: ErrorStats | None) -> str:
    return f"{100 * stats.median:5.1f}% / {100 * stats.p95:5.1f}%" if stats else "    (none held out)"


def summary(result: Calibration, args) -> list[str]:
    """The model, its error next to the replaced model's, and the plan command that uses the file."""
    model, info, replaced = result.cost_model, result.identity, result.evaluation.replaced
    errors = result.evaluation.errors
    shapes = len({(t.height, t.width) for t in result.timings})
    # `mmtok plan` has no --plan flag: the plan's own command line is the one to extend
    after = f"re-run the `mmtok plan` that made {args.plan} with --cost-model {args.out} added" if args.plan else \
        f"mmtok plan MANIFEST --out PLAN --preset {args.preset or DEFAULT_PRESET} --cost-model {args.out}"
    return [
        f"{info['codec']} on {info['device']}: {plural(len(result.timings), 'batch', 'batches')} of "
        f"{plural(shapes, 'shape')} ({result.grid}) timed in {result.timing_seconds:.1f} s",
        f"cost = count*(a*n + b*n^2 + c) + batch, n = (h/{model.stride})*(w/{model.stride}), seconds: "
        f"a={model.a:.4g} b={model.b:.4g} c={model.c:.4g} batch={model.batch:.4g}",
        "per-batch error (median / p95)      timed shapes      held-out shapes",
        f"calibrated model                 {_errors(errors.fitted)}   {_errors(errors.held_out)}",
        f"replaced model (best scale)      {_errors(replaced.errors.fitted)}   "
        f"{_errors(replaced.errors.held_out)}   [{replaced.cost_model.source}]",
        f"wrote {args.out}; next: {after}",
    ]
