"""The framework record of the hand-made CostTables in the search and assemble tests."""

from __future__ import annotations

import dataclasses

from autopar.cost_model.frameworks import get_framework

# autopar's record without the two per-step terms the tests' own step formulas leave out:
# no compute slowdown under overlapped collectives, no fixed seconds per step.
PLAIN_FRAMEWORK = dataclasses.replace(
    get_framework("autopar"), overlap_slowdown=0.0, step_overhead_s=0.0)
