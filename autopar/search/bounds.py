"""Cheap bounds on one outer candidate, valid for every split and recompute choice.

Notation as in ``autopar/cost_model/assemble.py``: S stages on p ranks, m micro-batches,
t_i(r) a layer's time per micro-batch, c the bubble coefficient.

Time. sum_j T_j = sum_i t_i(r_i) + S p2p >= A, with A - S p2p a lower bound on sum_i t_i(r_i)
over recompute choices whose activations fit the memory of all ranks together (a Lagrangian
bound of that multiple-choice knapsack; without memory pressure it is sum_i min_r t_i(r)); so the
pipeline term
m max_k R_k + c sum_j T_j >= m max(A / p, max_i min_r t_i + p2p) + c A. The tail
max_k E_k >= max(dp_tail + sum_i opt_i / p, sum_i (dp_step_i - eta bwd_i + opt_i) / p) (a max is at
least the mean), or sum_i opt_i / p without data parallelism. The refined bound (the candidates
the cheap one does not prune) raises max_k R_k with whole blocks: per rank, its p2p sends plus
the fastest recompute mix of its blocks that fits its own memory at its own held floor
(``memory_bottleneck_s``); A stays the all-ranks bound of the bubble term.

Memory. max_k mem_k >= mean_k mem_k >= (sum_i static_i + f_min sum_i min_r act_i(r)) / p
+ min_i min_r transient_i(r) + buffers, with f_min the fewest micro-batches any rank's layers are
charged however they sit among its chunks (``held_counts.held_floor``);
and the rank holding layer i needs at least static_i + min_r (f_min act_i(r) + transient_i(r)).
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import operator
from dataclasses import dataclass

from autopar.config import RECOMPUTE
from autopar.cost_model.held_counts import held_floor, held_vectors
from autopar.cost_model.pipeline import bubble_coefficient, pipeline_buffer_microbatches
from autopar.cost_model.tables import CostTable
from autopar.schedules import rank_of_stage
from autopar.search.ilp import cost_signature, layer_runs
from autopar.search.ilp_hull import rank_time_curve
from autopar.search.ilp_ranks import big_run
from autopar.units import GIB

FLOAT_SLACK = 1e-9  # relative: keeps float summation order from lifting a bound over the optimum

__all__ = [
    "TableSummary",
    "ilp_key",
    "integer_bottleneck_s",
    "memory_bottleneck_s",
    "memory_duals",
    "memory_lower_bound",
    "min_in_flight",
    "recv_buffer_counts",
    "summarize",
    "time_lower_bound",
    "unlimited_memory_time_bound",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class TableSummary:
    """Per-table aggregates the bounds need (one pass over the layers; schedule-independent).

    Attributes:
        runs: per run of identical layers: (count, time by mode, activations by mode).
        t_min_max_s: largest single-layer time per micro-batch at its fastest mode.
        opt_sum_s: sum of optimizer times.
        exposed_sum_s: sum of (dp_step - eta backward + optimizer) times.
        static_sum_bytes: sum of parameter + gradient + optimizer bytes.
        transient_min_bytes: smallest transient of any layer and mode.
        single_bytes: per layer (static, activations by mode, transient by mode) maxima inputs.
    """

    runs: tuple[tuple[int, tuple[float, ...], tuple[float, ...]], ...]
    t_min_max_s: float
    opt_sum_s: float
    exposed_sum_s: float
    static_sum_bytes: float
    transient_min_bytes: float
    single_bytes: tuple[tuple[float, tuple[float, ...], tuple[float, ...]], ...]


def summarize(table: CostTable) -> TableSummary:
    """Aggregate a table's layers once; the bounds of every schedule variant reuse it."""
    layers, eta = table.layers, table.overlap_efficiency
    runs, singles = [], set()
    for a, b in layer_runs(table):
        lay = layers[a]
        t = tuple(lay.time_per_microbatch_s(r) for r in RECOMPUTE)
        runs.append((b - a + 1, t, tuple(lay.act_bytes)))
        singles.add((lay.static_bytes, tuple(lay.act_bytes), tuple(lay.transient_bytes)))
    # Sums run over every layer in order (not count x value): the bounds stay bit-for-bit those
    # of the layer-by-layer formula, so the candidates' order does not shift by a rounding.
    return TableSummary(
        runs=tuple(runs),
        t_min_max_s=max(min(t) for _, t, _ in runs),
        opt_sum_s=sum(map(operator.attrgetter("optimizer_s"), layers)),
        exposed_sum_s=sum(lay.dp_step_s - eta * lay.backward_s + lay.optimizer_s for lay in layers),
        static_sum_bytes=sum(map(operator.attrgetter("static_bytes"), layers)),
        transient_min_bytes=min(min(trans) for _s, _a, trans in singles),
        single_bytes=tuple(sorted(singles)),
    )


def memory_duals(runs, in_flight: float) -> tuple[tuple[float, float], ...]:
    """(lam, sum_g L_g min_r (t_g(r) + lam f a_g(r))) at every breakpoint lam of the dual in
    ``_min_time_under_memory`` (lam = 0 first); they do not depend on the memory budget."""
    lams = {0.0}
    for _, t, a in runs:
        for r, s in itertools.combinations(range(len(t)), 2):
            da = in_flight * (a[r] - a[s])
            if da != 0 and (t[s] - t[r]) / da > 0:
                lams.add((t[s] - t[r]) / da)
    return tuple(
        (lam, sum(n * min(t[r] + lam * in_flight * a[r] for r in range(len(t)))
                  for n, t, a in runs))
        for lam in sorted(lams)
    )


def _min_time_under_memory(runs, in_flight: float, budget_bytes: float,
                           duals: tuple[tuple[float, float], ...] | None = None) -> float:
    """Lagrangian lower bound of min sum_i t_i(r_i) s.t. in_flight sum_i act_i(r_i) <= budget.

    For any lam >= 0: sum_g L_g min_r (t_g(r) + lam f a_g(r)) - lam budget is a lower bound (weak
    duality); the dual is concave piecewise linear, so its maximum is at a breakpoint
    (``memory_duals``, which a caller bounding many budgets passes in).
    """
    duals = memory_duals(runs, in_flight) if duals is None else duals
    return max(value - lam * budget_bytes for lam, value in duals)


def min_in_flight(schedule: str, pp: int, virtual_stages: int, num_microbatches: int) -> float:
    """f_min: the fewest micro-batches any pipeline rank's layers are charged, however they sit
    among its chunks (``held_counts.held_floor``)."""
    return min(held_floor(schedule, pp, virtual_stages, num_microbatches, k) for k in range(pp))


def _min_in_flight(table: CostTable) -> float:
    cfg = table.config
    return min_in_flight(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches)


def integer_bottleneck_s(table: CostTable) -> float:
    """Least possible max_k R_k with whole blocks, for profiles of one long run of blocks.

    Rank k can take x blocks only if base_k + x t_b <= R: base_k counts its S / p point-to-point
    sends and the first / last layer when its stages 0 / S-1 are on k (at their fastest mode;
    other distinct layers are left out, which keeps the bound valid), t_b the block's fastest
    time; stages no distinct layer can reach need a block each, and another distinct layer at
    least as slow as a block counts as one more block (it must sit on some rank). The least R with
    sum_k x_k >= L is found by raising R through the ranks' next thresholds in order.
    0 when the profile has another shape.
    """
    cfg = table.config
    runs = layer_runs(table)
    num_layers = len(table.layers)
    big = big_run(runs, num_layers)
    if cfg.num_stages == 1 or big is None:
        return 0.0
    p, s = cfg.pp, cfg.num_stages
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    base = [(s // p) * (table.p2p_s if p > 1 else 0.0)] * p
    t_b = min(table.layers[runs[big][0]].time_per_microbatch_s(r) for r in RECOMPUTE)
    count = runs[big][1] - runs[big][0] + 1
    reach: set[int] = set()
    for g, (a, _b) in enumerate(runs):
        if g == big:
            continue
        reach |= set(range(max(0, a - (num_layers - s)), min(a, s - 1) + 1))
        t_min = min(table.layers[a].time_per_microbatch_s(r) for r in RECOMPUTE)
        if a in (0, num_layers - 1):
            base[stage_rank[0 if a == 0 else s - 1]] += t_min
        elif t_min >= t_b:  # placed somewhere: counts at least as a block
            count += 1
    need = [sum(1 for j in range(s) if stage_rank[j] == k and j not in reach) for k in range(p)]
    level = max(base[k] + need[k] * t_b for k in range(p))
    if t_b <= 0:
        return level
    held = [need[k] + int((level - base[k] - need[k] * t_b) / t_b + FLOAT_SLACK) for k in range(p)]
    heap = [(base[k] + (held[k] + 1) * t_b, k) for k in range(p)]
    heapq.heapify(heap)
    while sum(held) < count:
        level, k = heapq.heappop(heap)
        held[k] += 1
        heapq.heappush(heap, (base[k] + (held[k] + 1) * t_b, k))
    return level


def recv_buffer_counts(table: CostTable) -> tuple[int, ...]:
    """Per pipeline rank, its one-micro-batch receive buffers (``pipeline_buffer_bytes`` is this
    times ``recv_buffer_bytes``); depends only on the schedule, pp, v, m and the policy."""
    cfg = table.config
    return tuple(
        pipeline_buffer_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages,
                                     table.num_microbatches, k,
                                     policy=table.framework.pipeline_recv_buffers)
        for k in range(cfg.pp)
    )


def _rank_curves(table: CostTable, runs, big: int,
                 recv: tuple[int, ...]) -> list[tuple[float, int, tuple]]:
    """Per pipeline rank: (its p2p time, blocks its stages need, (c0, f_k: blocks -> time)).

    f_k (``ilp_hull.rank_time_curve``) holds the edge layers that can only sit on rank k; the
    others are left out (they only add time and memory). Memory is the ILP's: capacity less
    buffers and the rank's pipeline receive buffers, without the ILP's safety margin.
    """
    cfg = table.config
    p, s, num_layers = cfg.pp, cfg.num_stages, len(table.layers)
    stage_rank = [rank_of_stage(cfg.schedule, p, j) for j in range(s)]
    edges: list[list] = [[] for _ in range(p)]
    reach: set[int] = set()
    for g, (a, _b) in enumerate(runs):
        if g != big:
            window = range(max(0, a - (num_layers - s)), min(a, s - 1) + 1)
            reach |= set(window)
            ranks = {stage_rank[j] for j in window}
            if len(ranks) == 1:
                edges[ranks.pop()].append(table.layers[a])
    p2p = table.p2p_s if p > 1 else 0.0
    block = table.layers[runs[big][0]]
    size = runs[big][1] - runs[big][0] + 1
    curves = []
    for k in range(p):
        fly = held_floor(cfg.schedule, p, cfg.virtual_stages, table.num_microbatches, k)
        pbuf = recv[k] * table.recv_buffer_bytes
        room = (table.capacity_bytes - table.buffers_bytes - pbuf) / GIB
        need = sum(1 for j in range(s) if stage_rank[j] == k and j not in reach)
        curve = rank_time_curve(block, edges[k], fly, size, room)
        curves.append((stage_rank.count(k) * p2p, need, curve))
    return curves


def _most_blocks(base: float, curve, low: int, high: int, level: float) -> int:
    """The largest x in [low, high] with base + f(x) <= level (true at low; f non-decreasing).

    Bisection over the free regime (closed form), then one count at a time over the binding
    counts (each an enumeration; few are under the level).
    """
    free_max, least_s = curve
    top = min(free_max, high)
    if low < top:
        lo, hi = low, top
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if base + least_s(mid) <= level:
                lo = mid
            else:
                hi = mid - 1
        if lo < top:
            return lo
        low = top
    while low < high and base + least_s(low + 1) <= level:
        low += 1
    return low


def memory_bottleneck_s(table: CostTable, start_s: float = 0.0,
                        recv: tuple[int, ...] | None = None) -> float:
    """Least possible max_k R_k with whole blocks whose recompute mix fits each rank's memory.

    For profiles of one long run of blocks (0 otherwise). Rank k holding x blocks takes at least
    v p2p + f_k(x) per micro-batch, f_k the fastest mix of recompute modes of x blocks (and the
    edge layers only rank k can hold) within its memory at its own held floor
    (``ilp_hull.rank_time_curve``, the ILP's hull); f_k grows with x. The least R >= start_s
    (itself a lower bound) with sum_k max{x : v p2p + f_k(x) <= R} >= L, each rank at least the
    blocks its edge-free stages need, is found by raising R through the ranks' next thresholds
    in order; inf when the blocks fit nowhere. Under tight memory this is far above
    ``integer_bottleneck_s``: a 1F1B rank near the front holds up to p micro-batches'
    activations and must recompute or hold fewer blocks.
    """
    cfg = table.config
    runs = layer_runs(table)
    big = big_run(runs, len(table.layers))
    if cfg.num_stages == 1 or big is None:
        return 0.0
    size = runs[big][1] - runs[big][0] + 1
    curves = _rank_curves(table, runs, big, recv_buffer_counts(table) if recv is None else recv)
    level = max(start_s, *(base + curve[1](need) for base, need, curve in curves))
    if level == math.inf:
        return level
    held = [_most_blocks(base, curve, need, size, level) for base, need, curve in curves]
    heap = [(base + curve[1](held[k] + 1), k) for k, (base, _n, curve) in enumerate(curves)
            if held[k] < size]
    heap = [item for item in heap if item[0] < math.inf]
    heapq.heapify(heap)
    while sum(held) < size:
        if not heap:
            return math.inf
        level, k = heapq.heappop(heap)
        held[k] += 1
        base, _need, (_c0, least_s) = curves[k]
        if held[k] < size and base + least_s(held[k] + 1) < math.inf:
            heapq.heappush(heap, (base + least_s(held[k] + 1), k))
    return level * (1 - FLOAT_SLACK)


def time_lower_bound(
    table: CostTable, summary: TableSummary | None = None, *, refined: bool = False,
    in_flight: float | None = None, recv: tuple[int, ...] | None = None,
    duals: tuple[tuple[float, float], ...] | None = None,
) -> float:
    """A step time no split or recompute choice of this candidate can beat (seconds).

    ``in_flight`` is ``min_in_flight`` of the table's schedule, ``recv`` its
    ``recv_buffer_counts`` and ``duals`` its ``memory_duals``, if the caller has them.
    ``refined`` adds the whole-block bottlenecks (``integer_bottleneck_s``, and
    ``memory_bottleneck_s`` with each rank's memory; slower, used on the candidates that survive
    the cheap bound).
    """
    summary = summary or summarize(table)
    cfg = table.config
    p, s = cfg.pp, cfg.num_stages
    p2p = table.p2p_s if p > 1 else 0.0
    # Memory summed over ranks: sum_k mem_k <= p capacity (each rank's transient >= the least).
    budget = (
        p * (table.capacity_bytes - table.buffers_bytes - summary.transient_min_bytes)
        - summary.static_sum_bytes
    )
    in_flight = _min_in_flight(table) if in_flight is None else in_flight
    total = _min_time_under_memory(summary.runs, in_flight, budget, duals) + s * p2p
    # Pigeonhole: some rank holds ceil(L_g / p) layers of run g (and every rank S / p stages).
    busiest = max(-(-count // p) * min(t) for count, t, _ in summary.runs)
    bottleneck = max(total / p, busiest + (s // p) * p2p)
    if refined:
        bottleneck = max(bottleneck, integer_bottleneck_s(table))
        bottleneck = max(bottleneck, memory_bottleneck_s(table, bottleneck, recv))
    pipeline = table.num_microbatches * bottleneck
    c = bubble_coefficient(cfg.schedule, p, cfg.virtual_stages, cfg.num_microbatches)
    pipeline += c * total
    if cfg.data_ranks > 1:
        tail = max(table.dp_tail_s + summary.opt_sum_s / p, summary.exposed_sum_s / p)
    else:
        tail = summary.opt_sum_s / p
    return pipeline + tail + table.step_fixed_s


def memory_lower_bound(table: CostTable, summary: TableSummary | None = None, *,
                       in_flight: float | None = None) -> float:
    """A largest-rank memory (bytes) no split or recompute choice of this candidate can beat
    (``in_flight`` as in ``time_lower_bound``)."""
    summary = summary or summarize(table)
    p = table.config.pp
    f = _min_in_flight(table) if in_flight is None else in_flight
    act_min = sum(n * min(a) for n, _, a in summary.runs)
    mean = (summary.static_sum_bytes + f * act_min) / p + summary.transient_min_bytes
    single = max(
        static + min(f * act[r] + trans[r] for r in range(len(act)))
        for static, act, trans in summary.single_bytes
    )
    return table.buffers_bytes + max(mean, single)


def ilp_key(table: CostTable) -> tuple:
    """Everything the ILP and the bounds read: candidates with equal keys share one solution."""
    cfg = table.config
    s = cfg.num_stages
    placement = tuple(rank_of_stage(cfg.schedule, cfg.pp, j) for j in range(s))
    flights = tuple(
        held_vectors(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
        for k in range(cfg.pp)
    )
    runs = layer_runs(table)
    signature = tuple((b - a + 1, cost_signature(table.layers[a])) for a, b in runs)
    return (
        signature,
        table.num_microbatches,
        table.p2p_s,
        table.dp_tail_s,
        table.overlap_efficiency,
        table.overlap_slowdown,
        table.step_fixed_s,
        table.recv_buffer_bytes,
        table.framework.pipeline_recv_buffers,
        table.buffers_bytes,
        table.capacity_bytes,
        cfg.pp,
        s,
        cfg.data_ranks > 1,
        placement,
        flights,
        bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches),
    )


# A capacity no memory term reaches (an infinite one makes inf - inf in the memory budget).
_UNLIMITED_BYTES = 1e30


def unlimited_memory_time_bound(table: CostTable, summary: TableSummary) -> float:
    """``time_lower_bound`` with unlimited memory (the dual at lam = 0 alone): a step time no
    split, recompute choice or offloading of the candidate can beat, since offloading only
    frees memory and adds time (copies, the CPU step)."""
    free = sum(n * min(t) for n, t, _ in summary.runs)
    return time_lower_bound(dataclasses.replace(table, capacity_bytes=_UNLIMITED_BYTES),
                            summary, in_flight=1.0, duals=((0.0, free),))
