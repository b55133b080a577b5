"""autopar.runtime: run a Plan on torch.distributed (mesh, TP, recompute, DP, pipeline, step).

Public: ``build_mesh``, ``apply_plan``, ``ParallelizedModel``, ``check_plan_runnable``,
``train_step``, ``local_batch``. Submodules import torch; ``import autopar.runtime`` stays cheap
because these names resolve on first use.
"""

from __future__ import annotations

from autopar.lazy import lazy_getattr

__all__ = [
    "ParallelizedModel",
    "apply_plan",
    "build_mesh",
    "check_plan_runnable",
    "count_collectives",
    "local_batch",
    "train_step",
]

_LAZY: dict[str, str] = {
    "ParallelizedModel": "autopar.runtime.apply",
    "apply_plan": "autopar.runtime.apply",
    "check_plan_runnable": "autopar.runtime.apply",
    "build_mesh": "autopar.runtime.mesh",
    "count_collectives": "autopar.runtime.comm_count",
    "local_batch": "autopar.runtime.step",
    "train_step": "autopar.runtime.step",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())
