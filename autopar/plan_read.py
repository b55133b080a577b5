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

__all__ = ["PlanFieldError", "check_estimate", "cluster_size", "estimate_doc",
           "estimate_stages_problem", "layer_names_problem", "moe_doc", "number", "search_fields",
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
    try:
        return float(value)
    except OverflowError:  # an integer of hundreds of digits: no float holds it
        raise PlanFieldError(f"plan {name} is far too large: {_shown(value)}") from None


# The longest one-line field (a model name or path) a plan holds: reports and headers print it.
MAX_LINE_CHARS = 4096


def text(value: Any, name: str, *, line: bool = False) -> str:
    """``value`` as a string (``line``: printable, one line of at most ``MAX_LINE_CHARS``: it
    is shown in reports and written into exports' headers, where a newline or a terminal
    control would be read as more)."""
    if not isinstance(value, str):
        raise PlanFieldError(f"plan {name} must be a string, got {_shown(value)}")
    if line and not (value.isprintable() and len(value) <= MAX_LINE_CHARS):
        raise PlanFieldError(f"plan {name} must be one line of printable text of at most "
                             f"{MAX_LINE_CHARS:,} characters, got {_shown(value)}")
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
# A bound on the search's counts far above any search (millions of candidates at most): a
# hand-edited count of hundreds of digits is no count to print.
MAX_SEARCH_COUNT = 10**12


def search_fields(value: Any) -> dict[str, Any]:
    """The ``search`` object's fields, each checked (counts whole, flags true/false, the gap a
    finite number); an unknown key is an error, as it would be to ``SearchInfo``."""
    if not isinstance(value, dict):
        raise PlanFieldError(f"plan search must be an object, got {_shown(value)}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if key in _SEARCH_COUNTS:
            out[key] = whole(item, f"search.{key}", high=MAX_SEARCH_COUNT)
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
    numbered blocks 0, 1, ... in order (exports name each stage's modules from these)."""
    if ("embedding" in names or "head" in names) and (
            names[0] != "embedding" or names[-1] != "head"
            or names.count("embedding") + names.count("head") != 2):
        return (f"the plan's stages do not run from the embedding to the head (layers "
                f"{_shown(names[0])} .. {_shown(names[-1])})")
    blocks = [int(m.group(1)) for m in map(_BLOCK_INDEX.search, names) if m]
    if any(b <= a for a, b in itertools.pairwise(blocks)):
        return "the plan's blocks are not in order (layers.0, layers.1, ...)"
    if blocks != list(range(len(blocks))):  # a module list's indices: 0, 1, ... without a gap
        return (f"the plan's {len(blocks)} blocks are not layers.0 .. layers.{len(blocks) - 1} "
                f"(found layers.{blocks[0]} .. layers.{blocks[-1]})")
    return None


def _fields_of(value: Any, cls: type, name: str) -> dict[str, Any]:
    """``value`` as an object whose keys are fields of the dataclass ``cls``."""
    import dataclasses

    if not isinstance(value, dict):
        raise PlanFieldError(f"plan {name} must be an object, got {_shown(value)}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in value if k not in known)
    if unknown:
        raise PlanFieldError(f"plan {name} has unknown field(s) {', '.join(unknown)}")
    return value


def _kept(value: Any, name: str) -> Any:
    """``value`` itself once ``number`` accepts it (a 0 stays 0: plans round-trip byte for
    byte)."""
    number(value, name)
    return value


def _numbers(value: Any, cls: type, name: str) -> dict[str, Any]:
    """An object of ``cls``'s number fields, each finite and >= 0."""
    return {k: _kept(v, f"{name}.{k}") for k, v in _fields_of(value, cls, name).items()}


def _stage(value: Any, name: str, pp: int) -> dict[str, Any]:
    from autopar.cost_model.estimate import MemoryBreakdown, StageEstimate

    data = _fields_of(value, StageEstimate, name)
    chunks = data.get("stages", [])
    pairs = data.get("layers", [])
    if not isinstance(chunks, list) or not isinstance(pairs, list):
        raise PlanFieldError(f"plan {name}.stages and .layers must be lists")
    return {"rank": whole(data.get("rank"), f"{name}.rank", high=pp - 1),
            "stages": [whole(c, f"{name}.stages[{i}]") for i, c in enumerate(chunks)],
            "layers": [list(whole_pair(r, f"{name}.layers[{i}]")) for i, r in enumerate(pairs)],
            "num_params": whole(data.get("num_params"), f"{name}.num_params"),
            "time_per_microbatch_s": _kept(data.get("time_per_microbatch_s"),
                                           f"{name}.time_per_microbatch_s"),
            "memory": _numbers(data.get("memory", {}), MemoryBreakdown, f"{name}.memory")}


def estimate_doc(value: Any, pp: int) -> dict[str, Any]:
    """The plan's ``estimate`` object, every field checked: numbers finite and >= 0 (the
    breakdowns and each pipeline rank's figures too, its rank below ``pp``), ``fits`` true or
    false, the interval two numbers low <= high, the words text; an unknown key is an error."""
    from autopar.cost_model.estimate import Estimate, MemoryBreakdown, TimeBreakdown

    data = dict(_fields_of(value, Estimate, "estimate"))
    for key, item in data.items():
        name = f"estimate.{key}"
        if key == "fits":
            if not isinstance(item, bool):
                raise PlanFieldError(f"plan {name} must be true or false, got {_shown(item)}")
        elif key in ("binding", "framework", "precision"):
            data[key] = text(item, name, line=True)  # printed by reports
        elif key == "time_breakdown":
            data[key] = _numbers(item, TimeBreakdown, name)
        elif key == "memory_breakdown":
            data[key] = _numbers(item, MemoryBreakdown, name)
        elif key == "stages":
            if not isinstance(item, list):
                raise PlanFieldError(f"plan {name} must be a list, got {_shown(item)}")
            data[key] = [_stage(s, f"{name}[{i}]", pp) for i, s in enumerate(item)]
        elif key == "step_time_interval_s":
            if not isinstance(item, list) or len(item) != 2:
                raise PlanFieldError(f"plan {name} must be [low, high], got {_shown(item)}")
            if number(item[0], f"{name}[0]") > number(item[1], f"{name}[1]"):
                raise PlanFieldError(f"plan {name} must have low <= high, got {_shown(item)}")
        else:
            data[key] = _kept(item, name)
    if data.get("mfu", 0.0) > 2.0:  # fp8 against the 16-bit peak stays below 2
        raise PlanFieldError(f"plan estimate.mfu must be at most 2, got {_shown(data['mfu'])}")
    return data


def moe_doc(value: Any) -> dict[str, Any]:
    """The plan's ``moe`` object (a ``MoEStructure``), every field checked: counts whole and in
    range (top_k at most the experts), the capacity factor and router imbalance as the model
    spec bounds them, the words one printable line; an unknown key is an error."""
    from autopar.graph.types import MoEStructure
    from autopar.models.spec import (
        MAX_CAPACITY_FACTOR,
        MAX_ROUTER_IMBALANCE,
        router_imbalance_valid,
    )

    data = dict(_fields_of(value, MoEStructure, "moe"))
    experts = whole(data.get("experts"), "moe.experts", low=1)
    # top_k 0: the profile found no k (graph.moe.routed_top_k); the cost model assumes one.
    out: dict[str, Any] = {"experts": experts,
                           "top_k": whole(data.get("top_k"), "moe.top_k", high=experts)}
    for key, low in (("shared_experts", 0), ("hidden", 1), ("expert_hidden", 1),
                     ("expert_params", 1)):
        if key in data or low:
            out[key] = whole(data.get(key), f"moe.{key}", low=low)
    for key, valid, bound in (
            ("capacity_factor", lambda v: v < MAX_CAPACITY_FACTOR,
             f"below {MAX_CAPACITY_FACTOR:g} (0: dropless)"),
            ("router_imbalance", router_imbalance_valid,
             f"0 (unknown) or from 1 to {MAX_ROUTER_IMBALANCE:g}")):
        if key in data:
            out[key] = _kept(data[key], f"moe.{key}")
            if not valid(out[key]):
                raise PlanFieldError(f"plan moe.{key} must be {bound}, got {_shown(out[key])}")
    for key in ("ep_blocker", "module"):
        if key in data:
            out[key] = text(data[key], f"moe.{key}", line=True)
    if "expert_tp_folded" in data:
        if not isinstance(data["expert_tp_folded"], bool):
            raise PlanFieldError("plan moe.expert_tp_folded must be true or false")
        out["expert_tp_folded"] = data["expert_tp_folded"]
    return out


# Estimate fields that are plain numbers: finite and >= 0 in any plan autopar reads or writes.
_ESTIMATE_NUMBERS = ("step_time_s", "tokens_per_s", "tflops_per_gpu", "hardware_tflops_per_gpu",
                     "mfu", "memory_per_gpu_bytes", "memory_capacity_bytes")


def check_estimate(estimate: Any) -> None:
    """Each figure a number, finite and >= 0; ``fits`` a boolean (a NaN must never read as fits)."""
    for name in _ESTIMATE_NUMBERS:
        value = getattr(estimate, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlanFieldError(f"plan estimate.{name} must be a number, got {value!r}")
        if not 0 <= value < math.inf:
            raise PlanFieldError(f"plan estimate.{name} must be finite and >= 0, got {value!r}")
    if not isinstance(estimate.fits, bool):
        raise PlanFieldError(f"plan estimate.fits must be true or false, got {estimate.fits!r}")
    if estimate.fits and estimate.memory_per_gpu_bytes > estimate.memory_capacity_bytes:
        raise PlanFieldError(
            f"plan estimate says it fits, but its memory_per_gpu_bytes "
            f"{estimate.memory_per_gpu_bytes:.4g} exceeds its memory_capacity_bytes "
            f"{estimate.memory_capacity_bytes:.4g}; re-create the plan with `autopar plan`")
    low, high = estimate.step_time_interval_s
    if high and not low <= estimate.step_time_s <= high:  # (0, 0): no interval recorded
        raise PlanFieldError(f"plan estimate.step_time_interval_s {[low, high]} does not hold "
                              f"its step_time_s {estimate.step_time_s}")


def estimate_stages_problem(estimate: Any, stages: tuple[Any, ...]) -> str | None:
    """Why the estimate's pipeline ranks do not hold the plan's stages (None when they do)."""
    for rank in estimate.stages:
        for chunk, pair in zip(rank.stages, rank.layers, strict=False):
            if chunk >= len(stages) or tuple(pair) != stages[chunk].layers:
                return (f"the estimate's pipeline rank {rank.rank} holds layers {list(pair)} as "
                        f"stage {chunk}, which the plan's stages do not")
    return None
