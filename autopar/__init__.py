"""autopar: an automatic parallelism planner for training large models.

Public names (see DESIGN.md): ``profile``, ``estimate``, ``plan``, ``ParallelConfig``, ``Plan``,
``Cluster``, ``models``, ``load_model_file``, ``InfeasiblePlanError``, ``FRAMEWORKS``,
``Framework``. Heavy modules (torch,
pulp) are imported on first use so ``import autopar`` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

import autopar.plan as _plan_module  # noqa: F401  (bound before ``plan`` below shadows it)
from autopar.config import ParallelConfig
from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.plan import Plan

__all__ = [
    "FRAMEWORKS",
    "SETTINGS",
    "AutoparError",
    "Cluster",
    "Estimate",
    "Framework",
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
    "FRAMEWORKS": ("autopar.cost_model.frameworks", "FRAMEWORKS"),
    "Framework": ("autopar.cost_model.frameworks", "Framework"),
    "SETTINGS": ("autopar.cost_model.frameworks", "SETTINGS"),
    "estimate": ("autopar.costing", "estimate"),
    "ModelProfile": ("autopar.graph.types", "ModelProfile"),
    "profile": ("autopar.graph", "profile"),
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


def plan(
    profile: Any,
    cluster: Any,
    global_batch: int,
    *,
    framework: str | None = None,
    **kwargs: Any,
) -> Any:
    """Search for the best split for ``framework`` (a name in ``FRAMEWORKS``; default
    "autopar"); see ``autopar.search.plan`` for the other keywords (the package's ``plan`` name
    is this function, not the ``autopar.plan`` module, which holds the Plan record)."""
    from autopar.search import plan as _search_plan

    return _search_plan(profile, cluster, global_batch, framework=framework, **kwargs)
