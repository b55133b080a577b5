"""The planner: ``plan(profile, cluster, global_batch, ...)`` searches every split for the best.

``space.py`` enumerates the outer candidates, ``bounds.py`` bounds them cheaply, ``ilp.py`` solves
the stage split and per-layer recompute of one candidate exactly, ``planner.py`` orchestrates
(pruning, top-k, progress, time budget) and ``layout.py`` writes the tensor-parallel layout.
"""

from __future__ import annotations

from autopar.search.options import SearchOptions
from autopar.search.planner import plan, plan_from_config

__all__ = ["SearchOptions", "plan", "plan_from_config"]
