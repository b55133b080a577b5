"""Strict readers of a plan document's fields: each value the type the schema names, or one error.

A plan file is data a user may have edited or received: a field of the wrong type must fail as
``PlanFormatError`` naming the field, never later as an internal error in an exporter or a
report (a ``"1"`` schema version, a one-element layer range, a float node count that would skip
the world-size check, a string where a number is printed). Python's ``int()`` and ``dict()`` are
too lenient for that (``int("16")``, ``int(1.5)``, ``int(True)``), so these readers check types.
"""

from __future__ import annotations

import itertools
import math
import re
import reprlib
from typing import Any

__all__ = ["PlanFieldError", "cluster_size", "layer_names_problem", "number", "search_fields",
           "text", "text_map", "texts", "whole", "whole_pair"]


class PlanFieldError(ValueError):
    """A field of a plan document that has the wrong type or an impossible value."""


def _shown(value: Any) -> str:
    # A bounded repr: the field may hold a huge list or string.
    return reprlib.repr(value)


def whole(value: Any, name: str, *, low: int = 0, high: int | None = None) -> int:
    """``value`` as an int in [low, high]: a JSON integer, not a bool, float or string."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlanFieldError(f"plan {name} must be a whole number, got {_shown(value)}")
    if value < low or (high is not None and value > high):
        bound = f"from {low:,} to {high:,}" if high is not None else f"at least {low:,}"
        raise PlanFieldError(f"plan {name} must be {bound}, got {_shown(value)}")
    return value


def number(value: Any, name: str) -> float:
    """``value`` as a finite number >= 0 (int or float, not a bool or string)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise PlanFieldError(f"plan {name} must be a number, got {_shown(value)}")
    if not 0 <= value < math.inf:
        raise PlanFieldError(f"plan {name} must be finite and >= 0, got {_shown(value)}")
    return float(value)


def text(value: Any, name: str, *, line: bool = False) -> str:
    """``value`` as a string (``line``: printable, one line: it is shown in reports and written
    into exports' headers, where a newline or a terminal control would be read as more)."""
    if not isinstance(value, str):
        raise PlanFieldError(f"plan {name} must be a string, got {_shown(value)}")
    if line and not value.isprintable():
        raise PlanFieldError(f"plan {name} must be one line of printable text, got "
                             f"{_shown(value)}")
    return value


def texts(value: Any, name: str) -> tuple[str, ...]:
    """``value`` as a list of strings."""
    if not isinstance(value, list):
        raise PlanFieldError(f"plan {name} must be a list of strings, got {_shown(value)}")
    return tuple(text(v, f"{name}[{i}]") for i, v in enumerate(value))


def text_map(value: Any, name: str) -> dict[str, str]:
    """``value`` as an object of string values."""
    if not isinstance(value, dict):
        raise PlanFieldError(f"plan {name} must be an object, got {_shown(value)}")
    return {text(k, f"{name} key"): text(v, f"{name}[{k!r}]") for k, v in value.items()}


def whole_pair(value: Any, name: str) -> tuple[int, int]:
    """``value`` as ``[first, last]``: two whole numbers."""
    if not isinstance(value, list) or len(value) != 2:
        raise PlanFieldError(f"plan {name} must be [first, last], got {_shown(value)}")
    return whole(value[0], f"{name}[0]"), whole(value[1], f"{name}[1]")


# SearchInfo's fields and the type each holds in JSON.
_SEARCH_COUNTS = ("candidates_considered", "candidates_pruned", "ilps_solved")
_SEARCH_FLAGS = ("optimal", "time_limit_hit")


def search_fields(value: Any) -> dict[str, Any]:
    """The ``search`` object's fields, each checked (counts whole, flags true/false, the gap a
    finite number); an unknown key is an error, as it would be to ``SearchInfo``."""
    if not isinstance(value, dict):
        raise PlanFieldError(f"plan search must be an object, got {_shown(value)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in _SEARCH_COUNTS:
            out[key] = whole(item, f"search.{key}")
        elif key in _SEARCH_FLAGS:
            if not isinstance(item, bool):
                raise PlanFieldError(f"plan search.{key} must be true or false, got {_shown(item)}")
            out[key] = item
        elif key == "mip_gap":
            out[key] = number(item, "search.mip_gap")
        else:
            raise PlanFieldError(f"plan search has an unknown field {key!r}")
    return out


def cluster_size(cluster: Any) -> dict[str, Any]:
    """The ``cluster`` object, its ``nodes`` and ``gpus_per_node`` (when present) whole numbers
    >= 1: the world-size check reads them."""
    if not isinstance(cluster, dict):
        raise PlanFieldError(f"plan cluster must be an object, got {_shown(cluster)}")
    for key in ("nodes", "gpus_per_node"):
        if key in cluster:
            whole(cluster[key], f"cluster.{key}", low=1)
    return dict(cluster)


_BLOCK_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)$")


def layer_names_problem(names: list[str]) -> str | None:
    """Why the stages' layers, in order, do not read as a model does (None when they do): the
    embedding first and the head last (one without the other is a plan cut short), the
    numbered blocks in increasing order (exports name each stage's modules from these)."""
    if ("embedding" in names or "head" in names) and (
            names[0] != "embedding" or names[-1] != "head"
            or names.count("embedding") + names.count("head") != 2):
        return (f"the plan's stages do not run from the embedding to the head (layers "
                f"{_shown(names[0])} .. {_shown(names[-1])})")
    blocks = [int(m.group(1)) for m in map(_BLOCK_INDEX.search, names) if m]
    if any(b <= a for a, b in itertools.pairwise(blocks)):
        return "the plan's blocks are not in order (layers.0, layers.1, ...)"
    return None
