"""SearchOptions: every knob of the planner in one frozen record.

The defaults search the whole space the runtime can execute; narrow it (schedules, tp limits,
micro-batch sizes) to plan faster or to match what a cluster allows.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any

from autopar.config import DTYPES, MAX_GLOBAL_BATCH, MAX_SEQ_LEN, OFFLOADS, SCHEDULES, ZERO_STAGES
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK
from autopar.cost_model.hardware import MAX_GPUS

__all__ = ["SOLVERS", "SearchOptions"]

SOLVERS: tuple[str, ...] = ("highs", "cbc")
# sourced: Llama 3 (arXiv:2407.21783, section 3.3.4) trained its 131,072-token context with
# cp = 16, 8,192 tokens per rank; Megatron-Core's context-parallel guide suggests cp for
# sequences of 8K tokens and longer. The search stops at this many tokens per rank.
MIN_CP_TOKENS = 8192
# The most model chunks per rank (a bound on a typo, far above any schedule's use).
_MAX_VIRTUAL_STAGES = 1024
# Switches (True / False only: a string such as "no" would read as on).
_FLAGS = ("allow_zero_bubble", "allow_tp_across_nodes", "robust", "context_parallel", "hsdp",
          "settings_search")
# Whole-number fields: (low, high); None allowed where the default is None.
_COUNTS = {"max_virtual_stages": (2, _MAX_VIRTUAL_STAGES), "max_tp": (1, MAX_GPUS),
           "max_cp": (1, MAX_GPUS), "min_cp_tokens": (1, MAX_SEQ_LEN)}


def _whole(name: str, value: Any, low: int, high: int) -> None:
    # numbers.Integral: Python's and numpy's integers, not bool (a flag read as 0 or 1).
    if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
            or not low <= int(value) <= high):
        raise ValueError(f"SearchOptions.{name} must be a whole number from {low:,} to "
                         f"{high:,}, got {value!r}")


def _real(name: str, value: Any, low: float, high: float, *, high_open: bool = True) -> None:
    number = float(value) if isinstance(value, numbers.Real) else math.nan
    if (isinstance(value, bool) or not isinstance(value, numbers.Real)
            or not (low <= number < high if high_open else low <= number <= high)):
        bound = (f"a finite number >= {low:g}" if high == math.inf else
                 f"a number from {low:g} to {high:g}{' (excluded)' if high_open else ''}")
        raise ValueError(f"SearchOptions.{name} must be {bound}, got {value!r}")


def _check_types(options: SearchOptions) -> None:
    """Every field's type and range (a NaN, a string or a negative would be read as data)."""
    for name in _FLAGS:
        if not isinstance(getattr(options, name), bool):
            raise ValueError(f"SearchOptions.{name} must be True or False, got "
                             f"{getattr(options, name)!r}")
    for name, (low, high) in _COUNTS.items():
        value = getattr(options, name)
        if value is not None or name in ("max_virtual_stages", "min_cp_tokens"):
            _whole(name, value, low, high)
    _real("time_limit_s", options.time_limit_s, 0.0, math.inf)  # NaN and inf refused too
    if options.time_limit_s == 0:
        raise ValueError("SearchOptions.time_limit_s must be > 0, got 0")
    _real("mip_gap", options.mip_gap, 0.0, 1.0)
    if options.memory_headroom_bytes is not None:
        _real("memory_headroom_bytes", options.memory_headroom_bytes, 0.0, math.inf)
    for name in ("schedules", "zero_stages", "sequence_parallel", "offloads"):
        if not isinstance(getattr(options, name), tuple):
            raise ValueError(f"SearchOptions.{name} must be a tuple, got "
                             f"{getattr(options, name)!r}")
    if not all(isinstance(v, bool) for v in options.sequence_parallel):
        raise ValueError("SearchOptions.sequence_parallel must hold True / False")
    for stage in options.zero_stages:
        _whole("zero_stages", stage, 0, max(ZERO_STAGES))
    if options.micro_batch_sizes is not None:
        if not isinstance(options.micro_batch_sizes, tuple):
            raise ValueError("SearchOptions.micro_batch_sizes must be a tuple or None")
        for size in options.micro_batch_sizes:
            _whole("micro_batch_sizes", size, 1, MAX_GLOBAL_BATCH)


def _as_python_numbers(options: SearchOptions) -> None:
    """numpy numbers (accepted above) held as Python's own: the search compares, sums and
    formats them as such."""
    def put(name: str, value: Any) -> None:
        object.__setattr__(options, name, value)

    for name in _COUNTS:
        if getattr(options, name) is not None:
            put(name, int(getattr(options, name)))
    for name in ("time_limit_s", "mip_gap", "memory_headroom_bytes"):
        if getattr(options, name) is not None:
            put(name, float(getattr(options, name)))
    put("zero_stages", tuple(int(z) for z in options.zero_stages))
    if options.micro_batch_sizes is not None:
        put("micro_batch_sizes", tuple(int(b) for b in options.micro_batch_sizes))


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchOptions:
    """How the planner searches.

    Attributes:
        time_limit_s: wall-clock limit of one ILP solve (the solver returns its best so far).
        mip_gap: relative MIP gap at which a solve stops (1e-4, HiGHS's own default; the oracle
            test holds to 0.1%).
        memory_headroom_bytes: if set, usable memory = device memory minus this, overriding the
            cluster's own headroom.
        schedules: pipeline schedules to consider (names from ``autopar.config.SCHEDULES``).
        allow_zero_bubble: consider the zero-bubble schedules (interleaved-zero-bubble,
            zbv-zero-bubble, dualpipe-v) when they are in ``schedules``.
        max_virtual_stages: largest number of model chunks per rank for interleaved schedules.
        max_tp: largest tensor-parallel degree (None: the node size, or the world size when
            ``allow_tp_across_nodes``).
        allow_tp_across_nodes: let tensor parallelism span nodes (slow links; off by default).
        zero_stages: ZeRO stages to consider.
        sequence_parallel: sequence-parallel settings to consider when tp > 1 (default on only:
            it saves activation memory at no extra communication in the ring model).
        micro_batch_sizes: micro-batch sizes to consider (None: every divisor of the
            per-replica batch).
        solver: "highs" (HiGHS through highspy, default) or "cbc" (pulp's bundled CBC).
        dtype: training precision of every candidate; None: the dtypes the GPU runs fast
            (``precision.supported_dtypes``: fp16 on V100, bf16 elsewhere, and fp8 on
            H100/H200) that the framework runs.
        context_parallel: consider context parallelism (cp > 1, powers of two).
        max_cp: largest context-parallel degree (None: any that divides the sequence).
        min_cp_tokens: fewest tokens per context-parallel rank (s / cp) to consider.
        hsdp: consider HSDP (dp_replicate > 1, the shard group filling one node).
        offloads: offload settings to consider for the candidates that need one to fit
            (``dimensions.py``).
        framework: the training framework that will run the plan (``FRAMEWORKS``): the search
            proposes only what it can run and costs it as it runs.
        robust: search with the framework's memory band kept free (each plan's memory times
            1 + band within the device; when nothing fits so, among what fits at all) and pick,
            among the best plans, the one with the best pessimistic step time (the high end of
            ``step_time_interval_s``).
        settings_search: also plan with each of the framework's searched settings it leaves off
            (``framework_settings.SEARCHED_SETTINGS``: ``expert-tp-1``) and keep the faster
            plan; False: the framework exactly as named.
    """

    time_limit_s: float = 10.0
    mip_gap: float = 1e-4
    memory_headroom_bytes: float | None = None
    schedules: tuple[str, ...] = SCHEDULES
    allow_zero_bubble: bool = True
    max_virtual_stages: int = 4
    max_tp: int | None = None
    allow_tp_across_nodes: bool = False
    zero_stages: tuple[int, ...] = ZERO_STAGES
    sequence_parallel: tuple[bool, ...] = (True,)
    micro_batch_sizes: tuple[int, ...] | None = None
    solver: str = "highs"
    dtype: str | None = None
    framework: str = DEFAULT_FRAMEWORK
    robust: bool = False
    context_parallel: bool = True
    max_cp: int | None = None
    min_cp_tokens: int = MIN_CP_TOKENS
    hsdp: bool = True
    offloads: tuple[str, ...] = OFFLOADS
    settings_search: bool = True

    def __post_init__(self) -> None:
        _check_types(self)
        _as_python_numbers(self)
        unknown = [s for s in self.schedules if s not in SCHEDULES]
        if unknown or not self.schedules:
            raise ValueError(
                f"SearchOptions.schedules {self.schedules!r}: use names in {SCHEDULES}"
            )
        if self.solver not in SOLVERS:
            raise ValueError(
                f"SearchOptions.solver {self.solver!r} is unknown; use one of {SOLVERS}"
            )
        if not self.zero_stages:  # each one's range: _check_types
            raise ValueError(f"SearchOptions.zero_stages {self.zero_stages!r}: use 0, 1, 2, 3")
        if not self.sequence_parallel:
            raise ValueError("SearchOptions.sequence_parallel must list at least one setting")
        from autopar.cost_model.frameworks import get_framework

        # raises ValueError naming the known ones; kept in canonical form (settings sorted)
        object.__setattr__(self, "framework", get_framework(self.framework).spec)
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"SearchOptions.dtype {self.dtype!r}: use one of {DTYPES} or None")
        if not self.offloads or any(o not in OFFLOADS for o in self.offloads):
            raise ValueError(f"SearchOptions.offloads {self.offloads!r}: use names in {OFFLOADS}")
