"""Compute terms: FLOPs over achieved throughput, a roofline over FLOPs and bytes.

Units: FLOPs, bytes, seconds. For one layer and one micro-batch on one rank:

    w        = fwd_flops * b / shard                      (matmul work of the layer's forward)
    eff(w)   = eff_max * w / (w + w_half)                 (matmul efficiency, fitted once)
    t_mm(F)  = F / (peak(dtype) * eff(w))                 (F = forward, backward or recompute)
    t_elem   = traffic * act_bytes_none / hbm_bandwidth   (norms, activations, softmax, dropout)

``shard`` is tp for layers that tensor parallelism splits (their matrices shrink tp-fold, so w
and eff fall as tp rises) and 1 otherwise. ``eff`` rises with matrix size (more micro-batch,
wider layers) toward ``eff_max``; ``w_half`` is the work at which half of it is reached. This is
the Megatron-LM SC'21 observation (section 5.4: per-GPU throughput rises with micro-batch size;
section 5.5: smaller tensor-parallel matrices run less efficiently) in one saturating curve.
The elementwise traffic (forward 1/3, backward 2/3 of ``traffic * act_bytes``) is the memory-bound
half of the roofline; matmuls are compute bound at the sizes that matter.
Recomputation re-runs forward FLOPs: it adds hardware FLOPs and time, never model FLOPs.

    t_fixed  = overhead_s                                  (framework cost per layer, fwd + bwd)

A fixed framework cost per layer and micro-batch (Python, operator dispatch, autograd, kernel
launches; DTensor dispatch under tensor parallelism, FSDP2 hooks; ``DeviceSpec``'s
``*_overhead_s``, measured by ``autopar calibrate``) is split like the elementwise traffic,
1/3 forward and 2/3 backward; a recompute re-runs the forward's share in proportion to the
forward FLOPs it repeats (all of it for full recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.hardware import DeviceSpec

__all__ = ["LayerCompute", "layer_compute", "matmul_efficiency"]

# Share of a layer's elementwise traffic in the forward pass (backward touches ~2x: gradients of
# every elementwise op read the saved input and the output gradient and write the input gradient).
FORWARD_TRAFFIC_SHARE = 1.0 / 3.0


def matmul_efficiency(device: DeviceSpec, work_flops: float) -> float:
    """Fraction of peak a layer's matmuls reach: eff_max * w / (w + w_half)."""
    if work_flops <= 0:
        return device.matmul_efficiency_max
    return device.matmul_efficiency_max * work_flops / (work_flops + device.matmul_half_flops)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCompute:
    """Compute times of one layer for one micro-batch on one rank, in seconds.

    Attributes:
        forward_s: forward matmuls plus forward elementwise traffic.
        backward_s: backward matmuls plus backward elementwise traffic.
        recompute_s: re-run forward time by recompute mode (none, selective, full).
    """

    forward_s: float
    backward_s: float
    recompute_s: tuple[float, float, float]


def layer_compute(
    device: DeviceSpec,
    peak_flops: float,
    *,
    fwd_flops: float,
    bwd_flops: float,
    recompute_flops: tuple[float, float, float],
    elementwise_bytes: float,
    overhead_s: float = 0.0,
) -> LayerCompute:
    """Times of one layer, micro-batch and rank (FLOPs and bytes already per rank).

    Args:
        device: the device spec (efficiency parameters, HBM bandwidth).
        peak_flops: peak FLOP/s at the training dtype.
        fwd_flops: forward FLOPs of the micro-batch on this rank.
        bwd_flops: backward FLOPs of the micro-batch on this rank.
        recompute_flops: extra forward FLOPs by recompute mode (none, selective, full).
        elementwise_bytes: bytes the layer saves for backward without recompute (this rank);
            the elementwise traffic is ``elementwise_traffic_factor`` times this.
        overhead_s: fixed framework seconds of the layer's forward + backward (1/3, 2/3).

    Returns:
        forward, backward and per-mode recompute seconds.
    """
    rate = peak_flops * matmul_efficiency(device, fwd_flops)
    traffic_s = device.elementwise_traffic_factor * elementwise_bytes / device.hbm_bytes_per_s
    # Elementwise traffic and framework overhead split alike between forward and backward.
    traffic_s += overhead_s
    fwd_traffic_s = FORWARD_TRAFFIC_SHARE * traffic_s
    fwd_mm = fwd_flops / rate if fwd_flops > 0 else 0.0
    recompute = []
    for extra in recompute_flops:
        if extra <= 0:
            recompute.append(0.0)
            continue
        # A full re-run also repeats the elementwise forward traffic in proportion to its FLOPs.
        share = min(1.0, extra / fwd_flops) if fwd_flops > 0 else 1.0
        recompute.append(extra / rate + share * fwd_traffic_s)
    return LayerCompute(
        forward_s=fwd_mm + fwd_traffic_s,
        backward_s=(bwd_flops / rate if bwd_flops > 0 else 0.0) + traffic_s - fwd_traffic_s,
        recompute_s=(recompute[0], recompute[1], recompute[2]),
    )
