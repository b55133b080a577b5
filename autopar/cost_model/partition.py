"""Balanced contiguous partition of layers into pipeline stages (min-max stage time).

Pure python and deterministic. The smallest feasible bottleneck T* is found by bisection between
the lower bound max(max_i c_i, sum c / k) and the upper bound lower + max_i c_i (a greedy split
under that limit always needs <= k stages) to a relative precision of 1e-7; each probe is a
greedy left-to-right packing using bisection on prefix sums, O(k log n). The split returned is
the greedy packing under the final bound that leaves at least one layer for every later stage.

``rank_balanced_partition`` balances pipeline ranks that run several stages each (interleaved
and V schedules): from the balanced split and from equal layer counts, a local search that moves
one layer out of a heaviest rank's stage to any other stage.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Sequence

__all__ = ["balanced_partition", "rank_balanced_partition", "uniform_partition"]

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


def _rank_loads(prefix: list[float], bounds: Sequence[int], ranks: Sequence[int]) -> list[float]:
    """Every rank's summed stage cost (stage ``j`` spans ``bounds[j]:bounds[j + 1]``)."""
    loads = [0.0] * (max(ranks) + 1)
    for stage, rank in enumerate(ranks):
        loads[rank] += prefix[bounds[stage + 1]] - prefix[bounds[stage]]
    return loads


def _key(loads: Sequence[float]) -> tuple[float, float]:
    """What the rank search minimises: the heaviest rank, then the sum of squared loads."""
    return max(loads), sum(x * x for x in loads)


def _chain_moves(costs: Sequence[float], bounds: Sequence[int], ranks: Sequence[int],
                 loads: list[float], stage: int):
    """(key, bounds moved, direction) of every move of one layer out of ``stage`` to another
    stage: its first layer to stage t < stage (bounds t+1 .. stage one later, direction 1: the
    stages between keep their sizes, each passing a layer on), or its last to stage t > stage
    (bounds stage+1 .. t one earlier, direction -1). The loads are updated as the chain grows,
    a layer at a time."""
    last = len(ranks) - 1
    for step in (1, -1):  # 1: the first layer goes left; -1: the last layer goes right
        cur = loads.copy()
        edge = stage if step == 1 else stage + 1  # the bound that moves first
        layer = bounds[edge] if step == 1 else bounds[edge] - 1
        cur[ranks[stage]] -= costs[layer]
        t = stage - step
        while 0 <= t <= last:
            cur[ranks[t]] += costs[layer]
            moved = range(t + 1, stage + 1) if step == 1 else range(stage + 1, t + 1)
            yield _key(cur), moved, step
            # extend the chain: stage t passes on its own outer layer to stage t - step
            layer = bounds[t] if step == 1 else bounds[t + 1] - 1
            cur[ranks[t]] -= costs[layer]
            t -= step


def _descend(costs: Sequence[float], prefix: list[float], bounds: list[int],
             ranks: Sequence[int]) -> list[int]:
    """Steepest descent of ``_key`` over chain moves out of the heaviest ranks' stages."""
    while True:
        loads = _rank_loads(prefix, bounds, ranks)
        key = _key(loads)
        best = None
        for stage, rank in enumerate(ranks):
            if loads[rank] < key[0] or bounds[stage + 1] - bounds[stage] < 2:
                continue
            for trial, moved, step in _chain_moves(costs, bounds, ranks, loads, stage):
                if trial < key and (best is None or trial < best[0]):
                    best = (trial, moved, step)
        if best is None:
            return bounds
        shifted = bounds.copy()
        for j in best[1]:
            shifted[j] += best[2]
        if _key(_rank_loads(prefix, shifted, ranks)) >= key:  # rounding: stop, never cycle
            return bounds
        bounds = shifted


def rank_balanced_partition(costs: Sequence[float],
                            ranks: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Split ``costs`` into ``len(ranks)`` non-empty contiguous stages, stage ``j`` run by rank
    ``ranks[j]``, balancing the ranks' summed costs.

    With one stage per rank this is ``balanced_partition``. When a rank runs several stages
    (interleaved and V schedules) the stage-balanced split can leave one rank a layer heavier
    than another on every chunk. A local search then moves one layer at a time out of a stage of
    the heaviest rank to any other stage (the stages between pass a layer on and keep their
    sizes), steepest first, while the heaviest rank gets lighter or, as heavy, the squared loads
    smaller (a strict decrease: it ends). It starts from the stage-balanced split and from equal
    layer counts, and keeps the better end: never heavier on its heaviest rank than the
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
    starts = ([first for first, _ in split] + [len(costs)],
              uniform_partition(len(costs), len(ranks)))
    ends = [_descend(costs, prefix, list(b), ranks) for b in starts]
    bounds = min(ends, key=lambda b: _key(_rank_loads(prefix, b, ranks)))
    return tuple((a, b - 1) for a, b in itertools.pairwise(bounds))


def uniform_partition(num_items: int, num_parts: int) -> list[int]:
    """Stage bounds (``num_parts + 1`` offsets) of equal stages, the first ``num_items %
    num_parts`` one item longer (DeepSpeed ``partition_uniform``)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    size, extra = divmod(num_items, num_parts)
    return [p * size + min(p, extra) for p in range(num_parts + 1)]
