"""autopar: an automatic parallelism planner for training large models.

Public names (see DESIGN.md): ``profile``, ``estimate``, ``plan``, ``ParallelConfig``, ``Plan``,
``Cluster``, ``models``, ``load_model_file``, ``InfeasiblePlanError``. Heavy modules (torch,
pulp) are imported on first use so ``import autopar`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopar.config import ParallelConfig
from autopar.errors import AutoparError, InfeasiblePlanError

__all__ = [
    "AutoparError",
    "Cluster",
    "Estimate",
    "InfeasiblePlanError",
    "ModelProfile",
    "ParallelConfig",
    "Plan",
    "estimate",
    "load_model_file",
    "models",
    "plan",
    "profile",
]

__version__ = "0.1.0"

# name -> (module, attribute); resolved lazily by __getattr__ (PEP 562).
_LAZY: dict[str, tuple[str, str | None]] = {
    "Cluster": ("autopar.cost_model.hardware", "Cluster"),
    "Estimate": ("autopar.cost_model.estimate", "Estimate"),
    "estimate": ("autopar.cost_model", "estimate"),
    "ModelProfile": ("autopar.graph.types", "ModelProfile"),
    "profile": ("autopar.graph", "profile"),
    "Plan": ("autopar.plan", "Plan"),
    "plan": ("autopar.search", "plan"),
    "load_model_file": ("autopar.models.model_file", "load_model_file"),
    "models": ("autopar.models", None),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module_name, attr = _LAZY[name]
    module = importlib.import_module(module_name)
    value = module if attr is None else getattr(module, attr)
    globals()[name] = value
    return value
