"""Plan parameters, the encoder cost model, and the presets in `plans/*.yaml`.

Every number that changes a plan lives in `PlanParameters`; a preset sets some or all of them and
command-line flags override single fields. `PlanParameters.to_dict()` is what plan.json records.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from mmtok.errors import MmtokError
from mmtok.fsutil import atomic_write_bytes

MODES = ("image", "image-text", "text-image", "sft", "interleaved")
CAPTION_MODES = ("image-text", "text-image")  # the plan reads and counts the txt sidecar
ENCODER_TEXT_MODES = ("sft", "interleaved")  # document text is rendered and counted by the encoder
REPO_PLANS = Path(__file__).resolve().parents[2] / "plans"


@dataclass(frozen=True)
class CostModel:
    """Estimated encoder cost of a batch: the quantity rank ranges balance.

    For a batch of `count` images of target shape (h, w) pixels:

        n    = (h // stride) * (w // stride)          latent positions at the attention resolution
        cost = count * (a * n + b * n**2 + c) + batch

    `a` is the convolution work per latent position (linear in pixels), `b` the single-head
    spatial attention over the latent grid (quadratic in positions), `c` a fixed cost per image and
    `batch` a fixed cost per batch (launches, synchronisation). Only ratios matter: balancing is
    scale-invariant. Defaults are an analytic FLOP estimate for the 16x IBQ encoder (a = 1 per
    latent position; attention with 512 channels costs ~2e-5 of that per position pair); replace
    them with `mmtok calibrate` (timings of the real codec on the target GPU, fit by `CostModel.fit`).
    `source` says where the numbers came from (one line; plan.json records it, no cost depends on it).
    `seconds_per_unit` converts a cost to GPU seconds, for sizing work items: 1.0 for a fitted model (its costs
    are seconds); for the analytic default an estimate: 1e-5 s per unit, i.e. ~11 ms per 512x512 image (1,109
    units), ~90 images/s on one H100-class GPU -- unmeasured (no GPU yet); `mmtok calibrate` replaces it.
    """

    a: float = 1.0
    b: float = 2.0e-5
    c: float = 64.0
    batch: float = 4096.0
    stride: int = 16
    source: str = "analytic default (FLOP estimate of the 16x encoder)"
    seconds_per_unit: float = 1.0e-5

    def __post_init__(self) -> None:
        values = {"a": self.a, "b": self.b, "c": self.c, "batch": self.batch}
        numeric = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values())
        if not numeric or any(not math.isfinite(v) or v < 0 for v in values.values()) or not any(values.values()):
            raise MmtokError(f"cost_model parameters must be finite, >= 0 and not all zero, got {values}")
        if not isinstance(self.stride, int) or self.stride <= 0:
            raise MmtokError(f"cost_model.stride must be positive, got {self.stride}")
        if not isinstance(self.source, str) or "\n" in self.source:
            raise MmtokError(f"cost_model.source must be a one-line string, got {self.source!r}")
        unit = self.seconds_per_unit
        if isinstance(unit, bool) or not isinstance(unit, (int, float)) or not 1e-15 <= unit <= 1e6:
            raise MmtokError(f"cost_model.seconds_per_unit must be a number in [1e-15, 1e6], got {unit!r}")

    def latents(self, height: np.ndarray, width: np.ndarray) -> np.ndarray:
        """Latent positions at the attention resolution (float64, exact for any realistic shape)."""
        return (np.asarray(height, np.int64) // self.stride
                * (np.asarray(width, np.int64) // self.stride)).astype(np.float64)

    def image_cost(self, height: np.ndarray, width: np.ndarray) -> np.ndarray:
        """Cost of one image of each (height, width), batch overhead excluded."""
        n = self.latents(height, width)
        return self.a * n + self.b * n * n + self.c

    def batch_cost(self, height: np.ndarray, width: np.ndarray, count: np.ndarray) -> np.ndarray:
        """Cost of batches of `count` images of one shape each."""
        return np.asarray(count, np.float64) * self.image_cost(height, width) + self.batch

    @classmethod
    def fit(cls, height: np.ndarray, width: np.ndarray, count: np.ndarray, seconds: np.ndarray,
            stride: int = 16, source: str = "CostModel.fit to measured batch times",
            relative: bool = False) -> "CostModel":
        """Non-negative least-squares fit of (a, b, c, batch) to measured batch times.

        Feed it one row per timed batch (shape, image count, wall seconds on the encoder), e.g. from
        a calibration sweep on the target GPU (`mmtok calibrate`). `relative` minimises the squared
        relative error of each batch instead of the absolute one, so batches of 1 image weigh as much
        as full ones (timings that span orders of magnitude); it needs every time to be positive.
        """
        from scipy.optimize import nnls

        seconds = np.asarray(seconds, np.float64)
        n = cls(stride=stride).latents(height, width)
        k = np.asarray(count, np.float64)
        design = np.stack([k * n, k * n * n, k, np.ones_like(k)], axis=1)
        target = seconds
        if relative:
            if not np.all(seconds > 0):
                raise MmtokError("CostModel.fit(relative=True) needs every measured time to be > 0")
            design, target = design / seconds[:, None], np.ones_like(seconds)
        scale = design.max(axis=0)
        scale[scale == 0] = 1.0  # keep nnls well conditioned across the very different column ranges
        coef, _ = nnls(design / scale, target)
        a, b, c, batch = (coef / scale).tolist()
        return cls(a=a, b=b, c=c, batch=batch, stride=stride, source=source, seconds_per_unit=1.0)

    @classmethod
    def from_mapping(cls, data: Any, where: str) -> "CostModel":
        """A cost model from a `cost_model:` mapping; bad keys or values are refused naming `where`."""
        known = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, Mapping) or set(data) - set(known):
            raise MmtokError(f"{where}: cost_model must be a mapping with keys among {known}, got {data!r}")
        try:
            return cls(**data)
        except MmtokError as err:
            raise MmtokError(f"{where}: {err}") from None

    @classmethod
    def from_file(cls, path: str | Path) -> "CostModel":
        """The top-level `cost_model:` mapping of a YAML file (written by `mmtok calibrate`, or a preset).

        Without its own `source`, the model's source names the file."""
        import yaml

        path = Path(path)
        fix = "pass the YAML file written by `mmtok calibrate --out` (or a preset with a cost_model block)"
        if path.is_dir():
            raise MmtokError(f"cost model file {path} is a directory, not a YAML file; {fix}")
        if not path.is_file():
            raise MmtokError(f"cost model file {path} not found; {fix}")
        try:
            data = yaml.safe_load(path.read_text("utf-8"))
        except (yaml.YAMLError, UnicodeDecodeError) as err:
            raise MmtokError(f"{path}: not valid YAML ({' '.join(str(err).split())}); {fix}") from None
        if not isinstance(data, Mapping) or "cost_model" not in data:
            raise MmtokError(f"{path}: no top-level `cost_model:` mapping; {fix}")
        cost = data["cost_model"]
        if isinstance(cost, Mapping) and "source" not in cost:
            cost = {**cost, "source": f"cost_model of {path}"}
        return cls.from_mapping(cost, str(path))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class PlanParameters:
    """Everything that determines a plan besides the manifest (recorded in plan.json)."""

    mode: str = "image"
    text_tokenizer: str = "tekken"
    factor: int = 16  # pixels per code of the image codec (16 Emu3.5, 8 Emu3)
    min_source_pixels: int = 64 * 64  # drop smaller source images (icons, spacers)
    max_source_pixels: int = 89_478_485  # drop larger ones (Pillow's decompression-bomb limit)
    max_aspect_ratio: float | None = 4.0  # long side / short side of the source; None: no limit
    min_pixels: int = 256 * 256  # resize bounds of the target shape (mmtok.media.resize)
    max_pixels: int = 512 * 512
    token_budget: int = 65_536  # image-block tokens per batch (a single larger image gets its own batch)
    max_batch_images: int = 128
    window_rows: int = 262_144  # manifest rows per window before snapping to a document boundary
    max_document_tokens: int = 1 << 20  # drop documents whose image blocks + BOS/EOS exceed this; 0: no limit
    cost_model: CostModel = field(default_factory=CostModel)
    item_seconds: float = 180.0  # target GPU time of one work item (cost model estimate): the unit encode resumes

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise MmtokError(f"mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        positive = ("factor", "min_pixels", "max_pixels", "token_budget", "max_batch_images", "window_rows",
                    "max_source_pixels")
        for name in positive:
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise MmtokError(f"plan parameter {name} must be a positive integer, got {getattr(self, name)!r}")
        if not isinstance(self.max_document_tokens, int) or self.max_document_tokens < 0:
            raise MmtokError("plan parameter max_document_tokens must be an integer >= 0, "
                             f"got {self.max_document_tokens!r}")
        if self.min_source_pixels < 0 or self.min_source_pixels > self.max_source_pixels:
            raise MmtokError(f"min_source_pixels ({self.min_source_pixels}) must be in [0, max_source_pixels]")
        if self.min_pixels > self.max_pixels:
            raise MmtokError(f"min_pixels ({self.min_pixels}) must not exceed max_pixels ({self.max_pixels})")
        seconds = self.item_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 1e-9 <= seconds <= 1e9:
            raise MmtokError(f"plan parameter item_seconds must be a number in [1e-9, 1e9] (seconds), got {seconds!r}")
        if self.max_aspect_ratio is not None and not self.max_aspect_ratio >= 1:
            raise MmtokError(f"max_aspect_ratio must be >= 1 or null, got {self.max_aspect_ratio!r}")

    @property
    def counts_captions(self) -> bool:
        return self.mode in CAPTION_MODES

    @property
    def document_totals_exact(self) -> bool:
        """False where the encoder adds document text the plan does not count."""
        return self.mode not in ENCODER_TEXT_MODES

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], source: str = "parameters") -> "PlanParameters":
        """Build from a preset-style mapping; unknown keys are refused, naming `source`."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise MmtokError(f"{source}: unknown plan parameter(s) {unknown}; known: {sorted(known)}")
        values = dict(data)
        if "cost_model" in values:
            values["cost_model"] = CostModel.from_mapping(values["cost_model"] or {}, source)
        try:
            return cls(**values)
        except TypeError as err:
            raise MmtokError(f"{source}: {err}") from None

    def override(self, **changes: Any) -> "PlanParameters":
        """A copy with the non-None `changes` applied (cost-model fields as `cost_<name>`)."""
        cost = {k[5:]: v for k, v in changes.items() if k.startswith("cost_") and v is not None}
        plain = {k: v for k, v in changes.items() if not k.startswith("cost_") and v is not None}
        if cost:
            plain["cost_model"] = dataclasses.replace(self.cost_model, **cost)
        return dataclasses.replace(self, **plain)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def available_presets() -> dict[str, Path]:
    """Preset name -> file, from ./plans (the working directory) and the repository's plans/."""
    found: dict[str, Path] = {}
    for folder in (REPO_PLANS, Path.cwd() / "plans"):
        if folder.is_dir():
            found.update({p.stem: p for p in sorted(folder.glob("*.yaml"))})
    return found


def load_preset(name_or_path: str) -> PlanParameters:
    """Parameters from a preset name (plans/NAME.yaml) or a YAML file path."""
    import yaml

    path = Path(name_or_path)
    if not path.is_file():
        presets = available_presets()
        if name_or_path not in presets:
            raise MmtokError(f"plan preset {name_or_path!r} not found; pass a YAML path or one of "
                             f"{', '.join(sorted(presets)) or '(none: plans/ is missing)'}")
        path = presets[name_or_path]
    try:
        data = yaml.safe_load(path.read_text("utf-8")) or {}
    except yaml.YAMLError as err:
        raise MmtokError(f"plan preset {path} is not valid YAML: {err}") from None
    if not isinstance(data, Mapping):
        raise MmtokError(f"plan preset {path} must hold a mapping of parameters, got {type(data).__name__}")
    cost = data.get("cost_model")
    if isinstance(cost, Mapping) and "source" not in cost:  # the preset's own numbers: say whose
        data = {**data, "cost_model": {**cost, "source": f"preset {name_or_path}"}}
    return PlanParameters.from_mapping(data, source=str(path))


# -- the cost model file `mmtok calibrate` writes: its `cost_model:` is what `CostModel.from_file` reads -----
def write_calibration(path: str | os.PathLike, result: dict) -> None:
    """Write `result` (`mmtok.plan.calibrate.Calibration.to_json()`) as YAML atomically (a crash leaves the old
    file or none): `cost_model:` in block style, then `calibration:` with one line per timing row."""
    import yaml

    class Dumper(yaml.SafeDumper):
        pass

    Dumper.add_representer(_Row, lambda dumper, row: dumper.represent_mapping("tag:yaml.org,2002:map", row,
                                                                              flow_style=True))
    evidence = {**result["calibration"], "timings": [_Row(row) for row in result["calibration"]["timings"]]}
    text = "".join([
        "# Encoder cost model measured by `mmtok calibrate` (`calibration:` holds the evidence).\n",
        f"# Use it: mmtok plan MANIFEST --out PLAN --cost-model {path} ...\n",
        yaml.safe_dump({"cost_model": result["cost_model"]}, sort_keys=False, width=1 << 16),
        yaml.dump({"calibration": evidence}, Dumper=Dumper, sort_keys=False, default_flow_style=None, width=1 << 16),
    ])
    atomic_write_bytes(path, text.encode("utf-8"))


class _Row(dict):
    """A timing row, written on one line."""
