"""autopar: an automatic parallelism planner for training large models.

Public names (see DESIGN.md): ``profile``, ``estimate``, ``plan``, ``ParallelConfig``, ``Plan``,
``Cluster``, ``models``, ``load_model_file``, ``InfeasiblePlanError``, ``FRAMEWORKS``,
``Framework``. Heavy modules (torch,
pulp) are imported on first use so ``import autopar`` stays fast.
"""

from __future__ import annotations

from typing import Any

import autopar.plan as _plan_module  # noqa: F401  (bound before ``plan`` below shadows it)
from autopar.config import ParallelConfig
from autopar.errors import AutoparError, InfeasiblePlanError
from autopar.lazy import lazy_getattr
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

# name -> the module it is read from, on first use (PEP 562; autopar.lazy).
_LAZY: dict[str, str] = {
    "Cluster": "autopar.cost_model.hardware",
    "Estimate": "autopar.cost_model.estimate",
    "FRAMEWORKS": "autopar.cost_model.frameworks",
    "Framework": "autopar.cost_model.frameworks",
    "SETTINGS": "autopar.cost_model.frameworks",
    "estimate": "autopar.costing",
    "ModelProfile": "autopar.graph.types",
    "profile": "autopar.graph",
    "load_model_file": "autopar.models.model_file",
    "models": "autopar.models",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())


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
