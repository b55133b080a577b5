"""Per-chunk held micro-batches of a pipeline rank: the vectors its activation peak is a max over.

A rank that runs v model chunks holds, at each instant, c_i chunk-micro-batches of chunk i
(local chunk i: the rank's i-th stage in stage order). Its activation memory peaks at

    max over instants of  sum_i c_i A_i        (A_i: one micro-batch's activations of chunk i)

which only the vertices of the set of count vectors can attain (a linear function's max over a
point set is at a vertex of its convex hull). ``held_vectors`` returns those vectors; a rank whose
chunks hold the same count at its peak has one vector (c, ..., c), and a one-chunk schedule
(gpipe, 1f1b) the vector (``pipeline.in_flight_microbatches``,).

How the counts arise (a chunk-micro-batch holds its activations from its forward F to its full
backward B, or to its weight pass W when the backward is split):

- interleaved 1F1B and interleaved zero bubble (loop placement): the rank's order of chunk
  passes, as torch's ``_get_1f1b_rank_ops`` lays it out (torch/distributed/pipelining/
  schedules.py; Megatron-LM's forward_backward_pipelining_with_interleaving runs the same order
  at N = p): forwards run N = ``schedules.microbatches_per_round`` micro-batches back to back per
  chunk, chunk 0 first; backwards N at a time from the last chunk down; a warm-up of
  (v - 1) N + k (p - 1 - r) forwards (k = 2, or 1 for zero bubble), then one forward and one
  backward per step, then the remaining backwards; zero bubble runs each weight pass after the
  backward r steps later (``num_1f1b_microbatches = rank``), the oldest first. ``_interleaved``
  replays that order and counts per chunk;
- zbv-zero-bubble (V placement: chunk 0 is stage r, chunk 1 stage 2p - 1 - r): on torch's own
  action lists (tests/unit/test_cost_held_counts.py replays them) the rank holds
  T = min(2p, 2m, m + r + 1) at its peak, chunk 0 at most min(m, 2p - r), chunk 1 at most
  min(m, r + 1), and every split of T between those limits occurs: the vertices are the two
  ends;
- dualpipe-v (m >= 2p): one vector, (2p - r, r + 1).
"""

from __future__ import annotations

import functools
import itertools

from autopar.cost_model.pipeline import in_flight_microbatches
from autopar.schedules import get_schedule, microbatches_per_round

__all__ = ["floor_of", "held_floor", "held_vectors", "uniform", "uniform_ranks"]

Vector = tuple[float, ...]


def _interleaved(p: int, v: int, m: int, rank: int, zero_bubble: bool) -> list[tuple[int, ...]]:
    """Per-chunk held counts after each forward of torch's interleaved order for ``rank``, less
    those inside a straight stretch (the same forward and release as the step before: a mix of
    its two neighbours)."""
    n = microbatches_per_round(p, m)
    total = v * m
    warm = min((v - 1) * n + (1 if zero_bubble else 2) * (p - 1 - rank), total)
    held = [0] * v
    seen: list[tuple[int, ...]] = []
    backwards: list[int] = []  # chunk of each backward, in order (zero bubble's W follow them)
    weights, freed, step = 0, -1, None
    for op in range(warm + total):
        if op < total:
            chunk = (op // n) % v
            held[chunk] += 1
            if step == (chunk, freed) and len(seen) > 1:
                seen.pop()  # the previous point sits between its neighbours
            step, freed = (chunk, freed), -1
            seen.append(tuple(held))
        if op >= warm:
            chunk = v - 1 - ((op - warm) // n) % v
            backwards.append(chunk)
            if not zero_bubble:
                freed = chunk
            elif op - warm >= rank:
                freed = backwards[weights]
                weights += 1
            if freed >= 0:
                held[freed] -= 1
    return seen


def _vertices(points: list[tuple[int, ...]]) -> tuple[Vector, ...]:
    """The Pareto-maximal points, less those between two others on a line (in order of time)."""
    unique = list(dict.fromkeys(points))
    top = [a for a in unique
           if not any(b != a and all(x >= y for x, y in zip(b, a)) for b in unique)]
    changed = True
    while changed and len(top) > 2:
        changed = False
        for i in range(1, len(top) - 1):
            a, q, b = top[i - 1], top[i], top[i + 1]
            d, e = [y - x for x, y in zip(a, b)], [y - x for x, y in zip(a, q)]
            along = sum(x * y for x, y in zip(d, e))
            if 0 < along < sum(x * x for x in d) and all(
                    di * ej == dj * ei for (di, ei), (dj, ej) in
                    itertools.combinations(zip(d, e), 2)):
                del top[i]  # q lies inside the segment a-b: a mix of the two
                changed = True
                break
    return tuple(tuple(float(x) for x in t) for t in top)


@functools.lru_cache(maxsize=65536)
def held_vectors(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> tuple[Vector, ...]:
    """The count vectors (one entry per local chunk) at which ``rank``'s activations can peak.

    Args:
        schedule: schedule name.
        num_ranks: p, pipeline ranks.
        virtual_stages: v, model chunks per rank.
        num_microbatches: m, micro-batches per pipeline per step.
        rank: the pipeline rank.

    Returns:
        The vertices (see the module docstring); ((in_flight,) * v,) where every chunk holds
        the same count.
    """
    p, v, m = num_ranks, virtual_stages, num_microbatches
    s = get_schedule(schedule)
    if p <= 1 or not s.multi_chunk or v <= 1:
        flight = in_flight_microbatches(schedule, p, v, m, rank)
        return ((flight,) * max(1, v if p > 1 else 1),)
    if schedule == "zbv-zero-bubble":
        total = min(2 * p, 2 * m, m + rank + 1)
        first, second = min(m, 2 * p - rank), min(m, rank + 1)
        ends = {(total - second, second), (first, total - first)}
        return tuple((float(a), float(b)) for a, b in sorted(ends, reverse=True))
    if schedule == "dualpipe-v":
        return ((float(2 * p - rank), float(rank + 1)),)
    return _vertices(_interleaved(p, v, m, rank, s.zero_bubble))


def held_floor(
    schedule: str, num_ranks: int, virtual_stages: int, num_microbatches: int, rank: int
) -> float:
    """A count every chunk of ``rank`` is charged at least, however its layers sit among its
    chunks (``floor_of`` its vectors)."""
    return floor_of(held_vectors(schedule, num_ranks, virtual_stages, num_microbatches, rank))


def floor_of(vectors: tuple[Vector, ...]) -> float:
    """Max over the vectors of their smallest entry: sum_i c_i A_i >= min_i c_i sum_i A_i for
    each vector c, and the peak is the largest of them."""
    return max(min(c) for c in vectors)


def uniform(vectors: tuple[Vector, ...]) -> bool:
    """Whether the rank's peak does not depend on how its layers sit among its chunks."""
    return len(vectors) == 1 and len(set(vectors[0])) == 1


def uniform_ranks(schedule: str, num_ranks: int, virtual_stages: int,
                  num_microbatches: int) -> bool:
    """Whether no rank's peak depends on how its layers sit among its chunks (then counting
    layers per rank, not per stage, is exact)."""
    return all(uniform(held_vectors(schedule, num_ranks, virtual_stages, num_microbatches, k))
               for k in range(num_ranks))
