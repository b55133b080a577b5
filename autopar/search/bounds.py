"""Cheap bounds on one outer candidate, valid for every split and recompute choice.

Notation as in ``autopar/cost_model/assemble.py``: S stages on p ranks, m micro-batches,
t_i(r) a layer's time per micro-batch, c the bubble coefficient.

Time. sum_j T_j = sum_i t_i(r_i) + S p2p >= sum_i min_r t_i(r) + S p2p =: A, so the pipeline term
m max_k R_k + c sum_j T_j >= m max(A / p, max_i min_r t_i + p2p) + c A. The tail
max_k E_k >= max(dp_tail + sum_i opt_i / p, sum_i (dp_step_i - eta bwd_i + opt_i) / p) (a max is at
least the mean), or sum_i opt_i / p without data parallelism.

Memory. max_k mem_k >= mean_k mem_k >= (sum_i static_i + f_min sum_i min_r act_i(r)) / p
+ min_i min_r transient_i(r) + buffers, with f_min the fewest in-flight micro-batches of any rank;
and the rank holding layer i needs at least static_i + min_r (f_min act_i(r) + transient_i(r)).
"""

from __future__ import annotations

from autopar.cost_model.partition import balanced_partition
from autopar.cost_model.pipeline import bubble_coefficient, in_flight_microbatches, rank_of_stage
from autopar.cost_model.tables import CostTable
from autopar.search.ilp import cost_signature, layer_runs

__all__ = ["balanced_split", "ilp_key", "memory_lower_bound", "time_lower_bound"]

_R = range(3)


def time_lower_bound(table: CostTable) -> float:
    """A step time no split or recompute choice of this candidate can beat (seconds)."""
    cfg, layers = table.config, table.layers
    p, s = cfg.pp, cfg.num_stages
    p2p = table.p2p_s if p > 1 else 0.0
    t_min = [
        min(layer.time_per_microbatch_s(r) for r in ("none", "selective", "full"))
        for layer in layers
    ]
    total = sum(t_min) + s * p2p
    pipeline = table.num_microbatches * max(total / p, max(t_min) + p2p)
    pipeline += bubble_coefficient(cfg.schedule, p, cfg.virtual_stages) * total
    opt = sum(layer.optimizer_s for layer in layers)
    if cfg.dp > 1:
        exposed = sum(
            layer.dp_step_s - table.overlap_efficiency * layer.backward_s + layer.optimizer_s
            for layer in layers
        )
        tail = max(table.dp_tail_s + opt / p, exposed / p)
    else:
        tail = opt / p
    return pipeline + tail


def _min_in_flight(table: CostTable) -> float:
    cfg = table.config
    return min(
        in_flight_microbatches(cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, k)
        for k in range(cfg.pp)
    )


def memory_lower_bound(table: CostTable) -> float:
    """A largest-rank memory (bytes) no split or recompute choice of this candidate can beat."""
    p, layers = table.config.pp, table.layers
    f = _min_in_flight(table)
    mean = sum(layer.static_bytes + f * min(layer.act_bytes) for layer in layers) / p + min(
        min(layer.transient_bytes) for layer in layers
    )
    single = max(
        layer.static_bytes + min(f * layer.act_bytes[r] + layer.transient_bytes[r] for r in _R)
        for layer in layers
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
        table.buffers_bytes,
        table.capacity_bytes,
        cfg.pp,
        s,
        cfg.dp > 1,
        placement,
        flights,
        bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages),
    )
