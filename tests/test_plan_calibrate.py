"""`mmtok calibrate`: the grid, the fit as a pure function of the timing table, the held-out split,
the YAML file `mmtok plan --cost-model` reads, and the refusals."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
import yaml

from manifestkit import write_rows
from mmtok.cli import main as cli_main
from mmtok.codecs import emu35, wavtokenizer
from mmtok.errors import MmtokError
from mmtok.formats import presets
from mmtok.formats.manifest import SCHEMA
from mmtok.formats.presets import CostModel, PlanParameters, load_preset
from mmtok.plan import calibrate as cal

TRUTH = CostModel(a=3e-6, b=4e-10, c=2e-4, batch=5e-3, source="truth")
IDENTITY = {"codec": "emu3.5", "checkpoint_sha256": "ab" * 32, "device": "cpu (2 threads)", "torch": "x",
            "date": "2026-01-01"}
TINY_GRID = ["--preset", "demo", "--max-shapes", "2", "--batch-sizes", "1", "--max-images", "2", "--repeats", "1"]


def synthetic(model: CostModel, grid: cal.Grid, noise: float = 0.0, seed: int = 0) -> list[cal.Timing]:
    """A timing table that `model` generates over the grid's cells, times a log-normal `noise`."""
    rng = np.random.default_rng(seed)
    timings = []
    for h, w, k in cal.grid_cells(grid):
        seconds = float(model.batch_cost(h, w, k) * np.exp(noise * rng.standard_normal()))
        timings.append(cal.Timing(h, w, k, seconds, (seconds,)))
    return timings


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread: two threads on a loaded 2-core machine wait for each other at every small op."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def grid() -> cal.Grid:
    return cal.preset_grid("apertus-stage1")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return emu35.write_random_checkpoint(tmp_path_factory.mktemp("emu35_tiny"))


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    """A manifest of 40 one-image documents of varied sizes (mode image never opens the tar)."""
    sizes = [(640, 480), (480, 640), (300, 300), (1024, 256), (200, 150), (800, 800), (256, 1000), (512, 384)]
    rows = [dict(key=f"{i:06d}", document=i, image_index=0, tar="/nonexistent/shard.tar", container="tar",
                 member=f"{i:06d}.jpg", offset=512 * (i + 1), size=1000, width=w, height=h, format="jpeg",
                 orientation=1, text_offset=-1, text_size=-1, json_offset=-1, json_size=-1, status="ok", reason="")
            for i, (w, h) in enumerate(sizes * 5)]
    directory = tmp_path_factory.mktemp("manifest")
    write_rows(directory, pa.Table.from_pylist(rows, schema=SCHEMA))
    return directory


# ----------------------------------------------------------------------------------------------- grid


def test_preset_grid_spans_the_range_with_legal_non_square_shapes(grid):
    params = load_preset("apertus-stage1")
    areas = [h * w for h, w in grid.shapes]
    assert len(grid.shapes) == cal.DEFAULT_MAX_SHAPES and areas == sorted(areas)
    assert grid.shapes[0] == (256, 256) and grid.shapes[-1] == (512, 512)
    assert all(h % 16 == 0 and w % 16 == 0 and params.min_pixels <= h * w <= params.max_pixels for h, w in grid.shapes)
    assert any(w / h >= 3.5 for h, w in grid.shapes) and any(h / w >= 3.5 for h, w in grid.shapes)
    assert grid.capacity[-1] == 123 and max(grid.capacity) == params.max_batch_images  # the plan's own capacity
    assert cal.preset_grid("apertus-stage1") == grid


def test_cells_take_the_batch_sizes_up_to_the_capacity_capped_by_max_images(grid):
    cells = cal.grid_cells(grid, (1, 4, 200), max_images=None)
    assert [k for h, w, k in cells if (h, w) == (512, 512)] == [1, 4, 123]  # 200 exceeds the capacity
    assert [k for h, w, k in cells if (h, w) == (256, 256)] == [1, 4, 200, 256]
    capped = cal.grid_cells(grid, (1, 4, 16), max_images=8)
    assert {k for _, _, k in capped} == {1, 4, 8} and len(capped) == 3 * len(grid.shapes)
    with pytest.raises(MmtokError, match="must be >= 1"):
        cal.grid_cells(grid, (0,))


def test_plan_grid_takes_the_extremes_and_the_most_common_shapes(manifest, tmp_path):
    assert cli_main(["plan", str(manifest), "--out", str(tmp_path / "plan"), "--preset", "demo", "--mode", "image",
                     "--quiet"]) == 0
    full = cal.plan_grid(tmp_path / "plan", max_shapes=100)
    small = cal.plan_grid(tmp_path / "plan", max_shapes=4)
    areas = [h * w for h, w in full.shapes]
    ratios = [w / h for h, w in full.shapes]
    picked = set(small.shapes)
    assert full.shapes[int(np.argmin(areas))] in picked and full.shapes[int(np.argmax(areas))] in picked
    assert full.shapes[int(np.argmax(ratios))] in picked and full.shapes[int(np.argmin(ratios))] in picked
    assert max(full.capacity) <= load_preset("demo").max_batch_images
    assert full.replaced.source == "preset demo"


def test_pick_shapes_orders_extremes_then_image_count_with_ties_by_index():
    h, w = np.array([256, 256, 128, 512, 384, 320]), np.array([256, 512, 512, 128, 384, 320])
    images = np.array([5, 9, 1, 1, 9, 9])
    # smallest area (first of three), largest, widest, tallest; then 9, 9 (4 taken already), 9, 5 images
    assert cal.pick_shapes(h, w, images, 10) == [0, 4, 2, 3, 1, 5]
    assert cal.pick_shapes(h, w, images, 5) == [0, 4, 2, 3, 1]


# ---------------------------------------------------------------------------------------------- the fit


def test_fit_recovers_the_model_that_generated_the_timings(grid):
    fitted = cal.fit_timings(synthetic(TRUTH, grid))
    for name in ("a", "b", "c", "batch"):
        assert getattr(fitted, name) == pytest.approx(getattr(TRUTH, name), rel=1e-4)
    noisy = cal.evaluate(synthetic(TRUTH, grid, noise=0.02), CostModel())
    assert noisy.errors.held_out.median < 0.03 and noisy.errors.fitted.median < 0.03


def test_fit_and_the_whole_result_are_a_pure_function_of_the_timing_table(grid):
    timings = synthetic(TRUTH, grid, noise=0.05)
    shuffled = timings[:]
    random.Random(3).shuffle(shuffled)
    assert cal.fit_timings(shuffled) == cal.fit_timings(timings)
    first = cal.calibration_result(timings, grid, IDENTITY, repeats=3, warmup=1)
    assert cal.calibration_result(shuffled, grid, IDENTITY, repeats=3, warmup=1) == first
    assert first.cost_model.source == ("mmtok calibrate: codec emu3.5 abababababab on cpu (2 threads), "
                                       f"2026-01-01, held-out median error "
                                       f"{100 * first.evaluation.errors.held_out.median:.1f}%")


def test_held_out_split_is_deterministic_and_interpolates(grid):
    shapes = list(grid.shapes)
    held = cal.held_out_shapes(shapes)
    assert held == cal.held_out_shapes(shapes[::-1]) == (grid.shapes[2], grid.shapes[5], grid.shapes[8])
    assert cal.held_out_shapes(shapes[:2]) == () and cal.held_out_shapes(shapes[:4], every=2) == (grid.shapes[1],)
    report = cal.evaluate(synthetic(TRUTH, grid), CostModel())
    assert report.held_out_shapes == sorted([list(s) for s in held])
    assert report.errors.held_out.batches == sum(1 for h, w, _ in cal.grid_cells(grid) if (h, w) in held)


def test_replaced_model_is_compared_after_its_best_scale(grid):
    timings = synthetic(TRUTH, grid)
    scaled = dataclasses.replace(TRUTH, a=TRUTH.a * 1e6, b=TRUTH.b * 1e6, c=TRUTH.c * 1e6, batch=TRUTH.batch * 1e6)
    report = cal.evaluate(timings, scaled)
    assert report.replaced.scale == pytest.approx(1e-6)
    assert report.replaced.errors.fitted.max < 1e-9
    default = cal.evaluate(timings, CostModel()).replaced.errors
    assert default.fitted.median > 0.05  # the analytic FLOP ratios are not this machine's


# ------------------------------------------------------------------------------- the file and the plan


def test_calibration_file_round_trips_into_the_plan(grid, manifest, tmp_path):
    result = cal.calibration_result(synthetic(TRUTH, grid, noise=0.01), grid, IDENTITY, repeats=3, warmup=1).to_json()
    path = tmp_path / "cost.yaml"
    presets.write_calibration(path, result)
    assert yaml.safe_load(path.read_text()) == result
    assert CostModel.from_file(path).to_dict() == result["cost_model"]
    out = tmp_path / "plan"
    assert cli_main(["plan", str(manifest), "--out", str(out), "--preset", "demo", "--mode", "image",
                     "--cost-model", str(path), "--quiet"]) == 0
    recorded = json.loads((out / "plan.json").read_text())["parameters"]["cost_model"]
    assert recorded == result["cost_model"] and recorded["source"].startswith("mmtok calibrate: codec emu3.5")
    assert cli_main(["plan", str(manifest), "--out", str(out), "--preset", "demo", "--mode", "image",
                     "--cost-model", str(path), "--cost-c", "0.5", "--quiet"]) == 0
    recorded = json.loads((out / "plan.json").read_text())["parameters"]["cost_model"]
    assert recorded["c"] == 0.5 and recorded["a"] == result["cost_model"]["a"]
    assert recorded["source"] == result["cost_model"]["source"] + "; overridden by flags: c=0.5"


def test_cost_model_sources_name_the_preset_or_the_default(tmp_path):
    assert load_preset("demo").cost_model.source == "preset demo"
    assert PlanParameters().cost_model.source.startswith("analytic default")
    own = tmp_path / "own.yaml"
    own.write_text("cost_model: {a: 2.0, source: measured by hand}\n")
    assert load_preset(str(own)).cost_model.source == "measured by hand"
    bare = tmp_path / "bare.yaml"
    bare.write_text("cost_model: {a: 2.0, b: 0.0}\n")
    assert CostModel.from_file(bare) == CostModel(a=2.0, b=0.0, source=f"cost_model of {bare}")


@pytest.mark.parametrize("text, message", [
    ("cost_model: [1, 2\n", "not valid YAML"),
    ("calibration: {}\n", "no top-level `cost_model:`"),
    ("cost_model: {a: -1.0}\n", "must be finite, >= 0"),
    ("cost_model: {a: 1.0, speed: 2}\n", "keys among"),
    ("cost_model: {a: 1.0, source: [x]}\n", "one-line string"),
])
def test_plan_refuses_a_bad_cost_model_file_in_one_line_naming_it(manifest, tmp_path, capsys, text, message):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(MmtokError, match=message) as caught:
        CostModel.from_file(path)
    assert str(path) in str(caught.value)
    assert cli_main(["plan", str(manifest), "--out", str(tmp_path / "p"), "--cost-model", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and str(path) in err and message in err


def test_plan_refuses_a_missing_cost_model_file(manifest, tmp_path, capsys):
    assert cli_main(["plan", str(manifest), "--out", str(tmp_path / "p"), "--cost-model", str(tmp_path / "no.yaml"),
                     "--quiet"]) == 2
    assert "no.yaml not found" in capsys.readouterr().err


def test_plan_says_a_cost_model_directory_is_a_directory(manifest, tmp_path, capsys):
    assert cli_main(["plan", str(manifest), "--out", str(tmp_path / "p"), "--cost-model", str(tmp_path),
                     "--quiet"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path} is a directory, not a YAML file" in err and "not found" not in err


# ------------------------------------------------------------------------------------------ the command


def test_cli_times_the_tiny_codec_and_writes_a_file_plan_accepts(tiny_checkpoint, manifest, tmp_path, capsys):
    out = tmp_path / "cost.yaml"
    assert cli_main(["calibrate", "--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--out", str(out),
                     "--no-progress", "--json", *TINY_GRID]) == 0
    printed = json.loads(capsys.readouterr().out)
    data = yaml.safe_load(out.read_text())
    assert {k: printed[k] for k in data} == data
    info = data["calibration"]
    assert [(t["height"], t["width"], t["count"]) for t in info["timings"]] == [
        (128, 128, 1), (128, 128, 2), (256, 256, 1), (256, 256, 2)]
    assert all(len(t["runs"]) == 1 and t["seconds"] > 0 for t in info["timings"])
    assert info["errors"]["held_out"] is None and info["replaced"]["cost_model"]["source"] == "preset demo"
    assert data["cost_model"]["source"].startswith("mmtok calibrate: codec emu3.5 ")
    assert f" on {info['device']}, " in data["cost_model"]["source"] and info["device"].startswith("cpu (")
    plan = tmp_path / "plan"
    assert cli_main(["plan", str(manifest), "--out", str(plan), "--preset", "demo", "--mode", "image",
                     "--cost-model", str(out), "--quiet"]) == 0
    assert json.loads((plan / "plan.json").read_text())["parameters"]["cost_model"] == data["cost_model"]


def test_cli_prints_the_errors_and_the_next_command(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "cost.yaml"
    assert cli_main(["calibrate", "--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--out", str(out),
                     "--no-progress", *TINY_GRID]) == 0
    text = capsys.readouterr().err
    assert "calibrated model" in text and "replaced model (best scale)" in text and "[preset demo]" in text
    assert f"next: mmtok plan MANIFEST --out PLAN --preset demo --cost-model {out}" in text


def test_cli_refuses_an_audio_codec_and_bad_flags_in_one_line(tmp_path, tiny_checkpoint, capsys):
    audio = wavtokenizer.write_random_checkpoint(tmp_path / "wav")
    args = ["--device", "cpu", "--out", str(tmp_path / "x.yaml"), "--no-progress", *TINY_GRID]
    assert cli_main(["calibrate", "--codec", "wavtokenizer", "--checkpoint", str(audio), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--codec wavtokenizer is an audio codec; this needs an image codec" in err
    assert cli_main(["calibrate", "--checkpoint", str(tiny_checkpoint), *args, "--batch-sizes", "1,x"]) == 2
    assert "--batch-sizes" in capsys.readouterr().err
    assert not (tmp_path / "x.yaml").exists()


def test_cli_takes_the_shapes_of_a_plan(tiny_checkpoint, manifest, tmp_path, capsys):
    plan = tmp_path / "plan"
    assert cli_main(["plan", str(manifest), "--out", str(plan), "--preset", "demo", "--mode", "image", "--quiet"]) == 0
    out = tmp_path / "cost.yaml"
    assert cli_main(["calibrate", "--checkpoint", str(tiny_checkpoint), "--device", "cpu", "--plan", str(plan),
                     "--max-shapes", "2", "--batch-sizes", "1", "--max-images", "1", "--repeats", "1",
                     "--out", str(out), "--no-progress"]) == 0
    info = yaml.safe_load(out.read_text())["calibration"]
    assert info["grid"] == f"plan {plan}" and len(info["timings"]) == 2
    assert {(t["height"], t["width"]) for t in info["timings"]} == set(cal.plan_grid(plan, 2).shapes)
    shown = capsys.readouterr().err
    assert f"next: re-run the `mmtok plan` that made {plan} with --cost-model {out} added" in shown
    assert "--plan" not in shown.split("next:")[1]  # `mmtok plan` has no --plan flag
