"""Cost model: cluster description and the time and memory of any split.

``estimate(profile, cluster, config, split=, recompute=) -> Estimate`` (a Plan's own split:
``autopar.costing.estimate``); ``build_cost_table(profile, cluster,
config) -> CostTable`` (the per-layer terms the search's ILP shares with ``estimate``).
"""

from __future__ import annotations

from autopar.cost_model.estimator import estimate
from autopar.cost_model.hardware import Cluster, DeviceSpec, LinkSpec
from autopar.cost_model.layer_costs import build_cost_table
from autopar.cost_model.validate import check_config

__all__ = ["Cluster", "DeviceSpec", "LinkSpec", "build_cost_table", "check_config", "estimate"]
