"""Build the CostTable of one configuration: every per-layer term, from the profile and cluster.

Units: seconds and bytes, per micro-batch and per rank unless named per step. The terms come from
``compute`` (FLOPs over achieved throughput), ``memory`` (model state as the runtime holds it,
activations), ``comm`` (alpha-beta ring collectives on the tp, dp and pp groups); ``assemble``
turns the table into an Estimate with the formula the search's ILP shares.

Communication charged: exactly the collectives the runtime issues (collectives.py lists their
counts; ``charged_collectives`` returns the counts these terms charge, tested equal), each timed
by ``comm.collective_s`` at the size of its call:
- tp, per micro-batch (``tp_collectives``): per block, the row-parallel outputs forward and the
  column-parallel parents' input gradients backward, each one all-reduce of a [b, s, h]
  activation (with sequence parallelism an all-gather and a reduce-scatter of the same size in
  their place, plus one all-gather in the first block's backward); full recompute re-runs the
  forward ones but the block's last. The vocab-parallel embedding all-reduces its output; the
  head all-gathers the logits ([b, s, V]) forward and all-reduces its input gradient backward
  (with SP: all-gathers the sequence forward, reduce-scatters the input gradient backward).
- dp (``dp_collectives``), per FSDP2 / replicate() unit: a block, or a stage root holding the
  non-block layers (at pp == 1 one root holds the embedding and the head: it is charged on the
  first of them). All-gathers move the unit's parameters at the training dtype, reduce-scatters
  and all-reduces its gradients in fp32 (the reduce dtype).
  zero 0: DDP all-reduces 25 MiB buckets in the last micro-batch's backward; replicate(), per unit.
  zero 1: one all-gather per step (prefetched under the first micro-batch's forward: only the
  excess is charged), one reduce-scatter per step.
  zero 2: the same all-gather, one reduce-scatter per micro-batch (pp == 1) or per step (pp > 1).
  zero 3, pp == 1: per micro-batch an all-gather in forward and in backward and a reduce-scatter;
  pp > 1: an all-gather per micro-batch forward, one in the first backward, one reduce-scatter
  per step. Collectives in a micro-batch overlap that micro-batch's compute of the layer
  (prefetch): only the excess is exposed. Per-step backward reductions overlap the last
  micro-batch's backward (assemble.py), except the last one (``dp_tail_s``).
- pp: per micro-batch and stage, the activation send forward and the gradient send backward.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

from autopar.config import (
    DTYPE_BYTES,
    RECOMPUTE,
    ParallelConfig,
    base_dtype,
)
from autopar.cost_model import comm, memory
from autopar.cost_model.checkpoints import checkpoint_terms
from autopar.cost_model.collectives import first_block_index, rank_stages, stage_split
from autopar.cost_model.cp_comm import (
    cp_exchange_s,
    cp_link,
    cp_terms,
    gather_collectives,
    kv_bytes,
    local_profile,
)
from autopar.cost_model.dp_comm import (
    dp_head_s,
    dp_terms,
    framework_dp_collectives,
    fsdp_root_bytes,
    fsdp_unit_params,
    params_tp,
    root_share,
)
from autopar.cost_model.ep_comm import edp_link, unit_collectives
from autopar.cost_model.expert_tp import costed_profiles, model_flops_once
from autopar.cost_model.framework_names import DEFAULT_FRAMEWORK, RUNTIME
from autopar.cost_model.framework_support import (
    model_framework,
    moe_routes_whole_sequence,
    moe_tp_mode,
)
from autopar.cost_model.frameworks import Framework, get_framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.layer_terms import (
    activation_bytes_of,
    framework_layer,
    grad_bytes_of,
    kept_less_of,
    net_of_backward_state,
    transient_bytes_of,
    weight_pass_bytes_of,
)
from autopar.cost_model.layer_times import (
    layer_rates_of,
    layer_times,
    optimizer_s,
    overheads_s,
    traffic_bytes,
    with_experts,
)
from autopar.cost_model.moe import (
    ep_collectives,
    ep_layer_state,
    ep_terms,
    experts_whole,
    unstated_imbalance,
)
from autopar.cost_model.offload import (
    host_copies,
    offload_state,
    pcie_link,
    run_offload,
)
from autopar.cost_model.overlap import overlapped_s
from autopar.cost_model.precision import dtype_reason, fp8_linears
from autopar.cost_model.table_cache import ProfileTerms, driven_cluster, profile_terms
from autopar.cost_model.tables import RECOMPUTE_INDEX, CostTable, LayerCost, with_schedule
from autopar.cost_model.tied_head import tied_sync_s, with_tied_sync
from autopar.cost_model.tp_comm import tp_collectives, tp_sharded
from autopar.graph.types import ModelProfile

__all__ = ["build_cost_table", "charged_collectives"]


def _ep_terms(profile, layer, cfg, cluster, shard: int, fw: Framework):
    return ep_terms(layer, cfg, cluster, seq_len=profile.seq_len, shard=shard,
                    force_balance=fw.moe_force_balance, dispatch=fw.ep_dispatch,
                    whole_sequence=moe_routes_whole_sequence(fw, cfg))


def _layer_cost(profile, cluster, cfg, index, groups, ratio, first_block, fw,
                attention_flops: float) -> tuple:
    layer, b = framework_layer(profile.layers[index], fw), cfg.micro_batch
    offload, shard = run_offload(cfg, fw), (cfg.tp if tp_sharded(layer) else 1)
    head_elems = profile.seq_len * profile.vocab if layer.kind == "head" else 0.0
    act = activation_bytes_of(profile, layer, cfg, ratio, shard, fw, head_elems)
    kept_less = kept_less_of(profile, layer, cfg, ratio, shard, fw, head_elems, act)
    ckpt = checkpoint_terms(fw, cfg, layer.kind == "block", act[2], groups["tp"], groups["pcie"])
    act = ckpt.activations(act)
    ep = _ep_terms(profile, layer, cfg, cluster, shard, fw)
    rec_flops = tuple(layer.recompute_flops.get(m, 0.0) for m in RECOMPUTE)
    attn_flops = attention_flops * b / shard  # the attention core, this rank's
    cp = cp_terms(profile, layer, cfg, shard, fw)
    act = tuple(a + x + k for a, x, k in zip(act, ep.extra_act_bytes, cp.saved_bytes))
    fp8, rates = layer_rates_of(cluster, cfg, fw, profile, layer, b / shard, attn_flops)
    passes_s, opt_fixed_s = overheads_s(profile, cluster, cfg, index, shard)
    held = params_tp(layer, cfg)  # after tp, and ep's routed-expert sharding
    traffic = traffic_bytes(cluster, cfg, fw, fp8, act[0], held)
    base = layer_times(cluster, cfg, layer, shard, rates, rec_flops, act[0], passes_s, traffic)
    times = with_experts(base, ep, cluster, cfg, layer, shard, fw)
    state, host_bytes = offload_state(ep_layer_state(layer, cfg, shard), cfg, held, offload)
    step_s, mb_s, tail_s = dp_terms(  # a framework that waits gives its DP traffic no window
        _unit_calls(profile, cfg, index, fw), groups,
        times.forward_s if fw.param_gather_overlapped else 0.0,
        times.backward_s if cfg.zero in fw.dp_reduce_overlap_stages else 0.0,
        cluster.dp_overlap_efficiency, fw.overlap_slowdown)
    transient = ckpt.transient(tuple(x + ep.buffer_bytes + k for x, k in zip(transient_bytes_of(
        layer, cfg, act, held, shard, ratio, fw, head_elems, profile.loss,
        root_share(profile, cfg, fw, index)), cp.transient_bytes)))
    cost = LayerCost(
        name=layer.name,
        num_params=layer.num_params,
        # Per whole sample: a rank's share of it (the local profile's) times cp.
        model_flops_per_sample=(layer.fwd_flops + layer.bwd_flops) * cfg.cp,
        recompute_flops_per_sample=tuple(x * cfg.cp for x in rec_flops),
        compute_s=times.forward_s + times.backward_s,
        backward_s=times.backward_s,
        recompute_s=ckpt.rerun(times.recompute_s),
        tp_comm_s=ckpt.tp_comm(_tp_comm_s(fw, cfg, tp_collectives(
            profile, layer, cfg, ratio, first_block=first_block, loss_parallel=fw.loss_parallel,
            moe_tp=moe_tp_mode(fw, cfg)), groups["tp"], times)),
        dp_microbatch_s=mb_s,
        act_bytes=_fragmented(net_of_backward_state(_less(act, kept_less), cfg,
                                                    state.local_params, held, fw), cluster, fw),
        transient_bytes=_fragmented(transient, cluster, fw),
        param_bytes=state.param_bytes,
        grad_bytes=grad_bytes_of(state, held, fw, cfg.dtype),
        optimizer_bytes=state.optimizer_bytes * fw.adam_moment_bytes / memory.ADAM_BYTES,
        dp_step_s=step_s,
        ep_comm_s=ep.comm_s,
        optimizer_s=optimizer_s(cluster, cfg, state.local_params, offload)
        + (opt_fixed_s if layer.num_params > 0 else 0.0),
        cp_comm_s=cp_exchange_s(profile, layer, cfg, cluster, groups, attn_flops, shard, fw,
                                base.floor_stretch),
        host_bytes=host_bytes + ckpt.host_bytes,
        unstated_imbalance_s=_unstated_imbalance_s(profile, layer, cfg, cluster, shard, fw,
                                                   base, (times, ep)),
    )
    return _with_weight_pass(cost, weight_pass_bytes_of(layer, cfg, ratio, shard), cluster,
                             fw), tail_s


def _less(values, less) -> tuple[float, float, float]:
    """Per recompute mode, ``values`` less ``less``."""
    return (values[0] - less[0], values[1] - less[1], values[2] - less[2])


def _with_weight_pass(cost: LayerCost, kept_freed, cluster: Cluster, fw: Framework) -> LayerCost:
    """``cost`` with its split-backward terms (``LayerCost.weight_pass_bytes``,
    ``input_pass_freed_bytes``), as churning memory."""
    kept, freed = kept_freed
    return dataclasses.replace(cost, weight_pass_bytes=_fragmented(kept, cluster, fw),
                               input_pass_freed_bytes=_fragmented(freed, cluster, fw))


def _unstated_imbalance_s(profile, layer, cfg: ParallelConfig, cluster: Cluster, shard: int,
                          fw: Framework, base, costed) -> tuple[float, float, float]:
    """Per micro-batch, by recompute mode: the busiest ep rank's seconds beyond a balanced
    router (``costed``: the layer's times and ep terms as charged, ``base``: its times before
    the routed excess), where the model states no router imbalance (LayerCost field)."""
    if cfg.ep <= 1 or not unstated_imbalance(layer.moe, fw.moe_force_balance):
        return (0.0, 0.0, 0.0)
    even = ep_terms(layer, cfg, cluster, seq_len=profile.seq_len, shard=shard,
                    force_balance=True, dispatch=fw.ep_dispatch,
                    whole_sequence=moe_routes_whole_sequence(fw, cfg))
    balanced = (with_experts(base, even, cluster, cfg, layer, shard, fw), even)
    a, b = (tuple(t.forward_s + t.backward_s + t.recompute_s[k] + terms.comm_s[k]
                  for k in range(3)) for t, terms in (costed, balanced))
    return (a[0] - b[0], a[1] - b[1], a[2] - b[2])


def _tp_comm_s(fw: Framework, cfg: ParallelConfig, tp_calls, link, times) -> tuple:
    """Exposed tensor-parallel seconds per micro-batch by recompute mode (a per-step
    collective counts 1/m per micro-batch)."""
    return tuple(_tp_exposed_s(fw, sum(c.time_s(link) / (
        cfg.num_microbatches if c.per == "step" else 1) for c in calls),
        times.forward_s + times.backward_s) for calls in tp_calls)


def _tp_exposed_s(fw: Framework, comm_s: float, gemm_window_s: float) -> float:
    """Tensor-parallel time a micro-batch waits for: all of it, or (a framework overlapping
    it with the layer's GEMMs) what the layer's compute cannot hide plus the slowdown."""
    return overlapped_s(comm_s, gemm_window_s, fw.overlap_slowdown) if (
        fw.tp_comm_overlapped) else comm_s


def _unit_calls(profile, cfg: ParallelConfig, index: int, fw: Framework):
    """The dp collectives of layer ``index``'s FSDP unit as ``fw`` issues them, and offload's
    host copies."""
    unit = fsdp_unit_params(profile, cfg, index)
    own = unit_collectives(profile.layers[index], cfg, unit)  # ep: experts on their own group
    fp8 = fp8_linears(cfg.dtype, profile.layers[index].kind)
    return framework_dp_collectives(own, cfg, fw, fp8_linears=fp8) + host_copies(
        cfg, own, unit, run_offload(cfg, fw))


def _fragmented(values: tuple[float, float, float], cluster: Cluster, fw: Framework):
    """Memory that churns over a step, with the caching allocator's unusable share
    (``Framework.fragmentation_fraction``). The CPU preset has no caching allocator (its
    reserve is 0: a CPU run's peak is its live tensor bytes), so nothing is added there."""
    if cluster.allocator_reserve_bytes <= 0:
        return values
    f = 1.0 + fw.fragmentation_fraction
    return values[0] * f, values[1] * f, values[2] * f


def build_cost_table(profile: ModelProfile, cluster: Cluster, config: ParallelConfig,
                     framework: str | Framework = DEFAULT_FRAMEWORK) -> CostTable:
    """The CostTable (what ``assemble`` and the search's ILP consume) of every per-layer cost
    term of ``config`` on ``cluster`` for ``profile`` (bytes at ``profile.dtype``, counts per
    sample) under ``framework`` (a name in ``FRAMEWORKS`` or a Framework record)."""
    cfg = config
    fw = model_framework(get_framework(framework), profile)
    cluster = driven_cluster(cluster, fw)  # framework_cluster, once per search
    whole, local, profile = costed_profiles(profile, cfg, fw)  # expert_tp.py
    # The attention core's FLOPs (what "selective" re-runs in the traced profile; a framework's
    # own selective policy replaces that entry per layer): the cp ring's window, fp8's split.
    terms = profile_terms(profile)
    ratio = DTYPE_BYTES[cfg.dtype] / DTYPE_BYTES[profile.dtype]
    groups = comm.parallel_groups(cluster, cfg)
    dp_efficiency = fw.dp_comm_efficiency * (fw.zero3_comm_efficiency if cfg.zero == 3 else 1.0)
    groups["edp"] = edp_link(cluster, cfg, whole=any(
        experts_whole(layer, cfg.tp) for layer in profile.layers))
    for axis in ("dp", "dp_replicate", "edp"):
        link = groups[axis]
        groups[axis] = dataclasses.replace(
            link, bandwidth_bytes_per_s=link.bandwidth_bytes_per_s * dp_efficiency)
    groups["cp_ring"] = cp_link(cluster, cfg)
    groups["pcie"] = pcie_link(cluster)
    layers, tails = _layer_costs(profile, cluster, cfg, groups, ratio, fw, terms)
    layers = with_tied_sync(layers, tied_sync_s(profile, cluster, cfg, fw.grad_reduce_bytes))
    if not fw.expert_tensor_parallel and profile is not local:
        layers = model_flops_once(layers, local, cfg.cp)
    p2p, recv_bytes = _pipeline_sends(terms.max_output_bytes, cfg, groups, ratio)
    return with_schedule(CostTable(
        config=cfg,
        layers=tuple(layers),
        p2p_s=p2p,
        dp_tail_s=max(tails) if cfg.data_ranks > 1 else 0.0,
        overlap_efficiency=cluster.dp_overlap_efficiency
        if cfg.zero in fw.dp_reduce_overlap_stages else 0.0,
        buffers_bytes=memory.buffers_bytes(cfg, cluster) + fsdp_root_bytes(profile, cfg, fw),
        capacity_bytes=cluster.usable_memory_bytes,
        peak_flops=cluster.device.peak_flops(base_dtype(cfg.dtype)),
        tokens_per_step=cfg.global_batch * whole.seq_len,
        recv_buffer_bytes=recv_bytes,
        framework=fw,
        dp_head_s=dp_head_s(profile, cfg, groups["dp"], fw) if cfg.data_ranks > 1 else 0.0,
        host_capacity_bytes=cluster.host_memory_bytes_per_gpu,
        dtype_reason=dtype_reason(cluster.device, cfg.dtype, fw.fp8_scaling, fw.dtypes),
        names=terms.names,
        blocks=tuple(layer.kind == "block" for layer in profile.layers),
    ), cfg)


def _layer_costs(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig, groups, ratio,
                 fw: Framework, terms: ProfileTerms) -> tuple[list[LayerCost], list[float]]:
    """Every layer's LayerCost and DP tail, in profile order."""
    count = len(profile.layers)
    layers: list = [None] * count
    tails = [0.0] * count
    first = terms.first_block
    for index, shared in terms.computed:
        # A repeated block shares its first occurrence's measurements, hence its costs (the
        # model's first block apart: with SP it cuts its input, one more collective).
        cost, tail = _layer_cost(profile, cluster, cfg, index, groups, ratio, index == first,
                                 fw, terms.attention_flops[index])
        if profile.layers[index].kind != "block":  # only blocks are ever recomputed
            cost = cost.never_recomputed()
        layers[index], tails[index] = cost, tail
        for k in shared:
            layers[k], tails[k] = cost, tail
    return layers, tails


def _pipeline_sends(max_output_bytes: float, cfg: ParallelConfig, groups, ratio
                    ) -> tuple[float, float]:
    """(p2p seconds per micro-batch, one stage-boundary tensor's bytes); zeros when pp == 1
    (``max_output_bytes``: the profile's largest layer output per sample)."""
    if cfg.pp <= 1:
        return 0.0, 0.0
    sp_div = cfg.tp if cfg.sequence_parallel else 1
    boundary = max_output_bytes * cfg.micro_batch * ratio
    recv_bytes = boundary / sp_div  # one stage input (or output gradient) on one rank
    # forward activation send + backward gradient send of one micro-batch
    return 2 * comm.p2p_s(groups["pp"], recv_bytes), recv_bytes


def charged_collectives(
    profile: ModelProfile,
    config: ParallelConfig,
    pp_rank: int = 0,
    *,
    split: tuple[tuple[int, int], ...] | None = None,
    recompute: tuple[str, ...] | None = None,
) -> dict[str, int]:
    """The collectives per step that this module's time terms charge one rank of ``pp_rank``.

    The same records (``tp_collectives``, ``dp_collectives``, context parallelism's
    ``cp_comm.gather_collectives``: autopar's runtime) that ``build_cost_table`` times,
    counted like ``collectives.expected_collectives`` (``"kind@axis"`` -> calls per step; DDP's
    buckets, which the runtime's counter cannot see, left out), so tests can hold the two equal.

    Args:
        profile: the model profile.
        config: the degrees, batch and schedule.
        pp_rank: the pipeline rank whose stages to count.
        split, recompute: a Plan's stage ranges and per-layer recompute; defaults as in
            ``collectives.stage_split``.
    """
    cfg, split, recompute = stage_split(profile, config, split, recompute)
    runtime = model_framework(get_framework(RUNTIME), profile)
    ratio = DTYPE_BYTES[cfg.dtype] / DTYPE_BYTES[profile.dtype]
    m, first = cfg.num_microbatches, first_block_index(profile)
    counts: Counter[str] = Counter()
    local = local_profile(profile, cfg.cp)
    for a, b in rank_stages(cfg, split, pp_rank):
        for i in range(a, b + 1):
            mode = RECOMPUTE_INDEX[recompute[i]]
            tp = tp_collectives(profile, profile.layers[i], cfg, ratio, first_block=i == first,
                                loss_parallel=runtime.loss_parallel,
                                moe_tp=moe_tp_mode(runtime, cfg))
            shard = cfg.tp if tp_sharded(local.layers[i]) else 1
            cp = gather_collectives(kv_bytes(local, local.layers[i], cfg, shard), cfg)
            ep = ep_collectives(local.layers[i], cfg, seq_len=local.seq_len,
                                whole_sequence=moe_routes_whole_sequence(runtime, cfg))
            calls = tp[mode] + cp[mode] + ep[mode] + unit_collectives(
                profile.layers[i], cfg, fsdp_unit_params(profile, cfg, i))
            for c in calls:
                if c.counted:
                    counts[f"{c.kind}@{c.axis}"] += round(c.calls) * (
                        m if c.per == "microbatch" else 1)
    return dict(sorted((k, v) for k, v in counts.items() if v))
