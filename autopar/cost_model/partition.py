"""Balanced contiguous partition of layers into pipeline stages (min-max stage time).

Pure python and deterministic. The smallest feasible bottleneck T* is found by bisection between
the lower bound max(max_i c_i, sum c / k) and the upper bound lower + max_i c_i (a greedy split
under that limit always needs <= k stages) to a relative precision of 1e-7; each probe is a
greedy left-to-right packing using bisection on prefix sums, O(k log n). The split returned is
the greedy packing under the final bound that leaves at least one layer for every later stage.

``rank_balanced_partition`` balances pipeline ranks that run several stages each (interleaved
and V schedules): from the balanced split, a local search over single-layer bound moves.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["balanced_partition", "rank_balanced_partition"]

_RELATIVE_TOLERANCE = 1e-7  # stop bisecting when the bottleneck is known to this precision


def _greedy(prefix: list[float], limit: float, num_stages: int) -> tuple[list[int] | None, float]:
    """Greedy packing under ``limit``: (stage end indices (exclusive) or None if > k, grow).

    ``grow`` is the smallest limit above ``limit`` at which the packing would change (a stage
    taking one more layer); every limit below it gives the same packing.
    """
    n = len(prefix) - 1
    ends: list[int] = []
    grow = float("inf")
    start = 0
    while start < n:
        stages_left = num_stages - len(ends)
        if stages_left <= 0:
            return None, grow
        # furthest end e with prefix[e] - prefix[start] <= limit, keeping one layer per later stage
        e = bisect_right(prefix, prefix[start] + limit) - 1
        cap = n - (stages_left - 1)
        if e < cap and e + 1 <= n:
            grow = min(grow, prefix[e + 1] - prefix[start])
        e = min(e, cap)
        if e <= start:
            return None, grow
        ends.append(e)
        start = e
    # Leaving one layer per later stage makes the packing use exactly k stages when it fits.
    return (ends if len(ends) == num_stages else None), grow


def _bottleneck(prefix: list[float], ends: list[int]) -> float:
    """Largest stage sum of a packing given by its stage ends."""
    starts = [0, *ends[:-1]]
    return max(prefix[b] - prefix[a] for a, b in zip(starts, ends))


def balanced_partition(costs: Sequence[float], num_stages: int) -> tuple[tuple[int, int], ...]:
    """Split ``costs`` into ``num_stages`` non-empty contiguous ranges minimising the largest sum.

    Args:
        costs: per-layer cost (e.g. seconds per micro-batch), in order; all >= 0.
        num_stages: number of stages k, 1 <= k <= len(costs).

    Returns:
        ((first, last), ...) inclusive layer indices of each stage, in order.

    Raises:
        ValueError: if num_stages is out of range or a cost is negative.

    Example:
        >>> balanced_partition([1, 1, 1, 1], 2)
        ((0, 1), (2, 3))
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise ValueError(f"cannot split {n} layers into {num_stages} non-empty stages")
    if any(c < 0 for c in costs):
        raise ValueError("layer costs must be >= 0")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    biggest = max(float(c) for c in costs)
    lo = max(biggest, prefix[-1] / num_stages)
    hi = lo + biggest
    ends, _ = _greedy(prefix, hi * (1 + 1e-12), num_stages)
    if ends is None:  # pragma: no cover - the bound above is always feasible
        raise AssertionError("balanced_partition: upper bound infeasible")
    hi = _bottleneck(prefix, ends)
    probe, grow = _greedy(prefix, lo, num_stages)
    if probe is not None:
        hi = lo
    else:
        lo = max(lo, grow)
        # Both ends snap to layer-range sums: hi to the bottleneck a feasible packing achieves,
        # lo to the smallest limit that changes an infeasible packing. Usually a few probes.
        while hi - lo > _RELATIVE_TOLERANCE * hi:
            mid = 0.5 * (lo + hi)
            probe, grow = _greedy(prefix, mid, num_stages)
            if probe is None:
                lo = max(mid, grow)
            else:
                hi = _bottleneck(prefix, probe)
        if lo <= hi:
            probe, _ = _greedy(prefix, lo, num_stages)
            if probe is not None:
                hi = _bottleneck(prefix, probe)
    # hi is a layer-range sum; allow for rounding when the greedy re-adds it to a prefix sum.
    ends, _ = _greedy(prefix, hi * (1 + 1e-12), num_stages)
    assert ends is not None
    starts = [0, *ends[:-1]]
    return tuple((a, b - 1) for a, b in zip(starts, ends))


def _rank_loads(prefix: list[float], bounds: list[int], ranks: Sequence[int]) -> tuple[float, ...]:
    """Every rank's summed stage cost, heaviest first (the order local search minimises)."""
    loads = [0.0] * (max(ranks) + 1)
    for stage, rank in enumerate(ranks):
        loads[rank] += prefix[bounds[stage + 1]] - prefix[bounds[stage]]
    return tuple(sorted(loads, reverse=True))


def rank_balanced_partition(costs: Sequence[float],
                            ranks: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Split ``costs`` into ``len(ranks)`` non-empty contiguous stages, stage ``j`` run by rank
    ``ranks[j]``, balancing the ranks' summed costs.

    With one stage per rank this is ``balanced_partition``. When a rank runs several stages
    (interleaved and V schedules) the stage-balanced split can leave one rank a layer heavier
    than another on every chunk; from it, steepest descent moves one stage bound by one layer at
    a time while the ranks' loads, heaviest first, get lexicographically smaller (each step a
    strict decrease, so it ends). A local optimum: never heavier on its heaviest rank than the
    stage-balanced split.

    Example:
        >>> rank_balanced_partition([1] * 10, (0, 1, 1, 0))  # balanced_partition: 4 and 6
        ((0, 3), (4, 5), (6, 8), (9, 9))
    """
    split = balanced_partition(costs, len(ranks))
    if len(set(ranks)) == len(ranks):
        return split
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    bounds = [first for first, _ in split] + [len(costs)]
    best = _rank_loads(prefix, bounds, ranks)
    while True:
        move = None
        for j in range(1, len(bounds) - 1):
            for step in (-1, 1):
                b = bounds[j] + step
                if not bounds[j - 1] < b < bounds[j + 1]:
                    continue
                trial = [*bounds[:j], b, *bounds[j + 1:]]
                loads = _rank_loads(prefix, trial, ranks)
                if loads < best:
                    best, move = loads, trial
        if move is None:
            return tuple((a, b - 1) for a, b in itertools.pairwise(bounds))
        bounds = move
