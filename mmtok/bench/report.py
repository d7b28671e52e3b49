"""The benchmark's report, computed from results.csv only: report.md, summary.json, metrics.png, grids/.

report.md has the two table shapes of the Apertus report: Table 1 (one row per tokenizer, overall means)
and Table E.1 (one row per category, the tokenizers side by side per metric, plus an "Overall" row).
Arrows give the better direction; the best value of each metric in a row (Table E.1) or column
(Table 1) is bold, ties included, judged on the printed digits. Means are over the rows of status "ok"
(NaN metrics, e.g. PESQ on a clip without speech, are left out of that metric's mean); "Overall" is the
mean over all scored items, not the mean of category means. A PSNR of identical images is inf and the
mean over a set containing one is inf, printed as "inf" (summary.json writes "inf"; NaN becomes null).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import math
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mmtok.fsutil import atomic_write_bytes, atomic_write_json

OVERALL = "Overall"


@dataclass(frozen=True)
class Metric:
    key: str
    title: str
    better: str  # "up", "down" or "" (a cost, not a quality)
    digits: int

    @property
    def header(self) -> str:
        return self.title + {"up": " ↑", "down": " ↓", "": ""}[self.better]


METRICS = {
    "image": (Metric("tokens", "Tokens/img", "", 0), Metric("psnr", "PSNR (dB)", "up", 2),
              Metric("ssim", "SSIM", "up", 3), Metric("lpips", "LPIPS", "down", 3)),
    "audio": (Metric("tokens_per_s", "Tokens/s", "", 1), Metric("mel_l1", "Mel L1", "down", 3),
              Metric("stoi", "STOI", "up", 3), Metric("pesq", "PESQ-WB", "up", 2)),
}


def _float(text: str) -> float:
    return math.nan if text in ("", None) else float(text)


def aggregate(rows: list[dict], metrics: tuple[Metric, ...], labels: list[str]) -> dict:
    """{label: {category or OVERALL: {"n": scored rows, metric: mean}}} over rows with status ok."""
    out: dict = {}
    for label in labels:
        scored = [r for r in rows if r["tokenizer"] == label and r["status"] == "ok"]
        groups: dict[str, list[dict]] = {OVERALL: scored}
        for row in scored:
            groups.setdefault(row["category"], []).append(row)
        out[label] = {name: _means(group, metrics) for name, group in groups.items()}
    return out


def _means(rows: list[dict], metrics: tuple[Metric, ...]) -> dict:
    means: dict = {"n": len(rows)}
    for metric in metrics:
        values = np.array([_float(r[metric.key]) for r in rows], dtype=np.float64)
        values = values[~np.isnan(values)]
        means[metric.key] = float(values.mean()) if values.size else math.nan
    return means


def format_value(value: float, digits: int) -> str:
    if math.isnan(value):
        return "–"
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:,.{digits}f}"


def _bold_best(values: list[float], metric: Metric) -> list[str]:
    texts = [format_value(v, metric.digits) for v in values]
    finite = [v for v in values if not math.isnan(v)]
    if not metric.better or len(values) < 2 or not finite:
        return texts
    best = max(finite) if metric.better == "up" else min(finite)
    best_text = format_value(best, metric.digits)
    return [f"**{t}**" if t == best_text else t for t in texts]


def table_overall(stats: dict, metrics: tuple[Metric, ...], labels: list[str]) -> list[str]:
    """Table 1 shape: one row per tokenizer."""
    lines = ["| Tokenizer | n | " + " | ".join(m.header for m in metrics) + " |",
             "|---|---:|" + "---:|" * len(metrics)]
    columns = [_bold_best([stats[label][OVERALL][m.key] for label in labels], m) for m in metrics]
    for i, label in enumerate(labels):
        cells = [label, str(stats[label][OVERALL]["n"])] + [column[i] for column in columns]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def table_categories(stats: dict, metrics: tuple[Metric, ...], labels: list[str], categories: list[str]) -> list[str]:
    """Table E.1 shape: one row per category (then Overall), tokenizers side by side per metric."""
    header = ["Category", "n"] + [f"{m.header} {label}" for m in metrics for label in labels]
    lines = ["| " + " | ".join(header) + " |", "|---|---:|" + "---:|" * (len(metrics) * len(labels))]
    for category in categories + [OVERALL]:
        cells_n = "/".join(str(stats[label].get(category, {"n": 0})["n"]) for label in labels)
        cells = [f"**{category}**" if category == OVERALL else _escape(category), cells_n]
        for metric in metrics:
            values = [stats[label].get(category, {}).get(metric.key, math.nan) for label in labels]
            cells += _bold_best(values, metric)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def slug(text: str) -> str:
    """A file-name-safe, unique name for a category."""
    clean = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")[:48] or "category"
    return f"{clean}-{hashlib.sha256(text.encode()).hexdigest()[:6]}"


@dataclass(frozen=True)
class BenchSummary:
    """What a benchmark run found; `to_json()` is summary.json."""

    identity: dict  # the run's identity (run.json): input, tokenizers, metrics settings
    means: dict  # tokenizer label -> category (or OVERALL) -> metric key -> mean (non-finite ones as in JSON)
    status_counts: dict[str, dict[str, int]]  # tokenizer label -> item status -> rows
    excluded_from_catalog: dict[str, int]  # reason -> catalog rows left out
    items: int
    this_invocation_timing_s: dict  # seconds of this invocation, by phase

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def write_bench_report(out: Path, identity: dict, rows: list[dict], excluded: dict, timing: dict) -> BenchSummary:
    """Write report.md, summary.json, metrics.png and grids/ (images) from the results rows; returns the summary."""
    modality = identity["modality"]
    metrics = METRICS[modality]
    labels = [t["label"] for t in identity["tokenizers"]]
    categories = sorted({r["category"] for r in rows})
    stats = aggregate(rows, metrics, labels)
    statuses = {label: dict(Counter(r["status"] for r in rows if r["tokenizer"] == label)) for label in labels}
    summary = BenchSummary(identity=identity, means=_json_safe(stats), status_counts=statuses,
                           excluded_from_catalog=excluded, items=len({r["item"] for r in rows}),
                           this_invocation_timing_s=timing)
    atomic_write_json(out / "summary.json", summary.to_json())
    kept = _kept_files(out, rows, labels, modality)
    lines = _markdown(identity, stats, metrics, labels, categories, statuses, excluded, kept, modality)
    atomic_write_bytes(out / "report.md", ("\n".join(lines) + "\n").encode("utf-8"))
    plot_means(out / "metrics.png", stats, metrics, labels, categories)
    if modality == "image":
        write_grids(out, kept, labels)
    return summary


def _json_safe(value):
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _markdown(identity, stats, metrics, labels, categories, statuses, excluded, kept, modality) -> list[str]:
    unit = "image" if modality == "image" else "clip"
    lines = ["# Tokenizer reconstruction benchmark", "",
             f"Input `{identity['input']['path']}` ({identity['input']['kind']}), category column "
             f"`{identity['category_column']}`, up to {identity['per_category']} {unit}s per category, seed "
             f"{identity['seed']}. Means over scored {unit}s; ↑/↓: higher/lower is better; best in bold.", "",
             "## Overall", ""]
    lines += table_overall(stats, metrics, labels)
    lines += ["", "## Per category", ""]
    lines += table_categories(stats, metrics, labels, categories)
    lines += ["", "## Not scored", ""]
    lines += _status_lines(statuses, excluded)
    lines += ["", "## Tokenizers and settings", ""]
    for tokenizer in identity["tokenizers"]:
        codec = tokenizer["codec"]
        rule = f", resize {tokenizer['resize']}" if "resize" in tokenizer else ""
        lines.append(f"- **{tokenizer['label']}**: codec `{codec['name']}`, checkpoint sha256 "
                     f"`{codec['checkpoint_sha256'][:16]}…`, precision {codec['precision']}{rule}")
    lines.append(f"- metrics: {identity['metrics']}")
    lines += ["", "Files: `results.csv` (one row per item × tokenizer), `summary.json`, `metrics.png`"
              + (", `grids/`" if modality == "image" else "") + "."]
    if modality == "audio":
        lines += ["", "## Listen", ""] + _wav_lines(kept, labels)
    return lines


def _status_lines(statuses: dict, excluded: dict) -> list[str]:
    lines = []
    for label, counts in statuses.items():
        other = {k: v for k, v in sorted(counts.items()) if k != "ok"}
        lines.append(f"- {label}: {counts.get('ok', 0)} scored" + (f"; not scored: {other}" if other else ""))
    if excluded:
        lines.append(f"- catalog rows left out before sampling: {dict(sorted(excluded.items()))}")
    return lines


def _kept_files(out: Path, rows: list[dict], labels: list[str], modality: str) -> dict[str, list[tuple]]:
    """category -> [(slug, item, {"input": path, label: path})] for items whose files are in recon/."""
    suffix = ".png" if modality == "image" else ".wav"
    recon = out / "recon"
    slugs = {p.name.split("__")[0] for p in recon.glob(f"*__input{suffix}")} if recon.is_dir() else set()
    by_item = {}
    for row in rows:
        by_item.setdefault(row["item"], row["category"])
    kept: dict[str, list[tuple]] = {}
    for item in by_item:
        item_slug = kept_name(item)
        if item_slug not in slugs:
            continue
        files = {"input": recon / f"{item_slug}__input{suffix}"}
        files.update({label: recon / f"{item_slug}__{label}{suffix}" for label in labels
                      if (recon / f"{item_slug}__{label}{suffix}").exists()})
        kept.setdefault(by_item[item], []).append((item_slug, item, files))
    return kept


def kept_name(item: str) -> str:
    """The file-name prefix of an item's kept input and reconstructions under recon/."""
    return hashlib.sha256(item.encode("utf-8")).hexdigest()[:12]


def _wav_lines(kept: dict, labels: list[str]) -> list[str]:
    lines = []
    for category in sorted(kept):
        for _, item, files in kept[category]:
            links = ", ".join(f"[{name}]({path.parent.name}/{path.name})" for name, path in files.items())
            lines.append(f"- {_escape(category)} · `{item}`: {links}")
    return lines or ["- (no clips kept)"]


def plot_means(path: Path, stats: dict, metrics: tuple[Metric, ...], labels: list[str], categories: list[str]) -> None:
    """Grouped bars: one panel per metric, categories (and Overall) on x, one bar per tokenizer."""
    from mmtok.extras import require

    matplotlib = require("matplotlib", "bench", "mmtok bench reconstruct")
    matplotlib.use("Agg")
    plt = require("matplotlib.pyplot", "bench", "mmtok bench reconstruct")

    groups = categories + [OVERALL]
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.6 + 0.08 * len(groups)), squeeze=False)
    width = 0.8 / max(len(labels), 1)
    x = np.arange(len(groups))
    for axis, metric in zip(axes[0], metrics, strict=True):
        for i, label in enumerate(labels):
            values = np.array([stats[label].get(g, {}).get(metric.key, math.nan) for g in groups], dtype=float)
            shown = np.where(np.isfinite(values), values, np.nan)  # inf PSNR cannot be drawn; marked below
            bars = axis.bar(x + (i - (len(labels) - 1) / 2) * width, shown, width, label=label)
            for bar, value in zip(bars, values, strict=True):
                if math.isinf(value):
                    axis.annotate("inf", (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom", fontsize=7)
        axis.set_title(metric.header)
        axis.set_xticks(x, [g[:18] for g in groups], rotation=45, ha="right", fontsize=8)
        axis.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


GRID_HEIGHT = 192  # display height of every tile in a grid
LABEL_BAND = 18


def write_grids(out: Path, kept: dict, labels: list[str]) -> None:
    """grids/<category>.png: one row per kept image: input | reconstruction of each tokenizer."""
    from PIL import Image, ImageDraw

    for category, items in kept.items():
        rows = [[_tile(files.get(name)) for name in ["input"] + labels] for _, _, files in items]
        widths = [max(row[c].width for row in rows) for c in range(len(labels) + 1)]
        canvas = Image.new("RGB", (sum(widths) + 4 * len(widths), LABEL_BAND + len(rows) * (GRID_HEIGHT + 4)), "white")
        draw = ImageDraw.Draw(canvas)
        left = 0
        for column, name in enumerate(["input"] + labels):
            draw.text((left + 2, 3), f"{name}" + (f" · {category[:40]}" if column == 0 else ""), fill="black")
            for r, row in enumerate(rows):
                canvas.paste(row[column], (left, LABEL_BAND + r * (GRID_HEIGHT + 4)))
            left += widths[column] + 4
        buffer = io.BytesIO()
        canvas.save(buffer, format="PNG")
        atomic_write_bytes(out / "grids" / f"{slug(category)}.png", buffer.getvalue())


def _tile(path: Path | None):
    from PIL import Image

    if path is None or not path.exists():
        return Image.new("RGB", (GRID_HEIGHT, GRID_HEIGHT), (200, 200, 200))  # not scored for this tokenizer
    image = Image.open(path).convert("RGB")
    width = max(1, round(image.width * GRID_HEIGHT / image.height))
    return image.resize((width, GRID_HEIGHT), Image.BICUBIC)
