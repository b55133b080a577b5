"""One layer's seconds per micro-batch on one rank: forward, backward and recompute compute
(``compute.layer_compute`` at the rate ``precision.layer_rates`` gives its FLOPs), the bytes its
parameters and fp8 casts move, the routed experts' excess, the framework's fixed overheads, and
its optimizer step. ``layer_costs`` assembles them with the memory and communication terms.
"""

from __future__ import annotations

import dataclasses

from autopar.config import ParallelConfig, dp_mechanism, uses_autocast
from autopar.cost_model import memory
from autopar.cost_model.compute import (
    FORWARD_SHARE,
    attention_ratio,
    busy_speedup,
    framework_overheads_s,
    layer_compute,
    matmul_efficiency,
    param_traffic_bytes_per_param,
)
from autopar.cost_model.dp_comm import fsdp_unit_params
from autopar.cost_model.frameworks import Framework
from autopar.cost_model.hardware import Cluster
from autopar.cost_model.moe import expert_call_flops
from autopar.cost_model.offload import cpu_adam_s
from autopar.cost_model.pipeline import bubble_coefficient
from autopar.cost_model.precision import fp8_cast_bytes, fp8_linears, layer_rates
from autopar.cost_model.tp_comm import tp_modules
from autopar.graph.types import ModelProfile

__all__ = ["OPTIMIZER_TRAFFIC_BYTES_PER_PARAM", "fp8_casts", "layer_rates_of", "layer_times",
           "optimizer_s", "overheads_s", "param_traffic_bytes", "pipeline_speedup",
           "traffic_bytes", "with_experts"]

# Sourced: torch's foreach AdamW touches its fp32 param, grad, exp_avg, exp_avg_sq in about eight
# elementwise kernels of two tensors each: ~16 x 4 bytes per parameter per step (memory bound).
OPTIMIZER_TRAFFIC_BYTES_PER_PARAM = 64


def pipeline_speedup(cluster: Cluster, cfg: ParallelConfig) -> float:
    """Compute speed-up of a pipeline's ranks from sharing compute units with idle neighbours
    (``compute.busy_speedup``; busy fraction of uniform stages m v / (m v + c p v))."""
    if cfg.pp <= 1:
        return 1.0
    busy = cfg.num_microbatches * cfg.virtual_stages
    c = bubble_coefficient(cfg.schedule, cfg.pp, cfg.virtual_stages, cfg.num_microbatches)
    bubble = c * cfg.num_stages
    return busy_speedup(cluster.device, busy / (busy + bubble))


def param_traffic_bytes(cfg: ParallelConfig, params_tp: float) -> tuple[float, float]:
    """(forward, backward) bytes over a layer's parameters per micro-batch (weight casts under
    autocast, gradient accumulation; ``compute.param_traffic_bytes_per_param``)."""
    fwd, bwd = param_traffic_bytes_per_param(
        autocast=uses_autocast(cfg), casts_per_step=cfg.pp > 1,
        num_microbatches=cfg.num_microbatches)
    # FSDP2 accumulates unsharded gradients only where memory.fsdp_accumulates_grads says so;
    # otherwise each micro-batch's gradient is reduce-scattered and accumulated sharded.
    if dp_mechanism(cfg) == "fsdp" and not memory.fsdp_accumulates_grads(cfg):
        return fwd * params_tp, bwd * params_tp / cfg.shard_ranks
    return fwd * params_tp, bwd * params_tp


def traffic_bytes(cluster: Cluster, cfg: ParallelConfig, fw: Framework, fp8: bool,
                   act_bytes: float, held: float) -> tuple[float, float]:
    """(forward, backward) bytes a layer's parameters and fp8 casts move per micro-batch."""
    (fwd, bwd), (cast_f, cast_b) = (param_traffic_bytes(cfg, held),
                                    fp8_casts(fp8, fw, act_bytes, held, cfg))
    return cluster.param_traffic_factor * fwd + cast_f, cluster.param_traffic_factor * bwd + cast_b


def layer_times(cluster: Cluster, cfg: ParallelConfig, layer, shard: int,
                 rates: tuple[float, float], rec_flops, elementwise_bytes: float,
                 passes_s: float, param_traffic):
    """Forward, backward and recompute seconds of one micro-batch on one rank (``rates``: the
    layer's peak FLOP rate and its selective re-run's share of it, ``layer_rates``)."""
    b = cfg.micro_batch
    return layer_compute(
        cluster.device,
        rates[0],
        fwd_flops=layer.fwd_flops * b / shard,
        bwd_flops=layer.bwd_flops * b / shard,
        recompute_flops=tuple(f * b / shard for f in rec_flops),
        elementwise_bytes=elementwise_bytes,
        overhead_s=passes_s,
        speedup=pipeline_speedup(cluster, cfg),
        # Checkpointing's measured cost of a re-run block beyond the forward share charged.
        recompute_extra_s=max(0.0, cluster.device.recompute_layer_overhead_s
                              - cluster.device.layer_overhead_s * FORWARD_SHARE)
        if layer.kind == "block" else 0.0,
        floor_s=cluster.device.dispatch_floor_s if layer.kind == "block" else 0.0,
        param_traffic_bytes=param_traffic,
        selective_rate_ratio=rates[1],
    )


def overheads_s(profile: ModelProfile, cluster: Cluster, cfg: ParallelConfig, index: int,
                 shard: int) -> tuple[float, float]:
    """The framework's fixed seconds of the layer's passes and of its optimizer step."""
    layer = profile.layers[index]
    kind = dp_mechanism(cfg)
    fsdp_unit = kind in ("fsdp", "replicate") and fsdp_unit_params(profile, cfg, index) > 0
    return framework_overheads_s(
        cluster.device, block=layer.kind == "block", tp_modules=tp_modules(layer, cfg),
        fsdp_unit=fsdp_unit,
        dtensor_params=kind in ("fsdp", "replicate") or (shard > 1 and layer.num_params > 0),
    )


def with_experts(times, ep, cluster: Cluster, cfg: ParallelConfig, layer, shard: int,
                  fw: Framework):
    """The busiest ep rank's extra routed-expert FLOPs (cost_model/moe.py), at the rate the
    layer's own matmuls run, and the fixed cost of looped experts' GEMM calls
    (``moe.expert_call_flops``), at the max rate: forward, backward (twice the calls), and the
    re-run forward of full recompute."""
    fixed = expert_call_flops(layer, cfg, fw.expert_gemm_calls, cluster.device.matmul_half_flops)
    if not ep.extra_fwd_flops and not fixed:
        return times
    fwd_flops = layer.fwd_flops * cfg.micro_batch / shard
    peak = cluster.device.peak_flops(cfg.dtype) * pipeline_speedup(cluster, cfg)
    rate = peak * matmul_efficiency(cluster.device, fwd_flops)
    fixed_s = fixed / (peak * cluster.device.matmul_efficiency_max)
    fwd_s, bwd_s = ep.extra_fwd_flops / rate + fixed_s, ep.extra_bwd_flops / rate + 2 * fixed_s
    rec = times.recompute_s
    return dataclasses.replace(times, forward_s=times.forward_s + fwd_s,
                               backward_s=times.backward_s + bwd_s,
                               recompute_s=(rec[0], rec[1], rec[2] + fwd_s))


def layer_rates_of(cluster: Cluster, cfg: ParallelConfig, fw: Framework, profile: ModelProfile,
                   layer, scale: float, attn_flops: float) -> tuple[bool, tuple[float, float]]:
    """(fp8 linears?, precision.layer_rates of the layer's FLOPs (``scale`` times its
    per-sample ones, ``attn_flops`` of them its attention core) at its kernel's speed)."""
    fp8 = fp8_linears(cfg.dtype, layer.kind)
    return fp8, layer_rates(
        cluster.device, cfg.dtype, layer.fwd_flops * scale, attn_flops, fp8_linears=fp8,
        attention_ratio=attention_ratio(cluster.device, fw.attention_kernel, profile.attention),
        selective_attention_only=fw.selective_policy == "attention")


def optimizer_s(cluster: Cluster, cfg: ParallelConfig, local_params: float,
                 offload: str) -> float:
    """The optimizer step over ``local_params``: AdamW's HBM traffic on the device, or the
    offloaded CPU step (offload.cpu_adam_s; ``offload``: what the framework runs)."""
    if offload != "none":
        return cpu_adam_s(cluster, cfg, local_params, offload)
    return OPTIMIZER_TRAFFIC_BYTES_PER_PARAM * local_params / cluster.device.hbm_bytes_per_s


def fp8_casts(fp8: bool, fw: Framework, act_bytes: float, held: float,
               cfg: ParallelConfig) -> tuple[float, float]:
    """(forward, backward) bytes of the fp8 casts under the framework's scaling recipe."""
    if not fp8:
        return 0.0, 0.0
    return fp8_cast_bytes(fw.fp8_scaling, act_bytes, held, cfg.num_microbatches)
