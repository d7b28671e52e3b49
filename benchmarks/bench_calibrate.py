"""`mmtok calibrate` benchmark: does a cost model fitted to real codec timings predict batches it was
not fitted on, and how much better than the analytic default does it do?

    python benchmarks/bench_calibrate.py                       # CPU, mid-size Emu3.5, ~5-10 min on 2 cores
    python benchmarks/bench_calibrate.py --quick               # tiny codec, a smoke run of the same code
    python benchmarks/bench_calibrate.py --device cuda --config full --batch-sizes 1,4,16 --max-images 0 \
        --shapes 12 --repeats 3 --warmup 1 --clock wall

The codec is Emu3.5 with random weights (MID_CONFIG of bench_emu35.py: the published layout at half
width and half depth, full 131,072 x 256 codebook; `--config full` for the published size). The grid is
`mmtok.plan.calibrate.preset_grid` of apertus-stage1 (256²..512², square ends, aspect ratios up to 4 in
between), timed by `mmtok.plan.calibrate.time_cells` exactly as `mmtok calibrate` does. Every 3rd shape
(never the smallest or largest) is held out: the model is fitted on the others and its per-batch
relative error is measured on the held-out batches, next to the analytic default after its best
scale, and next to the same fit by absolute (instead of relative) least squares. Writes a Markdown
section to --out and the calibration YAML beside it.

On a CPU shared with other jobs wall time measures the other jobs as much as the codec, so the CPU
default is one torch thread timed by the process's CPU time (`--clock cpu`); `mmtok calibrate` itself
times wall seconds, which is what a dedicated GPU needs (`--clock wall`).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from mmtok.codecs import emu35
from mmtok.formats import presets
from mmtok.formats.presets import CostModel
from mmtok.plan import calibrate as cal

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_emu35 import MID_CONFIG  # noqa: E402

PRESET = "apertus-stage1"
CONFIGS = {"tiny": emu35.TINY_CONFIG, "mid": MID_CONFIG, "full": emu35.FULL_SIZE_CONFIG}
CLOCKS = {"cpu": "CPU seconds of the process (time.process_time)", "wall": "wall seconds (time.perf_counter)"}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def machine(device: torch.device) -> str:
    where = cal.device_name(device)
    return (f"{os.cpu_count()}-core {platform.machine()} {platform.system()}, {where} (torch {torch.__version__}, "
            f"Python {platform.python_version()}); load average at the end {os.getloadavg()[0]:.1f}")


def absolute_fit_errors(timings: list[cal.Timing], held: set) -> dict:
    """Errors of CostModel.fit by absolute least squares (what relative=True replaces), same split."""
    def fit(rows):
        h, w, k, s = (np.array([getattr(t, n) for t in rows]) for n in ("height", "width", "count", "seconds"))
        return CostModel.fit(h, w, k, s)

    train = [t for t in timings if (t.height, t.width) not in held]
    test = [t for t in timings if (t.height, t.width) in held]
    return cal.Errors(fitted=cal.error_stats(cal.relative_errors(fit(timings), timings)),
                      held_out=cal.error_stats(cal.relative_errors(fit(train), test)) if test else None)


def percent(stats: cal.ErrorStats | None, key: str) -> str:
    return f"{100 * getattr(stats, key):.1f}%" if stats else "n/a"


def report(result: cal.Calibration, absolute: cal.Errors, args, device: torch.device, seconds: float,
           config: dict) -> str:
    info, evaluation = result.identity, result.evaluation
    rows = [("calibrated (`mmtok calibrate`, relative least squares)", evaluation.errors),
            ("same fit by absolute least squares", absolute),
            ("analytic default (a=1, b=2e-5, c=64, batch=4096) x best scale", evaluation.replaced.errors)]
    held = ", ".join(f"{h}x{w}" for h, w in evaluation.held_out_shapes)
    shapes = sorted({(t.height, t.width) for t in result.timings}, key=lambda s: (s[0] * s[1], s))
    d = config["ddconfig"]
    lines = [
        "## Cost-model calibration (`benchmarks/bench_calibrate.py`)", "",
        f"Command: `{' '.join(['python', 'benchmarks/bench_calibrate.py', *sys.argv[1:]])}`  ",
        f"Machine: {machine(device)}.  ",
        f"Codec: Emu3.5, random weights, `{args.config}` config (ch {d['ch']}, {d['num_res_blocks']} ResNet blocks "
        f"per level, codebook {config['n_embed']:,} x {config['embed_dim']}), float32.  ",
        f"Grid: {len(shapes)} shapes of preset `{PRESET}` ({', '.join(f'{h}x{w}' for h, w in shapes)}); batch sizes "
        f"{sorted({t.count for t in result.timings})}; {len(result.timings)} timed batches, median of "
        f"{result.repeats} runs each after {result.warmup} warm-up run(s) per batch and one of the largest batch; "
        f"{seconds / 60:.1f} min of wall time. Clock: {info['clock']}. Held out: {held or 'none'} "
        f"({evaluation.errors.held_out.batches if evaluation.errors.held_out else 0} batches).", "",
        "Per-batch relative error |predicted/measured - 1| (held out: fitted without those shapes):", "",
        "| model | timed median | timed p95 | held-out median | held-out p95 | held-out max |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, errors in rows:
        lines.append(f"| {name} | {percent(errors.fitted, 'median')} | {percent(errors.fitted, 'p95')} | "
                     f"{percent(errors.held_out, 'median')} | {percent(errors.held_out, 'p95')} | "
                     f"{percent(errors.held_out, 'max')} |")
    model = result.cost_model
    counts = sorted({t.count for t in result.timings})
    lines += ["", f"Fitted model (seconds): a = {model.a:.4g} per latent position, b = {model.b:.4g} per "
              f"position pair, c = {model.c:.4g} per image, batch = {model.batch:.4g} per batch (stride "
              f"{model.stride}).", "", f"Timings (median {info['clock'].split(' (')[0]} per batch):", "",
              "| shape | " + " | ".join(f"{k} img" for k in counts) + " |",
              "|---|" + "---:|" * len(counts)]
    for h, w in shapes:
        cells = {t.count: t.seconds for t in result.timings if (t.height, t.width) == (h, w)}
        lines.append(f"| {h}x{w} | " + " | ".join(f"{cells[k]:.2f}" if k in cells else "" for k in counts) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="/tmp/results-calibrate.md", help="Markdown file to write")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="mid")
    parser.add_argument("--shapes", type=int, default=7, help="shapes of the preset's range")
    parser.add_argument("--batch-sizes", default="1", help="comma-separated; each shape's capped capacity is added")
    parser.add_argument("--max-images", type=int, default=2, help="cap on images per batch (0: the preset's capacity)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=0,
                        help="warm-up runs per batch (the largest batch always gets one)")
    parser.add_argument("--clock", choices=("cpu", "wall"), default="cpu",
                        help="cpu: the process's CPU seconds (a shared CPU; needs --device cpu), wall: wall seconds")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--quick", action="store_true", help="tiny codec, 5 shapes, 1 repeat: a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.config, args.shapes, args.repeats = "tiny", 5, 1
    device = torch.device(args.device)
    if args.clock == "cpu" and device.type != "cpu":
        parser.error("--clock cpu measures host CPU time: use --clock wall on a GPU")
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    config = CONFIGS[args.config]
    codec = emu35.random_codec(config).to(device).eval()
    codec.checkpoint_sha256 = f"random-{args.config}"  # no checkpoint file: the source line names the config
    grid = dataclasses.replace(cal.preset_grid(PRESET, args.shapes), replaced=CostModel())
    cells = cal.grid_cells(grid, [int(b) for b in args.batch_sizes.split(",")], args.max_images or None)
    log(f"bench_calibrate: {len(cells)} batches on {cal.device_name(device)}, {args.config} config")
    started = time.perf_counter()
    timings = cal.time_cells(codec, device, cells, args.repeats, args.warmup, clock=clock)
    seconds = time.perf_counter() - started
    identity = {**cal.codec_identity(codec, device), "clock": CLOCKS[args.clock]}
    result = cal.calibration_result(timings, grid, identity, repeats=args.repeats, warmup=args.warmup,
                                    timing_seconds=seconds)
    held = {tuple(s) for s in result.evaluation.held_out_shapes}
    text = report(result, absolute_fit_errors(timings, held), args, device, seconds, config)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    presets.write_calibration(out.with_suffix(".yaml"), result.to_json())
    print(text)
    log(f"wrote {out} and {out.with_suffix('.yaml')}")


if __name__ == "__main__":
    main()
