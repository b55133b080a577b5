"""Argument types for the command line: every number is checked here, once, before any work.

Each type rejects text that is not a number, NaN and infinities, and values outside a sane range,
with a message argparse prints as one ``autopar: error: argument --x: ...`` line. The ranges are
the library's own bounds (``MAX_GPUS``, ``MAX_GLOBAL_BATCH``, ``MAX_SEQ_LEN``), so that no loop
over a size (divisors, candidates) can start on an absurd value.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

__all__ = ["MAX_SEED", "framework_spec", "int_in", "positive_float"]

# The runs' seeds are mixed with the step into torch's signed 64-bit generator seed
# (runtime/data.py: seed * 1,000,003 + step): 43 bits keep that in range (a millisecond
# timestamp fits).
MAX_SEED = 2**43 - 1
# Optimizer steps a command runs or counts (run, verify, export's slurm script): a billion,
# decades of any real training, so a typo in the digits cannot start an endless job.
MAX_STEPS = 10**9
# torchrun restarts of a failed group.
MAX_RESTARTS = 1000


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``[low, high]`` (``8``, ``8.0`` and ``1e3`` are integers)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            number = _number(text)
            if not number.is_integer():
                raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
            value = int(number)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value

    parse.__name__ = "integer"
    return parse


def positive_float(high: float, low: float = 0.0) -> Callable[[str], float]:
    """An argparse type: a finite number in ``(0, high]`` (at least ``low`` when given)."""

    def parse(text: str) -> float:
        value = _number(text)
        if not (0 < value <= high and value >= low):
            bound = f"at least {low:g}" if low else "above 0"
            raise argparse.ArgumentTypeError(f"must be {bound} and at most {high:g}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def framework_spec(text: str) -> str:
    """An argparse type: a framework name with optional settings (``megatron-lm+tp-comm-overlap``),
    returned in its canonical form (settings sorted)."""
    from autopar.cost_model.frameworks import get_framework

    try:
        return get_framework(text).spec
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


framework_spec.__name__ = "framework"
