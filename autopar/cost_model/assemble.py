"""Assemble an Estimate from a CostTable, a stage split and per-layer recompute choices.

The step-time formula (the search's ILP encodes exactly this; keep them in sync):

    t_i(r)   = compute_i + recompute_i(r) + tp_comm_i(r) + dp_microbatch_i   (one micro-batch)
    T_j      = sum_{i in stage j} t_i(r_i) + p2p                             (p2p = 0 if pp == 1)
    R_k      = sum_{j on rank k} T_j                                          (per pipeline rank)
    pipeline = m * max_k R_k + c * sum_j T_j        c = bubble_coefficient(schedule, p, v)
    r_k      = sum_{i on k} dp_step_i,   w_k = eta * sum_{i on k} backward_i
    dp_k     = max(dp_tail, s r_k, r_k - (1 - s) w_k)          (dp > 1; s = overlap slowdown)
    E_k      = dp_k + sum_{i on k} optimizer_i
    step     = pipeline + max_k E_k + fixed      (fixed: framework step overhead + first gather)

For uniform stages, pipeline = (m v + p - 1) T_chunk: Megatron-LM SC'21 Eq. 1 generalised to v
chunks. The DP reduction overlaps the last micro-batch's backward (gradients are synchronised
once per step, after accumulation); what the window cannot hide, or at least the last bucket, is
exposed. Every term is a sum or a max of sums, so the ILP can minimise it exactly.

Memory of pipeline rank k:

    static_k = sum_{i on k} (param_i + grad_i + optimizer_i)
    act_k    = max_{c in H_k} sum_{j on k} c_j sum_{i in j} act_i(r_i)
               + max_{i on k} transient_i(r_i)
               H_k: the per-chunk held counts rank k's peak is a max over (held_counts.py)
    pbuf_k   = pipeline_buffer_microbatches(schedule, p, v, m, k) * recv_buffer_bytes
    mem_k    = static_k + act_k + buffers + pbuf_k;       fits  <=>  max_k mem_k <= capacity

pbuf_k (``pipeline_buffer_bytes``) is what the framework's pipeline keeps to receive: torch's
PipelineStage one buffer per micro-batch for stage inputs and output gradients, and the split
backward's input gradients (pipeline.py); a framework that allocates a tensor per transfer only
the ones in flight. It depends on the rank only, not on the split (the ILP adds it per rank).
"""

from __future__ import annotations

from collections.abc import Sequence

from autopar.config import RECOMPUTE
from autopar.cost_model.comm import COMM_SPREAD
from autopar.cost_model.estimate import Estimate, MemoryBreakdown, StageEstimate, TimeBreakdown
from autopar.cost_model.held_counts import held_split_vectors, held_vectors, splits_backward
from autopar.cost_model.moe import DROPLESS_IMBALANCE, FITTED_ROUTER_IMBALANCE_RANGE
from autopar.cost_model.overlap import overlapped_s
from autopar.cost_model.pipeline import bubble_coefficient, pipeline_buffer_microbatches
from autopar.cost_model.tables import RECOMPUTE_INDEX, CostTable
from autopar.schedules import rank_of_stage
from autopar.units import GIB

__all__ = ["assemble", "check_split", "held_activations", "pipeline_buffer_bytes"]

# Reports add "memory nearly full" above this fraction of the usable memory: a reporting
# threshold (a plan that close has little room for what the model leaves out), not a cost term.
NEARLY_FULL_FRACTION = 0.9


def pipeline_buffer_bytes(table: CostTable, rank: int) -> float:
    """Bytes of torch pipelining's receive buffers (and held input gradients) on ``rank``."""
    cfg = table.config
    count = pipeline_buffer_microbatches(
        cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, rank,
        policy=table.framework.pipeline_recv_buffers,
    )
    return count * table.recv_buffer_bytes


def check_split(
    table: CostTable, stage_layers: Sequence[tuple[int, int]], recompute: Sequence[str]
) -> None:
    """Raise ValueError unless the split covers every layer once, in order, one stage per chunk."""
    cfg = table.config
    n = len(table.layers)
    if len(stage_layers) != cfg.num_stages:
        raise ValueError(
            f"split has {len(stage_layers)} stages; pp * virtual_stages = {cfg.num_stages}"
        )
    expected = 0
    for first, last in stage_layers:
        if first != expected or last < first:
            raise ValueError(f"stage layer ranges {list(stage_layers)} are not contiguous")
        expected = last + 1
    if expected != n:
        raise ValueError(f"split covers {expected} layers; the profile has {n}")
    if len(recompute) != n or any(r not in RECOMPUTE for r in recompute):
        raise ValueError(f"need one recompute choice in {RECOMPUTE} per layer ({n})")


def _layer_arrays(table: CostTable, recompute: Sequence[str]):
    """Per-layer time, activation and transient bytes under each layer's recompute choice."""
    idx = [RECOMPUTE_INDEX[r] for r in recompute]
    layers = table.layers
    time = [layer.time_per_microbatch_s(r) for layer, r in zip(layers, recompute)]
    act = [layer.act_bytes[k] for layer, k in zip(layers, idx)]
    transient = [layer.transient_bytes[k] for layer, k in zip(layers, idx)]
    return idx, time, act, transient


def _rank_memory(table, stage_layers, stages, rank, act, transient, idx) -> MemoryBreakdown:
    chunk_act = [sum(act[i] for i in range(stage_layers[j][0], stage_layers[j][1] + 1))
                 for j in stages]  # stages in order: local chunk order
    layers = [i for j in stages for i in range(stage_layers[j][0], stage_layers[j][1] + 1)]
    wpass = [max(0.0, sum(
        table.layers[i].weight_pass_bytes[idx[i]] - table.layers[i].input_pass_freed_bytes[idx[i]]
        for i in range(stage_layers[j][0], stage_layers[j][1] + 1))) for j in stages] if (
        splits_backward(table.config.schedule)) else [0.0] * len(stages)
    held = held_activations(table, rank, stages, chunk_act, wpass)
    peak_act = held + max(transient[i] for i in layers)
    return MemoryBreakdown(
        parameters_bytes=sum(table.layers[i].param_bytes for i in layers),
        gradients_bytes=sum(table.layers[i].grad_bytes for i in layers),
        optimizer_bytes=sum(table.layers[i].optimizer_bytes for i in layers),
        activations_bytes=peak_act,
        buffers_bytes=table.buffers_bytes,
        pipeline_buffers_bytes=pipeline_buffer_bytes(table, rank),
    )


def held_activations(table: CostTable, rank: int, stages: Sequence[int],
                     chunk_act: Sequence[float], chunk_weight_pass: Sequence[float]) -> float:
    """The activations a pipeline rank holds at its peak.

    Args:
        table: the configuration's cost terms (its schedule, pp, virtual stages, micro-batches).
        rank: the pipeline rank.
        stages: the rank's stages (global indices), in local chunk order.
        chunk_act: one micro-batch's activations of each of those stages (A_i).
        chunk_weight_pass: what one micro-batch of each holds more from its input pass to its
            weight pass under a split backward (D_i >= 0: the stage's
            ``LayerCost.weight_pass_bytes`` less the head's ``input_pass_freed_bytes``).

    Returns:
        The max over the rank's count vectors of sum_i c_i A_i, + w_i D_i under a schedule that
        splits backwards (held_counts). Global stage 0 holds nothing more: torch's
        ``PipelineStage`` skips the first stage's input pass and runs its whole backward at W.
    """
    cfg = table.config
    args = (cfg.schedule, cfg.pp, cfg.virtual_stages, table.num_microbatches, rank)
    split = held_split_vectors(*args)
    if not split:
        return max(sum(c * a for c, a in zip(vec, chunk_act)) for vec in held_vectors(*args))
    extra = [0.0 if j == 0 else d for j, d in zip(stages, chunk_weight_pass)]
    v = len(chunk_act)
    return max(sum(c * a for c, a in zip(vec[:v], chunk_act))
               + sum(w * d for w, d in zip(vec[v:], extra)) for vec in split)


def _rank_extra_s(table: CostTable, layers: list[int]) -> tuple[float, float]:
    """(exposed DP reduction, optimizer) of one pipeline rank per step."""
    opt = sum(table.layers[i].optimizer_s for i in layers)
    if table.config.dp * table.config.cp == 1:
        return 0.0, opt
    reduce_s = sum(table.layers[i].dp_step_s for i in layers)
    window_s = table.overlap_efficiency * sum(table.layers[i].backward_s for i in layers)
    return max(table.dp_tail_s, overlapped_s(reduce_s, window_s, table.overlap_slowdown)), opt


def assemble(
    table: CostTable, stage_layers: Sequence[tuple[int, int]], recompute: Sequence[str]
) -> Estimate:
    """Estimate of one split: see the module docstring for the formula.

    Args:
        table: the outer configuration's cost terms.
        stage_layers: (first, last) profile-layer index of each stage (model chunk), in order.
        recompute: one recompute mode per profile layer.

    Returns:
        The Estimate (step time, throughput, MFU, memory of the largest rank, breakdowns).
    """
    check_split(table, stage_layers, recompute)
    cfg, m = table.config, table.num_microbatches
    idx, time, act, transient = _layer_arrays(table, recompute)
    p2p = table.p2p_s if cfg.pp > 1 else 0.0
    times = [sum(time[a : b + 1]) + p2p for a, b in stage_layers]
    ranks = range(cfg.pp)
    stages_of, layers_of = _placement(cfg, stage_layers)
    rank_time = {k: sum(times[j] for j in stages_of[k]) for k in ranks}
    bottleneck = max(ranks, key=lambda k: (rank_time[k], -k))
    c = bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
    bubble_s = c * sum(times)
    extras = {k: _rank_extra_s(table, layers_of[k]) for k in ranks}
    tail = max(ranks, key=lambda k: (sum(extras[k]), -k))
    step_s = m * rank_time[bottleneck] + bubble_s + sum(extras[tail]) + table.step_fixed_s

    blayers = layers_of[bottleneck]
    breakdown = TimeBreakdown(
        compute_s=m * sum(table.layers[i].compute_s for i in blayers),
        recompute_s=m * sum(table.layers[i].recompute_s[idx[i]] for i in blayers),
        tp_comm_s=m * sum(table.layers[i].tp_comm_s[idx[i]] for i in blayers),
        ep_comm_s=m * sum(table.layers[i].ep_comm_s[idx[i]] for i in blayers),
        cp_comm_s=m * sum(table.layers[i].cp_comm_s[idx[i]] for i in blayers),
        pp_comm_s=m * p2p * len(stages_of[bottleneck]),
        dp_comm_s=m * sum(table.layers[i].dp_microbatch_s for i in blayers) + extras[tail][0]
        + table.dp_head_s,
        bubble_s=bubble_s,
        optimizer_s=extras[tail][1],
        overhead_s=table.step_overhead_s,
    )
    per_rank = [
        StageEstimate(
            rank=k,
            stages=tuple(stages_of[k]),
            layers=tuple((stage_layers[j][0], stage_layers[j][1]) for j in stages_of[k]),
            num_params=sum(table.layers[i].num_params for i in layers_of[k]),
            time_per_microbatch_s=rank_time[k],
            memory=_rank_memory(table, stage_layers, stages_of[k], k, act, transient, idx),
        )
        for k in ranks
    ]
    largest = max(per_rank, key=lambda s: (s.memory_bytes, -s.rank))
    host_bytes = max(sum(table.layers[i].host_bytes for i in layers_of[k]) for k in ranks)
    unstated_s = m * sum(table.layers[i].unstated_imbalance_s[idx[i]] for i in blayers)
    return _finish(table, step_s, breakdown, per_rank, largest, recompute, bottleneck, host_bytes,
                   unstated_s)


def _placement(cfg, stage_layers) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """Stages and profile layers of every pipeline rank (``schedules.rank_of_stage``)."""
    stages_of: dict[int, list[int]] = {k: [] for k in range(cfg.pp)}
    for j in range(len(stage_layers)):
        stages_of[rank_of_stage(cfg.schedule, cfg.pp, j)].append(j)
    layers_of = {
        k: [i for j in stages_of[k] for i in range(stage_layers[j][0], stage_layers[j][1] + 1)]
        for k in range(cfg.pp)
    }
    return stages_of, layers_of


def _finish(table, step_s, breakdown, per_rank, largest, recompute, bottleneck,
            host_bytes: float, unstated_s: float = 0.0) -> Estimate:
    cfg = table.config
    batch = cfg.global_batch
    model_flops = batch * sum(layer.model_flops_per_sample for layer in table.layers)
    extra_flops = batch * sum(
        layer.recompute_flops_per_sample[RECOMPUTE_INDEX[r]]
        for layer, r in zip(table.layers, recompute)
    )
    per_gpu = model_flops / table.world_size / step_s
    hw_per_gpu = (model_flops + extra_flops) / table.world_size / step_s
    mem = largest.memory_bytes
    fits = mem <= table.capacity_bytes and host_bytes <= table.host_capacity_bytes
    return Estimate(
        step_time_s=step_s,
        tokens_per_s=table.tokens_per_step / step_s,
        tflops_per_gpu=per_gpu / 1e12,
        hardware_tflops_per_gpu=hw_per_gpu / 1e12,
        mfu=per_gpu / table.peak_flops,
        memory_per_gpu_bytes=mem,
        memory_capacity_bytes=table.capacity_bytes,
        fits=fits,
        time_breakdown=breakdown,
        memory_breakdown=largest.memory,
        stages=tuple(per_rank),
        binding=_binding(table, breakdown, step_s, largest, bottleneck, host_bytes),
        framework=table.framework.spec,
        step_time_interval_s=step_time_interval_s(table, step_s, breakdown, unstated_s),
        host_memory_per_gpu_bytes=host_bytes,
        host_memory_capacity_bytes=table.host_capacity_bytes,
        precision=table.dtype_reason,
    )


def step_time_interval_s(table: CostTable, step_s: float, breakdown: TimeBreakdown,
                         unstated_s: float = 0.0) -> tuple[float, float]:
    """(low, high) step time: the framework's cross-validated band around the prediction,
    widened at the high end by ``comm.COMM_SPREAD`` per second of exposed communication (one
    collective in ten runs that much slower than modelled on published clusters), and over
    the fitted range of router imbalance (``moe.FITTED_ROUTER_IMBALANCE_RANGE``) where the
    model states none: ``unstated_s`` is the binding rank's seconds beyond a balanced router
    at the default ``DROPLESS_IMBALANCE`` f, which grow as f - 1 (compute and all-to-all
    bytes), so the range's ends move the step by ``unstated_s (f_lo - f) / (f - 1)`` and
    ``unstated_s (f_hi - f) / (f - 1)``."""
    low, high = table.framework.step_time_band
    exposed = (breakdown.tp_comm_s + breakdown.dp_comm_s + breakdown.pp_comm_s
               + breakdown.ep_comm_s + breakdown.cp_comm_s)
    per_excess = unstated_s / (DROPLESS_IMBALANCE - 1.0)
    f_lo, f_hi = FITTED_ROUTER_IMBALANCE_RANGE
    return (step_s * low - per_excess * (DROPLESS_IMBALANCE - f_lo),
            step_s * high + COMM_SPREAD * exposed + per_excess * (f_hi - DROPLESS_IMBALANCE))


def _binding(table, breakdown: TimeBreakdown, step_s: float, largest, bottleneck: int,
             host_bytes: float = 0.0) -> str:
    """What limits the split most, in words."""
    mem, cap = largest.memory_bytes, table.capacity_bytes
    if host_bytes > table.host_capacity_bytes:
        return (f"host memory: what the plan keeps there needs {host_bytes / GIB:.1f} GiB per "
                f"GPU of {table.host_capacity_bytes / GIB:.1f} GiB")
    if mem > cap:
        return (
            f"memory: pipeline rank {largest.rank} needs {mem / GIB:.1f} GiB of "
            f"{cap / GIB:.1f} GiB usable"
        )
    terms = breakdown.to_dict()
    name, value = max(terms.items(), key=lambda kv: (kv[1], kv[0]))
    label = name.removesuffix("_s").replace("_", " ")
    note = f"{label} ({100 * value / step_s:.0f}% of the step, pipeline rank {bottleneck})"
    if mem > NEARLY_FULL_FRACTION * cap:
        note += f"; memory nearly full on rank {largest.rank} ({100 * mem / cap:.0f}%)"
    return note
