"""Graph capture and per-layer profiling: ``profile(model) -> ModelProfile``.

``profile`` (and torch) is imported on first use, so ``autopar.graph.types`` stays light for the
cost model and the search, which only read the records.
"""

from __future__ import annotations

from autopar.graph.types import LayerProfile, ModelProfile, TPStructure
from autopar.lazy import lazy_getattr

__all__ = ["LayerProfile", "ModelProfile", "TPStructure", "profile"]


__getattr__ = lazy_getattr(__name__, {"profile": "autopar.graph.profiler"}, globals())
