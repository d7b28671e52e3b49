"""The reconstruction benchmark runner: sample, preprocess as in training, encode + decode, score, log.

Output folder (all written by this module and mmtok.bench.report):
  run.json       the run identity (input fingerprint, sample parameters, tokenizers with checkpoint sha256,
                 precision and resize rule, metric settings); a resumed run must match it
  results.csv    one row per (item, tokenizer), appended and fsynced item by item; the only source of the
                 report numbers. Rows whose status is not "ok" carry a reason (decode_error, aspect_ratio, ...)
  recon/         reconstructions (PNG) / WAV pairs of the first items of each category, for grids and listening
  report.md, summary.json, metrics.png, grids/   written at the end from results.csv (mmtok.bench.report)

Resume: items whose (item, tokenizer) rows are already in results.csv are not recomputed; a torn last line
(a crash mid-write) is cut off first. The same run on CPU or CUDA writes the same columns; the numbers
depend on the device only through the codecs' own precision contracts.
"""

from __future__ import annotations

import csv
import io
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmtok.bench import inputs
from mmtok.errors import MmtokError
from mmtok.fsutil import sync

if TYPE_CHECKING:
    from mmtok.bench.report import BenchSummary

RESULTS = "results.csv"
RUN = "run.json"
RULE_KEYS = ("min_pixels", "max_pixels", "max_aspect")


# ---- tokenizer specs and resize rules -----------------------------------------------------------------------


@dataclass(frozen=True)
class TokenizerSpec:
    """`NAME=CHECKPOINT[,key=value...]`; keys: label, min_pixels, max_pixels, max_aspect, preset."""

    codec: str
    checkpoint: Path
    label: str
    options: dict = field(default_factory=dict)


OPTION_KEYS = {"label": str, "min_pixels": int, "max_pixels": int, "max_aspect": float, "preset": str}


def parse_tokenizer(text: str) -> TokenizerSpec:
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise MmtokError(f"--tokenizer {text!r}: expected NAME=CHECKPOINT[,key=value...], e.g. emu3=/ckpt/emu3")
    checkpoint, *pairs = rest.split(",")
    options = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if key not in OPTION_KEYS or not sep:
            raise MmtokError(f"--tokenizer {text!r}: unknown option {pair!r}; options: {', '.join(OPTION_KEYS)}")
        try:
            options[key] = OPTION_KEYS[key](value)
        except ValueError:
            raise MmtokError(f"--tokenizer {text!r}: {key} must be a {OPTION_KEYS[key].__name__}") from None
    label = options.pop("label", name)
    return TokenizerSpec(codec=name, checkpoint=Path(checkpoint), label=label, options=options)


@dataclass(frozen=True)
class ResizeRule:
    """The training resize of one tokenizer: mmtok.media.resize.target_shape with its factor and bounds, and the
    aspect-ratio filter (long side / short side of the source; None: no limit)."""

    factor: int
    min_pixels: int
    max_pixels: int
    max_aspect: float | None

    def target(self, height: int, width: int) -> tuple[tuple[int, int] | None, str]:
        """(target shape, "") or (None, reason) for a source image of height x width."""
        from mmtok.media.resize import target_shape

        if min(height, width) < 1:
            return None, "zero_size"
        if self.max_aspect is not None and max(height, width) / min(height, width) > self.max_aspect:
            return None, "aspect_ratio"
        return target_shape(height, width, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                            factor=self.factor), ""


def resize_rule(spec: TokenizerSpec, codec) -> ResizeRule:
    """The bounds of a plan preset if `preset=` is given, else the checkpoint's own (Emu3: its
    preprocessor_config.json), else mmtok plan's defaults; explicit --tokenizer keys win over all.
    The factor is always the codec's pixels per code."""
    defaults = getattr(codec, "resize_defaults", None)
    if defaults and "preset" not in spec.options:
        rule = {k: defaults[k] for k in RULE_KEYS}
    else:
        rule = _plan_rule(spec.options.get("preset"))
    rule.update({k: spec.options[k] for k in RULE_KEYS if k in spec.options})
    if rule["min_pixels"] > rule["max_pixels"]:
        raise MmtokError(f"{spec.label}: min_pixels {rule['min_pixels']} exceeds max_pixels {rule['max_pixels']}")
    return ResizeRule(factor=int(codec.pixels_per_code), **rule)


def _plan_rule(preset: str | None) -> dict:
    from mmtok.formats.presets import PlanParameters, load_preset

    params = load_preset(preset) if preset else PlanParameters()
    return {"min_pixels": params.min_pixels, "max_pixels": params.max_pixels, "max_aspect": params.max_aspect_ratio}


# ---- the durable results log ---------------------------------------------------------------------------------


class ResultsLog:
    """results.csv opened for appending: rows already there are `done`; every append is fsynced."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        self.path, self.columns = path, columns
        self.rows = self._read_existing()
        self.done = {(row["item"], row["tokenizer"]) for row in self.rows}
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._handle = open(self.path, "a", newline="", encoding="utf-8")
        if new:
            self._write([dict(zip(columns, columns, strict=True))])

    def _read_existing(self) -> list[dict]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):  # torn last record: cut it (it is recomputed)
            data = data[: data.rfind(b"\n") + 1]
            with open(self.path, "r+b") as handle:
                handle.truncate(len(data))
        reader = csv.DictReader(io.StringIO(data.decode("utf-8")))
        if data and tuple(reader.fieldnames or ()) != self.columns:
            raise MmtokError(f"{self.path}: columns {reader.fieldnames} differ from this modality's "
                             f"{list(self.columns)}; use a new --out folder")
        return list(reader)

    def append(self, rows: list[dict]) -> None:
        self._write(rows)
        self.rows.extend({k: _cell(row.get(k)) for k in self.columns} for row in rows)
        self.done.update((row["item"], row["tokenizer"]) for row in rows)

    def _write(self, rows: list[dict]) -> None:
        writer = csv.writer(self._handle, lineterminator="\n")
        writer.writerows([[_cell(row.get(k)) for k in self.columns] for row in rows])
        sync(self._handle)

    def close(self) -> None:
        self._handle.close()


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return "nan" if math.isnan(value) else repr(value)  # repr: full precision, "inf" stays "inf"
    return str(value)


# ---- the run ---------------------------------------------------------------------------------------------------


@dataclass
class Loaded:
    spec: TokenizerSpec
    codec: object
    rule: ResizeRule | None

    def describe(self) -> dict:
        info = {"label": self.spec.label, "codec": self.codec.describe()}
        if self.rule is not None:
            info["resize"] = asdict(self.rule)
        return info


@dataclass(frozen=True)
class RunOptions:
    manifest: Path
    category_column: str
    per_category: int
    seed: int
    tokenizers: list[TokenizerSpec]
    out: Path
    modality: str = "image"
    device: str | None = None
    path_column: str = "path"
    categories: Path | None = None
    text_tokenizer: str = "tekken"
    keep_per_category: int = 4  # items per category whose reconstructions are kept (grids / WAV pairs)
    progress: bool = True


def run(options: RunOptions) -> BenchSummary:
    """Run (or resume) the benchmark and write the report; returns its summary."""
    from mmtok.bench.report import write_bench_report
    from mmtok.launch import resolve_device

    device = resolve_device(options.device)
    catalog = inputs.read_catalog(options.manifest, options.category_column, options.path_column, options.categories)
    sample = inputs.stratified_sample(catalog.categories, options.per_category, options.seed)
    loaded = _load_tokenizers(options, device)
    task = _make_task(options, loaded, device)
    options.out.mkdir(parents=True, exist_ok=True)
    identity = _identity(options, catalog, loaded, task, device)
    _check_identity(options.out / RUN, identity)
    log = ResultsLog(options.out / RESULTS, task.columns)
    try:
        timing = _loop(options, catalog, sample, loaded, task, log)
    finally:
        log.close()
    return write_bench_report(options.out, identity, log.rows, catalog.excluded, timing)


def _load_tokenizers(options: RunOptions, device: torch.device) -> list[Loaded]:
    from mmtok.codecs.registry import load_codec

    if not options.tokenizers:
        raise MmtokError("give at least one --tokenizer NAME=CHECKPOINT")
    labels = [spec.label for spec in options.tokenizers]
    if len(set(labels)) != len(labels):
        raise MmtokError(f"tokenizer labels must be unique, got {labels}; add ,label=NAME to tell them apart")
    loaded = []
    for spec in options.tokenizers:
        codec = load_codec(spec.codec, spec.checkpoint, device)
        if codec.modality != options.modality:
            raise MmtokError(f"{spec.label}: a {codec.modality} codec in a --modality {options.modality} run")
        rule = resize_rule(spec, codec) if options.modality == "image" else None
        loaded.append(Loaded(spec, codec, rule))
    return loaded


def _make_task(options: RunOptions, loaded: list[Loaded], device: torch.device):
    if options.modality == "image":
        from mmtok.bench.tasks import ImageTask

        return ImageTask(device, options.text_tokenizer)
    if options.modality == "audio":
        from mmtok.bench.tasks import AudioTask

        rates = {int(item.codec.sample_rate) for item in loaded}
        if len(rates) != 1:
            raise MmtokError(f"audio tokenizers must share one sample rate, got {sorted(rates)}")
        return AudioTask(rates.pop())
    raise MmtokError(f"--modality must be image or audio, got {options.modality!r}")


def _identity(options: RunOptions, catalog: inputs.Catalog, loaded: list[Loaded], task, device: torch.device) -> dict:
    """What the rows of results.csv depend on; the device type too (TF32 codecs differ on CUDA and CPU)."""
    from mmtok import __version__

    return {"tool": f"mmtok {__version__} bench reconstruct", "modality": options.modality, "device_type": device.type,
            "input": {"path": str(options.manifest), "kind": catalog.kind, "fingerprint": catalog.fingerprint},
            "category_column": options.category_column, "per_category": options.per_category,
            "seed": options.seed, "tokenizers": [item.describe() for item in loaded], "metrics": task.settings()}


def _check_identity(path: Path, identity: dict) -> None:
    """Record the identity of a new run; refuse to resume a run whose identity differs (naming the key)."""
    import json

    from mmtok.fsutil import atomic_write_json

    if path.exists():
        difference = _first_difference(json.loads(path.read_text()), json.loads(json.dumps(identity)), "")
        if difference:
            raise MmtokError(f"{path.parent}: holds an earlier run with a different {difference}; use a new --out "
                             "folder, or delete this one to start over")
        return
    atomic_write_json(path, identity)


def _first_difference(old, new, where: str) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for key in sorted(set(old) | set(new), key=str):
            found = _first_difference(old.get(key), new.get(key), f"{where}.{key}" if where else repr(key))
            if found:
                return found
        return ""
    if isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        return next((d for i, (a, b) in enumerate(zip(old, new, strict=True))
                     if (d := _first_difference(a, b, f"{where}[{i}]"))), "")
    return "" if old == new else f"{where} ({old!r} before, {new!r} now)"


def _loop(options: RunOptions, catalog: inputs.Catalog, sample: np.ndarray, loaded: list[Loaded], task,
          log: ResultsLog) -> dict:
    from mmtok.bench.report import kept_name
    from mmtok.progress import progress as progress_bar

    reader = inputs.ByteReader()
    keep = _kept_positions(catalog.categories[sample], options.keep_per_category)
    timing = {"items": 0, "load_s": 0.0, "encode_s": 0.0, "decode_s": 0.0, "metrics_s": 0.0, "write_s": 0.0}
    bar = progress_bar(total=len(sample), unit="item", desc="bench reconstruct", enabled=options.progress)
    for position, index in enumerate(sample):
        item = {"item": str(catalog.ids[index]), "category": str(catalog.categories[index]),
                "source": str(catalog.sources[index])}
        item["slug"] = kept_name(item["item"])
        pending = [entry for entry in loaded if (item["item"], entry.spec.label) not in log.done]
        if pending:
            rows = _run_item(task, reader, catalog.locations[index], item, pending,
                             options.out if position in keep else None, timing)
            started = time.perf_counter()
            log.append(rows)
            timing["write_s"] += time.perf_counter() - started
            timing["items"] += 1
        bar.update(1)
    bar.close()
    return timing


def _kept_positions(categories: np.ndarray, per_category: int) -> set[int]:
    seen: dict[str, int] = {}
    keep = set()
    for position, category in enumerate(categories):
        if seen.get(category, 0) < per_category:
            keep.add(position)
            seen[category] = seen.get(category, 0) + 1
    return keep


def _run_item(task, reader: inputs.ByteReader, location: tuple, item: dict, pending: list[Loaded],
              keep_dir: Path | None, timing: dict) -> list[dict]:
    started = time.perf_counter()
    source, reason = task.load(reader, location)
    timing["load_s"] += time.perf_counter() - started
    base = {k: item[k] for k in ("item", "category", "source")}
    if source is None:
        return [{**base, "tokenizer": entry.spec.label, "status": reason} for entry in pending]
    rows = []
    for entry in pending:
        entry.codec.precision.apply()  # each codec's own numeric contract (Emu3.5: TF32; Emu3: strict fp32)
        row = task.run(entry, source, keep_dir, item["slug"])
        for key in ("encode_s", "decode_s", "metrics_s"):
            timing[key] += row.get(key) or 0.0
        rows.append({**base, "tokenizer": entry.spec.label, **row})
    if keep_dir is not None:
        task.keep_input(source, keep_dir, item["slug"])
    return rows
