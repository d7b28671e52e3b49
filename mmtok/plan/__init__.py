"""`mmtok plan`: manifest -> deterministic, shape-uniform GPU batches balanced across ranks.

Stages: `rows` (read, filter, target shapes) -> `batching` (windows, batches, balance splits) -> `core`
(rank ranges via `mmtok.ranks`, plan files via `mmtok.formats.plan`). `calibrate` fits the cost model
the planner balances with (`mmtok calibrate`). The parameters and presets are `mmtok.formats.presets`;
the caption normalisation the encoder shares is `mmtok.text.caption_text`; `mmtok plan --explain` and
`mmtok inspect` read a plan with `mmtok.tools.explain`. The same rank ranges for another world size:
`mmtok.formats.plan.Plan.rank_range`.
"""

from mmtok.plan.core import build_plan, rank_summary
from mmtok.plan.rows import window_bounds

__all__ = ["build_plan", "rank_summary", "window_bounds"]
