"""The names of the training frameworks autopar predicts for, and which one is the default.

A leaf module (no imports) so that every layer, the Estimate and Plan records included, names
them from one place; each name's record is in ``frameworks.py``.
"""

from __future__ import annotations

__all__ = ["DEFAULT_FRAMEWORK", "FRAMEWORKS", "RUNTIME"]

RUNTIME = "autopar"  # the record of this project's own runtime (what `autopar run` runs)
DEFAULT_FRAMEWORK = RUNTIME  # what a plan or an estimate is made for unless one is named
FRAMEWORKS: tuple[str, ...] = (RUNTIME, "torchtitan", "megatron-lm", "deepspeed")
