"""`mmtok plan`: manifest -> deterministic, shape-uniform GPU batches balanced across ranks.

Stages: `rows` (read, filter, target shapes) -> `batching` (windows, batches, balance splits) -> `core`
(rank ranges via `mmtok.ranks`, plan files via `mmtok.formats.plan`). Public API: `PlanParameters`,
`CostModel`, `load_preset`, `available_presets`, `build_plan`, `caption_text` (the caption
normalisation the encoder shares), `explain_plan` (`mmtok plan --explain`, `mmtok inspect`). The
same rank ranges for another world size: `mmtok.formats.plan.Plan.rank_range`.
"""

from mmtok.plan.batching import window_bounds
from mmtok.plan.captions import caption_text
from mmtok.plan.core import build_plan, rank_summary
from mmtok.plan.explain import explain_plan
from mmtok.plan.params import CAPTION_MODES, MODES, CostModel, PlanParameters, available_presets, load_preset

__all__ = [
    "CAPTION_MODES", "MODES", "CostModel", "PlanParameters", "available_presets", "build_plan", "caption_text",
    "explain_plan", "load_preset", "rank_summary", "window_bounds",
]
