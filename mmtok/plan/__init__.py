"""`mmtok plan`: manifest -> deterministic, shape-uniform GPU batches balanced across ranks.

Stages: `rows` (read, filter, target shapes) -> `batching` (windows, lanes, batches) -> `core`
(rank ranges via `ranks`, plan files via `mmtok.formats.plan`). Public API: `PlanParameters`,
`CostModel`, `load_preset`, `available_presets`, `build_plan`, `caption_text` (the caption
normalisation the encoder shares), `partition_ranks` / `allowed_cuts` (the same rank ranges for
another world size), `explain_plan` (`mmtok plan --explain`, `mmtok inspect`).
"""

from mmtok.plan.batching import allowed_cuts, window_bounds
from mmtok.plan.captions import caption_text
from mmtok.plan.core import build_plan, rank_summary
from mmtok.plan.explain import explain_plan
from mmtok.plan.params import CAPTION_MODES, MODES, CostModel, PlanParameters, available_presets, load_preset
from mmtok.plan.ranks import imbalance, partition_ranks, rank_costs

__all__ = [
    "CAPTION_MODES", "MODES", "CostModel", "PlanParameters", "allowed_cuts", "available_presets", "build_plan",
    "caption_text", "explain_plan", "imbalance", "load_preset", "partition_ranks", "rank_costs", "rank_summary",
    "window_bounds",
]
