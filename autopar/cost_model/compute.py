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
    t_block  = max(t_gpu, floor)                           (GPU: the host's eager dispatch time)
    t_param  = param_traffic_bytes / hbm_bandwidth         (weight casts, gradient accumulation)

A fixed framework cost per layer and micro-batch (Python, operator dispatch, autograd, kernel
launches; DTensor dispatch under tensor parallelism, FSDP2 hooks; ``DeviceSpec``'s
``*_overhead_s``, measured by ``autopar calibrate``) is split like the elementwise traffic,
1/3 forward and 2/3 backward; a recompute re-runs the forward's share in proportion to the
forward FLOPs it repeats (all of it for full recompute).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_model.hardware import DeviceSpec

__all__ = [
    "ATTENTION_KERNELS",
    "FORWARD_SHARE",
    "MATMUL_BACKWARD_RATIO",
    "LayerCompute",
    "attention_ratio",
    "busy_speedup",
    "framework_overheads_s",
    "layer_compute",
    "matmul_efficiency",
    "param_traffic_bytes_per_param",
]

# The attention kernels a framework runs for a fused (SDPA) attention core: "fused" (cuDNN /
# FlashAttention-3 class, what the device's matmul curve stands for) or "flash2" (the
# FlashAttention-2 kernel of torch's SDPA flash backend).
ATTENTION_KERNELS = ("fused", "flash2")


def attention_ratio(device: DeviceSpec, kernel: str, attention: str) -> float:
    """Speed of a layer's attention core relative to the layer's matmul rate: the device's
    ``flash2_attention_ratio`` for ``kernel`` "flash2" on a fused (``attention`` "sdpa")
    core; 1 for the fused kernels and for eager attention (its score matmuls are matmuls)."""
    if kernel == "flash2" and attention == "sdpa":
        return device.flash2_attention_ratio
    return 1.0

# The forward pass's share of a layer's work: its matmul FLOPs (backward runs two matmuls per
# forward matmul: input and weight gradients) and its elementwise traffic (the gradient of every
# elementwise op reads the saved input and the output gradient and writes the input gradient).
# Sourced (Kaplan et al. 2020 / Narayanan et al. 2021's 2:1 backward-to-forward FLOPs); used for
# traffic, fixed overhead and dispatch floors alike, and by the pipeline timeline (plotting.py).
MATMUL_BACKWARD_RATIO = 2.0  # backward FLOPs of a matmul over its forward's (dX and dW)
FORWARD_SHARE = 1.0 / (1.0 + MATMUL_BACKWARD_RATIO)


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
        floor_stretch: (forward, backward) wall time over the kernels' own where the host's
            dispatch floor holds the layer up (1: it does not): each kernel's window, for
            what overlaps it (cp_comm.py), is stretched alike.
    """

    forward_s: float
    backward_s: float
    recompute_s: tuple[float, float, float]
    floor_stretch: tuple[float, float] = (1.0, 1.0)


def layer_compute(
    device: DeviceSpec,
    peak_flops: float,
    *,
    fwd_flops: float,
    bwd_flops: float,
    recompute_flops: tuple[float, float, float],
    elementwise_bytes: float,
    overhead_s: float = 0.0,
    speedup: float = 1.0,
    recompute_extra_s: float = 0.0,
    floor_s: float = 0.0,
    param_traffic_bytes: tuple[float, float] = (0.0, 0.0),
    selective_rate_ratio: float = 1.0,
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
        speedup: divides every time (``busy_speedup``: ranks sharing cores with idle ones).
        recompute_extra_s: checkpointing's own fixed cost of a full re-run, beyond the re-run
            forward share of ``overhead_s`` (selective pays its FLOP share of it).
        floor_s: the host's dispatch time of the layer's forward + backward (GPU): forward and
            backward each take at least their share (1/3, 2/3) of it.
        param_traffic_bytes: (forward, backward) memory traffic over the layer's parameters
            per micro-batch (mixed-precision weight casts, gradient accumulation), at HBM
            bandwidth (``param_traffic_bytes_per_param``).
        selective_rate_ratio: the selective re-run's FLOP rate over ``peak_flops``'s (it re-runs
            the attention core alone, at its kernel's speed, where ``peak_flops`` blends it
            with the linears: ``compute.attention_ratio``).

    Returns:
        forward, backward and per-mode recompute seconds.
    """
    rate = peak_flops * matmul_efficiency(device, fwd_flops)
    traffic_s = device.elementwise_traffic_factor * elementwise_bytes / device.hbm_bytes_per_s
    traffic_s += overhead_s  # elementwise traffic and overhead split alike over fwd and bwd
    fwd_traffic_s = FORWARD_SHARE * traffic_s
    fwd_mm = fwd_flops / rate if fwd_flops > 0 else 0.0
    recompute = _recompute_s(recompute_flops, fwd_flops, rate, fwd_traffic_s + recompute_extra_s,
                             selective_rate_ratio)
    bwd_mm = bwd_flops / rate if bwd_flops > 0 else 0.0
    own = (fwd_mm + fwd_traffic_s, bwd_mm + traffic_s - fwd_traffic_s)
    fwd_s, bwd_s = max(own[0], FORWARD_SHARE * floor_s), max(own[1], (1 - FORWARD_SHARE) * floor_s)
    stretch = (fwd_s / own[0] if own[0] > 0 else 1.0, bwd_s / own[1] if own[1] > 0 else 1.0)
    fwd_s += param_traffic_bytes[0] / device.hbm_bytes_per_s
    bwd_s += param_traffic_bytes[1] / device.hbm_bytes_per_s
    return LayerCompute(
        forward_s=fwd_s / speedup,
        backward_s=bwd_s / speedup,
        recompute_s=(recompute[0] / speedup, recompute[1] / speedup, recompute[2] / speedup),
        floor_stretch=stretch,
    )


def _recompute_s(recompute_flops: tuple[float, float, float], fwd_flops: float, rate: float,
                 rerun_fixed_s: float, selective_rate_ratio: float = 1.0) -> list[float]:
    """Seconds of each recompute mode's extra forward: its FLOPs at ``rate`` (the selective
    mode's at ``selective_rate_ratio`` of it) plus its FLOP share of the forward's fixed
    seconds (a full re-run repeats the elementwise forward traffic)."""
    out = []
    for mode, extra in enumerate(recompute_flops):
        if extra <= 0:
            out.append(0.0)
            continue
        share = min(1.0, extra / fwd_flops) if fwd_flops > 0 else 1.0
        mode_rate = rate * (selective_rate_ratio if mode == 1 else 1.0)
        out.append(extra / mode_rate + share * rerun_fixed_s)
    return out


def param_traffic_bytes_per_param(
    *, autocast: bool, casts_per_step: bool, num_microbatches: int
) -> tuple[float, float]:
    """(forward, backward) bytes moved per parameter per micro-batch besides the matmuls.

    What autopar's runtime does (autopar/runtime/step.py, apply.py):

    - autocast (16-bit training without FSDP2's mixed precision): the forward casts each fp32
      weight to 16 bits (read 4, write 2 = 6 bytes), once per micro-batch at pp == 1 (autocast
      is entered per micro-batch) and once per step under a pipeline schedule (one autocast
      region: ``casts_per_step``, 6 / m per micro-batch); the backward of that cast upcasts the
      16-bit weight gradient (read 2, write 4 = 6 bytes).
    - every micro-batch after a step's first adds its gradient into the fp32 ``.grad``
      (``AccumulateGrad``: read 4 + 4, write 4 = 12 bytes): 12 (m - 1) / m on average.

    Measured on one H200: llama2-7b at 16 micro-batches of 4,096 tokens ran 8% slower than its
    blocks alone predict, about these 23 bytes per parameter per micro-batch at 4.8 TB/s
    (benchmarks/results/h200/).
    """
    m = max(1, num_microbatches)
    forward = (6.0 / m if casts_per_step else 6.0) if autocast else 0.0
    backward = (6.0 if autocast else 0.0) + 12.0 * (m - 1) / m
    return forward, backward


def framework_overheads_s(
    device: DeviceSpec, *, block: bool, tp_modules: int, fsdp_unit: bool, dtensor_params: bool
) -> tuple[float, float]:
    """Fixed framework seconds of one layer: (forward + backward per micro-batch, optimizer
    per step), from the device's measured overheads (``DeviceSpec``'s ``*_overhead_s``).

        pass      = base + tp_modules * tp_module + fsdp_unit * fsdp_layer
        optimizer = (optimizer_layer + dtensor_params * dtensor_optimizer_layer) * base / layer

    with base = layer_overhead_s for a block, edge_layer_overhead_s for the embedding or head.

    Args:
        device: the device spec.
        block: whether the layer is a transformer block.
        tp_modules: the layer's tensor-parallel modules when tp > 1 (0 otherwise).
        fsdp_unit: whether the runtime wraps the layer as its own FSDP2 / replicate() unit.
        dtensor_params: whether the layer's parameters are DTensors (TP-sharded, FSDP2).
    """
    layer = device.layer_overhead_s
    base = layer if block else device.edge_layer_overhead_s
    passes = base + tp_modules * device.tp_module_overhead_s
    passes += device.fsdp_layer_overhead_s if fsdp_unit else 0.0
    opt = device.optimizer_layer_overhead_s
    opt += device.dtensor_optimizer_layer_overhead_s if dtensor_params else 0.0
    return passes, (opt * base / layer if layer > 0 else 0.0)


def busy_speedup(device: DeviceSpec, busy_fraction: float) -> float:
    """How much faster a process computes when only ``busy_fraction`` of the processes run.

    The device's throughputs are per process with all N running; with s =
    ``shared_compute_processes`` (N processes over N / s compute units) a process gets
    min(1, (N / s) / active) of a unit, so with active = N f the rate rises by

        speedup = min(1, 1 / (s f)) / (1 / s) = min(s, 1 / f)

    (1 on a GPU, where s = 1). Used for pipeline schedules, whose ranks idle in the bubble:
    f = m v / (m v + c p v) for uniform stages (c the bubble coefficient).
    """
    s = max(1.0, device.shared_compute_processes)
    if busy_fraction <= 0:
        return s
    return max(1.0, min(s, 1.0 / busy_fraction))
