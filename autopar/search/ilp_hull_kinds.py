"""Hull cuts for per-rank counting by kind: the fastest mode mix each rank's count vector allows.

The per-rank relaxation of a repeating section (``ilp_rank_kinds.py``) counts, per rank k,
kind kappa and mode r, N[kappa][k][r]. As with one run of blocks (``ilp_hull.py``), its LP
relaxation mixes modes fractionally at the memory limit: Llama 4 Maverick's candidates under an
interleaved schedule kept a 7% gap after 20 s, and with only the counts integral the bound rose
from 3.86 s to 4.08 s. So each rank gets the exact hull of its time over its count vectors:
for every vector c = (c_kappa) the window constraints allow and edge case e (the edge layers
that may sit on the rank),

    f_k(c, e) = the least time of c_kappa layers of each kind and the edge layers e over their
                modes, within the rank's memory (static + in-flight activations + the largest
                transient of the modes used + buffers <= capacity)

and one-hot binaries y[k][c][e] with

    (kind_hull_one)    sum_{c,e} y = 1
    (kind_hull_count)  sum_{c,e} c_kappa y = sum_r N[kappa][k][r]          for every kind
    (kind_hull_edge)   sum_{c, e containing i} y = sum_r n[i][k][r]        for every edge layer
    (kind_hull_time)   the rank's time >= sum_{c,e} f_k(c, e) y

Every integer solution satisfies them at its own (c, e) (f_k is the least time of any mix
fitting the same memory), so the optimum is unchanged; vectors that fit nowhere (or cannot beat
the cutoff) get no binary, which also makes the memory constraint integral. Ranks with more
than ``MAX_CASES`` vectors and cases keep the plain relaxation (still a valid bound).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.held_counts import held_floor
from autopar.cost_model.tables import CostTable, LayerCost
from autopar.schedules import rank_of_stage
from autopar.search.ilp_hull import (
    COUNT_SLACK,
    MEM_SLACK_GIB,
    TIME_SLACK_S,
    _edge_combos,
    _modes,
    rank_time_limit,
)
from autopar.search.ilp_pattern import Pattern
from autopar.search.ilp_rank_kinds import window_spread
from autopar.units import GIB

__all__ = ["MAX_CASES", "add_kind_hull"]

R = range(len(RECOMPUTE))
MAX_CASES = 2000  # count vectors x edge cases per rank above which the rank gets no hull


def _front(points, room: float = math.inf) -> list[tuple[float, float]]:
    """The (time, memory) points within ``room`` no other beats in both, by memory ascending
    (time falling)."""
    out: list[tuple[float, float]] = []
    for t, m in sorted(points, key=lambda x: (x[1], x[0])):
        if m > room + MEM_SLACK_GIB:
            break
        if not out or t < out[-1][0]:
            out.append((t, m))
    return out


def _mixes(layer: LayerCost, fly: float, count: int, ceiling: float) -> list[tuple]:
    """(time, memory GiB) of every mode mix of ``count`` layers using modes whose transient is
    at most ``ceiling``, Pareto-pruned (memory: static + in-flight activations)."""
    modes = [(t, a) for t, a, tr in _modes(layer, fly) if tr <= ceiling]
    static = layer.static_bytes / GIB
    out = []
    for split in itertools.combinations_with_replacement(range(len(modes)), count):
        out.append((sum(modes[i][0] for i in split),
                    count * static + sum(modes[i][1] for i in split)))
    return _front(out) if modes or count == 0 else []


def _merged(kinds: list[LayerCost], fly: float, vector: tuple[int, ...], ceiling: float,
            cache: dict, room: float) -> list[tuple[float, float]]:
    """The (time, memory) front of the vector's layers over their modes (prefixes memoised in
    ``cache``, shared by the ranks of one in-flight count)."""
    key = (fly, ceiling, vector)
    if key in cache:
        return cache[key]
    if not vector:
        cache[key] = [(0.0, 0.0)]
        return cache[key]
    head = _merged(kinds, fly, vector[:-1], ceiling, cache, room)
    mixes_key = (fly, ceiling, len(vector) - 1, vector[-1], "mixes")
    if mixes_key not in cache:
        cache[mixes_key] = _front(_mixes(kinds[len(vector) - 1], fly, vector[-1], ceiling),
                                  room)
    cache[key] = _front([(t0 + t, m0 + m) for t0, m0 in head for t, m in cache[mixes_key]],
                        room)
    return cache[key]


def _least_time(kinds: list[LayerCost], fly: float, vector: tuple[int, ...], combos,
                room: float, ceilings: list[float], cache: dict) -> float:
    """f_k(c, e): the least time of the vector's layers and the edge case within ``room``."""
    best = math.inf
    for ceiling in ceilings if any(vector) else [0.0]:  # no block: no block's transient
        merged = _merged(kinds, fly, vector, ceiling, cache, room - ceiling)
        for t_e, m_e, tr_e in combos:
            budget = room - m_e - max(ceiling, tr_e)
            fits = [t for t, m in merged if m <= budget + MEM_SLACK_GIB]
            if fits:
                best = min(best, min(fits) + t_e)
    return best


def _vectors(table: CostTable, pat: Pattern, n: dict, k: int, fly: float,
             room: float) -> list[tuple[int, ...]]:
    """Count vectors rank k may hold: each kind within its bound and the window constraint,
    their least memory (every layer in its leanest mode) within ``room``."""
    least = [min(table.layers[rep].static_bytes / GIB + a for _t, a, _tr in
                 _modes(table.layers[rep], fly)) for rep in pat.rep]
    cfg = table.config
    windows = sum(1 for j in range(cfg.num_stages)
                  if rank_of_stage(cfg.schedule, cfg.pp, j) == k)
    highs = [int(max(n[pat.key0 + c, k, r].upBound for r in R)) for c in range(len(pat.rep))]
    shares = [pat.per_period(c) / pat.period for c in range(len(pat.rep))]
    spreads = [window_spread(pat, c) for c in range(len(pat.rep))]
    out = []
    for vector in itertools.product(*(range(h + 1) for h in highs)):
        total = sum(vector)
        if sum(c * m for c, m in zip(vector, least, strict=True)) > room + MEM_SLACK_GIB:
            continue
        if all(abs(c - share * total) <= windows * spread + COUNT_SLACK
               for c, share, spread in zip(vector, shares, spreads, strict=True)):
            out.append(vector)
    return out


def _add_rank(prob, table: CostTable, keys, pat: Pattern, n: dict, k: int, room: float,
              limit_s: float, var: Callable, cache: dict) -> None:
    cfg = table.config
    fly = held_floor(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
    kinds_g = range(pat.key0, pat.key0 + len(pat.rep))
    edges = sorted({g for g, kk, _r in n if kk == k and g not in kinds_g})
    vectors = _vectors(table, pat, n, k, fly, room)
    if len(vectors) << len(edges) > MAX_CASES:
        return
    kinds = [table.layers[keys[g][0]] for g in kinds_g]
    ceilings = sorted({tr for layer in kinds for _t, _a, tr in _modes(layer, fly)})
    picks: list = []
    floor: list = []
    holds: dict[int, list] = {g: [] for g in edges}
    count_terms: list[list] = [[] for _ in kinds]
    for mask in range(2 ** len(edges)):
        chosen = [g for i, g in enumerate(edges) if mask >> i & 1]
        combos = _edge_combos([table.layers[keys[g][0]] for g in chosen], fly)
        for vector in vectors:
            value = _least_time(kinds, fly, vector, combos, room, ceilings, cache)
            if value == math.inf or value > limit_s:
                continue
            y = var(prob, f"kind_hull[rank{k}][case{mask}][{'_'.join(map(str, vector))}]", 0, 1,
                    "Binary")
            picks.append(y)
            floor.append((value - TIME_SLACK_S) * y)
            for kappa, c in enumerate(vector):
                if c:
                    count_terms[kappa].append(c * y)
            for g in chosen:
                holds[g].append(y)
    # [Constraint] kind_hull_one: one count vector and edge case holds the rank's layers
    prob += pulp.lpSum(picks) == 1, f"kind_hull_one[rank{k}]"
    for kappa, g in enumerate(kinds_g):
        # [Constraint] kind_hull_count: the vector is the rank's count of each kind
        prob += pulp.lpSum(count_terms[kappa]) == pulp.lpSum(n[g, k, r] for r in R), (
            f"kind_hull_count[{table.names[keys[g][0]]}][rank{k}]")
    for g in edges:
        # [Constraint] kind_hull_edge: the case holds edge layer g exactly when rank k does
        prob += pulp.lpSum(holds[g]) == pulp.lpSum(n[g, k, r] for r in R if (g, k, r) in n), (
            f"kind_hull_edge[{table.names[keys[g][0]]}][rank{k}]")
    rank_time = pulp.lpSum(table.layers[keys[g][0]].time_per_microbatch_s(RECOMPUTE[r]) * v
                           for (g, kk, r), v in sorted(n.items()) if kk == k)
    # [Constraint] kind_hull_time: the rank's layers take at least the fastest mix that fits
    prob += rank_time >= pulp.lpSum(floor), f"kind_hull_time[rank{k}]"


def add_kind_hull(prob, table: CostTable, keys, pat: Pattern, n: dict, cap_gib: float,
                  var: Callable, cutoff_s: float | None = None) -> None:
    """The hull cuts of every pipeline rank (counts whose rank alone exceeds the cutoff left
    out, ``ilp_hull.rank_time_limit``)."""
    room = cap_gib - table.buffers_bytes / GIB
    limit_s = rank_time_limit(table, cutoff_s)
    cache: dict = {}
    for k in range(table.config.pp):
        _add_rank(prob, table, keys, pat, n, k, room, limit_s, var, cache)
