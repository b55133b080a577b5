"""Convex-hull cuts for per-rank counting: the fastest mix of recompute modes each rank allows.

With per-rank counting (``ilp_ranks.py``) a pipeline rank k holds c identical blocks split over
the recompute modes, N[k][r], plus the edge layers placed on it. Its memory is a knapsack over
the modes, and the LP relaxation of that knapsack is weak: fractional N[k][r] mix "none" and
"full" at exactly the memory limit, a time no integer mix reaches. These cuts give each rank the
exact hull of its time as a function of its block count instead.

For rank k, e a set of edge layers on it (the ones that can only sit on rank k always belong to
e; the others that may sit on it are conditioned on), and c = 0..L blocks:

    f_k(c, e) = min  sum_r t_b(r) n_r + sum_{i in e} t_i(r_i)
                s.t. sum_r n_r = c,  n_r >= 0 integer,  r_i a mode of edge layer i,
                     c s_b + sum_{i in e} s_i + fly_k (sum_r a_b(r) n_r + sum_{i in e} a_i(r_i))
                       + max(transient of every mode used) + buffers <= capacity
    (s: static bytes, a: activation bytes, t: time per micro-batch, fly_k: in-flight micro-batches
    of rank k: exactly the terms of the ILP's memory and bottleneck constraints.)

    f_k(c, e) = c t_fast + t_e for c <= c0 (every layer in its fastest mode fits: "free"), and
    is enumerated for the few c0 < c where memory forces slower modes ("binding"; rank_case).
    Per edge case e:  w[k][e] binary and x[k][e] in [0, c0 w] (free regime);
                      y[k][c][e] binary per binding c (f_k finite and, with a cutoff, affordable)
    (hull_free)  x[k][e] <= c0 w[k][e]
    (hull_one)   sum_e (w[k][e] + sum_c y[k][c][e]) = 1
    (hull_count) sum_e (x[k][e] + sum_c c y[k][c][e]) = sum_r N[k][r]
    (hull_edge)  sum_{e containing i} (w[k][e] + sum_c y[k][c][e]) = sum_r n[i][k][r]
    (hull_time)  sum_r t_b(r) N[k][r] + sum_{i may sit on k} sum_r t_i(r) n[i][k][r]
                   >= sum_e (t_fast x[k][e] + t_e w[k][e] + sum_c f_k(c, e) y[k][c][e])

Every integer solution of the ILP satisfies these with the one-hot at its own (c, e), since
f_k(c, e) is the least time of any mix fitting the same memory: the optimum is unchanged. The LP
relaxation, however, can no longer buy time with a fractional mix: at an integral y it pays f_k
exactly, and branching on y fixes a rank's count with its exact time. Memory is checked against
the capacity without the ILP's safety margin, so the cuts stay valid within the solver's
tolerance. Ranks where neither memory nor the cutoff binds get no hull (the LP is exact there).
Only the free regime's fastest modes need no binaries, which keeps the model small.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import pulp

from autopar.config import RECOMPUTE
from autopar.cost_model.held_counts import held_floor
from autopar.cost_model.pipeline import bubble_coefficient
from autopar.cost_model.tables import CostTable, LayerCost
from autopar.units import GIB  # the ILP's memory scale

__all__ = ["RankCase", "add_rank_hull", "best_block_time", "rank_case", "rank_time_curve",
           "rank_time_limit"]

_Point = TypeVar("_Point", bound=tuple[float, ...])

R = range(len(RECOMPUTE))
MAX_CONDITIONED_EDGES = 3  # optional edge layers per rank the hull conditions on (2^3 cases)
COUNT_SLACK = 1e-9  # integer rounding slack: a count that fits up to float error still fits
TIME_SLACK_S = 1e-9  # keeps float summation order from cutting off the exact optimum
MEM_SLACK_GIB = 1e-9  # a memory sum that fits up to float error still fits


def _modes(layer: LayerCost, fly: float) -> list[tuple[float, float, float]]:
    """(time, in-flight activation GiB, transient GiB) per recompute mode, duplicates dropped."""
    out = []
    for r in R:
        mode = (
            layer.time_per_microbatch_s(RECOMPUTE[r]),
            fly * layer.act_bytes[r] / GIB,
            layer.transient_bytes[r] / GIB,
        )
        if mode not in out:
            out.append(mode)
    return out


def _pareto(points: list[_Point]) -> list[_Point]:
    """Points no other point beats in every coordinate (ties: the first kept), sorted."""
    keep: list[_Point] = []
    for p in sorted(set(points)):
        if not any(all(q[i] <= p[i] for i in range(len(p))) for q in keep):
            keep.append(p)
    return keep


def _edge_combos(layers: list[LayerCost], fly: float) -> list[tuple[float, float, float]]:
    """(time, memory GiB, transient GiB) of every mode choice of ``layers``, Pareto-pruned.

    Memory here is static + in-flight activations; transients combine by max.
    """
    combos = [(0.0, 0.0, 0.0)]
    for layer in layers:
        static = layer.static_bytes / GIB
        combos = _pareto(
            [
                (t0 + t, m0 + static + a, max(tr0, tr))
                for t0, m0, tr0 in combos
                for t, a, tr in _modes(layer, fly)
            ]
        )
    return combos


def _two_mode_time(rem: int, lo: tuple, hi: tuple, budget: float) -> float:
    """Least time of rem blocks split between modes lo and hi (time, memory) within budget.

    n blocks in mode lo: time = rem t_hi + n (t_lo - t_hi), memory = rem a_hi + n (a_lo - a_hi);
    both are linear in n, so the optimum is an end of the feasible integer interval of n.
    """
    (t_lo, a_lo), (t_hi, a_hi) = lo, hi
    slack, step = budget - rem * a_hi, a_lo - a_hi
    if step == 0:
        first, last = (0, rem) if slack >= 0 else (1, 0)
    elif step > 0:
        first, last = 0, min(rem, math.floor(slack / step + COUNT_SLACK))
    else:
        first, last = max(0, math.ceil(slack / step - COUNT_SLACK)), rem
    if first > last:
        return math.inf
    return min(rem * t_hi + n * (t_lo - t_hi) for n in (first, last))


def best_block_time(c: int, modes: list[tuple[float, float]], budget: float) -> float:
    """f(c): least time of c identical blocks over modes (time, memory), memory <= budget.

    Exact for up to three modes: the count of the last mode is enumerated, the other two are
    solved by ``_two_mode_time``.
    """
    if not modes:
        return 0.0 if c == 0 else math.inf
    if len(modes) == 1:
        t, a = modes[0]
        return c * t if c * a <= budget + COUNT_SLACK else math.inf
    if len(modes) == 2:
        return _two_mode_time(c, modes[0], modes[1], budget)
    t, a = modes[-1]
    best = math.inf
    for k in range(c + 1):
        rest = _two_mode_time(c - k, modes[0], modes[1], budget - k * a)
        best = min(best, rest + k * t)
    return best


@dataclass(frozen=True, slots=True)
class RankCase:
    """f_k(c, e) of one rank and edge case e, in two parts.

    Attributes:
        free_max: c0, the largest count at which every block and edge layer runs in its fastest
            mode within memory (then f_k(c, e) = c block_s + edge_s for all c <= c0); -1 if none.
        block_s: the fastest block mode's time per micro-batch.
        edge_s: the fastest time of the case's edge layers.
        binding: c -> f_k(c, e) for the counts c0 < c that fit, where memory forces slower modes.
    """

    free_max: int
    block_s: float
    edge_s: float
    binding: dict[int, float]


def _least_time(c: int, blocks, static: float, combos, room: float) -> float:
    """f_k(c, e) by enumeration (module docstring); inf when nothing fits.

    The rank's largest transient is enumerated as a threshold T over the blocks' transients: only
    modes with transient <= T are used, and T (or an edge layer's larger transient) is charged.
    """
    best = math.inf
    for t_e, m_e, tr_e in combos:
        base = room - c * static - m_e
        if c == 0:
            best = min(best, t_e if base - tr_e >= 0 else math.inf)
            continue
        for ceiling in sorted({tr for _t, _a, tr in blocks}):
            allowed = [(t, a) for t, a, tr in blocks if tr <= ceiling]
            best = min(best, t_e + best_block_time(c, allowed, base - max(ceiling, tr_e)))
    return best


def rank_case(
    block: LayerCost,
    edges: list[LayerCost],
    fly: float,
    c_max: int,
    room: float,
    limit_s: float = math.inf,
) -> RankCase:
    """The RankCase of ``edges`` and up to ``c_max`` blocks.

    ``room`` is the capacity less buffers (GiB); counts whose least time exceeds ``limit_s`` are
    left out (f_k grows with c: dropping a block frees memory and saves its time).
    """
    blocks = _modes(block, fly)
    combos = _edge_combos(edges, fly)
    t_f, a_f, tr_f = min(blocks)
    t_e, m_e, tr_e = combos[0]  # the fastest (then least memory) edge modes
    static = block.static_bytes / GIB
    free = -1
    while free < c_max and (free + 1) * t_f + t_e <= limit_s:
        c = free + 1
        if c * (static + a_f) + m_e + max(tr_f if c else 0.0, tr_e) > room:
            break
        free = c
    binding = {}
    for c in range(free + 1, c_max + 1):
        value = _least_time(c, blocks, static, combos, room)
        if value == math.inf or value > limit_s:
            break  # nothing fits (the least memory grows with c) or too slow: so are larger c
        binding[c] = value
    return RankCase(free_max=free, block_s=t_f, edge_s=t_e, binding=binding)


def rank_time_curve(
    block: LayerCost, edges: list[LayerCost], fly: float, c_max: int, room: float
) -> tuple[int, Callable[[int], float]]:
    """(c0, c -> f_k(c, e)) for counts up to ``c_max``, f_k evaluated on demand (memoised).

    c0 is ``RankCase.free_max`` (closed form): f_k is c t_fast + t_e up to it, and binding
    counts come from ``_least_time`` (inf when nothing fits). f_k is non-decreasing in c.
    """
    blocks = _modes(block, fly)
    combos = _edge_combos(edges, fly)
    t_f, a_f, tr_f = min(blocks)
    t_e, m_e, tr_e = combos[0]
    static = block.static_bytes / GIB

    def free(c: int) -> bool:
        return c * (static + a_f) + m_e + max(tr_f if c else 0.0, tr_e) <= room

    free_max = -1
    if free(0):
        per = static + a_f
        left = room - m_e - max(tr_f, tr_e)
        free_max = c_max if per <= 0 else max(0, min(c_max, math.floor(left / per)))
        while free_max < c_max and free(free_max + 1):  # float rounding of the division
            free_max += 1
        while free_max > 0 and not free(free_max):
            free_max -= 1
    seen: dict[int, float] = {}

    def least_s(c: int) -> float:
        if c not in seen:
            seen[c] = (c * t_f + t_e if c <= free_max
                       else _least_time(c, blocks, static, combos, room))  # fmt: skip
        return seen[c]

    return free_max, least_s


def _rank_edges(n: dict, big: int, k: int) -> tuple[list[int], list[int], list[int]]:
    """(edge runs that may sit on rank k, those that always do, those conditioned on)."""
    ranks_of: dict[int, set[int]] = {}
    for g, kk, _r in n:
        if g != big:
            ranks_of.setdefault(g, set()).add(kk)
    here = sorted(g for g, ks in ranks_of.items() if k in ks)
    always = [g for g in here if ranks_of[g] == {k}]
    optional = [g for g in here if g not in always][:MAX_CONDITIONED_EDGES]
    return here, always, optional


def _rank_cases(table: CostTable, runs, n: dict, big: int, k: int, room: float, limit_s: float):
    """(edge runs that may sit on rank k, conditioned edge runs, RankCase per case mask, c_max)."""
    cfg = table.config
    fly = held_floor(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
    size = runs[big][1] - runs[big][0] + 1
    c_max = min(size, int(sum(n[big, k, r].upBound for r in R)))
    here, always, optional = _rank_edges(n, big, k)
    layer = [table.layers[a] for a, _b in runs]
    cases = {}
    for mask in range(2 ** len(optional)):
        chosen = always + [g for i, g in enumerate(optional) if mask >> i & 1]
        edges = [layer[g] for g in chosen]
        cases[mask] = rank_case(layer[big], edges, fly, c_max, room, limit_s)
    return here, optional, cases, c_max


def _add_rank(prob, table: CostTable, runs, n, big: int, k: int, room: float, limit_s, var):
    """The hull variables and constraints of pipeline rank k (module docstring)."""
    here, optional, cases, c_max = _rank_cases(table, runs, n, big, k, room, limit_s)
    if all(case.free_max == c_max and not case.binding for case in cases.values()):
        return  # memory and cutoff never bind here: the LP already has the exact hull
    layer = [table.layers[a] for a, _b in runs]
    pick: dict[int, list] = {mask: [] for mask in cases}  # the case's one-hot variables
    count, floor = [], []  # sum c y, and sum f y
    for mask, case in sorted(cases.items()):
        tag = f"rank{k}][case{mask}"
        if case.free_max >= 0:
            w = var(prob, f"hull_free[{tag}]", 0, 1, "Binary")
            x = var(prob, f"hull_free_count[{tag}]", 0, case.free_max)
            # [Constraint] hull_free: x counts the blocks while every mode is the fastest
            prob += x <= case.free_max * w, f"hull_free[{tag}]"
            pick[mask].append(w)
            count.append(x)
            floor.append(case.block_s * x + case.edge_s * w)
        for c, value in sorted(case.binding.items()):
            y = var(prob, f"hull[{tag}][{c}]", 0, 1, "Binary")
            pick[mask].append(y)
            count.append(c * y)
            floor.append((value - TIME_SLACK_S) * y)
    # [Constraint] hull_one / hull_count: one regime of one edge case holds the rank's blocks
    prob += pulp.lpSum(v for mask in sorted(pick) for v in pick[mask]) == 1, f"hull_one[rank{k}]"
    blocks = pulp.lpSum(n[big, k, r] for r in R)
    prob += pulp.lpSum(count) == blocks, f"hull_count[rank{k}]"
    for i, g in enumerate(optional):
        # [Constraint] hull_edge: the case holds edge layer g exactly when rank k does
        prob += (
            pulp.lpSum(v for mask in sorted(pick) if mask >> i & 1 for v in pick[mask])
            == pulp.lpSum(n[g, k, r] for r in R if (g, k, r) in n),
            f"hull_edge[{table.names[runs[g][0]]}][rank{k}]",
        )
    rank_time = pulp.lpSum(
        layer[g].time_per_microbatch_s(RECOMPUTE[r]) * n[g, k, r]
        for g in [big, *here]
        for r in R
        if (g, k, r) in n
    )
    # [Constraint] hull_time: the rank's layers take at least the fastest mix that fits
    prob += rank_time >= pulp.lpSum(floor), f"hull_time[rank{k}]"


def rank_time_limit(table: CostTable, cutoff_s: float | None) -> float:
    """The most a rank's time per micro-batch may be and its step still beat ``cutoff_s``:
    step >= m R_k + c sum_j T_j >= (m + c) R_k and R_k >= f_k + v p2p (inf without a cutoff)."""
    if cutoff_s is None:
        return math.inf
    cfg = table.config
    weight = table.num_microbatches + bubble_coefficient(
        cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches
    )
    p2p = table.p2p_s if cfg.pp > 1 else 0.0
    return cutoff_s / weight - cfg.virtual_stages * p2p + TIME_SLACK_S


def add_rank_hull(
    prob, table: CostTable, runs, n: dict, big: int, cap_gib: float, var, cutoff_s=None
) -> None:
    """Add the hull cuts of every pipeline rank (per-rank counting, time objective only).

    With a cutoff, counts whose rank alone would exceed it are left out:
    step >= m R_k + c sum_j T_j >= (m + c) R_k and R_k >= f_k(c, e) + v p2p, so only
    f_k(c, e) <= cutoff / (m + c) - v p2p can beat it.

    Args:
        prob: the ILP.
        table: the configuration's cost terms.
        runs: the layer runs; ``big`` indexes the run of blocks.
        n: per-rank counts (run, rank, mode) -> variable, as ``add_rank_counts`` returns them.
        cap_gib: the usable memory per GPU in GiB.
        var: the ILP's variable factory.
        cutoff_s: the ILP's cutoff on the step time, if any.
    """
    cfg = table.config
    room = cap_gib - table.buffers_bytes / GIB
    limit_s = rank_time_limit(table, cutoff_s)
    for k in range(cfg.pp):
        _add_rank(prob, table, runs, n, big, k, room, limit_s, var)
