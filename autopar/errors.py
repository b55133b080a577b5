"""Errors autopar raises for bad input.

Every error a user can cause derives from ``AutoparError``; its message is one line naming what is
wrong and what to do. The CLI prints ``str(error)`` and exits with code 2, never a traceback.
"""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "ClusterConfigError",
    "InfeasiblePlanError",
    "ModelFileError",
    "PlanMismatchError",
    "TraceError",
    "UnknownModelError",
]


class AutoparError(Exception):
    """A user-facing error: the message says what is wrong and how to fix it."""


class ModelFileError(AutoparError):
    """A model file is missing, does not import, or lacks ``build_model``/``example_inputs``."""


class UnknownModelError(AutoparError, ValueError):
    """A model name or spec that autopar does not know."""


class TraceError(AutoparError):
    """A model that none of the capture paths (fx, export, module-level) could profile."""


class ClusterConfigError(AutoparError, ValueError):
    """A cluster description with a missing or impossible field."""


class PlanMismatchError(AutoparError, ValueError):
    """A plan that does not match the model, the cluster or the launch (fingerprints, world)."""


class InfeasiblePlanError(AutoparError):
    """No split of the model fits the cluster's memory.

    Attributes:
        min_memory_bytes: the smallest per-GPU peak memory any candidate would need.
        closest: a short description of the split that came closest (e.g. "dp=1 tp=8 pp=16 ...").
    """

    def __init__(self, message: str, *, min_memory_bytes: float = 0.0, closest: str = "") -> None:
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.closest = closest
