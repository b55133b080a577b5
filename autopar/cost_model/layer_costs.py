"""Build the CostTable of one configuration: every per-layer term, from the profile and cluster.

Units: seconds and bytes, per micro-batch and per rank unless named per step. The terms come from
``compute`` (FLOPs over achieved throughput), ``memory`` (model state as the runtime holds it,
activations), ``comm`` (alpha-beta ring collectives on the tp, dp and pp groups); ``assemble``
turns the table into an Estimate with the formula the search's ILP shares.

Communication charged (the runtime's collectives, autopar/runtime/data_parallel.py):
- tp: per block, one all-reduce (or reduce-scatter + all-gather with sequence parallelism, equal
  in the ring model) per row-parallel output in forward and as many in backward
  (``allreduce_fwd_bytes`` of the profile); full recompute repeats the forward ones. The
  vocab-parallel embedding all-reduces its output; the head all-gathers the logits forward and
  all-reduces its input gradient backward (the counts are in collectives.py).
- dp, zero 0 (DDP / replicate()): one all-reduce of the fp32 gradients per step, overlapped with
  the last micro-batch's backward except the last bucket.
- dp, zero 1: parameter all-gather once per step (prefetched under the first micro-batch's
  forward: only the excess is charged), gradient reduce-scatter once per step.
- dp, zero 2: the same all-gather, gradient reduce-scatter every micro-batch.
- dp, zero 3: per micro-batch, parameter all-gather in forward and in backward plus the gradient
  reduce-scatter; each overlaps its layer's compute (prefetch), only the excess is exposed.
- pp: per micro-batch and stage, the activation send forward and the gradient send backward.
"""

from __future__ import annotations

import dataclasses

from autopar.config import DTYPE_BYTES, RECOMPUTE, ParallelConfig
from autopar.cost_model import comm, memory
from autopar.cost_model.compute import layer_compute
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.tables import CostTable, LayerCost
from autopar.graph.types import LayerProfile, ModelProfile

__all__ = ["OPTIMIZER_TRAFFIC_BYTES_PER_PARAM", "build_cost_table", "tp_sharded"]

MIB = 2**20
# torch's foreach AdamW touches its fp32 tensors (param, grad, exp_avg, exp_avg_sq) in about eight
# elementwise kernels of two tensors each: ~16 x 4 bytes per parameter per step (memory bound).
OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 64
DDP_BUCKET_BYTES = 25 * MIB  # DistributedDataParallel's default bucket_cap_mb


_FIELDS = tuple(f.name for f in dataclasses.fields(LayerCost))


def tp_sharded(layer: LayerProfile) -> bool:
    """Whether tensor parallelism splits this layer (column/row-parallel or vocab-parallel)."""
    return bool(layer.tp.colwise or layer.tp.rowwise or layer.tp.vocab_parallel)


def _tp_comm(profile, layer: LayerProfile, link: comm.GroupLink, cfg, ratio: float) -> tuple:
    """Exposed tp collective time per micro-batch by recompute mode (collectives.py's list)."""
    if link.size <= 1:
        return (0.0, 0.0, 0.0)
    b, w = cfg.micro_batch, DTYPE_BYTES[cfg.dtype]
    hidden_bytes = profile.seq_len * profile.hidden * b * w  # one [b, s, h] activation
    if layer.kind == "block":
        count = len(layer.tp.rowwise)
        total = layer.tp.allreduce_fwd_bytes * b * ratio
        if count == 0 or total <= 0:
            return (0.0, 0.0, 0.0)
        # forward: one all-reduce (SP: all-gather + reduce-scatter) per row-parallel output;
        # backward as many for the column-parallel inputs; full recompute repeats the forward.
        fwd = count * comm.all_reduce_s(link, total / count)
        return (2 * fwd, 2 * fwd, 3 * fwd)
    if not layer.tp.vocab_parallel:
        return (0.0, 0.0, 0.0)
    if layer.kind == "embedding":  # vocab-parallel lookup: one all-reduce forward
        fwd = comm.all_reduce_s(link, layer.tp.allreduce_fwd_bytes * b * ratio or hidden_bytes)
        return (fwd, fwd, 2 * fwd)
    if layer.kind == "head":  # logits all-gather forward, input-gradient all-reduce backward
        fwd = comm.all_gather_s(link, profile.seq_len * profile.vocab * b * w)
        if cfg.sequence_parallel:
            fwd += comm.all_gather_s(link, hidden_bytes)
        bwd = comm.all_reduce_s(link, hidden_bytes) / (2 if cfg.sequence_parallel else 1)
        return (fwd + bwd, fwd + bwd, 2 * fwd + bwd)
    return (0.0, 0.0, 0.0)


def _dp_terms(cfg, link, params_tp: float, fwd_s: float, bwd_s: float, eta: float):
    """(dp_step_s, dp_microbatch_s, tail_s) of one layer (see the module docstring)."""
    kind = memory.dp_mechanism(cfg)
    if kind == "none":
        return 0.0, 0.0, 0.0
    w = DTYPE_BYTES[cfg.dtype]
    grads = memory.GRAD_BYTES * params_tp
    if kind in ("ddp", "replicate"):
        tail = comm.all_reduce_s(link, min(grads, DDP_BUCKET_BYTES))
        return comm.all_reduce_s(link, grads), 0.0, tail
    gather = comm.all_gather_s(link, w * params_tp)
    scatter = comm.reduce_scatter_s(link, grads)
    # Zero 1/2 gather once per step, prefetched under the first micro-batch's forward.
    step_gather = max(0.0, gather - eta * fwd_s)
    if cfg.zero == 1:
        return step_gather + scatter, 0.0, scatter
    if cfg.zero == 2:
        return step_gather, max(0.0, scatter - eta * bwd_s), scatter
    per_mb = max(0.0, gather - eta * fwd_s) + max(0.0, gather + scatter - eta * bwd_s)
    return 0.0, per_mb, scatter


def _layer_cost(profile, cluster, cfg, layer, groups, ratio) -> tuple[LayerCost, float]:
    b, tp = cfg.micro_batch, cfg.tp
    w = DTYPE_BYTES[cfg.dtype]
    shard = tp if tp_sharded(layer) else 1
    vocab_shard = tp if layer.tp.vocab_parallel else 1
    head_elems = profile.seq_len * profile.vocab / vocab_shard if layer.kind == "head" else 0.0
    act = memory.activation_bytes(
        layer, cfg, dtype_ratio=ratio, tp_sharded=shard > 1, logprob_elements=head_elems
    )
    rec_flops = tuple(layer.recompute_flops.get(m, 0.0) for m in RECOMPUTE)
    times = layer_compute(
        cluster.device,
        cluster.device.peak_flops(cfg.dtype),
        fwd_flops=layer.fwd_flops * b / shard,
        bwd_flops=layer.bwd_flops * b / shard,
        recompute_flops=tuple(f * b / shard for f in rec_flops),
        elementwise_bytes=act[0],
    )
    params_tp = layer.num_params / shard
    state = memory.layer_state(params_tp, cfg)
    eta = cluster.dp_overlap_efficiency
    step_s, mb_s, tail_s = _dp_terms(cfg, groups["dp"], params_tp, times.forward_s,
                                     times.backward_s, eta)
    fsdp = memory.dp_mechanism(cfg) == "fsdp"
    sp_div = tp if (cfg.sequence_parallel and shard > 1) else 1
    transient = memory.transient_bytes(
        act,
        output_bytes=layer.output_bytes * b * ratio / sp_div,
        gathered_param_bytes=2 * w * params_tp if fsdp and cfg.zero == 3 else 0.0,
        unsharded_grad_bytes=(w + memory.GRAD_BYTES) * params_tp if fsdp else 0.0,
        logits_bytes=(w + memory.FP32_LOGPROB_BYTES) * head_elems * b,
    )
    cost = LayerCost(
        name=layer.name,
        num_params=layer.num_params,
        model_flops_per_sample=layer.fwd_flops + layer.bwd_flops,
        recompute_flops_per_sample=(rec_flops[0], rec_flops[1], rec_flops[2]),
        compute_s=times.forward_s + times.backward_s,
        backward_s=times.backward_s,
        recompute_s=times.recompute_s,
        tp_comm_s=_tp_comm(profile, layer, groups["tp"], cfg, ratio),
        dp_microbatch_s=mb_s,
        act_bytes=act,
        transient_bytes=transient,
        param_bytes=state.param_bytes,
        grad_bytes=state.grad_bytes,
        optimizer_bytes=state.optimizer_bytes,
        dp_step_s=step_s,
        optimizer_s=OPTIMIZER_TRAFFIC_BYTES_PER_PARAM * state.local_params
        / cluster.device.hbm_bytes_per_s,
    )
    return cost, tail_s


def build_cost_table(profile: ModelProfile, cluster: Cluster, config: ParallelConfig) -> CostTable:
    """Every per-layer cost term of ``config`` on ``cluster`` for ``profile``.

    Args:
        profile: the model profile (bytes at ``profile.dtype``, counts per sample).
        cluster: the cluster.
        config: the outer configuration.

    Returns:
        The CostTable that ``assemble`` and the search's ILP consume.
    """
    cfg = config
    ratio = DTYPE_BYTES[cfg.dtype] / DTYPE_BYTES[profile.dtype]
    groups = comm.parallel_groups(cluster, cfg)
    layers: list[LayerCost] = []
    tails: list[float] = []
    done: dict[str, tuple[dict, float]] = {}
    for layer in profile.layers:
        # A repeated block shares its first occurrence's measurements, hence its costs.
        if layer.repeat_of in done and layer.kind == "block":
            fields, tail = done[layer.repeat_of]
            fields["name"] = layer.name
            cost = LayerCost(**fields)
        else:
            cost, tail = _layer_cost(profile, cluster, cfg, layer, groups, ratio)
            done[layer.name] = ({f: getattr(cost, f) for f in _FIELDS}, tail)
        layers.append(cost)
        tails.append(tail)
    p2p = 0.0
    if cfg.pp > 1:
        sp_div = cfg.tp if cfg.sequence_parallel else 1
        boundary = max(layer.output_bytes for layer in profile.layers) * cfg.micro_batch * ratio
        # forward activation send + backward gradient send of one micro-batch
        p2p = 2 * comm.p2p_s(groups["pp"], boundary / sp_div)
    return CostTable(
        config=cfg,
        layers=tuple(layers),
        num_microbatches=cfg.num_microbatches,
        p2p_s=p2p,
        dp_tail_s=max(tails) if cfg.dp > 1 else 0.0,
        overlap_efficiency=cluster.dp_overlap_efficiency,
        buffers_bytes=memory.buffers_bytes(cfg),
        capacity_bytes=cluster.usable_memory_bytes,
        peak_flops=cluster.device.peak_flops(cfg.dtype),
        tokens_per_step=cfg.global_batch * profile.seq_len,
        world_size=cfg.world_size,
    )
