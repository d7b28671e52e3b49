"""Fit the plan's encoder cost model (`mmtok.formats.presets.CostModel`) to timings of the real image codec.

A calibration is four steps, each a function here:
  grid      `preset_grid` / `plan_grid`: target shapes (as the plan's resize rule makes them) and the
            batch capacity of each; `grid_cells` adds the batch sizes -> (height, width, count) cells
  time      `time_cells`: the codec on random uint8 images of every cell, warm-up excluded, the
            median of `repeats` runs, the device synchronised around each run
  evaluate  `evaluate`: the fit (`CostModel.fit`, relative least squares) and its per-batch relative
            error on the timed batches and on held-out shapes, next to the model it replaces
  write     `mmtok.formats.presets.write_calibration` (beside its reader): YAML with a top-level
            `cost_model:` (what `mmtok plan --cost-model` reads) and a `calibration:` mapping holding the
            timing table and the errors

Everything after `time_cells` is a pure function of the timing table.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.errors import MmtokError
from mmtok.formats.presets import CostModel, PlanParameters, load_preset

DEFAULT_BATCH_SIZES = (1, 4, 16)
DEFAULT_MAX_SHAPES = 12
DEFAULT_REPEATS = 3
DEFAULT_WARMUP = 1
HOLDOUT_EVERY = 3  # every 3rd shape (in area order, never the smallest or the largest) is held out
# Width/height ratios given to the preset spread between its square end points, clipped to the
# preset's max_aspect_ratio: the extremes first, so even a short grid has both orientations.
ASPECTS = (4.0, 1 / 4, 4 / 3, 3 / 4, 2.0, 1 / 2, 16 / 9, 9 / 16, 1.0)


@dataclass(frozen=True)
class Grid:
    """Target shapes to time (sorted by area, then height, width) with the plan's batch capacity of each."""

    origin: str  # "preset NAME" or "plan DIR"
    shapes: tuple[tuple[int, int], ...]
    capacity: tuple[int, ...]
    factor: int  # pixels per code the shapes are multiples of
    replaced: CostModel  # the model a calibration replaces (the preset's or the plan's)


@dataclass(frozen=True)
class Timing:
    """One timed cell: `count` images of height x width; `seconds` is the median of `runs`."""

    height: int
    width: int
    count: int
    seconds: float
    runs: tuple[float, ...]

    def key(self) -> tuple:
        return (self.height, self.width, self.count, self.seconds)


def _area_order(shapes: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    return tuple(sorted(set(shapes), key=lambda s: (s[0] * s[1], s[0], s[1])))


# ----------------------------------------------------------------------------------------------- grid


def spread_shapes(params: PlanParameters, count: int) -> tuple[tuple[int, int], ...]:
    """Up to `count` distinct target shapes of the preset's resize rule: areas log-spaced over
    [min_pixels, max_pixels], square at both ends, the aspect ratios of ASPECTS in between."""
    from mmtok.media.resize import target_shapes

    limit = params.max_aspect_ratio or max(ASPECTS)
    aspect = np.array([1.0 if i in (0, count - 1) else ASPECTS[(i - 1) % len(ASPECTS)] for i in range(count)])
    aspect = np.clip(aspect, 1 / limit, limit)
    area = np.geomspace(params.min_pixels, params.max_pixels, count)
    height, width = target_shapes(np.sqrt(area / aspect), np.sqrt(area * aspect), min_pixels=params.min_pixels,
                                  max_pixels=params.max_pixels, factor=params.factor)
    return _area_order(zip(height.tolist(), width.tolist(), strict=True))


def preset_grid(preset: str, max_shapes: int = DEFAULT_MAX_SHAPES) -> Grid:
    """`spread_shapes` of a preset, with the batch capacity the plan gives each shape under it."""
    from mmtok.plan.rows import SHAPE_BITS, ShapeTable, text_tokenizer

    params = load_preset(preset)
    shapes = spread_shapes(params, max_shapes)
    packed = np.array([(h // params.factor) << SHAPE_BITS | (w // params.factor) for h, w in shapes], np.uint32)
    table = ShapeTable.build(packed, params, text_tokenizer(params.text_tokenizer))
    return Grid(origin=f"preset {preset}", shapes=shapes, capacity=tuple(table.capacity.tolist()),
                factor=params.factor, replaced=params.cost_model)


def pick_shapes(height: np.ndarray, width: np.ndarray, images: np.ndarray, max_shapes: int) -> list[int]:
    """Indices of at most `max_shapes` shapes: the smallest and largest area, the widest and the
    tallest, then the most images; ties go to the first index."""
    area, ratio = height * width, width / height
    extremes = [int(np.argmin(area)), int(np.argmax(area)), int(np.argmax(ratio)), int(np.argmin(ratio))]
    common = np.lexsort((np.arange(len(images)), -images)).tolist()
    return list(dict.fromkeys(extremes + common))[:max_shapes]


def plan_grid(plan_dir: str | os.PathLike, max_shapes: int = DEFAULT_MAX_SHAPES) -> Grid:
    """`pick_shapes` of a plan's batches; a shape's capacity is its largest batch in the plan."""
    from mmtok.formats.plan import BATCHES_FILE, META_FILE, Plan

    plan = Plan.open(plan_dir)
    batches = plan.table(BATCHES_FILE, ["target_height", "target_width", "num_images"])
    h, w, n = (batches.column(i).to_numpy().astype(np.int64) for i in range(3))
    if not len(n):
        raise MmtokError(f"plan {plan_dir} has no batches to calibrate on; use --preset NAME instead")
    keys, inverse = np.unique(h << 32 | w, return_inverse=True)
    images = np.bincount(inverse, weights=n)
    capacity = np.zeros(len(keys), np.int64)
    np.maximum.at(capacity, inverse, n)
    uh, uw = keys >> 32, keys & 0xFFFFFFFF
    chosen = pick_shapes(uh, uw, images, max_shapes)
    cap = {(int(uh[i]), int(uw[i])): int(capacity[i]) for i in chosen}
    shapes = _area_order(cap)
    parameters = plan.meta.parameters
    replaced = CostModel.from_mapping({"source": f"cost_model of plan {plan_dir}", **parameters["cost_model"]},
                                      str(Path(plan_dir) / META_FILE))
    return Grid(origin=f"plan {plan_dir}", shapes=shapes, capacity=tuple(cap[s] for s in shapes),
                factor=int(parameters["factor"]), replaced=replaced)


def grid_cells(grid: Grid, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
               max_images: int | None = None) -> list[tuple[int, int, int]]:
    """(height, width, count) cells sorted: per shape the batch sizes up to its capacity (capped at
    `max_images`) and that capacity itself."""
    if any(b < 1 for b in batch_sizes) or (max_images is not None and max_images < 1):
        raise MmtokError(f"batch sizes and --max-images must be >= 1, got {list(batch_sizes)} and {max_images}")
    cells = []
    for (height, width), capacity in zip(grid.shapes, grid.capacity, strict=True):
        limit = min(capacity, max_images) if max_images else capacity
        cells += [(height, width, count) for count in sorted({b for b in batch_sizes if b <= limit} | {limit})]
    return sorted(cells)


# ---------------------------------------------------------------------------------------------- timing


def device_name(device) -> str:
    """'cuda NVIDIA H200' or 'cpu (N threads)'."""
    import torch

    if device.type == "cuda":
        return f"cuda {torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads()
    return f"{device.type} ({threads} thread{'s' if threads > 1 else ''})"


def _synchronize(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def random_pixels(height: int, width: int, count: int, device):
    """uint8 [count, height, width, 3] random images on `device` (copied from pinned memory on CUDA,
    as the encoder's loader does), the same for the same cell."""
    import torch

    generator = torch.Generator().manual_seed(height * 1_000_003 + width * 1_009 + count)
    pixels = torch.randint(0, 256, (count, height, width, 3), dtype=torch.uint8, generator=generator)
    if device.type == "cuda":
        pixels = pixels.pin_memory().to(device, non_blocking=True)
        _synchronize(device)
    return pixels


def time_cell(codec, device, height: int, width: int, count: int, repeats: int = DEFAULT_REPEATS,
              warmup: int = DEFAULT_WARMUP, clock: Callable[[], float] = time.perf_counter) -> Timing:
    """Seconds of `codec.encode` on one cell by `clock` (wall time; `time.process_time` suits a shared
    CPU): `warmup` runs discarded, the median of `repeats`; on CUDA the clock is read only after the
    device finished (synchronize before start and stop)."""
    import torch

    pixels = random_pixels(height, width, count, device)
    runs = []
    try:
        with torch.inference_mode():
            for index in range(warmup + repeats):
                _synchronize(device)
                started = clock()
                codec.encode(pixels)
                _synchronize(device)
                if index >= warmup:
                    runs.append(clock() - started)
    except torch.cuda.OutOfMemoryError:
        raise MmtokError(f"{count} images of {height}x{width} do not fit in {device_name(device)} memory; pass "
                         f"--max-images below {count} (the plan's token_budget must then shrink too)") from None
    return Timing(height, width, count, float(np.median(runs)), tuple(runs))


def time_cells(codec, device, cells: Sequence[tuple[int, int, int]], repeats: int = DEFAULT_REPEATS,
               warmup: int = DEFAULT_WARMUP, progress: bool = True,
               clock: Callable[[], float] = time.perf_counter) -> list[Timing]:
    """`time_cell` of every cell, in order, under the codec's precision contract, after one untimed
    run of the largest cell (the allocator's pools and the kernel caches then hold what every cell needs)."""
    from mmtok.progress import progress as progress_bar

    if repeats < 1 or warmup < 0:
        raise MmtokError(f"--repeats must be >= 1 and warm-up runs >= 0, got {repeats} and {warmup}")
    codec.precision.apply()  # TF32 and cuDNN settings as in `mmtok encode`: the timings are of that code path
    if cells:
        time_cell(codec, device, *max(cells, key=lambda c: (c[0] * c[1] * c[2], c)), repeats=1, warmup=0)
    timings = []
    bar = progress_bar(total=len(cells), desc="calibrate", unit="cell", enabled=progress)
    try:
        for height, width, count in cells:
            bar.set_postfix_str(f"{count} x {height}x{width}", refresh=False)
            timings.append(time_cell(codec, device, height, width, count, repeats, warmup, clock))
            bar.update(1)
    finally:
        bar.close()
    return timings


# -------------------------------------------------------------------------------------------- the fit


def _columns(timings: Sequence[Timing]) -> tuple[np.ndarray, ...]:
    return tuple(np.array([getattr(t, name) for t in timings]) for name in ("height", "width", "count", "seconds"))


def fit_timings(timings: Sequence[Timing], stride: int = 16, source: str = "mmtok calibrate") -> CostModel:
    """`CostModel.fit` (relative least squares) of the timings; independent of their order."""
    if not timings:
        raise MmtokError("no timings to fit: the calibration grid is empty")
    height, width, count, seconds = _columns(sorted(timings, key=Timing.key))
    return CostModel.fit(height, width, count, seconds, stride=stride, source=source, relative=True)


def relative_errors(model: CostModel, timings: Sequence[Timing], scale: float = 1.0) -> np.ndarray:
    """|scale * predicted / measured - 1| per timed batch."""
    height, width, count, seconds = _columns(timings)
    return np.abs(scale * model.batch_cost(height, width, count) / seconds - 1)


def best_scale(model: CostModel, timings: Sequence[Timing]) -> float:
    """The factor s minimising the squared relative errors of s * model (a model in arbitrary units)."""
    height, width, count, seconds = _columns(timings)
    ratio = model.batch_cost(height, width, count) / seconds
    return float(ratio.sum() / (ratio * ratio).sum())


@dataclass(frozen=True)
class ErrorStats:
    """Relative errors (fractions) of a model over timed batches."""

    median: float
    p95: float
    max: float
    batches: int


def error_stats(errors: np.ndarray) -> ErrorStats:
    """Median, 95th percentile and max of relative errors (fractions), and how many batches."""
    return ErrorStats(median=float(np.median(errors)), p95=float(np.percentile(errors, 95)),
                      max=float(errors.max()), batches=int(errors.size))


@dataclass(frozen=True)
class Errors:
    """A model's errors on every timed batch, and on the held-out shapes for a fit without them (None when no
    shape is held out)."""

    fitted: ErrorStats
    held_out: ErrorStats | None = None


@dataclass(frozen=True)
class Replaced:
    """The model a calibration replaces, compared after its best scale."""

    cost_model: CostModel
    scale: float
    errors: Errors

    def to_json(self) -> dict:
        return {"cost_model": self.cost_model.to_dict(), "scale": self.scale,
                "errors": dataclasses.asdict(self.errors)}


@dataclass(frozen=True)
class Evaluation:
    """`evaluate`'s result: the fit's errors beside those of the model it replaces."""

    held_out_shapes: list[list[int]]  # [height, width], sorted
    holdout_every: int
    errors: Errors
    replaced: Replaced

    def to_json(self) -> dict:
        return {"held_out_shapes": self.held_out_shapes, "holdout_every": self.holdout_every,
                "errors": dataclasses.asdict(self.errors), "replaced": self.replaced.to_json()}


def held_out_shapes(shapes: Sequence[tuple[int, int]], every: int = HOLDOUT_EVERY) -> tuple[tuple[int, int], ...]:
    """Every `every`-th shape in area order, never the smallest or the largest (an interpolation test)."""
    ordered = _area_order(shapes)
    return tuple(s for i, s in enumerate(ordered) if i % every == every - 1 and 0 < i < len(ordered) - 1)


def evaluate(timings: Sequence[Timing], replaced: CostModel, every: int = HOLDOUT_EVERY) -> Evaluation:
    """Errors of the fit and of `replaced` (after its best scale): on every timed batch ("fitted"),
    and on the held-out shapes for a fit without them ("held_out", None when no shape is held out).
    The held-out scale of `replaced` is also chosen without the held-out shapes."""
    held = set(held_out_shapes([(t.height, t.width) for t in timings], every))
    train = [t for t in timings if (t.height, t.width) not in held]
    test = [t for t in timings if (t.height, t.width) in held]
    model = fit_timings(timings, replaced.stride)
    scale = best_scale(replaced, timings)
    fitted, replaced_fitted = error_stats(relative_errors(model, timings)), \
        error_stats(relative_errors(replaced, timings, scale))
    held_out = replaced_held_out = None
    if test:
        held_out = error_stats(relative_errors(fit_timings(train, replaced.stride), test))
        replaced_held_out = error_stats(relative_errors(replaced, test, best_scale(replaced, train)))
    return Evaluation(held_out_shapes=[list(s) for s in sorted(held)], holdout_every=every,
                      errors=Errors(fitted, held_out),
                      replaced=Replaced(replaced, scale, Errors(replaced_fitted, replaced_held_out)))


# -------------------------------------------------------------------------------------- the whole run


def calibrate(codec, device, grid: Grid, *, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES,
              max_images: int | None = None, repeats: int = DEFAULT_REPEATS, warmup: int = DEFAULT_WARMUP,
              every: int = HOLDOUT_EVERY, progress: bool = True) -> Calibration:
    """Time the grid and fit."""
    if codec.modality != "image":
        raise MmtokError(f"codec {codec.name} is an {codec.modality} codec; calibrate times image codecs only "
                         "(the plan's cost model is for image batches)")
    if grid.factor % codec.pixels_per_code:
        raise MmtokError(f"{grid.origin} makes shapes in multiples of {grid.factor} pixels but codec {codec.name} "
                         f"has {codec.pixels_per_code} pixels per code; use a preset or plan made for this codec")
    cells = grid_cells(grid, batch_sizes, max_images)
    started = time.perf_counter()
    timings = time_cells(codec, device, cells, repeats, warmup, progress)
    return calibration_result(timings, grid, codec_identity(codec, device), repeats=repeats, warmup=warmup,
                              every=every, timing_seconds=time.perf_counter() - started)


def codec_identity(codec, device) -> dict:
    """What the timings were taken of: codec, checkpoint, device, torch, date."""
    import torch

    return {"codec": codec.name, "checkpoint_sha256": codec.checkpoint_sha256, "device": device_name(device),
            "torch": str(torch.__version__), "date": datetime.date.today().isoformat()}


@dataclass(frozen=True)
class Calibration:
    """A calibration: the fitted model and its evidence. `to_json()` is the file `write_calibration` writes (and
    `mmtok calibrate --json` prints): `cost_model:` for the plan, `calibration:` the evidence."""

    cost_model: CostModel
    identity: dict  # `codec_identity`: codec, checkpoint, device, torch, date (a benchmark adds its clock)
    grid: str  # the grid's origin: "preset NAME" or "plan DIR"
    repeats: int
    warmup: int
    timing_seconds: float
    evaluation: Evaluation
    timings: tuple[Timing, ...]  # sorted by Timing.key

    def to_json(self) -> dict:
        table = [{"height": t.height, "width": t.width, "count": t.count, "seconds": t.seconds, "runs": list(t.runs)}
                 for t in self.timings]
        return {"cost_model": self.cost_model.to_dict(),
                "calibration": {**self.identity, "grid": self.grid, "repeats": self.repeats, "warmup": self.warmup,
                                "timing_seconds": self.timing_seconds, **self.evaluation.to_json(), "timings": table}}


def calibration_result(timings: Sequence[Timing], grid: Grid, identity: dict, *, repeats: int, warmup: int,
                       every: int = HOLDOUT_EVERY, timing_seconds: float = 0.0) -> Calibration:
    """The calibration of a timing table (pure: equal tables and identities give equal results)."""
    timings = sorted(timings, key=Timing.key)
    report = evaluate(timings, grid.replaced, every)
    errors = report.errors
    quoted = (f"held-out median error {100 * errors.held_out.median:.1f}%" if errors.held_out
              else f"fitted median error {100 * errors.fitted.median:.1f}% (no held-out shapes)")
    source = (f"mmtok calibrate: codec {identity['codec']} {identity['checkpoint_sha256'][:12]} on "
              f"{identity['device']}, {identity['date']}, {quoted}")
    model = dataclasses.replace(fit_timings(timings, grid.replaced.stride), source=source)
    return Calibration(cost_model=model, identity=identity, grid=grid.origin, repeats=repeats, warmup=warmup,
                       timing_seconds=timing_seconds, evaluation=report, timings=tuple(timings))
