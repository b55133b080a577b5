"""Graph capture and per-layer profiling: ``profile(model) -> ModelProfile``.

``profile`` (and torch) is imported on first use, so ``autopar.graph.types`` stays light for the
cost model and the search, which only read the records.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopar.graph.types import LayerProfile, ModelProfile, TPStructure

__all__ = ["LayerProfile", "ModelProfile", "TPStructure", "profile"]


def __getattr__(name: str) -> Any:
    if name != "profile":
        raise AttributeError(f"module 'autopar.graph' has no attribute {name!r}")
    value = importlib.import_module("autopar.graph.profiler").profile
    globals()[name] = value
    return value
