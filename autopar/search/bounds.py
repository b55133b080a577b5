"""Cheap bounds on one outer candidate, valid for every split and recompute choice.

Notation as in ``autopar/cost_model/assemble.py``: S stages on p ranks, m micro-batches,
t_i(r) a layer's time per micro-batch, c the bubble coefficient.

Time. sum_j T_j = sum_i t_i(r_i) + S p2p >= A, with A - S p2p a lower bound on sum_i t_i(r_i)
over recompute choices whose activations fit the memory of all ranks together (a Lagrangian
bound of that multiple-choice knapsack; without memory pressure it is sum_i min_r t_i(r)); so the
pipeline term
m max_k R_k + c sum_j T_j >= m max(A / p, max_i min_r t_i + p2p) + c A. The tail
max_k E_k >= max(dp_tail + sum_i opt_i / p, sum_i (dp_step_i - eta bwd_i + opt_i) / p) (a max is at
least the mean), or sum_i opt_i / p without data parallelism.

Memory. max_k mem_k >= mean_k mem_k >= (sum_i static_i + f_min sum_i min_r act_i(r)) / p
+ min_i min_r transient_i(r) + buffers, with f_min the fewest in-flight micro-batches of any rank;
and the rank holding layer i needs at least static_i + min_r (f_min act_i(r) + transient_i(r)).
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from autopar.config import RECOMPUTE
from autopar.cost_model.partition import balanced_partition
from autopar.cost_model.pipeline import bubble_coefficient, in_flight_microbatches
from autopar.cost_model.tables import CostTable
from autopar.schedules import rank_of_stage
from autopar.search.ilp import cost_signature, layer_runs
from autopar.search.ilp_ranks import big_run

__all__ = [
    "TableSummary",
    "balanced_split",
    "ilp_key",
    "integer_bottleneck_s",
    "memory_lower_bound",
    "summarize",
    "time_lower_bound",
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
    return TableSummary(
        runs=tuple(runs),
        t_min_max_s=max(min(t) for _, t, _ in runs),
        opt_sum_s=sum(lay.optimizer_s for lay in layers),
        exposed_sum_s=sum(lay.dp_step_s - eta * lay.backward_s + lay.optimizer_s for lay in layers),
        static_sum_bytes=sum(lay.static_bytes for lay in layers),
        transient_min_bytes=min(min(lay.transient_bytes) for lay in layers),
        single_bytes=tuple(sorted(singles)),
    )


def _min_time_under_memory(runs, in_flight: float, budget_bytes: float) -> float:
    """Lagrangian lower bound of min sum_i t_i(r_i) s.t. in_flight sum_i act_i(r_i) <= budget.

    For any lam >= 0: sum_g L_g min_r (t_g(r) + lam f a_g(r)) - lam budget is a lower bound (weak
    duality); the dual is concave piecewise linear, so its maximum is at a breakpoint.
    """
    lams = {0.0}
    for _, t, a in runs:
        for r, s in itertools.combinations(range(len(t)), 2):
            da = in_flight * (a[r] - a[s])
            if da != 0 and (t[s] - t[r]) / da > 0:
                lams.add((t[s] - t[r]) / da)
    return max(
        sum(n * min(t[r] + lam * in_flight * a[r] for r in range(len(t))) for n, t, a in runs)
        - lam * budget_bytes
        for lam in sorted(lams)
    )


def _min_in_flight(table: CostTable) -> float:
    cfg = table.config
    return min(
        in_flight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
        for k in range(cfg.pp)
    )


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
    n_layers = len(table.layers)
    big = big_run(runs, n_layers)
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
        reach |= set(range(max(0, a - (n_layers - s)), min(a, s - 1) + 1))
        t_min = min(table.layers[a].time_per_microbatch_s(r) for r in RECOMPUTE)
        if a in (0, n_layers - 1):
            base[stage_rank[0 if a == 0 else s - 1]] += t_min
        elif t_min >= t_b:  # placed somewhere: counts at least as a block
            count += 1
    need = [sum(1 for j in range(s) if stage_rank[j] == k and j not in reach) for k in range(p)]
    level = max(base[k] + need[k] * t_b for k in range(p))
    if t_b <= 0:
        return level
    held = [need[k] + int((level - base[k] - need[k] * t_b) / t_b + 1e-9) for k in range(p)]
    heap = [(base[k] + (held[k] + 1) * t_b, k) for k in range(p)]
    heapq.heapify(heap)
    while sum(held) < count:
        level, k = heapq.heappop(heap)
        held[k] += 1
        heapq.heappush(heap, (base[k] + (held[k] + 1) * t_b, k))
    return level


def time_lower_bound(
    table: CostTable, summary: TableSummary | None = None, *, refined: bool = False
) -> float:
    """A step time no split or recompute choice of this candidate can beat (seconds).

    ``refined`` adds the whole-block bottleneck (``integer_bottleneck_s``; slower, used on the
    candidates that survive the cheap bound).
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
    total = _min_time_under_memory(summary.runs, _min_in_flight(table), budget) + s * p2p
    # Pigeonhole: some rank holds ceil(L_g / p) layers of run g (and every rank S / p stages).
    busiest = max(-(-count // p) * min(t) for count, t, _ in summary.runs)
    bottleneck = max(total / p, busiest + (s // p) * p2p)
    if refined:
        bottleneck = max(bottleneck, integer_bottleneck_s(table))
    pipeline = table.num_microbatches * bottleneck
    c = bubble_coefficient(cfg.schedule, p, cfg.virtual_stages, cfg.num_microbatches)
    pipeline += c * total
    if cfg.dp * cfg.cp > 1:
        tail = max(table.dp_tail_s + summary.opt_sum_s / p, summary.exposed_sum_s / p)
    else:
        tail = summary.opt_sum_s / p
    return pipeline + tail + table.step_fixed_s


def memory_lower_bound(table: CostTable, summary: TableSummary | None = None) -> float:
    """A largest-rank memory (bytes) no split or recompute choice of this candidate can beat."""
    summary = summary or summarize(table)
    p = table.config.pp
    f = _min_in_flight(table)
    act_min = sum(n * min(a) for n, _, a in summary.runs)
    mean = (summary.static_sum_bytes + f * act_min) / p + summary.transient_min_bytes
    single = max(
        static + min(f * act[r] + trans[r] for r in range(len(act)))
        for static, act, trans in summary.single_bytes
    )
    return table.buffers_bytes + max(mean, single)


def balanced_split(table: CostTable, recompute: str) -> tuple[tuple[int, int], ...]:
    """The most balanced contiguous split by time per micro-batch under uniform recompute."""
    costs = [layer.time_per_microbatch_s(recompute) for layer in table.layers]
    return balanced_partition(costs, table.config.num_stages)


def ilp_key(table: CostTable) -> tuple:
    """Everything the ILP and the bounds read: candidates with equal keys share one solution."""
    cfg = table.config
    s = cfg.num_stages
    placement = tuple(rank_of_stage(cfg.schedule, cfg.pp, j) for j in range(s))
    flights = tuple(
        in_flight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
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
        cfg.dp * cfg.cp > 1,
        placement,
        flights,
        bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches),
    )
